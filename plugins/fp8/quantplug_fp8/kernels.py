"""Pure-torch kernels for DeepSeek's block FP8 format (weights) and its dynamic activations.

Weights (DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``, ``fp8_cast_bf16.py``): ``weight``
F8_E4M3 [out, in], ``weight_scale_inv`` F32 [ceil(out/bn), ceil(in/bk)], a *multiplier*
despite its name: w[r, c] = float(weight[r, c]) * scale[r // bn, c // bk]. Edge blocks are
partial (a [576, 7168] kv_a_proj_with_mqa has a [5, 56] scale; its last block row covers 64
rows). The block of an element is found from its own index, never from rows // scale_rows.

Activations (DeepSeek ``act_quant``, as of the 2025-08 kernel.py): per token, per group of
``bk`` input features: amax = max(max|x|, 1e-4); s = amax / 448 (with ``scale_fmt`` "ue8m0":
s = 2 ** ceil(log2(s))); x' = float(fp8_e4m3(x / s)) * s. DeepSeek asserts in % 128 == 0; an
input whose width is not a multiple of the group ends in one partial group (the same rule as
partial weight blocks).
"""

from __future__ import annotations

import math

import torch
from quantplug.api import QuantplugError

FP8_MAX = 448.0
#: DeepSeek's act_quant clamps each group's amax to at least this (no division by zero)
ACT_AMAX_FLOOR = 1e-4
#: rows of dense weight materialized at once by :func:`linear` (times in_features elements),
#: rounded to whole block rows: bounded temporaries whatever the matrix size
LINEAR_CHUNK_ELEMS = 1 << 20
#: elements decoded per step by :func:`dequantize` (a 16 MiB int16 buffer). Few, large steps:
#: every op is an intra-op parallel region, and on oversubscribed cores each one can wait a
#: scheduler slice for its second thread (measured under load on 64 MiB: 2M-element steps 0.67 s
#: best and erratic, 8M 0.42 s, one unchunked pass 0.48 s; naive 1.9 s)
DEQUANT_CHUNK_ELEMS = 1 << 23


