"""Linear layers whose storage and arithmetic belong to a pluggable :class:`LinearScheme`.

A scheme (vLLM's ``create_weights`` / ``apply`` / ``process_weights_after_loading`` shape)
declares the checkpoint tensors it needs as :class:`~quantplug.types.TensorSpec` so the plan can
check names, dtypes and shapes from headers before any data is read. Dense loading is the same
interface: :class:`DenseScheme` is the core's default answer to ``quantplug_linear_scheme``.
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
from ..kernels import compute
from ..kernels.forms import Form, Weights
from ..types import FLOAT_DTYPES, SAFETENSORS_DTYPES, Problem, TensorInfo, TensorSpec

if TYPE_CHECKING:
    from ..options import LoadOptions

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
        from ..checkpoint import TORCH_DTYPES

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


class DenseScheme(LinearScheme):
    """Unquantized weight [out, in]; F32 / F16 / BF16 on disk, computed in the model dtype.

    A weight whose stored values the model dtype holds exactly (BF16 or F16 on disk, a float32
    model) stays as stored: the conversion is exact, so products on the stored values are the
    model dtype's products, and memory and bytes read per token are the file's (DeepSeek's and
    Kimi's bf16 embeddings and lm_head: half the float32 copy). Otherwise the weight is converted
    to the model dtype at load, as before."""

    name = "dense"
    weight_only = True

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        return [TensorSpec("weight", FLOATS, (out_features, in_features))]

    def target_dtype(self, spec: TensorSpec, model_dtype: torch.dtype, stored: str) -> torch.dtype:
        if model_dtype == torch.float32 and stored in ("BF16", "F16"):
            return torch.bfloat16 if stored == "BF16" else torch.float16
        return super().target_dtype(spec, model_dtype, stored)

    def dequantize(self, layer: nn.Module, index: int | None = None) -> torch.Tensor:
        w: torch.Tensor = layer.weight  # type: ignore[assignment]
        w = w if index is None else w[index]
        return w if w.dtype == layer.model_dtype else w.to(layer.model_dtype)  # type: ignore[arg-type]

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, layer.weight)  # type: ignore[arg-type]
        return rows if rows.dtype == layer.model_dtype else rows.to(layer.model_dtype)  # type: ignore[arg-type]

    def split(self, direction: str, out_features: int, in_features: int) -> Mapping[str, SplitRule]:
        return {"weight": SplitRule(0 if direction == "out" else 1)}

    def form(self, layer: nn.Module) -> Weights | None:
        w: torch.Tensor = layer.weight  # type: ignore[assignment]
        name = FLOAT_FORMS.get(w.dtype)
        return None if name is None else Weights(Form(name), w)


#: torch float dtype -> the float form of weights held in it
FLOAT_FORMS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class RefusedScheme(LinearScheme):
    """A layer the backend cannot compute: one plan-time error Problem naming the layer and the
    config field (``quantplug.api.refuse``); never a silent dense fallback. Its tensors are
    accepted whatever they are, so the refusal is the one problem reported for the layer."""

    name = "refused"

    def __init__(self, layer: str, field: str, why: str) -> None:
        self.layer, self.field, self.why = layer, field, why

    def describe(self) -> str:
        return f"refused ({self.field}: {self.why})"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        return [TensorSpec("weight", SAFETENSORS_DTYPES, None, optional=True)]

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        return [Problem(f"{self.field}: {self.why}; refusing a silent dense fallback", layer=layer_name,
                        kind="refused")]

    def dequantize(self, layer: nn.Module, index: int | None = None) -> torch.Tensor:
        raise RuntimeError(f"{self.layer}: {self.why}")  # unreachable: the plan refuses to load


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
        from ..checkpoint import TORCH_DTYPES

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


class FloatParams(PlannedModule):
    """Helper for modules holding plain float parameters (norms, embeddings, routers)."""

    qp_fp32: frozenset[str] = frozenset()

    def add_float(self, name: str, shape: tuple[int, ...], ckpt_tensor: str, optional: bool = False) -> None:
        self.qp_sources[name] = [Source(ckpt_tensor, shape, FLOATS, optional=optional)]

    def qp_target_dtype(self, name: str, stored: str, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if name in self.qp_fp32 else model_dtype


class QuantLinear(PlannedModule):
    """``y = x W^T`` with W stored and applied by ``scheme``; no bias (MLA / MoE linears have none)."""

    def __init__(self, in_features: int, out_features: int, scheme: LinearScheme, ckpt: str,
                 model_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        #: (out, in) of the whole layer; ``out_features`` / ``in_features`` become this rank's
        #: slice when tensor parallelism splits the layer, this never changes
        self.full_features = (out_features, in_features)
        self.scheme = scheme
        self.qp_init(ckpt)
        self.specs = {s.suffix: s for s in scheme.tensor_specs(out_features, in_features)}
        for s in self.specs.values():
            shape = s.shape if s.shape is not None else ()
            self.qp_sources[s.suffix] = [Source(f"{ckpt}.{s.suffix}", shape, s.dtypes, optional=s.optional)]
        self.model_dtype = model_dtype

    def qp_target_dtype(self, name: str, stored: str, model_dtype: torch.dtype) -> torch.dtype:
        return self.scheme.target_dtype(self.specs[name], model_dtype, stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qp_parallel is not None:
            return self.qp_parallel(self, x)  # column / row parallel with its collective
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` of the weight this rank holds: on its form natively where the core can
        (:mod:`quantplug.kernels.compute`), else the scheme's ``apply``."""
        y = compute.linear(self, x)
        return self.scheme.apply(self, x) if y is None else y

    def qp_configure(self, options: LoadOptions) -> None:
        self.qp_kernel_mode = kernels_mode(self.scheme, options)

    def qp_finish(self) -> None:
        self.scheme.process_after_loading(self)
        self.qp_native = compute.bind(self)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme.describe()}"


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


