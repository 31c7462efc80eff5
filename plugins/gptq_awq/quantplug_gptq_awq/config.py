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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quantplug.api import ConfigError, Exclusions

#: bit widths whose words hold whole values (32 / bits per int32)
BITS = (4, 8)


def packing_of(qc: Mapping[str, Any]) -> str | None:
    """Which layout a config's weights use ("gptq" | "awq"), from its method alone; None: not ours."""
    method = qc.get("quant_method")
    if method in ("gptq", "awq"):
        return str(method)
    if method == "auto-round":
        return "awq" if "awq" in str(qc.get("packing_format") or "") else "gptq"
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
    raw_version: str | None

    @property
    def prefix(self) -> str:
        return self.exclude.prefix

    @classmethod
    def parse(cls, qc: Mapping[str, Any], where: str, prefix: str) -> IntConfig | None:
        method = qc.get("quant_method")
        if method not in ("gptq", "awq", "auto-round"):
            return None

        def bad(field: str, value: Any, expected: str) -> ConfigError:
            return ConfigError(f"config.json {where}.{field} = {value!r:.80}: {expected}")

        def integer(field: str, default: Any = None, *alts: str) -> int:
            v = qc.get(field, default)
            for a in alts:
                if field not in qc and a in qc:
                    v = qc[a]
            if not isinstance(v, int) or isinstance(v, bool):
                raise bad(field, v, "expected an integer")
            return v

        bits = integer("bits", None, "w_bit")
        group = integer("group_size", 128, "q_group_size")
        if group == 0 or group < -1:
            raise bad("group_size", group, "expected a positive integer or -1 (per channel)")
        fmt = str(qc.get("checkpoint_format") or "gptq")
        data_type = str(qc.get("data_type") or "int")
        overrides: list[tuple[str, tuple[tuple[str, Any], ...]]] = []
        excluded: list[str] = []
        substring = False
        if method == "gptq":
            packing = "gptq"
            sym = bool(qc.get("sym", True))
            desc_act = bool(qc.get("desc_act", False))
            dynamic = qc.get("dynamic") or {}
            if not isinstance(dynamic, dict):
                raise bad("dynamic", dynamic, "expected an object of '-:regex' / '+:regex' -> overrides")
            for key, val in dynamic.items():
                if not isinstance(val, dict):
                    raise bad(f"dynamic[{key!r}]", val, "expected an object")
                if key.startswith("-:"):
                    excluded.append(f"re:{key[2:]}")
                else:
                    overrides.append((f"re:{key[2:] if key.startswith('+:') else key}", tuple(sorted(val.items()))))
            exclude_source = f"{where}.dynamic"
        elif method == "awq":
            packing = "awq"
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise bad("version", qc.get("version"), "only AWQ GEMM checkpoints are supported (GEMV / Marlin / "
                          "exllama layouts are not)")
            sym = not bool(qc.get("zero_point", True))
            desc_act = False
            skip = qc.get("modules_to_not_convert") or []
            if not isinstance(skip, list) or not all(isinstance(e, str) for e in skip):
                raise bad("modules_to_not_convert", skip, "expected a list of module names")
            excluded, substring = list(skip), True
            exclude_source = f"{where}.modules_to_not_convert"
        else:
            pf = str(qc.get("packing_format") or "auto_round:auto_gptq")
            if pf in ("auto_round:auto_gptq", "auto_round:gptq", "auto_gptq"):
                packing = "gptq"
            elif pf in ("auto_round:auto_awq", "auto_round:awq", "auto_awq"):
                packing = "awq"
            else:
                raise bad("packing_format", pf, "supported: auto_round:auto_gptq, auto_round:auto_awq")
            sym = bool(qc.get("sym", True))
            desc_act = False
            extra = qc.get("extra_config") or {}
            if not isinstance(extra, dict):
                raise bad("extra_config", extra, "expected an object of layer name / regex -> overrides")
            for key, val in extra.items():
                if not isinstance(val, dict):
                    raise bad(f"extra_config[{key!r}]", val, "expected an object")
                # exact layer names, else a regex auto-round applies with re.search
                entry = key if re.fullmatch(r"[\w.]+", key) else f"re:.*(?:{key})"
                if _unquantized(val):
                    excluded.append(entry)
                else:
                    overrides.append((entry, tuple(sorted(val.items()))))
            exclude_source = f"{where}.extra_config (bits 16)"
        if bits not in BITS:
            raise bad("bits", bits, f"supported bit widths: {', '.join(map(str, BITS))}")
        why = f"{where} ({method}{', ' + str(qc.get('packing_format')) if method == 'auto-round' else ''})"
        default = LayerQuant(bits, group, sym, desc_act, why)
        return cls(method=method, packing=packing, checkpoint_format=fmt, default=default,
                   exclude=Exclusions(tuple(excluded), exclude_source, prefix, "match", substring),
                   overrides=tuple(overrides), lm_head=bool(qc.get("lm_head", False)), data_type=data_type,
                   where=where, raw_version=str(qc.get("version")) if qc.get("version") else None)

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
            if matcher.excluded_by(module) is not None:
                try:
                    q = LayerQuant(int(vals.get("bits", q.bits)), int(vals.get("group_size", q.group_size)),
                                   bool(vals.get("sym", q.sym)), bool(vals.get("desc_act", q.desc_act)),
                                   f"{self.where} override {matcher.entries[0]!r}")
                except (TypeError, ValueError):
                    raise ConfigError(f"config.json {self.where}: override {matcher.entries[0]!r} = {vals!r:.80}: "
                                      "expected integer bits / group_size") from None
                break
        if module.rsplit(".", 1)[-1] == "lm_head" and not self.lm_head and q is self.default:
            return None, f"{self.where}.lm_head is false"
        return q, q.why


def _unquantized(val: Mapping[str, Any]) -> bool:
    bits = val.get("bits")
    return (isinstance(bits, int) and bits >= 16) or str(val.get("data_type", "int")) in ("float", "fp", "bf16", "fp16")
