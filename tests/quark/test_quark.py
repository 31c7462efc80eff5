"""Quark MXFP4 backend against amd-quark's own export (tests/data/vendor) and derived variants."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import quantplug
import torch
from conftest import VENDOR, load_logits, rel_err
from quantplug.errors import PlanError
from quantplug.loader import model_bytes
from quantplug.plan import build_plan
from safetensors.torch import load_file, save_file

quark = pytest.importorskip("quantplug_quark")
from quantplug_quark.scheme import dequantize_mxfp4, quantize_mxfp4, unpack_fp4  # noqa: E402

FIX = VENDOR / "quark_mxfp4_dsv3"
REF = load_file(str(VENDOR / "quark_mxfp4_dsv3.reference.safetensors"))


def _logits(path, **kw):
    return load_logits(path, REF["input_ids"], **kw)


def test_vendor_fixture_matches_vendor_logits():
    model, out = _logits(FIX)
    assert model.quantplug_plan.backend == "quark"
    assert rel_err(out, REF["vendor_logits"]) <= 1e-4
    assert rel_err(out, REF["dense_logits"]) > 1e-2  # it really is the quantized model
    # packed in memory: parameters + buffers within 1.1x of the checkpoint's weight bytes
    assert model_bytes(model) <= 1.1 * model.quantplug_plan.weight_bytes()
    w = model.model.layers[0].self_attn.q_a_proj.weight
    assert w.dtype == torch.uint8


def test_dequantize_option_caches_dense_copy_same_logits():
    model, out = _logits(FIX, options={"dequantize": True})
    assert rel_err(out, REF["vendor_logits"]) <= 1e-4
    assert hasattr(model.model.layers[0].self_attn.q_a_proj, "_dequantized")


def _kimi_wrap(dst, strip_exclude_prefix=False, yarn=True):
    shutil.copytree(FIX, dst)
    cfg = json.loads((FIX / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    qc["exclude"] = [e if strip_exclude_prefix else f"language_model.{e}" for e in qc["exclude"]]
    qc["exclude"].append("re:vision_tower.*")
    qc["exclude"].append("mm_projector*")
    if yarn:
        cfg.pop("rope_parameters")
        cfg["rope_theta"] = 10000.0
        cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    text = {k: v for k, v in cfg.items() if k != "architectures"}
    text["model_type"] = "kimi_k2"
    wrapped = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text, "quantization_config": qc}
    (dst / "config.json").write_text(json.dumps(wrapped))
    sd = load_file(str(FIX / "model.safetensors"))
    sd = {f"language_model.{k}": v for k, v in sd.items()}
    sd["vision_tower.blocks.0.weight"] = torch.zeros(4, 4)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def _reference_logits_yarn(tmp_path):
    """transformers on the fixture's dequantized weights with the same yarn rope."""
    from conftest import hf_logits

    cfg = json.loads((FIX / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 1.0, "mscale_all_dim": 1.0}
    sd = load_file(str(FIX / "model.safetensors"))
    dense = {}
    for k, v in sd.items():
        if k.endswith("weight_scale"):
            continue
        if v.dtype == torch.uint8:
            dense[k] = dequantize_mxfp4(v, sd[k + "_scale"])
        else:
            dense[k] = v
    return hf_logits(cfg, dense, REF["input_ids"])


def test_kimi_wrapped_yarn_export_loads_and_matches(tmp_path):
    path = _kimi_wrap(tmp_path / "kimi")
    model, out = _logits(path)
    plan = model.quantplug_plan
    assert plan.prefix == "language_model" and plan.backend == "quark"
    assert rel_err(out, _reference_logits_yarn(tmp_path)) <= 1e-4
    # lm_head excluded (float), the rest mxfp4
    assert plan.schemes()["language_model.lm_head"] == "dense"
    assert plan.schemes()["language_model.model.layers.0.self_attn.q_a_proj"].startswith("mxfp4")
    warn = [p.message for p in plan.warnings]
    assert any("mm_projector*" in m for m in warn)  # pattern matching nothing: a warning, not an error


def test_stripped_exclude_prefix_is_plan_time_problem(tmp_path):
    path = _kimi_wrap(tmp_path / "kimi", strip_exclude_prefix=True)
    with pytest.raises(PlanError) as e:
        quantplug.plan(path)
    msg = str(e.value)
    assert "'lm_head'" in msg and "language_model.lm_head" in msg


def test_unsupported_spec_is_problem_naming_layer(tmp_path):
    dst = tmp_path / "q"
    shutil.copytree(FIX, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["layer_quant_config"] = {
        "model.layers.0.self_attn.o_proj": {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 16,
                                                       "scale_format": "e8m0"}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    plan = build_plan(dst)
    msgs = [p.describe() for p in plan.errors]
    assert any("model.layers.0.self_attn.o_proj" in m and "group_size" in m for m in msgs), msgs


def test_fused_shards_disagree(tmp_path):
    dst = tmp_path / "q"
    shutil.copytree(FIX, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["exclude"].append("model.layers.0.self_attn.q_a_proj")
    (dst / "config.json").write_text(json.dumps(cfg))
    plan = build_plan(dst)
    assert any("fused_qkv_a_proj_with_mqa" in p.describe() for p in plan.errors)


def test_nibble_order_and_scale_on_hand_example():
    # elements 0..31: e[0]=0.5 (code 1), e[1]=-6 (code 15), the rest 0; scale 2**(128-127)=2
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 1.0, -12.0
    q, s = quantize_mxfp4(w)
    assert q[0, 0].item() == (1 | (15 << 4)) and s[0, 0].item() == 128
    assert torch.equal(unpack_fp4(q)[0, :2], torch.tensor([1, 15], dtype=torch.uint8))
    assert torch.equal(dequantize_mxfp4(q, s), w)


def test_requantizing_vendor_weights_reproduces_vendor_bytes():
    sd = load_file(str(FIX / "model.safetensors"))
    for k, v in sd.items():
        if v.dtype == torch.uint8 and k.endswith(".weight"):
            q, s = quantize_mxfp4(dequantize_mxfp4(v, sd[k + "_scale"]))
            assert torch.equal(q, v) and torch.equal(s, sd[k + "_scale"]), k


def test_export_matches_vendor_layout(tmp_path):
    dense = quantplug.load(FIX)  # any model will do; export re-quantizes its dequantized weights
    from quantplug_quark.export import export_quark

    res = export_quark(dense, dense.quantplug_plan, tmp_path / "out", {})
    ours = load_file(str(res.path / "model.safetensors"))
    theirs = load_file(str(FIX / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {k: (v.dtype, v.shape) for k, v in theirs.items()}
    for k, v in theirs.items():
        if v.dtype == torch.uint8:
            assert torch.equal(ours[k], v), k
    ours_cfg = json.loads((res.path / "config.json").read_text())["quantization_config"]
    theirs_cfg = json.loads((FIX / "config.json").read_text())["quantization_config"]
    assert ours_cfg == theirs_cfg
    model, out = _logits(res.path)
    assert rel_err(out, REF["vendor_logits"]) <= 1e-4


def test_export_writes_unquantized_tensors_in_float_dtype(tmp_path):
    """``float_dtype=bfloat16``: the tensors amd-quark leaves unquantized (embeddings, norms,
    lm_head, the routed experts) as bfloat16, as it writes them for a bfloat16 model; the router's
    correction bias stays float32; the MXFP4 codes and scales are the float32 export's."""
    dense = quantplug.load(FIX)
    from quantplug_quark.export import export_quark

    f32 = load_file(str(export_quark(dense, dense.quantplug_plan, tmp_path / "f32", {}).path / "model.safetensors"))
    res = export_quark(dense, dense.quantplug_plan, tmp_path / "bf16", {"float_dtype": "bfloat16"})
    bf = load_file(str(res.path / "model.safetensors"))
    assert bf.keys() == f32.keys()
    for k, v in bf.items():
        if f32[k].dtype == torch.uint8:
            assert torch.equal(v, f32[k]), k
        elif k.endswith("e_score_correction_bias"):
            assert v.dtype == torch.float32, k
        else:
            assert v.dtype == torch.bfloat16 and torch.equal(v, f32[k].to(torch.bfloat16)), k
    assert any(".mlp.experts." in k and v.dtype == torch.bfloat16 for k, v in bf.items())
    _, out = _logits(res.path)
    assert rel_err(out, REF["vendor_logits"]) <= 3e-2


def test_cli_explain_names_quark():
    r = subprocess.run([sys.executable, "-m", "quantplug.cli", "explain", str(FIX), "model.layers.1.self_attn.q_b_proj"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("linear_scheme"))
    assert "mxfp4" in line and "quark (quantplug-quark 0.1.0)" in line


def test_scratch_made_in_inference_mode_serves_later_plain_forwards(monkeypatch):
    """The MXFP4 linear's per-thread buffer, first allocated inside ``torch.inference_mode``, must
    stay writable by a later forward outside it (an inference tensor would refuse the in-place
    writes with a RuntimeError)."""
    from quantplug_quark import scheme

    monkeypatch.setattr(scheme, "_SCRATCH", __import__("threading").local())  # no buffer yet
    model = quantplug.load(FIX, progress=False)
    ids = REF["input_ids"]
    with torch.inference_mode():
        first = model(ids)
    with torch.no_grad():
        assert torch.equal(model(ids), first)
