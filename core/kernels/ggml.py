"""ggml block formats in torch: dequantize kernels bit-exact with gguf-py's ``gguf.quants``.

Each kernel takes the packed bytes ``[..., row_bytes]`` (uint8, as GGUF stores a tensor: one row
of blocks per output row) and returns float32 ``[..., row_len]``. The arithmetic is gguf-py's,
operation for operation (``d * q``, ``d * q + m``, ``dl * q - ml``, all in float32, no fused
multiply-add), so results are equal bit for bit; ``tests/expert_pack/test_ggml.py`` checks every
type on random valid blocks against ``gguf.quants.dequantize``.

Block layouts (ggml-org/llama.cpp ``ggml/src/ggml-common.h``), QK_K = 256:

=======  =====  =====  ==================================================================
type     elems  bytes  layout
=======  =====  =====  ==================================================================
Q4_0      32     18    d f16, qs[16]: x_j = d*(lo_j - 8), x_{j+16} = d*(hi_j - 8)
Q4_1      32     20    d f16, m f16, qs[16]: x = d*q + m
Q5_0      32     22    d f16, qh u32 (bit j = 5th bit of x_j), qs[16]: x = d*(q - 16)
Q5_1      32     24    d f16, m f16, qh u32, qs[16]: x = d*q + m
Q8_0      32     34    d f16, qs int8[32]: x = d*q
Q2_K     256     84    scales[16] (lo 4 bits scale, hi 4 bits min), qs[64], d, dmin f16
Q3_K     256    110    hmask[32], qs[64], scales[12] (6-bit, signed -32), d f16
Q4_K     256    144    d, dmin f16, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128]
Q5_K     256    176    d, dmin f16, scales[12], qh[32], qs[128]
Q6_K     256    210    ql[128], qh[64], scales int8[16], d f16
MXFP4     32     17    e8m0 exponent, qs[16]: x = 2^(e-128) * kvalues[nibble], j / j+16 split
=======  =====  =====  ==================================================================

The IQ and ternary types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS,
TQ1_0, TQ2_0) come from ``quantplug.kernels.ggml_iq``, same kernel signature, same bit-exactness.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from ..checkpoint.gguf_index import ggml_types
from ..errors import QuantplugError
from . import native
from .forms import FORMS, Form
from .ggml_iq import IQ_KERNELS

QK_K = 256
#: the block types these kernels implement
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4",
                *IQ_KERNELS)
#: name -> (elements per block, bytes per block), from the one table of ggml types (gguf-py's
#: GGML_QUANT_SIZES, through quantplug.api.ggml_types)
BLOCKS: dict[str, tuple[int, int]] = {name: (block, size) for name, block, size in ggml_types().values()
                                      if name in KERNEL_TYPES}
assert set(BLOCKS) == set(KERNEL_TYPES), f"gguf-py lacks ggml types {set(KERNEL_TYPES) - set(BLOCKS)}"
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED = FLOAT_TYPES + tuple(BLOCKS)

_LOHI = torch.tensor([0, 4], dtype=torch.uint8)
_SHIFT2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
_BITS8 = torch.arange(8, dtype=torch.uint8)
_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


class _Scratch:
    """Reusable work buffers for one :func:`dequantize` call.

    Every intermediate goes through ``out=`` into a buffer allocated once per call and reused for
    every chunk: multi-megabyte temporaries would otherwise be fresh ``mmap`` allocations per chunk
    whose page faults cost more than the arithmetic.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            # a normal tensor even when first needed inside inference_mode: an inference tensor
            # could not be written later outside it (a load's dequantization after a forward)
            with torch.inference_mode(False):
                buf = self._bufs[key] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)


_LOCAL = threading.local()


def _scratch(name: str) -> _Scratch:
    """This thread's persistent scratch ``name`` (``"kernel"``: the kernels' temporaries, bounded
    by ``chunk_blocks``; ``"weights"``: :func:`linear`'s dequantized chunk). Reused across calls,
    so a forward pass allocates no fresh multi-MB temporaries; one set per thread, so concurrent
    forwards in different threads never share a buffer."""
    pool = getattr(_LOCAL, "pool", None)
    if pool is None:
        pool = _LOCAL.pool = {}
    ws = pool.get(name)
    if ws is None:
        ws = pool[name] = _Scratch()
    return ws


