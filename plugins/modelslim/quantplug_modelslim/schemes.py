"""msModelSlim linear schemes, int8 / int4 weights kept packed in memory.

Numerics (msmodelslim 26.1.0: ``msmodelslim/core/quant_service/modelslim_v1/save/ascendv1.py`` and
``.../save/utils/pack.py`` for the stored tensors, its fake-quant modules for the activations;
vllm-ascend ``vllm_ascend/quantization/modelslim_config.py``; checked by reproducing
msmodelslim's fake-quant logits on the vendor fixtures): weight
w = (w_q - weight_offset) * weight_scale. W8A8 static activations
q = clamp(round(x / input_scale + input_offset), -128, 127). Dynamic activations per token,
either "msmodelslim" (asymmetric: lo = min(min x, 0), hi = max(max x, 0), s = (hi - lo) / 255,
o = round(-128 - lo / s)) or "ascend" (torch_npu.npu_dynamic_quant: symmetric, s = max|x| / 127).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from quantplug.api import ActQuant, Form, Layer, LinearScheme, SplitRule, TensorSpec, Weights

ACTIVATION_MODES = ("ascend", "msmodelslim")


def deq_scale_f32(deq: torch.Tensor) -> torch.Tensor:
    """deq_scale as fp32: int64 holding fp32 bits (msmodelslim for fp16 models) or plain fp32."""
    if deq.dtype == torch.int64:
        return (deq & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return deq.to(torch.float32)


def dynamic_quant(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token int8 quantization of x [..., k] -> (q, scale [..., 1], offset [..., 1])."""
    x = x.to(torch.float32)
    if mode == "ascend":
        s = x.abs().amax(-1, keepdim=True) / 127.0
        s = torch.where(s == 0, torch.ones_like(s), s)
        return torch.clamp(torch.round(x / s), -128, 127), s, torch.zeros_like(s)
    lo = torch.clamp(x.amin(-1, keepdim=True), max=0)
    hi = torch.clamp(x.amax(-1, keepdim=True), min=0)
    s = (hi - lo) / 255.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    o = torch.round(-128 - lo / s)
    return torch.clamp(torch.round(x / s + o), -128, 127), s, o


