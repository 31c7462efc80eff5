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


def reference_model(q_lora_rank: int = 24, **overrides: Any) -> Any:
    """The tiny reference model. ``q_lora_rank``: CONFIG's 24, or a multiple of 32 for the group-32 / 16
    formats' exporters and the native products; ``overrides``: other config fields changed from
    :data:`CONFIG`'s values (a checkpoint of it needs the same in its config.json:
    :func:`write_float_checkpoint`)."""
    kwargs: dict[str, Any] = dict(
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
    cfg = DeepseekV4Config(**{**kwargs, **overrides})
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


def write_float_checkpoint(path: Path, ref: Any, extra: dict[str, torch.Tensor] | None = None,
                           config: dict[str, Any] | None = None) -> Path:
    """The tiny float32 release-named checkpoint of ``ref`` (plus ``extra`` tensors) at ``path``;
    ``config``: config.json fields changed from :data:`CONFIG`'s (as ``ref`` was made)."""
    from quantplug.testing import write_checkpoint

    write_checkpoint(path, {**CONFIG, **(config or {})}, {**float_tensors(ref), **(extra or {})})
    return path


# -- the release's quantization (FP8 dense linears, FP4 or FP8 routed experts), independent of quantplug ----------

#: the linears the release stores in FP8 (``X.weight`` F8_E4M3 + ``X.scale``): every attention projection, the
#: indexer's ``wq_b`` and the shared expert; the routed experts follow ``expert_dtype``
FP8_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               "ffn.shared_experts.w1", "ffn.shared_experts.w3", "ffn.shared_experts.w2")
#: kept in float32 by the release (everything else that is neither FP8 / FP4 nor an integer is BF16)
F32_SUFFIXES = ("attn_sink", "ape", "gate.bias")
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _release_kind(name: str) -> str:
    """"fp8" / "expert" / "f32" / "int" / "bf16": how the release stores the tensor ``name``."""
    parts = name.split(".")
    if name.endswith(".weight") and any(name.endswith(f".{lin}.weight") for lin in FP8_LINEARS):
        return "fp8"
    if len(parts) > 4 and parts[2:4] == ["ffn", "experts"]:
        return "expert"
    if name.endswith("tid2eid"):
        return "int"
    if name.startswith(("hc_", "layers.")) and ".hc_" in f".{name}" or name.endswith(F32_SUFFIXES):
        return "f32"
    return "bf16"


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The E8M0 exponent byte (int32) of the smallest power of two s with amax / s <= qmax
    (1.0 for an all-zero group): DeepSeek's ue8m0 rounding ``2 ** ceil(log2(amax / qmax))``."""
    s = torch.where(amax > 0, amax.double() / qmax, torch.ones_like(amax, dtype=torch.float64))
    e = torch.ceil(torch.log2(s)).to(torch.int32)
    return (e + 127).clamp(1, 254)


def _e8m0(exp_byte: torch.Tensor) -> torch.Tensor:
    return exp_byte.to(torch.uint8).view(torch.float8_e8m0fnu)


