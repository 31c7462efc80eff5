"""The block-FP8 linear scheme: F8_E4M3 weight kept as ``torch.float8_e4m3fn`` in memory (a
zero-copy view of the checkpoint where the loader allows), F32 ``weight_scale_inv`` per block.

Forward dequantizes block rows at a time (:func:`.kernels.linear`). With activation emulation
(the default, ``activation_quant=dynamic``) the input is first quantized as DeepSeek's
``act_quant`` does it (per token, groups of ``block[1]``), which is what the deployed FP8 GEMMs
(DeepSeek's ``fp8_gemm``, vLLM / sglang block-FP8 kernels, DeepGEMM) compute on;
``activation_quant=none`` is the weight-only model (DeepSeek's reference ``gemm_impl="bf16"``:
``weight_dequant`` then a bf16 matmul).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from quantplug.api import ActQuant, Form, Layer, LinearScheme, SplitRule, TensorSpec, Weights

from . import kernels

ACTIVATION_MODES = ("dynamic", "none")
SCALE_DTYPES = ("F32", "BF16", "F16")


class FP8BlockScheme(LinearScheme):
    """``weight`` F8_E4M3 [out, in] + ``weight_scale_inv`` [ceil(out/bn), ceil(in/bk)] (stacked
    with a leading expert dimension for routed experts)."""

    name = "fp8-block"

    def __init__(self, block: tuple[int, int], activation_quant: str = "dynamic", scale_fmt: str | None = None,
                 reason: str = "") -> None:
        self.block = block
        self.activation_quant = activation_quant
        self.scale_fmt = scale_fmt
        self.reason = reason
        #: weight-only (apply = dequantize then float matmul) lets MLA decode absorb kv_b_proj
        self.weight_only = activation_quant == "none"

    @property
    def key(self) -> str:
        return f"fp8-block {self.block[0]}x{self.block[1]} act={self.activation_quant}"

    def describe(self) -> str:
        if self.activation_quant == "none":
            act = "activations not quantized (activation_quant=none: weight-only)"
        else:
            fmt = ", ue8m0 scales" if self.scale_fmt == "ue8m0" else ""
            act = f"activations fp8 e4m3 per token per {self.block[1]} (DeepSeek act_quant{fmt}; activation_quant=dynamic)"
        return f"fp8 e4m3 block {list(self.block)}, weight_scale_inv f32; {act}"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        return [TensorSpec("weight", ("F8_E4M3",), (out_features, in_features)),
                TensorSpec("weight_scale_inv", SCALE_DTYPES,
                           kernels.scale_shape(out_features, in_features, self.block), target="F32")]

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
            return {"weight": SplitRule(0, bn, bn), "weight_scale_inv": SplitRule(0, bn, 1)}
        return {"weight": SplitRule(1, bk, bk), "weight_scale_inv": SplitRule(1, bk, 1)}

    def _parts(self, layer: Layer, index: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        w: torch.Tensor = layer.weight
        s: torch.Tensor = layer.weight_scale_inv
        return (w, s) if index is None else (w[index], s[index])

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
        return Weights(Form("FP8", scale="F32", group=bk, rows=bn, act=act), layer.weight,
                       scale=layer.weight_scale_inv)

    def apply(self, layer: Layer, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        if self.activation_quant == "dynamic":
            x = kernels.act_quant(x, self.block[1], self.scale_fmt)
        w, s = self._parts(layer, index)
        return kernels.linear(x, w, s, self.block, layer.model_dtype)
