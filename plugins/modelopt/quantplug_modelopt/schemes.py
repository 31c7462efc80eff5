"""ModelOpt linear schemes: NVFP4 (``weight`` uint8 + e4m3 block scales + global scale) and FP8 per
tensor, weights kept as stored in memory, activations emulated from the stored ``input_scale``
unless ``activation_quant=none``. Both declare the core's compute form (the stored tensors as they
are: FP4 E2M1 with E4M3 scales times the global scale, FP8 per tensor), so the core's native
kernels run them; ``apply`` is the torch path with the same values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from quantplug.api import ActQuant, Form, LinearScheme, Problem, SplitRule, TensorInfo, TensorSpec, Weights

from . import kernels

ACTIVATION_MODES = ("emulate", "none")
WHOLE = SplitRule(None)


def _slot(t: torch.Tensor, index: int | None) -> torch.Tensor:
    return t if index is None else t[index]


class NVFP4Scheme(LinearScheme):
    """``weight`` U8 [out, in/2], ``weight_scale`` F8_E4M3 [out, in/16], ``weight_scale_2`` F32 [],
    ``input_scale`` F32 [] when the checkpoint stores activation scales (quant_algo NVFP4; not
    W4A16_NVFP4). Routed experts: the same per expert, stacked."""

    name = "nvfp4"

    def __init__(self, group: int, act: bool, mode: str, reason: str) -> None:
        self.group, self.act, self.mode, self.reason = group, act, mode, reason
        self.emulate = act and mode == "emulate"
        self.weight_only = not self.emulate

    def describe(self) -> str:
        w = f"nvfp4 (e4m3 scale per {self.group}, f32 global)"
        if not self.act:
            return f"{w}; weight-only"
        if self.emulate:
            return f"{w}; activations nvfp4 (input_scale global, emulated)"
        return f"{w}; activations NOT emulated (activation_quant=none)"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        specs = [TensorSpec("weight", ("U8",), (out_features, in_features // 2)),
                 TensorSpec("weight_scale", ("F8_E4M3",), (out_features, in_features // self.group)),
                 TensorSpec("weight_scale_2", ("F32",), (), target="F32")]
        if self.act:
            specs.append(TensorSpec("input_scale", ("F32",), (), target="F32"))
        return specs

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        w = tensors.get("weight")
        if w is not None and (w.shape[-1] * 2) % self.group:
            return [Problem(f"NVFP4 needs in_features divisible by {self.group}, got {w.shape[-1] * 2}",
                            tensor=w.name, file=w.file.name)]
        return []

    def split(self, direction: str, out_features: int, in_features: int) -> dict[str, SplitRule]:
        """Rows of ``weight`` / ``weight_scale`` follow out; along in, whole 16-groups: 8 bytes and
        one scale per group. The scalars are whole on every rank. Row-parallel activation
        emulation stays exact: its block scales are per 16 inputs of a token (whole groups per
        rank) under the static global scale."""
        names = [s.suffix for s in self.tensor_specs(out_features, in_features)]
        g = self.group
        if direction == "out":
            rules = {"weight": SplitRule(0), "weight_scale": SplitRule(0)}
        else:
            rules = {"weight": SplitRule(1, g, g // 2), "weight_scale": SplitRule(1, g, 1)}
        return {n: rules.get(n, WHOLE) for n in names}

    def dequantize(self, layer: Any, index: int | None = None) -> torch.Tensor:
        return kernels.dequantize_nvfp4(_slot(layer.weight, index), _slot(layer.weight_scale, index),
                                        _slot(layer.weight_scale_2, index), layer.model_dtype)

    def form(self, layer: Any) -> Weights:
        """FP4 E2M1 with E4M3 block scales per 16 and ``weight_scale_2`` folded into them first
        (``global_mode="times_scale"``: ``e2m1 * (f32(weight_scale) * weight_scale_2)``, the vendor's
        order); activations ``nvfp4`` under the static ``input_scale`` when emulated."""
        act = ActQuant("nvfp4", group=self.group) if self.emulate else None
        return Weights(Form("FP4", scale="E4M3", group=self.group, global_scale=True, global_mode="times_scale", act=act),
                       layer.weight, scale=layer.weight_scale, global_scale=layer.weight_scale_2,
                       input_scale=layer.input_scale if self.emulate else None)

    def apply(self, layer: Any, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        if self.emulate:
            x = kernels.nvfp4_act(x, _slot(layer.input_scale, index), self.group)
        w, s, s2 = _slot(layer.weight, index), _slot(layer.weight_scale, index), _slot(layer.weight_scale_2, index)
        return kernels.linear(x, lambda r0, r1, out: kernels.nvfp4_f32(w[r0:r1], s[r0:r1], s2, out),
                              w.shape[0], w.shape[1] * 2, layer.model_dtype)


class FP8Scheme(LinearScheme):
    """``weight`` F8_E4M3 [out, in], ``weight_scale`` F32 [], ``input_scale`` F32 [] (static FP8
    activations) when stored."""

    name = "fp8"

    def __init__(self, act: bool, mode: str, reason: str) -> None:
        self.act, self.mode, self.reason = act, mode, reason
        self.emulate = act and mode == "emulate"
        self.weight_only = not self.emulate

    def describe(self) -> str:
        w = "fp8 e4m3 per tensor"
        if not self.act:
            return f"{w}; weight-only"
        if self.emulate:
            return f"{w}; activations fp8 static per tensor (emulated)"
        return f"{w}; activations NOT emulated (activation_quant=none)"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        specs = [TensorSpec("weight", ("F8_E4M3",), (out_features, in_features)),
                 TensorSpec("weight_scale", ("F32",), (), target="F32")]
        if self.act:
            specs.append(TensorSpec("input_scale", ("F32",), (), target="F32"))
        return specs

    def split(self, direction: str, out_features: int, in_features: int) -> dict[str, SplitRule]:
        """``weight`` rows / columns; the per-tensor scales whole (static activations: exact)."""
        names = [s.suffix for s in self.tensor_specs(out_features, in_features)]
        rule = SplitRule(0 if direction == "out" else 1)
        return {n: rule if n == "weight" else WHOLE for n in names}

    def dequantize(self, layer: Any, index: int | None = None) -> torch.Tensor:
        return kernels.dequantize_fp8(_slot(layer.weight, index), _slot(layer.weight_scale, index), layer.model_dtype)

    def form(self, layer: Any) -> Weights:
        """FP8 E4M3 with one float32 scale per matrix; activations ``fp8_static`` (clamped to
        +-448, as :func:`kernels.fp8_act`) when emulated."""
        scale = layer.weight_scale
        if scale.dim() == 1:  # stacked experts: one scale per slot
            scale = scale.view(-1, 1, 1)
        act = ActQuant("fp8_static") if self.emulate else None
        return Weights(Form("FP8", rows=0, act=act), layer.weight, scale=scale,
                       input_scale=layer.input_scale if self.emulate else None)

    def apply(self, layer: Any, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        if self.emulate:
            x = kernels.fp8_act(x, _slot(layer.input_scale, index))
        w, s = _slot(layer.weight, index), _slot(layer.weight_scale, index)

        def rows(r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
            return torch.mul(kernels.e4m3_to_f32(w[r0:r1]), s.to(torch.float32).reshape(()), out=out)

        return kernels.linear(x, rows, w.shape[0], w.shape[1], layer.model_dtype)
