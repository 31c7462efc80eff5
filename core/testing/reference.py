"""The transformers reference: ``DeepseekV3ForCausalLM`` (fp32, eager attention) on given weights.

Independent of quantplug's model code: a backend's dense weights (``quantplug.api.dense_state``
of the loaded model, prefix removed) run through transformers' own implementation. Needs
``transformers`` (5.x) at call time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import to_layout


def hf_logits(cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV3ForCausalLM on ``state`` (text names, hub or fused experts), fp32 eager.

    ``cfg`` is a text config.json dict (``tiny_config()`` spelling or the hub's). Every
    parameter of the transformers model must be in ``state`` and nothing else: an
    ``AssertionError`` lists what is missing or unexpected.
    """
    model = hf_model(cfg, state)
    with torch.no_grad():
        out: torch.Tensor = model(ids).logits
    return out


def hf_model(cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' model of ``cfg`` with the weights of ``state`` (see :func:`hf_logits`), fp32
    eager, in eval mode: DeepseekV3ForCausalLM, or DeepseekV32ForCausalLM for a DeepSeek-V3.2 config
    (DSA, ``quantplug.testing.is_dsa``)."""
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
    )

    from . import is_dsa

    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")}
    model: torch.nn.Module
    if is_dsa(cfg):
        hc32 = DeepseekV32Config(**kw)
        hc32._attn_implementation = "eager"
        model = DeepseekV32ForCausalLM(hc32).eval()
    else:
        hc = DeepseekV3Config(**kw)
        hc._attn_implementation = "eager"
        model = DeepseekV3ForCausalLM(hc).eval()
    sd = to_layout({k: v.float() for k, v in state.items()}, "fused")
    if cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, f"the reference got tensors transformers does not have: {sorted(unexpected)[:5]}"
    assert not missing, f"the reference lacks tensors transformers needs: {sorted(missing)[:5]}"
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (0 when both are zero)."""
    denom = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    return diff / denom if denom else diff
