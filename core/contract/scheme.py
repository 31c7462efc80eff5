"""The linear scheme contract: :class:`LinearScheme` (what a backend subclasses), the records a
scheme and the plan exchange (:class:`Source`, :class:`SlotSources`, :class:`SplitRule`,
:class:`Part`), the base of every planned module (:class:`PlannedModule`) and the layouts of
stacked linears (:class:`StackLayout` and its kinds).

Below the layers that implement it (``quantplug.layers.linear`` builds :class:`QuantLinear`
and :class:`StackedLinear` on it, and re-exports every name here); it imports only
``quantplug.types`` / ``quantplug.errors`` (the kernels' ``Weights`` for type checking only: the
return type of :meth:`LinearScheme.form`).
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import QuantplugError
from ..types import FLOAT_DTYPES, TORCH_DTYPE_NAMES, Problem, TensorInfo, TensorSpec
from .options import LoadOptions

if TYPE_CHECKING:
    from ..kernels.forms import Weights

#: the one dtype table: safetensors dtype name -> torch dtype (``types.SAFETENSORS_DTYPES`` names
#: the keys, for code that must not import torch; GGUF's float / int types reuse these names);
#: re-exported as ``quantplug.checkpoint.TORCH_DTYPES``
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr in TORCH_DTYPE_NAMES.items()}

FLOATS = tuple(sorted(FLOAT_DTYPES))


class Part(NamedTuple):
    """Part ``nth`` (from 0) of ``parts`` equal parts of stored axis ``axis``, for a fused tensor
    whose length the plan learns only from the header (a scheme that leaves its spec's shape
    open): the plan resolves it into :attr:`Source.narrow` once the header is read."""

    axis: int
    nth: int
    parts: int


class Source(NamedTuple):
    """One checkpoint tensor feeding (part of) one parameter.

    ``narrow`` = (axis, start, length) selects a slice of the stored tensor (transformers 5 fused
    ``gate_up_proj``); ``part`` asks for such a slice before its length is known (:class:`Part`,
    resolved into ``narrow`` by the plan); ``slot`` writes into that slot of the parameter's
    leading (stacked) dimension (hub per-expert tensors). ``shape`` is the stored shape the plan
    expects. A named tuple, not a dataclass: a DeepSeek-V3 plan creates ~45,000 of them.
    """

    tensor: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    narrow: tuple[int, int, int] | None = None
    slot: int | None = None
    optional: bool = False
    #: tensor-parallel slices ((axis, start, length), ...) of the stored tensor's storage shape,
    #: set by :func:`quantplug.parallel.shard_plan` (``narrow`` folded in): the loader reads
    #: exactly those byte ranges, never the whole tensor
    slices: tuple[tuple[int, int, int], ...] | None = None
    #: an equal part of a stored axis whose length the header gives (resolved into ``narrow``)
    part: Part | None = None


class SlotSources(list):
    """The sources of a stacked parameter read one stored tensor per slot (:class:`PerIndexLayout`):
    slot ``i`` <- ``names[i].<suffix>``, every one of ``shape`` and ``dtypes``. A plain list of
    :class:`Source` to every reader; the plan checks such a list in bulk (one lookup per name, set
    checks for dtype and shape) instead of source by source: a Kimi-K3 plan has 494,592 of them.
    Built without keyword arguments (``tuple.__new__``), at a third of ``Source(...)``'s cost."""

    __slots__ = ("shape", "dtypes", "optional")

    def __init__(self, names: Sequence[str], suffix: str, shape: tuple[int, ...], dtypes: tuple[str, ...],
                 optional: bool = False) -> None:
        new = tuple.__new__
        super().__init__(new(Source, (f"{n}.{suffix}", shape, dtypes, None, i, optional, None, None))
                         for i, n in enumerate(names))
        self.shape, self.dtypes, self.optional = shape, dtypes, optional