class StackedLinear(PlannedModule):
    """``n`` linears of one shape stored as one stacked tensor per spec: routed experts
    (``[E, out, in]``) or split MLA K/V per head. ``layout`` (a :class:`StackLayout`) says where
    the stacked tensors come from. Routed experts served from the checkpoint's files
    (``expert_cache_mb``) keep this module's specs and layout but load no stacked tensors: the
    expert cache (:mod:`quantplug.experts`) reads one expert's slices at a time."""

    def __init__(self, n: int, in_features: int, out_features: int, scheme: LinearScheme, ckpt: str,
                 layout: StackLayout | tuple, model_dtype: torch.dtype) -> None:
        super().__init__()
        self.n, self.in_features, self.out_features = n, in_features, out_features
        self.full_features = (out_features, in_features)  # stacks split by slot, never by features
        self.scheme = scheme
        self.model_dtype = model_dtype
        self.layout = StackLayout.of(layout)
        self.qp_init(ckpt)
        self.specs = {s.suffix: s for s in scheme.tensor_specs(out_features, in_features)}
        for s in self.specs.values():
            self.qp_sources[s.suffix] = self._sources(s, n)

    def _sources(self, s: TensorSpec, n: int) -> list[Source]:
        # shape None: the scheme checks shapes itself (``check``); the plan checks none here
        known = s.shape is not None
        shape = s.shape if s.shape is not None else ()
        lay = self.layout
        if isinstance(lay, StackedLayout):
            return [Source(f"{lay.name}.{s.suffix}", (n, *shape) if known else (), s.dtypes, optional=s.optional)]
        if isinstance(lay, PerIndexLayout):
            return SlotSources(lay.names, s.suffix, shape, s.dtypes, s.optional)
        assert isinstance(lay, FusedLayout)
        tensor = lay.name if s.suffix == "weight" else f"{lay.name}_{s.suffix}"
        if lay.parts == 1:
            return [Source(tensor, (n, *shape) if known else (), s.dtypes, optional=s.optional)]
        if known:
            rows = shape[0]
            return [Source(tensor, (n, rows * lay.parts, *shape[1:]), s.dtypes, narrow=(1, lay.part * rows, rows),
                           optional=s.optional)]
        # rows unknown until the header is read: the plan resolves the part into ``narrow``
        return [Source(tensor, (), s.dtypes, part=Part(1, lay.part, lay.parts), optional=s.optional)]

    def qp_hold_slots(self, count: int) -> None:
        """From now on this stack holds ``count`` slots (``quantplug.parallel``: this rank's
        experts or heads, its tensors already sliced to them)."""
        self.n = count

    def qp_target_dtype(self, name: str, stored: str, model_dtype: torch.dtype) -> torch.dtype:
        return self.scheme.target_dtype(self.specs[name], model_dtype, stored)

    qp_stacked = True

    def forward(self, x: torch.Tensor, index: int) -> torch.Tensor:
        y = compute.linear(self, x, index)
        return self.scheme.apply(self, x, index) if y is None else y

    def forward_grouped(self, x: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
        """Consecutive row groups of x [rows, in], group (slot, n) through slot ``slot``."""
        y = compute.grouped(self, x, groups)
        return self.scheme.apply_grouped(self, x, groups) if y is None else y

    def forward_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n, T, in] -> [..., n, T, out], slot i applied to x[..., i, :, :]."""
        y = compute.stacked_all(self, x)
        return self.scheme.apply_all(self, x) if y is None else y

    #: the slots are served by an expert store (``quantplug.experts``): no tensors are loaded here
    qp_served = False

    def qp_configure(self, options: LoadOptions) -> None:
        self.qp_kernel_mode = kernels_mode(self.scheme, options)

    def qp_finish(self) -> None:
        if self.qp_served:
            return
        self.scheme.process_after_loading(self)
        self.qp_native = compute.bind(self, self.n)

    def extra_repr(self) -> str:
        return f"n={self.n}, in={self.in_features}, out={self.out_features}, scheme={self.scheme.describe()}"




class FusedProjections:
    """Sibling projections run as one (what :func:`fuse_projections` returns): ``f(x)`` or, for
    stacked layers, ``f(x, groups)`` = the ``layers``' outputs side by side, computed by ``fn``,
    the function their scheme's :meth:`LinearScheme.fuse` returned. ``layers`` say what it stands
    for (the conformance kit checks it against the separate applies)."""

    def __init__(self, fn: Callable[..., torch.Tensor] | None, layers: Sequence[nn.Module]) -> None:
        self.fn, self.layers = fn, list(layers)

    def __call__(self, x: torch.Tensor, groups: list[tuple[int, int]] | None = None) -> torch.Tensor:
        # the core's native call first (few rows, every layer bound to a form), then the scheme's
        # fused function, then the separate products
        if groups is None:
            y = compute.fused(self.layers, x)
        else:
            y = compute.grouped(self.layers[0], x, groups, self.layers[1:])
        if y is not None:
            return y
        if self.fn is not None:
            return self.fn(x) if groups is None else self.fn(x, groups)
        if groups is None:
            return torch.cat([m(x) for m in self.layers], dim=-1)
        return torch.cat([m.forward_grouped(x, groups) for m in self.layers], dim=-1)  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"<FusedProjections of {', '.join(getattr(m, 'qp_ckpt', '?') for m in self.layers)}>"


def fuse_projections(layers: Sequence[nn.Module]) -> FusedProjections | None:
    """Sibling projections of one input run as one: when every layer is an unsplit
    :class:`QuantLinear` or :class:`StackedLinear` of one input width, and either all are bound to
    native forms (the core's call) or their schemes are of one class whose :meth:`LinearScheme.fuse`
    answers; otherwise None (the model applies them one by one)."""
    if len(layers) < 2 or not isinstance(layers[0], (QuantLinear, StackedLinear)):
        return None
    first = layers[0]
    for layer in layers:
        if not isinstance(layer, type(first)) or layer.qp_parallel is not None or layer.in_features != first.in_features:
            return None
    native_all = all(layer.qp_native is not None for layer in layers)
    scheme: LinearScheme = first.scheme
    fn = None
    if all(type(layer.scheme) is type(scheme) for layer in layers) and type(scheme).fuse is not LinearScheme.fuse:
        fn = scheme.fuse(layers)
    if fn is None and not native_all:
        return None
    return FusedProjections(fn, layers)


class FusedMLP:
    """A gated MLP for one token run as one (what :func:`fuse_mlp` returns): ``f(x)`` or, for
    stacked layers, ``f(x, slots, weights)``; see :meth:`LinearScheme.fuse_mlp`. ``layers`` are
    (gate, up, down)."""

    def __init__(self, fn: Callable[..., torch.Tensor], layers: Sequence[nn.Module]) -> None:
        self.fn, self.layers = fn, list(layers)

    def __call__(self, x: torch.Tensor, slots: Sequence[int] | None = None,
                 weights: Sequence[float] | None = None) -> torch.Tensor:
        return self.fn(x) if slots is None else self.fn(x, slots, weights)

    def __repr__(self) -> str:
        return f"<FusedMLP of {', '.join(getattr(m, 'qp_ckpt', '?') for m in self.layers)}>"


def fuse_mlp(gate: nn.Module, up: nn.Module, down: nn.Module) -> FusedMLP | None:
    """``gate.scheme.fuse_mlp(gate, up, down)`` when the three are unsplit :class:`QuantLinear` or
    :class:`StackedLinear` (all one kind) of matching widths whose schemes are of one class that
    overrides :meth:`LinearScheme.fuse_mlp`; otherwise None (the model composes the applies).

    .. versionadded:: 1.3
    """
    layers = (gate, up, down)
    if not isinstance(gate, (QuantLinear, StackedLinear)):
        return None
    scheme: LinearScheme = gate.scheme
    for layer in layers:
        if not isinstance(layer, type(gate)) or type(layer.scheme) is not type(scheme) or layer.qp_parallel is not None:
            return None
    if not (gate.in_features == up.in_features == down.out_features
            and gate.out_features == up.out_features == down.in_features):
        return None
    if type(scheme).fuse_mlp is LinearScheme.fuse_mlp:
        return None
    fn = scheme.fuse_mlp(gate, up, down)
    return None if fn is None else FusedMLP(fn, layers)


def fuse_attention(attn: nn.Module) -> Callable[..., torch.Tensor | None] | None:
    """``attn.o_proj.scheme.fuse_attention(attn)`` when that scheme's class overrides
    :meth:`LinearScheme.fuse_attention` and no linear of the layer is tensor-parallel; else None.

    .. versionadded:: 1.3
    """
    o_proj = getattr(attn, "o_proj", None)
    if not isinstance(o_proj, QuantLinear) or type(o_proj.scheme).fuse_attention is LinearScheme.fuse_attention:
        return None
    if any(getattr(m, "qp_parallel", None) is not None for m in attn.modules()):  # norms etc. have none
        return None
    return o_proj.scheme.fuse_attention(attn)


_INT4_SEPARABLE: dict[tuple[int, ...], bool] = {}


def int4pack_rows_separable(rows: Sequence[int]) -> bool:
    """Whether torch's int4 CPU weight layout (``aten._convert_weight_to_int4pack_for_cpu``) of
    matrices of ``rows`` rows stacked is their own layouts stacked, i.e. its row blocks do not
    straddle the parts: then one fused kernel weight serves each part through a row view (see
    :meth:`LinearScheme.fuse`). The layout belongs to the kernel and its CPU build, so this is
    probed once per process and row counts with random codes, never assumed.

    .. versionadded:: 1.2
    """
    key = tuple(rows)
    if key not in _INT4_SEPARABLE:
        g = torch.Generator().manual_seed(0)
        parts = [torch.randint(0, 16, (n, 128), generator=g, dtype=torch.int32) for n in rows]
        whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat(parts), 1)
        each = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(p, 1) for p in parts])
        _INT4_SEPARABLE[key] = torch.equal(whole, each)
    return _INT4_SEPARABLE[key]


def fuse_int4_packs(layers: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared half of an int4 scheme's :meth:`LinearScheme.fuse`, for layers that keep torch's
    int4 CPU kernel weight as buffers ``_int4`` [.., N, K/2] and ``_int4_sz`` [.., K/g, N, 2]
    (stacked layers also ``_int4_slots``, each slot's pair of views): one fused (pack, sz) with the
    layers' rows side by side, or None when a layer has none or the kernel's layout does not split
    at their row counts (:func:`int4pack_rows_separable`). Each layer's ``_int4`` is re-pointed to
    a view of the fused pack (no second copy); the fused scales-and-zeros are a copy of theirs (a
    view would not be contiguous, which the kernel silently misreads), registered as the buffer
    ``_int4_fused_sz`` of the first layer so model bytes count it.

    .. versionadded:: 1.2
    """
    if any(getattr(layer, "_int4", None) is None for layer in layers):
        return None
    packs: list[torch.Tensor] = [layer._int4 for layer in layers]
    rows = [p.shape[-2] for p in packs]
    if not int4pack_rows_separable(rows):
        return None
    pack = torch.cat(packs, dim=-2)
    sz = torch.cat([layer._int4_sz for layer in layers], dim=-2).contiguous()
    start = 0
    for layer, n in zip(layers, rows):
        layer._int4 = pack[..., start:start + n, :]  # a registered buffer: re-pointed, not added
        if pack.dim() == 3:
            layer._int4_slots = list(zip(layer._int4.unbind(0), layer._int4_sz.unbind(0)))
        start += n
    layers[0].register_buffer("_int4_fused_sz", sz, persistent=False)
    return pack, sz