def _exp2(exp_byte: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, exp_byte.to(torch.float64) - 127).to(torch.float32)


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128), scale_dtype: str = "E8M0"
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float [N, K] -> (F8_E4M3 weight, scale [ceil(N/bn), ceil(K/bk)], the dequantized float32 weight).

    E8M0 scales: s = 2^ceil(log2(amax / 448)) per block (the byte ``log2(s) + 127``); F32 scales: s = amax / 448.
    W = fp8 * s with the block's s (edge blocks partial)."""
    n, k = w.shape
    bn, bk = block
    rb, cb = -(-n // bn), -(-k // bk)
    pad = torch.zeros(rb * bn, cb * bk, dtype=torch.float32)
    pad[:n, :k] = w.float()
    tiles = pad.view(rb, bn, cb, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    if scale_dtype == "E8M0":
        byte = _pow2_scale(amax, 448.0)
        s, stored = _exp2(byte), _e8m0(byte)
    elif scale_dtype == "F32":
        s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        stored = s
    else:
        raise ValueError(f"scale_dtype {scale_dtype!r}: E8M0 or F32")
    q = (tiles / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (q.float() * s[:, None, :, None]).view(rb * bn, cb * bk)[:n, :k]
    return q.view(rb * bn, cb * bk)[:n, :k].contiguous(), stored.contiguous(), deq.contiguous()


def quantize_fp4_experts(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float [N, K] -> (I8 [N, K/2] packed E2M1, F8_E8M0 scale [N, K/group], the dequantized float32 weight).

    Per row and group of 32: s = 2^ceil(log2(amax / 6)); each element the nearest E2M1 value of w / s (ties to
    the even code); byte j holds element 2j in the low nibble and 2j+1 in the high nibble; sign in bit 3."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    byte = _pow2_scale(g.abs().amax(-1), 6.0)
    s = _exp2(byte)
    v = g / s[..., None]
    a = v.abs().clamp(max=6.0)
    # nearest E2M1 magnitude, ties to the even code (index): distance, then index parity
    d = (a[..., None] - _E2M1_VALUES).abs()
    best = d.min(-1, keepdim=True).values
    cand = (d == best)
    idx = torch.where(cand & (torch.arange(8) % 2 == 0), torch.arange(8), 99).min(-1).values
    idx = torch.where(idx == 99, torch.where(cand, torch.arange(8), 99).min(-1).values, idx)
    code = idx | ((v < 0) & (idx > 0)).to(torch.int64) << 3
    code = code.reshape(n, k)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    mag = _E2M1_VALUES[idx]
    deq = (torch.where(v < 0, -mag, mag) * s[..., None]).reshape(n, k)
    return packed.contiguous(), _e8m0(byte).contiguous(), deq.contiguous()


def release_tensors(ref: Any, expert_dtype: str = "fp4", block: tuple[int, int] = (128, 128),
                    scale_dtype: str = "E8M0") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``ref``'s weights quantized into DeepSeek-V4's release layout, and the float32 values they stand for.

    Returns (stored tensors in the release's names and dtypes, dequantized float32 tensors in the same names
    without the ``.scale`` entries). FP8 linears (:data:`FP8_LINEARS`): ``X.weight`` F8_E4M3 + ``X.scale``
    (``scale_dtype`` E8M0 or F32, per ``block``); routed experts: ``expert_dtype`` "fp4" (I8 packed + F8_E8M0
    ``.scale`` per 32) or "fp8" (as the dense linears: V4-Flash-Base with ``scale_dtype="F32"``); BF16 norms,
    embeddings, head, router weight, compressors, ``indexer.weights_proj``; F32 ``attn_sink``, ``ape``, ``hc_*``,
    ``gate.bias``; I64 ``tid2eid``."""
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype {expert_dtype!r}: fp4 or fp8")
    stored: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for name, t in release_names(ref.state_dict()).items():
        kind = _release_kind(name)
        base = name[: -len(".weight")]
        if kind == "fp8" or (kind == "expert" and expert_dtype == "fp8"):
            q, s, deq = quantize_fp8_blocks(t, block, scale_dtype)
            stored[name], stored[f"{base}.scale"], values[name] = q, s, deq
        elif kind == "expert":
            q, s, deq = quantize_fp4_experts(t)
            stored[name], stored[f"{base}.scale"], values[name] = q, s, deq
        elif kind == "int":
            stored[name] = values[name] = t.to(torch.int64)
        elif kind == "f32":
            stored[name] = values[name] = t.float().contiguous()
        else:
            stored[name] = t.to(torch.bfloat16).contiguous()
            values[name] = stored[name].float()
    return stored, values


def release_config(expert_dtype: str | None = "fp4", where: str = "top", block: tuple[int, int] = (128, 128),
                   scale_fmt: str | None = "ue8m0") -> dict[str, Any]:
    """:data:`CONFIG` with the release's ``quantization_config``; ``expert_dtype`` at the top level (``where``
    "top", V4), inside ``quantization_config`` ("quantization_config", V4.1 / transformers), or nowhere
    (``expert_dtype`` None)."""
    qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": list(block)}
    if scale_fmt:
        qc["scale_fmt"] = scale_fmt
    cfg = {**CONFIG, "quantization_config": qc}
    if expert_dtype is not None:
        if where == "top":
            cfg["expert_dtype"] = expert_dtype
        else:
            qc["expert_dtype"] = expert_dtype
    return cfg


def write_v4_release(path: Path, ref: Any, expert_dtype: str = "fp4", block: tuple[int, int] = (128, 128),
                     scale_dtype: str = "E8M0", where: str | None = "top",
                     extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Write ``ref`` as a DeepSeek-V4 release checkpoint at ``path`` (see :func:`release_tensors`; config from
    :func:`release_config`, ``where`` None: no ``expert_dtype`` key) and return the dequantized float32
    tensors in the release's names (:func:`set_release_weights` puts them into a transformers model)."""
    from quantplug.testing import write_checkpoint

    stored, values = release_tensors(ref, expert_dtype, block, scale_dtype)
    cfg = release_config(expert_dtype if where else None, where or "top", block,
                         "ue8m0" if scale_dtype == "E8M0" else None)
    write_checkpoint(path, cfg, {**stored, **(extra or {})})
    return values


def set_release_weights(ref: Any, values: dict[str, torch.Tensor]) -> Any:
    """A copy of transformers' ``ref`` holding ``values`` (release names, e.g. :func:`write_v4_release`'s
    dequantized tensors) in place of its own weights."""
    import copy

    out = copy.deepcopy(ref)
    sd = out.state_dict()
    with torch.no_grad():
        for name, t in sd.items():
            mapped = release_names({name: t})
            if name.endswith("experts.gate_up_proj"):
                base = next(iter(mapped)).rsplit(".experts.", 1)[0]
                t.copy_(torch.stack([torch.cat([values[f"{base}.experts.{e}.w1.weight"],
                                                values[f"{base}.experts.{e}.w3.weight"]]) for e in range(t.shape[0])]))
            elif name.endswith("experts.down_proj"):
                base = next(iter(mapped)).rsplit(".experts.", 1)[0]
                t.copy_(torch.stack([values[f"{base}.experts.{e}.w2.weight"] for e in range(t.shape[0])]))
            else:
                (key,) = mapped
                t.copy_(values[key].to(t.dtype))
    return out
