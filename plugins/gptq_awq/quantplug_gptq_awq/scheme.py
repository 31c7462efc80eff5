"""The GPTQ / AWQ linear scheme: int4 / int8 values in their int32 words, group scales and packed
zero points, weight-only (these formats do not quantize activations, so ``weight_only`` holds and
MLA decode absorbs kv_b).

At load the words are repacked once into the core's INT4 / INT8 form (kernels.repack: the same
bytes, the stored tensors released), which the core's native kernels compute with; ``dequantize``
and ``apply`` read the repacked tensors. A ``g_idx`` that permutes groups (real act-order) has no
form: those layers keep their words and run on the torch path (g_idx gathered per input)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from quantplug.api import (
    FLOATS,
    TORCH_DTYPES,
    Form,
    LinearScheme,
    LoadError,
    Problem,
    SplitRule,
    TensorInfo,
    TensorSpec,
    Weights,
    unsplit_features,
)

from . import kernels
from .config import LayerQuant
from .kernels import IntPack

WHOLE = SplitRule(None)


class IntPackScheme(LinearScheme):
    """``qweight`` / ``qzeros`` / ``scales`` (+ GPTQ ``g_idx``) of one linear or a stack of experts."""

    weight_only = True

    def __init__(self, pack: IntPack, quant: LayerQuant, reason: str) -> None:
        self.pack, self.quant, self.reason = pack, quant, reason
        self.name = pack.name
        self.per = 32 // quant.bits

    def describe(self) -> str:
        zeros = " (zeros stored - 1)" if self.pack.zero_offset else ""
        order = "; a g_idx that permutes groups runs on the torch path (no compute form)" if self.quant.desc_act else ""
        return f"{self.pack.name} {self.quant.describe()}{zeros}; weight-only{order}"

    def groups(self, in_features: int) -> int:
        g = self.quant.group_size
        return 1 if g <= 0 else -(-in_features // g)

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        g, p = self.groups(in_features), self.per
        if self.pack.weight_axis == "in":
            qweight = (in_features // p, out_features)
        else:
            qweight = (in_features, out_features // p)
        specs = [TensorSpec("qweight", ("I32",), qweight),
                 TensorSpec("qzeros", ("I32",), (g, out_features // p)),
                 TensorSpec("scales", FLOATS, (g, out_features))]
        if self.pack.name == "gptq":
            specs.append(TensorSpec("g_idx", ("I32", "I64"), (in_features,), optional=not self.quant.desc_act))
        return specs

    def target_dtype(self, spec: TensorSpec, model_dtype: torch.dtype, stored: str) -> torch.dtype:
        if spec.suffix == "scales":
            return TORCH_DTYPES[stored]  # products are taken in float32: scales stay as stored
        return super().target_dtype(spec, model_dtype, stored)

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        w = tensors.get("qweight")
        if w is None:
            return []
        in_f = w.shape[-2] * (self.per if self.pack.weight_axis == "in" else 1)
        if self.pack.weight_axis == "in" and in_f % self.per:
            return [Problem(f"{self.pack.name} int{self.quant.bits}: in_features must be a multiple of {self.per}",
                            tensor=w.name, file=w.file.name)]
        return []

    def split(self, direction: str, out_features: int, in_features: int) -> dict[str, SplitRule] | str:
        """Column split (out): GPTQ ``qweight`` columns, ``qzeros`` whole words of 32/bits columns,
        ``scales`` columns; AWQ ``qweight`` / ``qzeros`` whole words, ``scales`` columns. Row split
        (in): whole groups (and whole words: lcm of the group and 32/bits inputs for GPTQ's
        qweight), one scale / zero row per group; ``g_idx`` whole on every rank (its groups are
        checked to be ``k // group`` then; act-order layers refuse row splits)."""
        names = [s.suffix for s in self.tensor_specs(out_features, in_features)]
        p, g = self.per, self.quant.group_size
        gptq = self.pack.weight_axis == "in"
        if direction == "out":
            rules = {"qweight": SplitRule(1) if gptq else SplitRule(1, p, 1), "qzeros": SplitRule(1, p, 1),
                     "scales": SplitRule(1)}
        else:
            if self.quant.desc_act:
                return "act-order (desc_act): g_idx maps inputs to groups out of order, a row slice holds no whole groups"
            f = math.lcm(p, g) if gptq and g > 0 else (p if gptq else 1)
            per_group = SplitRule(0, g, 1) if g > 0 else WHOLE
            rules = {"qweight": SplitRule(0, f, f // p) if gptq else SplitRule(0), "qzeros": per_group,
                     "scales": per_group}
        return {n: rules.get(n, WHOLE) for n in names}

    def process_after_loading(self, layer: Any) -> None:
        """The group of every input, once: ``g_idx`` as stored (checked against the group count), or
        ``k // group``; a row-split layer must have the plain order. In the plain order the words
        are then repacked into the core's INT4 / INT8 form and the stored tensors released."""
        self._groups_of(layer)
        if layer._plain_order:
            self._repack(layer)

    def _repack(self, layer: Any) -> None:
        codes, scales, zero = kernels.repack(self.pack, self.quant.bits, layer.qweight, layer.qzeros, layer.scales,
                                             layer.scales.shape[-1])
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            layer._parameters.pop(name, None)
        layer.register_buffer("_codes", codes, persistent=False)
        layer.register_buffer("_scales", scales, persistent=False)
        layer.register_buffer("_zeros", zero, persistent=False)

    def _groups_of(self, layer: Any) -> None:
        in_f = layer.in_features
        n_groups = layer.scales.shape[-2]
        split = in_f != unsplit_features(layer)[1]
        plain = self._plain(in_f)
        g_idx = getattr(layer, "g_idx", None)
        layer._plain_order = True
        if g_idx is None:
            layer._groups = plain.long()
            return
        gi = g_idx.long().reshape(-1, g_idx.shape[-1])
        if not split and (int(gi.min()) < 0 or int(gi.max()) >= n_groups):
            raise LoadError(f"{layer.qp_ckpt}.g_idx holds groups outside [0, {n_groups}) of its scales")
        if split:  # row split: the whole g_idx on every rank, plain order required
            if not bool((gi == self._plain(gi.shape[-1])).all()):
                raise LoadError(f"{layer.qp_ckpt}.g_idx is an act-order permutation; this layer cannot be split by "
                                "rows (desc_act is false in the config, but the checkpoint says otherwise)")
            layer._groups = plain.long()
            return
        groups = gi if gi.shape[0] > 1 else gi[0]
        plain_order = bool((groups == plain).all()) if groups.dim() == 1 else bool((gi == plain).all())
        layer._groups = plain.long() if plain_order else groups
        layer._plain_order = plain_order

    def _plain(self, n: int) -> torch.Tensor:
        """The group of each of ``n`` inputs without act-order: k // group (per channel: 0)."""
        g = self.quant.group_size
        return torch.arange(n) // g if g > 0 else torch.zeros(n, dtype=torch.int64)

    # -- compute ------------------------------------------------------------------------------

    def form(self, layer: Any) -> Weights | None:
        """The repacked words as the core's INT4 / INT8 form with group scales (their stored dtype)
        and integer zero points; None for act-order layers (not repacked: g_idx permutes groups)."""
        codes = getattr(layer, "_codes", None)
        if codes is None:
            return None
        scales, zero = layer._scales, layer._zeros
        enc = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}.get(scales.dtype)
        if enc is None:
            return None
        group = self.quant.group_size if self.quant.group_size > 0 else 0
        return Weights(Form("INT4" if self.quant.bits == 4 else "INT8", scale=enc, group=group, zero=zero is not None),
                       codes, scale=scales, zero=zero)

    def _parts(self, layer: Any, index: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        qw, qz, s, groups = layer.qweight, layer.qzeros, layer.scales, layer._groups
        if index is not None:
            qw, qz, s = qw[index], qz[index], s[index]
            if groups.dim() == 2:
                groups = groups[index]
        return qw, qz, s, groups

    def _rows(self, layer: Any, index: int | None):
        codes = getattr(layer, "_codes", None)
        if codes is not None:  # repacked at load
            c, s, z = layer._codes, layer._scales, layer._zeros
            if index is not None:
                c, s, z = c[index], s[index], (z[index] if z is not None else None)
            out_f, in_f = s.shape[-2], layer.in_features
            g = self.quant.group_size if self.quant.group_size > 0 else in_f

            def repacked(r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
                return kernels.dequantize_codes_f32(self.quant.bits, c, z, s, g, r0, r1, out)

            return repacked, out_f, in_f
        qw, qz, s, groups = self._parts(layer, index)
        out_f, in_f = s.shape[-1], groups.shape[-1]
        zeros = kernels.zeros_f32(self.pack, qz, self.quant.bits, out_f)
        g = self.quant.group_size if self.quant.group_size > 0 else in_f
        gathered = None if getattr(layer, "_plain_order", True) else groups

        def rows(r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
            return kernels.dequantize_rows_f32(self.pack, self.quant.bits, qw, zeros, s, g, gathered, r0, r1, out)

        return rows, out_f, in_f

    def dequantize(self, layer: Any, index: int | None = None) -> torch.Tensor:
        rows, out_f, _ = self._rows(layer, index)
        return rows(0, out_f).to(layer.model_dtype).contiguous()

    def apply(self, layer: Any, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        rows, out_f, in_f = self._rows(layer, index)
        return kernels.linear(x, rows, out_f, in_f, layer.model_dtype)
