"""What an architecture declares for the core to read: its tensor-parallel plan and its dense-state mapping.

A model class (the text model's root, e.g. ``DeepseekV3ForCausalLM``) carries two class attributes,
each a mapping from a module-name pattern (relative to that class's instance, ``*`` standing for
one name component, as in transformers' ``base_model_tp_plan``) to a typed entry:

* ``qp_tp_plan``: how the modules it names split over tensor-parallel ranks
  (:class:`ColumnParallel`, :class:`RowParallel`, :class:`FeatureParallel`,
  :class:`HeadParallel`, :class:`ExpertParallel`, :class:`VocabParallel`). Read by
  :func:`quantplug.parallel.shard_plan`; a module no entry names is replicated.
* ``qp_dense_state``: how stacked layers go back to the hub layout's dense tensors
  (:class:`Unstack`, :class:`FoldHeads`). Read by :func:`quantplug.api.dense_state`; plain
  linears, embeddings and float parameters need no entry.

An entry applies to the modules its pattern names that hold its members (``FeatureParallel``'s
``gate_proj`` / ``up_proj`` / ``down_proj``...): a pattern such as ``model.layers.*.mlp`` names
both dense MLPs and MoE blocks, and only the former hold those members. A module holding only
some of an entry's required members, or named by two entries, is a :class:`DeclarationError`
naming the class, the pattern and the module.

A module an entry of the tensor-parallel plan splits by heads or experts implements the small
interface of :class:`HeadGroup` / :class:`ExpertGroup`, so the parallel loader never sets an
architecture's fields itself; every module a group entry names has ``qp_ckpt``, its checkpoint
name (decisions and dense-state names use it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import QuantplugError


class DeclarationError(QuantplugError):
    """An architecture's ``qp_tp_plan`` / ``qp_dense_state`` does not fit the modules it names."""


# ---------------------------------------------------------------------------------------------
# Tensor-parallel plan entries
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ColumnParallel:
    """One linear (``QuantLinear``) split by output features into contiguous blocks (the first
    ``out % N`` ranks hold one more); ``gather``: every rank's slice is all-gathered after the
    product (``lm_head``: the logits). On a tied head (:class:`TiedModule`) it follows its
    embedding's :class:`VocabParallel` rows. transformers: ``"colwise"`` / ``"colwise_rep"``."""

    gather: bool = False


@dataclass(frozen=True)
class RowParallel:
    """One linear split by input features into contiguous blocks; the partial products are
    all-reduced. transformers: ``"rowwise"``."""


@dataclass(frozen=True)
class FeatureParallel:
    """A pair of column- and row-parallel linears around one inner width (a gated MLP: ``gate``
    and ``up`` by output, ``down`` by input), split into equal parts. Inner width not divisible
    by the ranks, or no member splitting: the whole group stays whole with no collective (one
    decision); otherwise each member splits or, where its scheme cannot, computes whole with a
    gather (exact either way). transformers: ``"colwise"`` on gate / up and ``"rowwise"`` on
    down."""

    column: tuple[str, ...]
    row: tuple[str, ...]


@dataclass(frozen=True)
class HeadSlice:
    """A float parameter of a :class:`HeadParallel` module held per head (Kimi's KDA: the q / k / v
    convolutions' channels, ``dt_bias``, ``A_log``): each rank reads only its heads' entries.

    ``param``: the parameter's dotted name relative to the module (``"dt_bias"``,
    ``"q_conv1d.weight"``; the owner is the module itself or a ``FloatParams`` child). The head
    axis is the stored tensor's first axis longer than 1 (``[C, 1, W]`` and ``[C]``: axis 0;
    Kimi-Linear's ``A_log`` ``[1, 1, H, 1]``: axis 2). ``per_head``: entries of that axis per
    head; None: the axis length divided by the head count (an error unless it divides). The
    heads' entries are the axis' first ``heads * per_head`` (K3's ``A_log`` stored as a longer 1-D
    tensor whose first H entries are the heads': ``per_head=1``, the rest is read by no rank).
    sglang: ``_a_log_weight_loader`` / the conv weights' ``narrow`` by ``tp_rank``."""

    param: str
    per_head: int | None = None


