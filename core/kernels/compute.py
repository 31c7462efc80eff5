"""Running planned layers on their forms: native where it pays, the scheme's own ``apply`` where not.

:func:`bind` asks a loaded layer's scheme for its :class:`~quantplug.kernels.forms.Weights`
(``LinearScheme.form``, contract 1.4) and binds them to the native kernels; the layer keeps the
binding as ``qp_native``. Every product of the layer then comes here first:

* few input rows per weight (a decode step, batches up to :data:`NATIVE_ROWS`, a step's expert
  rows): the native row kernels, all siblings of one input and all row groups of stacked experts
  in one call;
* more rows (a prompt, a prompt's expert groups) in exact mode, up to :data:`NATIVE_PREFILL_ROWS`:
  the same native row kernels, 4 input rows per pass over each block of weight rows;
* still more rows in exact mode: the weight decoded natively a block of rows at a time into a
  reused buffer and multiplied by torch's matmul (BLAS), the activations quantized natively first
  when the form says so. A prompt's expert groups are decided one by one: the groups within the
  row kernels' rows in one native call, only the larger ones decoded (a 256-token prompt gives
  the bench model's experts ~32 rows each, and the largest group past 128 rows);
* otherwise (no native library, tensors off the CPU, fast mode or integer products with many rows,
  a form the C code refuses) these functions return None and the caller runs ``scheme.apply``.

Exact mode gives the scheme's ``dequantize`` + matmul up to the order of float32 sums (the
conformance kit checks it per layer); results never depend on which path ran beyond that.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.utils.hooks import RemovableHandle

from ..contract.routing import RouterSpec
from ..errors import QuantplugError
from . import native, routers
from .native import Bound

#: input rows per weight up to which the native row kernels run (one-call steps, batched decode)
NATIVE_ROWS = 16
#: input rows per weight up to which an exact product (a prefill, a prompt's expert groups) of a
#: weight-only form stays on the native row kernels: for forms decoded in registers (Q4_0 / Q8_0,
#: INT4 / INT8 / FP8 / FP4), and for the other forms (decoded into a buffer per 4 rows); above
#: them, a block of rows is decoded and multiplied by torch's matmul. Measured on [256, 512]
#: weights, 2 threads: native 150-290 us vs decode + matmul 300-440 us at 64-128 rows for the
#: first; K-quants cross at ~40.
NATIVE_PREFILL_ROWS = (128, 32)
#: dense weight elements decoded at once for a many-row product (1 MiB of float32: the block
#: stays in cache between its decoding and its matmul)
CHUNK_ELEMS = 1 << 18

_LOCAL = threading.local()


def _buffer(n: int) -> torch.Tensor:
    """This thread's reused float32 buffer of at least ``n`` elements (a normal tensor even when
    first made under inference_mode, so later writes outside it work)."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):
            buf = _LOCAL.buf = torch.empty(n, dtype=torch.float32)
    return buf[:n]


def _first_param(layer: torch.nn.Module) -> tuple[str, torch.Tensor] | None:
    for name, t in layer._parameters.items():
        if t is not None:
            return name, t
    return None


def bind(layer: Any, slots: int | None = None) -> Bound | None:
    """The layer's weights bound to the native kernels, or None: the scheme declares no form
    (``form`` returns None), the tensors are not on the CPU, or the C code refuses the shapes
    (then the torch path runs; a form whose tensors contradict the layer is a QuantplugError).
    Made once after loading; a layer whose tensors are later replaced or moved is re-bound."""
    scheme = layer.scheme
    weights = scheme.form(layer)
    if weights is None or not weights.contiguous_rows():
        return None
    # an embedding holds this rank's vocabulary rows under vocab parallelism: its rows, as stored
    out_f, in_f = (weights.weight.shape[-2], layer.dim) if hasattr(layer, "vocab") else (layer.out_features, layer.in_features)
    # the load's ``kernels`` where the scheme takes it (PlannedModule.qp_configure)
    mode = layer.qp_kernel_mode
    b = Bound(weights, out_f, in_f, slots, layer.model_dtype, mode if mode in native.MODES else "exact",
              f"{layer.qp_ckpt} ({type(scheme).__name__})", lookups=hasattr(layer, "vocab"))
    if not b.device_ok or not b.native_shapes():
        return None  # shapes the C code does not take (e.g. inputs not a multiple of 32): torch path
    first = _first_param(layer)
    # what bound() checks per call, in two dictionary reads and a pointer compare: the layer's
    # first parameter is still the same tensor object with the same data (model.to() swaps the
    # data of the same Parameter object)
    b.sentinel = None if first is None else (first[0], first[1], first[1].data_ptr())
    return b


def bound(layer: Any) -> Bound | None:
    """The layer's live binding: None when there is none, the library is unavailable, or the
    layer's tensors moved off the CPU or were replaced since binding (then it is dropped, and
    bound again where the new tensors are on the CPU)."""
    b: Bound | None = layer.__dict__.get("qp_native")
    if b is None or native._lib is None and native.library() is None:
        return None
    sent = b.sentinel
    if sent is None:
        return b
    p = layer._parameters.get(sent[0])
    if p is sent[1] and p.data_ptr() == sent[2]:
        return b
    layer.qp_native = b = None
    first = _first_param(layer)
    if first is not None and first[1].device.type == "cpu":
        layer.qp_native = b = bind(layer, layer.n if layer.qp_stacked else None)
    return b


def _rows(x: torch.Tensor, k: int) -> int:
    return x.numel() // max(k, 1)


