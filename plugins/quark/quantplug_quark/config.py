"""Quark's ``quantization_config``, parsed once into a frozen value.

Per-layer lookup order (amd-quark): ``exclude`` (exact names or ``re:`` regexes), then
``layer_quant_config`` (fnmatch patterns), then ``layer_type_quant_config`` ("Linear"), then
``global_quant_config``. Names are full checkpoint names (``language_model.`` for Kimi wrappers).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from quantplug.api import Fields


@dataclass(frozen=True)
class WeightSpec:
    dtype: str | None
    qscheme: str | None
    group_size: int | None
    ch_axis: int | None
    scale_format: str | None
    has_input_quant: bool
    has_output_quant: bool

    @classmethod
    def parse(cls, spec: Fields | None) -> WeightSpec | None:
        """One Quark ``QuantizationConfig`` object (``global_quant_config``, a
        ``layer_quant_config`` value...). None: the layers it covers are not quantized (null,
        or no weight, input or output spec). A weight object must name its ``dtype``."""
        if spec is None:
            return None
        weights = spec.obj_or_list("weight")
        has_in = spec.obj_or_list("input_tensors") is not None
        has_out = spec.obj_or_list("output_tensors") is not None
        if weights is None:
            if not (has_in or has_out):
                return None
            return cls(None, None, None, None, None, has_in, has_out)  # activation-only: refused later
        if len(weights) > 1:  # Quark allows a list of specs (double quantization); we take none of those
            dtype = "+".join(w.get_str("dtype") for w in weights)
            return cls(dtype, None, None, None, None, has_in, has_out)
        w = weights[0]
        return cls(dtype=w.get_str("dtype"), qscheme=w.opt_str("qscheme"), group_size=w.opt_int("group_size", 1, 1 << 24),
                   ch_axis=w.opt_int("ch_axis", -8, 8), scale_format=w.opt_str("scale_format"),
                   has_input_quant=has_in, has_output_quant=has_out)

    def unsupported(self) -> str | None:
        """Why this plugin cannot run the spec, or None when it is MXFP4 weight-only."""
        if self.dtype is None:
            return "activation-only quantization (input / output tensors quantized, weight spec null)"
        if self.has_input_quant or self.has_output_quant:
            return f"activation quantization ({self.dtype} weights with input/output tensors quantized)"
        wanted = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}
        for k, v in wanted.items():
            if getattr(self, k) != v:
                return f"weight {k} {getattr(self, k)!r} (this plugin runs MXFP4: dtype fp4, per_group 32, e8m0)"
        if self.ch_axis not in (-1, 1, None):
            return f"weight ch_axis {self.ch_axis} (groups must run along the input dimension, ch_axis -1)"
        return None

    def describe(self) -> str:
        return f"{self.dtype}/{self.qscheme}/g{self.group_size}/{self.scale_format}"


@dataclass(frozen=True)
class QuarkConfig:
    global_spec: WeightSpec | None
    layer_specs: tuple[tuple[str, WeightSpec | None], ...]
    type_specs: tuple[tuple[str, WeightSpec | None], ...]
    exclude: tuple[str, ...]
    weight_format: str
    pack_method: str | None
    version: str | None
    #: the ``re:`` exclude entries, compiled at parse time (an invalid one is a ConfigError there)
    exclude_rx: tuple[tuple[str, re.Pattern[str]], ...] = ()

    @classmethod
    def parse(cls, qc: Fields) -> QuarkConfig:
        exclude = qc.str_list("exclude")
        rx = tuple((e, qc.regex(f"exclude[{i}]", e[3:])) for i, e in enumerate(exclude) if e.startswith("re:"))
        export = qc.get_obj("export")
        return cls(
            global_spec=WeightSpec.parse(qc.get_obj("global_quant_config")),
            layer_specs=tuple((k, WeightSpec.parse(v)) for k, v in qc.entries("layer_quant_config", nullable=True)),
            type_specs=tuple((k, WeightSpec.parse(v)) for k, v in qc.entries("layer_type_quant_config",
                                                                               nullable=True)),
            exclude=exclude,
            weight_format=export.get_str("weight_format", "real_quantized") if export else "real_quantized",
            pack_method=export.opt_str("pack_method") if export else None,
            version=qc.opt_str("version"),
            exclude_rx=rx,
        )

    def excluded_by(self, name: str) -> str | None:
        compiled = dict(self.exclude_rx)
        for entry in self.exclude:
            if entry.startswith("re:"):
                if compiled[entry].fullmatch(name):
                    return entry
            elif entry == name:
                return entry
        return None

    def spec_for(self, name: str) -> tuple[WeightSpec | None, str]:
        """The spec of linear ``name`` and where it came from."""
        hit = self.excluded_by(name)
        if hit is not None:
            return None, f"excluded by {hit!r}"
        for pattern, spec in self.layer_specs:
            if fnmatch.fnmatch(name, pattern):
                return spec, f"layer_quant_config[{pattern!r}]"
        for typ, spec in self.type_specs:
            if typ in ("Linear", "nn.Linear", "torch.nn.Linear"):
                return spec, f"layer_type_quant_config[{typ!r}]"
        return self.global_spec, "global_quant_config"

    def exact_names(self) -> list[tuple[str, str]]:
        """(entry, section) for exact (non-pattern) names that must match a module."""
        out = [(e, "exclude") for e in self.exclude if not e.startswith("re:") and not _is_pattern(e)]
        out += [(k, "layer_quant_config") for k, _ in self.layer_specs if not _is_pattern(k)]
        return out

    def patterns(self) -> list[tuple[str, str]]:
        out = [(e, "exclude") for e in self.exclude if e.startswith("re:") or _is_pattern(e)]
        out += [(k, "layer_quant_config") for k, _ in self.layer_specs if _is_pattern(k)]
        return out


def _is_pattern(s: str) -> bool:
    return any(c in s for c in "*?[")
