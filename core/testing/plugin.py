"""quantplug's pytest plugin (``pytest11`` entry point ``quantplug``): fixtures for backend tests.

Loaded automatically by pytest wherever quantplug is installed (``-p no:quantplug`` turns it
off). The conformance kit itself is a class, ``quantplug.testing.BackendConformance``; these
fixtures are for a backend's own further tests:

* ``quantplug_tiny_checkpoint(layout="deepseek_v3", **config)``: a tiny dense checkpoint
  (layouts: ``deepseek_v3`` hub spelling, ``fused`` transformers-5 experts, ``kimi_k25`` wrapper
  with vision tensors, ``tied`` embeddings, ``sharded`` with an index) -> (path, config, state);
* ``quantplug_reference``: :func:`quantplug.testing.reference.hf_logits` (transformers);
* ``quantplug_plugin_manager({name: plugin})``: an isolated manager (core defaults + those);
* ``quantplug_distribution(dist, version, {ep_name: module}, modules={name: source})``: a
  throwaway installed distribution on ``sys.path`` for the test, so the backend is found through
  its ``quantplug.backends`` entry point as after ``pip install``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pytest loads this plugin in every session: torch only when a fixture is used
    import torch

LAYOUTS = ("deepseek_v3", "fused", "kimi_k25", "tied", "sharded")


@pytest.fixture
def quantplug_tiny_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, dict[str, Any], dict[str, torch.Tensor]]]:
    from . import hub_rope_spelling, random_state, tiny_config, to_layout, wrap_kimi, write_checkpoint

    counter = iter(range(1 << 30))

    def make(layout: str = "deepseek_v3", seed: int = 0,
             **overrides: Any) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
        if layout == "tied":
            overrides.setdefault("tie_word_embeddings", True)
        cfg = tiny_config(**overrides)
        state = random_state(cfg, seed)
        config: dict[str, Any] = hub_rope_spelling(cfg)
        if layout == "fused":
            config, state = cfg, to_layout(state, "fused")
        elif layout == "kimi_k25":
            config, state = wrap_kimi(hub_rope_spelling(cfg), state)
        path = write_checkpoint(tmp_path / f"{layout}-{next(counter)}", config, state,
                                shards=3 if layout == "sharded" else 1)
        return path, config, state

    return make


@pytest.fixture
def quantplug_reference() -> Callable[..., torch.Tensor]:
    from .reference import hf_logits

    return hf_logits


@pytest.fixture
def quantplug_plugin_manager() -> Callable[..., Any]:
    from .probes import isolated_plugin_manager

    return isolated_plugin_manager


@pytest.fixture
def quantplug_distribution(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    from .probes import installed, write_distribution

    with ExitStack() as stack:
        def install(dist: str, version: str, entry_points: Mapping[str, str],
                    modules: Mapping[str, str] | None = None) -> Path:
            site = tmp_path / f"site-{dist}-{version}"
            write_distribution(site, dist, version, entry_points, modules)
            stack.enter_context(installed(site))
            return site

        yield install
