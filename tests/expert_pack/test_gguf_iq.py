"""GGUF IQ / TQ files written by llama.cpp's own llama-quantize (tests/data/vendor/README.md,
"GGUF IQ / TQ"): every block of every tensor decodes bit-exactly as gguf-py decodes it; the logits
equal transformers' DeepseekV3 on gguf-py's dequantization (rel 1e-5, fp32); the Unsloth-like mix
(routed experts IQ1_S / IQ2_XXS, attention Q4_K / Q6_K, attn_k_b Q4_0) plans, loads, generates,
serves its experts from an expert pack; cached decode = full recompute."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import quantplug
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from quantplug.models.config import parse_model_config
from quantplug_expert_pack import ggml
from quantplug_expert_pack.build import build_pack
from quantplug_expert_pack.testing import reference_state
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import VENDOR, hf_logits, rel_err  # noqa: E402
from test_generate import check_cached_equals_recompute  # noqa: E402

PER_TYPE = {t: f"gguf_{t.lower()}_dsv3" for t in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                                                  "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0")}
MIXED = "gguf_iq_unsloth_dsv3"
ALL = [*PER_TYPE.values(), MIXED]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(VENDOR / f"{name}.reference.safetensors"))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("name", ALL)
def test_every_block_decodes_as_gguf_py_decodes_it(name):
    types = {}
    for t in GGUFReader(VENDOR / name / "model.gguf").tensors:
        ttype = t.tensor_type.name
        types[t.name] = ttype
        if ttype in ggml.FLOAT_TYPES:
            continue
        raw = np.array(t.data)
        got = ggml.dequantize(torch.from_numpy(raw), ttype).numpy()
        ref = gguf_dequantize(raw, t.tensor_type)
        assert np.isfinite(ref).all(), t.name
        np.testing.assert_array_equal(_bits(got), _bits(ref), err_msg=f"{name}: {t.name} ({ttype})")
    if name in PER_TYPE.values():  # the file is what its name says: every routed expert in the type
        want = next(k for k, v in PER_TYPE.items() if v == name)
        experts = {k: v for k, v in types.items() if "_exps." in k}
        assert experts and set(experts.values()) == {want}, experts


@pytest.mark.parametrize("name", ALL)
def test_logits_equal_transformers_on_gguf_py_weights(name):
    ref = _reference(name)
    model = quantplug.load(VENDOR / name, progress=False)
    assert model.quantplug_plan.backend == "expert_pack" and not model.quantplug_plan.problems
    with torch.no_grad():
        out = model(ref["input_ids"])
    assert rel_err(out, ref["logits"]) <= 1e-5
    # the stored reference is what gguf-py + transformers compute here and now
    cfg = json.loads((VENDOR / name / "config.json").read_text())
    mc = parse_model_config(cfg, cfg["architectures"][0], False)
    assert rel_err(hf_logits(cfg, reference_state(VENDOR / name, mc), ref["input_ids"]), ref["logits"]) <= 1e-6


def test_unsloth_like_mix_plans_with_the_types_llama_quantize_wrote():
    plan = quantplug.plan(VENDOR / MIXED)
    assert plan.backend == "expert_pack" and not plan.problems
    d = plan.to_dict()
    schemes = d["schemes"]
    want = {
        "model.layers.1.mlp.experts.gate_proj": "IQ1_S", "model.layers.1.mlp.experts.up_proj": "IQ1_S",
        "model.layers.1.mlp.experts.down_proj": "IQ2_XXS", "model.layers.2.mlp.experts.gate_proj": "IQ2_XXS",
        "model.layers.2.mlp.experts.up_proj": "IQ2_XXS", "model.layers.2.mlp.experts.down_proj": "IQ2_XXS",
        "model.layers.0.self_attn.k_b_proj": "Q4_0", "model.layers.0.self_attn.v_b_proj": "Q4_K",
        "model.layers.0.self_attn.q_a_proj": "Q4_K", "model.layers.0.self_attn.q_b_proj": "Q4_K",
        "model.layers.0.self_attn.kv_a_proj_with_mqa": "Q6_K", "model.layers.0.self_attn.o_proj": "Q6_K",
        "model.layers.0.mlp.gate_proj": "Q4_K", "model.layers.0.mlp.down_proj": "Q6_K",
        "model.layers.1.mlp.shared_experts.up_proj": "Q4_K", "model.layers.2.mlp.shared_experts.down_proj": "Q6_K",
        "model.embed_tokens": "Q4_K", "lm_head": "Q6_K",
    }
    assert {k: schemes[k] for k in want} == {k: f"ggml {v}" for k, v in want.items()}
    assert d["attention_layouts"]["model.layers.2.self_attn"] == "split_kv"


def test_unsloth_like_mix_generates_greedy_and_cache_equals_recompute():
    model = quantplug.load(VENDOR / MIXED, progress=False)
    ids = _reference(MIXED)["input_ids"][:, :7]
    out = model.generate(ids, 6, eos_token_id=None)
    with torch.no_grad():  # greedy = argmax of a full forward at each generated position
        assert torch.equal(model(out)[:, ids.shape[1] - 1:-1].argmax(-1), out[:, ids.shape[1]:])
    check_cached_equals_recompute(model, ids, steps=4)


@pytest.mark.parametrize("ggml_type", sorted(PER_TYPE))
def test_per_type_cache_equals_recompute(ggml_type):
    model = quantplug.load(VENDOR / PER_TYPE[ggml_type], progress=False)
    check_cached_equals_recompute(model, _reference(PER_TYPE[ggml_type])["input_ids"][:, :6], steps=3)


def test_unsloth_like_mix_with_experts_in_an_expert_pack(tmp_path):
    root = tmp_path / "packed"
    shutil.copytree(VENDOR / MIXED, root)
    build_pack(root, progress=False)
    ref = _reference(MIXED)
    model = quantplug.load(root, progress=False, options={"expert_cache_mb": 1})
    with torch.no_grad():
        assert rel_err(model(ref["input_ids"]), ref["logits"]) <= 1e-5
