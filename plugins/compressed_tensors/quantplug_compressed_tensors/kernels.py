"""Pure-torch compressed-tensors kernels: weight dequantization and activation quantization.

Weights (compressed-tensors 0.19 / 0.20, ``compressors/pack_quantized``, ``naive_quantized``):

* pack-quantized: ``weight_packed`` int32 [out, ceil(in*bits/32)]; element c of a row sits at
  bit c*bits of the row's little-endian bit stream, stored unsigned as q + 2**(bits-1) (read
  the words as bytes: for 4 bits, byte c//2, low nibble first). Zero points (asymmetric) are
  packed the same way along the *output* dim: [ceil(out*bits/32), groups].
* naive / int / float-quantized: ``weight`` int8 or F8_E4M3 in its own shape.
* w = (q - zero_point) * scale, with ``scale`` per tensor [1], per channel [out, 1], per group
  [out, in/group] or per block [ceil(out/bh), ceil(in/bw)] (edge blocks partial).

Products are taken in float32 (exact: q has at most 8 significant bits, the scale at most 24
and one rounding to the model dtype follows), so a bfloat16 result equals compressed-tensors'
own decompressor, which multiplies in the scale's dtype, and a float32 result is the exact
q * scale the vendor fixtures' reference logits use.

Work is chunked: a dequantization fills its output :data:`CHUNK` elements at a time with a few
whole-chunk ops (no per-element Python, no gather), and :func:`linear` dequantizes at most
:data:`LINEAR_CHUNK` weight elements at once, so a forward never holds a whole dense copy of a
large weight.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: output elements produced per dequantization step (int4: words, 8 values each). Each op of a
#: step runs as one ATen parallel region over torch's threads; 2**20 keeps the steps' temporaries
#: at a few MiB and the regions few (bench/bench_ct.py's 64 MiB, 2 idle cores, wall: int4 -> bf16
#: 0.126 s at 2**20 and 2**18, 0.259 s at 2**15, where every op ran in the calling thread, 0.29 s
#: at 2**22; fp8 -> f32 0.072 / 0.103 / 0.218 / 0.092 s). On an oversubscribed machine every
#: region can wait a scheduler slice for its second thread: run with one torch thread there
CHUNK = 1 << 20
#: dense weight elements materialized at once by :func:`linear` (1 MiB of float32)
LINEAR_CHUNK = 1 << 18
FP8_MAX = 448.0


@dataclass(frozen=True)
class Layout:
    """How one weight is stored: what :func:`dequantize` needs besides the tensors."""

    kind: str  # "packed" (int32 words) | "int8" | "fp8" ("fp8-nan": fp8 holding NaN codes)
    bits: int
    strategy: str  # tensor | channel | group | block
    group: int | None  # group size (group strategy)
    block: tuple[int, int] | None  # (rows, cols) (block strategy)
    out_features: int
    in_features: int

    def scale_shape(self) -> tuple[int, ...]:
        o, i = self.out_features, self.in_features
        if self.strategy == "tensor":
            return (1,)
        if self.strategy == "channel":
            return (o, 1)
        if self.strategy == "group":
            assert self.group
            return (o, -(-i // self.group))
        assert self.block
        return (-(-o // self.block[0]), -(-i // self.block[1]))

    def packed_cols(self) -> int:
        return -(-self.in_features * self.bits // 32)

    def zp_shape(self) -> tuple[int, ...]:
        """Shape of the stored zero point: packed along out for pack-quantized group/channel."""
        s = self.scale_shape()
        if self.kind == "packed" and self.strategy in ("group", "channel"):
            return (-(-self.out_features * self.bits // 32), s[-1])
        return s


def _groups_(o: torch.Tensor, t: torch.Tensor, group: int, op: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
    """``op(o_part, t_part)`` in place with ``t`` [r, G] broadcast over column groups of ``group``
    (the last group may be partial)."""
    r, n = o.shape
    full = n // group
    if t.shape[-1] == 1 or group >= n:
        op(o, t[:, :1])
        return
    if full:
        op(o[:, :full * group].view(r, full, group), t[:, :full].unsqueeze(-1))
    if full * group < n:
        op(o[:, full * group:], t[:, full:full + 1])


def unpack_rows(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 words [r, W] (packed along the last dim) -> int8 values [r, n] (offset removed)."""
    # flattened first: a [G, 1] transpose counts as contiguous with last stride G, which view refuses
    b = words.contiguous().view(-1).view(torch.uint8).view(*words.shape[:-1], words.shape[-1] * 4)
    if bits == 4:
        v = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    elif bits == 8:
        v = b
    else:  # pragma: no cover - the scheme refuses other widths at plan time
        raise ValueError(f"unpack: {bits}-bit packing not supported")
    return (v[..., :n].to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int values [r, n] in [-2**(bits-1), 2**(bits-1)) -> int32 words [r, ceil(n*bits/32)]."""
    per = 32 // bits
    r, n = q.shape
    u = (q.to(torch.int32) + (1 << (bits - 1))).to(torch.int64)
    pad = -n % per
    if pad:
        u = F.pad(u, (0, pad))
    u = u.view(r, -1, per) << (torch.arange(per, dtype=torch.int64) * bits)
    words = u.sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_zero_point(zp: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """Packed zero points [ceil(out*bits/32), G] (packed along out) -> float32 [out, G]."""
    return unpack_rows(zp.t().contiguous(), bits, out_features).t().float()


#: int64 constants of the nibble spreading in :func:`_unpack_int4` (bytes 0x0F.., 0x78.., 0x80..)
_M16, _M8, _M4 = 0x0000FFFF0000FFFF, 0x00FF00FF00FF00FF, 0x0F0F0F0F0F0F0F0F
_SUB8, _SIGN = 0x7878787878787878, 0x8080808080808080 - (1 << 64)


def _unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 words [r, W] -> int8 values [r, 8W]: each word's 8 nibbles spread to the 8 bytes of
    an int64 (bit-interleave by 16, 8, 4), then u - 8 per byte without carries (SWAR:
    (u + 0x78) ^ 0x80 == (u - 8) mod 256 for u < 16). Little-endian byte order = element order."""
    x = words.to(torch.int64).bitwise_and_(0xFFFFFFFF)
    x = x.bitwise_or_(x << 16).bitwise_and_(_M16)
    x = x.bitwise_or_(x << 8).bitwise_and_(_M8)
    x = x.bitwise_or_(x << 4).bitwise_and_(_M4)
    return x.add_(_SUB8).bitwise_xor_(_SIGN).view(torch.int8)


def _fp8_as_f16(q: torch.Tensor) -> torch.Tensor:
    """float8 e4m3fn -> float16 holding value / 256, exactly, by integer ops (torch's own fp8
    conversion is scalar on CPU): e4m3's sign / exponent / mantissa bits shifted into f16's
    fields with no rebias (b << 7 puts the sign at bit 14; y + (y & 0x4000) carries it to bit 15),
    so an e4m3 subnormal becomes an f16 subnormal of the same mantissa. Multiplying by 256 (folded
    into the scale) restores the value. NaN codes (0x7F / 0xFF) are not mapped: callers check."""
    y = q.view(torch.uint8).to(torch.int16).bitwise_left_shift_(7)
    return y.add_(y & 0x4000).view(torch.float16)


def has_nan_codes(q: torch.Tensor) -> bool:
    """Whether float8 e4m3fn ``q`` holds a NaN code (S.1111.111): eight bytes per int64 lane,
    (b & 0x7F) + 1 carries into bit 7 exactly for 0x7F."""
    b = q.contiguous().view(torch.uint8).reshape(-1)
    n8 = b.numel() // 8 * 8
    if b.storage_offset() % 8:  # not 8-byte aligned: byte by byte
        n8 = 0
    if n8:
        w = b[:n8].view(torch.int64)
        if bool(((w & 0x7F7F7F7F7F7F7F7F) + 0x0101010101010101).bitwise_and_(_SIGN).any()):
            return True
    return bool(((b[n8:] & 0x7F) == 0x7F).any())


def _int_values(layout: Layout, q: torch.Tensor) -> torch.Tensor:
    """Stored rows ``q`` -> their integer values as int8 [r, in] (fp8: f16 = value / 256; int8 as stored)."""
    if layout.kind == "fp8":
        return _fp8_as_f16(q)
    if layout.kind != "packed":  # int8, or fp8 with NaN codes: converted by copy_
        return q
    n = layout.in_features
    if layout.bits == 8:
        return (q.view(torch.uint8) ^ 0x80).view(torch.int8)[:, :n]
    if sys.byteorder == "little":
        return _unpack_int4(q)[:, :n]
    return unpack_rows(q, 4, n)  # pragma: no cover - big-endian hosts


def dequantize(layout: Layout, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32, rows: tuple[int, int] | None = None,
               out: torch.Tensor | None = None, nan_codes: bool | None = None) -> torch.Tensor:
    """Dense weight rows ``rows`` (default all) [r, in] in ``dtype``.

    ``q``: the stored weight (int32 words, int8 or float8) of the whole layer; ``scale`` as
    stored; ``zero_point`` already unpacked to float32 [out, G] (:func:`unpack_zero_point`) or
    as stored for naive formats. Works :data:`CHUNK` elements at a time (int4 words: CHUNK words
    at a time), each step a few whole-chunk torch ops (temporaries bounded by the chunk). When the output dtype is the scale's (or float32), values and
    products are formed in the output itself: the product of an integer or fp8 value and a scale
    is exact in float32, so one rounding happens either way. ``nan_codes``: whether an fp8
    weight holds NaN codes (None: look; schemes pass what they found once per layer).
    """
    r0, r1 = rows if rows is not None else (0, layout.out_features)
    n = layout.in_features
    if layout.kind == "fp8" and (nan_codes or (nan_codes is None and has_nan_codes(q[r0:r1]))):
        layout = dataclasses.replace(layout, kind="fp8-nan")  # torch's conversion keeps NaN codes NaN
    if out is None:
        out = torch.empty(r1 - r0, n, dtype=dtype, device=q.device)
    cdt = out.dtype if out.dtype in (torch.float32, scale.dtype) else torch.float32
    if layout.kind == "fp8":
        # float16 values: float16 -> float32 converts vectorized (-> bfloat16 does not: 10x slower),
        # and the scale times 256 (below) stays out of float16's range
        cdt = torch.float32
    step = max(1, CHUNK // max(n, 1))
    tmp = None if cdt == out.dtype else torch.empty(min(step, r1 - r0), n, dtype=cdt, device=q.device)
    s_all = scale.reshape(1, 1) if layout.strategy == "tensor" else scale
    if layout.kind == "fp8":  # the values come as value / 256 (exact); 256 * scale is exact too
        s_all = s_all.to(cdt) * 256
    # int4: the integer stage works on int64 words, 8 values each: CHUNK words per step
    vstep = 8 * step if layout.kind == "packed" and layout.bits == 4 else step
    values = q[:0]
    v0 = r0
    for a in range(r0, r1, step):
        b = min(a + step, r1)
        if a >= v0 + values.shape[0]:
            v0 = a
            values = _int_values(layout, q[a:min(a + vstep, r1)])
        o = out[a - r0:b - r0] if tmp is None else tmp[:b - a]
        o.copy_(values[a - v0:b - v0])
        if layout.strategy == "block":
            assert layout.block
            bh, bw = layout.block
            first = a // bh
            s = s_all[first:-(-b // bh)].to(cdt).repeat_interleave(bh, dim=0)[a - first * bh:b - first * bh]
            group = bw
        else:
            s = s_all.to(cdt).expand(b - a, 1) if layout.strategy == "tensor" else s_all[a:b].to(cdt)
            group = layout.group if layout.strategy == "group" and layout.group else n
            if zero_point is not None:
                z = zero_point.reshape(1, 1) if layout.strategy == "tensor" else zero_point[a:b]
                _groups_(o, z.to(cdt).expand(b - a, -1), group, torch.Tensor.sub_)
        _groups_(o, s, group, torch.Tensor.mul_)
        if tmp is not None:
            out[a - r0:b - r0].copy_(o)
    return out


# -- activations -------------------------------------------------------------------------------

def fp8_quant(x: torch.Tensor, group: int | None, static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize activations to FP8 E4M3: per token (``group`` None), per token and group of
    ``group`` input features (the last group may be partial), or with a static scale.
    s = max|x| / 448, x' = float(e4m3(x / s)) * s; computed in float32."""
    xf = x.to(torch.float32)
    if static_scale is not None:
        s = static_scale.to(torch.float32).reshape(())
        return ((xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s).to(x.dtype)
    n = xf.shape[-1]
    g = n if group is None or group >= n else group
    full = n // g
    parts = []
    if full:
        parts.append(xf[..., :full * g].unflatten(-1, (full, g)))
    if full * g < n:
        parts.append(xf[..., full * g:].unsqueeze(-2))
    outs = []
    for p in parts:
        s = p.abs().amax(-1, keepdim=True) / FP8_MAX
        s = torch.where(s == 0, torch.ones_like(s), s)
        outs.append(((p / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s).flatten(-2))
    return torch.cat(outs, dim=-1).to(x.dtype) if len(outs) > 1 else outs[0].to(x.dtype)


def int8_quant(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize activations to int8, symmetric: per token s = max|x| / 127 (vLLM's dynamic
    per-token kernel), or a static scale; q = clamp(round(x / s), -128, 127)."""
    xf = x.to(torch.float32)
    if static_scale is not None:
        s = static_scale.to(torch.float32).reshape(())
    else:
        s = xf.abs().amax(-1, keepdim=True) / 127.0
        s = torch.where(s == 0, torch.ones_like(s), s)
    return (torch.round(xf / s).clamp(-128, 127) * s).to(x.dtype)


def linear(x: torch.Tensor, rows_fn: Callable[[int, int], torch.Tensor], out_features: int, in_features: int,
           align: int = 1) -> torch.Tensor:
    """``x @ W^T`` with ``W`` produced ``rows_fn(r0, r1)`` a block of rows at a time (at most
    :data:`LINEAR_CHUNK` elements, a multiple of ``align`` rows)."""
    step = max(align, LINEAR_CHUNK // max(in_features, 1) // align * align)
    if step >= out_features:
        return F.linear(x, rows_fn(0, out_features).to(x.dtype))
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    for r in range(0, out_features, step):
        e = min(r + step, out_features)
        out[..., r:e] = F.linear(x, rows_fn(r, e).to(x.dtype))
    return out


# --- fast kernels (load option ``kernels="fast"``) ---------------------------------------------
#
# torch's CPU weight-only int4 kernel (``aten._weight_int4pack_mm_for_cpu``, as the ExpertPack
# backend uses for ggml Q4_0) computes ``x @ W^T`` with ``W = (u - 8) * scale + zero`` per group
# of g in {32, 64, 128, 256} inputs, u a 4-bit code, from a layout made once by
# ``aten._convert_weight_to_int4pack_for_cpu``. compressed-tensors int4 stores u = q + 8 and
# means w = (q - zp) * s, so the stored codes go in unchanged with scale s and zero -zp * s
# (0 when symmetric: exactly ggml Q4_0's mapping, w = d * (u - 8)). A group of G > 256 (or a
# channel / tensor scale) repeats its scale over G / g kernel groups, g the largest allowed
# divisor. Activations, scales, zeros and the output are rounded to bfloat16 (the kernel's fast
# path); the int4 codes are kept exactly. Needs out rows in multiples of 16.

INT4_KERNEL_GROUPS = (256, 128, 64, 32)


def int4_kernel_group(layout: Layout) -> int | None:
    """The int4 kernel's group size for ``layout`` (pack-quantized int4; None: no fast form)."""
    if layout.kind != "packed" or layout.bits != 4 or layout.out_features % 16:
        return None
    span = layout.group if layout.strategy == "group" else layout.in_features
    if layout.strategy not in ("group", "channel", "tensor") or not span or layout.in_features % span:
        return None
    return next((g for g in INT4_KERNEL_GROUPS if span % g == 0), None)


def int4_repack(layout: Layout, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """The fast kernel's form of ``weight_packed`` ``[..., out, in/8]`` (stacked: one per leading
    index) with its scales / unpacked zero points: (int4 pack uint8 [..., out, in/2], scales and
    zeros bfloat16 [..., in/g, out, 2], g); None when the layout has no fast form."""
    g = int4_kernel_group(layout)
    if g is None:
        return None
    o, i = layout.out_features, layout.in_features
    lead = q.shape[:-2]
    qs = q.reshape(-1, *q.shape[-2:])
    n = qs.shape[0]
    ss = scale.reshape(n, 1 if layout.strategy == "tensor" else o, -1)  # [n, 1 | o, 1 | i/G]
    zs = zero_point.reshape(n, o, -1) if zero_point is not None else None
    packs, szs = [], []
    for e in range(n):
        codes = (unpack_rows(qs[e], 4, i).to(torch.int32) + 8).contiguous()  # u = q + 8 in 0..15
        s = ss[e].float().expand(o, -1)
        reps = i // g // s.shape[-1]
        s = s.repeat_interleave(reps, dim=-1)
        z = torch.zeros_like(s) if zs is None else -(zs[e].float().expand(o, -1).repeat_interleave(reps, dim=-1) * s)
        packs.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        szs.append(torch.stack([s.t(), z.t()], dim=-1).to(torch.bfloat16).contiguous())
    pack, sz = torch.stack(packs), torch.stack(szs)
    return pack.view(*lead, *pack.shape[1:]), sz.view(*lead, *sz.shape[1:]), g


def int4_linear(x: torch.Tensor, pack: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """``x @ W^T`` through the int4-pack kernel (bfloat16 activations; see the section comment)."""
    xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, pack, group, sz)
    return y.to(x.dtype).view(*x.shape[:-1], pack.shape[0])


def int4_grouped(x: torch.Tensor, slots: Sequence[tuple[torch.Tensor, torch.Tensor]], group: int,
                 groups: list[tuple[int, int]]) -> torch.Tensor:
    """Stacked experts: ``x`` [rows, in] in consecutive groups ``(slot, n)``, each through its slot's
    kernel weight ``slots[slot]`` = (pack, scales-and-zeros), views made once at load; activations
    converted once for all groups, the outputs gathered with one cat (what one
    :func:`int4_linear` per group computes, with two conversions instead of two per group)."""
    xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    outs, start = [], 0
    for slot, n in groups:
        pack, sz = slots[slot]
        outs.append(torch.ops.aten._weight_int4pack_mm_for_cpu(xb[start:start + n], pack, group, sz))
        start += n
    return torch.cat(outs).to(x.dtype)


class Int4Fused:
    """Sibling projections of one input through one int4 kernel weight (``pack`` [.., sum N, in/2],
    ``sz`` [.., in/group, sum N, 2]; stacked: one per expert): ``f(x)`` / ``f(x, groups)`` return
    their outputs side by side (``LinearScheme.fuse``)."""

    def __init__(self, pack: torch.Tensor, sz: torch.Tensor, group: int) -> None:
        self.pack, self.sz, self.group = pack, sz, group
        self.slots = list(zip(pack.unbind(0), sz.unbind(0))) if pack.dim() == 3 else None

    def __call__(self, x: torch.Tensor, groups: list[tuple[int, int]] | None = None) -> torch.Tensor:
        if groups is None:
            return int4_linear(x, self.pack, self.sz, self.group)
        assert self.slots is not None
        return int4_grouped(x, self.slots, self.group, groups)
