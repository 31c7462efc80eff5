"""GPTQ, AWQ and AutoRound ``quantization_config``, parsed once into a frozen value.

* GPTQ (``quant_method: "gptq"``; AutoGPTQ, GPTQModel, auto-round ``auto_gptq``): ``bits``,
  ``group_size`` (-1: one group per row), ``sym``, ``desc_act`` (act-order: ``g_idx`` permutes
  groups), ``checkpoint_format`` (``gptq``: zeros stored minus 1; ``gptq_v2``: as is), ``lm_head``
  and GPTQModel's ``dynamic``: ``"-:<regex>"`` excludes the modules it ``re.match``es,
  ``"+:<regex>"`` / ``"<regex>"`` overrides bits / group_size / sym / desc_act for them.
* AWQ (``quant_method: "awq"``, ``version: "gemm"``; AutoAWQ, auto-round ``auto_awq``): ``bits``
  (``w_bit``), ``group_size`` (``q_group_size``), ``zero_point``, ``modules_to_not_convert``
  (entries match as substrings of the module name, as transformers does).
* AutoRound (``quant_method: "auto-round"``): ``bits``, ``group_size``, ``sym``, ``data_type``
  ``int``, ``packing_format`` ``auto_round:auto_gptq`` (GPTQ layout, zeros minus 1) or
  ``auto_round:auto_awq`` (AWQ layout), and ``extra_config``: per-layer overrides keyed by exact
  layer name or by a regex (``re.search``), ``{"bits": 16, "data_type": "float"}`` leaving a layer
  unquantized (auto-round does so for a layer whose width is not a multiple of the group).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from quantplug.api import Exclusions, Fields

#: bit widths whose words hold whole values (32 / bits per int32)
BITS = (4, 8)


#: AutoRound ``packing_format`` values -> the layout they store
PACKING_FORMATS = {"auto_round:auto_gptq": "gptq", "auto_round:gptq": "gptq", "auto_gptq": "gptq",
                   "auto_round:auto_awq": "awq", "auto_round:awq": "awq", "auto_awq": "awq"}
#: auto-round ``data_type`` values of a layer left in float
FLOAT_TYPES = ("float", "fp", "bf16", "fp16")


def packing_of(qc: Fields) -> str | None:
    """Which layout a config's weights use ("gptq" | "awq"), from its method alone; None: not ours.
    An AutoRound ``packing_format`` quantplug does not know claims for "gptq", which refuses it."""
    method = qc.opt_str("quant_method")
    if method in ("gptq", "awq"):
        return method
    if method == "auto-round":
        return PACKING_FORMATS.get(qc.get_str("packing_format", "auto_round:auto_gptq"), "gptq")
    return None


@dataclass(frozen=True)
class LayerQuant:
    bits: int
    group_size: int  # -1: one group per output row (per channel)
    sym: bool
    desc_act: bool
    why: str

    def describe(self) -> str:
        group = "per channel" if self.group_size <= 0 else f"group {self.group_size}"
        return f"int{self.bits} {group}{'' if self.sym else ', zero point'}{', act-order g_idx' if self.desc_act else ''}"


@dataclass(frozen=True)
class IntConfig:
    method: str       # "gptq" | "awq" | "auto-round"
    packing: str      # "gptq" | "awq": the storage layout
    checkpoint_format: str  # gptq: "gptq" (zeros - 1) | "gptq_v2"
    default: LayerQuant
    exclude: Exclusions
    #: (matcher entry, overrides) in file order: exact names and "re:" entries, as Exclusions reads them
    overrides: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
    lm_head: bool
    data_type: str
    where: str

    @property
    def prefix(self) -> str:
        return self.exclude.prefix

    @classmethod
    def parse(cls, qc: Fields, where: str, prefix: str) -> IntConfig | None:
        """Every field read through ``quantplug.api.Fields``: a wrong type or value is one
        ConfigError naming config.json and the key path."""
        method = qc.opt_str("quant_method")
        if method not in ("gptq", "awq", "auto-round"):
            return None
        # AutoAWQ spells bits / group_size w_bit / q_group_size
        bits = qc.get_int("bits" if qc.has("bits") or not qc.has("w_bit") else "w_bit", 1, 64)
        gkey = "group_size" if qc.has("group_size") or not qc.has("q_group_size") else "q_group_size"
        group = qc.get_int(gkey, -1, 1 << 24, 128)
        qc.expect(group != 0, gkey, "a positive group size or -1 (per channel)")
        qc.expect(bits in BITS, "bits" if qc.has("bits") else "w_bit",
                  f"one of the supported bit widths: {', '.join(map(str, BITS))}")
        fmt = qc.get_str("checkpoint_format", "gptq", choices=("gptq", "gptq_v2"))
        data_type = qc.get_str("data_type", "int")
        overrides: list[tuple[str, tuple[tuple[str, Any], ...]]] = []
        excluded: list[str] = []
        substring = False
        packing_format = ""
        if method == "gptq":
            packing = "gptq"
            sym = qc.get_bool("sym", True)
            desc_act = qc.get_bool("desc_act", False)
            dynamic = qc.get_obj("dynamic")
            for key, val in qc.entries("dynamic"):
                assert dynamic is not None and val is not None
                pattern = key[2:] if key.startswith(("-:", "+:")) else key
                dynamic.regex(key, pattern)
                if key.startswith("-:"):
                    excluded.append(f"re:{pattern}")
                else:
                    overrides.append((f"re:{pattern}", _overrides(val)))
            exclude_source = f"{where}.dynamic"
        elif method == "awq":
            packing = "awq"
            version = qc.get_str("version", "gemm")
            qc.expect(version.lower() == "gemm", "version", "'gemm': only AWQ GEMM checkpoints are supported (GEMV / "
                      "Marlin / exllama layouts are not)")
            sym = not qc.get_bool("zero_point", True)
            desc_act = False
            excluded, substring = list(qc.str_list("modules_to_not_convert")), True
            exclude_source = f"{where}.modules_to_not_convert"
        else:
            packing_format = qc.get_str("packing_format", "auto_round:auto_gptq", choices=PACKING_FORMATS)
            packing = PACKING_FORMATS[packing_format]
            sym = qc.get_bool("sym", True)
            desc_act = False
            extra = qc.get_obj("extra_config")
            for key, val in qc.entries("extra_config"):
                assert extra is not None and val is not None
                # exact layer names, else a regex auto-round applies with re.search
                entry = key if re.fullmatch(r"[\w.]+", key) else f"re:.*(?:{key})"
                if entry.startswith("re:"):
                    extra.regex(key, entry[3:])
                if _unquantized(val):
                    excluded.append(entry)
                else:
                    overrides.append((entry, _overrides(val)))
            exclude_source = f"{where}.extra_config (bits 16)"
        why = f"{where} ({method}{', ' + packing_format if method == 'auto-round' else ''})"
        default = LayerQuant(bits, group, sym, desc_act, why)
        return cls(method=method, packing=packing, checkpoint_format=fmt, default=default,
                   exclude=Exclusions(tuple(excluded), exclude_source, prefix, "match", substring),
                   overrides=tuple(overrides), lm_head=qc.get_bool("lm_head", False), data_type=data_type,
                   where=where)

    @functools.cached_property
    def _override_matchers(self) -> tuple[tuple[Exclusions, dict[str, Any]], ...]:
        return tuple((Exclusions((e,), self.where, self.prefix), dict(v)) for e, v in self.overrides)

    def layer(self, module: str) -> tuple[LayerQuant | None, str]:
        """What ``module`` (checkpoint name) is quantized as, and why (None: left in float)."""
        hit = self.exclude.excluded_by(module)
        if hit is not None:
            return None, f"{self.exclude.source} entry {hit!r}"
        q = self.default
        for matcher, vals in self._override_matchers:
            if matcher.excluded_by(module) is not None:  # values typed and range-checked by parse
                q = LayerQuant(vals.get("bits", q.bits), vals.get("group_size", q.group_size), vals.get("sym", q.sym),
                               vals.get("desc_act", q.desc_act), f"{self.where} override {matcher.entries[0]!r}")
                break
        if module.rsplit(".", 1)[-1] == "lm_head" and not self.lm_head and q is self.default:
            return None, f"{self.where}.lm_head is false"
        return q, q.why


def _overrides(val: Fields) -> tuple[tuple[str, Any], ...]:
    """The per-layer overrides quantplug reads, typed (the entry's other keys are not read)."""
    found: dict[str, Any] = {"bits": val.opt_int("bits", 1, 64), "group_size": val.opt_int("group_size", -1, 1 << 24)}
    for key in ("sym", "desc_act"):
        if val.has(key):
            found[key] = val.get_bool(key, False)
    if found["group_size"] == 0:
        val.fail("group_size", 0, "a positive group size or -1 (per channel)")
    return tuple(sorted((k, v) for k, v in found.items() if v is not None))


def _unquantized(val: Fields) -> bool:
    """An auto-round ``extra_config`` entry that leaves its layers in float (16 bits or more, or a
    float ``data_type``)."""
    bits = val.opt_int("bits", 1, 64)
    data_type = val.get_str("data_type", "int")  # typed even where bits alone decide
    return (bits is not None and bits >= 16) or data_type in FLOAT_TYPES
