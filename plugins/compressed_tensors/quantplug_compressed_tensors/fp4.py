"""compressed-tensors FP4: ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized``.

Storage (compressed-tensors 0.20 ``compressors/nvfp4``, ``compressors/mxfp4``; what llm-compressor
and auto-round's ``llm_compressor`` format write; facts in :data:`NVFP4` / :data:`MXFP4`):

* ``weight_packed`` uint8 [out, in/2]: two E2M1 codes per byte, low nibble = even column; code
  bit 3 = sign, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6};
* NVFP4: ``weight_scale`` F8_E4M3 [out, in/16], ``weight_global_scale`` F32 [1], a *divisor*
  (``448 * 6 / amax``: the inverse of ModelOpt's ``weight_scale_2``); activations (W4A4):
  ``input_global_scale`` F32 [1], block scales per 16 computed at run time;
* MXFP4: ``weight_scale`` uint8 [out, in/32] holding E8M0 exponents, value ``2**(e - 127)``;
  activations (W4A4): dynamic, E8M0 scales per 32 computed at run time.

Arithmetic (compressed-tensors' steps, taken in float32 where the library takes them in the
unpacked dtype, bfloat16, which rounds weights by ~0.3%; one rounding to the model dtype):

* NVFP4 weight: ``b = f32(weight_scale[r, c // 16]) / weight_global_scale``, ``w = e2m1 * b``.
* MXFP4 weight: ``w = e2m1 * 2**(weight_scale[r, c // 32] - 127)`` (exact in float32).
* NVFP4 activations (``forward_quantize``, strategy tensor_group, dynamic "local"): per token
  and 16 inputs ``s = f32(e4m3(min(input_global_scale * amax16 / 6, 448)))`` (0 -> 0.125),
  ``b = s / input_global_scale``, ``x' = e2m1_rne(clamp(x / b, -6, 6)) * b``.
* MXFP4 activations (dynamic, group 32, uint8 scales): ``p = amax32`` rounded to a power of two
  (float32 bits + 2**21, mantissa dropped: 1.75 * 2**k and up round to 2**(k + 1)),
  ``e = clamp(127 + log2(p) - 2, 0, 255)``, ``b = 2**(e - 127)``,
  ``x' = e2m1_rne(clamp(x / b, -6, 6)) * b``.

``e2m1_rne``: nearest E2M1 value, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
2.5 -> 2, 3.5 -> 4, 5 -> 4), as ``cast_to_fp4``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from quantplug.api import LinearScheme, Problem, SplitRule, TensorInfo, TensorSpec, refuse

from .config import Group

FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
WHOLE = SplitRule(None)


@dataclass(frozen=True)
class FP4Layout:
    """Storage facts of one FP4 weight (the compute layer maps these onto its E2M1 form)."""

    name: str        # "nvfp4" | "mxfp4"
    group: int       # inputs per block scale
    scale: str       # "e4m3" (F8_E4M3) | "e8m0" (uint8 biased exponent)
    global_scale: str | None  # "divide": block scale = f32(weight_scale) / weight_global_scale
    packing: str = "uint8 [out, in/2]; byte = e[2i] | e[2i+1] << 4 (low nibble = even column)"
    element: str = "e2m1: sign bit 3, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}"


NVFP4 = FP4Layout("nvfp4", 16, "e4m3", "divide")
MXFP4 = FP4Layout("mxfp4", 32, "e8m0", None)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
BYTE_LUT = torch.stack((E2M1[torch.arange(256) & 0x0F], E2M1[torch.arange(256) >> 4]), dim=-1).contiguous()
E4M3_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
#: e8m0 byte -> 2**(b - 127) (0xFF: NaN), exact in float32 down to 2**-149
E8M0_LUT = torch.where(torch.arange(256) == 255, torch.tensor(float("nan")),
                       torch.exp2(torch.arange(256, dtype=torch.float64) - 127).to(torch.float32))
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_ODD_TIES = torch.tensor([0.75, 1.75, 3.5])
#: dense weight elements materialized at once by :func:`linear` (1 MiB of float32)
LINEAR_CHUNK = 1 << 18
_SCRATCH = threading.local()


def block_scales(layout: FP4Layout, scale: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 block scales [r, in/group]."""
    if layout.scale == "e8m0":
        return E8M0_LUT.to(scale.device)[scale.view(torch.uint8).long()]
    s = E4M3_LUT.to(scale.device)[scale.view(torch.uint8).long()]
    return s / global_scale.to(torch.float32).reshape(()) if global_scale is not None else s


