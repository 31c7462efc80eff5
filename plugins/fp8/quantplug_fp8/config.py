"""DeepSeek's native FP8 ``quantization_config``, parsed once into a frozen value.

The official releases (DeepSeek-V3 / R1 / V3.1, Kimi-K2) write::

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
     "weight_block_size": [128, 128]}            # V3.1 adds "scale_fmt": "ue8m0"

and no list of unconverted modules: lm_head, embeddings, norms and the router are simply
stored in BF16. DeepSeek-V4 (``model_type: deepseek_v4``) adds ``"scale_fmt": "ue8m0"`` and names each
scale ``X.scale`` (F8_E8M0, or F32 in V4-Flash-Base); its routed experts follow ``expert_dtype``
(``"fp4"``: I8 packed E2M1 + E8M0 scales per 32; ``"fp8"``: as the dense linears), a top-level
config key in V4 and a ``quantization_config`` key in V4.1 / transformers; absent, each expert's
stored dtype decides. transformers' ``FineGrainedFP8Config`` adds ``modules_to_not_convert`` and vLLM
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
    #: DeepSeek-V4's layout: scales named ``X.scale`` (not ``X.weight_scale_inv``), FP4 experts allowed
    v4: bool = False
    #: DeepSeek-V4's ``expert_dtype`` ("fp4" / "fp8"), None where the config does not say
    expert_dtype: str | None = None
    #: the config key ``expert_dtype`` was read from ("expert_dtype" or "quantization_config.expert_dtype")
    expert_dtype_key: str = ""

    @property
    def scale_suffix(self) -> str:
        return "scale" if self.v4 else "weight_scale_inv"

    @classmethod
    def parse(cls, qc: Fields, where: str, top: Fields | None = None) -> FP8Config:
        """``qc``: the ``quantization_config`` at ``where``; ``top``: the whole config.json (DeepSeek-V4's
        ``model_type`` and top-level ``expert_dtype``)."""
        wbs = qc.int_list("weight_block_size", 1, 1 << 16, length=2)
        if wbs is None:
            qc.fail("weight_block_size", None, "two positive integers [rows, columns], e.g. [128, 128]")
        fmt = qc.get_str("fmt", "e4m3", choices=("e4m3",))  # only F8_E4M3 weights
        act = qc.get_str("activation_scheme", "dynamic", choices=("dynamic",))  # static input scales are not supported
        scale_fmt = qc.opt_str("scale_fmt", choices=("ue8m0",))
        skip = qc.str_list("modules_to_not_convert") + qc.str_list("ignored_layers")
        v4 = top is not None and (top.raw("model_type") == "deepseek_v4"
                                  or "DeepseekV4ForCausalLM" in (top.raw("architectures") or []))
        expert_dtype, key = qc.opt_str("expert_dtype", choices=("fp4", "fp8")), f"{where}.expert_dtype"
        if expert_dtype is None and top is not None:
            expert_dtype, key = top.opt_str("expert_dtype", choices=("fp4", "fp8")), "expert_dtype"
        return cls((wbs[0], wbs[1]), fmt, act, scale_fmt, tuple(dict.fromkeys(skip)), where, v4,
                   expert_dtype, key if expert_dtype is not None else "")

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
