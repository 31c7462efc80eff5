"""Tensor- and expert-parallel loading over ``torch.distributed``: each rank reads only its share.

Under an initialized default process group of world size N > 1 (or ``load(..., group=g)``),
the plan is rewritten for this rank (:func:`shard_plan`): every parameter's sources become the
byte ranges of the rank's slice, and the model's modules get their collectives. What splits how
is the architecture's declaration (``qp_tp_plan``, :mod:`quantplug.models.declarations`), read
here with no knowledge of any model class; DeepSeek-V3 / Kimi declare the split serving engines
use:

* MLA (``HeadParallel``): heads over ranks. ``q_b_proj`` (or ``q_proj``), ``kv_b_proj``, the
  Kimi-K3 ``g_proj`` and the split ``k_b`` / ``v_b`` stacks hold this rank's heads; ``o_proj`` is
  row-parallel with an all-reduce; ``q_a_proj``, ``kv_a_proj_with_mqa`` and the norms are
  replicated. (vLLM ``models/deepseek_v2.py`` DeepseekV2MLAAttention: ColumnParallelLinear
  q_b_proj / kv_b_proj, RowParallelLinear o_proj, ReplicatedLinear q_a_proj /
  kv_a_proj_with_mqa, ``num_local_heads = num_heads // tp_size``; DeepSeek-V3
  ``inference/model.py`` MLA: ``n_local_heads = n_heads // world_size``, wq / wkv_b column-, wo
  row-parallel.)
* Dense MLP and shared experts (``FeatureParallel``): gate / up by output rows, down by input
  columns + all-reduce (vLLM DeepseekV2MLP MergedColumnParallelLinear + RowParallelLinear;
  DeepSeek MLP w1 / w3 column-, w2 row-parallel).
* Routed experts (``ExpertParallel``): rank r computes a contiguous block of experts, the router
  is replicated, the routed output is all-reduced once (DeepSeek ``inference/model.py`` MoE:
  ``experts_start_idx = rank * n_local_experts``, gate replicated, ``dist.all_reduce(y)``).
* Embedding (``VocabParallel``): masked lookup + all-reduce (DeepSeek ParallelEmbedding, vLLM
  VocabParallelEmbedding); ``lm_head`` (``ColumnParallel(gather=True)``) by vocab rows + one
  all-gather of the logits (DeepSeek ``Transformer.forward``: ``dist.all_gather(all_logits,
  logits)``).

How a quantized tensor follows a split is the scheme's answer (``LinearScheme.split``); a
split the scheme does not declare, or one that would cut a block or group, replicates that
layer on every rank (a ``tensor_parallel`` decision with the reason, counted in the per-rank
bytes; option ``strict_split`` makes it a Problem). A replicated column layer computes its full
output and keeps this rank's slice; a replicated row layer all-gathers its input; so every
mix stays exact.

Documented behaviour where N does not divide: heads (attention replicated in that layer),
intermediate size (that MLP replicated), experts (uneven contiguous blocks: the first E mod N
ranks hold one more), vocabulary (uneven row blocks, the gather trims the padding).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .checkpoint import TORCH_DTYPES, storage_shape
from .checkpoint.gguf_index import GGUF_FLOATS
from .errors import LoadError, ParallelError, QuantplugError
from .layers.embedding import Embedding
from .layers.linear import LinearScheme, PlannedModule, QuantLinear, Source, SplitRule, StackedLinear
from .memory import read_runs
from .models.declarations import (
    ColumnParallel,
    DeclarationError,
    ExpertGroup,
    ExpertParallel,
    FeatureParallel,
    HeadGroup,
    HeadParallel,
    HeadSlice,
    RowParallel,
    TiedModule,
    VocabParallel,
    ckpt_name,
    declared,
)
from .types import CORE, Decision, Problem, TensorInfo

if TYPE_CHECKING:
    from .contract.plan import LoadPlanView as LoadPlan
    from .contract.plan import ParamPlanView as ParamPlan

HOOK = "tensor_parallel"
TP_STYLES = (ColumnParallel, RowParallel, FeatureParallel, HeadParallel, ExpertParallel, VocabParallel)


# ---------------------------------------------------------------------------------------------
# Process group and collectives
# ---------------------------------------------------------------------------------------------

class Comm:
    """The process group the model's forward talks over (``group`` None: the default group).

    Failure handling (:meth:`watch`, called by ``load`` on every rank): each forward collective
    waits at most ``timeout_s`` (load option ``tp_timeout_s``) for the other ranks, and a rank
    whose forward raises publishes its error in the group's key-value store (:meth:`guard`), so
    every rank waiting in a collective raises :class:`ParallelError` naming it within a fraction
    of a second, instead of waiting for gloo's own timeout (30 minutes) while that rank stays
    alive. A rank that never arrives (hung, or stopped outside a forward) is named when the
    timeout expires: the waiting ranks compare how far each got in the store. After such an
    error the group is out of step (a collective is left pending) and every later collective
    raises at once: destroy the group and load again.
    """

    def __init__(self, world: int, rank: int, group: Any = None) -> None:
        self.world, self.rank, self.group = world, rank, group
        #: seconds a forward collective waits for the others (None: unbounded, no store polling)
        self.timeout_s: float | None = None
        self._store: Any = None
        self._tag = ""
        self._seq = 0
        #: why this group is out of step (set on the first failure; every later collective raises)
        self.failed: str | None = None

    @property
    def device(self) -> torch.device:
        """Where this group's own small tensors (flags, sizes) live: NCCL only reduces on CUDA."""
        if dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- bounded collectives -------------------------------------------------------------------

    def watch(self, timeout_s: float) -> None:
        """Bound every later forward collective by ``timeout_s`` and share failures through the
        default group's store. A collective: every rank calls it (``load`` does)."""
        store = None
        with contextlib.suppress(Exception):  # private API: without it, timeouts still apply, unnamed
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        if store is not None and self.rank == 0:
            n[0] = int(store.add("quantplug/tp/groups", 1))
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        self._store = store if int(n.item()) > 0 else None
        self._tag = f"quantplug/tp/{int(n.item())}"
        self.timeout_s = float(timeout_s)

    def _key(self, what: str) -> str:
        return f"{self._tag}/{what}"

    def _peer_failure(self) -> str | None:
        if self._store is None:
            return None
        try:
            if not self._store.check([self._key("failed")]):
                return None
            info = json.loads(self._store.get(self._key("failed")).decode())
        except Exception:  # noqa: BLE001 (the store itself is gone: the job is ending)
            return None
        if int(info.get("rank", -1)) == self.rank:
            return None
        return (f"tensor-parallel {info.get('during', 'forward')}: rank {info.get('rank')} of {self.world} failed "
                f"({info.get('error', '?')}); rank {self.rank} stops too")

    def publish(self, exc: BaseException, during: str) -> None:
        """Tell the other ranks this rank's ``during`` failed with ``exc`` (they raise naming it)."""
        text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        self.failed = self.failed or f"rank {self.rank} failed during {during} ({text[:300]})"
        if self._store is None:
            return
        with contextlib.suppress(Exception):
            if not self._store.check([self._key("failed")]):
                self._store.set(self._key("failed"), json.dumps({"rank": self.rank, "error": text[:500],
                                                                  "during": during}))

    @contextlib.contextmanager
    def guard(self, during: str) -> Iterator[None]:
        """Run a forward / generate step; any exception (a ``BaseException`` too) is published to
        the other ranks before it propagates."""
        try:
            yield
        except ParallelError:
            raise  # a peer's failure, already known to everyone
        except BaseException as exc:
            self.publish(exc, during)
            raise

    def _wait(self, work: Any, what: str) -> None:
        deadline = time.monotonic() + (self.timeout_s or 0.0)
        step, announced = 0.05, False
        while True:
            left = deadline - time.monotonic()
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(min(step, left), 0.001)))
                return
            except RuntimeError as exc:
                peer = self._peer_failure()
                if peer is not None:
                    self.failed = peer
                    raise ParallelError(peer) from None
                if work.is_completed():  # the collective itself failed: a peer's process is gone
                    self.failed = (f"tensor-parallel {what}: the collective failed on rank {self.rank} of "
                                   f"{self.world} (a peer's process ended?): {str(exc).splitlines()[0][:200]}")
                    raise ParallelError(self.failed) from None
            if not announced and self._store is not None:  # slow: say how far this rank got
                announced = True
                with contextlib.suppress(Exception):
                    self._store.set(self._key(f"at/{self.rank}"), str(self._seq))
            if time.monotonic() >= deadline:
                self._timed_out(what)
            step = min(step * 2, 1.0)

    def _timed_out(self, what: str) -> None:
        behind: list[int] = []
        if self._store is not None:
            time.sleep(min(1.0, self.timeout_s or 1.0))  # ranks waiting here too have announced by now
            for r in range(self.world):
                if r == self.rank:
                    continue
                try:
                    at = int(self._store.get(self._key(f"at/{r}")).decode()) if self._store.check(
                        [self._key(f"at/{r}")]) else -1
                except Exception:  # noqa: BLE001
                    at = -1
                if at < self._seq:
                    behind.append(r)
        who = f"rank(s) {behind}" if behind else "a rank"
        msg = (f"tensor-parallel {what}: {who} of {self.world} did not reach collective #{self._seq} within "
               f"tp_timeout_s = {self.timeout_s:g} s (hung, dead, or stopped outside a forward); rank {self.rank} "
               "stops")
        self.failed = msg
        if self._store is not None:
            with contextlib.suppress(Exception):
                if not self._store.check([self._key("failed")]):
                    self._store.set(self._key("failed"), json.dumps({
                        "rank": behind[0] if behind else -1, "during": what,
                        "error": f"did not reach collective #{self._seq} within {self.timeout_s:g} s "
                                 f"(seen by rank {self.rank})"}))
        raise ParallelError(msg)

    def _collective(self, what: str, start: Callable[[bool], Any]) -> None:
        if self.failed is not None:
            raise ParallelError(f"{self.failed}; the process group is out of step: destroy it and load again")
        if self.timeout_s is None:
            start(False)
            return
        self._seq += 1
        self._wait(start(True), what)

    # -- the collectives the model's forward uses ------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self._collective("forward", lambda a: dist.all_reduce(t, group=self.group, async_op=a))
        return t

    def all_gather(self, t: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Concatenate every rank's ``t`` along the last dim; rank i contributes ``sizes[i]``
        columns (padded to the largest for the collective, trimmed after)."""
        m = max(sizes)
        if t.shape[-1] < m:
            t = F.pad(t, (0, m - t.shape[-1]))
        t = t.contiguous()
        bufs = [torch.empty_like(t) for _ in range(self.world)]
        self._collective("forward", lambda a: dist.all_gather(bufs, t, group=self.group, async_op=a))
        return torch.cat([b[..., :s] for b, s in zip(bufs, sizes)], dim=-1)

    def agree(self, error: BaseException | None, stage: str) -> None:
        """Every rank says whether ``stage`` worked; a rank whose peer failed raises too, so
        nobody waits in a later collective for a rank that has given up."""
        flags = torch.zeros(self.world, dtype=torch.int32, device=self.device)
        flags[self.rank] = 1 if error is not None else 0
        dist.all_reduce(flags, group=self.group)
        if error is not None:
            raise error
        failed = [i for i, f in enumerate(flags.tolist()) if f]
        if failed:
            raise LoadError(f"rank(s) {failed} of {self.world} failed during {stage}; rank {self.rank} stops too "
                            "(their error is on their stderr)")


class EngineComm(Comm):
    """The ranks of an engine whose own tensor-parallel layers run the forward collectives (vLLM's
    RowParallelLinear and MoE all-reduces, VocabParallelEmbedding's masked lookup, the logits
    gather): loading plans, reads and agrees over ``group`` as any load does, and the planned
    modules compute this rank's partial products only: ``all_reduce`` returns its input (the
    engine sums), ``all_gather`` is refused (a layer that needs its input gathered is one the plan
    replicated where the engine splits it: load with ``strict_split`` so the plan refuses it).
    Pass it as ``quantplug.load(..., group=EngineComm(world, rank, group))``."""

    #: planned modules' forward collectives are the engine's
    engine = True

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        raise ParallelError(f"rank {self.rank} of {self.world}: a planned module asked to all-gather its input or "
                            "output inside an engine that runs its own collectives (a layer the plan replicated, "
                            "or an unsplit head): the engine gathers")


def resolve_group(group: Any = None) -> Comm | None:
    """The Comm for ``group`` (default: the initialized default group; a :class:`Comm` as given),
    None when not distributed or world size 1."""
    if isinstance(group, Comm):
        return group if group.world > 1 else None
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size(group)
    if world <= 1:
        return None
    return Comm(world, dist.get_rank(group), group)


def block(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous block of ``n`` items: (start, length); the first ``n % world``
    ranks hold one more."""
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