def dequantize_f32(layout: FP4Layout, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``packed`` [r, in/2] + scales -> float32 [r, in] (into ``out`` when given)."""
    r, half = packed.shape
    n = half * 2
    w = out if out is not None else torch.empty(r, n, dtype=torch.float32, device=packed.device)
    torch.index_select(BYTE_LUT.to(packed.device), 0, packed.reshape(-1).to(torch.int32), out=w.view(-1, 2))
    w.view(r, n // layout.group, layout.group).mul_(block_scales(layout, scale, global_scale).unsqueeze(-1))
    return w


def dequantize(layout: FP4Layout, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_f32(layout, packed, scale, global_scale).to(dtype)


def linear(x: torch.Tensor, layout: FP4Layout, packed: torch.Tensor, scale: torch.Tensor,
           global_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x @ W^T``, W dequantized :data:`LINEAR_CHUNK` elements at a time into this thread's reused
    float32 buffer and rounded to ``dtype`` as :func:`dequantize` rounds it."""
    rows, k = packed.shape[0], packed.shape[1] * 2
    step = min(rows, max(1, LINEAR_CHUNK // max(k, 1)))
    buf = getattr(_SCRATCH, "w", None)
    if buf is None or buf.numel() < step * k:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference_mode
            buf = _SCRATCH.w = torch.empty(step * k, dtype=torch.float32)
    x2 = x.reshape(-1, k)
    y = torch.empty(x2.shape[0], rows, dtype=x.dtype, device=x.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = dequantize_f32(layout, packed[r0:r1], scale[r0:r1], global_scale, buf[: (r1 - r0) * k].view(r1 - r0, k))
        wd = w if dtype == torch.float32 and x.dtype == torch.float32 else w.to(dtype).to(x.dtype)
        y[:, r0:r1] = F.linear(x2, wd)
    return y.view(*x.shape[:-1], rows)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest E2M1 value (ties to the even code, |v| > 6 saturates to 6)."""
    a = v.abs()
    idx = torch.searchsorted(_BOUNDS.to(v.device), a) + torch.isin(a, _ODD_TIES.to(v.device)).long()
    mag = E2M1[:8].to(v.device)[idx.clamp_(max=7)]
    return torch.where(v < 0, -mag, mag)


def _power_of_two(a: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``round_to_power_2`` on float32 with E2M1's 1 mantissa bit."""
    bits = a.contiguous().view(torch.int32)
    return ((bits + (1 << 21)) & (0x1FF << 23)).view(torch.float32)


def act_quant(layout: FP4Layout, x: torch.Tensor, input_global_scale: torch.Tensor | None) -> torch.Tensor:
    """W4A4 activations, emulated (module docstring): x [..., k], k a multiple of the group."""
    xf = x.to(torch.float32)
    k = xf.shape[-1]
    g = xf.unflatten(-1, (k // layout.group, layout.group))
    amax = g.abs().amax(-1)
    if layout.name == "nvfp4":
        assert input_global_scale is not None
        gs = input_global_scale.to(torch.float32).reshape(())
        s = (gs * (amax / 6.0)).clamp_(max=448.0).to(torch.float8_e4m3fn).to(torch.float32)
        s = torch.where(s == 0, torch.full_like(s, 0.125), s)
        b = s / gs
    else:
        e = (127 + torch.floor(torch.log2(_power_of_two(amax))) - 2).clamp_(0, 255)
        b = torch.exp2(e - 127)
    q = e2m1_round((g / b.unsqueeze(-1)).clamp_(-6.0, 6.0))
    return (q * b.unsqueeze(-1)).flatten(-2).to(x.dtype)


class CTFP4Scheme(LinearScheme):
    """One nvfp4- / mxfp4-pack-quantized linear (or a stack of routed experts)."""

    name = "compressed-tensors-fp4"

    def __init__(self, fmt: str, layout: FP4Layout, act: bool, act_mode: str, reason: str) -> None:
        self.fmt, self.layout, self.act, self.act_mode, self.reason = fmt, layout, act, act_mode, reason
        self.emulate = act and act_mode != "none"
        self.weight_only = not self.emulate

    def describe(self) -> str:
        lay = self.layout
        w = f"{self.fmt} ({lay.scale} scale per {lay.group}" + (", f32 global)" if lay.global_scale else ")")
        if not self.act:
            return f"{w}; weight-only"
        a = f"{lay.name} per {lay.group}" + (" under input_global_scale" if lay.global_scale else ", dynamic e8m0")
        if self.emulate:
            return f"{w}; activations {a} (emulated)"
        return f"{w}; activations {a} NOT emulated (activation_quant=none)"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        lay = self.layout
        specs = [TensorSpec("weight_packed", ("U8",), (out_features, in_features // 2)),
                 TensorSpec("weight_scale", ("F8_E4M3",) if lay.scale == "e4m3" else ("U8", "F8_E8M0"),
                            (out_features, in_features // lay.group))]
        if lay.global_scale:
            specs.append(TensorSpec("weight_global_scale", ("F32",), (1,), target="F32"))
            if self.act:
                specs.append(TensorSpec("input_global_scale", ("F32",), (1,), target="F32"))
        return specs

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        w = tensors.get("weight_packed")
        if w is not None and (w.shape[-1] * 2) % self.layout.group:
            return [Problem(f"{self.layout.name} needs in_features divisible by {self.layout.group}, got "
                            f"{w.shape[-1] * 2}", tensor=w.name, file=w.file.name)]
        return []

    def split(self, direction: str, out_features: int, in_features: int) -> dict[str, SplitRule]:
        """Rows follow out; along in whole groups (group/2 bytes and one scale each); global scales
        whole. Row-parallel activation emulation stays exact: its scales are per group of one
        token's inputs (and a static global scale)."""
        names = [s.suffix for s in self.tensor_specs(out_features, in_features)]
        g = self.layout.group
        if direction == "out":
            rules = {"weight_packed": SplitRule(0), "weight_scale": SplitRule(0)}
        else:
            rules = {"weight_packed": SplitRule(1, g, g // 2), "weight_scale": SplitRule(1, g, 1)}
        return {n: rules.get(n, WHOLE) for n in names}

    def _parts(self, layer: Any, index: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q, s = layer.weight_packed, layer.weight_scale
        gs = getattr(layer, "weight_global_scale", None)
        if index is not None:
            q, s, gs = q[index], s[index], gs[index] if gs is not None else None
        return q, s, gs

    def dequantize(self, layer: Any, index: int | None = None) -> torch.Tensor:
        q, s, gs = self._parts(layer, index)
        return dequantize(self.layout, q, s, gs, layer.model_dtype)

    def apply(self, layer: Any, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        if self.emulate:
            igs = getattr(layer, "input_global_scale", None)
            x = act_quant(self.layout, x, igs if igs is None or index is None else igs[index])
        q, s, gs = self._parts(layer, index)
        return linear(x, self.layout, q, s, gs, layer.model_dtype)


def scheme(layer: str, group: Group, why: str, mode: str) -> Any:
    """The scheme of an FP4 config group, or a plan-time refusal naming the field."""
    base = f"config_groups.{group.name}"
    w = group.weights
    if w is None:
        return refuse(layer, f"{base}.weights", "activation-only quantization (no weight args) is not supported")
    act = group.input_activations
    fmt = group.format
    layout = NVFP4 if fmt == "nvfp4-pack-quantized" else MXFP4 if fmt == "mxfp4-pack-quantized" else None
    if layout is None:
        return refuse(layer, f"{base}.format", f"{w.type}{w.num_bits} {w.strategy} weights in format {fmt!r}: FP4 "
                      f"weights are supported as {' / '.join(FORMATS)}")
    if w.type != "float" or w.num_bits != 4 or w.group_size != layout.group or not w.symmetric:
        return refuse(layer, f"{base}.weights", f"{fmt} needs symmetric float4 weights in groups of {layout.group}, "
                      f"got {w.type}{w.num_bits} group {w.group_size}{'' if w.symmetric else ' asymmetric'}")
    if act is not None:
        dynamic = act.dynamic in (True, "local")
        if not (dynamic and act.type == "float" and act.num_bits == 4 and act.group_size == layout.group
                and act.symmetric):
            return refuse(layer, f"{base}.input_activations", f"{act.type}{act.num_bits} group {act.group_size} "
                          f"{'dynamic' if dynamic else 'static'} activations with {fmt} weights: supported are "
                          f"none and {layout.name} activations per {layout.group}")
    return CTFP4Scheme(fmt, layout, act is not None, mode, why)
