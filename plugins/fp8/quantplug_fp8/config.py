"""DeepSeek's native FP8 ``quantization_config``, parsed once into a frozen value.

The official releases (DeepSeek-V3 / R1 / V3.1, Kimi-K2) write::

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
     "weight_block_size": [128, 128]}            # V3.1 adds "scale_fmt": "ue8m0"

and no list of unconverted modules: lm_head, embeddings, norms and the router are simply
stored in BF16. transformers' ``FineGrainedFP8Config`` adds ``modules_to_not_convert`` and vLLM
reads ``ignored_layers``; both are honoured here (entry = a module name, with or without the
Kimi ``language_model.`` prefix, or a dotted prefix / suffix of one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantplug.api import ConfigError


@dataclass(frozen=True)
class FP8Config:
    block: tuple[int, int]
    fmt: str
    activation_scheme: str
    scale_fmt: str | None
    not_converted: tuple[str, ...]
    #: where the config was found: "quantization_config" or "text_config.quantization_config"
    where: str

    @classmethod
    def parse(cls, qc: dict[str, Any], where: str) -> FP8Config:
        def bad(field: str, value: Any, expected: str) -> ConfigError:
            return ConfigError(f"config.json {where}.{field} = {value!r}: {expected} (quantplug-fp8)")

        wbs = qc.get("weight_block_size")
        if (not isinstance(wbs, list | tuple) or len(wbs) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in wbs)):
            raise bad("weight_block_size", wbs, "expected two positive integers [rows, columns], e.g. [128, 128]")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise bad("fmt", fmt, "only e4m3 weights (F8_E4M3) are supported")
        act = qc.get("activation_scheme", "dynamic")
        if act != "dynamic":
            raise bad("activation_scheme", act, "only 'dynamic' activations are supported (static input scales "
                      "are not)")
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise bad("scale_fmt", scale_fmt, "expected absent or 'ue8m0'")
        skip: list[str] = []
        for field in ("modules_to_not_convert", "ignored_layers"):
            entries = qc.get(field)
            if entries is None:
                continue
            if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
                raise bad(field, entries, "expected a list of module names")
            skip += entries
        return cls((wbs[0], wbs[1]), fmt, act, scale_fmt, tuple(dict.fromkeys(skip)), where)

    def not_converted_by(self, module: str, prefix: str = "") -> str | None:
        """The entry that keeps ``module`` (checkpoint name) unquantized, or None."""
        return next((e for e in self.not_converted if matches(e, module, prefix)), None)


def matches(entry: str, module: str, prefix: str = "") -> bool:
    """Whether a not-converted ``entry`` names ``module``: equal, a dotted prefix of it or a dotted
    suffix of it, tried on the checkpoint name and on the name without the wrapper ``prefix``."""
    names = [module]
    if prefix and module.startswith(prefix + "."):
        names.append(module[len(prefix) + 1:])
    e = entry.rstrip(".")
    return any(n == e or n.startswith(e + ".") or n.endswith("." + e) for n in names)
