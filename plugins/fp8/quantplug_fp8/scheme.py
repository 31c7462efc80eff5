"""The block-FP8 linear scheme: F8_E4M3 weight kept as ``torch.float8_e4m3fn`` in memory (a
zero-copy view of the checkpoint where the loader allows), F32 ``weight_scale_inv`` per block.

Forward dequantizes block rows at a time (:func:`.kernels.linear`). With activation emulation
(the default, ``activation_quant=dynamic``) the input is first quantized as DeepSeek's
``act_quant`` does it (per token, groups of ``block[1]``), which is what the deployed FP8 GEMMs
(DeepSeek's ``fp8_gemm``, vLLM / sglang block-FP8 kernels, DeepGEMM) compute on;
``activation_quant=none`` is the weight-only model (DeepSeek's reference ``gemm_impl="bf16"``:
``weight_dequant`` then a bf16 matmul).

DeepSeek-V4's release (DeepSeek-V4's inference code model.py / convert.py, transformers 5.25's
``FP8Experts``): the same FP8 blocks with the scale named ``X.scale`` and stored as F8_E8M0 (W =
fp8 * 2^(s - 127)) or F32 (V4-Flash-Base), and routed experts in FP4 (:class:`FP4ExpertScheme`):
``X.weight`` I8 [N, K/2], byte j holding element 2j in the low nibble and 2j+1 in the high one,
E2M1 codes (bit 3 the sign), ``X.scale`` F8_E8M0 [N, K/32]. Both are the core's FP8 and FP4 forms
on the stored bytes (no dense copy at load); with ``activation_quant=dynamic`` the FP4 experts'
inputs are quantized as the FP8 linears' are (DeepSeek's ``act_quant`` before its ``fp4_gemm``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from quantplug.api import (
    ActQuant,
    Form,
    Layer,
    LinearScheme,
    Problem,
    SplitRule,
    TensorInfo,
    TensorSpec,
    Weights,
)

from . import kernels

ACTIVATION_MODES = ("dynamic", "none")
SCALE_DTYPES = ("F32", "BF16", "F16")
#: elements per E8M0 scale of an FP4 expert row
FP4_GROUP = 32
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
#: byte -> (element 2j, element 2j+1): the low nibble first
_BYTE_LUT = torch.stack((_E2M1[torch.arange(256) & 0x0F], _E2M1[torch.arange(256) >> 4]), dim=-1)


def e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """F8_E8M0 scale bytes -> float32 2^(byte - 127) (byte 255: NaN)."""
    b = scale.view(torch.uint8)
    v = torch.exp2(b.to(torch.float32) - 127.0)
    return torch.where(b == 255, torch.full_like(v, float("nan")), v)


def dequantize_fp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """I8 [..., N, K/2] packed E2M1 + F8_E8M0 [..., N, K/32] -> [..., N, K] (float32 products, then ``dtype``)."""
    vals = _BYTE_LUT.to(weight.device)[weight.view(torch.uint8).long()].flatten(-2)
    s = e8m0_values(scale)
    return (vals.unflatten(-1, (-1, FP4_GROUP)) * s.unsqueeze(-1)).flatten(-2).to(dtype)


class FP8BlockScheme(LinearScheme):
    """``weight`` F8_E4M3 [out, in] + ``weight_scale_inv`` [ceil(out/bn), ceil(in/bk)] (stacked
    with a leading expert dimension for routed experts). DeepSeek-V4: the scale is ``scale``
    (``scale_suffix``), F8_E8M0 (``scale_dtype="E8M0"``, kept as its bytes) or F32."""

    name = "fp8-block"

    def __init__(self, block: tuple[int, int], activation_quant: str = "dynamic", scale_fmt: str | None = None,
                 reason: str = "", scale_suffix: str = "weight_scale_inv", scale_dtype: str = "F32") -> None:
        self.block = block
        self.scale_suffix = scale_suffix
        self.scale_dtype = scale_dtype
        self.activation_quant = activation_quant
        self.scale_fmt = scale_fmt
        self.reason = reason
        #: weight-only (apply = dequantize then float matmul) lets MLA decode absorb kv_b_proj
        self.weight_only = activation_quant == "none"

    @property
    def key(self) -> str:
        e8m0 = " e8m0" if self.scale_dtype == "E8M0" else ""
        return f"fp8-block {self.block[0]}x{self.block[1]}{e8m0} {self.scale_suffix} act={self.activation_quant}"

    def describe(self) -> str:
        if self.activation_quant == "none":
            act = "activations not quantized (activation_quant=none: weight-only)"
        else:
            fmt = ", ue8m0 scales" if self.scale_fmt == "ue8m0" else ""
            act = f"activations fp8 e4m3 per token per {self.block[1]} (DeepSeek act_quant{fmt}; activation_quant=dynamic)"
        return f"fp8 e4m3 block {list(self.block)}, {self.scale_suffix} {self.scale_dtype.lower()}; {act}"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        shape = kernels.scale_shape(out_features, in_features, self.block)
        scale = (TensorSpec(self.scale_suffix, ("F8_E8M0",), shape) if self.scale_dtype == "E8M0" else
                 TensorSpec(self.scale_suffix, SCALE_DTYPES, shape, target="F32"))
        return [TensorSpec("weight", ("F8_E4M3",), (out_features, in_features)), scale]

    def split(self, direction: str, out_features: int, in_features: int) -> Mapping[str, SplitRule]:
        """Whole ``block`` tiles per rank: out by block rows (``weight`` rows, one scale row per
        ``block[0]``), in by block columns (one scale column per ``block[1]``); a slice that would
        cut a block replicates the layer (the core checks the bounds).

        Row-parallel with activation emulation stays exact: ``act_quant`` groups are
        ``block[1]`` consecutive input features of one token, starting at feature 0; this rank's
        input slice starts and ends on a multiple of ``block[1]`` (the rule below), so its groups
        are exactly the single-process groups it holds, quantized with the same per-group amax.
        Only the order of the partial-sum additions differs (the all-reduce)."""
        bn, bk = self.block
        if direction == "out":
            return {"weight": SplitRule(0, bn, bn), self.scale_suffix: SplitRule(0, bn, 1)}
        return {"weight": SplitRule(1, bk, bk), self.scale_suffix: SplitRule(1, bk, 1)}

    def _parts(self, layer: Layer, index: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight and its float32 scale (E8M0 bytes decoded: a few bytes per block)."""
        w: torch.Tensor = layer.weight
        s: torch.Tensor = getattr(layer, self.scale_suffix)
        if index is not None:
            w, s = w[index], s[index]
        return w, (e8m0_values(s) if self.scale_dtype == "E8M0" else s)

    def dequantize(self, layer: Layer, index: int | None = None) -> torch.Tensor:
        w, s = self._parts(layer, index)
        return kernels.dequantize(w, s, self.block, layer.model_dtype)

    def form(self, layer: Layer) -> Weights:
        """FP8 E4M3 codes with float32 scales per [block[0], block[1]] tile; DeepSeek's act_quant
        (per token, groups of block[1], amax floor 1e-4, ue8m0 as configured) as the form's
        activation quantization."""
        bn, bk = self.block
        act = (ActQuant("fp8", group=bk, ue8m0=self.scale_fmt == "ue8m0", floor=kernels.ACT_AMAX_FLOOR)
               if self.activation_quant == "dynamic" else None)
        scale = getattr(layer, self.scale_suffix)
        if self.scale_dtype == "E8M0":
            return Weights(Form("FP8", scale="E8M0", group=bk, rows=bn, act=act), layer.weight,
                           scale=scale.view(torch.uint8))
        return Weights(Form("FP8", scale="F32", group=bk, rows=bn, act=act), layer.weight, scale=scale)

    def apply(self, layer: Layer, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        if self.activation_quant == "dynamic":
            x = kernels.act_quant(x, self.block[1], self.scale_fmt)
        w, s = self._parts(layer, index)
        return kernels.linear(x, w, s, self.block, layer.model_dtype)


class FP4ExpertScheme(LinearScheme):
    """DeepSeek-V4's FP4 routed experts: ``weight`` I8 [out, in/2] (E2M1 codes, element 2j in the low
    nibble of byte j) + ``scale`` F8_E8M0 [out, in/32]; stacked with a leading expert dimension.
    Kept packed (the core's FP4 form with E8M0 scales per 32 inputs); ``activation_quant=dynamic``
    quantizes the input as the FP8 linears do (per token, groups of ``act_group``)."""

    name = "fp4-e2m1"

    def __init__(self, activation_quant: str = "dynamic", act_group: int = 128, scale_fmt: str | None = None,
                 reason: str = "") -> None:
        self.activation_quant = activation_quant
        self.act_group = act_group
        self.scale_fmt = scale_fmt
        self.reason = reason
        self.weight_only = activation_quant == "none"

    @property
    def key(self) -> str:
        return f"fp4-e2m1 e8m0/{FP4_GROUP} act={self.activation_quant}"

    def describe(self) -> str:
        act = ("activations not quantized (activation_quant=none: weight-only)" if self.weight_only else
               f"activations fp8 e4m3 per token per {self.act_group} (DeepSeek act_quant"
               f"{', ue8m0 scales' if self.scale_fmt == 'ue8m0' else ''}; activation_quant=dynamic)")
        return f"fp4 e2m1 packed (I8, low nibble first), scale e8m0 per {FP4_GROUP}; {act}"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        return [TensorSpec("weight", ("I8",), (out_features, in_features // 2)),
                TensorSpec("scale", ("F8_E8M0",), (out_features, in_features // FP4_GROUP))]

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        w = tensors.get("weight")
        if w is not None and (w.shape[-1] * 2) % FP4_GROUP:
            return [Problem(f"FP4 experts need in_features divisible by {FP4_GROUP} (one E8M0 scale per "
                            f"{FP4_GROUP}), got {w.shape[-1] * 2}", tensor=w.name, file=w.file.name)]
        return []

    def split(self, direction: str, out_features: int, in_features: int) -> Mapping[str, SplitRule]:
        if direction == "out":
            return {"weight": SplitRule(0), "scale": SplitRule(0)}
        return {"weight": SplitRule(1, 2, 1), "scale": SplitRule(1, FP4_GROUP, 1)}

    def _parts(self, layer: Layer, index: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        w: torch.Tensor = layer.weight
        s: torch.Tensor = layer.scale
        return (w, s) if index is None else (w[index], s[index])

    def dequantize(self, layer: Layer, index: int | None = None) -> torch.Tensor:
        w, s = self._parts(layer, index)
        return dequantize_fp4(w, s, layer.model_dtype)

    def form(self, layer: Layer) -> Weights:
        act = (ActQuant("fp8", group=self.act_group, ue8m0=self.scale_fmt == "ue8m0", floor=kernels.ACT_AMAX_FLOOR)
               if not self.weight_only else None)
        return Weights(Form("FP4", scale="E8M0", group=FP4_GROUP, act=act), layer.weight,
                       scale=layer.scale.view(torch.uint8))

    def apply(self, layer: Layer, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        if not self.weight_only:
            x = kernels.act_quant(x, self.act_group, self.scale_fmt)
        return F.linear(x, self.dequantize(layer, index).to(x.dtype))
