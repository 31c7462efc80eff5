"""ModelOpt backend against nvidia-modelopt 0.47's own exports (tests/data/vendor: NVFP4 and
MIXED_PRECISION), its numerics decoded independently, config variants, exclusion lists."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import quantplug
import torch
from conftest import VENDOR, load_logits, rel_err
from quantplug.errors import ConfigError, PlanError
from quantplug.loader import model_bytes
from quantplug.plan import build_plan
from quantplug.testing import random_state, tiny_config, write_checkpoint
from safetensors.torch import load_file, save_file

pytest.importorskip("quantplug_modelopt")
from quantplug_modelopt import kernels  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_generate import check_cached_equals_recompute  # noqa: E402

NVFP4 = VENDOR / "modelopt_nvfp4_dsv3"
MIXED = VENDOR / "modelopt_mixed_dsv3"
REF = {p: load_file(str(p) + ".reference.safetensors") for p in (NVFP4, MIXED)}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _variant(src: Path, dst: Path, edit_quant=None, edit_config=None, drop_sidecar=False, edit_state=None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    side = json.loads((src / "hf_quant_config.json").read_text())
    if edit_quant:
        edit_quant(side["quantization"])
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    if not drop_sidecar:
        (dst / "hf_quant_config.json").write_text(json.dumps(side))
    if edit_state is None:
        shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    else:
        save_file(edit_state(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


# -- vendor fixtures ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [NVFP4, MIXED], ids=["nvfp4", "mixed"])
def test_weight_only_matches_modelopt_dequantizer(path):
    ref = REF[path]
    model, out = load_logits(path, ref["input_ids"], options={"activation_quant": "none"}, progress=False)
    assert model.quantplug_plan.backend == "modelopt"
    assert rel_err(out, ref["vendor_logits"]) <= 1e-5  # observed 6.3e-7 / 8.0e-7
    assert rel_err(out, ref["dense_logits"]) > 1e-1  # it really is the quantized model


@pytest.mark.parametrize("path", [NVFP4, MIXED], ids=["nvfp4", "mixed"])
def test_activation_emulation_matches_modelopt_qtensor_steps(path):
    ref = REF[path]
    model, out = load_logits(path, ref["input_ids"], progress=False)
    # the same float32 steps as ModelOpt's NVFP4QTensor / FP8QTensor: observed 0.0
    assert rel_err(out, ref["vendor_logits_actquant"]) <= 1e-5
    assert rel_err(out, ref["vendor_logits"]) > 1e-2  # emulation changes the logits


def test_weights_stay_packed_and_memory_matches_the_checkpoint():
    model = quantplug.load(NVFP4, dtype=torch.bfloat16, progress=False)
    lin = model.model.layers[0].self_attn.q_b_proj
    assert lin.weight.dtype == torch.uint8 and lin.weight.shape == (192, 64)
    assert lin.weight_scale.dtype == torch.float8_e4m3fn and lin.weight_scale.shape == (192, 8)
    assert lin.weight_scale_2.dtype == torch.float32 and lin.input_scale.dtype == torch.float32
    experts = model.model.layers[1].mlp.experts.gate_proj
    assert experts.weight.shape == (8, 128, 128) and experts.weight_scale_2.shape == (8,)
    assert model_bytes(model) <= 1.05 * model.quantplug_plan.weight_bytes()
    assert not lin.scheme.weight_only and "emulated" in lin.scheme.describe()


def test_mixed_precision_schemes_follow_quantized_layers():
    plan = build_plan(MIXED)
    schemes = plan.schemes()
    assert schemes["model.layers.1.self_attn.q_a_proj"].startswith("fp8 e4m3 per tensor")
    assert schemes["model.layers.1.self_attn.kv_b_proj"] == "dense"  # not listed: left bf16 by ModelOpt
    assert schemes["model.layers.1.mlp.experts.gate_proj"].startswith("nvfp4")
    assert schemes["model.layers.0.mlp.down_proj"].startswith("nvfp4")
    assert schemes["lm_head"] == "dense"
    why = [d.describe() for d in plan.decisions_for("model.layers.1.self_attn") if "kv_b_proj" in d.describe()]
    assert any("not listed in hf_quant_config.json quantization.quantized_layers" in w for w in why)


def _decode_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Independent per-element decoder: low nibble = even column, sign bit 3, e4m3 scale per 16."""
    p = packed.numpy()
    rows, half = p.shape
    out = torch.empty(rows, half * 2, dtype=torch.float64)
    s = scale.to(torch.float64) * float(scale_2)
    for r in range(rows):
        for b in range(half):
            for j, code in enumerate((int(p[r, b]) & 0xF, int(p[r, b]) >> 4)):
                v = E2M1[code & 7] * (-1 if code & 8 else 1)
                out[r, 2 * b + j] = v * s[r, (2 * b + j) // 16]
    return out


def test_dequantize_equals_an_independent_decoder():
    st = load_file(str(NVFP4 / "model.safetensors"))
    m = "model.layers.1.mlp.experts.5.down_proj"
    w = kernels.dequantize_nvfp4(st[m + ".weight"], st[m + ".weight_scale"], st[m + ".weight_scale_2"])
    want = _decode_nvfp4(st[m + ".weight"][:8], st[m + ".weight_scale"][:8], st[m + ".weight_scale_2"])
    assert torch.allclose(w[:8].double(), want, rtol=1e-7, atol=0)  # float32 steps vs float64


def test_nvfp4_activation_rounding_is_nearest_even_and_saturates():
    gs = torch.tensor(1.0 / (6 * 448))
    x = torch.zeros(1, 16)
    # one group whose amax is 6 * 448 * gs: block scale 448 (e4m3 max), b = 1 / 6 ... values on the grid
    x[0, 0] = 1.0
    b = float((1.0 / (6 * gs)).to(torch.float8_e4m3fn).float() * gs)
    x[0, 1:6] = torch.tensor([0.25, 0.75, 1.75, 3.5, 5.0]) * b  # ties -> even codes 0, 1, 2, 4, 4
    y = kernels.nvfp4_act(x, gs)
    assert y[0, 1:6].div(b).tolist() == [0.0, 1.0, 2.0, 4.0, 4.0]
    assert kernels.e2m1_round(torch.tensor([7.0, -9.0, 0.3])).tolist() == [6.0, -6.0, 0.5]


@pytest.mark.parametrize("path", [NVFP4, MIXED], ids=["nvfp4", "mixed"])
def test_cached_generate_equals_recompute(path):
    model = quantplug.load(path, options={"activation_quant": "none"}, progress=False)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    check_cached_equals_recompute(model, ids, steps=4)


def test_cached_generate_with_activation_emulation():
    """A decode token's activations are quantized per token and 16-group, as in the batched
    recompute; only float summation order differs (observed max rel 0.0 on this fixture)."""
    model = quantplug.load(NVFP4, progress=False)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    check_cached_equals_recompute(model, ids, steps=4, tol=1e-3)


# -- config variants -------------------------------------------------------------------------------

def test_config_json_alone_is_enough(tmp_path):
    """Without hf_quant_config.json: config.json quantization_config (quant_method modelopt, ignore)."""
    path = _variant(NVFP4, tmp_path / "c", drop_sidecar=True)
    ref = REF[NVFP4]
    _, out = load_logits(path, ref["input_ids"], progress=False)
    assert rel_err(out, ref["vendor_logits_actquant"]) <= 1e-5


def test_sidecar_and_config_disagreeing_is_an_error(tmp_path):
    path = _variant(NVFP4, tmp_path / "c", edit_quant=lambda q: q.update(quant_algo="FP8"))
    with pytest.raises(ConfigError, match="quant_algo 'FP8' and config.json quantization_config.quant_algo 'NVFP4'"):
        build_plan(path)


def test_unsupported_algorithm_is_refused_at_plan_time(tmp_path):
    def algo(cfg):
        cfg["quantization_config"]["quant_algo"] = "W4A8_AWQ"

    path = _variant(NVFP4, tmp_path / "c", edit_quant=lambda q: q.update(quant_algo="W4A8_AWQ"), edit_config=algo)
    with pytest.raises(PlanError, match="W4A8_AWQ is not supported by quantplug-modelopt"):
        quantplug.plan(path)


def test_kv_cache_algorithm_is_a_warning(tmp_path):
    path = _variant(NVFP4, tmp_path / "c", edit_quant=lambda q: q.update(kv_cache_quant_algo="FP8"))
    plan = build_plan(path)
    assert any("kv_cache_quant_algo 'FP8'" in p.message and p.severity == "warning" for p in plan.problems)


# -- exclusion lists -------------------------------------------------------------------------------

def test_exclude_name_matching_nothing_is_an_error_with_a_did_you_mean(tmp_path):
    path = _variant(NVFP4, tmp_path / "c", edit_quant=lambda q: q["exclude_modules"].append("model.layers.1.mlp.gates"))
    with pytest.raises(PlanError, match=r"'model.layers.1.mlp.gates' is part of no module name of this checkpoint; did you "
                                        r"mean 'model.layers.1.mlp.gate'\?"):
        quantplug.plan(path)


def test_scales_stored_for_an_excluded_module_is_an_error_naming_both(tmp_path):
    path = _variant(NVFP4, tmp_path / "c", edit_quant=lambda q: q["exclude_modules"].append("*shared_experts*"))
    with pytest.raises(PlanError) as err:
        quantplug.plan(path)
    msg = str(err.value)
    assert "entry '*shared_experts*' excludes model.layers.1.mlp.shared_experts.down_proj" in msg
    assert "model.layers.1.mlp.shared_experts.down_proj.weight_scale" in msg


def _dequantized_module(st: dict, module: str) -> dict:
    """The fixture with ``module`` stored as bf16 (its NVFP4 tensors replaced by the dequantized weight)."""
    out = {k: v for k, v in st.items() if not k.startswith(module + ".")}
    out[module + ".weight"] = kernels.dequantize_nvfp4(st[module + ".weight"], st[module + ".weight_scale"],
                                                       st[module + ".weight_scale_2"]).to(torch.bfloat16)
    return out


@pytest.mark.parametrize("entry", ["model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.gate*",
                                   "re:.*layers\\.0\\.mlp\\.(gate|up)_proj$"])
def test_other_engine_names_and_patterns_exclude_the_shards(tmp_path, entry):
    """vLLM's fused gate_up_proj, a wildcard or a regex: gate_proj and up_proj of layer 0 load dense."""

    def state(st):
        return _dequantized_module(_dequantized_module(st, "model.layers.0.mlp.gate_proj"), "model.layers.0.mlp.up_proj")

    path = _variant(NVFP4, tmp_path / "c", edit_quant=lambda q: q["exclude_modules"].append(entry), edit_state=state)
    plan = build_plan(path)
    assert plan.schemes()["model.layers.0.mlp.gate_proj"] == "dense"
    assert plan.schemes()["model.layers.0.mlp.up_proj"] == "dense"
    assert plan.schemes()["model.layers.0.mlp.down_proj"].startswith("nvfp4")
    assert not [p for p in plan.problems if p.severity == "error"]


def test_float_layer_the_config_calls_quantized_loads_as_stored_with_a_warning(tmp_path):
    path = _variant(NVFP4, tmp_path / "c", edit_state=lambda st: _dequantized_module(st, "model.layers.2.self_attn.o_proj"))
    plan = build_plan(path)
    assert plan.schemes()["model.layers.2.self_attn.o_proj"] == "dense"
    assert any(p.kind == "modelopt-float" and "model.layers.2.self_attn.o_proj" in p.message for p in plan.problems)


def test_kimi_wrapper_prefix_resolves_unprefixed_excludes(tmp_path):
    """A Kimi-K2.5 export names tensors language_model.*; ModelOpt writes exclude names both ways."""
    st = load_file(str(NVFP4 / "model.safetensors"))
    cfg = json.loads((NVFP4 / "config.json").read_text())
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")}
    root = tmp_path / "kimi"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                  "model_type": "kimi_k25", "text_config": text,
                                                  "quantization_config": cfg["quantization_config"]}))
    side = json.loads((NVFP4 / "hf_quant_config.json").read_text())
    side["quantization"]["exclude_modules"] = ["lm_head", "language_model.model.embed_tokens",
                                               "model.layers.*.mlp.gate", "vision_tower*"]
    (root / "hf_quant_config.json").write_text(json.dumps(side))
    save_file({f"language_model.{k}": v for k, v in st.items()}, str(root / "model.safetensors"))
    ref = REF[NVFP4]
    model, out = load_logits(root, ref["input_ids"], options={"activation_quant": "none"}, progress=False)
    assert model.quantplug_plan.prefix == "language_model"
    assert rel_err(out, ref["vendor_logits"]) <= 1e-5
    assert any("'vision_tower*' matches no module" in p.message and p.severity == "warning"
               for p in model.quantplug_plan.problems)


# -- export ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("algo", ["W4A16_NVFP4", "NVFP4", "FP8"])
def test_export_round_trip(tmp_path, algo):
    from quantplug.plugins import get_plugin_manager

    cfg = tiny_config()
    dense = quantplug.load(write_checkpoint(tmp_path / "dense", cfg, random_state(cfg)), progress=False)
    pm = get_plugin_manager()
    [res] = pm.export("modelopt", model=dense, destination=tmp_path / "out", options={"algo": algo},
                      plan=dense.quantplug_plan)
    side = json.loads((res.path / "hf_quant_config.json").read_text())
    assert side["quantization"]["quant_algo"] == algo
    st = load_file(str(res.path / "model.safetensors"))
    g, u = (st[f"model.layers.1.mlp.experts.0.{p}_proj.weight_scale{'_2' if algo != 'FP8' else ''}"] for p in ("gate", "up"))
    if algo != "FP8":
        assert torch.equal(g, u)  # shared over the fused pair, as ModelOpt writes it
    model = quantplug.load(res.path, options={"activation_quant": "none"}, progress=False)
    ids = torch.randint(0, cfg["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(ids), dense(ids)) < 0.5
    assert model.quantplug_plan.backend == "modelopt"
