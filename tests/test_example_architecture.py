"""examples/deepseek_v2: a third-party architecture (DeepSeek-V2, softmax router) registered through
the ``quantplug.architectures`` entry point and built from the core's blocks, against
transformers' ``DeepseekV2ForCausalLM`` (float32)."""

from __future__ import annotations

import json

import pytest
import quantplug
import torch
from conftest import rel_err
from quantplug.errors import ConfigError

pytest.importorskip("quantplug_deepseek_v2", reason="examples/deepseek_v2 is not installed (.ci/run installs it)")
transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(2))


def _config(**kw):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
                kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.5,
                topk_method="greedy", max_position_embeddings=256)
    base.update(kw)
    return transformers.DeepseekV2Config(**base)


def randomized(cfg, seed=0):
    """transformers' DeepseekV2ForCausalLM of ``cfg`` with random weights (norms near 1, the rest
    ~1/sqrt(fan-in): logits of order 1), in eval mode."""
    torch.manual_seed(seed)
    ref = transformers.DeepseekV2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return ref


def _reference(tmp_path, cfg, seed=0):
    ref = randomized(cfg, seed)
    path = tmp_path / "dsv2"
    ref.save_pretrained(path, safe_serialization=True)
    return ref, path


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_loads_and_matches_transformers(tmp_path, method):
    cfg = _config(topk_method=method, n_group=4 if method != "greedy" else 1, topk_group=2 if method != "greedy" else 1)
    ref, path = _reference(tmp_path, cfg)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["DeepseekV2ForCausalLM"]
    model = quantplug.load(path)
    assert type(model).__module__ == "quantplug_deepseek_v2"
    with torch.no_grad():
        ours, theirs = model(IDS), ref(IDS).logits
    assert rel_err(ours, theirs) <= 1e-5
    # greedy generation with the latent cache equals transformers' greedy generate
    out = model.generate(IDS[:1, :6], 8, eos_token_id=None)
    want = ref.generate(IDS[:1, :6], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, want)


def test_router_is_the_architectures_own(tmp_path):
    """The router decides: with DeepSeek-V3's sigmoid router in its place the logits move (the test
    can fail); the whole-stack native step routes by the router's own spec (softmax, no bias)."""
    from quantplug.kernels import native
    from quantplug.models import deepseek

    cfg = _config()
    ref, path = _reference(tmp_path, cfg, seed=1)
    model = quantplug.load(path)
    moe = model.model.layers[1].mlp
    assert type(moe.gate).__name__ == "SoftmaxRouter"
    assert (moe.gate.spec.score, moe.gate.spec.select, moe.gate.spec.has_bias) == ("softmax", "greedy", False)
    assert (model.model._stack_step() is not None) == (native.library() is not None)
    x = torch.randn(5, cfg.hidden_size)
    idx, w = moe.gate(x)
    sig = deepseek.Router.forward.__get__(moe.gate)  # V3's routing on the same weights would differ
    moe.gate.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts), persistent=False)
    sidx, sw = sig(x)
    assert not torch.allclose(w.sort(dim=-1).values, sw.sort(dim=-1).values)
    ids, ws = moe.gate.route_one(x[:1])
    assert dict(zip(ids, ws)) == pytest.approx(dict(zip(idx[0].tolist(), w[0].tolist())))


def test_config_schema_is_the_architectures(tmp_path):
    cfg = _config()
    _, path = _reference(tmp_path, cfg, seed=2)
    conf = json.loads((path / "config.json").read_text())
    conf["topk_method"] = "noaux_tc"
    (path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match=r"topk_method.*greedy"):
        quantplug.plan(path)


def test_a_quantized_export_loads(tmp_path):
    """Any backend works with the new architecture: the DeepSeek FP8 backend's own exporter on the
    same weights, against transformers loading the dequantized weights the FP8 load holds."""
    from quantplug.testing.formats import fp8
    from safetensors.torch import load_file, save_file

    cfg = _config()
    _, path = _reference(tmp_path, cfg, seed=3)
    conf = json.loads((path / "config.json").read_text())
    # weights only (activation_quant=none): the reference computes in float on the dequantized weights
    model = quantplug.load(fp8(tmp_path / "fp8", conf, load_file(str(path / "model.safetensors"))),
                           options={"activation_quant": "none"})
    assert model.quantplug_plan.backend == "fp8"
    with torch.no_grad():
        ours = model(IDS)
    deq = tmp_path / "deq"
    deq.mkdir()
    save_file({k: v.float().contiguous() for k, v in quantplug.api.dense_state(model).items()},
              str(deq / "model.safetensors"))
    (deq / "config.json").write_text(json.dumps(conf))
    ref = transformers.DeepseekV2ForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(IDS).logits
    assert rel_err(ours, theirs) <= 1e-5
    assert rel_err(ours, quantplug.load(path)(IDS)) > 1e-4  # the FP8 weights are not the originals