def scale_shape(out_features: int, in_features: int, block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(out / bn), ceil(in / bk)]: the ``weight_scale_inv`` shape of an [out, in] weight."""
    return math.ceil(out_features / block[0]), math.ceil(in_features / block[1])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """F8_E4M3 ``weight`` [out, in] (or [n, out, in]) with F32 ``scale`` per block -> dense ``dtype``.

    Exact: each element is its fp8 value times its own block's scale, multiplied in float32 (as
    DeepSeek's kernel), then cast to ``dtype``; bit-identical to ``weight.float() * scale``
    expanded per element (NaN codes included). torch converts float8 to float element by element
    on CPU, so the bytes are decoded with integer ops instead: e4m3 ``s eeee mmm`` shifted left 7
    (sign bit kept, its int16 sign extension cleared) is the fp16 ``s 0eeee mmm0000000``, which
    is the fp8 value times 2**-8 (subnormals included: both formats' subnormals scale alike); the
    2**8 is folded into the block scale (exact: a power of two). Works in chunks of
    :data:`DEQUANT_CHUNK_ELEMS` elements through one reused int16 buffer, plus a per-row scale
    gather (1/bk of the output) and, for a non-float32 ``dtype``, one float32 chunk.
    """
    if weight.dim() == 3:
        res = out if out is not None else torch.empty(weight.shape, dtype=dtype, device=weight.device)
        for i in range(weight.shape[0]):
            dequantize(weight[i], scale[i], block, dtype, res[i])
        return res
    if weight.dim() != 2 or scale.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise QuantplugError(f"fp8 dequantize: expected a 2-D float8_e4m3fn weight and a 2-D scale, got "
                             f"{weight.dtype} {list(weight.shape)} and {list(scale.shape)}")
    rows, cols = weight.shape
    bn, bk = block
    want = scale_shape(rows, cols, block)
    if tuple(scale.shape) != want:
        raise QuantplugError(f"fp8 dequantize: weight {list(weight.shape)} with block {list(block)} needs a scale "
                             f"of shape {list(want)} ([ceil(out/{bn}), ceil(in/{bk})]), got {list(scale.shape)}")
    step = max(1, min(rows, DEQUANT_CHUNK_ELEMS // max(cols, 1)))
    if out is None:
        # a fresh output written chunk by chunk page-faults chunk by chunk, which measured 2.5x
        # the cost of faulting it in one whole-tensor op (256 MiB: 0.83 s vs 0.32 s on 2 cores)
        out = (torch.zeros if rows > step else torch.empty)(rows, cols, dtype=dtype, device=weight.device)
    elif out.shape != weight.shape or out.dtype != dtype:
        raise QuantplugError(f"fp8 dequantize(out=...): need {dtype} {list(weight.shape)}, got {out.dtype} "
                             f"{list(out.shape)}")
    scale = scale.to(torch.float32)
    fold = bool((scale.abs() < 2.0 ** 100).all())  # scale * 2**8 stays finite and exact
    mult = scale * 256.0 if fold else scale
    # each row's block row, from its own index (partial last block row included): [rows, ceil(in/bk)]
    srows = mult.index_select(0, torch.arange(rows, device=scale.device) // bn)
    raw = weight.view(torch.int8)
    # e4m3fn NaN codes are 0x7F (the int8 maximum) and 0xFF (the uint8 maximum): two reductions
    # over the bytes say whether any chunk needs the NaN fix-up below
    has_nan = rows * cols > 0 and (int(raw.max()) == 0x7F or int(raw.view(torch.uint8).max()) == 0xFF)
    full = cols // bk * bk
    bits = torch.empty(step, cols, dtype=torch.int16, device=weight.device)
    scratch = None if dtype == torch.float32 else torch.empty(step, cols, dtype=torch.float32, device=weight.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = bits[: r1 - r0]
        x.copy_(raw[r0:r1])
        x.bitwise_left_shift_(7).bitwise_and_(-16385)  # & 0xBFFF: drop the sign extension's bit 14
        o = out[r0:r1] if scratch is None else scratch[: r1 - r0]
        o.copy_(x.view(torch.float16))
        if not fold:
            o.mul_(256.0)
        s = srows[r0:r1]
        if full:
            o[:, :full].view(r1 - r0, full // bk, bk).mul_(s[:, : full // bk, None])
        if full < cols:  # the partial last block column
            o[:, full:].mul_(s[:, full // bk:])
        if has_nan:  # NaN codes (s 1111 111) decoded to 0x3F80 | sign (+-480 before scaling)
            o.masked_fill_((x & 0x7FFF) == 0x3F80, float("nan"))
        if scratch is not None:
            out[r0:r1].copy_(o)
    return out


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [out, in] -> (F8_E4M3 weight [out, in], F32 scale [ceil(out/bn), ceil(in/bk)]).

    Per block: s = amax / 448 (1.0 for an all-zero block), q = fp8_e4m3(w / s) rounded to
    nearest even, as DeepSeek's block quantization. Partial edge blocks use their own amax.
    """
    tiles = _tiles(w, block)
    amax = tiles.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return _codes(tiles, s, w.shape), s.contiguous()


def _tiles(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w`` [out, in] as float32 blocks [out blocks, bn, in blocks, bk], zero-padded at the edges."""
    rows, cols = w.shape
    bn, bk = block
    r_blocks, c_blocks = scale_shape(rows, cols, block)
    padded = torch.zeros(r_blocks * bn, c_blocks * bk)
    padded[:rows, :cols] = w.to(torch.float32)
    return padded.view(r_blocks, bn, c_blocks, bk)


def _codes(tiles: torch.Tensor, s: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The E4M3 codes of ``tiles`` over their block scales ``s``, back in the weight's ``shape``."""
    r_blocks, bn, c_blocks, bk = tiles.shape
    q = (tiles / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(r_blocks * bn, c_blocks * bk)[:shape[0], :shape[1]].contiguous()


def act_quant(x: torch.Tensor, group: int = 128, scale_fmt: str | None = None) -> torch.Tensor:
    """DeepSeek's dynamic activation quantization, emulated: x [..., k] -> x' in x's dtype.

    Per token, per ``group`` features (a last partial group when k % group != 0):
    s = max(amax, 1e-4) / 448, rounded up to a power of two when ``scale_fmt`` is "ue8m0";
    x' = float(fp8_e4m3(x / s)) * s.
    """
    xf = x.to(torch.float32)
    k = xf.shape[-1]
    full = k // group * group
    out = torch.empty_like(xf)
    parts = []
    if full:
        parts.append((xf[..., :full].unflatten(-1, (full // group, group)),
                      out[..., :full].unflatten(-1, (full // group, group))))
    if full < k:
        parts.append((xf[..., full:].unsqueeze(-2), out[..., full:].unsqueeze(-2)))
    for src, dst in parts:
        amax = src.abs().amax(-1, keepdim=True).clamp(min=ACT_AMAX_FLOOR)
        s = amax / FP8_MAX
        if scale_fmt == "ue8m0":
            s = torch.exp2(torch.ceil(torch.log2(s)))
        q = (src / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        dst.copy_(q.to(torch.float32) * s)
    return out.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
           dtype: torch.dtype) -> torch.Tensor:
    """``x @ W^T`` for block-FP8 ``W`` [out, in], dequantizing whole block rows at a time so the
    dense copy never exceeds about :data:`LINEAR_CHUNK_ELEMS` elements (one reused buffer)."""
    rows, cols = weight.shape
    bn = block[0]
    step = max(bn, LINEAR_CHUNK_ELEMS // max(cols, 1) // bn * bn)
    if step >= rows:
        return torch.nn.functional.linear(x, dequantize(weight, scale, block, dtype).to(x.dtype))
    y = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    buf = torch.empty(step, cols, dtype=dtype, device=weight.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = dequantize(weight[r0:r1], scale[r0 // bn: math.ceil(r1 / bn)], block, dtype, buf[: r1 - r0])
        y[..., r0:r1] = torch.nn.functional.linear(x, w.to(x.dtype))
    return y


def quantize_e8m0(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [out, in] -> (F8_E4M3 weight, F8_E8M0 scale [ceil(out/bn), ceil(in/bk)]): DeepSeek-V4's
    ``scale_fmt: ue8m0`` blocks, s = 2^ceil(log2(amax / 448)) (1 for an all-zero block), q =
    fp8_e4m3(w / s) rounded to nearest even. Already-quantized values come back unchanged."""
    tiles = _tiles(w, block)
    exp = _pow2_exponent(tiles.abs().amax(dim=(1, 3)), FP8_MAX)
    s = torch.exp2(exp.to(torch.float32))
    return _codes(tiles, s, w.shape), (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu).contiguous()


_E2M1_MAGS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
#: the midpoints between neighbouring E2M1 magnitudes, and those that round up (to the even code)
_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_UP = torch.tensor([0.75, 1.75, 3.5])


def quantize_fp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [out, in] -> (I8 [out, in/2] packed E2M1, F8_E8M0 [out, in/group]): DeepSeek-V4's FP4
    experts, s = 2^ceil(log2(amax / 6)) per row and group, each element the nearest E2M1 value of
    w / s (ties to the even code), element 2j in the low nibble of byte j, bit 3 the sign.
    Already-quantized values come back unchanged."""
    rows, cols = w.shape
    if cols % group:
        raise QuantplugError(f"fp4 quantize: {cols} inputs are not whole groups of {group}")
    g = w.to(torch.float32).view(rows, cols // group, group)
    exp = _pow2_exponent(g.abs().amax(-1), 6.0)
    v = g / torch.exp2(exp.to(torch.float32))[..., None]
    a = v.abs()
    idx = (torch.searchsorted(_E2M1_MIDS, a) + torch.isin(a, _E2M1_UP).long()).clamp_(max=7)
    code = (idx | (((v < 0) & (idx > 0)).long() << 3)).reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed.contiguous(), (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu).contiguous()


def _pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """ceil(log2(amax / qmax)) as int32 (0 for amax 0), clamped to E8M0's finite exponents."""
    ratio = torch.where(amax > 0, amax.double() / qmax, torch.ones_like(amax, dtype=torch.float64))
    return torch.ceil(torch.log2(ratio)).to(torch.int32).clamp(-127, 127)
