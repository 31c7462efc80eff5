"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) loaded by quantplug from a tiny release-named checkpoint
against transformers 5.25's ``DeepseekV4ForCausalLM`` with the same random float32 weights: one
layer of each kind (sliding window, CSA r=4 with the indexer, HCA r=8), a hash-routed and two
learned MoE layers, mHC, and a SwiGLU clamp that cuts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from quantplug import load, plan
from quantplug.plan import build_plan
from quantplug.testing import write_checkpoint

tf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, H, E, K, INTER, LIM, HCA = 96, 64, 8, 2, 32, 0.25, 8
#: the release config.json (E1 keys), scaled down
CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": V, "hidden_size": H,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
    "qk_rope_head_dim": 16, "q_lora_rank": 24, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8,
    "compress_ratios": [0, 4, HCA, 0], "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "index_n_heads": 4, "index_head_dim": 16, "index_topk": 3, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "n_routed_experts": E, "num_experts_per_tok": K, "n_shared_experts": 1,
    "moe_intermediate_size": INTER, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": LIM, "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}
T = 40

#: transformers' attention names -> the release's (under layers.L.attn)
_ATTN = {"q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv", "kv_norm": "kv_norm",
         "o_a_proj": "wo_a", "o_b_proj": "wo_b"}
_COMP = {"kv_proj": "wkv", "gate_proj": "wgate", "position_bias": "ape", "kv_norm": "norm"}


def release_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict in the release's names (the inverse of its conversion mapping)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        n = name.removeprefix("model.")
        parts = n.split(".")
        if n in ("embed_tokens.weight", "lm_head.weight", "norm.weight"):
            out[{"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight"}.get(n, n)] = t
        elif parts[0] == "hc_head":
            out[f"hc_head_{parts[1].removeprefix('hc_')}"] = t
        elif parts[0] == "layers":
            base, rest = f"layers.{parts[1]}", parts[2:]
            if rest[0] in ("input_layernorm", "post_attention_layernorm"):
                out[f"{base}.{'attn_norm' if rest[0] == 'input_layernorm' else 'ffn_norm'}.weight"] = t
            elif rest[0] in ("attn_hc", "ffn_hc"):
                out[f"{base}.hc_{rest[0][:-3]}_{rest[1]}"] = t
            elif rest[0] == "self_attn":
                r = rest[1:]
                if r == ["sinks"]:
                    out[f"{base}.attn.attn_sink"] = t
                elif r[0] == "compressor" and r[1] == "indexer":
                    if r[2] == "q_b_proj":
                        out[f"{base}.attn.indexer.wq_b.{r[-1]}"] = t
                    elif r[2] == "scorer":
                        out[f"{base}.attn.indexer.weights_proj.{r[-1]}"] = t
                    else:
                        out[f"{base}.attn.indexer.compressor.{'.'.join([_COMP[r[2]], *r[3:]])}"] = t
                elif r[0] == "compressor":
                    out[f"{base}.attn.compressor.{'.'.join([_COMP[r[1]], *r[2:]])}"] = t
                else:
                    out[f"{base}.attn.{_ATTN[r[0]]}.{r[1]}"] = t
            elif rest[:2] == ["mlp", "gate"]:
                out[f"{base}.ffn.gate.{ {'e_score_correction_bias': 'bias'}.get(rest[2], rest[2]) }"] = t
            elif rest[:2] == ["mlp", "shared_experts"]:
                w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[rest[2]]
                out[f"{base}.ffn.shared_experts.{w}.weight"] = t
            elif rest[:3] == ["mlp", "experts", "gate_up_proj"]:
                for e in range(t.shape[0]):
                    out[f"{base}.ffn.experts.{e}.w1.weight"] = t[e, :INTER]
                    out[f"{base}.ffn.experts.{e}.w3.weight"] = t[e, INTER:]
            elif rest[:3] == ["mlp", "experts", "down_proj"]:
                for e in range(t.shape[0]):
                    out[f"{base}.ffn.experts.{e}.w2.weight"] = t[e]
            else:
                raise AssertionError(f"no release name for {name}")
        else:
            raise AssertionError(f"no release name for {name}")
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def reference_model() -> Any:
    cfg = DeepseekV4Config(
        vocab_size=V, hidden_size=H, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=24, o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=4,
        index_head_dim=16, index_topk=3, rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        compress_ratios=[0, 4, 128], compress_rates={"compressed_sparse_attention": 4,
                                                     "heavily_compressed_attention": HCA},
        n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1, moe_intermediate_size=INTER,
        routed_scaling_factor=1.5, num_hash_layers=1, swiglu_limit=LIM, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = tf.DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "position_bias", "e_score_correction_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "bias" in name.split(".")[-1] else 1.0))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in ref.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]))
    return ref


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    ref = reference_model()
    tensors = release_names(ref.state_dict())
    tensors = {k: (v.to(torch.int32) if k.endswith("tid2eid") else v) for k, v in tensors.items()}
    tensors["mtp.0.enorm.weight"] = torch.ones(H)  # the MTP block: skipped, not loaded
    path = tmp_path_factory.mktemp("v4") / "ckpt"
    write_checkpoint(path, CONFIG, tensors)
    return ref, path


def test_plan_is_clean_and_skips_mtp(v4):
    _, path = v4
    p = plan(path)
    assert not p.problems
    assert any(n == "mtp.0.enorm.weight" for names in p.skipped.values() for n in names)


def test_missing_tensor_is_a_plan_problem(v4, tmp_path):
    _, path = v4
    from safetensors.torch import load_file
    tensors = load_file(str(path / "model.safetensors"))
    gone = "layers.1.attn.indexer.compressor.wkv.weight"
    del tensors[gone]
    write_checkpoint(tmp_path / "m", json.loads((path / "config.json").read_text()), tensors)
    p = build_plan(tmp_path / "m")
    assert any(gone in str(pr) for pr in p.problems), p.problems


def test_logits_match_transformers(v4):
    ref, path = v4
    model = load(path)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err
    # the clamp cuts: without it the reference's logits move
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.mlp.experts.limit = 1e9
            layer.mlp.shared_experts.limit = 1e9
        loose = ref(ids).logits
        for layer in ref.model.layers:
            layer.mlp.experts.limit = LIM
            layer.mlp.shared_experts.limit = LIM
    assert (loose - want).abs().max() > 1e-3


def test_config_refusals_name_file_and_key(tmp_path):
    from quantplug.errors import ConfigError
    from quantplug.models.deepseek_v4_config import parse_deepseek_v4_config
    for key, value, says in (("compress_ratios", [0, 4], "at least num_hidden_layers"),
                             ("scoring_func", "sigmoid", "sqrtsoftplus"),
                             ("o_groups", 3, "divisor of num_attention_heads"),
                             ("swiglu_limit", 0, "finite number"),
                             ("num_hash_layers", 9, r"integer in \[0, 3\]")):
        with pytest.raises(ConfigError, match=rf"cfg\.json: {key} = .*{says}"):
            parse_deepseek_v4_config({**CONFIG, key: value}, "DeepseekV4ForCausalLM", False, "cfg.json")


def test_cached_greedy_generation_equals_recomputing(v4):
    _, path = v4
    model = load(path)
    ids = torch.randint(0, V, (1, 13), generator=torch.Generator().manual_seed(4))
    n = 20  # crosses the sliding window and several compression windows while decoding
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n)
        seq = ids
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out[:, -n:], seq[:, -n:]), (out, seq)
