"""Tiny DeepSeek-V3 checkpoints with DeepSeek's MLA dimensions (kv_lora 512, rope 64, nope 128,
v 128) in every installed exporting backend's format, each written by that backend's own
``quantplug_export``: the set the engine integrations (the vLLM plugin, the transformers bridge)
are tested on. Needs only quantplug and the backends; the engines are not imported here."""

from __future__ import annotations

import importlib.metadata as md
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..loader import load
from ..plugins import ENTRY_POINT_GROUP
from . import random_state, tiny_config, write_checkpoint
from .probes import isolated_plugin_manager


def mla_config(**overrides: Any) -> dict[str, Any]:
    """A 3-layer DeepSeek-V3 config.json with the released model's MLA dimensions (4 heads, hidden
    256, 8 routed experts of 128, top-2 over 2 groups, one shared expert, vocabulary 256)."""
    cfg = tiny_config(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                      n_group=2, topk_group=1, num_hidden_layers=3, first_k_dense_replace=1)
    cfg.update(overrides)
    return cfg


class Export(NamedTuple):
    """One checkpoint of the set: ``label`` (also its directory name), the backend that writes it
    (None: the dense source itself), that backend's export options and which of its export results."""

    label: str
    backend: str | None
    options: Mapping[str, Any]
    pick: int = 0
    #: the format keeps its weights in 4 bits or fewer, FP8, or ggml blocks (the engines' memory bound)
    packed: bool = False


#: every bundled backend's export (and the worked third-party example's), one row per format
EXPORTS: tuple[Export, ...] = (
    Export("dense", None, {}),
    Export("compressed-tensors-w4a16", "compressed_tensors", {}, packed=True),
    Export("fp8-block", "fp8", {}, packed=True),
    Export("gguf-q8_0", "expert_pack", {"pack": False}, packed=True),
    Export("gguf-q4_0", "expert_pack", {"pack": False, "type": "Q4_0"}, packed=True),
    Export("gguf-q8_0-expert-pack", "expert_pack", {}, pick=1, packed=True),
    Export("modelslim-w4a8", "modelslim", {"recipes": ["w4a8"]}, packed=True),
    Export("modelslim-w8a8", "modelslim", {"recipes": ["w8a8"]}),
    Export("quark-mxfp4", "quark", {}, packed=True),
    Export("modelopt-w4a16-nvfp4", "modelopt", {}, packed=True),
    Export("modelopt-nvfp4", "modelopt", {"algo": "NVFP4"}, packed=True),
    Export("modelopt-fp8", "modelopt", {"algo": "FP8"}, packed=True),
    Export("gptq-int4", "gptq", {}, packed=True),
    Export("awq-int4", "awq", {}, packed=True),
    Export("acme-int8", "acme", {}),
)


def installed_backends() -> dict[str, Any]:
    """Entry-point name -> loaded plugin object, for every installed ``quantplug.backends`` entry point."""
    return {ep.name: ep.load() for ep in md.entry_points(group=ENTRY_POINT_GROUP)}


def export_formats(root: str | Path, config: Mapping[str, Any] | None = None, *, seed: int = 0,
                   dtype: torch.dtype = torch.bfloat16, only: Iterable[str] | None = None) -> dict[str, Path]:
    """Write the dense checkpoint (``config``, default :func:`mla_config`; random weights of
    ``seed``; floats stored in ``dtype``) under ``root/dense``, then each :data:`EXPORTS` row whose
    backend is installed, through that backend's own ``quantplug_export`` in an isolated plugin
    manager, under ``root/<label>``. ``only``: labels to write (default all). Returns label -> path."""
    root = Path(root)
    cfg = dict(config or mla_config())
    wanted = set(only) if only is not None else None
    dense = write_checkpoint(root / "dense", cfg, random_state(cfg, seed), dtype=dtype)
    out: dict[str, Path] = {"dense": dense} if wanted is None or "dense" in wanted else {}
    backends = installed_backends()
    model: Any = None
    for row in EXPORTS:
        if row.backend is None or row.backend not in backends or (wanted is not None and row.label not in wanted):
            continue
        if model is None:
            model = load(dense, plugin_manager=isolated_plugin_manager(), progress=False)
        pm = isolated_plugin_manager({row.backend: backends[row.backend]})
        scratch = root / f".{row.label}.export"
        scratch.mkdir(parents=True)
        plan = model.quantplug_plan
        res = pm.export(row.backend, model=model, destination=scratch, plan=plan, options=row.options)[row.pick]
        shutil.copytree(res.path, root / row.label)
        shutil.rmtree(scratch)
        out[row.label] = root / row.label
    return out


def checkpoint_bytes(path: str | Path) -> int:
    """Bytes of a checkpoint's weight files (safetensors, GGUF, expert packs)."""
    p = Path(path)
    return sum(f.stat().st_size for ext in ("*.safetensors", "*.gguf", "*.qpack") for f in p.rglob(ext))