def _f16(b: torch.Tensor, off: int, ws: _Scratch, key: str) -> torch.Tensor:
    """The little-endian f16 at byte ``off`` of each block [nb, size] -> float32 [nb, 1].

    Read in one strided pass through a float16 view of the blocks when the layout allows it (even
    block size, offset and storage offset: every ggml type with an f16 scale), else through a
    contiguous copy of the two bytes."""
    out = ws.get(key, (b.shape[0], 1), torch.float32)
    if b.shape[1] % 2 == 0 and off % 2 == 0 and b.storage_offset() % 2 == 0 and b.stride(0) % 2 == 0:
        out.copy_(b.view(torch.float16)[:, off // 2:off // 2 + 1])
        return out
    raw = ws.get(key + "_raw", (b.shape[0], 2), torch.uint8)
    raw.copy_(b[:, off:off + 2])
    out.copy_(raw.view(torch.float16))
    return out


def _scaled(d: torch.Tensor, q: torch.Tensor, ws: _Scratch, key: str) -> torch.Tensor:
    """float32 ``d * float(q)`` for small per-block scale arrays (into scratch)."""
    qf = ws.get(key + "_q", tuple(q.shape), torch.float32)
    qf.copy_(q)
    return qf.mul_(d)


def _nibbles(qs: torch.Tensor, groups: int, ws: _Scratch, key: str = "nib") -> torch.Tensor:
    """qs [nb, groups*w] -> [nb, groups, 2, w] uint8: low nibbles of each group, then high nibbles."""
    nb, w = qs.shape[0], qs.shape[1] // groups
    out = ws.get(key, (nb, groups, 2, w), torch.uint8)
    src = qs.reshape(nb, groups, w)
    # two scalar ops (vectorized) rather than one broadcast shift by [0, 4] (an order slower)
    torch.bitwise_and(src, 0x0F, out=out[:, :, 0])
    torch.bitwise_right_shift(src, 4, out=out[:, :, 1])
    return out


def _mul_sub(o: torch.Tensor, q: torch.Tensor, dl: torch.Tensor, ml: torch.Tensor, ws: _Scratch) -> None:
    """o = dl * float(q) - ml in two passes over the output: q converted into scratch, then one
    ``addcmul(-ml, q, dl)``, which rounds the product and the sum separately (no fused multiply-
    add), so the result is bit-identical to gguf-py's ``dl * q - ml``."""
    qf = ws.get("qf", tuple(o.shape), torch.float32)
    qf.copy_(q)
    neg = ws.get("neg_ml", tuple(ml.shape), torch.float32)
    torch.neg(ml, out=neg)
    torch.addcmul(neg, qf, dl, out=o)


def _nibble_planes(b: torch.Tensor, ws: _Scratch, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high nibbles of every byte of the blocks [nb, size], as int8 [nb, size] each (minus
    ``offset``). Computed over the whole contiguous chunk (scale bytes included, ignored later):
    contiguous scalar ops are an order faster than the same ops on the 16-byte strided quants."""
    b = b.contiguous()
    flat = b.view(-1)
    lo = ws.get("plane_lo", tuple(flat.shape), torch.uint8)
    hi = ws.get("plane_hi", tuple(flat.shape), torch.uint8)
    torch.bitwise_and(flat, 0x0F, out=lo)
    torch.bitwise_right_shift(flat, 4, out=hi)
    lo_i, hi_i = lo.view(torch.int8), hi.view(torch.int8)
    if offset:
        lo_i.sub_(offset)
        hi_i.sub_(offset)
    return lo_i.view(b.shape), hi_i.view(b.shape)


def _q4_0(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    d = _f16(b, 0, ws, "d")
    lo, hi = _nibble_planes(b, ws, 8)
    # codes in element order as int8 first, then one contiguous cast and one multiply (the cast is
    # exact, so float(q) * d rounds once): 12% faster than two strided int8 * d multiplies
    # (a fresh stack measured faster than ``stack(out=)`` into scratch: 155 vs 161 us per 8192 blocks)
    o.copy_(torch.stack((lo[:, 2:], hi[:, 2:]), 1).view(o.shape))
    o.mul_(d)


def _q4_1(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    d, m = _f16(b, 0, ws, "d"), _f16(b, 2, ws, "m")
    lo, hi = _nibble_planes(b, ws)
    ov = o.view(-1, 2, 16)
    torch.mul(lo[:, 4:], d, out=ov[:, 0])
    torch.mul(hi[:, 4:], d, out=ov[:, 1])
    ov.add_(m.view(-1, 1, 1))


def _qh_bits(qh: torch.Tensor, ws: _Scratch) -> torch.Tensor:
    """[nb, 4] little-endian u32 -> [nb, 32] uint8 bits (bit j of the word at position j)."""
    nb = qh.shape[0]
    out = ws.get("qh", (nb, 4, 8), torch.uint8)
    torch.bitwise_right_shift(qh.reshape(nb, 4, 1), _BITS8.view(1, 1, 8), out=out)
    return out.bitwise_and_(1).view(nb, 32)


def _q5_0(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    d = _f16(b, 0, ws, "d")
    ql = _nibbles(b[:, 6:], 1, ws).view(-1, 32)
    ql.bitwise_or_(_qh_bits(b[:, 2:6], ws).bitwise_left_shift_(4))
    o.copy_(ql.view(torch.int8).sub_(16))
    o.mul_(d)


def _q5_1(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    d, m = _f16(b, 0, ws, "d"), _f16(b, 2, ws, "m")
    ql = _nibbles(b[:, 8:], 1, ws).view(-1, 32)
    ql.bitwise_or_(_qh_bits(b[:, 4:8], ws).bitwise_left_shift_(4))
    o.copy_(ql)
    o.mul_(d).add_(m)


def _q8_0(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    d = _f16(b, 0, ws, "d")
    o.copy_(b[:, 2:].view(torch.int8))
    o.mul_(d)


def _q2_k(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    nb = b.shape[0]
    scales = b[:, :16]
    d, dmin = _f16(b, 80, ws, "d"), _f16(b, 82, ws, "dmin")
    lo = ws.get("sc_lo", (nb, 16), torch.uint8)
    hi = ws.get("sc_hi", (nb, 16), torch.uint8)
    torch.bitwise_and(scales, 0x0F, out=lo)
    torch.bitwise_right_shift(scales, 4, out=hi)
    dl = _scaled(d, lo, ws, "dl").view(nb, 16, 1)
    ml = _scaled(dmin, hi, ws, "ml").view(nb, 16, 1)
    q = ws.get("q", (nb, 2, 4, 32), torch.uint8)
    torch.bitwise_right_shift(b[:, 16:80].reshape(nb, 2, 1, 32), _SHIFT2.view(1, 1, 4, 1), out=q)
    q.bitwise_and_(3)
    _mul_sub(o.view(nb, 16, 16), q.view(nb, 16, 16), dl, ml, ws)


def _q3_k(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    nb = b.shape[0]
    hmask, qs, sc = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108, ws, "d")
    lsc = ws.get("lsc", (nb, 2, 8), torch.uint8)
    torch.bitwise_right_shift(sc[:, :8].reshape(nb, 1, 8), _LOHI.view(1, 2, 1), out=lsc)
    hsc = ws.get("hsc", (nb, 4, 4), torch.uint8)
    torch.bitwise_right_shift(sc[:, 8:].reshape(nb, 1, 4), _SHIFT2.view(1, 4, 1), out=hsc)
    scales = lsc.view(nb, 16).bitwise_and_(0x0F).bitwise_or_(hsc.view(nb, 16).bitwise_and_(0x03).bitwise_left_shift_(4))
    dl = _scaled(d, scales.view(torch.int8).sub_(32), ws, "dl").view(nb, 16, 1)
    ql = ws.get("q", (nb, 2, 4, 32), torch.uint8)
    torch.bitwise_right_shift(qs.reshape(nb, 2, 1, 32), _SHIFT2.view(1, 1, 4, 1), out=ql)
    ql.bitwise_and_(3)
    qh = ws.get("qh", (nb, 1, 8, 32), torch.uint8)
    torch.bitwise_right_shift(hmask.reshape(nb, 1, 1, 32), _BITS8.view(1, 1, 8, 1), out=qh)
    qh.bitwise_and_(1).bitwise_xor_(1).bitwise_left_shift_(2)  # offset 4 when the mask bit is 0
    q = ql.view(torch.int8).view(nb, 16, 16).sub_(qh.view(torch.int8).view(nb, 16, 16))
    ov = o.view(nb, 16, 16)
    ov.copy_(q)
    ov.mul_(dl)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (gguf-py's get_scale_min)."""
    nb = scales.shape[0]
    s = scales.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k4_scales(b: torch.Tensor, ws: _Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    nb = b.shape[0]
    d, dmin = _f16(b, 0, ws, "d"), _f16(b, 2, ws, "dmin")
    sc, mn = _scale_min_k4(b[:, 4:16])
    return _scaled(d, sc, ws, "dl").view(nb, 8, 1), _scaled(dmin, mn, ws, "ml").view(nb, 8, 1)


def _q4_k(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    nb = b.shape[0]
    dl, ml = _k4_scales(b, ws)
    _mul_sub(o.view(nb, 8, 32), _nibbles(b[:, 16:], 4, ws).view(nb, 8, 32), dl, ml, ws)


def _q5_k(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    nb = b.shape[0]
    dl, ml = _k4_scales(b, ws)
    ql = _nibbles(b[:, 48:176], 4, ws).view(nb, 8, 32)
    hi = ws.get("hi", (nb, 1, 8, 32), torch.uint8)
    torch.bitwise_right_shift(b[:, 16:48].reshape(nb, 1, 1, 32), _BITS8.view(1, 1, 8, 1), out=hi)
    ql.bitwise_or_(hi.bitwise_and_(1).bitwise_left_shift_(4).view(nb, 8, 32))
    _mul_sub(o.view(nb, 8, 32), ql, dl, ml, ws)


def _q6_k(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    nb = b.shape[0]
    d = _f16(b, 208, ws, "d")
    dl = _scaled(d, b[:, 192:208].view(torch.int8), ws, "dl").view(nb, 16, 1)
    lo = ws.get("lo", (nb, 2, 2, 64), torch.uint8)
    torch.bitwise_right_shift(b[:, :128].reshape(nb, 2, 1, 64), _LOHI.view(1, 1, 2, 1), out=lo)
    lo.bitwise_and_(0x0F)
    hi = ws.get("hi", (nb, 2, 4, 32), torch.uint8)
    torch.bitwise_right_shift(b[:, 128:192].reshape(nb, 2, 1, 32), _SHIFT2.view(1, 1, 4, 1), out=hi)
    hi.bitwise_and_(0x03).bitwise_left_shift_(4)
    q = lo.view(nb, 8, 32).bitwise_or_(hi.view(nb, 8, 32)).view(torch.int8).sub_(32)
    ov = o.view(nb, 16, 16)
    ov.copy_(q.view(nb, 16, 16))
    ov.mul_(dl)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2^(e-128) as float32 (denormal for e < 2), from the bit pattern."""
    x = e.to(torch.int32)
    bits = torch.where(x < 2, torch.tensor(0x00200000, dtype=torch.int32) << x, (x - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor, o: torch.Tensor, ws: _Scratch) -> None:
    d = e8m0_to_fp32_half(b[:, :1])
    idx = _nibbles(b[:, 1:], 1, ws).view(-1, 32)
    torch.index_select(_MXFP4_VALUES, 0, idx.reshape(-1).to(torch.int32), out=o.view(-1))
    o.mul_(d)


KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor, _Scratch], None]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k,
    "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4, **IQ_KERNELS,
}


def dequantize(data: torch.Tensor, ggml_type: str, *, chunk_blocks: int = 1 << 13,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed ``[..., row_bytes]`` uint8 -> float32 ``[..., row_len]`` (float types: a float32 copy).

    ``out``: a contiguous float32 tensor with the result's number of elements to write into (a
    reused buffer avoids the page faults of a fresh multi-MB allocation)."""
    if ggml_type in FLOAT_TYPES:  # data already viewed in its float dtype
        return data.to(torch.float32)
    if ggml_type not in KERNELS:
        raise QuantplugError(f"ggml type {ggml_type} has no dequantize kernel; supported: {', '.join(SUPPORTED)}")
    if data.dtype != torch.uint8:
        raise QuantplugError(f"{ggml_type} data must be uint8 block bytes, got {data.dtype}")
    block, size = BLOCKS[ggml_type]
    if data.shape[-1] % size:
        raise QuantplugError(f"{ggml_type}: {data.shape[-1]} bytes per row is not a multiple of {size}-byte blocks")
    lead = data.shape[:-1]
    blocks = data.reshape(-1, size)
    if out is None:
        out = torch.empty(blocks.shape[0], block, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.numel() != blocks.shape[0] * block or not out.is_contiguous():
        raise QuantplugError(f"dequantize(out=...): need a contiguous float32 tensor of {blocks.shape[0] * block} "
                             f"elements, got {out.dtype} {list(out.shape)}")
    out = out.view(blocks.shape[0], block)
    if ggml_type in NATIVE_TYPES and blocks.is_contiguous() and native.library() is not None:
        mat = _mat(blocks, ggml_type, blocks.shape[0], block)
        native.dequant(mat, 0, blocks.shape[0], out.view(blocks.shape[0], block))
        return out.view(*lead, data.shape[-1] // size * block)
    kernel = KERNELS[ggml_type]
    ws = _scratch("kernel")
    for s in range(0, blocks.shape[0], chunk_blocks):  # bounded, reused temporaries
        kernel(blocks[s:s + chunk_blocks], out[s:s + chunk_blocks], ws)
    return out.view(*lead, data.shape[-1] // size * block)


#: elements of dense weight materialized at once by :func:`linear` (1 MiB of float32: the chunk
#: stays in the L2 cache between its dequantization and its matmul)
LINEAR_CHUNK_ELEMS = 1 << 18


def dequantize_reused(data: torch.Tensor, ggml_type: str, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(data).to(dtype)`` into this thread's reused weight buffer: valid until the next
    call of this function or :func:`linear` in this thread (use it at once, never keep it)."""
    block, size = BLOCKS[ggml_type]
    n = data.numel() // size * block
    w = dequantize(data, ggml_type, out=_scratch("weights").get("w", (n,), torch.float32))
    return w if dtype == torch.float32 else w.to(dtype)


def linear(x: torch.Tensor, data: torch.Tensor, ggml_type: str, dtype: torch.dtype) -> torch.Tensor:
    """``x @ W^T`` for packed ``W`` [out, row_bytes]: exact (``W`` dequantized bit-exactly, rounded to
    the model ``dtype``, then a float matmul), a block of rows at a time into this thread's reused
    buffer, so the dense copy never exceeds :data:`LINEAR_CHUNK_ELEMS` elements and no call
    allocates a fresh weight-sized tensor. Up to :data:`NATIVE_EXACT_ROWS` float32 rows of a
    native type go through the native exact kernel instead (the same weights, float32 sums)."""
    if ggml_type in FLOAT_TYPES:
        return torch.nn.functional.linear(x, data.to(x.dtype))
    block, size = BLOCKS[ggml_type]
    if (dtype == torch.float32 and x.dtype == torch.float32 and x.numel() <= NATIVE_EXACT_ROWS * x.shape[-1]
            and ggml_type in NATIVE_TYPES and data.is_contiguous() and data.device.type == "cpu"
            and native.library() is not None):  # few rows: blocks decoded in registers
        k = data.shape[-1] // size * block
        y = native.gemm(native._as_f32_rows(x, k), [_mat(data, ggml_type, data.shape[0], k)])
        return y.view(*x.shape[:-1], data.shape[0])
    rows, k = data.shape[0], data.shape[-1] // size * block
    step = min(rows, max(1, LINEAR_CHUNK_ELEMS // max(k, 1)))
    wbuf = _scratch("weights").get("w", (step, k), torch.float32)

    def chunk(r: int, n: int) -> torch.Tensor:
        w = dequantize(data[r:r + n], ggml_type, out=wbuf[:n])
        return w if dtype == torch.float32 and x.dtype == torch.float32 else w.to(dtype).to(x.dtype)

    if step >= rows:
        return torch.nn.functional.linear(x, chunk(0, rows))
    x2 = x.reshape(-1, k)
    out_t = torch.empty(rows, x2.shape[0], dtype=x.dtype, device=x.device)  # rows of W^T x^T: contiguous slices
    for r in range(0, rows, step):
        n = min(step, rows - r)
        torch.mm(chunk(r, n), x2.t(), out=out_t[r:r + n])
    return out_t.t().reshape(*x.shape[:-1], rows)


# --- fast kernels (load option ``kernels="fast"``) ---------------------------------------------
#
# torch's CPU weight-only int4 kernel (``aten._weight_int4pack_mm_for_cpu``, the one gpt-fast and
# torchao use) computes ``x @ W^T`` with ``W = (q - 8) * scale + zero`` per group of 32 inputs, q a
# 4-bit code, from a layout made once by ``aten._convert_weight_to_int4pack_for_cpu``. Its fast
# path takes bfloat16 activations and scales (its float32 path is a slow reference loop), so
# "fast" rounds activations, group scales / zeros and the output to bfloat16; the int4 codes are
# kept exactly. ggml types whose blocks are 4-bit affine in groups of 32 map onto it directly:
#
# * Q4_0: scale d, zero 0 (w = d * (q - 8));  Q4_1: scale d, zero m + 8d (w = d * q + m);
# * Q4_K: per sub-block of 32, scale dl = d * sc, zero 8 dl - ml (w = dl * q - ml);
# * Q8_0: q8 = 16 * hi + lo (hi = q8 >> 4 in -8..7, lo = q8 & 15): two int4 halves side by side,
#   hi with scale 16d, lo with scale d and zero 8d, against x repeated twice (K' = 2K).
#
# The kernel needs the output rows in multiples of 16; other shapes and types stay exact.

#: ggml types with a fast (int4-pack) kernel
FAST_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
INT4_GROUP = 32


def _int4_parts(data: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows [N, row_bytes] -> (codes int32 [N, K'] in 0..15, scale [N, K'/32], zero [N, K'/32])
    float32, with ``(codes - 8) * scale + zero`` = the dequantized weight (K' = 2K for Q8_0)."""
    n, size = data.shape[0], BLOCKS[ggml_type][1]
    b = data.reshape(-1, size)
    ws = _Scratch()
    if ggml_type in ("Q4_0", "Q4_1"):
        d = _f16(b, 0, ws, "d").clone()
        codes = _nibbles(b[:, 2 if ggml_type == "Q4_0" else 4:], 1, ws).reshape(n, -1).to(torch.int32)
        zero = torch.zeros_like(d) if ggml_type == "Q4_0" else _f16(b, 2, ws, "m") + 8 * d
        return codes, d.view(n, -1), zero.view(n, -1)
    if ggml_type == "Q4_K":
        dl, ml = _k4_scales(b, ws)
        codes = _nibbles(b[:, 16:], 4, ws).reshape(n, -1).to(torch.int32)
        return codes, dl.reshape(n, -1).clone(), (8 * dl - ml).reshape(n, -1)
    if ggml_type == "Q8_0":
        d = _f16(b, 0, ws, "d").clone().view(n, -1)
        q = b[:, 2:].view(torch.int8).reshape(n, -1).to(torch.int32)
        codes = torch.cat([(q >> 4) + 8, q & 15], dim=-1)
        return codes, torch.cat([16 * d, d], dim=-1), torch.cat([torch.zeros_like(d), 8 * d], dim=-1)
    raise QuantplugError(f"ggml type {ggml_type} has no fast kernel; fast types: {', '.join(FAST_TYPES)}")


def int4_repack(data: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fast kernel's form of packed rows ``[..., N, row_bytes]`` (stacked: one per leading
    index): (int4 pack uint8 [..., N, K'/2], scales and zeros bfloat16 [..., K'/32, N, 2]); None
    when the type has no fast kernel or N is not a multiple of 16."""
    if ggml_type not in FAST_TYPES or data.shape[-2] % 16:
        return None
    lead = data.shape[:-2]
    flat = data.reshape(-1, *data.shape[-2:])
    packs, szs = [], []
    for m in flat:
        codes, scale, zero = _int4_parts(m, ggml_type)
        packs.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1))
        szs.append(torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous())
    pack, sz = torch.stack(packs), torch.stack(szs)
    return pack.view(*lead, *pack.shape[1:]), sz.view(*lead, *sz.shape[1:])


def int4_input(x: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """The kernel's activations for ``x`` [..., K]: contiguous bfloat16 [rows, K] ([rows, 2K] for Q8_0)."""
    xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if ggml_type == "Q8_0":
        return torch.cat([xb, xb], dim=-1)
    return xb.contiguous()


def int4_linear(x: torch.Tensor, pack: torch.Tensor, sz: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """``x @ W^T`` through the int4-pack kernel (bfloat16 activations; see the section comment)."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(int4_input(x, ggml_type), pack, INT4_GROUP, sz)
    return y.to(x.dtype).view(*x.shape[:-1], pack.shape[0])


def int4_grouped(x: torch.Tensor, slots: Sequence[tuple[torch.Tensor, torch.Tensor]], ggml_type: str,
                 groups: list[tuple[int, int]]) -> torch.Tensor:
    """Stacked experts: ``x`` [rows, K] in consecutive groups ``(slot, n)``, each through its slot's
    kernel weight ``slots[slot]`` = (pack, scales-and-zeros), views made once at load (no per-call
    indexing op); activations converted once for all groups, the outputs gathered with one cat."""
    xb = int4_input(x, ggml_type)
    outs, start = [], 0
    for slot, n in groups:
        pack, sz = slots[slot]
        outs.append(torch.ops.aten._weight_int4pack_mm_for_cpu(xb[start:start + n], pack, INT4_GROUP, sz))
        start += n
    return torch.cat(outs).to(x.dtype)


class Int4Fused:
    """Sibling projections of one input through one int4 kernel weight: ``pack`` [.., sum N, K/2]
    and ``sz`` [.., K'/32, sum N, 2] (stacked: one per expert). ``f(x)`` / ``f(x, groups)``
    return the projections' outputs side by side (see ``LinearScheme.fuse``)."""

    def __init__(self, pack: torch.Tensor, sz: torch.Tensor, ggml_type: str) -> None:
        self.pack, self.sz, self.ggml_type = pack, sz, ggml_type
        self.slots = list(zip(pack.unbind(0), sz.unbind(0))) if pack.dim() == 3 else None

    def __call__(self, x: torch.Tensor, groups: list[tuple[int, int]] | None = None) -> torch.Tensor:
        if groups is None:
            return int4_linear(x, self.pack, self.sz, self.ggml_type)
        assert self.slots is not None
        return int4_grouped(x, self.slots, self.ggml_type, groups)


# --- native kernels (``native.py`` / ``qp_kernels.c``) -------------------------------------------
#
# Packed ggml tensors that are not bound to a layer (an expert pack's cached payloads, one-off
# dequantizations) reach the native kernels through a transient matrix built here.

#: ggml types the native kernels decode
NATIVE_TYPES = frozenset(t for t in KERNEL_TYPES if t in FORMS)
#: most input rows the native exact kernel takes for a transient matrix in :func:`linear`
NATIVE_EXACT_ROWS = 16


def _mat(data: torch.Tensor, ggml_type: str, n: int, k: int) -> object:
    """A transient native matrix over contiguous packed rows ``data`` (the caller keeps it alive)."""
    if data.dtype != torch.uint8 or not data.is_contiguous() or data.device.type != "cpu":
        raise QuantplugError(f"{ggml_type}: native kernels read contiguous uint8 blocks on the CPU")
    m = native.Mat()
    m.type, m.n, m.k = FORMS[ggml_type][0], n, k
    m.w, m.ldw = data.data_ptr(), Form(ggml_type).row_bytes(k)
    lib = native.library()
    import ctypes

    if lib is None or lib.qp_check(ctypes.byref(m)) != 0:
        raise QuantplugError(f"{ggml_type}: {n} rows of {k} values are not a native matrix")
    return ctypes.pointer(m)
