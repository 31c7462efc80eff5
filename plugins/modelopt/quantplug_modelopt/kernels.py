"""Pure-torch kernels for ModelOpt NVFP4 and FP8 (per tensor): weights kept packed, dequantized a
block of rows at a time, activations emulated as the deployed kernels quantize them.

Storage (nvidia-modelopt 0.47 ``export_hf_checkpoint``; checked against its ``NVFP4QTensor`` /
``FP8QTensor`` on the vendor fixture): see :data:`NVFP4` and :data:`FP8`.

Arithmetic, the vendor's operation order, all in float32, one rounding to the model dtype at
the end:

* NVFP4 weight: ``b = f32(weight_scale[r, c // 16]) * weight_scale_2`` (float32 product), then
  ``w[r, c] = e2m1(code[r, c]) * b``; cast to the model dtype.
* NVFP4 activations (``input_scale`` = the static global scale ``amax / (6 * 448)``): per token,
  per 16 inputs, ``s = e4m3(clamp(amax16 / (6 * input_scale), 2**-9, 448))`` (an all-zero group
  takes 1), ``q = e2m1_rne(x / (f32(s) * input_scale))`` (round to nearest, ties to even,
  saturating at 6), ``x' = q * (f32(s) * input_scale)``: ModelOpt's ``NVFP4QTensor.quantize`` /
  ``dequantize`` and what TensorRT-LLM / vLLM's ``scaled_fp4_quant`` compute (they multiply by the
  reciprocal global scale; ModelOpt divides: the same up to one float32 rounding).
* FP8 weight: ``w = f32(weight) * weight_scale``; FP8 activations: ``x' = f32(e4m3(clamp(x /
  input_scale, -448, 448))) * input_scale`` (static per tensor, as vLLM's static FP8 kernels).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class NVFP4Layout:
    """Storage facts of one FP4 weight (the compute layer maps these onto its E2M1 form)."""

    group: int = 16                    # inputs per block scale
    element: str = "e2m1"              # sign bit 3, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}
    packing: str = "uint8 [out, in/2]; byte = e[2i] | e[2i+1] << 4 (low nibble = even column)"
    scale: str = "F8_E4M3 [out, in/group]"
    global_scale: str = "weight_scale_2 F32 scalar, multiplied: block scale = f32(weight_scale) * weight_scale_2"
    activation_scale: str = "input_scale F32 scalar: global scale of NVFP4 activations (amax / 2688)"


@dataclass(frozen=True)
class FP8Layout:
    """Storage facts of ModelOpt's per-tensor FP8 linear."""

    weight: str = "F8_E4M3 [out, in]"
    scale: str = "weight_scale F32 scalar, multiplied"
    activation_scale: str = "input_scale F32 scalar (static per-tensor FP8 activations)"


NVFP4 = NVFP4Layout()
FP8 = FP8Layout()
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
#: byte -> (even element, odd element) values
BYTE_LUT = torch.stack((E2M1[torch.arange(256) & 0x0F], E2M1[torch.arange(256) >> 4]), dim=-1).contiguous()
#: e4m3fn byte -> float32 value (NaN codes stay NaN); torch converts float8 element by element on CPU
E4M3_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
#: e2m1 rounding bounds (ModelOpt ``_cast_fp4``): ties at 0.75 / 1.75 / 3.5 round up to the even code
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_ODD_TIES = torch.tensor([0.75, 1.75, 3.5])
#: dense weight elements materialized at once by :func:`linear` (1 MiB of float32)
LINEAR_CHUNK = 1 << 18
_SCRATCH = threading.local()


def e4m3_to_f32(t: torch.Tensor) -> torch.Tensor:
    return E4M3_LUT.to(t.device)[t.view(torch.uint8).long()]


