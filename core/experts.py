"""Routed experts served from the checkpoint's own files through one bounded cache.

A DeepSeek-V3 / Kimi-K2 checkpoint is 0.4-1.3 TB, ~95% of it routed experts, of which a token
uses 8 per layer. With the load option ``expert_cache_mb`` > 0 the loader does not read the
routed experts: each MoE layer gets an :class:`ExpertStore` that knows, for each of this rank's
experts, the byte ranges of its stored tensors in the checkpoint's files (hub per-expert
tensors: whole tensors; fused 3-D tensors and GGUF ``*_exps``: one expert's slab, a fused
gate/up half as its contiguous rows), for every backend alike: the store reads exactly what the
plan would have loaded. One :class:`ExpertCache` per model holds experts packed, as the scheme
keeps them after loading (``process_after_loading`` runs per expert, forms are bound per
expert), within the budget, least recently used first out.

Reads are positional (``preadv``), submitted together for all of a step's missing experts of a
layer to a small thread pool (reads of different experts overlap each other and the compute of
the experts already resident), and a decode step prefetches the next MoE layer's likely experts
from its router applied to the current hidden state (load option ``expert_prefetch``), so the
reads overlap this layer's compute. A caller's experts stay pinned until its next request, so a
concurrent request never evicts experts in use.

Expert packs (``quantplug expert-pack build``) are storage in front of this one cache, for what
they add: one contiguous file of experts with checksums and alignment. A version-2 pack is named
by the safetensors index, a version-1 (GGUF) pack added by its backend
(``Checkpoint.add_pack``); either way its payloads are the checkpoint's per-expert tensors, read
here like any other, each payload's sha256 checked on first read.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from .checkpoint import qpack, storage_shape
from .checkpoint.gguf_index import GGUF_FLOATS
from .contract.experts import RoutedExpertStacks
from .errors import LoadError
from .kernels import compute
from .layers.activation import SILU
from .layers.linear import StackedLayout, StackedLinear
from .types import TensorInfo

#: the projections of a routed expert, in the order their entries hold them
PROJS = ("gate_proj", "up_proj", "down_proj")
#: reader threads: enough to keep an NVMe queue busy without crowding the compute threads
READERS = 4


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One stored tensor of one expert: its bytes in the checkpoint and the parameter it becomes."""

    info: TensorInfo
    dtype: torch.dtype  # the parameter's dtype (the plan's, conversion included)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in storage_shape(self.info) if self.info.format == "gguf" else self.info.shape:
            n *= d
        return n if self.info.format != "gguf" or self.info.dtype in GGUF_FLOATS else self.info.nbytes


def _slot_pieces(pp: Any, n: int) -> list[_Piece] | str:
    """The bytes of each of stacked parameter ``pp``'s ``n`` slots as one piece each, or why not."""
    sources = pp.sources
    if any(s.slot is not None for s, _ in sources):  # one stored tensor per expert
        by_slot: dict[int, list[tuple[Any, TensorInfo]]] = {}
        for s, i in sources:
            by_slot.setdefault(s.slot, []).append((s, i))
        out = []
        for slot in range(n):
            hit = by_slot.get(slot, [])
            if len(hit) != 1 or hit[0][0].slices is not None or hit[0][0].narrow is not None:
                return f"slot {slot} is not one whole stored tensor"
            out.append(_Piece(hit[0][1], pp.dtype))
        return out
    if len(sources) != 1:
        return f"{len(sources)} stored tensors feed it"
    src, info = sources[0]
    first = 0
    if src.slices is not None:  # expert parallel over a stacked tensor: this rank's contiguous slots
        if len(src.slices) != 1 or src.slices[0][0] != 0:
            return f"a tensor-parallel slice {src.slices} other than whole experts"
        first = src.slices[0][1]
    shape = storage_shape(info) if info.format == "gguf" else info.shape
    if not shape or info.nbytes % shape[0]:
        return f"stored shape {list(info.shape)} has no expert axis"
    slab = info.nbytes // shape[0]
    rest, start, nbytes = list(info.shape[1:]), 0, slab
    if src.narrow is not None:  # a fused gate / up half: its rows, contiguous within the slab
        axis, start, length = src.narrow
        if axis != 1 or len(shape) < 3:
            return f"a narrow {src.narrow} along an axis other than the rows"
        row = slab // shape[1]
        start, nbytes, rest[0] = start * row, length * row, length
    return [_Piece(dataclasses.replace(info, name=f"{info.name}[{first + slot}]", shape=tuple(rest),
                                       offset=info.offset + (first + slot) * slab + start, nbytes=nbytes), pp.dtype)
            for slot in range(n)]


