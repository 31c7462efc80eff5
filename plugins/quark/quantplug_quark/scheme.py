"""MXFP4 (OCP MX, E2M1 elements, e8m0 scales per 32 inputs) kept packed in memory.

Storage, as amd-quark exports it: ``weight`` uint8 [out, in/2], byte = e[2i] | e[2i+1] << 4
(low nibble = even element); code = sign (bit 3) + E2M1 magnitude {0, .5, 1, 1.5, 2, 3, 4, 6};
``weight_scale`` uint8 [out, in/32], value 2 ** (u8 - 127). A ``weight_scale`` stored as F8_E8M0 is the
same byte (OCP MX E8M0: biased exponent, 0xFF = NaN) and is read bit for bit.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from quantplug.api import Form, Layer, LinearScheme, Problem, SplitRule, TensorInfo, TensorSpec, Weights

GROUP = 32
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


_BYTE_LUT = torch.stack((E2M1[torch.arange(256) & 0x0F], E2M1[torch.arange(256) >> 4]), dim=-1)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> E2M1 codes uint8 [..., n] (low nibble first)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def dequantize_mxfp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Vectorised MXFP4 dequantization: [..., out, in/2] + [..., out, in/32] -> [..., out, in]."""
    # one gather through a 256-entry table of byte -> (even, odd) element values
    vals = _BYTE_LUT.to(weight.device)[weight.long()].flatten(-2)
    s = torch.exp2(scale.to(torch.float32) - 127.0)
    s = torch.where(scale == 255, torch.full_like(s, float("nan")), s)  # e8m0 0xFF is NaN
    out = (vals.unflatten(-1, (-1, GROUP)) * s.unsqueeze(-1)).flatten(-2)
    return out.to(dtype)


#: dense weight elements materialized at once by :func:`mxfp4_linear` (1 MiB of float32)
LINEAR_CHUNK_ELEMS = 1 << 18
_SCRATCH = threading.local()


def mxfp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x @ W^T`` with W dequantized exactly as :func:`dequantize_mxfp4` does (the same float32
    products, rounded to ``dtype``), a block of rows at a time into this thread's reused buffer:
    no weight-sized allocation per call and the chunk stays in cache for its matmul."""
    rows, k = weight.shape[0], weight.shape[-1] * 2
    step = min(rows, max(1, LINEAR_CHUNK_ELEMS // k))
    buf = getattr(_SCRATCH, "w", None)
    if buf is None or buf.numel() < step * k:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference_mode
            buf = _SCRATCH.w = torch.empty(step * k, dtype=torch.float32)
    lut = _BYTE_LUT.to(weight.device)
    x2 = x.reshape(-1, k)
    out_t = torch.empty(rows, x2.shape[0], dtype=x.dtype, device=x.device)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        w = buf[:n * k].view(n, k)
        torch.index_select(lut, 0, weight[r:r + n].reshape(-1).to(torch.int32), out=w.view(-1, 2))
        sc = scale[r:r + n]
        s = torch.exp2(sc.to(torch.float32) - 127.0)
        s = torch.where(sc == 255, torch.full_like(s, float("nan")), s)  # e8m0 0xFF is NaN
        w.view(n, -1, GROUP).mul_(s.unsqueeze(-1))
        wd = w if dtype == torch.float32 and x.dtype == torch.float32 else w.to(dtype).to(x.dtype)
        torch.mm(wd, x2.t(), out=out_t[r:r + n])
    return out_t.t().reshape(*x.shape[:-1], rows)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [..., out, in] -> (weight uint8 [..., out, in/2], weight_scale uint8 [..., out, in/32]).

    OCP MX rule: shared exponent = floor(log2(amax of the 32-group)) - 2 (E2M1's emax), clamped
    to e8m0's range; elements divided by 2**exp and rounded half-to-even onto the E2M1 grid,
    saturating at +-6.
    """
    g = w.to(torch.float32).unflatten(-1, (-1, GROUP))
    amax = g.abs().amax(-1)
    exp = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127)).clamp(-127, 127)
    x = (g / torch.exp2(exp).unsqueeze(-1)).clamp(-6, 6)
    mags = E2M1[:8]
    a = x.abs()
    # nearest grid value; ties go to the even code (lower mantissa bit 0)
    d = (a.unsqueeze(-1) - mags).abs()
    best = d.min(-1, keepdim=True).values
    cand = (d == best)
    code = torch.where(cand[..., :] & (torch.arange(8) % 2 == 0), torch.arange(8), 99).amin(-1)
    code = torch.where(code == 99, cand.float().argmax(-1), code)
    code = code + 8 * (x < 0).long() * (code != 0).long()
    codes = code.flatten(-2).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()