def int8_matmul(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int8 q [..., k] x int8 w [n, k] -> exact int32 [..., n] (``torch._int_mm``, CPU: any shape)."""
    return torch._int_mm(q.reshape(-1, q.shape[-1]), w.t()).view(*q.shape[:-1], w.shape[0])


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., n/2, k] (low nibble = even row, high nibble = odd row, signed) -> int8 [..., n, k]."""
    p = packed.view(torch.int8) if packed.dtype != torch.int8 else packed
    lo = torch.bitwise_right_shift(torch.bitwise_left_shift(p, 4), 4)  # sign-extend the low nibble
    hi = torch.bitwise_right_shift(p, 4)
    return torch.stack((lo, hi), dim=-2).flatten(-3, -2)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], [..., n, k] -> int8 [..., n/2, k] (inverse of unpack_int4_rows)."""
    q = q.to(torch.int16)
    lo, hi = q[..., 0::2, :] & 0x0F, (q[..., 1::2, :] & 0x0F) << 4
    return (lo | hi).to(torch.uint8).view(torch.int8)


class _IntScheme(LinearScheme):
    desc_type = ""

    @property
    def key(self) -> str:
        return self.desc_type

    def _weight_q(self, layer: Layer, index: int | None) -> torch.Tensor:
        w = layer.weight
        return w if index is None else w[index]

    def _part(self, layer: Layer, name: str, index: int | None) -> torch.Tensor:
        t = getattr(layer, name)
        return t if index is None else t[index]

    def dequantize(self, layer: Layer, index: int | None = None) -> torch.Tensor:
        wq = self._weight_q(layer, index).to(torch.float32)
        ws, wo = self._part(layer, "weight_scale", index), self._part(layer, "weight_offset", index)
        if ws.shape[-1] not in (1, wq.shape[-1]):  # per-group scales along k
            ws = ws.repeat_interleave(wq.shape[-1] // ws.shape[-1], dim=-1)
            wo = wo.repeat_interleave(wq.shape[-1] // wo.shape[-1], dim=-1)
        return ((wq - wo) * ws).to(layer.model_dtype)


class W8A8Static(_IntScheme):
    """Ascend W8A8: x quantized with the calibrated per-tensor scale/offset, int8 x int8 -> int32,
    + quant_bias, * deq_scale. With a non-zero weight_offset (not produced for Ascend) the
    weight is dequantized instead."""

    name = desc_type = "W8A8"

    def describe(self) -> str:
        return "W8A8 (int8 weight per-channel, static per-tensor activation; Ascend kernel emulation)"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        n = out_features
        return [TensorSpec("weight", ("I8",), (n, in_features)),
                TensorSpec("weight_scale", ("F32", "F16", "BF16"), (n, 1), target="F32"),
                TensorSpec("weight_offset", ("F32", "F16", "BF16"), (n, 1), target="F32"),
                TensorSpec("input_scale", ("F32", "F16", "BF16"), (1,), target="F32"),
                TensorSpec("input_offset", ("F32", "F16", "BF16"), (1,), target="F32"),
                TensorSpec("quant_bias", ("I32",), (n,)),
                TensorSpec("deq_scale", ("I64", "F32"), (n,))]

    def split(self, direction: str, out_features: int, in_features: int) -> dict[str, SplitRule]:
        """Column-parallel: every out-indexed tensor by rows, the per-tensor activation scale and
        offset whole. Row-parallel: weight columns; the per-output ``quant_bias`` (a constant of
        the int32 accumulator) is added on rank 0 only, so the all-reduce counts it once; the
        static per-tensor input quantization is the same on every rank (vllm-ascend's W8A8
        static method: ``quant_bias = layer.quant_bias if tp_rank == 0 else None``)."""
        if direction == "out":
            rows = SplitRule(0)
            return {"weight": rows, "weight_scale": rows, "weight_offset": rows, "input_scale": SplitRule(None),
                    "input_offset": SplitRule(None), "quant_bias": rows, "deq_scale": rows}
        whole = SplitRule(None)
        return {"weight": SplitRule(1), "weight_scale": whole, "weight_offset": whole, "input_scale": whole,
                "input_offset": whole, "quant_bias": SplitRule(None, once=True), "deq_scale": whole}

    def process_after_loading(self, layer: Layer) -> None:
        layer.register_buffer("_deq", deq_scale_f32(layer.deq_scale), persistent=False)
        layer._symmetric = bool((layer.weight_offset == 0).all())

    def form(self, layer: Layer) -> Weights:
        """int8 weights; activations quantized with the static scale / offset. Symmetric weights:
        ``(q . w + quant_bias) * deq_scale`` on integers, as :meth:`apply`; otherwise the float
        product of ``(q - offset) * scale`` and the dequantized weights."""
        if layer._symmetric:
            return Weights(Form("INT8", act=ActQuant("int8_static", integer="static")), layer.weight,
                           scale=layer.weight_scale.to(torch.float32), bias=layer.quant_bias, output_scale=layer._deq,
                           input_scale=layer.input_scale, input_offset=layer.input_offset)
        return Weights(Form("INT8", zero=True, act=ActQuant("int8_static")), layer.weight,
                       scale=layer.weight_scale.to(torch.float32), zero=layer.weight_offset.to(torch.float32),
                       input_scale=layer.input_scale, input_offset=layer.input_offset)

    def apply(self, layer: Layer, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        s, o = layer.input_scale.to(torch.float32), layer.input_offset.to(torch.float32)
        q = torch.clamp(torch.round(x.to(torch.float32) / s + o), -128, 127)
        if not layer._symmetric:
            w = self.dequantize(layer).to(torch.float32)
            return F.linear((q - o) * s, w).to(x.dtype)
        # int8 x int8 -> int32, as the deployed kernel computes (the same integers the float64
        # emulation produced, so the same logits, from an int8 GEMM instead of a float64 one)
        acc = int8_matmul(q.to(torch.int8), layer.weight) + layer.quant_bias
        return (acc.to(torch.float32) * layer._deq).to(x.dtype)

    def apply_row_parallel(self, layer: Layer, x: torch.Tensor,
                           all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Row-parallel: the int32 partial accumulators are summed over the ranks (``quant_bias``
        on rank 0 only), then scaled once: exactly the one-process integers and result."""
        if not layer._symmetric:
            return all_reduce(self.apply(layer, x))
        s, o = layer.input_scale.to(torch.float32), layer.input_offset.to(torch.float32)
        q = torch.clamp(torch.round(x.to(torch.float32) / s + o), -128, 127)
        acc = all_reduce(int8_matmul(q.to(torch.int8), layer.weight) + layer.quant_bias)
        return (acc.to(torch.float32) * layer._deq).to(x.dtype)