@dataclass(frozen=True)
class HeadParallel:
    """Attention heads over ranks: the ``column`` linears hold this rank's heads' output features
    (MLA ``q_b_proj`` / ``q_proj``, ``kv_b_proj``, the Kimi-K3 ``g_proj``; KDA's q / k / v,
    ``f_b_proj``, ``g_proj`` / ``g_b_proj`` and ``b_proj``, one feature per head), the ``row``
    linears their input features (``o_proj``, all-reduced), the ``stacks`` (``StackedLinear`` with
    one slot per head: split MLA ``k_b`` / ``v_b``) their slots, the ``floats``
    (:class:`HeadSlice`) their entries. Absent members are skipped (a layout without
    ``kv_b_proj``, a config without ``q_lora``, an MLA layer beside KDA's float parameters); each
    present linear's width must be a multiple of the head count. All or nothing: if the heads do
    not divide over the ranks or any member cannot split, the layer's attention is replicated.
    The module implements :class:`HeadGroup`. transformers: ``"colwise"`` / ``"rowwise"`` on q / k
    / v / o, with the head count read from the local shapes."""

    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    stacks: tuple[str, ...] = ()
    floats: tuple[HeadSlice, ...] = ()


@dataclass(frozen=True)
class ExpertParallel:
    """Routed experts, expert-parallel: every ``stacks`` member (``StackedLinear`` with one slot per
    expert) keeps a contiguous block of experts per rank (the first ``E % N`` ranks hold one
    more), the router stays replicated and the module's output is all-reduced once (its
    ``qp_parallel`` is set to that reduce). The module implements :class:`ExpertGroup`.
    transformers: ``base_model_ep_plan`` ``"grouped_gemm"`` on the experts with ``"ep_router"``."""

    stacks: tuple[str, ...]


@dataclass(frozen=True)
class VocabParallel:
    """The token embedding (``Embedding``) by vocabulary rows: masked lookup + all-reduce; a
    :class:`ColumnParallel` ``gather`` entry on its tied head then uses the same rows.
    transformers: ``"embedding_rowwise"`` (vLLM ``VocabParallelEmbedding``)."""


TPStyle = ColumnParallel | RowParallel | FeatureParallel | HeadParallel | ExpertParallel | VocabParallel


@runtime_checkable
class HeadGroup(Protocol):
    """A module split by :class:`HeadParallel`."""

    qp_ckpt: str

    def qp_heads(self) -> int:
        """The layer's whole head count."""
        ...

    def qp_hold_heads(self, start: int, count: int) -> None:
        """From now on this module computes heads ``[start, start + count)`` only (its members
        already hold just those heads' features)."""
        ...