class MXFP4Scheme(LinearScheme):
    """Packed fp4 weight + e8m0 scales; forward dequantizes (or uses a cached copy when asked)."""

    name = "mxfp4"
    #: activations are not quantized (the plugin refuses input_tensors specs): apply is
    #: dequantize then a float matmul, so MLA decode may absorb kv_b_proj through dequantize
    weight_only = True

    def __init__(self, source: str = "global_quant_config", cache: bool = False) -> None:
        self.source = source
        self.cache = cache

    @property
    def key(self) -> str:
        return "mxfp4"

    def describe(self) -> str:
        return f"mxfp4 (fp4 e2m1, group 32, e8m0 scale; {self.source}{'; cached dense copy' if self.cache else ''})"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        return [TensorSpec("weight", ("U8",), (out_features, in_features // 2)),
                # U8 (what amd-quark writes) and F8_E8M0 are one encoding: the byte is the biased
                # exponent. Kept as stored (no target: a U8 target would *convert* E8M0 values, 2**(b-127)
                # -> int, not keep the bits) and read through .view(uint8), so both give identical logits.
                TensorSpec("weight_scale", ("U8", "F8_E8M0"), (out_features, in_features // GROUP))]

    def split(self, direction: str, out_features: int, in_features: int) -> dict[str, SplitRule]:
        """Rows of both tensors follow out; along in, 2 values per byte and one scale per 32
        (vLLM ``layers/linear.py`` packed_dim=1 / packed_factor=2 for the fp4 weight), so a
        row-parallel part must hold whole 32-groups or the layer is replicated."""
        if direction == "out":
            return {"weight": SplitRule(0), "weight_scale": SplitRule(0)}
        return {"weight": SplitRule(1, 2, 1), "weight_scale": SplitRule(1, GROUP, 1)}

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        w = tensors.get("weight")
        if w is not None and (w.shape[-1] * 2) % GROUP:
            return [Problem(f"MXFP4 needs in_features divisible by {GROUP}, got {w.shape[-1] * 2}",
                            tensor=w.name, file=w.file.name)]
        return []

    def dequantize(self, layer: Layer, index: int | None = None) -> torch.Tensor:
        cached = getattr(layer, "_dequantized", None)
        if cached is not None:
            return cached if index is None else cached[index]
        w, s = layer.weight, layer.weight_scale
        if index is not None:
            w, s = w[index], s[index]
        return dequantize_mxfp4(w, s.view(torch.uint8), layer.model_dtype)

    def apply(self, layer: Layer, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        if getattr(layer, "_dequantized", None) is not None:
            return F.linear(x, self.dequantize(layer, index).to(x.dtype))
        w, s = layer.weight, layer.weight_scale
        if index is not None:
            w, s = w[index], s[index]
        return mxfp4_linear(x, w, s.view(torch.uint8), layer.model_dtype)

    def form(self, layer: Layer) -> Weights | None:
        """E2M1 codes (low nibble = even element) with E8M0 scales per 32 inputs; a cached dense copy
        as its float form."""
        dense = getattr(layer, "_dequantized", None)
        if dense is not None:
            name = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}.get(dense.dtype)
            return None if name is None else Weights(Form(name), dense)
        return Weights(Form("FP4", scale="E8M0", group=GROUP), layer.weight, scale=layer.weight_scale.view(torch.uint8))

    def process_after_loading(self, layer: Layer) -> None:
        if self.cache:
            layer.register_buffer("_dequantized", dequantize_mxfp4(layer.weight, layer.weight_scale.view(torch.uint8),
                                                                   layer.model_dtype), persistent=False)
