"""Linear layers whose storage and arithmetic belong to a pluggable :class:`LinearScheme`.

A scheme (vLLM's ``create_weights`` / ``apply`` / ``process_weights_after_loading`` shape)
declares the checkpoint tensors it needs as :class:`~quantplug.types.TensorSpec` so the plan can
check names, dtypes and shapes from headers before any data is read. Dense loading is the same
interface: :class:`DenseScheme` is the core's default answer to ``quantplug_linear_scheme``.

The contract itself (:class:`LinearScheme`, :class:`PlannedModule`, the sources, split rules and
stack layouts) lives in :mod:`quantplug.contract.scheme`; its names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..contract.scheme import (
    FLOATS,
    FusedLayout,
    LinearScheme,
    Part,
    PerIndexLayout,
    PlannedModule,
    SlotSources,
    Source,
    SplitRule,
    StackedLayout,
    StackLayout,
    kernels_mode,
)
from ..kernels import compute
from ..kernels.forms import Form, Weights
from ..types import SAFETENSORS_DTYPES, Problem, TensorInfo, TensorSpec

if TYPE_CHECKING:
    from ..contract.options import LoadOptions

__all__ = [
    "FLOATS", "FLOAT_FORMS", "DenseScheme", "FloatParams", "FusedLayout", "FusedMLP", "FusedProjections",
    "LinearScheme", "Part", "PerIndexLayout", "PlannedModule", "QuantLinear", "RefusedScheme", "SlotSources",
    "Source", "SplitRule", "StackLayout", "StackedLayout", "StackedLinear", "fuse_attention", "fuse_int4_packs",
    "fuse_mlp", "fuse_projections", "int4pack_rows_separable", "kernels_mode",
]



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