# ---------------------------------------------------------------------------------------------
# Forward of split modules (set as ``module.qp_parallel``)
# ---------------------------------------------------------------------------------------------

class Column:
    """Column-parallel linear: this rank's output features ``[start, start + length)``.
    ``sharded`` False: the weight is whole here (a split would cut a block), the full output is
    computed and sliced. ``gather``: concatenate every rank's slice (lm_head)."""

    kind = "column"

    def __init__(self, comm: Comm, start: int, length: int, sizes: Sequence[int], sharded: bool,
                 gather: bool = False) -> None:
        self.comm, self.start, self.length, self.sizes = comm, start, length, list(sizes)
        self.sharded, self.gather = sharded, gather

    def __call__(self, mod: Any, x: torch.Tensor) -> torch.Tensor:
        y = mod.product(x)
        if self.sharded:
            return self.comm.all_gather(y, self.sizes) if self.gather else y
        return y if self.gather else y[..., self.start:self.start + self.length].contiguous()


class Row:
    """Row-parallel linear: input is this rank's slice of features; partial outputs all-reduced.
    ``sharded`` False: the weight is whole here; the input slices are all-gathered first."""

    kind = "row"

    def __init__(self, comm: Comm, sizes: Sequence[int], sharded: bool) -> None:
        self.comm, self.sizes, self.sharded = comm, list(sizes), sharded

    def __call__(self, mod: Any, x: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return mod.product(self.comm.all_gather(x, self.sizes))
        if type(mod.scheme).apply_row_parallel is not LinearScheme.apply_row_parallel:
            return mod.scheme.apply_row_parallel(mod, x, self.comm.all_reduce)  # the scheme reduces its own accumulators
        return self.comm.all_reduce(mod.product(x))


class VocabEmbedding:
    """Vocab-parallel lookup: rows ``[start, start + length)`` here, others zero, all-reduced."""

    def __init__(self, comm: Comm, start: int, length: int) -> None:
        self.comm, self.start, self.length = comm, start, length

    def __call__(self, mod: Any, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mask = (local >= 0) & (local < self.length)
        out = mod.scheme.embed(mod, torch.where(mask, local, torch.zeros_like(local)))
        return self.comm.all_reduce(out.masked_fill(~mask.unsqueeze(-1), 0))


class Reduce:
    """All-reduce of a module's output (routed experts: each rank's experts' share)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(out)


# ---------------------------------------------------------------------------------------------
# The per-rank plan
# ---------------------------------------------------------------------------------------------

#: rank -> (sources, shape) of one parameter
Rewrite = Callable[[int], tuple[list[tuple[Source, TensorInfo]], tuple[int, ...]]]


@dataclass
class ParallelPlan:
    """What :func:`shard_plan` decided for ``world`` ranks, and this rank's share."""

    world: int
    rank: int
    decisions: list[Decision] = field(default_factory=list)
    #: bytes each rank reads (from headers alone)
    rank_bytes: list[int] = field(default_factory=list)
    #: bytes every rank reads whole (replicated tensors)
    replicated_bytes: int = 0
    #: bytes of the tensors split over the ranks (whole size)
    sharded_bytes: int = 0
    #: (module, parameter) zeroed on ranks other than 0 after loading (``SplitRule.once``)
    zero_off_rank0: list[tuple[nn.Module, str]] = field(default_factory=list, repr=False)

    def finish_params(self) -> None:
        """Called by the loader once parameters are registered, before schemes post-process."""
        if self.rank == 0:
            return
        for mod, name in self.zero_off_rank0:
            p = getattr(mod, name)
            mod.register_parameter(name, nn.Parameter(torch.zeros_like(p), requires_grad=False))

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world, "rank": self.rank, "rank_bytes": self.rank_bytes,
                "replicated_bytes": self.replicated_bytes, "sharded_bytes": self.sharded_bytes,
                "bound_bytes": self.replicated_bytes + math.ceil(self.sharded_bytes / self.world),
                "decisions": [{"target": d.target, "value": str(d.value), "reason": d.reason}
                              for d in self.decisions]}


def _eff_shape(src: Source, info: TensorInfo) -> list[int]:
    """The storage shape a source feeds after its own ``narrow``."""
    shape = list(storage_shape(info))
    if src.narrow is not None:
        shape[src.narrow[0]] = src.narrow[2]
    return shape


def _with_slice(src: Source, axis: int, start: int, length: int) -> Source:
    """``src`` reading only [start, start + length) of storage ``axis`` (after its own narrow)."""
    slices = dict((a, (s, n)) for a, s, n in (src.slices or ()))
    if src.narrow is not None and src.narrow[0] not in slices:
        slices[src.narrow[0]] = (src.narrow[1], src.narrow[2])
    if axis in slices:
        start += slices[axis][0]
    slices[axis] = (start, length)
    return src._replace(narrow=None, slices=tuple(sorted((a, s, n) for a, (s, n) in slices.items())))


def _param_shape(pp: ParamPlan, sources: list[tuple[Source, TensorInfo]]) -> tuple[int, ...]:
    src, info = sources[0]
    shape = _eff_shape(src, info)
    for a, _, n in src.slices or ():
        shape[a] = n
    if src.slot is not None:
        return (len(sources), *shape)
    return tuple(shape)


def source_bytes(src: Source, info: TensorInfo) -> int:
    """Bytes read for one source: its slice (or narrow) of the stored tensor."""
    full = storage_shape(info)
    n = math.prod(full)
    if n == 0:
        return 0
    item = info.nbytes // n
    shape = _eff_shape(src, info)
    for a, _, length in src.slices or ():
        shape[a] = length
    return item * math.prod(shape)


@dataclass(frozen=True)
class Split:
    """A split that works: each parameter's rewrite (by ``id`` of its :class:`ParamPlan`) and the
    (module, parameter) terms only rank 0 keeps (``SplitRule.once``)."""

    rewrites: dict[int, Rewrite]
    once: tuple[tuple[nn.Module, str], ...] = ()


@dataclass(frozen=True)
class Unsplit:
    """Why a module cannot split: it is replicated, with this reason."""

    reason: str


#: what planning one module's split returns
SplitResult = Split | Unsplit


class _Sharder:
    """Applies the architecture's declared plan (``qp_tp_plan``, :mod:`quantplug.models.declarations`)
    to one rank: rewrites the parameters' sources, sets the modules' collectives, records why."""

    def __init__(self, plan: LoadPlan, world: int, rank: int, comm: Comm | None) -> None:
        self.plan, self.world, self.rank = plan, world, rank
        self.comm = comm if comm is not None else Comm(world, rank)
        self.strict = plan.options.strict_split
        self.params: dict[int, list[ParamPlan]] = {}
        for pp in plan.params:
            self.params.setdefault(id(pp.module), []).append(pp)
        self.rewrites: dict[int, Rewrite] = {}
        self.pp_by_id: dict[int, ParamPlan] = {id(pp): pp for pp in plan.params}
        self.out = ParallelPlan(world, rank)
        #: id(embedding) -> its vocabulary blocks, for the heads tied to it
        self.vocab_ranges: dict[int, list[tuple[int, int]]] = {}

    # -- recording ------------------------------------------------------------------------------

    def decide(self, target: str, value: str, reason: str) -> None:
        self.out.decisions.append(Decision(HOOK, target, value, CORE, reason))

    def replicated(self, target: str, reason: str) -> None:
        self.decide(target, "replicated", reason)
        if self.strict:
            self.plan.problems.append(Problem(f"tensor-parallel split over {self.world} ranks impossible: {reason} "
                                              "(option strict_split forbids replicating it)", layer=target,
                                              kind="split"))

    # -- linears --------------------------------------------------------------------------------

    def try_linear(self, mod: PlannedModule, scheme: Any, direction: str, out_f: int, in_f: int,
                   ranges: Sequence[tuple[int, int]]) -> SplitResult:
        """The rewrites of ``mod``'s parameters for a split of ``direction`` into ``ranges``
        (features per rank), or why it cannot split."""
        rules = scheme.split(direction, out_f, in_f)
        if rules is None:
            return Unsplit(f"scheme {scheme.name} declares no split rule")
        if isinstance(rules, str):
            return Unsplit(rules)
        full = out_f if direction == "out" else in_f
        rewrites: dict[int, Rewrite] = {}
        once: list[tuple[nn.Module, str]] = []
        for pp in self.params.get(id(mod), []):
            rule: SplitRule | None = rules.get(pp.local)
            if rule is None:
                return Unsplit(f"scheme {scheme.name} declares no split rule for {pp.local}")
            if rule.axis is None:
                if rule.once and direction == "in":
                    once.append((mod, pp.local))
                continue
            if len(pp.sources) != 1 or pp.sources[0][0].slot is not None:
                return Unsplit(f"{pp.local} is fed by {len(pp.sources)} tensors; only a single stored tensor splits")
            src, info = pp.sources[0]
            shape = _eff_shape(src, info)
            axis, f, u = rule.axis, rule.features, rule.units
            if axis >= len(shape) or shape[axis] * f != full * u:
                return Unsplit(f"{pp.local}: stored axis {axis} of {info.label} has "
                               f"{shape[axis] if axis < len(shape) else '-'} entries, the split rule expects "
                               f"{full} / {f} * {u}")
            for start, length in ranges:
                if start % f or length % f:
                    return Unsplit(f"{pp.local}: this rank's slice [{start}, {start + length}) of {full} {direction} "
                                   f"features would cut its {f}-feature blocks / groups")

            def rw(r: int, src: Source = src, info: TensorInfo = info, pp: ParamPlan = pp,
                   axis: int = axis, f: int = f, u: int = u) -> tuple[list[tuple[Source, TensorInfo]], tuple[int, ...]]:
                start, length = ranges[r]
                s = [(_with_slice(src, axis, start // f * u, length // f * u), info)]
                return s, _param_shape(pp, s)

            rewrites[id(pp)] = rw
        return Split(rewrites, tuple(once))

    def linear(self, mod: QuantLinear, direction: str, ranges: Sequence[tuple[int, int]],
               gather: bool = False, res: SplitResult | None = None) -> bool:
        """Split ``mod`` (``res``: as already planned) or replicate it (recorded); sets its
        forward. True when split."""
        if res is None:
            res = self.try_linear(mod, mod.scheme, direction, mod.out_features, mod.in_features, ranges)
        sizes = [n for _, n in ranges]
        start, length = ranges[self.rank]
        if isinstance(res, Unsplit):
            self.replicated(mod.qp_ckpt, res.reason)
        else:
            self.rewrites.update(res.rewrites)
            self.out.zero_off_rank0 += res.once
            self.decide(mod.qp_ckpt, f"{'column' if direction == 'out' else 'row'}-parallel",
                        f"{direction} features split {sizes}")
            if direction == "out":
                mod.out_features = length
            else:
                mod.in_features = length
        sharded = isinstance(res, Split)
        mod.qp_parallel = (Column(self.comm, start, length, sizes, sharded, gather) if direction == "out"
                           else Row(self.comm, sizes, sharded))
        return sharded

    def stacked(self, mod: StackedLinear, ranges: Sequence[tuple[int, int]]) -> SplitResult:
        """The rewrites splitting a stacked module's slots (experts, heads) into ``ranges``."""
        rewrites: dict[int, Rewrite] = {}
        for pp in self.params.get(id(mod), []):
            src0, info0 = pp.sources[0]
            if src0.slot is not None:
                def rw_slots(r: int, pp: ParamPlan = pp) -> tuple[list[tuple[Source, TensorInfo]], tuple[int, ...]]:
                    start, length = ranges[r]
                    s = [(src._replace(slot=src.slot - start), info) for src, info in pp.sources
                         if src.slot is not None and start <= src.slot < start + length]
                    return s, (length, *pp.shape[1:])
                rewrites[id(pp)] = rw_slots
                continue
            if len(pp.sources) != 1:
                return Unsplit(f"{pp.local} is fed by {len(pp.sources)} tensors")
            shape = _eff_shape(src0, info0)
            if not shape or shape[0] != mod.n:
                return Unsplit(f"{pp.local}: {info0.label} has no leading axis of {mod.n} slots")

            def rw(r: int, pp: ParamPlan = pp, src: Source = src0,
                   info: TensorInfo = info0) -> tuple[list[tuple[Source, TensorInfo]], tuple[int, ...]]:
                start, length = ranges[r]
                s = [(_with_slice(src, 0, start, length), info)]
                return s, _param_shape(pp, s)
            rewrites[id(pp)] = rw
        return Split(rewrites)

    # -- the declared roles ---------------------------------------------------------------------

    def even(self, n: int) -> list[tuple[int, int]]:
        return [(r * (n // self.world), n // self.world) for r in range(self.world)]

    def blocks(self, n: int) -> list[tuple[int, int]]:
        return [block(n, self.world, r) for r in range(self.world)]

    @staticmethod
    def members(mod: nn.Module, names: Sequence[str], where: str, kind: type[PlannedModule]) -> list[Any]:
        """The members ``names`` that ``mod`` holds (absent ones skipped), each a ``kind``."""
        children = dict(mod.named_children())
        out = []
        for n in names:
            child = children.get(n)
            if child is None:
                continue
            if not isinstance(child, kind):
                raise DeclarationError(f"tensor-parallel plan: {where}.{n} is {type(child).__name__}, "
                                       f"expected a {kind.__name__}")
            out.append(child)
        return out

    def heads(self, name: str, mod: nn.Module, entry: HeadParallel) -> None:
        """:class:`HeadParallel`: all or nothing over the layer's head group."""
        if not isinstance(mod, HeadGroup):
            raise DeclarationError(f"tensor-parallel plan: {name} ({type(mod).__name__}) is split by HeadParallel "
                                   "but does not implement qp_heads / qp_hold_heads")
        target = ckpt_name(mod, name)
        nh = mod.qp_heads()
        if nh % self.world:
            self.replicated(target, f"{nh} attention heads do not divide over {self.world} ranks: "
                                    "attention is replicated in this layer")
            return
        heads = self.even(nh)
        planned: list[tuple[QuantLinear, str, list[tuple[int, int]], Split]] = []
        for names, direction in ((entry.column, "out"), (entry.row, "in")):
            for lin in self.members(mod, names, name, QuantLinear):
                width = lin.out_features if direction == "out" else lin.in_features
                if width % nh:
                    raise DeclarationError(f"tensor-parallel plan: {lin.qp_ckpt} has {width} {direction} features, "
                                           f"not a multiple of {nh} heads")
                per = width // nh
                ranges = [(s * per, n * per) for s, n in heads]
                res = self.try_linear(lin, lin.scheme, direction, lin.out_features, lin.in_features, ranges)
                if isinstance(res, Unsplit):
                    self.replicated(target, f"{lin.qp_ckpt.rsplit('.', 1)[-1]}: {res.reason}; "
                                            "attention is replicated in this layer")
                    return
                planned.append((lin, direction, ranges, res))
        stacks: list[tuple[StackedLinear, Split]] = []
        for stack in self.members(mod, entry.stacks, name, StackedLinear):
            if stack.n != nh:
                raise DeclarationError(f"tensor-parallel plan: {stack.qp_ckpt} stacks {stack.n} slots for {nh} heads")
            sres = self.stacked(stack, heads)
            if isinstance(sres, Unsplit):
                self.replicated(target, f"{stack.qp_ckpt}: {sres.reason}; attention is replicated in this layer")
                return
            stacks.append((stack, sres))
        floats: list[tuple[str, Split]] = []
        for sl in entry.floats:
            fres = self.head_floats(mod, sl, name, nh, heads)
            if fres is None:
                continue  # a parameter this module does not hold (an MLA layer beside KDA's)
            if isinstance(fres, Unsplit):
                self.replicated(target, f"{sl.param}: {fres.reason}; attention is replicated in this layer")
                return
            floats.append((sl.param, fres))
        for lin, direction, ranges, res in planned:
            self.linear(lin, direction, ranges, res=res)
        start, count = heads[self.rank]
        for stack, sres in stacks:
            self.rewrites.update(sres.rewrites)
            stack.qp_hold_slots(count)
            self.decide(stack.qp_ckpt, "head-parallel", f"heads split {[n for _, n in heads]}")
        for param, fres in floats:
            self.rewrites.update(fres.rewrites)
            self.decide(f"{target}.{param}", "head-parallel", f"heads split {[n for _, n in heads]}")
        mod.qp_hold_heads(start, count)

    def head_floats(self, mod: nn.Module, sl: HeadSlice, where: str, nh: int,
                    heads: Sequence[tuple[int, int]]) -> SplitResult | None:
        """The rewrite of one :class:`HeadSlice` float parameter to this rank's heads' entries of its
        head axis (the stored tensor's first axis longer than 1); None when the module holds no
        such parameter."""
        owner_name, _, local = sl.param.rpartition(".")
        try:
            owner = mod.get_submodule(owner_name) if owner_name else mod
        except AttributeError:
            return None
        pps = [pp for pp in self.params.get(id(owner), []) if pp.local == local]
        if not pps:
            return None
        pp = pps[0]
        if len(pp.sources) != 1 or pp.sources[0][0].slot is not None:
            return Unsplit(f"fed by {len(pp.sources)} tensors; only a single stored tensor splits")
        src, info = pp.sources[0]
        shape = _eff_shape(src, info)
        axis = next((a for a, n in enumerate(shape) if n > 1), None)
        if axis is None:
            return Unsplit(f"{info.label} {list(shape)} has no head axis")
        per = sl.per_head if sl.per_head is not None else shape[axis] // nh
        if per < 1 or (sl.per_head is None and shape[axis] % nh) or shape[axis] < per * nh:
            raise DeclarationError(f"tensor-parallel plan: {where}.{sl.param}: axis {axis} of {info.label} "
                                   f"{list(shape)} does not hold {nh} heads of "
                                   f"{sl.per_head if sl.per_head is not None else 'equal'} entries")

        def rw(r: int, src: Source = src, info: TensorInfo = info, pp: ParamPlan = pp, axis: int = axis,
               per: int = per) -> tuple[list[tuple[Source, TensorInfo]], tuple[int, ...]]:
            start, count = heads[r]
            s = [(_with_slice(src, axis, start * per, count * per), info)]
            return s, _param_shape(pp, s)

        return Split({id(pp): rw})

    def features(self, name: str, mod: nn.Module, entry: FeatureParallel) -> None:
        """:class:`FeatureParallel`: columns by output, rows by input, around one inner width."""
        target = ckpt_name(mod, name)
        cols = self.members(mod, entry.column, name, QuantLinear)
        rows = self.members(mod, entry.row, name, QuantLinear)
        inter = cols[0].out_features
        if any(c.out_features != inter for c in cols) or any(r.in_features != inter for r in rows):
            raise DeclarationError(f"tensor-parallel plan: {name}: the column outputs "
                                   f"{[c.out_features for c in cols]} and row inputs {[r.in_features for r in rows]} "
                                   "are not one inner width")
        if inter % self.world:
            self.replicated(target, f"intermediate size {inter} does not divide over {self.world} ranks")
            return
        ranges = self.even(inter)
        probe = [(lin, d, self.try_linear(lin, lin.scheme, d, lin.out_features, lin.in_features, ranges))
                 for lins, d in ((cols, "out"), (rows, "in")) for lin in lins]
        unsplit = [(lin, res) for lin, _, res in probe if isinstance(res, Unsplit)]
        if len(unsplit) == len(probe):
            # nothing splits: the whole group stays whole here, with no collective at all
            self.replicated(target, "; ".join(f"{lin.qp_ckpt.rsplit('.', 1)[-1]}: {res.reason}" for lin, res in unsplit))
            return
        for lin, d, res in probe:
            self.linear(lin, d, ranges, res=res)

    def experts(self, name: str, mod: nn.Module, entry: ExpertParallel) -> None:
        """:class:`ExpertParallel`: contiguous blocks of experts, one all-reduce of the output."""
        if not isinstance(mod, ExpertGroup):
            raise DeclarationError(f"tensor-parallel plan: {name} ({type(mod).__name__}) is split by ExpertParallel "
                                   "but does not implement qp_hold_experts")
        target = ckpt_name(mod, name)
        stacks = self.members(mod, entry.stacks, name, StackedLinear)
        e = stacks[0].n
        if any(s.n != e for s in stacks):
            raise DeclarationError(f"tensor-parallel plan: {name}: its stacks hold {[s.n for s in stacks]} experts")
        if e < self.world:
            self.replicated(target, f"{e} routed experts are fewer than {self.world} ranks")
            return
        ranges = self.blocks(e)
        rewrites: dict[int, Rewrite] = {}
        backed = []
        for lin in stacks:
            res = self.stacked(lin, ranges)
            if isinstance(res, Unsplit):
                self.replicated(target, f"routed experts cannot split by expert: {res.reason}")
                return
            rewrites.update(res.rewrites)
            backed.append(bool(self.params.get(id(lin))))
        if any(backed) and not all(backed):
            self.replicated(target, "some expert projections are stored tensors and others are served by the scheme")
            return
        self.rewrites.update(rewrites)
        first, count = ranges[self.rank]
        if all(backed):  # the stacks hold this rank's slots only
            for lin in stacks:
                lin.qp_hold_slots(count)
        mod.qp_hold_experts(first, count, first if all(backed) else 0, Reduce(self.comm))
        self.decide(target, "expert-parallel", f"experts per rank {[n for _, n in ranges]} (contiguous blocks); "
                                               "router replicated; one all-reduce")

    def vocab(self, name: str, emb: nn.Module, entry: VocabParallel) -> None:
        """:class:`VocabParallel`: the embedding's rows in blocks, masked lookup + all-reduce."""
        if not isinstance(emb, Embedding):
            raise DeclarationError(f"tensor-parallel plan: {name} ({type(emb).__name__}) is split by VocabParallel "
                                   "but is not an Embedding")
        ranges = self.blocks(emb.vocab)
        res = self.try_linear(emb, emb.scheme, "out", emb.vocab, emb.dim, ranges)
        if isinstance(res, Unsplit):
            self.replicated(emb.qp_ckpt, res.reason)
            return
        start, length = ranges[self.rank]
        self.rewrites.update(res.rewrites)
        emb.qp_parallel = VocabEmbedding(self.comm, start, length)
        self.vocab_ranges[id(emb)] = ranges
        self.decide(emb.qp_ckpt, "vocab-parallel", f"rows per rank {[n for _, n in ranges]}; masked lookup + all-reduce")

    def single(self, name: str, mod: nn.Module, entry: ColumnParallel | RowParallel) -> None:
        """:class:`ColumnParallel` / :class:`RowParallel` of one linear, in blocks."""
        if isinstance(mod, TiedModule) and isinstance(entry, ColumnParallel):
            ranges = self.vocab_ranges.get(id(mod.qp_tied_embedding()))
            if ranges is not None:  # the tied embedding's rows; whole where the embedding is whole
                start, length = ranges[self.rank]
                mod.qp_parallel = Column(self.comm, start, length, [n for _, n in ranges], True, gather=entry.gather)
            return
        if not isinstance(mod, QuantLinear):
            raise DeclarationError(f"tensor-parallel plan: {name} ({type(mod).__name__}) is split by "
                                   f"{type(entry).__name__} but is not a QuantLinear")
        if isinstance(entry, ColumnParallel):
            self.linear(mod, "out", self.blocks(mod.out_features), gather=entry.gather)
        else:
            self.linear(mod, "in", self.blocks(mod.in_features))

    def run(self) -> ParallelPlan:
        tied: list[tuple[str, nn.Module, ColumnParallel]] = []
        for name, mod, entry in declared(self.plan.model, "qp_tp_plan", TP_STYLES):
            if isinstance(entry, HeadParallel):
                self.heads(name, mod, entry)
            elif isinstance(entry, FeatureParallel):
                self.features(name, mod, entry)
            elif isinstance(entry, ExpertParallel):
                self.experts(name, mod, entry)
            elif isinstance(entry, VocabParallel):
                self.vocab(name, mod, entry)
            elif isinstance(mod, TiedModule):
                tied.append((name, mod, entry))  # after its embedding, wherever that is declared
            else:
                self.single(name, mod, entry)
        for name, mod, entry in tied:
            self.single(name, mod, entry)
        # bytes per rank, from headers alone
        totals = [0] * self.world
        for pp in self.plan.params:
            rw = self.rewrites.get(id(pp))
            whole = sum(source_bytes(s, i) for s, i in pp.sources)
            if rw is None:
                self.out.replicated_bytes += whole
                totals = [t + whole for t in totals]
                continue
            self.out.sharded_bytes += whole
            for r in range(self.world):
                totals[r] += sum(source_bytes(s, i) for s, i in rw(r)[0])
        self.out.rank_bytes = totals
        for pid, rw in self.rewrites.items():
            pp = self.pp_by_id[pid]
            pp.sources, pp.shape = rw(self.rank)
        return self.out


def shard_plan(plan: LoadPlan, world: int, rank: int, comm: Comm | None = None) -> ParallelPlan:
    """Rewrite ``plan`` for rank ``rank`` of ``world``: sources become this rank's slices,
    modules get their collectives (over ``comm``; none needed for a plan that is only shown).
    The decisions go into ``plan.decisions``; the result is also ``plan.parallel``."""
    if not 0 <= rank < world:
        raise QuantplugError(f"rank {rank} is outside world size {world}")
    out = _Sharder(plan, world, rank, comm).run()
    plan.decisions.extend(out.decisions)
    plan.parallel = out
    return out


# ---------------------------------------------------------------------------------------------
# Reading slices
# ---------------------------------------------------------------------------------------------

def _runs(info: TensorInfo, slices: Sequence[tuple[int, int, int]]) -> tuple[list[int], int, int]:
    """File byte offsets of the contiguous runs of a slice (C order), run length, item size."""
    shape = storage_shape(info)
    n = math.prod(shape)
    item = info.nbytes // n if n else 1
    sl = {a: (s, ln) for a, s, ln in slices}
    if not sl:
        return [info.offset], info.nbytes, item
    last = max(sl)
    strides = [item * math.prod(shape[i + 1:]) for i in range(len(shape))]
    run = sl[last][1] * strides[last]
    axes = [range(sl[i][0], sl[i][0] + sl[i][1]) if i in sl else range(shape[i]) for i in range(last)]
    base = info.offset + sl[last][0] * strides[last]
    offsets = [base + sum(i * st for i, st in zip(idx, strides)) for idx in itertools.product(*axes)]
    return offsets, run, item


def read_slices(fd: int, info: TensorInfo, slices: Sequence[tuple[int, int, int]], dst: torch.Tensor,
                stage: Any, stage_bytes: int) -> int:
    """Fill contiguous ``dst`` with the slice of stored tensor ``info`` (row slices one range,
    column slices row by row), converting the dtype through ``stage``; returns bytes read."""
    offsets, run, item = _runs(info, slices)
    if info.format == "gguf":
        src_dtype = GGUF_FLOATS.get(info.dtype, torch.uint8)
    else:
        src_dtype = TORCH_DTYPES[info.dtype]
    total = run * len(offsets)
    if dst.numel() * dst.element_size() != total // item * dst.element_size() or total % item:
        raise LoadError(f"{info.where()}: slice {list(slices)} holds {total} bytes, the parameter "
                        f"{list(dst.shape)} {dst.dtype} expects {dst.numel()} elements")
    flat = dst.view(-1)
    if src_dtype == dst.dtype:
        read_runs(fd, [(off, run) for off in offsets], flat.view(torch.uint8))
        return total
    # pieces of at most stage_bytes, batched into the staging buffer, converted in one copy
    cap = max(item, stage_bytes // item * item)
    pieces = [(off + p, min(cap, run - p)) for off in offsets for p in range(0, run, cap)]
    pos = 0
    i = 0
    while i < len(pieces):
        batch = []
        used = 0
        while i < len(pieces) and used + pieces[i][1] <= cap:
            batch.append(pieces[i])
            used += pieces[i][1]
            i += 1
        buf = stage.get(cap)[:used]
        read_runs(fd, batch, buf)
        count = used // item
        flat[pos:pos + count].copy_(buf.view(src_dtype))
        pos += count
    return total


def materialize_sliced(plan: LoadPlan, pp: ParamPlan, device: torch.device, stage: Any, stage_bytes: int) -> torch.Tensor:
    """A parameter whose sources carry rank slices: only those byte ranges are read."""
    out = torch.empty(pp.shape, dtype=pp.dtype)
    for src, info in pp.sources:
        dst = out if src.slot is None else out[src.slot]
        read_slices(plan.checkpoint.fd(info.file), info, src.slices or (), dst, stage, stage_bytes)
    return out if device.type == "cpu" else out.to(device)


# ---------------------------------------------------------------------------------------------
# Launch under torchrun
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def torchrun_session() -> Iterator[Comm | None]:
    """For the CLI: when started by torchrun (``WORLD_SIZE`` > 1 in the environment), initialize
    the default group from it (gloo: the CLI loads on CPU) and silence stdout on every rank but 0;
    destroy the group on exit. Yields the Comm, or None for a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or not dist.is_available():
        yield None
        return
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo")  # the CLI loads on CPU; NCCL reduces only CUDA tensors
    comm = resolve_group()
    saved = sys.stdout
    devnull = None
    if comm is not None and comm.rank != 0:
        devnull = open(os.devnull, "w")  # noqa: SIM115 (closed below)
        sys.stdout = devnull
    try:
        yield comm
    finally:
        sys.stdout = saved
        if devnull is not None:
            devnull.close()
        # a group left out of step by a failed rank keeps a collective pending: destroying it would
        # wait for the peer's process to end, so the process exits without it
        broken = comm is not None and (comm.failed is not None or _loaded_comm_failed())
        if started and not broken:
            dist.destroy_process_group()


_last_comms: list[Comm] = []


def remember(comm: Comm) -> None:
    """The Comm a load under torchrun used (the CLI session checks it before destroying the group)."""
    _last_comms.append(comm)


def _loaded_comm_failed() -> bool:
    return any(c.failed is not None for c in _last_comms)


def guard_model(model: nn.Module, comm: Comm) -> None:
    """Publish any exception of ``model``'s forward / ``next_logits`` / ``next_tokens`` /
    ``hidden_and_logits`` / ``mtp_logits`` (generation, speculative included) to the other ranks (:meth:`Comm.guard`), so they raise naming this rank instead
    of waiting."""
    import functools

    def wrap(fn: Callable[..., Any], during: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with comm.guard(during):
                return fn(*args, **kwargs)
        return run

    model.forward = wrap(model.forward, "forward")
    text_lm = getattr(model, "text_lm", None)
    lm = text_lm() if callable(text_lm) else None
    if lm is not None and hasattr(lm, "next_logits"):
        lm.next_logits = wrap(lm.next_logits, "generate")
        # next_tokens, and speculative decoding's verify forward and MTP draft
        for name in ("next_tokens", "hidden_and_logits", "mtp_logits"):
            if hasattr(lm, name):
                setattr(lm, name, wrap(getattr(lm, name), "generate"))
        if lm is not model:
            lm.forward = wrap(lm.forward, "forward")


def gather_json(comm: Comm, obj: Any) -> list[Any]:
    """Every rank's JSON-able ``obj`` (small: per-rank reports), in rank order, on every rank
    (sent as JSON bytes, not pickles)."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = torch.zeros(comm.world, dtype=torch.int64, device=comm.device)
    sizes[comm.rank] = data.numel()
    dist.all_reduce(sizes, group=comm.group)
    buf = torch.zeros(int(sizes.max()), dtype=torch.uint8, device=comm.device)
    buf[:data.numel()] = data.to(comm.device)
    bufs = [torch.empty_like(buf) for _ in range(comm.world)]
    dist.all_gather(bufs, buf, group=comm.group)
    return [json.loads(bytes(b[:int(n)].cpu().tolist()).decode()) for b, n in zip(bufs, sizes.tolist())]