class SplitRule(NamedTuple):
    """How one stored tensor of a scheme follows a tensor-parallel split of its layer.

    Splitting the layer's out (column-parallel) or in (row-parallel) dimension into equal
    contiguous parts, every ``features`` layer features of a part map to ``units`` indices of
    stored ``axis``: dense ``weight`` out -> (0, 1, 1), in -> (1, 1, 1); MXFP4 packs 2 values per
    byte along in -> (1, 2, 1) and has one scale per 32 -> (1, 32, 1); ModelSlim W4A8 packs two
    output rows per byte -> (0, 2, 1); a ggml Q4_0 row holds blocks of 32 values in 18 bytes ->
    (1, 32, 18). A part whose bounds are not multiples of ``features`` would cut a block: the
    layer is then replicated (recorded), never split wrongly.

    ``axis=None``: the tensor does not follow this split and is loaded whole on every rank
    (per-tensor input scales; per-output tensors under a row split). ``once=True`` (with
    ``axis=None``, row split only): a per-output additive term of the partial sums (ModelSlim
    W8A8 ``quant_bias``): rank 0 keeps it, the other ranks hold zeros, so the all-reduce adds it
    once, not N times.
    """

    axis: int | None
    features: int = 1
    units: int = 1
    once: bool = False


class LinearScheme(abc.ABC):
    """How one linear (or a stack of them: routed experts, per-head MLA K/V) is stored and run.

    Subclasses must implement :meth:`tensor_specs` and :meth:`dequantize`; they may override
    :meth:`apply` (a fused kernel; it must agree with ``dequantize`` then matmul),
    :meth:`embed`, :meth:`check` and, where the stored form is not what forward wants,
    :meth:`process_after_loading`. Parameters are created with exactly the names of the specs'
    suffixes, with a leading dimension when stacked.

    ``key`` says which answers are the same scheme (fused shards must have equal keys; default
    ``describe()``); ``describe()`` is what plans show; ``reason`` (optional) is recorded with the
    decision (e.g. "config_groups.group_0 targets Linear").
    """

    #: short name shown in plans, e.g. "dense", "mxfp4", "w8a8"
    name = "dense"
    #: why this scheme was chosen, recorded in the plan's decision (set per instance if useful)
    reason: str = ""
    #: True when ``apply`` is ``dequantize`` then a float matmul (activations not quantized):
    #: MLA decode may then absorb a dense ``kv_b_proj`` per head through ``dequantize`` and attend
    #: on the cached latent. False (the safe default) for schemes that quantize activations or
    #: that have not said: decode then expands K/V from the cached latent with ``apply`` (exact,
    #: but O(cached tokens) per step)
    weight_only: bool = False

    def takes_fast(self) -> bool:
        """Whether this layer runs faster kernels with a documented error under the core's option
        ``kernels=fast`` (contract 1.7). A plan none of whose layers answers True refuses
        ``kernels=fast`` at plan time, naming the backend, instead of ignoring it. Default: False."""
        return False

    @property
    def key(self) -> str:
        """Equality key: two answers with equal keys are the same scheme (fused shards must agree)."""
        return self.describe()

    def describe(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    @abc.abstractmethod
    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        """The checkpoint tensors (by suffix) one linear of shape [out, in] is stored as."""

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        """Extra header-only checks of the tensors found (keyed by suffix); default none."""
        return []

    def split(self, direction: str, out_features: int, in_features: int) -> Mapping[str, SplitRule] | str | None:
        """How this layer's stored tensors split over tensor-parallel ranks.

        ``direction`` is ``"out"`` (column-parallel: each rank holds a slice of the output
        features) or ``"in"`` (row-parallel: a slice of the input features, partial sums
        all-reduced). Return one :class:`SplitRule` per spec suffix, or a string saying why this
        scheme cannot split that way (the layer is replicated with that reason), or None (the
        default): the scheme declares nothing, and the layer is replicated on every rank. Stacked
        layers (routed experts, MLA K/V per head) split along their stacking axis and are not
        asked. See ``quantplug_linear_scheme`` in hookspecs.py for the rules.
        """
        return None

    def target_dtype(self, spec: TensorSpec, model_dtype: torch.dtype, stored: str) -> torch.dtype:
        """dtype the parameter holds: ``spec.target`` if set, else floats in the model dtype, else as stored."""
        if spec.target is not None:
            return TORCH_DTYPES[spec.target]
        if stored in FLOAT_DTYPES:
            return model_dtype
        return TORCH_DTYPES.get(stored, torch.uint8)

    @abc.abstractmethod
    def dequantize(self, layer: nn.Module, index: int | None = None) -> torch.Tensor:
        """The dense weight [out, in] (of stacked slot ``index``), in the model dtype."""

    def apply(self, layer: nn.Module, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        w = self.dequantize(layer, index)
        return F.linear(x.to(w.dtype), w)

    def apply_row_parallel(self, layer: nn.Module, x: torch.Tensor,
                           all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Row-parallel forward (this rank holds a slice of the input features, see ``split``):
        the partial output, summed over the ranks by ``all_reduce``. The default reduces the
        output of :meth:`apply`; a scheme with an exact integer accumulator may reduce that
        instead, before its float scaling, so the result equals one process bit for bit."""
        return all_reduce(self.apply(layer, x))

    def apply_grouped(self, layer: nn.Module, x: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
        """Stacked layers (routed experts): ``x`` [rows, in] holds consecutive groups of rows,
        ``groups`` = [(slot, rows), ...] in order; returns [rows, out], each group through its
        slot. The default applies slot by slot; a scheme may batch the slots (one kernel over
        several experts' weights). Must agree with :meth:`apply` per group."""
        if len(groups) == 1:
            return self.apply(layer, x, groups[0][0])
        outs, start = [], 0
        for slot, n in groups:
            outs.append(self.apply(layer, x[start:start + n], slot))
            start += n
        return torch.cat(outs)

    def apply_all(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Stacked layers (MLA K/V per head): x [..., n, T, in] -> [..., n, T, out], slot i applied
        to x[..., i, :, :]. The default applies slot by slot; a scheme may run one batched matmul."""
        outs = [self.apply(layer, x[..., i, :, :], i) for i in range(x.shape[-3])]
        return torch.stack(outs, dim=-3)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight (layer kind ``"embedding"``), in the model dtype. The
        default dequantizes the whole matrix; a scheme can dequantize only the rows looked up."""
        return F.embedding(ids, self.dequantize(layer))

    def process_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook, default no-op)
        """Called once per layer after all its tensors are loaded."""

    def form(self, layer: nn.Module) -> Weights | None:
        """This loaded layer's weight as one of the core's forms (``quantplug.kernels.forms``): a
        :class:`~quantplug.kernels.forms.Weights` naming the :class:`~quantplug.kernels.forms.Form`
        and the layer's tensors (stacked layers: with their leading slot dimension), or None (the
        default): the scheme computes every product itself through :meth:`apply`.

        With a form the core runs the layer's products, its one-token MLP / routed-expert steps and
        the absorbed MLA decode step natively (exact mode: the form's exact values, float32 sums),
        so the form must describe exactly what :meth:`dequantize` returns and the activation
        quantization :meth:`apply` performs (the conformance kit checks both). Called once per layer
        after :meth:`process_after_loading` (a scheme may repack its tensors there, once, into a
        form; the repacked tensors count in the model's bytes); again if the layer's tensors are
        replaced. Products the native kernels do not take (no C compiler, tensors off the CPU,
        many rows in fast mode) still go through :meth:`apply`.

        .. versionadded:: 1.4
        """
        return None

    def fuse(self, layers: Sequence[nn.Module]) -> Callable[..., torch.Tensor] | None:
        """Projections of one input, run as one: ``layers`` are sibling linears that the model
        always applies to the same ``x`` (an MLP's gate and up, MLA's q_a and kv_a, routed
        experts' gate and up), each answered by this scheme's class, loaded and processed, none
        tensor-parallel. Return ``f`` with ``f(x)`` (plain linears) or ``f(x, groups)`` (stacked,
        as :meth:`apply_grouped`) = the layers' outputs concatenated along the last dim, computed
        as the separate applies compute them (the same kernels, so bit for bit in practice), or
        None (the default): the model applies the layers one by one. Called once, after loading
        (:func:`fuse_projections`); a scheme that fuses may re-point the layers' own buffers into
        the fused ones (no extra memory), but each layer must still work on its own. Fused calls
        do not run the sibling modules' forward hooks.

        .. versionadded:: 1.2
        """
        return None

    def fuse_mlp(self, gate: nn.Module, up: nn.Module, down: nn.Module) -> Callable[..., torch.Tensor] | None:
        """A gated MLP for one token, run as one: ``down(silu(gate(x)) * up(x))`` where ``gate`` and
        ``up`` map hidden -> intermediate and ``down`` maps back, all three answered by this
        scheme's class, loaded, processed and fused (:meth:`fuse`) already, none tensor-parallel.
        Plain linears (a dense MLP, the shared experts): return ``f`` with ``f(x)`` for x [1, hidden]
        -> [1, hidden]. Stacked (routed experts): ``f(x, slots, weights)`` = the sum over i, in the
        given order, of ``weights[i] * mlp_{slots[i]}(x)`` (a decode step's top-k experts, weights
        as Python floats). The result must equal the model's own composition of the separate
        applies up to float rounding (the conformance kit checks it). None (the default): the
        model composes the applies. Called once, after :meth:`fuse`, by :func:`fuse_mlp`; the model
        calls ``f`` for single tokens only.

        .. versionadded:: 1.3
        .. deprecated:: 1.4
           Declare :meth:`form` instead: the core then runs the step natively for every scheme.
           Still honoured (with a DeprecationWarning) where the core has no native step for the
           layers; removed at contract 2.0.
        """
        return None

    def fuse_attention(self, attn: nn.Module) -> Callable[..., torch.Tensor | None] | None:
        """A decode step of an MLA layer (``quantplug.models.deepseek.MLA``) run as one, asked of
        its ``o_proj``'s scheme after loading and :meth:`fuse`: return ``f`` with
        ``f(x, rotation, cache)`` for x [1, 1, hidden] (one token of one sequence), ``rotation``
        the step's rope matrix [rope, rope] (``roped = x @ rotation``) and ``cache`` the layer's
        ``LatentCache``: f must append the token's normed latent and roped key with
        ``cache.append`` (shapes [1, 1, 1, dim]) and return the attention output after
        ``o_proj`` [1, 1, hidden], equal to the model's absorbed form up to float rounding (the
        conformance kit checks it); or return None to decline that call (the model runs its own
        step). None (the default): no fused step. The layer's modules are all loaded, unsplit
        (tensor parallelism declines) and their schemes processed.

        .. versionadded:: 1.3
        .. deprecated:: 1.4
           Declare :meth:`form` instead (as for :meth:`fuse_mlp`); removed at contract 2.0.
        """
        return None


def kernels_mode(scheme: LinearScheme, options: LoadOptions) -> str:
    """The native kernels' mode of a layer computed by ``scheme`` under ``options``: "fast" when
    the load asks for ``kernels=fast`` and the scheme takes it (:meth:`LinearScheme.takes_fast`),
    else "exact"."""
    return "fast" if options.kernels == "fast" and scheme.takes_fast() else "exact"


class PlannedModule(nn.Module):
    """A module whose parameters the plan fills from named checkpoint tensors.

    ``qp_sources`` maps each local parameter name to its :class:`Source` list; ``qp_ckpt`` is the
    module's checkpoint name (for messages and decisions).
    """

    qp_ckpt: str
    qp_sources: dict[str, list[Source]]
    #: tensor-parallel forward of this module (``quantplug.parallel``), None: unsplit
    qp_parallel: Any = None
    #: the weights bound to the native kernels (``quantplug.kernels.compute.bind``), None: none
    qp_native: Any = None
    #: stacked layers (routed experts, per-head K/V): one matrix per slot
    qp_stacked = False
    #: the native kernels' mode for this layer's products: "fast" under load option
    #: ``kernels=fast`` where its scheme takes it (:meth:`LinearScheme.takes_fast`), else "exact"
    #: (set by :meth:`qp_configure`)
    qp_kernel_mode: str = "exact"
    # registered by the loader from the plan; declared for type checkers
    weight: torch.Tensor

    def qp_init(self, ckpt: str) -> None:
        self.qp_ckpt = ckpt
        self.qp_sources = {}

    def qp_target_dtype(self, name: str, stored: str, model_dtype: torch.dtype) -> torch.dtype:
        """dtype parameter ``name`` holds in memory: floats in the model dtype, others as stored."""
        return model_dtype if stored in FLOAT_DTYPES else TORCH_DTYPES.get(stored, torch.uint8)

    def qp_configure(self, options: LoadOptions) -> None:  # noqa: B027 (optional, default no-op)
        """Called by the loader with the load's checked options before any tensor is loaded (a
        module reading load options takes them here). Default: nothing to take."""

    def qp_finish(self) -> None:
        """Called after loading (schemes post-process here)."""

    def qp_check(self, found: Mapping[str, TensorInfo]) -> list[Problem]:
        """Plan-time problems of the tensors found for this module's parameters (``found``: local
        parameter name -> the checkpoint tensor, from headers), beyond what its sources declare:
        a module whose source leaves a shape open (``Source.shape`` empty: several stored shapes
        are valid) refuses the ones it cannot use here, naming the tensor; a module whose parameter
        comes in alternative forms (optional sources, one set of which must be complete) names what
        is missing. Called also when nothing was found. Default: none."""
        return []


@dataclass(frozen=True)
class StackLayout(abc.ABC):
    """Where a :class:`StackedLinear`'s stacked tensors come from (one of the subclasses)."""

    @staticmethod
    def of(layout: StackLayout | tuple) -> StackLayout:
        """``layout`` as a :class:`StackLayout`; the tagged tuples of contract 1.1 - 1.4
        (``("fused", name, (part, parts))``, ``("per_index", names)``, ``("stacked", name)``) are
        converted with a DeprecationWarning."""
        if isinstance(layout, StackLayout):
            return layout
        warnings.warn("StackedLinear layouts as tagged tuples are deprecated; pass FusedLayout, PerIndexLayout or "
                      "StackedLayout (quantplug.api)", DeprecationWarning, stacklevel=3)
        if isinstance(layout, tuple) and len(layout) == 3 and layout[0] == "fused":
            part, parts = layout[2]
            return FusedLayout(layout[1], part, parts)
        if isinstance(layout, tuple) and len(layout) == 2 and layout[0] == "per_index":
            return PerIndexLayout(tuple(layout[1]))
        if isinstance(layout, tuple) and len(layout) == 2 and layout[0] == "stacked":
            return StackedLayout(layout[1])
        raise QuantplugError(f"StackedLinear layout {layout!r}: expected FusedLayout, PerIndexLayout or StackedLayout")

    @property
    @abc.abstractmethod
    def stored(self) -> tuple[str, ...]:
        """The checkpoint modules (or fused tensors) this layout reads."""


@dataclass(frozen=True)
class FusedLayout(StackLayout):
    """One stored tensor per spec holding every slot, named ``name`` (spec ``weight``) or
    ``name_<suffix>``; slot rows are part ``part`` of ``parts`` equal parts of axis 1
    (transformers 5 ``gate_up_proj`` [E, 2I, H] holds gate rows then up rows: parts 2)."""

    name: str
    part: int = 0
    parts: int = 1

    @property
    def stored(self) -> tuple[str, ...]:
        return (self.name,)

    def __post_init__(self) -> None:
        if not 0 <= self.part < self.parts:
            raise QuantplugError(f"FusedLayout {self.name}: part {self.part} of {self.parts}")


@dataclass(frozen=True)
class PerIndexLayout(StackLayout):
    """One stored module per slot: slot ``i`` reads ``names[i].<suffix>`` (hub per-expert tensors)."""

    names: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(self.names))

    @property
    def stored(self) -> tuple[str, ...]:
        return self.names


@dataclass(frozen=True)
class StackedLayout(StackLayout):
    """One stored module ``name.<suffix>`` whose tensors hold all slots on their leading axis
    (GGUF ``ffn_*_exps``, ``attn_k_b`` / ``attn_v_b``)."""

    name: str

    @property
    def stored(self) -> tuple[str, ...]:
        return (self.name,)
