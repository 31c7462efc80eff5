"""Tiny Kimi-K3 / Kimi-Linear checkpoints for the tests of formats, tensor parallelism and served
experts: quantplug.testing.kimi's canonical configs and random weights (release names), with 4 KDA
and 4 MLA heads (they divide over 2 and 4 ranks), plus the K3 release's own format
(:func:`write_k3_release`) and transformers' Kimi-Linear as a reference.

Every linear's input is a multiple of 32 (MXFP4 / int4 groups, ggml blocks) and every output even
(ModelSlim W4A8 packs two output rows per byte). Layer 0 is KDA and layer 3 MLA in both models.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from quantplug.testing import kimi as canon
from quantplug.testing import write_checkpoint
from quantplug.testing.kimi import release_dtypes

__all__ = ["k3_config", "kimi_linear_config", "kimi_state", "release_dtypes", "transformers_kimi_linear",
           "write_k3_release"]

HEADS = 4


def k3_config(**text: Any) -> dict[str, Any]:
    """quantplug.testing.kimi's Kimi-K3 (5 layers: KDA 0-2, MLA 3-4, latent MoE, SiTU, attention
    residuals, bounded forget gate, full-rank KDA gate) with 4 KDA and 4 MLA heads; ``text``
    overrides ``text_config`` (``linear_attn_config`` merged key by key)."""
    lin = {"num_heads": HEADS, **(text.pop("linear_attn_config", None) or {})}
    return canon.kimi_k3_config(**{"num_attention_heads": HEADS, "num_key_value_heads": HEADS,
                                   "linear_attn_config": lin, **text})


def kimi_linear_config(**over: Any) -> dict[str, Any]:
    """quantplug.testing.kimi's Kimi-Linear (4 layers: KDA 0 and 2, MLA 1 and 3) with 4 KDA and 4
    MLA heads."""
    lin = {"num_heads": HEADS, **(over.pop("linear_attn_config", None) or {})}
    return canon.kimi_linear_config(**{"num_attention_heads": HEADS, "num_key_value_heads": HEADS,
                                       "linear_attn_config": lin, **over})


def kimi_state(cfg: dict[str, Any], seed: int = 0, **kw: Any) -> dict[str, torch.Tensor]:
    """Random float32 weights of ``cfg`` (K3 or Kimi-Linear), release names."""
    if "text_config" in cfg:
        return canon.kimi_k3_state(cfg, seed, **kw)
    return canon.kimi_linear_state(cfg, seed)


def transformers_kimi_linear(cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' ``KimiLinearForCausalLM`` (float32, eager, eval) holding ``state`` (a Kimi-Linear
    checkpoint's tensors in the release's names, renamed by quantplug.testing.kimi.release_to_hf)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    hc = KimiLinearConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")})
    hc._attn_implementation = "eager"
    model = KimiLinearForCausalLM(hc).float().eval()
    model.load_state_dict(canon.release_to_hf({k: v.float() for k, v in state.items()}), strict=True)
    return model


def _mxfp4_scale(w: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' MXFP4 weight scale per 32 along the input: the power of two
    ``2^(floor(log2(amax)) - 2)`` (its ``round_to_power_2`` rule, e8m0 exponent clamped to [0, 255])."""
    amax = w.float().unflatten(-1, (-1, 32)).abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny)
    e = (127 + torch.floor(torch.log2(amax)) - 2).clamp(0, 255)
    return torch.exp2(e - 127)


def write_k3_release(path: Path, cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[Path, Path]:
    """Kimi-K3 as released: compressed-tensors ``mxfp4-pack-quantized`` on the routed experts only,
    each packed by compressed-tensors' own ``MXFP4PackedCompressor`` (``weight_packed`` uint8
    [out, in/2], low nibble = even column; ``weight_scale`` uint8 E8M0 [out, in/32]), every other
    tensor in the release's dtypes (bfloat16; convolutions, dt_bias, A_log float32), the config's
    ``ignore`` listing every non-expert linear by name (the modules llm-compressor left out), the
    quantization_config inside ``text_config`` and again at the top level.

    Returns (the release, its dequantized twin): the same model with every tensor in float32, the
    experts decoded by the compressor's ``decompress`` (float32 scales: exact)."""
    import re

    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
               "dynamic": False, "scale_dtype": "torch.uint8"}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    expert = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
    linear = re.compile(r"(_proj|_proj_with_mqa|lm_head|\.w[123])\.weight$")
    rel = release_dtypes(state)
    packed: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in rel.items():
        if not expert.search(name):
            packed[name], deq[name] = t, t.float()
            continue
        base = name.removesuffix(".weight")
        w = t.float()
        sd = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": _mxfp4_scale(w)}, scheme)
        packed.update({f"{base}.{k}": v for k, v in sd.items()})
        back = MXFP4PackedCompressor.decompress({k: v.clone() for k, v in sd.items()}, scheme)
        deq[name] = back["weight"].float()
    ignore = sorted(n.removesuffix(".weight") for n, t in state.items()
                    if linear.search(n) and t.dim() == 2 and not expert.search(n) and "_res_proj" not in n)
    qc = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                        "output_activations": None, "format": "mxfp4-pack-quantized"}},
          "ignore": ignore, "kv_cache_scheme": None}
    qcfg = copy.deepcopy(cfg)
    qcfg["text_config"]["quantization_config"] = qc
    qcfg["quantization_config"] = qc
    release = write_checkpoint(Path(path), qcfg, packed)
    dense = write_checkpoint(Path(str(path) + "-dequantized"), cfg, deq)
    return release, dense