def _out(y: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    return (y if x.dtype == torch.float32 else y.to(x.dtype)).view(*x.shape[:-1], n)


_IN_REGISTERS = frozenset({"Q4_0", "Q8_0", "INT4", "INT8", "FP8", "FP4"})


def _native_rows(b: Bound) -> int:
    """The most input rows the native row kernels take for ``b`` in exact mode (see
    :data:`NATIVE_PREFILL_ROWS`). Forms that quantize their activations (FP8 / int8 / FP4
    emulation) stay at :data:`NATIVE_ROWS`: an activation code sits on a rounding boundary often
    enough in a prompt that the kernels' float32 summation order, not torch's, moves it by a whole
    step (a ModelOpt FP8-static fixture's logits 7% apart), so prompts keep the torch matmul the
    reference path uses."""
    if b.form.act is not None:
        return NATIVE_ROWS
    f = b.form.dtype
    cheap = f in _IN_REGISTERS and (f not in ("Q4_0", "Q8_0") or b.model_dtype == torch.float32)
    return NATIVE_PREFILL_ROWS[0] if cheap else NATIVE_PREFILL_ROWS[1]


def _row_kernels(b: Bound, rows: int) -> bool:
    """Whether ``rows`` input rows through ``b`` in exact mode take the native row kernels (few
    rows, or a prompt within :func:`_native_rows` of a form the decode-and-matmul path takes)."""
    return rows <= NATIVE_ROWS or (_many(b) and rows <= _native_rows(b))


def _many(b: Bound) -> bool:
    """Whether a many-row product may take the decode-and-matmul path (exact float products):
    not for float weights already in the model dtype (their own matmul is best)."""
    act = b.form.act
    f = b.form.dtype
    same = (f, b.model_dtype) in (("F32", torch.float32), ("BF16", torch.bfloat16), ("F16", torch.float16))
    return b.mode == "exact" and not same and (act is None or act.integer == "float")


def _dequant_mm(b: Bound, x2: torch.Tensor, slot: int | None, out: torch.Tensor,
                xa: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [M, N] = x' @ W^T for float32 rows ``x2`` [M, K], W decoded natively a block of rows
    at a time (rounded to the model dtype), x' the activations as the form quantizes them (``xa``:
    already quantized so, by a sibling with the same activation quantization)."""
    mat = b.ptr(slot)
    if xa is None:
        xa = native.act_rows(mat, x2) if b.form.act is not None else x2
    n, k = b.n, b.k
    step = max(1, min(n, CHUNK_ELEMS // max(k, 1)))
    buf = _buffer(step * k).view(step, k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        w = native.dequant(mat, r0, r1, buf[:r1 - r0], b.wround)
        torch.mm(xa, w.t(), out=out[:, r0:r1])
    return out


def linear(layer: Any, x: torch.Tensor, slot: int | None = None) -> torch.Tensor | None:
    """``x @ W^T`` of the layer (of stacked ``slot``) on its form, or None (run ``scheme.apply``)."""
    b = bound(layer)
    if b is None or not native.native_ok(x):
        return None
    rows = _rows(x, b.k)
    if rows == 0:
        return None
    if b.mode == "fast" or _row_kernels(b, rows):
        y = native.gemm(native._as_f32_rows(x, b.k), [b.ptr(slot)], wround=b.wround)
        return _out(y, x, b.n)
    if not _many(b):
        return None
    x2 = native._as_f32_rows(x, b.k)
    y = _dequant_mm(b, x2, slot, torch.empty(rows, b.n, dtype=torch.float32))
    return _out(y, x, b.n)


def fused(layers: Sequence[Any], x: torch.Tensor) -> torch.Tensor | None:
    """Sibling projections of one input (q_a + kv_a, gate + up) side by side in one native call,
    for few rows; None otherwise."""
    bs = [bound(m) for m in layers]
    if any(b is None for b in bs) or not native.native_ok(x):
        return None
    k = bs[0].k  # type: ignore[union-attr]
    rows = _rows(x, k)
    fast = all(b.mode == "fast" for b in bs)  # type: ignore[union-attr]
    if rows == 0 or not (fast or all(_row_kernels(b, rows) for b in bs)) or any(b.k != k for b in bs):  # type: ignore[union-attr,arg-type]
        return None
    y = native.gemm(native._as_f32_rows(x, k), [b.ptr() for b in bs], wround=bs[0].wround)  # type: ignore[union-attr]
    return _out(y, x, y.shape[-1])


def grouped(layer: Any, x: torch.Tensor, groups: Sequence[tuple[int, int]],
            siblings: Sequence[Any] = ()) -> torch.Tensor | None:
    """Stacked experts: ``x`` [rows, K] in consecutive groups ``(slot, n)``, each through its slot;
    with ``siblings`` (e.g. up beside gate) their outputs side by side. None: the scheme's path."""
    layers = [layer, *siblings]
    bs = [bound(m) for m in layers]
    if any(b is None for b in bs) or not native.native_ok(x) or not groups:
        return None
    b0 = bs[0]
    assert b0 is not None
    most = max(n for _, n in groups)
    if all(b.mode == "fast" for b in bs if b is not None) or all(b is not None and _row_kernels(b, most) for b in bs):
        return _grouped_native(bs, x, groups)
    if not all(_many(b) for b in bs if b is not None):
        return None
    # a prompt's expert groups: each group on the row kernels while it is within their rows, only
    # the larger ones decoded and multiplied
    small = [all(b is not None and _row_kernels(b, n) for b in bs) for _, n in groups]
    x2 = native._as_f32_rows(x, b0.k)
    if any(small):
        out = _grouped_native(bs, x2, groups, small)
    else:
        out = torch.empty(x2.shape[0], sum(b.n for b in bs if b is not None), dtype=torch.float32)
    start = 0
    for (slot, n), native_done in zip(groups, small):
        if not native_done:
            xs, col = x2[start:start + n], 0
            # siblings (gate beside up) that quantize their input alike quantize it once
            xa = native.act_rows(b0.ptr(slot), xs) if _shared_act(bs, slot) else None
            for b in bs:
                assert b is not None
                _dequant_mm(b, xs, slot, out[start:start + n, col:col + b.n], xa)
                col += b.n
        start += n
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _shared_act(bs: Sequence[Bound | None], slot: int) -> bool:
    """Whether the stacked matrices of ``slot`` all quantize their input, and identically."""
    if any(b is None or b.form.act is None for b in bs):
        return False
    return len({_act_key(b.mats[slot].act) for b in bs if b is not None}) == 1


def _grouped_native(bs: Sequence[Bound | None], x: torch.Tensor, groups: Sequence[tuple[int, int]],
                    which: Sequence[bool] | None = None) -> torch.Tensor:
    """:func:`grouped`'s groups (those ``which`` marks, default all) in one native call: outputs
    [rows, sum N] float32 for a float32 ``x``, else in x's dtype; rows of other groups zero."""
    b0 = bs[0]
    assert b0 is not None
    mats, spec, start = [], [], 0
    for g, (slot, n) in enumerate(groups):
        if not 0 <= slot < len(b0.mats):
            raise QuantplugError(f"{b0.where}: expert slot {slot} outside the stack of {len(b0.mats)}")
        if which is None or which[g]:
            col = 0
            for b in bs:
                assert b is not None
                mats.append(b.ptr(slot))
                spec.append((start, n, start, col))
                col += b.n
        start += n
    y = native.gemm(native._as_f32_rows(x, b0.k), mats, spec, out_rows=x.shape[0], wround=b0.wround)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def stacked_all(layer: Any, x: torch.Tensor) -> torch.Tensor | None:
    """Per-head stacks (split MLA K/V): x [.., n, T, K] -> [.., n, T, N], slot i on x[.., i, :, :],
    in one native call: one sequence of few tokens, or in fast mode (whose products are the
    native ones at every size) any tokens and sequences; None otherwise."""
    b = bound(layer)
    if b is None or not native.native_ok(x):
        return None
    nh, t, k = x.shape[-3], x.shape[-2], x.shape[-1]
    fast = b.mode == "fast"
    seqs = x.numel() // max(nh * t * k, 1)  # fast mode: a batch of sequences too
    if x.numel() == 0 or nh != len(b.mats) or not (fast or (seqs == 1 and _row_kernels(b, t))):
        return None
    g = seqs * nh
    x2 = native._as_f32_rows(x.reshape(g * t, k), k)
    y = native.gemm(x2, [b.ptr(i % nh) for i in range(g)], [(i * t, t, i * t, 0) for i in range(g)],
                    out_rows=g * t, wround=b.wround)
    return (y if x.dtype == torch.float32 else y.to(x.dtype)).view(*x.shape[:-1], b.n)


def _same_act(bs: Sequence[Bound]) -> bool:
    """Whether the matrices quantize their input identically (static scales included)."""
    key = _act_key(bs[0].mats[0].act)
    for b in bs:
        if b.mode != bs[0].mode and (b.mode == "fast") != (bs[0].mode == "fast"):
            return False
        if any(_act_key(m.act) != key for m in b.mats):
            return False
    return True


def _act_key(a: Any) -> tuple:
    """What decides how a native matrix quantizes its input (its ``act`` fields)."""
    return (a.kind, a.group, a.ue8m0, a.epi, a.scale, a.offset, a.floor)


def _rotations(rot: torch.Tensor, b: int, rope: int) -> torch.Tensor | None:
    """``rot`` ([rope, rope] for every row, or one per row) as the native steps read it: float32,
    contiguous, one [rope, rope] matrix per row of b (shared when b is 1); None when it holds
    neither one nor b matrices."""
    if rot.dtype == torch.float32 and rot.dim() == 2 and b == 1 and rot.is_contiguous():
        return rot
    r = rot.reshape(-1, rope, rope).to(torch.float32)
    if r.shape[0] == 1 and b > 1:
        r = r.expand(b, -1, -1)
    return r.contiguous() if r.shape[0] == b else None


#: the gated MLP activations of ``qp_mlp`` (``QM_*`` in ``qp_types.h``)
MLP_ACTS = {"silu": 0, "situ": 1, "silu_clamp": 2}
#: ``qp_mlp``'s activation arguments for SiLU (id, two unused parameters)
SILU = (0, 0.0, 0.0)


def mlp_act(act: tuple[str, float, float | None] | None) -> tuple[int, float, float]:
    """``qp_mlp``'s (id, a, b) for an MLP activation: None (SiLU), ``("situ", beta, linear_beta)``
    (Kimi-K3's SiTU, :func:`quantplug.layers.activation.situ_mul`; linear_beta None or 0: ``up``
    as it is) or ``("silu_clamp", limit, None)`` (the clamped SwiGLU ``silu(min(gate, limit)) *
    clamp(up, -limit, limit)``, :func:`quantplug.layers.activation.silu_clamp_mul`). A
    QuantplugError for any other."""
    if act is None:
        return SILU
    if isinstance(act, tuple) and len(act) == 3 and act[0] == "situ":
        beta, lbeta = float(act[1]), float(act[2] or 0.0)
        if beta > 0 and lbeta >= 0 and beta != float("inf") and lbeta != float("inf"):
            return MLP_ACTS["situ"], beta, lbeta
    if isinstance(act, tuple) and len(act) == 3 and act[0] == "silu_clamp" and act[2] is None:
        lim = float(act[1])
        if 0 < lim < float("inf"):
            return MLP_ACTS["silu_clamp"], lim, 0.0
    raise QuantplugError(f"gated MLP activation {act!r}: expected None, ('situ', beta > 0, linear_beta >= 0 or None) "
                         "or ('silu_clamp', limit > 0, None)")


class MLPStep:
    """A gated MLP ``down(act(gate(x), up(x)))`` for few rows in one native call: a dense MLP or
    shared experts (``f(x)``, x [M, H]), or routed experts (``f(x, pairs)``: ``pairs`` = (row,
    slot, weight) sorted by slot; row r's output is the sum over its pairs, in order, of
    ``weight * mlp_slot(x[r])``). ``reduce``: the all-reduce of a split MLP's partial output.
    ``act``: SiLU (``silu(gate) * up``, the default) or SiTU (see ``mlp_act``); the whole-stack
    step (:class:`StackStep`) takes SiLU steps only."""

    def __init__(self, layers: Sequence[Any], gate: Bound, up: Bound, down: Bound, stacked: bool,
                 reduce: Any = None, act: tuple[int, float, float] = SILU) -> None:
        self.layers = list(layers)
        self.gate, self.up, self.down, self.stacked, self.reduce = gate, up, down, stacked, reduce
        self.h, self.i = gate.k, gate.n
        #: ``qp_mlp``'s activation (id, a, b): ``SILU`` or SiTU's
        self.act = act

    def live(self) -> bool:
        """The library is loaded and the layers still hold the tensors bound at load."""
        return native.library() is not None and all(
            bound(m) is b for m, b in zip(self.layers, (self.gate, self.up, self.down)))

    @staticmethod
    def build(gate: Any, up: Any, down: Any, stacked: bool, reduce: Any = None,
              act: tuple[str, float, float | None] | None = None) -> MLPStep | None:
        """From the MLP's three layers; ``act`` None (SiLU) or ``("situ", beta, linear_beta)``. None
        when a layer has no native binding or the three disagree."""
        code = mlp_act(act)
        bs = [bound(m) for m in (gate, up, down)]
        if any(b is None for b in bs):
            return None
        g, u, d = bs
        assert g is not None and u is not None and d is not None
        if not (g.k == u.k == d.n and g.n == u.n == d.k) or len({g.wround, u.wround, d.wround}) != 1:
            return None
        if not (_same_act([g, u]) and _same_act([d])):
            return None  # e.g. per-layer static input scales: the separate products handle them
        return MLPStep((gate, up, down), g, u, d, stacked, reduce, code)

    def __call__(self, x: torch.Tensor, pairs: Sequence[tuple[int, int, float]] | None = None) -> torch.Tensor | None:
        """The step's output, or None when it cannot run now (see :meth:`live`; x off the CPU)."""
        if native._lib is None or not native.native_ok(x) or not self.live():
            return None
        m = x.numel() // self.h
        if pairs is None:
            pairs = [(r, 0, 1.0) for r in range(m)]
        slots = sorted({s for _, s, _ in pairs})
        for s in slots:
            if not 0 <= s < len(self.gate.mats):
                raise QuantplugError(f"{self.gate.where}: expert slot {s} outside the stack of {len(self.gate.mats)}")
        index = {s: i for i, s in enumerate(slots)}
        y = _mlp_call([self.gate.ptr(s) for s in slots], [self.up.ptr(s) for s in slots],
                      [self.down.ptr(s) for s in slots], x, [(r, index[s], w) for r, s, w in pairs], self.h,
                      self.gate.wround, self.act).view(x.shape)
        return self.reduce(y) if self.reduce is not None else y


def _mlp_call(gates: Sequence[Any], ups: Sequence[Any], downs: Sequence[Any], x: torch.Tensor,
              pairs: Sequence[tuple[int, int, float]], h: int, wround: int,
              act: tuple[int, float, float] = SILU) -> torch.Tensor:
    """``qp_mlp`` over the matrices of the experts used (``pairs`` = (row, expert index, weight),
    grouped by expert), activation ``act`` (``mlp_act``): [M, h] in x's dtype."""
    import ctypes

    lib = native.library()
    assert lib is not None
    x2 = native._as_f32_rows(x, h)
    m = x2.shape[0]
    if not pairs:
        out = torch.zeros(m, h, dtype=torch.float32)
    else:
        p, e = len(pairs), len(gates)
        mp = ctypes.POINTER(native.Mat) * e
        out = torch.empty(m, h, dtype=torch.float32)
        i32, f32 = ctypes.c_int32 * p, ctypes.c_float * p
        rc = lib.qp_mlp(mp(*gates), mp(*ups), mp(*downs), e, m, x2.data_ptr(), x2.stride(0), p,
                        i32(*[s for _, s, _ in pairs]), i32(*[r for r, _, _ in pairs]), f32(*[w for _, _, w in pairs]),
                        out.data_ptr(), out.stride(0), wround, act[0], act[1], act[2])
        native.check(rc, "mlp")
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def mlp_over(experts: Sequence[Sequence[Any]], x: torch.Tensor, pairs: Sequence[tuple[int, int, float]],
             act: tuple[str, float, float | None] | None = None) -> torch.Tensor | None:
    """Few rows ``x`` through the gated MLPs of ``experts`` (each (gate, up, down) layers bound
    to native forms, e.g. an expert cache's one-slot layers): ``pairs`` = (row, index into
    ``experts``, weight), grouped by index; ``act`` as :meth:`MLPStep.build`'s (None: SiLU); None
    where the native kernels cannot run them."""
    code = mlp_act(act)
    if native._lib is None or not native.native_ok(x) or not experts:
        return None
    bs: list[list[Bound]] = []
    for triple in experts:
        got = [bound(m) for m in triple]
        if any(b is None for b in got):
            return None
        bs.append([b for b in got if b is not None])
    if not (_same_act([t[0] for t in bs] + [t[1] for t in bs]) and _same_act([t[2] for t in bs])):
        return None
    g0 = bs[0][0]
    if len({b.wround for t in bs for b in t}) != 1:
        return None
    return _mlp_call([t[0].ptr() for t in bs], [t[1].ptr() for t in bs], [t[2].ptr() for t in bs],
                     x, pairs, g0.k, g0.wround, code).view(x.shape)


def deprecated_fuse(kind: str, scheme: Any) -> None:
    warnings.warn(f"{type(scheme).__name__}.{kind} (contract 1.3) is deprecated: declare the weights' form "
                  "(LinearScheme.form, contract 1.4) and the core runs the step; removed at contract 2.0",
                  DeprecationWarning, stacklevel=3)


class MLAStep:
    """One absorbed MLA decode step for B sequences at one position, in two native calls around the
    cache append (``qp_latent_pre`` / ``qp_latent_post``): q / latent projections, norms, rope, W_UK
    absorption (dense ``kv_b`` rows or per-head ``k_b``), attention on the cached latent, W_UV,
    the output gate, ``o_proj``; ``reduce`` all-reduces a head-split layer's partial output. The
    latent is what the cache holds; when ``kv_b``'s form quantizes its input (DeepSeek fp8
    act_quant), the cached rows are quantized the same way before attention, which is the
    expanded form's arithmetic (kv_b applied to the quantized latent) reassociated."""

    def __init__(self, spec: Any, keep: list[Any], nh: int, kv_lora: int, rope: int, v: int, hidden: int,
                 gated: bool, reduce: Any) -> None:
        self.spec, self.keep, self.nh, self.kv_lora, self.rope, self.v, self.h = spec, keep, nh, kv_lora, rope, v, hidden
        self.gated, self.reduce = gated, reduce
        self.wround = 0
        self.ref: Any = None

    @staticmethod
    def build(*, q_a: Any, kv_a: Any, q_b: Any, kv_b: Any, k_b: Any, v_b: Any, o: Any, g: Any,
              q_a_norm: Any, kv_a_norm: Any, nh: int, q_lora: int | None, kv_lora: int, rope: int, nope: int,
              v: int, hidden: int, eps_q: float, eps_kv: float, scale: float, reduce: Any = None) -> MLAStep | None:
        """From the layer's modules (``q_a`` None without q_lora, then ``q_b`` is ``q_proj``;
        ``kv_b`` or ``k_b`` / ``v_b``; ``g`` None without the output gate); None when any of them
        has no native binding or the pieces disagree."""
        import ctypes

        mods = {"kv_a": kv_a, "q_b": q_b, "o": o}
        if q_a is not None:
            mods["q_a"] = q_a
        if g is not None:
            mods["g"] = g
        if kv_b is not None:
            mods["kv_b"] = kv_b
        else:
            mods["k_b"], mods["v_b"] = k_b, v_b
        bs = {k: bound(m) for k, m in mods.items()}
        if any(b is None for b in bs.values()) or len({b.wround for b in bs.values() if b is not None}) != 1:
            return None
        norms = [q_a_norm.weight if q_a is not None else kv_a_norm.weight, kv_a_norm.weight]
        if any(n.dtype not in (torch.float32, torch.bfloat16) or n.dtype != norms[1].dtype or not n.is_contiguous()
               or n.device.type != "cpu" for n in norms):
            return None
        st = native.LatentAttn(H=hidden, q_lora=q_lora or 0, kv_lora=kv_lora, rope=rope, nope=nope, v=v, nh=nh,
                        eps_q=eps_q, eps_kv=eps_kv, scale=scale, norm_bf16=int(norms[1].dtype == torch.bfloat16),
                        kv_dense=int(kv_b is not None))
        keep: list[Any] = [bs, norms, mods]
        st.kv_a, st.q_b, st.o = bs["kv_a"].ptr(), bs["q_b"].ptr(), bs["o"].ptr()  # type: ignore[union-attr]
        if q_a is not None:
            st.q_a = bs["q_a"].ptr()  # type: ignore[union-attr]
        if g is not None:
            st.g = bs["g"].ptr()  # type: ignore[union-attr]
        if kv_b is not None:
            st.kv_b = bs["kv_b"].ptr()  # type: ignore[union-attr]
        else:
            kb, vb = bs["k_b"], bs["v_b"]
            assert kb is not None and vb is not None
            if len(kb.mats) != nh or len(vb.mats) != nh:
                return None
            st.k_b = _mat_array([kb.ptr(h) for h in range(nh)], keep)
            st.v_b = _mat_array([vb.ptr(h) for h in range(nh)], keep)
        st.q_a_norm, st.kv_a_norm = norms[0].data_ptr(), norms[1].data_ptr()
        step = MLAStep(st, keep, nh, kv_lora, rope, v, hidden, g is not None, reduce)
        step.ref = ctypes.byref(st)
        step.wround = next(b.wround for b in bs.values() if b is not None)
        # the C code's own check of the whole layer, once
        lib = native.library()
        if lib is None:
            return None
        probe = torch.zeros(1, hidden)
        rot = torch.eye(rope).unsqueeze(0).contiguous()
        qcat = torch.empty(1, nh, kv_lora + rope)
        kvrow = torch.empty(1, kv_lora + rope)
        gate = torch.empty(1, nh * v) if g is not None else None
        if lib.qp_latent_pre(ctypes.byref(st), 1, probe.data_ptr(), rot.data_ptr(), qcat.data_ptr(), kvrow.data_ptr(),
                          gate.data_ptr() if gate is not None else None, step.wround) != 0:
            return None
        return step

    def __call__(self, x: torch.Tensor, rot: torch.Tensor, cache: Any) -> torch.Tensor | None:
        """x [B, 1, hidden] (one position per sequence), ``rot`` [rope, rope] or [B, .., rope, rope]
        (``roped = x @ rot``), ``cache`` the layer's ``LatentCache``: appends each sequence's latent
        and key and returns the attention output after ``o_proj`` [B, 1, hidden]; None when the
        inputs or the cache are of a kind the native step does not take."""
        lib = native._lib
        b = x.shape[0]
        if lib is None or not native.native_ok(x) or x.numel() != b * self.h or b > NATIVE_ROWS:
            return None
        bs, _, mods = self.keep[0], self.keep[1], self.keep[2]
        if any(bound(m) is not bs[k] for k, m in mods.items()):
            return None  # a layer's tensors were replaced or moved since the step was built
        lat, kr = cache.latent, cache.k_rope
        if lat.dtype not in (torch.float32, torch.bfloat16) or lat.shape[0] != b or lat.device.type != "cpu":
            return None
        x2 = x.reshape(b, self.h)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        r = _rotations(rot, b, self.rope)
        if r is None:
            return None
        pos = cache.reserve(1)
        out = torch.empty(b, 1, self.h)
        rc = lib.qp_latent_step(self.ref, b, x2.data_ptr(), r.data_ptr(), lat.data_ptr(), lat.stride(2), lat.stride(0),
                             kr.data_ptr(), kr.stride(2), kr.stride(0), pos, None, 0, None,
                             int(lat.dtype == torch.bfloat16), out.data_ptr(), self.wround)
        if rc != 0:
            cache.unreserve(1)
            native.check(rc, "latent_step")
        y = out if x.dtype == torch.float32 else out.to(x.dtype)
        return self.reduce(y) if self.reduce is not None else y


class StackLayer:
    """One decoder layer as :class:`StackStep` runs it: its MLA step, its two norms, and either a
    dense MLP step or a MoE (the stacked experts' step, the router: its
    :class:`~quantplug.contract.routing.RouterSpec` ``spec``, float32 weight, bias (``spec.has_bias``) and
    int32 ``tid2eid`` table (``spec.by_token``); the shared experts' step or None)."""

    def __init__(self, *, mla: MLAStep, attn_norm: torch.Tensor, ffn_norm: torch.Tensor, eps: float,
                 mlp: MLPStep | None = None, experts: MLPStep | None = None, router: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, spec: RouterSpec | None = None, tid2eid: torch.Tensor | None = None,
                 shared: MLPStep | None = None) -> None:
        self.mla, self.attn_norm, self.ffn_norm, self.eps = mla, attn_norm, ffn_norm, eps
        self.mlp, self.experts, self.router, self.bias, self.shared = mlp, experts, router, bias, shared
        self.spec, self.tid2eid = spec, tid2eid


class StackStep:
    """A decode step of the whole decoder stack for B <= :data:`NATIVE_ROWS` sequences at one
    position in one native call (``qp_stack_step`` in ``qp_decode_step``): per layer the input norm, the MLA step, the
    residual, the post-attention norm, the dense MLP or the MoE (routing included), the residual;
    then the final norm. The same arithmetic as the per-layer steps in the same order (in a
    bfloat16 model with their roundings to bfloat16), without a Python round trip per layer.

    ``watch``: (owner dict, key, tensor) of every tensor the step reads outside the bound layers
    (norm weights, router weights); the step declines (returns None, the per-layer path runs) when
    any bound layer or watched tensor was replaced or moved since it was built, or when a module
    of ``modules`` has forward hooks (the per-layer path calls them)."""

    def __init__(self, layers: Sequence[StackLayer], final_norm: torch.Tensor, eps: float, hidden: int,
                 modules: Sequence[torch.nn.Module], owners: Sequence[tuple[torch.nn.Module, Any]]) -> None:
        import ctypes

        self.h, self.eps, self.final_norm = hidden, eps, final_norm
        self.modules = list(modules)
        # each module's own forward-hook dicts, held: torch registers a hook by adding to these
        # dicts (never by replacing them), so a step's hook check reads one object per dict
        self.hook_dicts = tuple(d for m in self.modules for d in (m._forward_hooks, m._forward_pre_hooks))
        self._hooks_clear_at = -1
        self.owners = [(m.__dict__, st) for m, st in owners]
        self.keep: list[Any] = []
        arr = (native.Layer * len(layers))()
        #: a layer routes by token id: the step needs the ids (a call on embeddings declines)
        self.by_token = False
        checks: list[tuple[Any, ...]] = []
        tensors: list[torch.Tensor] = [final_norm]
        for i, sl in enumerate(layers):
            L = arr[i]
            L.attn = ctypes.pointer(sl.mla.spec)
            L.attn_norm, L.ffn_norm = sl.attn_norm.data_ptr(), sl.ffn_norm.data_ptr()
            L.norm_bf16, L.eps = int(sl.attn_norm.dtype == torch.bfloat16), sl.eps
            tensors += [sl.attn_norm, sl.ffn_norm]
            steps: list[MLAStep | MLPStep] = [sl.mla]
            if sl.experts is not None:
                ex = sl.experts
                n = len(ex.gate.mats)
                L.gate, L.up, L.down = (_mat_array([b.ptr(s) for s in range(n)], self.keep) for b in (ex.gate, ex.up, ex.down))
                assert sl.router is not None and sl.spec is not None
                L.E = n
                routers.route(L.route, sl.spec, sl.router, sl.bias, sl.tid2eid)
                tensors += [t for t in (sl.router, sl.bias, sl.tid2eid) if t is not None]
                self.by_token = self.by_token or sl.spec.by_token
                if sl.shared is not None:
                    L.sg, L.su, L.sd = sl.shared.gate.ptr(), sl.shared.up.ptr(), sl.shared.down.ptr()
                    steps.append(sl.shared)
                steps.append(ex)
            else:
                m = sl.mlp
                assert m is not None
                L.gate, L.up, L.down = (_mat_array([b.ptr()], self.keep) for b in (m.gate, m.up, m.down))
                L.E = 0
                steps.append(m)
            for st in steps:
                if isinstance(st, MLAStep):
                    bs, mods = st.keep[0], st.keep[2]
                    pairs = [(mod, bs[k]) for k, mod in mods.items()]
                else:
                    pairs = list(zip(st.layers, (st.gate, st.up, st.down)))
                for mod, b in pairs:
                    sent = b.sentinel or (None, None, 0)
                    checks.append((mod.__dict__, mod._parameters, b, *sent))
        self.layers_arr, self.n = arr, len(layers)
        self.mla_steps = [sl.mla for sl in layers]  # kept alive: the layers' C structs point into them
        self.checks = checks
        self.tensors = [(t, t.data_ptr()) for t in tensors]
        self.rope = layers[0].mla.rope
        self.wround = layers[0].mla.wround
        #: the model dtype the step takes and returns (float32, or bfloat16 with every rounding of
        #: the per-layer path: each norm, module output and residual sum)
        self.dtype = torch.bfloat16 if self.wround else torch.float32

    @staticmethod
    def build(layers: Sequence[StackLayer], final_norm: torch.Tensor, eps: float, hidden: int,
              modules: Sequence[torch.nn.Module], owners: Sequence[tuple[torch.nn.Module, Any]]) -> StackStep | None:
        """None when the library is unavailable, a piece is not native, an MLP step is not SiLU's,
        or a tensor is not a contiguous CPU float32 / bfloat16 one (norms) or float32 one (routers). ``owners``: (module,
        step) of every per-layer step used; the stack declines once a module's ``step`` is another."""
        if native.library() is None or not layers:
            return None
        def ok(t: torch.Tensor | None, dtypes: tuple[torch.dtype, ...]) -> bool:
            return t is None or (t.device.type == "cpu" and t.dtype in dtypes and t.is_contiguous())
        fl = (torch.float32, torch.bfloat16)
        wround = layers[0].mla.wround
        # a float32 model, or a bfloat16 one (norm weights bfloat16, as RMSNorm then multiplies)
        if wround not in (0, native.WROUND[torch.bfloat16]) or not ok(final_norm, fl) or final_norm.numel() != hidden:
            return None
        norms = [final_norm] + [n for sl in layers for n in (sl.attn_norm, sl.ffn_norm)]
        if wround and any(n.dtype != torch.bfloat16 for n in norms):
            return None
        for sl in layers:
            if sl.mla.reduce is not None or sl.mla.wround != wround or sl.mla.h != hidden:
                return None
            if not (ok(sl.attn_norm, fl) and ok(sl.ffn_norm, fl)) or sl.attn_norm.dtype != sl.ffn_norm.dtype:
                return None
            parts = [p for p in (sl.mlp, sl.experts, sl.shared) if p is not None]
            if any(p.reduce is not None or p.gate.wround != wround or p.h != hidden for p in parts):
                return None
            if any(p.act != SILU for p in parts):  # qp_stack_step's MLPs are SiLU-gated
                return None
            if sl.experts is not None:
                if (sl.router is None or sl.spec is None or not ok(sl.router, (torch.float32,))
                        or not ok(sl.bias, (torch.float32,)) or not ok(sl.tid2eid, (torch.int32,))):
                    return None
                if not routers.fits(sl.spec, len(sl.experts.gate.mats), sl.router, sl.bias, sl.tid2eid):
                    return None
            elif sl.mlp is None:
                return None
        return StackStep(layers, final_norm, eps, hidden, modules, owners)

    def live(self) -> bool:
        """Every per-layer step, bound layer and watched tensor is as at build time and no module
        has hooks."""
        for d, st in self.owners:
            if d.get("step") is not st:
                return False
        for d, params, b, name, t, ptr in self.checks:  # what bound() checks, inlined
            if d.get("qp_native") is not b or name is not None and (params.get(name) is not t or t.data_ptr() != ptr):
                return False
        for t, ptr in self.tensors:
            if t.data_ptr() != ptr:
                return False
        return self._no_hooks()

    def _no_hooks(self) -> bool:
        """No module of the stack has forward hooks, nor are there global ones. torch registers
        every hook with a new ``RemovableHandle``, whose class counter then moves: while it
        stands where it stood at the last check that found none, there still are none (a hook
        written into a module's hook dict by hand, bypassing ``register_*``, is not seen then)."""
        n = RemovableHandle.next_id
        if n == self._hooks_clear_at:
            return True
        if any(self.hook_dicts) or _global_hooks():
            return False
        self._hooks_clear_at = n
        return True

    def __call__(self, x: torch.Tensor, rot: torch.Tensor, caches: Sequence[Any]) -> torch.Tensor | None:
        """x [B, 1, hidden] in the model dtype (the embeddings), ``rot`` as :class:`MLAStep` takes
        it, ``caches`` every layer's ``LatentCache``: appends each layer's latent and key and
        returns the final norm of the last residual [B, 1, hidden]; None when the step cannot run
        now."""
        if x.dtype != self.dtype or x.device.type != "cpu" or x.numel() != x.shape[0] * self.h:
            return None
        got = self._run(x.shape[0], x, None, None, rot, caches, None, False)
        return None if got is None else got[0]

    def logits(self, ids: torch.Tensor, embed: Bound | None, rot: torch.Tensor, caches: Sequence[Any],
               head: Bound | None, pick: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """A whole decode step from token ids ``ids`` [B, 1] (int64): the rows of ``embed`` (the
        embedding's binding, decoded exactly as its lookup does), the stack as a call of the step,
        then ``head`` (the LM head's binding, or None) in the same native call. Returns (the final
        norm [B, 1, hidden] in the model dtype, float32 logits [B, vocab] or None without ``head``,
        with ``pick`` and a head the greedy tokens [B] as ``logits.argmax(-1)``, else None);
        None when the step cannot run now (nothing appended)."""
        b = ids.shape[0]
        if not self._takes(ids, embed, head) or ids.numel() != b:
            return None
        return self._run(b, None, ids.contiguous(), embed, rot, caches, head, pick and head is not None)

    def sequence(self, ids: torch.Tensor | None, x: torch.Tensor | None, embed: Bound | None, rot: torch.Tensor,
                 caches: Sequence[Any], head: Bound | None, pick: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """T <= :data:`NATIVE_ROWS` new tokens of ONE sequence (every cache of batch 1) in one native
        call, each attending on the cached tokens and on the new ones before it (causal), as T
        one-token steps would in turn: the step of a speculative verify. The tokens come as ids
        ``ids`` [T] (int64, with ``embed`` the embedding's binding) or as inputs ``x`` [T, hidden] in
        the model dtype; ``rot`` [T, rope, rope] the rotation of each token's position (the cache's
        length onwards). Appends the T latents and keys to every cache and returns (the final norm
        [1, T, hidden], float32 logits [T, vocab] through ``head`` or None, the greedy picks [T] with
        ``pick`` and a head); None when the step cannot run now (nothing appended). Each row's
        arithmetic is the one-token step's, so the logits equal T one-token steps' (tested)."""
        if ids is not None:
            if x is not None or not self._takes(ids, embed, head) or ids.dim() != 1:
                return None
            t = ids.shape[0]
            ids = ids.contiguous()
        else:
            if (x is None or embed is not None or x.dtype != self.dtype or x.device.type != "cpu" or x.dim() != 2
                    or x.shape[1] != self.h or head is not None and not self._takes(None, None, head)):
                return None
            t = x.shape[0]
        if t < 1:
            return None
        got = self._run(t, x, ids, embed, rot, caches, head, pick and head is not None, one_sequence=True)
        return None if got is None else (got[0].view(1, t, self.h), got[1], got[2])

    def speculate(self, ids: torch.Tensor, embed: Bound, rot: torch.Tensor, caches: Sequence[Any], head: Bound,
                  draft: DraftStep, proj: Bound, dcaches: Sequence[Any], drot: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int, bool]] | None:
        """One step of greedy speculative decoding in one native call (``qp_spec_step``): ``ids`` [2]
        = (the last emitted token, the draft) of ONE sequence through the stack at the cache's
        length and the next position (``rot`` [2, rope, rope]; as :meth:`sequence`, so each row is a
        one-token step), the draft accepted when the pick after the last token equals it; then
        ``draft`` (the drafter, its one-layer cache ``dcaches``, its rows' rotations ``drot`` [2,
        rope, rope], its projection's binding ``proj``) on the accepted pairs (hidden state, next
        token) and the head on its last row. Returns (the final norm [1, 2, hidden], float32 logits
        [2, vocab], the drafter's float32 logits [1, vocab] (their greedy pick is the next draft),
        (pick after the last token, pick after the draft, accepted)); the
        main caches gain both tokens (roll the draft back when it was rejected), the drafter's cache
        its accepted pairs (2 or 1). None when the step cannot run now (nothing appended)."""
        lib = native._lib
        if (lib is None or len(caches) != self.n or len(dcaches) != 1 or ids.dtype != torch.int64 or tuple(ids.shape) != (2,)
                or not self._takes(ids, embed, head) or not self.live() or not draft.live(self, proj)):
            return None
        every = [*caches, *dcaches]
        c0 = caches[0]
        if any(c.latent.shape[0] != 1 or c.latent.dtype != c0.latent.dtype or c.latent.shape[3] != c0.latent.shape[3]
               or c.k_rope.shape[3] != c0.k_rope.shape[3] for c in every) or any(c.length != c0.length for c in caches):
            return None
        r, dr = _rotations(rot, 2, self.rope), _rotations(drot, 2, self.rope)
        if r is None or dr is None:
            return None
        held: list[tuple[Any, int]] = []
        try:
            for c, t in [(c, 2) for c in caches] + [(dcaches[0], 2)]:
                held.append((c, c.reserve(t)))  # may grow (re-allocate) a cache: pointers are read after
        except BaseException:
            for c, _ in held:
                c.unreserve(2)
            raise
        lat, kr = c0.latent, c0.k_rope
        if any((c.latent.stride(2), c.k_rope.stride(2)) != (lat.stride(2), kr.stride(2)) for c in every) or len(
                {at for c, at in held[:-1]}) != 1:
            for c, _ in held:
                c.unreserve(2)
            return None
        import ctypes

        vp = ctypes.c_void_p * self.n
        lats, krs = vp(*[c.latent.data_ptr() for c in caches]), vp(*[c.k_rope.data_ptr() for c in caches])
        d = dcaches[0]
        hid = torch.empty(1, 2, self.h)
        logits = torch.empty(2, head.n)
        dlogits = torch.empty(1, head.n)
        res = torch.empty(3, dtype=torch.int64)
        ids = ids.contiguous()
        fn = self.final_norm
        rc = lib.qp_spec_step(self.layers_arr, self.n, self.h, ids.data_ptr(), embed.ptr(), r.data_ptr(), lats, krs,
                              lat.stride(2), kr.stride(2), held[0][1], int(lat.dtype == torch.bfloat16), fn.data_ptr(),
                              int(fn.dtype == torch.bfloat16), self.eps, head.ptr(), draft.struct(proj),
                              d.latent.data_ptr(), d.k_rope.data_ptr(), held[-1][1], dr.data_ptr(), hid.data_ptr(),
                              logits.data_ptr(), dlogits.data_ptr(), res.data_ptr(), self.wround)
        if rc != 0:
            for c, _ in held:
                c.unreserve(2)
            if rc == -4:  # a token id outside the embedding: the module path raises its own error
                return None
            native.check(rc, "spec_step")
        a, b, acc = res.tolist()
        if not acc:
            d.unreserve(1)  # the drafter appended one pair
        return (hid if self.dtype == torch.float32 else hid.to(self.dtype)), logits, dlogits, (a, b, bool(acc))

    def _takes(self, ids: torch.Tensor | None, embed: Bound | None, head: Bound | None) -> bool:
        """Whether token ids, the embedding's binding and the head's binding suit this step."""
        if ids is not None and (embed is None or ids.dtype != torch.int64 or ids.device.type != "cpu"
                                or embed.k != self.h or embed.model_dtype != self.dtype or embed.slots is not None):
            return False
        return head is None or (head.k == self.h and head.model_dtype == self.dtype and head.slots is None)

    def paged(self, x: torch.Tensor, rot: torch.Tensor, kv: Sequence[torch.Tensor], rows: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor | None:
        """A decode step on an engine's paged latent cache (vLLM's MLA cache): ``x`` [B, hidden] the
        embeddings in the model dtype, ``rot`` [B, rope, rope] each row's rotation at its position,
        ``kv`` every layer's cache as [slots, kv_lora + rope] (per slot the latent then the roped key;
        float32 or bfloat16, the same for every layer), ``rows`` [B, R] int64 the slot of each
        position of each sequence, ``positions`` [B] int64 each sequence's new token (< R; the
        sequences may stand at different positions). Writes every layer's latent and key at slot
        ``rows[b, positions[b]]`` and attends on ``rows[b, :positions[b] + 1]``. Returns the final
        norm [B, hidden] in the model dtype; None (nothing written) when the step cannot run now or
        a slot lies outside the cache."""
        lib = native._lib
        b = x.shape[0]
        if (lib is None or b > NATIVE_ROWS or len(kv) != self.n or x.dtype != self.dtype or x.device.type != "cpu"
                or x.numel() != b * self.h or self.by_token or not self.live()):
            return None
        c0, kl = kv[0], self.mla_steps[0].kv_lora
        if (c0.dtype not in (torch.float32, torch.bfloat16) or c0.dim() != 2 or c0.shape[1] != kl + self.rope
                or c0.device.type != "cpu" or c0.stride(1) != 1
                or any(c.dtype != c0.dtype or c.shape != c0.shape or c.stride() != c0.stride() for c in kv)):
            return None
        if (rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[0] != b or positions.dtype != torch.int64
                or tuple(positions.shape) != (b,) or rows.device.type != "cpu" or positions.device.type != "cpu"):
            return None
        rows, positions = rows.contiguous(), positions.contiguous()
        lo, hi = torch.aminmax(rows)
        plo, phi = torch.aminmax(positions)
        if int(lo) < 0 or int(hi) >= c0.shape[0] or int(plo) < 0 or int(phi) >= rows.shape[1]:
            return None
        r = _rotations(rot, b, self.rope)
        if r is None:
            return None
        import ctypes

        esz, ld = c0.element_size(), c0.stride(0)
        vp = ctypes.c_void_p * self.n
        lats, krs = vp(*[c.data_ptr() for c in kv]), vp(*[c.data_ptr() + kl * esz for c in kv])
        x2 = x.reshape(b, self.h).to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        out = torch.empty(b, self.h)
        fn = self.final_norm
        rc = lib.qp_decode_step(self.layers_arr, self.n, self.h, b, None, None, x2.data_ptr(), r.data_ptr(), lats, krs,
                                ld, 0, ld, 0, 0, rows.data_ptr(), rows.shape[1], positions.data_ptr(),
                                int(c0.dtype == torch.bfloat16), fn.data_ptr(), int(fn.dtype == torch.bfloat16),
                                self.eps, out.data_ptr(), None, None, None, self.wround)
        native.check(rc, "decode_step")
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def _run(self, b: int, x: torch.Tensor | None, ids: torch.Tensor | None, embed: Bound | None,
             rot: torch.Tensor, caches: Sequence[Any], head: Bound | None, pick: bool, one_sequence: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """``b`` rows: b sequences at one position, or (``one_sequence``) b tokens of one sequence."""
        lib = native._lib
        if lib is None or b > NATIVE_ROWS or len(caches) != self.n or not self.live() or self.by_token and ids is None:
            return None
        c0 = caches[0]
        t = b if one_sequence else 1  # positions each cache gains
        for c in caches:
            if c.length != c0.length or c.latent.dtype != c0.latent.dtype or c.latent.shape[0] != b // t:
                return None
        if c0.latent.dtype not in (torch.float32, torch.bfloat16) or c0.latent.device.type != "cpu":
            return None
        r = _rotations(rot, b, self.rope)
        if r is None:
            return None
        pos: list[int] = []
        try:
            for c in caches:
                pos.append(c.reserve(t))  # may grow (re-allocate) the cache: pointers are read after
        except BaseException:
            for c in caches[:len(pos)]:
                c.unreserve(t)
            raise
        lat, kr = c0.latent, c0.k_rope
        strides = (lat.stride(2), lat.stride(0), kr.stride(2), kr.stride(0))
        if any((c.latent.stride(2), c.latent.stride(0), c.k_rope.stride(2), c.k_rope.stride(0)) != strides
               for c in caches) or len(set(pos)) != 1:
            for c in caches:
                c.unreserve(t)
            return None
        # one sequence: every row reads and writes the one cache row (batch stride 0), row i at
        # position pos + i; qp_latent_step writes all rows' latents before any row attends
        bpos = torch.arange(pos[0], pos[0] + b) if one_sequence else None
        if one_sequence:
            strides = (strides[0], 0, strides[2], 0)
        import ctypes

        vp = ctypes.c_void_p * self.n
        lats, krs = vp(*[c.latent.data_ptr() for c in caches]), vp(*[c.k_rope.data_ptr() for c in caches])
        if x is None:
            x2 = torch.empty(b, self.h)
        else:
            x2 = x.reshape(b, self.h).to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        out = torch.empty(b, 1, self.h)
        logits = None if head is None else torch.empty(b, head.n)
        best = torch.empty(b, dtype=torch.int64) if pick else None
        fn = self.final_norm
        rc = lib.qp_decode_step(self.layers_arr, self.n, self.h, b, None if ids is None else ids.data_ptr(),
                                None if embed is None else embed.ptr(), x2.data_ptr(), r.data_ptr(), lats, krs,
                                strides[0], strides[1], strides[2], strides[3], pos[0], None, 0,
                                None if bpos is None else bpos.data_ptr(),
                                int(lat.dtype == torch.bfloat16), fn.data_ptr(), int(fn.dtype == torch.bfloat16),
                                self.eps, out.data_ptr(), None if head is None else head.ptr(),
                                None if logits is None else logits.data_ptr(),
                                None if best is None else best.data_ptr(), self.wround)
        if rc != 0:
            for c in caches:
                c.unreserve(t)
            if rc == -4:  # a token id outside the embedding: the module path raises its own error
                return None
            native.check(rc, "decode_step")
        return (out if self.dtype == torch.float32 else out.to(self.dtype)), logits, best  # bfloat16 values: exact


class DraftStep:
    """The drafter of :meth:`StackStep.speculate` (``qp_draft``): a next-token-prediction block as
    DeepSeek's MTP layer is one, ``eh_proj(cat(enorm(embedding), hnorm(hidden)))`` through one
    decoder layer (``block``, a one-layer :class:`StackStep` whose final norm is the block's head
    norm). ``enorm`` / ``hnorm``: the two RMSNorm modules (their weights are read at each call and
    must keep the block's norm dtype); ``proj_module``: ``eh_proj``, bound per call."""

    def __init__(self, block: StackStep, enorm: torch.nn.Module, hnorm: torch.nn.Module, proj_module: torch.nn.Module) -> None:
        self.block, self.enorm, self.hnorm, self.proj_module = block, enorm, hnorm, proj_module
        self.c = native.Draft()
        import ctypes

        self.c.layer = ctypes.pointer(block.layers_arr[0])
        self.c.fnorm = block.final_norm.data_ptr()
        self.c.norm_bf16 = int(block.final_norm.dtype == torch.bfloat16)
        self.c.eps = block.eps
        self.dtype = block.final_norm.dtype

    @staticmethod
    def build(block: StackStep | None, enorm: torch.nn.Module, hnorm: torch.nn.Module,
              proj_module: torch.nn.Module) -> DraftStep | None:
        """None without a one-layer block step or when the norms' epsilons differ from the block's
        head norm (``qp_draft`` has one)."""
        if block is None or block.n != 1 or getattr(enorm, "eps", None) != block.eps or getattr(hnorm, "eps", None) != block.eps:
            return None
        return DraftStep(block, enorm, hnorm, proj_module)

    def live(self, stack: StackStep, proj: Bound) -> bool:
        """The block is as built, both norm weights are contiguous CPU tensors of the head norm's
        dtype (refreshed into the struct), ``proj`` suits the stack and no drafter module has hooks."""
        if not self.block.live() or proj.k != 2 * stack.h or proj.n != stack.h or proj.model_dtype != stack.dtype or proj.slots is not None:
            return False
        if _hooked(self.enorm) or _hooked(self.hnorm) or _hooked(self.proj_module):
            return False
        ew, hw = cast(torch.Tensor, self.enorm.weight), cast(torch.Tensor, self.hnorm.weight)
        for w in (ew, hw):
            if w.dtype != self.dtype or w.device.type != "cpu" or not w.is_contiguous() or w.numel() != stack.h:
                return False
        self.c.enorm, self.c.hnorm = ew.data_ptr(), hw.data_ptr()
        return True

    def struct(self, proj: Bound) -> Any:
        import ctypes

        self.c.proj = proj.ptr()
        return ctypes.byref(self.c)


def _hooked(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _mat_array(ptrs: Sequence[Any], keep: list[Any]) -> Any:
    """``Mat`` pointers as the C array (``const qp_mat *const *``) a step struct holds; the array is
    appended to ``keep``, which must live as long as the struct."""
    import ctypes

    arr = (ctypes.POINTER(native.Mat) * len(ptrs))(*ptrs)
    keep.append(arr)
    return ctypes.cast(arr, ctypes.POINTER(ctypes.POINTER(native.Mat)))


def _global_hooks() -> bool:
    """Whether global module forward hooks are registered (``register_module_forward_hook``)."""
    from torch.nn.modules import module as _m

    return bool(_m._global_forward_hooks or _m._global_forward_pre_hooks)


class HyperStep:
    """A hyper-connection's mix of N residual streams (C ``qp_hyper_pre`` / ``qp_hyper_post``,
    ``blocks/hyper_mix.c``; the math is :mod:`quantplug.blocks.hyper`'s): :meth:`pre` takes the
    streams x [B, N, D] to the sub-layer's input ``u = sum_k pre_k x_k`` [B, D] and the row's
    ``(pre, post, comb)``; :meth:`post` takes the sub-layer's output f [B, D] back to the new streams
    ``post_k f + sum_j comb[j, k] x_j``. A head (``head=True``: ``fn`` [N, N * D], scale [1]) has
    :meth:`pre` only. Float32 streams only (a bfloat16 model's mixes round where torch's do; they
    run the block's forward); None where it cannot run (library off, tensors replaced)."""

    def __init__(self, owner: Any, n: int, iters: int, hc_eps: float, norm_eps: float, head: bool) -> None:
        self.owner = owner
        self.fn, self.base, self.scale = owner.fn, owner.base, owner.scale
        self.n, self.iters, self.hc_eps, self.norm_eps, self.head = n, iters, hc_eps, norm_eps, head
        self.m = n if head else (2 + n) * n
        self.d = self.fn.shape[1] // n

    @classmethod
    def build(cls, owner: Any, n: int, iters: int, hc_eps: float, norm_eps: float, head: bool) -> HyperStep | None:
        """The step of ``owner`` (a module holding ``fn`` / ``base`` / ``scale``), or None when its
        tensors are not float32 contiguous CPU tensors of the declared shapes."""
        fn, base, scale = owner.fn, owner.base, owner.scale
        m = n if head else (2 + n) * n
        ok = all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
                 and t.is_contiguous() for t in (fn, base, scale))
        if not ok or fn.dim() != 2 or fn.shape[0] != m or fn.shape[1] % n or base.shape != (m,) \
                or scale.numel() != (1 if head else 3) or iters < 1 or n > 64:
            return None
        return cls(owner, n, iters, hc_eps, norm_eps, head)

    def live(self) -> bool:
        o = self.owner
        return native._lib is not None and o.fn is self.fn and o.base is self.base and o.scale is self.scale

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """x [..., N, D] float32 -> (u [..., D], pre [..., N], post [..., N], comb [..., N, N])
        (a head: post and comb empty), or None."""
        if not self.live() or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-2:] != (self.n, self.d):
            return None
        lead = x.shape[:-2]
        xc = x.reshape(-1, self.n, self.d).contiguous()
        b, n, d = xc.shape[0], self.n, self.d
        if b == 0:
            return None
        u = torch.empty(b, d, dtype=torch.float32)
        pre = torch.empty(b, n, dtype=torch.float32)
        post = torch.empty(0 if self.head else b * n, dtype=torch.float32)
        comb = torch.empty(0 if self.head else b * n * n, dtype=torch.float32)
        lib = native._lib
        assert lib is not None
        rc = lib.qp_hyper_pre(b, n, d, xc.data_ptr(), self.fn.data_ptr(), self.m, self.base.data_ptr(),
                              self.scale.data_ptr(), self.iters, self.hc_eps, self.norm_eps, u.data_ptr(),
                              pre.data_ptr(), None if self.head else post.data_ptr(),
                              None if self.head else comb.data_ptr())
        if rc != 0:
            return None
        return (u.view(*lead, d), pre.view(*lead, n), post.view(*lead, n) if not self.head else post,
                comb.view(*lead, n, n) if not self.head else comb)

    def post(self, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor | None:
        """The new streams [..., N, D] of the sub-layer output f [..., D] (float32), or None."""
        if self.head or not self.live() or f.dtype != torch.float32 or x.dtype != torch.float32:
            return None
        n, d = self.n, self.d
        xc = x.reshape(-1, n, d).contiguous()
        fc = f.reshape(-1, d).contiguous()
        if fc.shape[0] != xc.shape[0]:
            return None
        out = torch.empty_like(xc)
        pc, cc = post.float().contiguous(), comb.float().contiguous()  # held across the call
        lib = native._lib
        assert lib is not None
        rc = lib.qp_hyper_post(xc.shape[0], n, d, fc.data_ptr(), xc.data_ptr(), pc.data_ptr(), cc.data_ptr(),
                               out.data_ptr())
        return out.view(x.shape) if rc == 0 else None


def _f32_vector(t: Any, n: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
            and t.is_contiguous() and t.numel() == n)


def _watched(watch: Sequence[tuple[Any, str]]) -> list[tuple[Any, str, torch.Tensor, int]]:
    """(module, attribute, the tensor now, its data pointer) of each watched attribute."""
    out = []
    for m, name in watch:
        t = getattr(m, name)
        out.append((m, name, t, t.data_ptr()))
    return out


def _unchanged(watched: Sequence[tuple[Any, str, torch.Tensor, int]]) -> bool:
    """Every watched attribute still holds the same tensor with the same data."""
    return all(getattr(m, name) is t and t.data_ptr() == ptr for m, name, t, ptr in watched)


class PoolBuffers:
    """One decode call's buffers of a pooled compressor (``qp_pool_state``), the caller's to fill
    and read back: ``kv`` / ``gate`` [B, pending + 1, width] (the pending rows copied in, this
    token's written by the call), ``ent`` [B, n (+ 1 when this token completes a window), dim],
    ``prev_kv`` / ``prev_gate`` (overlap: the previous window's first halves, or None),
    ``prev_kv_out`` / ``prev_gate_out`` (overlap and completing: written by the call), ``cos`` /
    ``sin`` the rotation at the completed window's first position."""

    def __init__(self, kv: torch.Tensor, gate: torch.Tensor, pending: int, n: int, ent: torch.Tensor,
                 prev_kv: torch.Tensor | None, prev_gate: torch.Tensor | None, prev_kv_out: torch.Tensor | None,
                 prev_gate_out: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.kv, self.gate, self.pending, self.n, self.ent = kv, gate, pending, n, ent
        self.prev_kv, self.prev_gate, self.prev_kv_out, self.prev_gate_out = prev_kv, prev_gate, prev_kv_out, prev_gate_out
        self.cos, self.sin = cos, sin

    def struct(self) -> Any:
        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()
        return native.PoolState(kv=ptr(self.kv), gate=ptr(self.gate), pending=self.pending, n=self.n, ent=ptr(self.ent),
                                prev_kv=ptr(self.prev_kv), prev_gate=ptr(self.prev_gate),
                                prev_kv_out=ptr(self.prev_kv_out), prev_gate_out=ptr(self.prev_gate_out),
                                cos=ptr(self.cos), sin=ptr(self.sin))


class WindowAttnStep:
    """One decode token of sliding-window attention with per-head sinks over one shared key / value
    head, with an optional pooled compressor of its keys and a top-k indexer over its own
    compressor's keys, in one native call (C ``qp_window_step``, ``blocks/window_attention.c``;
    the math is :mod:`quantplug.blocks.v4_attention`'s). Float32 models; every projection of a
    native form. ``__call__(x, cos, sin, win, comp, idx)``: x [B, H] float32, the rotation of the
    position, the window's keys ``win`` [B, nwin, hd] with this token's row written at the end,
    the compressors' :class:`PoolBuffers`; returns [B, H], or None where it declines."""

    def __init__(self, st: Any, keep: list[Any], mods: dict[str, Any], bs: dict[str, Bound], hidden: int,
                 wround: int, watch: Sequence[tuple[Any, str]] = ()) -> None:
        import ctypes

        self.st, self.keep, self.mods, self.bs, self.h, self.wround = st, keep, mods, bs, hidden, wround
        self.ref = ctypes.byref(st)
        self.watch = _watched(watch)

    @staticmethod
    def build(*, mods: dict[str, Any], floats: dict[str, torch.Tensor], hidden: int, nh: int, hd: int, rope: int,
              q_lora: int, groups: int, o_rank: int, window: int, eps: float, ratio: int = 0, overlap: bool = False,
              idx_heads: int = 0, idx_dim: int = 0, idx_topk: int = 0,
              watch: Sequence[tuple[Any, str]] = ()) -> WindowAttnStep | None:
        """``mods``: the linears ``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b`` (and ``c_wkv``,
        ``c_wgate`` with a compressor; ``i_wq``, ``ic_wkv``, ``ic_wgate`` with an indexer);
        ``floats``: float32 tensors ``q_norm``, ``kv_norm``, ``sink`` (and ``c_ape``, ``c_norm``;
        ``i_w``, ``ic_ape``, ``ic_norm``); ``watch``: (module, attribute) of each of those tensors
        (the step declines once one is replaced or moved). None when any is missing, not native or
        not float32."""
        bs = {k: bound(m) for k, m in mods.items()}
        if any(b is None for b in bs.values()) or {b.wround for b in bs.values() if b is not None} != {0}:
            return None
        if any(b.slots is not None for b in bs.values() if b is not None):
            return None
        if not all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
                   and t.is_contiguous() for t in floats.values()):
            return None
        keep: list[Any] = [bs, dict(floats)]
        st = native.WindowAttn(H=hidden, nh=nh, hd=hd, rope=rope, q_lora=q_lora, groups=groups, o_rank=o_rank,
                               window=window, idx_heads=idx_heads, idx_dim=idx_dim, idx_topk=idx_topk, eps=eps,
                               scale=hd ** -0.5)
        for k in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            setattr(st, k, bs[k].ptr())  # type: ignore[union-attr]
        st.q_norm, st.kv_norm, st.sink = (floats[k].data_ptr() for k in ("q_norm", "kv_norm", "sink"))
        if ratio:
            pool = native.Pool(dim=hd, ratio=ratio, overlap=int(overlap), eps=eps, wkv=bs["c_wkv"].ptr(),  # type: ignore[union-attr]
                               wgate=bs["c_wgate"].ptr(), ape=floats["c_ape"].data_ptr(),  # type: ignore[union-attr]
                               norm=floats["c_norm"].data_ptr())
            keep.append(pool)
            import ctypes
            st.comp = ctypes.pointer(pool)
        if idx_heads:
            ipool = native.Pool(dim=idx_dim, ratio=ratio, overlap=1, eps=eps, wkv=bs["ic_wkv"].ptr(),  # type: ignore[union-attr]
                                wgate=bs["ic_wgate"].ptr(), ape=floats["ic_ape"].data_ptr(),  # type: ignore[union-attr]
                                norm=floats["ic_norm"].data_ptr())
            keep.append(ipool)
            import ctypes
            st.idx_comp = ctypes.pointer(ipool)
            st.idx_q = bs["i_wq"].ptr()  # type: ignore[union-attr]
            st.idx_w = floats["i_w"].data_ptr()
        if native.library() is None:
            return None
        return WindowAttnStep(st, keep, mods, bs, hidden, 0, watch)  # type: ignore[arg-type]

    def live(self) -> bool:
        return (native._lib is not None and all(bound(m) is self.bs[k] for k, m in self.mods.items())
                and _unchanged(self.watch))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, win: torch.Tensor,
                 comp: PoolBuffers | None, idx: PoolBuffers | None) -> torch.Tensor | None:
        import ctypes

        lib = native._lib
        b = x.shape[0]
        if lib is None or x.dtype != torch.float32 or x.shape != (b, self.h) or b > NATIVE_ROWS:
            return None
        x2 = x.contiguous()
        out = torch.empty(b, self.h)
        cst = comp.struct() if comp is not None else None
        ist = idx.struct() if idx is not None else None
        rc = lib.qp_window_step(self.ref, b, x2.data_ptr(), cos.data_ptr(), sin.data_ptr(), win.data_ptr(), win.shape[1],
                                None if cst is None else ctypes.byref(cst), None if ist is None else ctypes.byref(ist),
                                out.data_ptr(), self.wround)
        native.check(rc, "window_step")
        return out


class HyperStackLayer:
    """One decoder layer of residual streams as :class:`HyperStackStep` runs it: the mixes around
    the attention and around the MoE (``HyperStep`` each), the two norms' float32 weights, the
    attention's :class:`WindowAttnStep`, and the MoE: its stacked experts' step, the router (its
    ``RouterSpec``, float32 weight, bias, ``tid2eid`` table), the shared experts' step or None."""

    def __init__(self, *, hc_attn: HyperStep, hc_ffn: HyperStep, attn_norm: torch.Tensor, ffn_norm: torch.Tensor,
                 eps: float, attn: WindowAttnStep, experts: MLPStep, router: torch.Tensor, spec: RouterSpec,
                 bias: torch.Tensor | None, tid2eid: torch.Tensor | None, shared: MLPStep | None) -> None:
        self.hc_attn, self.hc_ffn, self.attn_norm, self.ffn_norm, self.eps = hc_attn, hc_ffn, attn_norm, ffn_norm, eps
        self.attn, self.experts, self.router, self.spec, self.bias, self.tid2eid = attn, experts, router, spec, bias, tid2eid
        self.shared = shared


class HyperStackStep:
    """A decode step of a stack of residual-stream (hyper-connection) layers with window attention
    and MoE, from token ids to logits, in one native call (C ``qp_hyper_decode_step``,
    ``blocks/hyper_stack.c``): the embedding rows copied into the streams; per layer the mix, the
    norm, the attention (:class:`WindowAttnStep`'s kernel, the cache written into the buffers
    :meth:`__call__` is given), the mix back, then the same around the MoE (the router by its
    spec, by token id where it routes so; the experts through ``qp_mlp`` with their activation);
    the head's collapse of the streams, the final norm, the LM head, the greedy pick. The per-block
    native steps' arithmetic in their order; float32 models. ``live()`` declines (the per-block path
    runs) when a step, a bound layer or a watched tensor was replaced, or a module has forward hooks."""

    def __init__(self, layers: Sequence[HyperStackLayer], head_hc: HyperStep, final_norm: torch.Tensor, eps: float,
                 hidden: int, modules: Sequence[torch.nn.Module], owners: Sequence[tuple[torch.nn.Module, Any]],
                 watch: Sequence[tuple[Any, str]] = ()) -> None:
        import ctypes

        self.watch = _watched(watch)
        self.h, self.eps, self.final_norm, self.head_hc = hidden, eps, final_norm, head_hc
        self.layers = list(layers)
        self.n = len(layers)
        self.hook_dicts = tuple(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks))
        self.owners = [(m.__dict__, st) for m, st in owners]
        self.keep: list[Any] = []
        ffn = (native.Layer * self.n)()
        arr = (native.HyperBlock * self.n)()
        tensors: list[torch.Tensor] = [final_norm]
        for i, sl in enumerate(layers):
            f = ffn[i]
            ex = sl.experts
            e = len(ex.gate.mats)
            f.gate, f.up, f.down = (_mat_array([b.ptr(s) for s in range(e)], self.keep) for b in (ex.gate, ex.up, ex.down))
            f.E = e
            tid = None if sl.tid2eid is None else sl.tid2eid.to(torch.int32).contiguous()
            self.keep.append(tid)
            routers.route(f.route, sl.spec, sl.router, sl.bias, tid)
            if sl.shared is not None:
                f.sg, f.su, f.sd = sl.shared.gate.ptr(), sl.shared.up.ptr(), sl.shared.down.ptr()
            f.act, f.act_a, f.act_b = ex.act
            a = arr[i]
            a.attn = ctypes.pointer(sl.attn.st)
            a.ffn = ctypes.pointer(f)
            a.attn_norm, a.ffn_norm, a.eps = sl.attn_norm.data_ptr(), sl.ffn_norm.data_ptr(), sl.eps
            hc = sl.hc_attn
            a.hc, a.iters, a.hc_eps, a.hc_norm_eps = hc.n, hc.iters, hc.hc_eps, hc.norm_eps
            a.a_fn, a.a_base, a.a_scale = hc.fn.data_ptr(), hc.base.data_ptr(), hc.scale.data_ptr()
            g = sl.hc_ffn
            a.f_fn, a.f_base, a.f_scale = g.fn.data_ptr(), g.base.data_ptr(), g.scale.data_ptr()
            tensors += [sl.attn_norm, sl.ffn_norm, sl.router, *(t for t in (sl.bias, sl.tid2eid) if t is not None)]
        self.ffn, self.arr = ffn, arr
        self.tensors = [(t, t.data_ptr()) for t in tensors]

    @staticmethod
    def build(layers: Sequence[HyperStackLayer], head_hc: HyperStep | None, final_norm: torch.Tensor, eps: float,
              hidden: int, modules: Sequence[torch.nn.Module], owners: Sequence[tuple[torch.nn.Module, Any]],
              watch: Sequence[tuple[Any, str]] = ()) -> HyperStackStep | None:
        """None when the library is unavailable or a piece is not native / float32 / of these sizes.
        ``watch``: (module, attribute) of the tensors read outside the steps (norms, routers): the
        step declines once one is replaced or moved."""
        if native.library() is None or not layers or head_hc is None or not head_hc.head:
            return None
        vec = [final_norm] + [t for sl in layers for t in (sl.attn_norm, sl.ffn_norm, sl.router)]
        if not all(_f32_vector(t, t.numel()) for t in vec) or final_norm.numel() != hidden:
            return None
        n = head_hc.n
        for sl in layers:
            parts = [p for p in (sl.experts, sl.shared) if p is not None]
            if any(p.reduce is not None or p.gate.wround != 0 or p.h != hidden or p.act != parts[0].act for p in parts):
                return None
            if sl.hc_attn.n != n or sl.hc_ffn.n != n or sl.hc_attn.head or sl.hc_ffn.head or sl.attn.h != hidden:
                return None
            if sl.bias is not None and not _f32_vector(sl.bias, sl.bias.numel()):
                return None
            if not routers.fits(sl.spec, len(sl.experts.gate.mats), sl.router, sl.bias,
                                None if sl.tid2eid is None else sl.tid2eid.to(torch.int32)):
                return None
        return HyperStackStep(layers, head_hc, final_norm, eps, hidden, modules, owners, watch)

    def live(self) -> bool:
        for d, st in self.owners:
            if d.get("step") is not st:
                return False
        for sl in self.layers:
            if not (sl.attn.live() and sl.hc_attn.live() and sl.hc_ffn.live() and sl.experts.live()
                    and (sl.shared is None or sl.shared.live())):
                return False
        if not self.head_hc.live() or any(t.data_ptr() != p for t, p in self.tensors) or not _unchanged(self.watch):
            return False
        return not any(self.hook_dicts) and not _global_hooks()

    def __call__(self, ids: torch.Tensor, embed: Bound, head: Bound | None,
                 states: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, PoolBuffers | None, PoolBuffers | None]],
                 pick: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """One decode token ``ids`` [B] (int64) of B sequences at one position; ``states``: per layer
        (window buffer [B, nwin, hd] with room for this token's row at the end, cos, sin [rope / 2]
        of the position, the compressor's and the indexer's :class:`PoolBuffers` or None). Returns
        (the final norm [B, hidden], float32 logits [B, vocab] or None without ``head``, the greedy
        picks [B] with ``pick``); None when it cannot run now (no buffer written)."""
        import ctypes

        lib = native._lib
        b = ids.shape[0]
        if (lib is None or ids.dtype != torch.int64 or ids.dim() != 1 or b > NATIVE_ROWS or len(states) != self.n
                or embed.k != self.h or embed.slots is not None or embed.model_dtype != torch.float32
                or (head is not None and (head.k != self.h or head.slots is not None))):
            return None
        ws = (native.WindowState * self.n)()
        keep: list[Any] = []
        for i, (win, cos, sin, comp, idx) in enumerate(states):
            s = ws[i]
            s.win, s.nwin, s.cos, s.sin = win.data_ptr(), win.shape[1], cos.data_ptr(), sin.data_ptr()
            if comp is not None:
                cst = comp.struct()
                keep.append(cst)
                s.comp = ctypes.pointer(cst)
            if idx is not None:
                ist = idx.struct()
                keep.append(ist)
                s.idx = ctypes.pointer(ist)
        idc = ids.contiguous()
        hid = torch.empty(b, self.h)
        logits = torch.empty(b, head.n) if head is not None else None
        best = torch.empty(b, dtype=torch.int64) if pick and head is not None else None
        hc = self.head_hc
        rc = lib.qp_hyper_decode_step(self.arr, ws, self.n, self.h, b, idc.data_ptr(), embed.ptr(), hc.fn.data_ptr(),
                                      hc.base.data_ptr(), hc.scale.data_ptr(), self.final_norm.data_ptr(), self.eps,
                                      hid.data_ptr(), None if head is None else head.ptr(),
                                      None if logits is None else logits.data_ptr(),
                                      None if best is None else best.data_ptr(), 0)
        if rc == -4:
            return None  # a token id outside the embedding or a routing table: the modules raise their own error
        native.check(rc, "hyper_decode_step")
        return hid, logits, best
