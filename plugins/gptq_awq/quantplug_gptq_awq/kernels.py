"""Pure-torch kernels for GPTQ and AWQ integer packing (int4 / int8 in int32 words), kept packed in
memory, dequantized a block of output rows at a time.

Storage facts (:class:`IntPack`, one per packing):

* GPTQ (AutoGPTQ / GPTQModel v1, auto-round ``auto_gptq`` and ``auto_round:auto_gptq``):
  ``qweight`` int32 [in * bits / 32, out], input row k in word k // (32/bits) at bits
  ``bits * (k % (32/bits))``; ``qzeros`` int32 [G, out * bits / 32] packed the same way along
  out, stored as ``zero - 1`` (checkpoint_format ``gptq``; ``gptq_v2`` stores the zero);
  ``scales`` F16 [G, out]; ``g_idx`` int32 [in] (group of input k; act-order when it is not
  ``k // group``).
* AWQ GEMM (AutoAWQ, auto-round ``auto_awq`` / ``auto_round:auto_awq``): ``qweight`` int32
  [in, out * bits / 32], ``qzeros`` int32 [in / group, out * bits / 32], both packed along out
  in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i of a word holds column
  ``8 * word + ORDER[i]``), zeros stored as is; ``scales`` F16 [in / group, out].

Arithmetic (what auto-round's own dequantizers compute, in float32; one rounding to the model
dtype): ``w[j, k] = (q[k, j] - z[g(k), j]) * float32(s[g(k), j])`` with ``g(k) = g_idx[k]``
(GPTQ) or ``k // group`` (AWQ); ``q - z`` is an exact integer, so one float32 rounding.

Compute form (:func:`repack`, once at load, unless g_idx is a real act-order permutation): the
core's INT4 form (rows = outputs, byte j = inputs 2j low / 2j+1 high nibble, code = q, which the
form reads as q - 8) or INT8 (int8 code = q - 128), scales transposed to [out, groups] in their
stored dtype, zero points z' = z - 8 (INT4) / z - 128 (INT8), so that the form's
``((code - offset) - z') * s`` is ``(q - z) * s`` with the same float32 operations: every weight
bit for bit. GPTQ's words read as little-endian bytes are already that byte order along the
input: its repack is a transpose.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: column t of an 8-column AWQ word is nibble AWQ_REVERSE[t]
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)
#: dense weight elements materialized at once by :func:`linear` (4 MiB of float32: fewer, larger steps measured
#: 17 vs 21 ms for a [2048, 7168] int4 layer and one input row, 1 thread)
LINEAR_CHUNK = 1 << 20
#: values unpacked at once by :func:`repack` (int16 temporaries of 32 MiB)
REPACK_CHUNK = 1 << 24
_SCRATCH = threading.local()


@dataclass(frozen=True)
class IntPack:
    """Storage facts of one packing (the compute layer maps these onto its int4 / int8 form with
    group scales and zero points)."""

    name: str               # "gptq" | "awq"
    weight_axis: str        # which axis of qweight is packed: "in" (GPTQ) | "out" (AWQ)
    order: tuple[int, ...]  # element order inside a 4-bit word (identity or AWQ's interleave)
    zero_offset: int        # added to a stored zero: 1 for GPTQ v1 ("zero - 1" stored), else 0
    scale: str = "F16 [groups, out]"
    zeros: str = "int32 [groups, out * bits / 32], packed along out"


def gptq(checkpoint_format: str = "gptq") -> IntPack:
    return IntPack("gptq", "in", tuple(range(8)), 0 if checkpoint_format == "gptq_v2" else 1)


AWQ = IntPack("awq", "out", AWQ_ORDER, 0)


def _unpack_last(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [..., W] packed along the last dim -> int16 [..., W * 32 / bits] (logical order)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    v = torch.bitwise_right_shift(words.unsqueeze(-1), shifts).bitwise_and_((1 << bits) - 1).to(torch.int16)
    if order is not None and bits == 4 and order != tuple(range(8)):
        v = v[..., list(AWQ_REVERSE)]
    return v.reshape(*words.shape[:-1], words.shape[-1] * per)


def unpack_gptq_weight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight [.., in * bits / 32, cols] -> int16 [.., in, cols] (packed along in)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    v = torch.bitwise_right_shift(qweight.unsqueeze(-2), shifts[:, None]).bitwise_and_((1 << bits) - 1)
    return v.to(torch.int16).reshape(*qweight.shape[:-2], qweight.shape[-2] * per, qweight.shape[-1])


def zeros_f32(pack: IntPack, qzeros: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """Stored ``qzeros`` [G, out * bits / 32] -> float32 zero points [G, out]."""
    z = _unpack_last(qzeros, bits, pack.order)[..., :out_features].to(torch.float32)
    return z + pack.zero_offset if pack.zero_offset else z


def dequantize_rows_f32(pack: IntPack, bits: int, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                        group: int, groups: torch.Tensor | None, r0: int, r1: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Output rows r0:r1 of the dense weight, float32 [r1 - r0, in] (into ``out`` when given).

    ``zeros`` float32 [G, out] (:func:`zeros_f32`), ``scales`` [G, out] as stored. Inputs map to
    groups of ``group`` consecutive inputs (the last may be partial; per channel: ``group`` =
    in), or, for act-order, through ``groups`` int64 [in] (g_idx): then the group's zero and
    scale are gathered per input."""
    per, mask = 32 // bits, (1 << bits) - 1
    if pack.weight_axis == "in":  # GPTQ: the rows' words transposed (1/per of the values): [r, in / per]
        words = qweight[:, r0:r1].t().contiguous()
        r, n = words.shape[0], words.shape[1] * per
        w = out if out is not None else torch.empty(r, n, dtype=torch.float32, device=qweight.device)
        slots = w.view(r, n // per, per)  # value i of a word is input per * word + i
    else:  # AWQ: words along out, transposed: [r / per, in]; value i of a word is output row per * word + ORDER[i]
        if r0 % per or (r1 - r0) % per:
            raise ValueError(f"AWQ rows {r0}:{r1} must start and end on whole {per}-row words")
        words = qweight[:, r0 // per:r1 // per].t().contiguous()
        r, n = r1 - r0, words.shape[1]
        w = out if out is not None else torch.empty(r, n, dtype=torch.float32, device=qweight.device)
        slots = w.view(r // per, per, n).transpose(1, 2)  # [words, in, per]
    if pack.weight_axis == "in" and sys.byteorder == "little":
        # value i of a word sits in byte i // (8 / bits): read the words as bytes (low nibble first)
        b = words.view(torch.uint8)
        w.copy_(torch.stack((b & 0xF, b >> 4), dim=-1).view(r, n) if bits == 4 else b)
    else:
        order = pack.order if bits == 4 and pack.weight_axis == "out" else tuple(range(per))
        for i in range(per):
            slots[..., order[i]].copy_(torch.bitwise_right_shift(words, bits * i).bitwise_and_(mask))
    z = zeros[:, r0:r1].t()  # [r, G]
    s = scales[:, r0:r1].t().to(torch.float32)
    if groups is not None:  # act-order: one gathered zero and scale per input
        w.sub_(z.index_select(1, groups)).mul_(s.index_select(1, groups))
        return w
    full = n // group
    if full:
        v = w[:, :full * group].view(r, full, group)
        v.sub_(z[:, :full, None]).mul_(s[:, :full, None])
    if full * group < n:  # a last, partial group
        w[:, full * group:].sub_(z[:, full:full + 1]).mul_(s[:, full:full + 1])
    return w


def repack(pack: IntPack, bits: int, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
           out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stored ``qweight`` / ``qzeros`` / ``scales`` (plain group order; a leading slot dim for
    stacked experts) -> (codes, scales [.., out, G] in the stored dtype, zero points [.., out, G]
    or None when all are zero): INT4 codes uint8 [.., out, in/2] (nibble = q), INT8 codes int8
    [.., out, in] (q - 128); zero points int8 when they fit, else float32. Temporaries beyond the
    result stay below :data:`REPACK_CHUNK` values (AWQ's unpacking, a few slots at a time)."""
    if pack.weight_axis == "in" and sys.byteorder == "little":
        # value v of a word sits at bits * v: read as bytes, inputs 2j / 2j+1 are byte j's low / high
        # nibble (4 bits), input j byte j (8 bits): the repack is a transpose (into a fresh tensor:
        # the INT8 shift below works in place, and contiguous() may return qweight itself)
        t = qweight.transpose(-1, -2)[..., :out_features, :]
        codes = torch.empty(t.shape, dtype=qweight.dtype).copy_(t).view(torch.uint8)
    else:
        lead = qweight.shape[:-2]
        flat = qweight.reshape(-1, *qweight.shape[-2:])
        in_f = flat.shape[-2] * (32 // bits) if pack.weight_axis == "in" else flat.shape[-2]
        width = in_f // 2 if bits == 4 else in_f
        out = torch.empty(flat.shape[0], out_features, width, dtype=torch.uint8)
        step = max(1, REPACK_CHUNK // max(in_f * out_features, 1))
        for i in range(0, flat.shape[0], step):
            words = flat[i:i + step]
            q = unpack_gptq_weight(words, bits) if pack.weight_axis == "in" else _unpack_last(words, bits, pack.order)
            qt = q[..., :out_features].transpose(-1, -2)  # [slots, out, in]
            out[i:i + step] = (qt[..., 0::2] | (qt[..., 1::2] << 4)).to(torch.uint8) if bits == 4 else qt.to(torch.uint8)
        codes = out.reshape(*lead, out_features, width)
    if bits == 8:
        codes = codes.bitwise_xor_(0x80).view(torch.int8)  # q - 128 (codes is a fresh tensor)
    z = zeros_f32(pack, qzeros, bits, out_features) - (8 if bits == 4 else 128)
    zt = z.transpose(-1, -2).contiguous()
    if not bool(zt.any()):
        zero = None
    elif bool(((zt >= -128) & (zt <= 127)).all()):
        zero = zt.to(torch.int8)
    else:
        zero = zt
    return codes, scales.transpose(-1, -2).contiguous(), zero


def dequantize_codes_f32(bits: int, codes: torch.Tensor, zero: torch.Tensor | None, scales: torch.Tensor, group: int,
                         r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows r0:r1 of the dense weight from :func:`repack`'s tensors, float32 [r1 - r0, in]:
    ``((code - offset) - z') * f32(s)`` = ``(q - z) * f32(s)``, the same float32 operations as
    :func:`dequantize_rows_f32` (``q - z`` is exact)."""
    c = codes[r0:r1]
    r = c.shape[0]
    n = c.shape[1] * 2 if bits == 4 else c.shape[1]
    w = out if out is not None else torch.empty(r, n, dtype=torch.float32, device=codes.device)
    if bits == 4:
        w.copy_(torch.stack((c & 0xF, c >> 4), dim=-1).view(r, n)).sub_(8)
    else:
        w.copy_(c)
    s = scales[r0:r1].to(torch.float32)
    z = zero[r0:r1].to(torch.float32) if zero is not None else None
    full = n // group
    if full:
        v = w[:, :full * group].view(r, full, group)
        if z is not None:
            v.sub_(z[:, :full, None])
        v.mul_(s[:, :full, None])
    if full * group < n:  # a last, partial group
        v = w[:, full * group:]
        if z is not None:
            v.sub_(z[:, full:full + 1])
        v.mul_(s[:, full:full + 1])
    return w


def linear(x: torch.Tensor, rows_fn, out_features: int, in_features: int, dtype: torch.dtype,
           align: int = 8) -> torch.Tensor:
    """``x @ W^T`` with ``rows_fn(r0, r1, out)`` filling float32 rows of W (a reused buffer of at most
    :data:`LINEAR_CHUNK` elements per thread, blocks of ``align`` rows: whole AWQ words), each
    rounded to ``dtype`` as dequantize rounds it."""
    step = min(out_features, max(align, LINEAR_CHUNK // max(in_features, 1) // align * align))
    buf = getattr(_SCRATCH, "w", None)
    if buf is None or buf.numel() < step * in_features:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference_mode
            buf = _SCRATCH.w = torch.empty(step * in_features, dtype=torch.float32)
    x2 = x.reshape(-1, in_features)
    y = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
    for r0 in range(0, out_features, step):
        r1 = min(out_features, r0 + step)
        w = rows_fn(r0, r1, buf[: (r1 - r0) * in_features].view(r1 - r0, in_features))
        wd = w if dtype == torch.float32 and x.dtype == torch.float32 else w.to(dtype).to(x.dtype)
        y[:, r0:r1] = F.linear(x2, wd)
    return y.view(*x.shape[:-1], out_features)


# -- packing (test writers, export) ---------------------------------------------------------------

def pack_last(v: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int values [..., n] in [0, 2**bits) -> int32 words [..., n * bits / 32] packed along the last dim."""
    per = 32 // bits
    u = v.to(torch.int64).reshape(*v.shape[:-1], -1, per)
    if order is not None and bits == 4 and order != tuple(range(8)):
        u = u[..., list(order)]
    words = (u << (torch.arange(per, dtype=torch.int64) * bits)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_gptq_weight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int values [in, out] -> GPTQ qweight [in * bits / 32, out]."""
    return pack_last(q.t().contiguous(), bits).t().contiguous()
