"""Shared fixtures: tiny checkpoints, a transformers reference, a fresh plugin manager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quantplug.plugins import PluginManager, reset_plugin_manager

VENDOR = Path(__file__).parent / "data" / "vendor"


@pytest.fixture(autouse=True)
def _fresh_default_manager():
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture
def pm() -> PluginManager:
    """A plugin manager with the core defaults only (no entry points)."""
    return PluginManager(entry_points=False, env={})


def hf_logits(cfg: dict, state: dict, ids: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV3ForCausalLM on the same weights (fused expert layout), fp32 eager."""
    from quantplug.testing import to_layout
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hc = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    hc._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hc).eval()
    sd = to_layout(state, "fused")
    if cfg.get("tie_word_embeddings"):
        sd = dict(sd)
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not missing, missing
    with torch.no_grad():
        return model(ids).logits


def load_logits(path, ids: torch.Tensor, **kw):
    """quantplug.load(path, **kw) and its logits on ids."""
    import quantplug

    model = quantplug.load(path, **kw)
    with torch.no_grad():
        return model, model(ids)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())
