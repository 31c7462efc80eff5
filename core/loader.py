"""Execute a LoadPlan: zero-copy views where tensors are used as stored, streamed conversion
into preallocated parameters otherwise, then post-processing.

Load option ``mmap`` (default true): a tensor used exactly as stored is a zero-copy view of the
memory-mapped file, costing no memory of its own but tied to the file: a file truncated or
rewritten after the load (a network or otherwise changing file system) kills the process with
SIGBUS on the next forward that touches the lost pages (safetensors' own loader does the same;
llama.cpp offers ``--no-mmap``). ``mmap=False`` reads every tensor with ``preadv`` into memory of
its own: no SIGBUS, at the cost of that memory (the model's bytes as anonymous memory instead of
shared page cache) and of the copy at load.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import experts, parallel
from .checkpoint import TORCH_DTYPES, qpack
from .checkpoint.gguf_index import GGUF_FLOATS
from .contract.options import TakesOptions
from .errors import CheckpointError, LoadError
from .layers.linear import PlannedModule
from .lower import accelerate
from .memory import read_into
from .plan import LoadPlan, ParamPlan, build_plan
from .plugins import PluginManager, get_plugin_manager
from .stats import expose_stats
from .types import TensorInfo

#: bytes read per ``preadv`` when a tensor is converted (bounded staging: peak memory stays at
#: the model plus this, and the converted chunk is still in cache when it is copied)
STAGE_BYTES = 16 << 20


class _Stage:
    """One reusable staging buffer per load."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
        return self.buf[:nbytes]


def _stream(plan: LoadPlan, info: TensorInfo, dst: torch.Tensor, stage: _Stage) -> None:
    """Read a safetensors (or float GGUF) tensor with ``preadv`` and convert it into contiguous CPU ``dst``,
    in chunks of at most STAGE_BYTES (no memory map: source pages never count as ours)."""
    src_dtype = GGUF_FLOATS[info.dtype] if info.format == "gguf" else TORCH_DTYPES[info.dtype]
    fd = plan.checkpoint.fd(info.file)
    flat = dst.view(-1)
    if src_dtype == dst.dtype:
        read_into(fd, info.offset, flat)
        return
    item = src_dtype.itemsize
    per = max(1, STAGE_BYTES // item)
    for start in range(0, info.numel, per):
        count = min(per, info.numel - start)
        buf = stage.get(count * item).view(src_dtype)
        read_into(fd, info.offset + start * item, buf)
        flat[start:start + count].copy_(buf)


def _private(plan: LoadPlan, info: TensorInfo) -> torch.Tensor:
    """The tensor as :meth:`Checkpoint.tensor` gives it (dtype and shape; GGUF blocks as
    [..., row_bytes]), but read with ``preadv`` into memory of its own: no memory map (option
    ``mmap=False``)."""
    return plan.checkpoint.read(info)[1]


def _materialize(plan: LoadPlan, pp: ParamPlan, device: torch.device, stage: _Stage) -> torch.Tensor:
    ckpt = plan.checkpoint
    mapped = plan.options.mmap
    for _, info in pp.sources:  # an expert pack's payloads: sha256 checked on first read
        qpack.verify(ckpt, info)
    if pp.sources[0][0].slices is not None:  # a tensor-parallel slice: read only its byte ranges
        return parallel.materialize_sliced(plan, pp, device, stage, STAGE_BYTES)
    if pp.zero_copy and device.type == "cpu":
        src, info = pp.sources[0]
        if mapped:  # a view of the file's pages: no memory of its own, but the file must not shrink
            t = ckpt.tensor(info)
            return t.narrow(*src.narrow) if src.narrow is not None else t
        t = _private(plan, info)  # mmap=False: one copy, owned
        return t.narrow(*src.narrow).clone() if src.narrow is not None else t
    out = torch.empty(pp.shape, dtype=pp.dtype, device=device)
    for src, info in pp.sources:
        dst = out if src.slot is None else out[src.slot]
        if (src.narrow is None and device.type == "cpu" and dst.is_contiguous() and dst.numel() == info.numel
                and (info.format == "safetensors" or info.dtype in GGUF_FLOATS)):
            _stream(plan, info, dst, stage)
            continue
        t = ckpt.tensor(info) if mapped else _private(plan, info)
        if src.narrow is not None:
            t = t.narrow(*src.narrow)
        dst.copy_(t)  # converts dtype and device in one pass
    return out


def execute(plan: LoadPlan, *, device: str | torch.device = "cpu",
            plugin_manager: PluginManager | None = None, progress: bool | None = None) -> nn.Module:
    """Load every parameter of ``plan`` and return the ready model (plan attached)."""
    return _execute(plan, device, plugin_manager, progress)[0]


def _execute(plan: LoadPlan, device: str | torch.device, plugin_manager: PluginManager | None,
             progress: bool | None) -> tuple[nn.Module, set[int]]:
    """:func:`execute`, and the ids of the parameter plans served on demand (not loaded)."""
    plan.raise_for_problems()
    pm = plugin_manager or get_plugin_manager()
    dev = torch.device(device)
    model = plan.model
    show = sys.stderr.isatty() if progress is None else progress
    served: set[int] = set()
    cache = None
    budget = plan.options.expert_cache_mb
    if budget > 0:  # routed experts read on demand from the checkpoint's files (quantplug.experts)
        served, cache, kept = experts.attach(plan, model, int(budget * (1 << 20)), readers=plan.options.expert_readers)
        for why in kept:
            warnings.warn(f"expert_cache_mb: routed experts of {why}; they are loaded into memory", stacklevel=3)
    for mod in model.modules():  # the load's options, to the modules that take them (declared fields)
        if isinstance(mod, TakesOptions):
            mod.qp_configure(plan.options)
    # shard by shard: sorting by (file, offset) turns reads into one forward sweep per file
    order = sorted((p for p in plan.params if id(p) not in served),
                   key=lambda p: (str(p.sources[0][1].file), p.sources[0][1].offset))
    bar: Any = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=sum(p.nbytes for p in order), unit="B", unit_scale=True, desc="loading", file=sys.stderr)
    stage = _Stage()
    plan.checkpoint.check_unchanged()  # a file replaced or shrunk since its header was read: LoadError
    for pp in order:
        try:
            t = _materialize(plan, pp, dev, stage)
        except qpack.ChecksumError:
            raise  # names the pack, the tensor and the expert already
        except (RuntimeError, OSError, CheckpointError) as exc:
            src, info = pp.sources[0]
            raise LoadError(f"{info.where()} ({info.file}): cannot load into {pp.param} ({exc})") from None
        pp.module.register_parameter(pp.local, nn.Parameter(t, requires_grad=False))
        if bar is not None:
            bar.update(pp.nbytes)
    if bar is not None:
        bar.close()
    if plan.parallel is not None:
        plan.parallel.finish_params()
    for mod in model.modules():
        if isinstance(mod, PlannedModule):
            mod.qp_finish()
    for mod in model.modules():  # sibling projections a scheme runs as one (LinearScheme.fuse)
        fuse = getattr(mod, "qp_fuse", None)
        if fuse is not None:
            fuse()
    accelerate(model)  # the blocks' native steps (quantplug.lower)
    model.to(dev)
    pm.backend_all(plan.backend, "quantplug_process_after_loading", model=model, quant_config=plan.quant_config,
                   options=plan.options)
    model.eval()
    if cache is not None:
        expose_stats(model, "expert_cache", cache)
    model.quantplug_plan = plan  # type: ignore[assignment]
    model.decisions = plan.decisions  # type: ignore[assignment]
    return model, served


