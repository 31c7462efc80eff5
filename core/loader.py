"""Execute a LoadPlan: zero-copy views where tensors are used as stored, streamed conversion
into preallocated parameters otherwise, then post-processing."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import LoadError
from .layers.linear import PlannedModule
from .plan import LoadPlan, ParamPlan, build_plan
from .plugins import PluginManager, get_plugin_manager


def _materialize(plan: LoadPlan, pp: ParamPlan, device: torch.device) -> torch.Tensor:
    ckpt = plan.checkpoint
    if pp.zero_copy and device.type == "cpu":
        src, info = pp.sources[0]
        t = ckpt.tensor(info)
        if src.narrow is not None:
            t = t.narrow(*src.narrow)
        return t
    out = torch.empty(pp.shape, dtype=pp.dtype, device=device)
    for src, info in pp.sources:
        t = ckpt.tensor(info)
        if src.narrow is not None:
            t = t.narrow(*src.narrow)
        dst = out if src.index is None else out[src.index]
        dst.copy_(t)  # converts dtype and device in one pass
    return out


def execute(plan: LoadPlan, *, device: str | torch.device = "cpu",
            plugin_manager: PluginManager | None = None, progress: bool | None = None) -> nn.Module:
    """Load every parameter of ``plan`` and return the ready model (plan attached)."""
    plan.raise_for_problems()
    pm = plugin_manager or get_plugin_manager()
    dev = torch.device(device)
    model = plan.model
    show = sys.stderr.isatty() if progress is None else progress
    # shard by shard: sorting by (file, offset) turns reads into one forward sweep per file
    order = sorted(plan.params, key=lambda p: (str(p.sources[0][1].file), p.sources[0][1].offset))
    bar: Any = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=sum(p.nbytes for p in order), unit="B", unit_scale=True, desc="loading", file=sys.stderr)
    for pp in order:
        try:
            t = _materialize(plan, pp, dev)
        except RuntimeError as exc:
            src, info = pp.sources[0]
            raise LoadError(f"{info.where()}: cannot load into {pp.param} ({exc})") from None
        pp.module.register_parameter(pp.local, nn.Parameter(t, requires_grad=False))
        if bar is not None:
            bar.update(pp.nbytes)
    if bar is not None:
        bar.close()
    for mod in model.modules():
        if isinstance(mod, PlannedModule):
            mod.qp_finish()
    model.to(dev)
    pm.backend_all(plan.backend, "quantplug_process_after_loading", model=model, quant_config=plan.quant_config,
                   options=plan.options)
    model.eval()
    model.quantplug_plan = plan  # type: ignore[assignment]
    model.decisions = plan.decisions  # type: ignore[assignment]
    return model


def load(path: str | Path, *, backend: str | None = None, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", options: Mapping[str, Any] | None = None,
         plugin_manager: PluginManager | None = None, progress: bool | None = None) -> nn.Module:
    """Plan (headers only, every problem raised together) then load; returns the torch module.

    ``model(input_ids)`` with a LongTensor [B, T] returns logits [B, T, vocab]; the module
    carries ``quantplug_plan`` and ``decisions``.
    """
    t0 = time.perf_counter()
    p = build_plan(path, backend=backend, options=options, dtype=dtype, plugin_manager=plugin_manager)
    model = execute(p, device=device, plugin_manager=plugin_manager, progress=progress)
    model.load_seconds = time.perf_counter() - t0  # type: ignore[assignment]
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes held by parameters and buffers (shared storage counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = int(t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
