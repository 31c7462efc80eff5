"""Tiny checkpoints of every kind the fuzz suite and the untrusted-input tests mutate."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from quantplug.models.config import parse_model_config
from quantplug.testing import random_state, tiny_config, write_checkpoint

VENDOR = Path(__file__).parents[1] / "data" / "vendor"
IDS = torch.tensor([[3, 17, 42, 99, 5, 150]])


def dense(root: Path, shards: int = 2, **overrides) -> Path:
    cfg = tiny_config(**overrides)
    return write_checkpoint(root, cfg, random_state(cfg), shards=shards)


def gguf(root: Path, **overrides) -> Path:
    from quantplug_expert_pack.export import gguf_state, write_gguf

    cfg = tiny_config(**overrides)
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    write_gguf(root / "model.gguf", gguf_state(random_state(cfg), mc), mc, default_type="Q8_0",
               types={"attn_k_b": "Q4_0"}, vocab=cfg["vocab_size"])  # a vocabulary: the read level decodes it
    return root


def packed(root: Path) -> Path:
    from quantplug_expert_pack.build import build_pack

    gguf(root)
    build_pack(root, progress=False)
    return root


def vendor(root: Path, name: str) -> Path:
    shutil.copytree(VENDOR / name, root)
    return root


def clone(src: Path, dst: Path, changed: str | None = None) -> Path:
    """``dst`` holding ``src``'s files, hard-linked, except ``changed`` (written by the caller)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != changed:
            os.link(f, dst / f.name)
    return dst