def _read(ckpt: Any, piece: _Piece) -> torch.Tensor:
    info = piece.info
    raw, t = ckpt.read(info, random_access=True)
    if info.nbytes:
        qpack.verify(ckpt, info, raw)  # an expert pack's payload: sha256 checked on first read
    return t if t.dtype == piece.dtype else t.to(piece.dtype)


#: glibc ``mallopt`` parameter: requests of at least this many bytes are served by ``mmap``
_M_MMAP_THRESHOLD = -3


def _return_freed_experts_to_the_os(smallest: int) -> bool:
    """Make glibc serve allocations of ``smallest`` bytes and more by ``mmap`` (and give them back
    on free), so evicted experts leave the process instead of staying in the heap.

    glibc's default threshold is dynamic: after a large mmapped block is freed it rises to that
    block's size (up to 32 MiB), and later blocks of that size come from the heap, where freed
    memory is kept: a cache cycling experts through it grew the process by 3x its budget
    (measured: 8 MiB cache, +34 MiB RSS; with the threshold fixed, +10 MiB). Fixed at
    ``smallest`` (128 KiB at least), expert tensors are mapped and unmapped; the model's small
    tensors and decode activations stay below it. Returns False where there is no glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, max(128 << 10, min(smallest, 32 << 20))))


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.4g}"


class _Entry:
    """One resident expert: its three one-slot layers, loaded, processed and bound."""

    __slots__ = ("layers", "nbytes", "pins")

    def __init__(self, layers: tuple[StackedLinear, StackedLinear, StackedLinear], nbytes: int) -> None:
        self.layers, self.nbytes, self.pins = layers, nbytes, 0


class ExpertCache:
    """The model's experts in memory: at most ``budget`` bytes of them, least recently used out.

    Statistics (``stats()``, exposed on the model as ``quantplug.api.stats_sources(model)
    ["expert_cache"]``): requests, hits, misses, ``expert_reads`` and ``bytes_read`` (experts read
    from the files, prefetches included), evictions, prefetches issued, prefetched experts later
    requested, prefetches dropped for want of room, the most bytes ever resident
    (``peak_bytes``)."""

    def __init__(self, budget: int, workers: int = READERS) -> None:
        self.budget = budget
        self.used = 0
        self._lru: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._pending: dict[tuple[int, int], Future] = {}
        self._prefetched: set[tuple[int, int]] = set()
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="quantplug-experts")
        self._local = threading.local()
        self.counts = {"requests": 0, "hits": 0, "misses": 0, "expert_reads": 0, "bytes_read": 0, "evictions": 0,
                       "prefetched": 0,
                       "prefetch_hits": 0, "prefetch_dropped": 0, "peak_bytes": 0}

    def stats(self) -> dict[str, float]:
        c = dict(self.counts)
        return {**c, "hit_rate": c["hits"] / c["requests"] if c["requests"] else 0.0, "resident_bytes": self.used,
                "budget_bytes": self.budget}

    def _unpin_mine(self) -> None:
        for e in getattr(self._local, "pins", ()):
            e.pins -= 1
        self._local.pins = []

    def _make_room(self, need: int) -> None:
        """Evict unpinned experts, least recently used first, until ``need`` more bytes fit (lock
        held). Experts pinned by other threads' requests cannot go: the cache then holds more than
        its budget until they are unpinned (``peak_bytes`` shows it); only a request whose own
        experts exceed the budget fails."""
        self._evict_to(self.budget - need)
        if self.used + need <= self.budget:
            return
        mine = sum(e.nbytes for e in getattr(self._local, "pins", ()))
        if mine + need > self.budget:
            raise LoadError(f"expert cache of {_mib(self.budget)} MiB cannot hold the experts one step needs "
                            f"({_mib(need)} MiB more next to {_mib(mine)} MiB of this step's experts): raise "
                            "expert_cache_mb")

    def _evict_to(self, target: int) -> None:
        """Evict unpinned experts, least recently used first, until at most ``target`` bytes are resident."""
        for key in list(self._lru):
            if self.used <= target:
                return
            e = self._lru[key]
            if e.pins:
                continue
            del self._lru[key]
            self.used -= e.nbytes
            self.counts["evictions"] += 1

    def _submit(self, store: ExpertStore, slot: int) -> Future:
        key = (id(store), slot)
        fut = self._pending.get(key)
        if fut is None:
            fut = self._pending[key] = self._pool.submit(store.build, slot)
        return fut

    def _admit(self, store: ExpertStore, slot: int, layers: Any, nbytes: int, prefetch: bool = False) -> _Entry | None:
        """Make a built expert resident (lock taken). A prefetch that does not fit without going
        over the budget is dropped (None): a later request reads it again."""
        key = (id(store), slot)
        with self._lock:
            self._pending.pop(key, None)
            e = self._lru.get(key)
            if e is None:
                if prefetch:
                    self._evict_to(self.budget - nbytes)
                    if self.used + nbytes > self.budget:
                        self.counts["prefetch_dropped"] += 1
                        return None
                self._make_room(nbytes)
                e = self._lru[key] = _Entry(layers, nbytes)
                self.used += nbytes
                self.counts["peak_bytes"] = max(self.counts["peak_bytes"], self.used)
            return e

    def get(self, store: ExpertStore, slots: Sequence[int]) -> list[_Entry]:
        """The entries of ``slots`` (in that order), reading the missing ones together; they stay
        pinned for this thread until its next :meth:`get`."""
        futures: dict[int, Future] = {}
        out: dict[int, _Entry] = {}
        with self._lock:
            self._unpin_mine()
            mine: list[_Entry] = self._local.pins
            for s in slots:
                key = (id(store), s)
                self.counts["requests"] += 1
                e = self._lru.get(key)
                if e is not None:
                    self._lru.move_to_end(key)
                    e.pins += 1
                    mine.append(e)
                    out[s] = e
                    self.counts["hits"] += 1
                else:
                    self.counts["misses"] += 1
                    futures[s] = self._submit(store, s)
                if key in self._prefetched:
                    self._prefetched.discard(key)
                    self.counts["prefetch_hits"] += 1
        for s, fut in futures.items():
            try:
                layers, nbytes = fut.result()
            except BaseException:
                # a failed read (I/O error, checksum mismatch) caches nothing: the next request
                # reads the expert again (after the file is repaired, it succeeds)
                with self._lock:
                    if self._pending.get((id(store), s)) is fut:
                        del self._pending[(id(store), s)]
                raise
            with self._lock:
                e = self._admit(store, s, layers, nbytes)
                assert e is not None  # a request's admission never drops
                e.pins += 1
                mine.append(e)
            out[s] = e
        return [out[s] for s in slots]

    def prefetch(self, store: ExpertStore, slots: Sequence[int]) -> None:
        """Start reading ``slots`` (not yet resident) in the background; never waits, never evicts
        a pinned expert (a prefetch that does not fit is dropped)."""
        with self._lock:
            for s in slots:
                key = (id(store), s)
                if key in self._lru or key in self._pending:
                    continue
                fut = self._submit(store, s)
                self.counts["prefetched"] += 1
                self._prefetched.add(key)
                fut.add_done_callback(self._done_callback(store, s))

    def _done_callback(self, store: ExpertStore, slot: int) -> Callable[[Future], None]:
        return lambda fut: self._prefetch_done(store, slot, fut)

    def _prefetch_done(self, store: ExpertStore, slot: int, fut: Future) -> None:
        if fut.exception() is not None:
            with self._lock:
                self._pending.pop((id(store), slot), None)
            return
        layers, nbytes = fut.result()
        self._admit(store, slot, layers, nbytes, prefetch=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class ExpertStore:
    """One MoE layer's routed experts (this rank's), read from the checkpoint on demand.

    ``pieces[proj][suffix][slot]``: the stored bytes of each parameter of each expert. ``build``
    makes one resident expert: three one-slot :class:`StackedLinear` (the layer's own schemes and
    dims), their parameters read, ``process_after_loading`` run and forms bound."""

    def __init__(self, experts: nn.Module, ckpt: Any, pieces: dict[str, dict[str, list[_Piece]]],
                 cache: ExpertCache) -> None:
        self.experts, self.ckpt, self.pieces, self.cache = experts, ckpt, pieces, cache
        self.slots = len(pieces[PROJS[0]][next(iter(pieces[PROJS[0]]))])
        self.slot_bytes = sum(p[0].info.nbytes for proj in pieces.values() for p in proj.values())
        self.entry_bytes = sum(p[0].nbytes for proj in pieces.values() for p in proj.values())
        #: whether an expert of this layer was built (entry_bytes then holds the largest built size)
        self.built = False

    def build(self, slot: int) -> tuple[tuple[StackedLinear, StackedLinear, StackedLinear], int]:
        layers = []
        nbytes = 0
        for proj in PROJS:
            src: StackedLinear = getattr(self.experts, proj)
            lin = StackedLinear(1, src.in_features, src.out_features, src.scheme, f"{src.qp_ckpt}[{slot}]",
                                StackedLayout(src.qp_ckpt), src.model_dtype)
            for suffix, per_slot in self.pieces[proj].items():
                try:
                    t = _read(self.ckpt, per_slot[slot]).unsqueeze(0)
                except OSError as exc:
                    raise LoadError(f"{per_slot[slot].info.where()} ({per_slot[slot].info.file}): cannot read expert "
                                    f"{slot} of {src.qp_ckpt} ({exc})") from None
                lin.register_parameter(suffix, nn.Parameter(t, requires_grad=False))
            lin.qp_finish()
            nbytes += sum(t.numel() * t.element_size() for t in (*lin.parameters(), *lin.buffers()))
            layers.append(lin)
        with self.cache._lock:
            self.cache.counts["expert_reads"] += 1
            self.cache.counts["bytes_read"] += self.slot_bytes
            # what an expert holds once built: more than its stored bytes where a scheme's
            # process_after_loading repacks (GPTQ / AWQ: int8 zero points for 4-bit packed ones), so
            # the runs of _chunks are sized by the largest built one
            self.entry_bytes = max(self.entry_bytes, nbytes)
            self.built = True
        return (layers[0], layers[1], layers[2]), nbytes

    # -- compute --------------------------------------------------------------------------------

    def _chunks(self, slots: Sequence[int]) -> Iterator[list[int]]:
        """``slots`` in ascending order, in runs that fit the cache together, each sized when the
        caller asks for it by the largest expert built so far: one expert alone until one of this
        layer's is built (a built expert can hold more than its stored bytes, see :meth:`build`)."""
        s, i = sorted(slots), 0
        while i < len(s):
            per = max(1, int(self.cache.budget // max(self.entry_bytes, 1))) if self.built else 1
            yield s[i:i + per]
            i += per

    def forward_step(self, x: torch.Tensor, pairs: Sequence[tuple[int, int, float]]) -> torch.Tensor:
        """Few token rows x [M, H] through ``pairs`` = (row, slot, weight), sorted by slot: the sum
        over each row's pairs in order of ``weight * mlp_slot(x[row])``."""
        out: torch.Tensor | None = None
        act = getattr(self.experts, "act", SILU)
        for chunk in self._chunks(sorted({s for _, s, _ in pairs})):
            entries = dict(zip(chunk, self.cache.get(self, chunk)))
            part = [(r, s, w) for r, s, w in pairs if s in entries]
            y = compute.mlp_over([entries[s].layers for s in chunk], x, [(r, chunk.index(s), w) for r, s, w in part],
                                 act=act.native)
            if y is None:  # no native kernels: the layers' own products
                y = torch.zeros(x.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
                for r, s, w in part:
                    g, u, d = entries[s].layers
                    xr = x[r:r + 1]
                    y[r:r + 1] += (d(act(g(xr, 0), u(xr, 0)), 0) * w).to(x.dtype)
            out = y if out is None else out + y
        return out if out is not None else torch.zeros_like(x)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, first: int, count: int,
                slot_base: int) -> torch.Tensor:
        """x [T, H], idx / w [T, top_k]: every token through its experts of ``[first, first +
        count)``, summed per token in ascending expert order (as ``Experts.forward``)."""
        out = torch.zeros_like(x)
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=first + count).tolist()
        starts, acc = {}, 0
        for e, n in enumerate(counts):
            starts[e] = acc
            acc += n
        hit = [e for e in range(first, first + count) if counts[e]]
        wf = w.reshape(-1)
        act = getattr(self.experts, "act", SILU)
        for chunk in self._chunks([e - slot_base for e in hit]):
            entries = self.cache.get(self, chunk)
            for slot, entry in zip(chunk, entries):
                e = slot + slot_base
                sel = order[starts[e]:starts[e] + counts[e]]
                tok = sel // k
                xs = x.index_select(0, tok)
                g, u, d = entry.layers
                hs = d(act(g(xs, 0), u(xs, 0)), 0) * wf.index_select(0, sel).unsqueeze(-1)
                out.index_add_(0, tok, hs.to(out.dtype))
        return out

    def prefetch(self, slots: Sequence[int]) -> None:
        """Start reading ``slots`` in the background (see :meth:`ExpertCache.prefetch`)."""
        self.cache.prefetch(self, [s for s in slots if 0 <= s < self.slots])

    def dequantize(self, stack: StackedLinear, slot: int) -> torch.Tensor:
        """Slot ``slot`` of served stacked layer ``stack`` (one of the layer's projections) as a
        dense [out, in] tensor, through its scheme's ``dequantize`` (``quantplug.api.dense_state``)."""
        proj = next((p for p in PROJS if getattr(self.experts, p) is stack), None)
        if proj is None:
            raise LoadError(f"{stack.qp_ckpt} is not served by the expert store of {self.experts.qp_ckpt}")
        entry = self.cache.get(self, [slot])[0]
        layer = entry.layers[PROJS.index(proj)]
        return layer.scheme.dequantize(layer, 0)


def attach(plan: Any, model: nn.Module, budget_bytes: int,
           readers: int = READERS) -> tuple[set[int], ExpertCache | None, list[str]]:
    """Serve the routed experts of ``plan``'s model from its files: one :class:`ExpertStore` per
    MoE layer whose experts the plan reads per expert (``module.store``), sharing one cache of
    ``budget_bytes``. Returns the ids of the parameter plans the loader must not load, the cache,
    and the layers left in memory with the reason."""
    by_module: dict[int, dict[str, Any]] = {}
    for pp in plan.params:
        by_module.setdefault(id(pp.module), {})[pp.local] = pp
    skip: set[int] = set()
    kept: list[str] = []
    cache = ExpertCache(budget_bytes, readers)
    stores = 0
    smallest = 1 << 62
    for mod in model.modules():
        if not isinstance(mod, RoutedExpertStacks):
            continue
        layers = {proj: getattr(mod, proj) for proj in PROJS}
        pieces: dict[str, dict[str, list[_Piece]]] = {}
        why = ""
        for proj, lin in layers.items():
            params = by_module.get(id(lin), {})
            if not params:  # nothing read by the plan: the scheme supplies the weights itself
                why = "-"
                break
            pieces[proj] = {}
            for local, pp in params.items():
                got = _slot_pieces(pp, lin.n)
                if isinstance(got, str):
                    why = f"{pp.param}: {got}"
                    break
                pieces[proj][local] = got
            if why:
                break
        if why:
            if why != "-":
                kept.append(f"{mod.qp_ckpt}: {why}")
            continue
        store = ExpertStore(mod, plan.checkpoint, pieces, cache)
        smallest = min(smallest, min(p[0].nbytes for proj in pieces.values() for p in proj.values()))
        mod.qp_store = store
        for lin in layers.values():
            lin.qp_served = True
            skip.update(id(pp) for pp in by_module[id(lin)].values())
        stores += 1
    if not stores:
        cache.close()
        return skip, None, kept
    _return_freed_experts_to_the_os(smallest)
    return skip, cache, kept


def step_bytes(plan: Any) -> int:
    """Bytes of one step's routed experts of the largest MoE layer in memory: ``top_k`` experts,
    each gate + up + down with their scales (0 when the plan stacks no routed experts)."""
    per_layer: dict[str, int] = {}
    for pp in plan.params:
        if pp.module.qp_stacked and ".experts." in pp.param and pp.shape:
            layer = pp.param.rsplit(".experts.", 1)[0]
            per_layer[layer] = per_layer.get(layer, 0) + pp.nbytes // pp.shape[0]
    return plan.model_config.num_experts_per_tok * max(per_layer.values(), default=0)


def check_budget(plan: Any, budget_bytes: int) -> str | None:
    """Why a cache of ``budget_bytes`` cannot serve the plan's experts (it must hold one step's
    experts of one layer, :func:`step_bytes`), or None."""
    need = step_bytes(plan)
    if budget_bytes < need:
        top_k = plan.model_config.num_experts_per_tok
        return (f"expert_cache_mb = {budget_bytes / (1 << 20):.4g} MiB holds less than one step's routed experts of a "
                f"layer: {top_k} experts of {need / top_k / (1 << 20):.4g} MiB each = {need / (1 << 20):.4g} MiB")
    return None


__all__ = ["ExpertCache", "ExpertStore", "attach", "check_budget", "step_bytes"]