def nvfp4_f32(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, out: torch.Tensor | None = None,
              group: int = NVFP4.group) -> torch.Tensor:
    """uint8 ``weight`` [r, in/2], F8_E4M3 ``scale`` [r, in/group], F32 ``scale_2`` [] -> float32
    [r, in] (into ``out`` when given)."""
    r, half = weight.shape
    n = half * 2
    w = out if out is not None else torch.empty(r, n, dtype=torch.float32, device=weight.device)
    torch.index_select(BYTE_LUT.to(weight.device), 0, weight.reshape(-1).to(torch.int32), out=w.view(-1, 2))
    b = e4m3_to_f32(scale) * scale_2.to(torch.float32).reshape(())  # the block scales, float32
    w.view(r, n // group, group).mul_(b.unsqueeze(-1))
    return w


def dequantize_nvfp4(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return nvfp4_f32(weight, scale, scale_2).to(dtype)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (e4m3_to_f32(weight) * scale.to(torch.float32).reshape(())).to(dtype)


def linear(x: torch.Tensor, rows_fn, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """``x @ W^T`` with W made ``rows_fn(r0, r1, out)`` (float32 rows into ``out``) a block of rows at
    a time (at most :data:`LINEAR_CHUNK` elements, one reused buffer per thread), each block
    rounded to the model ``dtype`` as :meth:`dequantize` rounds it, then multiplied in x's dtype."""
    step = min(out_features, max(1, LINEAR_CHUNK // max(in_features, 1)))
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


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest E2M1 value (ties to the even code, |v| > 6 saturates to 6)."""
    a = v.abs()
    idx = torch.searchsorted(_BOUNDS.to(v.device), a) + torch.isin(a, _ODD_TIES.to(v.device)).long()
    mag = E2M1[:8].to(v.device)[idx.clamp_(max=7)]
    return torch.where(v < 0, -mag, mag)


def nvfp4_act(x: torch.Tensor, input_scale: torch.Tensor, group: int = NVFP4.group) -> torch.Tensor:
    """NVFP4 activations: dynamic e4m3 scales per ``group`` inputs under the static global scale
    ``input_scale`` (see the module docstring); x [..., k] with k a multiple of ``group``."""
    xf = x.to(torch.float32)
    k = xf.shape[-1]
    g = xf.unflatten(-1, (k // group, group))
    gs = input_scale.to(torch.float32).reshape(())
    s = g.abs().amax(-1) / (E2M1_MAX * gs)
    s = torch.where(s == 0, torch.ones_like(s), s).clamp_(2.0 ** -9, E4M3_MAX)
    b = s.to(torch.float8_e4m3fn).to(torch.float32) * gs
    q = e2m1_round(g / b.unsqueeze(-1))
    return (q * b.unsqueeze(-1)).flatten(-2).to(x.dtype)


def fp8_act(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    s = input_scale.to(torch.float32).reshape(())
    q = (x.to(torch.float32) / s).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * s).to(x.dtype)


# -- quantization (the exporter): ModelOpt's rules ------------------------------------------------

def quantize_nvfp4(w: torch.Tensor, scale_2: torch.Tensor | None = None, group: int = NVFP4.group
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense [out, in] -> (weight uint8 [out, in/2], weight_scale F8_E4M3 [out, in/group],
    weight_scale_2 F32 []): ``weight_scale_2 = amax / (6 * 448)`` unless given (ModelOpt shares the
    max over a fused gate / up pair), block scales ``e4m3(amax16 / (6 * weight_scale_2))``."""
    wf = w.to(torch.float32)
    s2 = (wf.abs().amax() / (E2M1_MAX * E4M3_MAX)) if scale_2 is None else scale_2.to(torch.float32)
    s2 = torch.where(s2 == 0, torch.ones_like(s2), s2).reshape(())
    g = wf.unflatten(-1, (-1, group))
    s = g.abs().amax(-1) / (E2M1_MAX * s2)
    s = torch.where(s == 0, torch.ones_like(s), s).clamp_(2.0 ** -9, E4M3_MAX).to(torch.float8_e4m3fn)
    q = e2m1_round(g / (s.to(torch.float32) * s2).unsqueeze(-1)).flatten(-2)
    codes = _codes(q)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), s.contiguous(), s2.clone()


def _codes(q: torch.Tensor) -> torch.Tensor:
    """E2M1 values -> 4-bit codes (sign bit 3)."""
    mag = (q.abs().unsqueeze(-1) == E2M1[:8]).to(torch.uint8).argmax(-1).to(torch.uint8)
    return mag | ((q < 0) & (mag != 0)).to(torch.uint8) << 3


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense -> (F8_E4M3 weight, F32 weight_scale []): scale = amax / 448 (ModelOpt FP8QTensor)."""
    wf = w.to(torch.float32)
    s = wf.abs().amax() / E4M3_MAX
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (wf / s).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s.reshape(())
