"""The compressed-tensors linear scheme: packed int4 / int8, naive int8, FP8 E4M3 weights kept as
stored in memory, activations fake-quantized as the config says (or not: ``activation_quant=none``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from quantplug.api import (
    FLOATS,
    TORCH_DTYPES,
    ActQuant,
    Form,
    LinearScheme,
    LoadError,
    Problem,
    SplitRule,
    TensorInfo,
    TensorSpec,
    Weights,
    fuse_int4_packs,
    native,
    unsplit_features,
)

from . import kernels
from .config import QuantArgs
from .kernels import Layout

SCALES = ("weight_scale", "input_scale")


def describe_activations(act: QuantArgs) -> str:
    kind = "fp8" if act.type == "float" else f"int{act.num_bits}"
    if act.dynamic in (True, "local"):
        how = f"dynamic per-token group {act.group_size}" if act.strategy == "group" else "dynamic per token"
    else:
        how = "static per tensor"
    return f"{kind} {how}"


class CTScheme(LinearScheme):
    """One compressed-tensors linear (or a stack of routed experts sharing a config group).

    ``kind``: "packed" (pack-quantized int32 words), "int8" or "fp8" (naive / int / float
    quantized). ``act``: the config's input activations (None: weight-only), emulated unless
    ``act_mode`` is "none".
    """

    name = "compressed-tensors"

    def __init__(self, fmt: str, kind: str, weights: QuantArgs, act: QuantArgs | None, act_mode: str,
                 reason: str, kernels: str = "exact") -> None:
        self.fmt, self.kind, self.weights, self.act, self.act_mode = fmt, kind, weights, act, act_mode
        self.reason = reason
        #: "exact" (dequantize exactly, float matmul) or "fast": pack-quantized int4 weight-only
        #: layers through torch's int4 kernel (kernels.int4_repack; bfloat16 activations)
        self.fast = (kernels == "fast" and kind == "packed" and weights.num_bits == 4
                     and weights.strategy in ("group", "channel", "tensor") and (act is None or act_mode == "none"))
        self.kernels = kernels
        #: exact kernels are dequantize then float matmul: MLA decode may absorb kv_b through them
        self.weight_only = (act is None or act_mode == "none") and not self.fast

    def takes_fast(self) -> bool:
        """Under ``kernels="fast"``: pack-quantized int4 weight-only layers (torch's int4 kernel)."""
        return self.fast

    def describe(self) -> str:
        w = f"{self.fmt} {self.weights.describe()}" + ("; fast int4 kernel" if self.fast else "")
        if self.act is None:
            return f"{w}; weight-only"
        a = describe_activations(self.act)
        if self.act_mode == "none":
            return f"{w}; activations {a} NOT emulated (activation_quant=none)"
        return f"{w}; activations {a} (emulated)"

    # -- storage --------------------------------------------------------------------------------

    def layout(self, out_features: int, in_features: int) -> Layout:
        w = self.weights
        return Layout(self.kind, w.num_bits, w.strategy, w.group_size, w.block_structure, out_features, in_features)

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        lay = self.layout(out_features, in_features)
        specs: list[TensorSpec] = []
        if self.kind == "packed":
            specs += [TensorSpec("weight_packed", ("I32",), (out_features, lay.packed_cols())),
                      TensorSpec("weight_shape", ("I64", "I32"), (2,))]
        else:
            specs.append(TensorSpec("weight", ("I8",) if self.kind == "int8" else ("F8_E4M3",),
                                    (out_features, in_features)))
        specs.append(TensorSpec("weight_scale", FLOATS, lay.scale_shape()))
        if not self.weights.symmetric:
            specs.append(TensorSpec("weight_zero_point", ("I32",) if self.kind == "packed" else ("I8", "I32"),
                                    lay.zp_shape()))
        if self.act is not None and self.act.dynamic is False:
            specs.append(TensorSpec("input_scale", FLOATS, (1,)))
        return specs

    def split(self, direction: str, out_features: int, in_features: int) -> dict[str, SplitRule] | str:
        """Tensor-parallel rules per stored tensor (vLLM ``compressed_tensors`` schemes'
        ``output_dim`` / ``input_dim`` / ``packed_dim`` weight attributes, checked here):

        * pack-quantized ``weight_packed`` [out, in*bits/32]: rows follow out; along in,
          32/bits values per int32 word -> (1, 32/bits, 1). Zero points are packed along *out*
          ([out*bits/32, groups]) -> (0, 32/bits, 1) under a column split, group columns under a
          row split. ``weight_shape`` (the whole layer's [out, in]) is whole on every rank;
        * naive int8 / fp8 ``weight`` [out, in]: (0, 1, 1) / (1, 1, 1), in whole blocks for the
          block strategy;
        * scales (and unpacked zero points): per tensor [1] whole; per channel [out, 1] rows
          under out, whole under in; per group [out, in/group] rows / (1, group, 1); per block
          (0, bh, 1) / (1, bw, 1);
        * ``input_scale`` (static per tensor) whole.

        Row-parallel activations: static per-tensor quantization is the same on every rank;
        dynamic per-token quantization (int8 or fp8 ``strategy: token``) takes its scale over the
        whole input row, which one rank does not hold: refused (the layer is replicated) unless
        activations are not emulated (``activation_quant=none``); dynamic fp8 per-token groups
        stay exact when every rank's slice holds whole groups (the weight's in rule is widened to
        the least common multiple of its unit and the activation group)."""
        lay = self.layout(out_features, in_features)
        w = self.weights
        names = [s.suffix for s in self.tensor_specs(out_features, in_features)]
        whole = SplitRule(None)
        per = 32 // w.num_bits if self.kind == "packed" else 1
        if direction == "out":
            rows = SplitRule(0, lay.block[0], lay.block[0]) if lay.strategy == "block" and lay.block else SplitRule(0)
            scale = (whole if lay.strategy == "tensor" else
                     SplitRule(0, lay.block[0], 1) if lay.strategy == "block" and lay.block else SplitRule(0))
            zp = SplitRule(0, per, 1) if self.kind == "packed" and lay.strategy in ("group", "channel") else scale
            rules = {"weight": rows, "weight_packed": rows, "weight_shape": whole, "weight_scale": scale,
                     "weight_zero_point": zp, "input_scale": whole}
            return {n: rules[n] for n in names}
        act = self.act
        act_group = 1
        if act is not None and self.act_mode != "none" and act.dynamic is not False:
            if act.strategy == "group" and act.group_size:
                act_group = act.group_size
            else:
                return (f"dynamic per-token activation quantization ({describe_activations(act)}) spans the whole "
                        "input row; a row-parallel slice would quantize differently")
        if lay.strategy == "block" and lay.block:
            unit, scale = lay.block[1], SplitRule(1, lay.block[1], 1)
        elif lay.strategy == "group" and lay.group:
            unit, scale = lay.group, SplitRule(1, lay.group, 1)
        elif lay.strategy in ("tensor", "channel"):
            unit, scale = per, whole
        else:
            return f"weight strategy {lay.strategy!r}: no row-parallel rule"
        # features per rule: whole words / groups / blocks and whole activation groups
        f = math.lcm(unit, per, act_group)
        weight = SplitRule(1, f, f // per)
        if scale.axis is not None:
            scale = SplitRule(1, f, f // scale.features)
        rules = {"weight": weight, "weight_packed": weight, "weight_shape": whole, "weight_scale": scale,
                 "weight_zero_point": scale, "input_scale": whole}
        return {n: rules[n] for n in names}

    def target_dtype(self, spec: TensorSpec, model_dtype: torch.dtype, stored: str) -> torch.dtype:
        if spec.suffix in SCALES:
            return TORCH_DTYPES[stored]  # scales stay as stored: products are taken in float32 anyway
        return super().target_dtype(spec, model_dtype, stored)

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        w, t = self.weights, tensors.get("weight")
        # compressed-tensors requires in_features % group_size == 0 (forward_helpers._process_group)
        if t is not None and w.strategy == "group" and w.group_size and t.shape[-1] % w.group_size:
            return [Problem(f"group {w.group_size}: in_features {t.shape[-1]} is not a multiple of the group",
                            tensor=t.name, file=t.file.name)]
        return []

    def process_after_loading(self, layer: Any) -> None:
        if self.kind == "packed":
            shape = layer.weight_shape.to(torch.int64).reshape(-1, 2)
            want = torch.tensor(unsplit_features(layer))  # the whole layer's, split or not
            bad = (shape != want).any(-1).nonzero().flatten().tolist()
            if bad:
                where = f"{layer.qp_ckpt}" + (f" (expert slot {bad[0]})" if shape.shape[0] > 1 else "")
                raise LoadError(f"{where}.weight_shape holds {shape[bad[0]].tolist()}, but the model and the "
                                f"packed tensors say [{layer.out_features}, {layer.in_features}]")
        if not self.weights.symmetric:
            zp = layer.weight_zero_point
            if self.kind == "packed":
                lay = self._layout_of(layer)
                flat = zp.reshape(-1, *zp.shape[-2:])
                z = torch.stack([kernels.unpack_zero_point(t, lay.bits, lay.out_features) for t in flat])
                z = z.reshape(*zp.shape[:-2], lay.out_features, zp.shape[-1])
            else:
                z = zp.float()
            layer.register_buffer("_zero_point", z, persistent=False)
        if self.fast and native.library() is None:
            # without the native kernels only: repacked once, here, for torch's int4 kernel
            # (counted in load time and model bytes); the packed weight stays for dequantize /
            # export. Shapes the kernel cannot take (out % 16) stay exact. With them, the core's
            # exact native kernels run the stored words (faster per decode step than the int4
            # kernel, and no second copy)
            fast = kernels.int4_repack(self._layout_of(layer), layer.weight_packed, layer.weight_scale,
                                       getattr(layer, "_zero_point", None))
            if fast is not None:
                layer.register_buffer("_int4", fast[0], persistent=False)
                layer.register_buffer("_int4_sz", fast[1], persistent=False)
                layer._int4_group = fast[2]
                if fast[0].dim() == 3:  # stacked experts: each slot's views, made once
                    layer._int4_slots = list(zip(fast[0].unbind(0), fast[1].unbind(0)))

    # -- compute --------------------------------------------------------------------------------

    def form(self, layer: Any) -> Weights | None:
        """The stored tensors as the core's form: pack-quantized int4 words read as bytes (INT4),
        naive int8 (INT8) or FP8, the scales as stored, unpacked zero points; activations as the
        config quantizes them (unless ``activation_quant=none``). Pack-quantized 8-bit words
        (unsigned codes) have no form: the scheme's own path runs them."""
        if self.kind == "packed" and self.weights.num_bits != 4:
            return None
        lay = self._layout_of(layer)
        scale = layer.weight_scale
        enc = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}.get(scale.dtype)
        if enc is None:
            return None
        if lay.strategy == "tensor":
            rows, group = 0, 0
        elif lay.strategy == "channel":
            rows, group = 1, 0
        elif lay.strategy == "group" and lay.group:
            rows, group = 1, lay.group
        elif lay.strategy == "block" and lay.block:
            rows, group = lay.block
        else:
            return None
        zero = getattr(layer, "_zero_point", None)
        if zero is not None:
            zero = zero.to(torch.float32).contiguous()
        act, extra = None, {}
        a = self.act
        if a is not None and self.act_mode != "none":
            static = a.dynamic is False
            if a.type == "float":
                act = ActQuant("fp8_static") if static else ActQuant("fp8", group=(a.group_size or 0) if a.strategy == "group" else 0)
            else:
                act = ActQuant("int8_static") if static else ActQuant("int8_sym")
            if static:
                extra["input_scale"] = layer.input_scale
        dtype = "INT4" if self.kind == "packed" else "INT8" if self.kind == "int8" else "FP8"
        q = layer.weight_packed if self.kind == "packed" else layer.weight
        return Weights(Form(dtype, scale=enc, group=group, rows=rows, zero=zero is not None, act=act), q,
                       scale=scale, zero=zero, **extra)

    def _layout_of(self, layer: Any) -> Layout:
        lay = getattr(layer, "_ct_layout", None)
        if lay is None:
            lay = self.layout(layer.out_features, layer.in_features)
            layer._ct_layout = lay
        return lay

    def _parts(self, layer: Any, index: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q = layer.weight_packed if self.kind == "packed" else layer.weight
        s = layer.weight_scale
        z = getattr(layer, "_zero_point", None)
        if index is not None:
            q, s = q[index], s[index]
            z = z[index] if z is not None else None
        return q, s, z

    def _nan_codes(self, layer: Any) -> bool | None:
        """fp8: whether the weight holds NaN codes, looked up once per layer (None: not fp8)."""
        if self.kind != "fp8":
            return None
        found = getattr(layer, "_ct_nan_codes", None)
        if found is None:
            found = layer._ct_nan_codes = kernels.has_nan_codes(layer.weight)
        return found

    def dequantize(self, layer: Any, index: int | None = None, rows: tuple[int, int] | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        q, s, z = self._parts(layer, index)
        return kernels.dequantize(self._layout_of(layer), q, s, z, dtype or layer.model_dtype, rows,
                                  nan_codes=self._nan_codes(layer))

    def quantize_input(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        act = self.act
        if act is None or self.act_mode == "none":
            return x
        static = layer.input_scale if act.dynamic is False else None
        if act.type == "float":
            return kernels.fp8_quant(x, act.group_size if act.strategy == "group" else None, static)
        return kernels.int8_quant(x, static)

    def apply(self, layer: Any, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        pack = getattr(layer, "_int4", None)
        if pack is not None:  # fast: weight-only by construction (no activation quantization)
            if index is not None:
                slot_pack, slot_sz = layer._int4_slots[index]
                return kernels.int4_linear(x, slot_pack, slot_sz, layer._int4_group)
            return kernels.int4_linear(x, pack, layer._int4_sz, layer._int4_group)
        x = self.quantize_input(layer, x)
        lay = self._layout_of(layer)
        q, s, z = self._parts(layer, index)
        align = lay.block[0] if lay.strategy == "block" and lay.block else 1
        nan = self._nan_codes(layer)
        return kernels.linear(x, lambda r0, r1: kernels.dequantize(lay, q, s, z, x.dtype, (r0, r1), nan_codes=nan),
                              lay.out_features, lay.in_features, align)

    def fuse(self, layers: Sequence[Any]) -> Callable[..., torch.Tensor] | None:
        """Under ``kernels="fast"``: siblings repacked for the int4 kernel with one group size become
        one kernel weight, rows side by side (``fuse_int4_packs``: each layer's pack becomes a view
        of it; the fused scales-and-zeros are the one new buffer)."""
        groups = {getattr(layer, "_int4_group", None) for layer in layers}
        group = groups.pop() if len(groups) == 1 else None
        fused = fuse_int4_packs(layers) if group is not None else None
        if group is None or fused is None:
            return None
        pack, sz = fused
        return kernels.Int4Fused(pack, sz, group)

    def apply_grouped(self, layer: Any, x: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
        pack = getattr(layer, "_int4", None)
        if pack is None or len(groups) == 1:
            return super().apply_grouped(layer, x, groups)
        return kernels.int4_grouped(x, layer._int4_slots, layer._int4_group, groups)
