"""A tiny DeepSeek-V4 (transformers 5.25's ``DeepseekV4ForCausalLM`` with random float32 weights) and its
state dict in the release's tensor names, shared by the V4 tests: one layer of each kind (sliding window,
CSA r=4 with the indexer, HCA r=8), a hash-routed and two learned MoE layers, mHC, and a SwiGLU clamp
that cuts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as tf
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

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


def reference_model(q_lora_rank: int = 24) -> Any:
    """``q_lora_rank``: CONFIG's 24, or a multiple of 32 for the group-32 / 16 formats' exporters."""
    cfg = DeepseekV4Config(
        vocab_size=V, hidden_size=H, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=q_lora_rank, o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=4,
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


def float_tensors(ref: Any) -> dict[str, torch.Tensor]:
    """``ref``'s weights in the release's names and dtypes of the float layout (``tid2eid`` int32)."""
    tensors = release_names(ref.state_dict())
    return {k: (v.to(torch.int32) if k.endswith("tid2eid") else v) for k, v in tensors.items()}


def write_float_checkpoint(path: Path, ref: Any, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """The tiny float32 release-named checkpoint of ``ref`` (plus ``extra`` tensors) at ``path``."""
    from quantplug.testing import write_checkpoint

    write_checkpoint(path, CONFIG, {**float_tensors(ref), **(extra or {})})
    return path
