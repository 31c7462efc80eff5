"""Shared fixtures: tiny checkpoints, a transformers reference, a fresh plugin manager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quantplug.plugins import PluginManager, reset_plugin_manager
from quantplug.testing.reference import hf_logits, rel_err

__all__ = ["VENDOR", "hf_logits", "load_logits", "rel_err"]  # the transformers reference is quantplug.testing's

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


def load_logits(path, ids: torch.Tensor, **kw):
    """quantplug.load(path, **kw) and its logits on ids."""
    import quantplug

    model = quantplug.load(path, **kw)
    with torch.no_grad():
        return model, model(ids)
