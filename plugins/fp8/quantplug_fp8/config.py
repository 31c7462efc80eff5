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

from quantplug.api import Fields


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
    def parse(cls, qc: Fields, where: str) -> FP8Config:
        wbs = qc.int_list("weight_block_size", 1, 1 << 16, length=2)
        if wbs is None:
            qc.fail("weight_block_size", None, "two positive integers [rows, columns], e.g. [128, 128]")
        fmt = qc.get_str("fmt", "e4m3", choices=("e4m3",))  # only F8_E4M3 weights
        act = qc.get_str("activation_scheme", "dynamic", choices=("dynamic",))  # static input scales are not supported
        scale_fmt = qc.opt_str("scale_fmt", choices=("ue8m0",))
        skip = qc.str_list("modules_to_not_convert") + qc.str_list("ignored_layers")
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
