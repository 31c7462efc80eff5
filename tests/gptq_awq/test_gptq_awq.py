"""GPTQ / AWQ / AutoRound backends against auto-round 0.16.1's own exports (tests/data/vendor),
g_idx act-order decoded element by element, exclusion lists, config errors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import quantplug
import torch
from conftest import VENDOR, hf_logits, load_logits, rel_err
from quantplug.errors import ConfigError, PlanError
from quantplug.loader import model_bytes
from quantplug.plan import build_plan
from safetensors.torch import load_file, save_file

pytest.importorskip("quantplug_gptq_awq")

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_generate import check_cached_equals_recompute  # noqa: E402

FIXTURES = {  # fixture: (backend, what it is)
    "gptq_autoround_dsv3": ("gptq", "auto_gptq asym g128, g_idx, dynamic excludes"),
    "awq_autoround_dsv3": ("awq", "auto_awq asym g64, modules_to_not_convert"),
    "autoround_awq_dsv3": ("awq", "auto-round, auto_round:auto_awq asym g32, extra_config"),
    "autoround_gptq_dsv3": ("gptq", "auto-round, auto_round:auto_gptq sym g32, extra_config"),
}
REF = {n: load_file(str(VENDOR / f"{n}.reference.safetensors")) for n in FIXTURES}


def _copy(src: Path, dst: Path, edit_qc=None, edit_state=None) -> Path:
    shutil.copytree(src, dst)
    if edit_qc:
        cfg = json.loads((dst / "config.json").read_text())
        edit_qc(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_state:
        save_file(edit_state(load_file(str(dst / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("name", list(FIXTURES))
def test_matches_auto_round_dequantizer(name):
    ref = REF[name]
    model, out = load_logits(VENDOR / name, ref["input_ids"], progress=False)
    assert model.quantplug_plan.backend == FIXTURES[name][0]
    assert rel_err(out, ref["vendor_logits"]) <= 1e-5  # observed 6.7e-7 .. 8.2e-7
    assert rel_err(out, ref["dense_logits"]) > 1e-1
    schemes = model.quantplug_plan.schemes()
    # auto-round leaves kv_a_proj_with_mqa in bf16 (80 rows): the mixed checkpoint plans cleanly
    assert schemes["model.layers.1.self_attn.kv_a_proj_with_mqa"] == "dense"
    assert schemes["model.layers.1.mlp.experts.down_proj"].startswith(FIXTURES[name][0])
    assert not model.quantplug_plan.problems


@pytest.mark.parametrize("name", list(FIXTURES))
def test_words_are_repacked_once_into_the_int4_form_without_a_second_copy(name):
    """At load the int32 words become the core's INT4 form (rows = outputs, two inputs a byte),
    scales [out, G] as stored (F16), integer zero points as int8 (none when symmetric); the stored
    tensors are released (the model holds no more than its file), and every weight the form
    describes is the one the stored words dequantize to (auto-round's arithmetic), bit for bit."""
    from quantplug.kernels.reference import reference_dequantize
    from quantplug_gptq_awq import kernels as ik

    model = quantplug.load(VENDOR / name, dtype=torch.bfloat16, progress=False)
    lin = model.model.layers[0].mlp.down_proj
    assert "qweight" not in lin._parameters and "qzeros" not in lin._parameters and "scales" not in lin._parameters
    assert lin._codes.dtype == torch.uint8 and lin._codes.shape == (256, 256)  # [out, in / 2]
    assert lin._scales.dtype == torch.float16 and lin.scheme.weight_only
    sym = name == "autoround_gptq_dsv3"
    assert (lin._zeros is None) if sym else (lin._zeros.dtype == torch.int8)
    assert model_bytes(model) <= 1.05 * model.quantplug_plan.weight_bytes()
    st = load_file(str(VENDOR / name / "model.safetensors"))
    for mod in model.modules():
        b = getattr(mod, "qp_native", None)
        if b is None or not hasattr(mod, "_codes"):
            continue
        slots = [None] if b.slots is None else range(b.slots)
        for slot in slots:
            ckpt = mod.qp_ckpt
            if slot is not None:  # routed experts: model.layers.N.mlp.experts.<slot>.<proj>
                base, proj = mod.qp_ckpt.rsplit(".", 1)
                ckpt = f"{base}.{slot}.{proj}"
            scheme = mod.scheme
            qw, qz, s = st[f"{ckpt}.qweight"], st[f"{ckpt}.qzeros"], st[f"{ckpt}.scales"]
            out_f = s.shape[-1]
            group = scheme.quant.group_size if scheme.quant.group_size > 0 else mod.in_features
            want = ik.dequantize_rows_f32(scheme.pack, 4, qw, ik.zeros_f32(scheme.pack, qz, 4, out_f), s, group, None,
                                          0, out_f)
            got = reference_dequantize(b.weights, b.n, b.k, slot)
            assert torch.equal(got, want), ckpt


def test_act_order_layers_keep_their_words_and_the_torch_path(tmp_path):
    """A g_idx that permutes groups has no compute form: those layers are not repacked and not
    bound (the scheme's torch path gathers per input); plain-order layers of the same file are."""
    path = _copy(VENDOR / "gptq_autoround_dsv3", tmp_path / "ao", edit_qc=lambda q: q.update(desc_act=True),
                 edit_state=_act_order)
    model = quantplug.load(path, progress=False)
    up = model.model.layers[0].mlp.up_proj
    assert up.qweight.dtype == torch.int32 and up.qp_native is None and up.scheme.form(up) is None
    assert "torch path" in up.scheme.describe()


@pytest.mark.parametrize("name", ["gptq_autoround_dsv3", "autoround_awq_dsv3"])
def test_cached_generate_equals_recompute(name):
    model = quantplug.load(VENDOR / name, progress=False)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    check_cached_equals_recompute(model, ids, steps=4)


# -- act-order (g_idx) ----------------------------------------------------------------------------

def _decode_gptq(st: dict, module: str, zero_offset: int = 1) -> torch.Tensor:
    """Independent numpy decoder: W[j, k] = (q[k, j] - (z[g, j] + 1)) * s[g, j], g = g_idx[k]."""
    qw = st[f"{module}.qweight"].numpy().view(np.uint32)
    qz = st[f"{module}.qzeros"].numpy().view(np.uint32)
    s = st[f"{module}.scales"].float().numpy()
    g_idx = st[f"{module}.g_idx"].numpy()
    in_f, out_f = qw.shape[0] * 8, qw.shape[1]
    q = np.stack([(qw >> (4 * i)) & 15 for i in range(8)], 1).reshape(in_f, out_f).astype(np.float32)
    z = np.stack([(qz >> (4 * i)) & 15 for i in range(8)], -1).reshape(qz.shape[0], out_f).astype(np.float32)
    w = (q - (z[g_idx] + zero_offset)) * s[g_idx]
    return torch.from_numpy(np.ascontiguousarray(w.T))


def _act_order(st: dict) -> dict:
    """Every quantized module's g_idx replaced by a random assignment of inputs to its groups (an
    act-order checkpoint: GPTQ with desc_act stores such a g_idx)."""
    g = torch.Generator().manual_seed(5)
    out = dict(st)
    for k in st:
        if k.endswith(".g_idx"):
            groups = st[k[: -len("g_idx")] + "scales"].shape[0]
            out[k] = torch.randint(0, groups, st[k].shape, generator=g).to(torch.int32)
    return out


def test_act_order_g_idx_matches_an_independent_decoder(tmp_path):
    src = VENDOR / "gptq_autoround_dsv3"
    path = _copy(src, tmp_path / "ao", edit_qc=lambda q: q.update(desc_act=True), edit_state=_act_order)
    st = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    dense = {}
    for k, v in st.items():
        if k.endswith(".qweight"):
            m = k[: -len(".qweight")]
            dense[f"{m}.weight"] = _decode_gptq(st, m)
        elif not k.endswith((".qzeros", ".scales", ".g_idx")):
            dense[k] = v.float()
    ref = REF["gptq_autoround_dsv3"]
    model, out = load_logits(path, ref["input_ids"], progress=False)
    assert "act-order g_idx" in model.model.layers[0].mlp.up_proj.scheme.describe()
    want = hf_logits({k: v for k, v in cfg.items() if k != "quantization_config"}, dense, ref["input_ids"])
    assert rel_err(out, want) <= 1e-5
    assert rel_err(out, ref["vendor_logits"]) > 1e-2  # the permutation matters
    par = quantplug.plan(path, world_size=2).parallel  # act-order row-parallel layers replicate, with the reason
    down = next(d for d in par.decisions if d.target == "model.layers.0.mlp.down_proj")
    assert down.value == "replicated" and "act-order" in down.reason


def test_g_idx_out_of_range_is_a_load_error(tmp_path):
    def bad(st):
        st = dict(st)
        st["model.layers.0.mlp.up_proj.g_idx"] = torch.full_like(st["model.layers.0.mlp.up_proj.g_idx"], 9)
        return st

    path = _copy(VENDOR / "gptq_autoround_dsv3", tmp_path / "bad", edit_state=bad)
    with pytest.raises(quantplug.errors.LoadError, match=r"model.layers.0.mlp.up_proj.g_idx holds groups outside"):
        quantplug.load(path, progress=False)


# -- exclusion lists and configs ------------------------------------------------------------------

def test_awq_vllm_fused_name_excluding_quantized_modules_is_refused(tmp_path):
    """modules_to_not_convert written with vLLM's fused name: it names gate_proj / up_proj, which
    are stored quantized: a plan error naming the entry and the tensors."""
    path = _copy(VENDOR / "awq_autoround_dsv3", tmp_path / "a",
                 edit_qc=lambda q: q["modules_to_not_convert"].append("model.layers.0.mlp.gate_up_proj"))
    with pytest.raises(PlanError) as err:
        quantplug.plan(path)
    msg = str(err.value)
    assert "entry 'model.layers.0.mlp.gate_up_proj' excludes model.layers.0.mlp.gate_proj" in msg
    assert "model.layers.0.mlp.gate_proj.qweight" in msg


def test_gptq_dynamic_exclusion_matching_nothing_is_a_warning(tmp_path):
    path = _copy(VENDOR / "gptq_autoround_dsv3", tmp_path / "g",
                 edit_qc=lambda q: q["dynamic"].update({"-:.*vision_tower.*": {}}))
    plan = build_plan(path)
    assert any("'re:.*vision_tower.*' matches no module" in p.message and p.severity == "warning"
               for p in plan.problems)


def test_autoround_extra_config_exact_name_matching_nothing_is_an_error(tmp_path):
    def edit(q):
        q["extra_config"]["model.layers.1.self_attn.kv_a_proj_with_mq"] = {"bits": 16, "data_type": "fp"}

    path = _copy(VENDOR / "autoround_gptq_dsv3", tmp_path / "r", edit_qc=edit)
    with pytest.raises(PlanError, match=r"'model.layers.1.self_attn.kv_a_proj_with_mq' matches no module of this "
                                        r"checkpoint; did you mean 'model.layers.1.self_attn.kv_a_proj_with_mqa'\?"):
        quantplug.plan(path)


def test_missing_exclusion_loads_the_float_layer_with_a_warning(tmp_path):
    """Without auto-round's extra_config entry for kv_a_proj_with_mqa, the bf16 layer still loads
    as stored, and the plan says the config would have quantized it."""
    def edit(q):
        del q["extra_config"]["model.layers.1.self_attn.kv_a_proj_with_mqa"]

    plan = build_plan(_copy(VENDOR / "autoround_awq_dsv3", tmp_path / "r", edit_qc=edit))
    assert plan.schemes()["model.layers.1.self_attn.kv_a_proj_with_mqa"] == "dense"
    assert [p.layer for p in plan.problems if p.kind == "awq-name-float"] == ["model.layers.1.self_attn.kv_a_proj_with_mqa"]


@pytest.mark.parametrize("edit, match", [
    (lambda q: q.update(version="gemv"), "only AWQ GEMM checkpoints"),
    (lambda q: q.update(bits=3), "supported bit widths: 4, 8"),
])
def test_config_errors(tmp_path, edit, match):
    with pytest.raises(ConfigError, match=match):
        build_plan(_copy(VENDOR / "awq_autoround_dsv3", tmp_path / "c", edit_qc=edit))


def test_autoround_override_of_group_size_is_honoured(tmp_path):
    """An extra_config override (bits / group_size per layer) changes the scheme of that layer."""
    def edit(q):
        q["extra_config"]["model.layers.0.mlp.down_proj"] = {"bits": 4, "group_size": 64}

    plan = build_plan(_copy(VENDOR / "autoround_gptq_dsv3", tmp_path / "o", edit_qc=edit))
    assert "group 64" in plan.schemes()["model.layers.0.mlp.down_proj"]
    # the stored scales are per 32: a shape problem, not a silent misread
    assert any("model.layers.0.mlp.down_proj.scales" in p.describe() for p in plan.errors)