class W8A8Dynamic(_IntScheme):
    """int8 weight (per-channel or per-group scales), per-token dynamic int8 activations."""

    name = desc_type = "W8A8_DYNAMIC"

    def __init__(self, mode: str = "ascend", group_size: int = 0) -> None:
        self.mode = mode
        self.group_size = group_size

    def describe(self) -> str:
        group = f", weight group {self.group_size}" if self.group_size else ""
        return f"{self.desc_type} (activations per token: {self.mode}{group})"

    def _scale_shape(self, n: int, k: int) -> tuple[int, int]:
        return (n, k // self.group_size) if self.group_size else (n, 1)

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        n, sc = out_features, self._scale_shape(out_features, in_features)
        return [TensorSpec("weight", ("I8",), (n, in_features)),
                TensorSpec("weight_scale", ("F32", "F16", "BF16"), sc, target="F32"),
                TensorSpec("weight_offset", ("F32", "F16", "BF16"), sc, target="F32")]

    def split(self, direction: str, out_features: int, in_features: int) -> dict[str, SplitRule] | str:
        """Column-parallel by rows. Row-parallel would need the per-token activation scale over
        the whole input row (an all-reduce of min / max inside apply): not done, so the layer is
        replicated rather than quantized differently from one process."""
        if direction == "in":
            return "per-token dynamic activation quantization spans the whole input row"
        return {s.suffix: SplitRule(0, 2 if s.suffix == "weight" and self.desc_type == "W4A8_DYNAMIC" else 1)
                for s in self.tensor_specs(out_features, in_features)}

    def process_after_loading(self, layer: Layer) -> None:
        # per-channel symmetric int8 weights (what Ascend deploys): the int8 x int8 -> int32 path
        layer._int_path = (self.desc_type == "W8A8_DYNAMIC" and not self.group_size
                           and bool((layer.weight_offset == 0).all()))
        if layer._int_path:
            layer.register_buffer("_row_sum", layer.weight.to(torch.int32).sum(-1), persistent=False)

    def _act(self, integer: str = "float") -> ActQuant:
        return ActQuant("int8_sym" if self.mode == "ascend" else "int8_asym", integer=integer)

    def form(self, layer: Layer) -> Weights:
        """int8 weights, per-token int8 activations: on integers for per-channel symmetric weights
        (``((q . w - o * rowsum) * s) * scale``, as :meth:`apply`), else the float product of
        ``(q - o) * s`` and ``(w - offset) * scale``."""
        if layer._int_path:
            return Weights(Form("INT8", act=self._act("dynamic")), layer.weight, scale=layer.weight_scale)
        return Weights(Form("INT8", group=self.group_size, zero=True, act=self._act()), layer.weight,
                       scale=layer.weight_scale, zero=layer.weight_offset)

    def apply(self, layer: Layer, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        q, s, o = dynamic_quant(x, self.mode)
        if getattr(layer, "_int_path", False):
            # s * ws * sum_k (q_k - o) w_k = s * ws * (q . w - o * sum_k w_k), the dot in int32
            w, ws, rs = (layer.weight, layer.weight_scale, layer._row_sum) if index is None else \
                (layer.weight[index], layer.weight_scale[index], layer._row_sum[index])
            acc = int8_matmul(q.to(torch.int8), w) - o.to(torch.int32) * rs
            return (acc.to(torch.float32) * s * ws.view(-1)).to(x.dtype)
        w = self.dequantize(layer, index).to(torch.float32)
        return F.linear((q - o) * s, w).to(x.dtype)


class W4A8Dynamic(W8A8Dynamic):
    """int4 weight packed two rows per byte along the output dim, per-channel scale; int8 dynamic
    activations. ``scale_bias`` (a kernel correction term) is loaded and not needed here."""

    name = desc_type = "W4A8_DYNAMIC"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        n, sc = out_features, self._scale_shape(out_features, in_features)
        return [TensorSpec("weight", ("I8",), (n // 2, in_features)),
                TensorSpec("weight_scale", ("F32", "F16", "BF16"), sc, target="F32"),
                TensorSpec("weight_offset", ("F32", "F16", "BF16"), sc, target="F32", optional=True),
                TensorSpec("scale_bias", ("F32", "F16", "BF16"), (n, 1), target="F32", optional=True)]

    def _weight_q(self, layer: Layer, index: int | None) -> torch.Tensor:
        packed = getattr(layer, "_int4k", None)
        if packed is not None:  # repacked at load (the core's INT4 form)
            p = packed if index is None else packed[index]
            nib = torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)
            return (nib.to(torch.int16) - 8).to(torch.int8)
        return unpack_int4_rows(super()._weight_q(layer, index))

    def process_after_loading(self, layer: Layer) -> None:
        """The two-rows-per-byte int4 weight is repacked once into the core's INT4 form (two inputs
        per byte, code + 8): the same bytes, and the stored tensor is released."""
        q = unpack_int4_rows(layer.weight).to(torch.int16) + 8          # [.., n, k] in 0..15
        layer.register_buffer("_int4k", (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8).contiguous(),
                              persistent=False)
        del layer._parameters["weight"]
        layer._int_path = False

    def form(self, layer: Layer) -> Weights:
        return Weights(Form("INT4", group=self.group_size, act=self._act()), layer._int4k, scale=layer.weight_scale)

    def dequantize(self, layer: Layer, index: int | None = None) -> torch.Tensor:
        wq = self._weight_q(layer, index).to(torch.float32)
        ws = self._part(layer, "weight_scale", index)
        if ws.shape[-1] not in (1, wq.shape[-1]):
            ws = ws.repeat_interleave(wq.shape[-1] // ws.shape[-1], dim=-1)
        return (wq * ws).to(layer.model_dtype)
