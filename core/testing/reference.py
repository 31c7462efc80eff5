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
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hc = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")})
    hc._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hc).eval()
    sd = to_layout({k: v.float() for k, v in state.items()}, "fused")
    if cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, f"the reference got tensors transformers does not have: {sorted(unexpected)[:5]}"
    assert not missing, f"the reference lacks tensors transformers needs: {sorted(missing)[:5]}"
    with torch.no_grad():
        out: torch.Tensor = model(ids).logits
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (0 when both are zero)."""
    denom = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    return diff / denom if denom else diff