def load(path: str | Path, *, backend: str | None = None, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", options: Mapping[str, Any] | None = None,
         plugin_manager: PluginManager | None = None, progress: bool | None = None,
         group: Any = None) -> nn.Module:
    """Plan (headers only, every problem raised together) then load; returns the torch module.

    ``model(input_ids)`` with a LongTensor [B, T] returns logits [B, T, vocab]; the module
    carries ``quantplug_plan``, ``decisions`` and ``load_report`` (rank, world_size, bytes_read,
    experts_on_demand_bytes: the routed experts left in the files for ``expert_cache_mb``).

    Under an initialized ``torch.distributed`` default group of world size N > 1 (or
    ``group=``), the model is split over the ranks (``quantplug.parallel``): each rank reads only
    its share, and ``model(input_ids)``, called on every rank with the same ids, returns the
    full logits on every rank. A rank that fails while planning or loading makes every rank
    raise (no rank is left waiting in a collective); a rank whose forward or generate step raises
    makes the others raise :class:`~quantplug.errors.ParallelError` naming it, and a rank that does
    not reach a forward collective within ``tp_timeout_s`` (default 60 s) is named by the others.
    """
    t0 = time.perf_counter()
    comm = parallel.resolve_group(group)
    if comm is None:
        p = build_plan(path, backend=backend, options=options, dtype=dtype, plugin_manager=plugin_manager)
        model, served = _execute(p, device, plugin_manager, progress)
    else:
        # every rank bounds its forward collectives and shares failures through the store; a
        # failure here (a BaseException too: a Rust library's panic) reaches every rank's agree
        comm.watch(_timeout(options))
        err: BaseException | None = None
        try:
            p = build_plan(path, backend=backend, options=options, dtype=dtype, plugin_manager=plugin_manager,
                           world_size=comm.world, rank=comm.rank, comm=comm)
            p.raise_for_problems()
        except BaseException as exc:  # noqa: BLE001 (re-raised by agree, after telling the other ranks)
            err = exc
        comm.agree(err, "planning")
        try:
            model, served = _execute(p, device, plugin_manager, progress if comm.rank == 0 else False)
        except BaseException as exc:  # noqa: BLE001
            err = exc
        comm.agree(err, "loading")
        comm.timeout_s = p.options.tp_timeout_s
        parallel.guard_model(model, comm)
        parallel.remember(comm)
    model.load_seconds = time.perf_counter() - t0  # type: ignore[assignment]
    model.load_report = {  # type: ignore[assignment]
        "rank": comm.rank if comm else 0, "world_size": comm.world if comm else 1,
        "bytes_read": sum(parallel.source_bytes(s, i) for pp in p.params if id(pp) not in served
                          for s, i in pp.sources),
        "experts_on_demand_bytes": sum(parallel.source_bytes(s, i) for pp in p.params if id(pp) in served
                                       for s, i in pp.sources)}
    return model


def _timeout(options: Mapping[str, Any] | None) -> float:
    """``tp_timeout_s`` as given (checked again, with every option, by the plan), else its default."""
    from .contract.options import CORE_OPTIONS

    spec = next(o for o in CORE_OPTIONS if o.name == "tp_timeout_s")
    try:
        return float(spec.convert((options or {}).get("tp_timeout_s", spec.default)))
    except ValueError:
        return float(spec.default)  # the plan reports the bad value on every rank


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