@runtime_checkable
class ExpertGroup(Protocol):
    """A module split by :class:`ExpertParallel`."""

    qp_ckpt: str

    def qp_hold_experts(self, start: int, count: int, slot_base: int,
                        reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """From now on this module computes routed experts ``[start, start + count)`` only;
        expert ``k`` is slot ``k - slot_base`` of its stacks (``slot_base`` = ``start`` when the
        stacks hold only this rank's slots, 0 when the scheme addresses experts itself), and its
        output (this rank's experts' share) goes through ``reduce`` (the sum over the ranks)."""
        ...


@runtime_checkable
class TiedModule(Protocol):
    """An output head that computes with an embedding's rows (``tie_word_embeddings``); under
    tensor parallelism the core sets its ``qp_parallel`` (called as ``qp_parallel(embedding, x)``)."""

    qp_parallel: Any

    def qp_tied_embedding(self) -> nn.Module:
        """The embedding module whose rows this head multiplies by."""
        ...


# ---------------------------------------------------------------------------------------------
# Dense-state entries
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Unstack:
    """Each ``stacks`` member (a ``StackedLinear`` named ``<parent>.<proj>``) goes back to one
    dense tensor per slot, ``<parent>.<slot>.<proj>.weight`` (routed experts in the hub layout);
    ``stored``: the per-slot names the architecture's checkpoints use instead, one per member in
    order (Kimi's ``w1`` / ``w3`` / ``w2`` for gate / up / down; empty: the member names)."""

    stacks: tuple[str, ...]
    stored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.stored and len(self.stored) != len(self.stacks):
            raise DeclarationError(f"Unstack: stored names {list(self.stored)} do not match the stacks "
                                   f"{list(self.stacks)} one to one")


@dataclass(frozen=True)
class HeadPart:
    """One per-head stack folded by :class:`FoldHeads`; ``transpose``: the slot is stored
    transposed relative to its rows in the folded tensor (llama.cpp ``attn_k_b``)."""

    member: str
    transpose: bool = False


@dataclass(frozen=True)
class FoldHeads:
    """Per-head stacks (one slot per head, every part the same head count) folded into one dense
    tensor ``<module qp_ckpt>.<into>.weight``: for each head, every part's slot in order, rows
    concatenated (split MLA ``k_b`` / ``v_b`` back into ``kv_b_proj``)."""

    into: str
    parts: tuple[HeadPart, ...]


DenseRule = Unstack | FoldHeads


# ---------------------------------------------------------------------------------------------
# Engine entries (qp_engine_plan: how an engine's own module tree takes the planned modules)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineMLP:
    """A gated MLP (``down(act(gate(x)) * up(x))``) an engine runs with a merged gate + up
    projection named ``<module>.<merged>`` (vLLM ``MergedColumnParallelLinear``), computed in one
    call where the scheme fused the pair at load (the module's ``fused`` attribute, or None).
    ``quantplug.bridge.planned_mlps`` hands the module itself to engines that run it whole."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    merged: str = "gate_up_proj"
    fused: str = "gate_up"


@dataclass(frozen=True)
class EngineExperts:
    """Routed experts an engine calls as ``fn(x, topk_ids, topk_weights)``: the module implements
    :class:`RoutedExperts` (its ``stacks`` are the gate / up / down ``StackedLinear``)."""

    stacks: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class EngineLatentAttention:
    """Multi-head latent attention an engine runs in its own attention module: ``q_a`` and
    ``kv_a`` merged as ``<module>.<merged>`` (one call where the module's ``fused`` attribute
    holds their fused product), K/V up-projections as a dense ``kv_b`` or per-head ``k_b`` /
    ``v_b`` stacks (the engine gets a ``kv_b_proj`` either way), and the absorbed per-head
    products (``quantplug.bridge.AbsorbedMLA``). The module implements
    :class:`LatentAttention`. ``unsupported``: members an engine's latent attention has no
    place for, with why (``(member, reason)``): a module holding one is refused by name. The
    entry applies to the modules its pattern names that hold ``kv_a`` (a hybrid's other attention
    layers under the same name, Kimi's KDA, are not MLA)."""

    q_a: str = "q_a_proj"
    kv_a: str = "kv_a_proj_with_mqa"
    merged: str = "fused_qkv_a_proj"
    fused: str = "qkv_a"
    unsupported: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class EngineGroupedLinear:
    """A block-diagonal grouped linear (DeepSeek-V4's ``wo_a``: group g of the input through its own
    block of rows) an engine calls as ``<module>.<member>`` on x [..., groups, in / groups] ->
    [..., groups, out / groups]. The module's ``product`` method computes it as quantplug's own
    forward does (``product(x)`` -> [..., groups * out / groups]); the member's plain product
    (every group through every block) is not what the engine means, so it is never handed out
    under that name as a plain linear."""

    member: str
    product: str


EngineEntry = EngineMLP | EngineExperts | EngineLatentAttention | EngineGroupedLinear


@dataclass(frozen=True)
class EngineRename:
    """A name the engines' module tree gives what quantplug's text model names otherwise: every
    name ``quantplug.bridge`` hands out (planned modules, float tensors) has ``pattern`` (a regular
    expression) replaced by ``repl`` (``re.sub``), the renames applied in declaration order. Read
    from the text model class's ``qp_engine_names`` (a tuple of renames; none: the names are the
    engines' already). Kimi-Linear: transformers' ``KimiLinearForCausalLM`` holds the release's
    ``block_sparse_moe`` as ``mlp`` and the forget gate's ``f_a_proj`` / ``f_b_proj`` / ``dt_bias`` /
    ``A_log`` under ``self_attn.forget_gate``."""

    pattern: str
    repl: str

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise DeclarationError(f"EngineRename({self.pattern!r}): not a regular expression ({exc})") from None


@runtime_checkable
class RoutedExperts(Protocol):
    """Routed experts an :class:`EngineExperts` entry names."""

    #: the experts' native step (one call for a few tokens' experts), or None
    step: Any

    def forward_step(self, x: torch.Tensor, ids: Any, weights: Any) -> torch.Tensor:
        """Each row's experts ``ids[r]`` weighted by ``weights[r]`` (Python lists), natively."""
        ...

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class EngineFloats(Protocol):
    """A module whose float tensors (its own and its float children's) engines hold in another
    form than quantplug loads them: ``qp_engine_floats()`` gives them as the engines hold them, by
    name relative to the module, and ``quantplug.bridge.float_state`` takes these in place of the
    loaded ones. Kimi's KDA: the q / k / v convolutions as one ``conv1d.weight`` [3 * H * K, 1, W]
    (q, k, v channels in order), and the decay rate as ``A_log`` [H] whichever form was loaded
    (llama.cpp's folded ``A`` = -exp(A_log) unfolded)."""

    def qp_engine_floats(self) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class LatentAttention(Protocol):
    """Latent attention an :class:`EngineLatentAttention` entry names (DeepSeek's MLA): the
    heads it computes, the latent width, the head dims, and how K/V are stored (``layout.kind``
    ``"dense"``: a ``kv_b_proj`` member; otherwise ``k_b`` / ``v_b`` stacks)."""

    qp_ckpt: str
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    layout: Any


# ---------------------------------------------------------------------------------------------
# Reading the declarations
# ---------------------------------------------------------------------------------------------

def _compile(pattern: str) -> re.Pattern[str]:
    parts = pattern.split(".")
    if not pattern or any(not p for p in parts):
        raise DeclarationError(f"module pattern {pattern!r}: expected dotted names, '*' for one component")
    return re.compile(r"\.".join(r"[^.]+" if p == "*" else re.escape(p) for p in parts) + r"\Z")


def _entry_members(entry: object) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) member names of an entry."""
    if isinstance(entry, FeatureParallel):
        return (*entry.column, *entry.row), ()
    if isinstance(entry, HeadParallel):
        return (), (*entry.column, *entry.row, *entry.stacks)
    if isinstance(entry, ExpertParallel | Unstack):
        return entry.stacks, ()
    if isinstance(entry, FoldHeads):
        return tuple(p.member for p in entry.parts), ()
    if isinstance(entry, EngineMLP):
        return (entry.gate, entry.up, entry.down), ()
    if isinstance(entry, EngineExperts):
        return entry.stacks, ()
    if isinstance(entry, EngineLatentAttention):
        return (entry.kv_a,), ()  # an MLA layer (a KDA layer under the same name holds no kv_a)
    if isinstance(entry, EngineGroupedLinear):
        return (entry.member,), ()
    return (), ()


def declared(model: nn.Module, attr: str, kinds: tuple[type, ...]) -> Iterator[tuple[str, nn.Module, Any]]:
    """``(module name in model, module, entry)`` for every module an entry of the declaration
    ``attr`` (``"qp_tp_plan"``, ``"qp_dense_state"`` or ``"qp_engine_plan"``) of a module in ``model`` applies to,
    in module order. Entries must be instances of ``kinds``."""
    roots = [(name, mod) for name, mod in model.named_modules() if getattr(type(mod), attr, None)]
    seen: dict[int, str] = {}
    for root_name, root in roots:
        plan: Mapping[str, Any] = getattr(type(root), attr)
        cls = type(root).__name__
        if not isinstance(plan, Mapping):
            raise DeclarationError(f"{cls}.{attr} must be a mapping of module patterns to entries, "
                                   f"not {type(plan).__name__}")
        compiled = []
        for pattern, entry in plan.items():
            if not isinstance(entry, kinds):
                raise DeclarationError(f"{cls}.{attr}[{pattern!r}] is {type(entry).__name__}; expected one of "
                                       f"{', '.join(k.__name__ for k in kinds)}")
            compiled.append((pattern, _compile(pattern), entry))
        for rel, mod in root.named_modules():
            hits = [(p, e) for p, rx, e in compiled if rel and rx.match(rel)]
            applies = []
            for pattern, entry in hits:
                required, _ = _entry_members(entry)
                held = [n for n in required if isinstance(mod._modules.get(n), nn.Module)]
                if required and not held:
                    continue  # not this role (a MoE block where dense MLPs are declared)
                if len(held) != len(required):
                    raise DeclarationError(f"{cls}.{attr}[{pattern!r}]: {rel} holds {held} of its members "
                                           f"{list(required)}")
                applies.append((pattern, entry))
            if len(applies) > 1:
                raise DeclarationError(f"{cls}.{attr}: {rel} is named by {[p for p, _ in applies]}; "
                                       "one entry per module")
            if not applies:
                continue
            name = f"{root_name}.{rel}" if root_name else rel
            if id(mod) in seen and attr == "qp_tp_plan":
                raise DeclarationError(f"{attr}: {name} is declared twice ({seen[id(mod)]} and {cls})")
            seen[id(mod)] = cls
            yield name, mod, applies[0][1]


def ckpt_name(mod: nn.Module, where: str) -> str:
    """The checkpoint name of a module a group entry names (its ``qp_ckpt``)."""
    name = getattr(mod, "qp_ckpt", None)  # a third party's module may lack it: said below
    if not isinstance(name, str):
        raise DeclarationError(f"{where} ({type(mod).__name__}) is named by a group entry but has no qp_ckpt "
                               "(its checkpoint name)")
    return name

