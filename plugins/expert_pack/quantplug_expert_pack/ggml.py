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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from quantplug.errors import QuantplugError

QK_K = 256
#: name -> (elements per block, bytes per block); the same numbers as gguf's GGML_QUANT_SIZES
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "MXFP4": (32, 17),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED = FLOAT_TYPES + tuple(BLOCKS)

_LOHI = torch.tensor([0, 4], dtype=torch.uint8)
_SHIFT2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
_BITS8 = torch.arange(8, dtype=torch.uint8)
_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per block [nb, 2] -> float32 [nb, 1] (little-endian f16)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """qs [nb, groups*w] -> [nb, groups, 2, w]: low nibbles of each group, then high nibbles."""
    nb = qs.shape[0]
    q = qs.reshape(nb, groups, 1, -1)
    return (q >> _LOHI.view(1, 1, 2, 1)) & 0x0F


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d = _f16(b[:, :2]).view(nb, 1, 1)
    q = (_nibbles(b[:, 2:], 1).view(torch.int8) - 8).to(torch.float32).view(nb, 2, 16)
    return (d * q).view(nb, 32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 1).reshape(nb, 32).to(torch.float32)
    return d * q + m


def _qh_bits(qh: torch.Tensor) -> torch.Tensor:
    """[nb, 4] little-endian u32 -> [nb, 32] bits (bit j of the word at position j)."""
    nb = qh.shape[0]
    return ((qh.reshape(nb, 4, 1) >> _BITS8.view(1, 1, 8)) & 1).reshape(nb, 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d = _f16(b[:, :2])
    ql = _nibbles(b[:, 6:], 1).reshape(nb, 32)
    q = (ql | (_qh_bits(b[:, 2:6]) << 4)).view(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    ql = _nibbles(b[:, 8:], 1).reshape(nb, 32)
    q = (ql | (_qh_bits(b[:, 4:8]) << 4)).to(torch.float32)
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return b[:, 2:].view(torch.int8).to(torch.float32) * d


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).view(nb, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).view(nb, 16, 1)
    q = ((qs.reshape(nb, 2, 1, 32) >> _SHIFT2.view(1, 1, 4, 1)) & 3).reshape(nb, 16, 16).to(torch.float32)
    return (dl * q - ml).view(nb, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    hmask, qs, sc, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    lsc = (sc[:, :8].reshape(nb, 1, 8) >> _LOHI.view(1, 2, 1)).reshape(nb, 16)
    hsc = (sc[:, 8:].reshape(nb, 1, 4) >> _SHIFT2.view(1, 4, 1)).reshape(nb, 16)
    scales = ((lsc & 0x0F) | ((hsc & 0x03) << 4)).view(torch.int8) - 32
    dl = (d * scales.to(torch.float32)).view(nb, 16, 1)
    ql = ((qs.reshape(nb, 2, 1, 32) >> _SHIFT2.view(1, 1, 4, 1)).reshape(nb, 16, 16)) & 3
    qh = ((hmask.reshape(nb, 1, 1, 32) >> _BITS8.view(1, 1, 8, 1)).reshape(nb, 16, 16) & 1) ^ 1
    q = (ql.view(torch.int8) - (qh << 2).view(torch.int8)).to(torch.float32)
    return (dl * q).view(nb, QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (gguf-py's get_scale_min)."""
    nb = scales.shape[0]
    s = scales.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).view(nb, 8, 1)
    ml = (dmin * mn.to(torch.float32)).view(nb, 8, 1)
    q = _nibbles(b[:, 16:], 4).reshape(nb, 8, 32).to(torch.float32)
    return (dl * q - ml).view(nb, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).view(nb, 8, 1)
    ml = (dmin * mn.to(torch.float32)).view(nb, 8, 1)
    qh, qs = b[:, 16:48], b[:, 48:176]
    ql = _nibbles(qs, 4).reshape(nb, 8, 32)
    hi = ((qh.reshape(nb, 1, 1, 32) >> _BITS8.view(1, 1, 8, 1)) & 1).reshape(nb, 8, 32)
    q = (ql | (hi << 4)).to(torch.float32)
    return (dl * q - ml).view(nb, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    dl = (d * sc.view(torch.int8).to(torch.float32)).view(nb, 16, 1)
    lo = ((ql.reshape(nb, 2, 1, 64) >> _LOHI.view(1, 1, 2, 1)) & 0x0F).reshape(nb, 8, 32)
    hi = ((qh.reshape(nb, 2, 1, 32) >> _SHIFT2.view(1, 1, 4, 1)) & 0x03).reshape(nb, 8, 32)
    q = ((lo | (hi << 4)).view(torch.int8) - 32).reshape(nb, 16, 16).to(torch.float32)
    return (dl * q).view(nb, QK_K)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2^(e-128) as float32 (denormal for e < 2), from the bit pattern."""
    x = e.to(torch.int32)
    bits = torch.where(x < 2, torch.tensor(0x00200000, dtype=torch.int32) << x, (x - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d = e8m0_to_fp32_half(b[:, :1])
    idx = _nibbles(b[:, 1:], 1).reshape(nb, 32).to(torch.int64)
    return d * _MXFP4_VALUES[idx]


KERNELS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k,
    "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4,
}


def row_bytes(ggml_type: str, row_len: int) -> int:
    block, size = BLOCKS[ggml_type]
    if row_len % block:
        raise QuantplugError(f"{ggml_type}: row length {row_len} is not a multiple of the block size {block}")
    return row_len // block * size


def dequantize(data: torch.Tensor, ggml_type: str, *, chunk_blocks: int = 1 << 16) -> torch.Tensor:
    """Packed ``[..., row_bytes]`` uint8 -> float32 ``[..., row_len]`` (float types: a float32 copy)."""
    if ggml_type in FLOAT_TYPES:
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
    out = torch.empty(blocks.shape[0], block, dtype=torch.float32)
    kernel = KERNELS[ggml_type]
    for s in range(0, blocks.shape[0], chunk_blocks):  # bounded temporaries, cache-friendly
        out[s:s + chunk_blocks] = kernel(blocks[s:s + chunk_blocks])
    return out.view(*lead, data.shape[-1] // size * block)
