"""Quark's ``quantization_config``, parsed once into a frozen value.

Per-layer lookup order (amd-quark): ``exclude`` (exact names or ``re:`` regexes), then
``layer_quant_config`` (fnmatch patterns), then ``layer_type_quant_config`` ("Linear"), then
``global_quant_config``. Names are full checkpoint names (``language_model.`` for Kimi wrappers).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from quantplug.api import ConfigError


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
    def parse(cls, spec: Any, where: str) -> WeightSpec | None:
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise ConfigError(f"quantization_config.{where}: expected an object, got {type(spec).__name__}")
        w = spec.get("weight") or {}
        if isinstance(w, list):  # Quark allows a list of specs (double quantization); we take none of those
            if not all(isinstance(x, dict) for x in w):
                raise ConfigError(f"config.json: quantization_config.{where}.weight: expected an object or a list "
                                  "of objects")
            w = {"dtype": "+".join(str(x.get("dtype")) for x in w)}
        if not isinstance(w, dict):
            raise ConfigError(f"config.json: quantization_config.{where}.weight = {w!r:.60}: expected an object")
        for key, types in (("dtype", str), ("qscheme", str), ("group_size", int), ("ch_axis", int),
                           ("scale_format", str)):
            v = w.get(key)
            if v is not None and (type(v) is not types):
                raise ConfigError(f"config.json: quantization_config.{where}.weight.{key} = {v!r:.60}: expected "
                                  f"{'an integer' if types is int else 'a string'} or null")
        return cls(dtype=w.get("dtype"), qscheme=w.get("qscheme"), group_size=w.get("group_size"),
                   ch_axis=w.get("ch_axis"), scale_format=w.get("scale_format"),
                   has_input_quant=bool(spec.get("input_tensors")), has_output_quant=bool(spec.get("output_tensors")))

    def unsupported(self) -> str | None:
        """Why this plugin cannot run the spec, or None when it is MXFP4 weight-only."""
        if self.dtype is None:
            return None
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

    @classmethod
    def parse(cls, qc: dict[str, Any]) -> QuarkConfig:
        layers = qc.get("layer_quant_config") or {}
        types = qc.get("layer_type_quant_config") or {}
        exclude = qc.get("exclude") or []
        if not isinstance(layers, dict) or not isinstance(types, dict) or not isinstance(exclude, list):
            raise ConfigError("quantization_config: layer_quant_config / layer_type_quant_config must be objects "
                              "and exclude a list")
        export = qc.get("export") or {}
        if not isinstance(export, dict):
            raise ConfigError(f"config.json: quantization_config.export = {export!r:.60}: expected an object")
        return cls(
            global_spec=WeightSpec.parse(qc.get("global_quant_config"), "global_quant_config"),
            layer_specs=tuple((k, WeightSpec.parse(v, f"layer_quant_config[{k!r}]")) for k, v in layers.items()),
            type_specs=tuple((k, WeightSpec.parse(v, f"layer_type_quant_config[{k!r}]")) for k, v in types.items()),
            exclude=tuple(str(x) for x in exclude),
            weight_format=str(export.get("weight_format", "real_quantized")),
            pack_method=export.get("pack_method"),
            version=qc.get("version"),
        )

    def excluded_by(self, name: str) -> str | None:
        for entry in self.exclude:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], name):
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
