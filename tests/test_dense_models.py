"""Dense DeepSeek-V3 / Kimi checkpoints against transformers' DeepseekV3ForCausalLM (fp32)."""

from __future__ import annotations

import pytest
import quantplug
import torch
from conftest import hf_logits, rel_err
from quantplug.testing import (
    hub_rope_spelling,
    random_state,
    tiny_config,
    to_layout,
    wrap_kimi,
    write_checkpoint,
)

IDS = torch.randint(0, 160, (2, 9), generator=torch.Generator().manual_seed(1))


def _check(tmp_path, cfg, state, written_cfg=None, tensors=None, pm=None, **kw):
    path = write_checkpoint(tmp_path / "ckpt", written_cfg or cfg, tensors if tensors is not None else state, **kw)
    model = quantplug.load(path, plugin_manager=pm)
    with torch.no_grad():
        ours = model(IDS)
    ref = hf_logits(cfg, state, IDS)
    assert ours.shape == (2, 9, cfg["vocab_size"])
    assert rel_err(ours, ref) <= 1e-5
    return model


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_hub_layout_yarn_hub_spelling(tmp_path, pm, key):
    cfg = tiny_config()
    state = random_state(cfg, seed=3)
    model = _check(tmp_path, cfg, state, written_cfg=hub_rope_spelling(cfg, key), pm=pm)
    assert model.quantplug_plan.model_config.rope.type == "yarn"
    assert any(d.hook == "expert_layout" and d.value == "hub" for d in model.decisions)


def test_fused_experts_transformers5_spelling(tmp_path, pm):
    cfg = tiny_config()
    state = random_state(cfg, seed=4)
    model = _check(tmp_path, cfg, state, tensors=to_layout(state, "fused"), pm=pm)
    assert any(d.hook == "expert_layout" and d.value == "fused" for d in model.decisions)
    # used exactly as stored: the fused expert tensors stay views of the memory-mapped file
    p = next(pp for pp in model.quantplug_plan.params if pp.param.endswith("experts.gate_proj.weight"))
    assert p.zero_copy


def test_kimi_k25_wrapper_with_vision(tmp_path, pm):
    cfg = tiny_config()
    state = random_state(cfg, seed=5)
    wcfg, tensors = wrap_kimi(hub_rope_spelling(cfg), state)
    model = _check(tmp_path, cfg, state, written_cfg=wcfg, tensors=tensors, pm=pm)
    plan = model.quantplug_plan
    assert plan.prefix == "language_model"
    skipped = [n for names in plan.skipped.values() for n in names]
    assert "vision_tower.patch_embed.proj.weight" in skipped and "mm_projector.proj.0.weight" in skipped
    assert any(rule.startswith("vision:") for rule in plan.skipped)


def test_q_lora_rank_null(tmp_path, pm):
    cfg = tiny_config(q_lora_rank=None)
    _check(tmp_path, cfg, random_state(cfg, seed=6), pm=pm)


def test_tied_embeddings(tmp_path, pm):
    cfg = tiny_config(tie_word_embeddings=True)
    model = _check(tmp_path, cfg, random_state(cfg, seed=7), pm=pm)
    assert model.lm_head(torch.ones(1, cfg["hidden_size"])).shape[-1] == cfg["vocab_size"]


def test_default_rope_sharded_bf16(tmp_path, pm):
    cfg = tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, n_group=1, topk_group=1)
    state = {k: v.to(torch.bfloat16).float() for k, v in random_state(cfg, seed=8).items()}
    path = write_checkpoint(tmp_path / "c", cfg, state, shards=3, dtype=torch.bfloat16)
    model = quantplug.load(path, plugin_manager=pm)
    with torch.no_grad():
        assert rel_err(model(IDS), hf_logits(cfg, state, IDS)) <= 1e-5
    # bf16 on disk, fp32 model: the linears keep their bf16 values (exact in float32) as zero-copy
    # views of the file (routed experts: stacked into one bf16 tensor per projection); the norms
    # and the router, plain float parameters, are converted
    params = model.quantplug_plan.params
    assert all(p.zero_copy for p in params if p.local == "weight" and "norm" not in p.param and ".gate." not in p.param
               and ".experts." not in p.param)
    assert not any(p.zero_copy for p in params if "norm" in p.param)
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_mtp_layer_is_skipped_by_rule(tmp_path, pm):
    cfg = tiny_config()
    state = random_state(cfg, seed=9)
    extra = dict(state)
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)
    model = _check(tmp_path, cfg, state, tensors=extra, pm=pm)
    assert any(rule.startswith("mtp-layers") for rule in model.quantplug_plan.skipped)


def test_kimi_k3_output_gate_matches_direct_formula(tmp_path, pm):
    cfg = tiny_config(mla_use_output_gate=True, num_hidden_layers=1, first_k_dense_replace=1)
    state = random_state(cfg, seed=10)
    wcfg, tensors = wrap_kimi(cfg, state, arch="KimiK25ForConditionalGeneration")
    model = quantplug.load(write_checkpoint(tmp_path / "k3", wcfg, tensors), plugin_manager=pm)
    attn = model.language_model.model.layers[0].self_attn
    x = torch.randn(1, 5, cfg["hidden_size"])
    pos = torch.arange(5)[None]
    cos, sin = model.language_model.model.rotary.cos_sin(pos, x.dtype)
    # direct formula: o_proj input == attention(x) * sigmoid(x @ Wg^T), where attention(x) is the
    # same layer's output with the gate switched off
    wg = state["model.layers.0.self_attn.g_proj.weight"]
    seen = []
    attn.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    with torch.no_grad():
        attn(x, cos, sin)
        attn.cfg = type(attn.cfg)(**{**attn.cfg.__dict__, "mla_use_output_gate": False})
        attn(x, cos, sin)
    gated, ungated = seen
    expected = ungated * torch.sigmoid(x @ wg.T)
    assert rel_err(gated, expected) <= 1e-6
    assert rel_err(gated, ungated) > 1e-2  # the gate does something


def test_plan_reads_no_tensor_data(tmp_path, pm, monkeypatch):
    cfg = tiny_config()
    path = write_checkpoint(tmp_path / "c", cfg, random_state(cfg))
    from quantplug.checkpoint import Checkpoint

    def boom(self, info):
        raise AssertionError(f"plan read tensor data of {info.name}")

    monkeypatch.setattr(Checkpoint, "raw", boom)
    monkeypatch.setattr(Checkpoint, "tensor", boom)
    p = quantplug.plan(path)
    assert p.errors == []
