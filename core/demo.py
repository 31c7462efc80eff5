"""``quantplug demo``: tiny checkpoints in every format whose backend can export, loaded and
compared with the dense model they came from."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .loader import load, model_bytes
from .plan import build_plan
from .plugins import PluginManager, get_plugin_manager
from .testing import hub_rope_spelling, random_state, tiny_config, write_checkpoint


@dataclass
class DemoRow:
    format: str
    backend: str
    bytes: int
    model_bytes: int
    plan_ms: float
    load_ms: float
    max_rel_err: float
    note: str = ""


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors")) + sum(
        p.stat().st_size for p in path.rglob("*.gguf")) + sum(p.stat().st_size for p in path.rglob("*.qpack"))


def _measure(path: Path, fmt: str, backend: str | None, ids: torch.Tensor, ref: torch.Tensor | None,
             pm: PluginManager, options: dict | None = None) -> tuple[DemoRow, torch.Tensor]:
    t0 = time.perf_counter()
    build_plan(path, backend=backend, options=options, plugin_manager=pm)
    plan_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    model = load(path, backend=backend, options=options, plugin_manager=pm, progress=False)
    load_ms = (time.perf_counter() - t0) * 1000
    with torch.no_grad():
        logits = model(ids)
    err = 0.0 if ref is None else float((logits - ref).abs().max() / ref.abs().max())
    plan: Any = model.quantplug_plan
    name = plan.backend or "dense"
    return DemoRow(fmt, name, _dir_bytes(path), model_bytes(model), plan_ms, load_ms, err), logits


def _served(path: Path, backend: str, pm: PluginManager) -> dict | None:
    """The options of an export with an expert pack: its routed experts served from the pack through
    the expert cache (``expert_cache_mb``: two steps of a layer), which is what a pack is for;
    None (defaults: experts in memory) for any other export."""
    if not any(path.glob("*.qpack")):
        return None
    from .experts import step_bytes

    return {"expert_cache_mb": 2 * step_bytes(build_plan(path, backend=backend, plugin_manager=pm)) / (1 << 20)}


def run_demo(workdir: Path | None = None, seed: int = 0) -> list[DemoRow]:
    pm = get_plugin_manager()
    tmp = tempfile.TemporaryDirectory(prefix="quantplug-demo-") if workdir is None else None
    root = Path(tmp.name) if tmp else Path(workdir)  # type: ignore[arg-type]
    try:
        cfg = tiny_config(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                          q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                          v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
        dense_dir = write_checkpoint(root / "dense", hub_rope_spelling(cfg), random_state(cfg, seed))
        ids = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(seed))
        dense_row, ref = _measure(dense_dir, "dense (safetensors, hub layout)", None, ids, None, pm)
        rows = [dense_row]
        dense_model = load(dense_dir, plugin_manager=pm, progress=False)
        dense_plan: Any = dense_model.quantplug_plan
        for rec in pm.records():
            if not pm.implements(rec.name, "quantplug_export"):
                continue
            out = root / rec.name
            out.mkdir()
            for res in pm.export(rec.name, model=dense_model, destination=out, plan=dense_plan):
                row, _ = _measure(res.path, res.format, rec.name, ids, ref, pm, _served(res.path, rec.name, pm))
                rows.append(row)
        return rows
    finally:
        if tmp is not None:
            tmp.cleanup()


def format_rows(rows: list[DemoRow]) -> str:
    head = ("format", "backend", "file bytes", "in-memory bytes", "plan ms", "load ms", "max rel err vs dense")
    body = [(r.format, r.backend, f"{r.bytes:,}", f"{r.model_bytes:,}", f"{r.plan_ms:.1f}", f"{r.load_ms:.1f}",
             f"{r.max_rel_err:.2e}") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(lines)
