"""quantplug backend for AMD Quark MXFP4 checkpoints (entry point ``quark``).

Every Quark-specific decision is one of this plugin's hook answers: the ``language_model``
prefix of the Kimi wrappers, the fused-module mapping, the per-layer scheme (exclude /
layer_quant_config / global lookup), and the plan-time check that every exact exclude name
matches something in the checkpoint.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from quantplug.api import Claim, OptionSpec, Problem, hookimpl, quant_config_fields, refuse

from .config import QuarkConfig
from .export import export_quark
from .scheme import MXFP4Scheme

#: the hook-contract version this plugin is written for (quantplug.api.CONTRACT_VERSION)
QUANTPLUG_CONTRACT = "1.4"

__version__ = "0.1.0"
PACKED = {"fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"], "gate_up_proj": ["gate_proj", "up_proj"]}


@hookimpl
def quantplug_detect(checkpoint: Any) -> Claim | None:
    qc, where = quant_config_fields(checkpoint)
    if qc is None or qc.opt_str("quant_method") != "quark":
        return None
    return Claim("quark", QuarkConfig.parse(qc), f"config.json {where}.quant_method == 'quark'")


@hookimpl
def quantplug_options() -> list[OptionSpec]:
    return [OptionSpec("dequantize", bool, False, None,
                       "keep a dense copy of every MXFP4 linear after loading: faster forward, more memory"),
            OptionSpec("float_dtype", str, "float32", ("float32", "bfloat16", "float16"),
                       "export: dtype of the unquantized tensors written (lm_head, norms, embeddings and the "
                       "routed experts amd-quark keeps float); amd-quark writes a bfloat16 model's as bfloat16",
                       scope="export")]


@hookimpl
def quantplug_resolve_prefix(model_config: Any) -> str:
    # Quark names layers by full checkpoint name; the Kimi wrappers keep the text model under
    # language_model (sglang PR 23408 / 24477). validate_plan checks the answer against the excludes.
    return "language_model" if model_config.is_wrapper else ""


@hookimpl
def quantplug_packed_modules() -> Mapping[str, Sequence[str]]:
    return PACKED


@hookimpl
def quantplug_linear_scheme(layer_name: str, layer_kind: str, shard_names: Sequence[str],
                            quant_config: QuarkConfig, checkpoint: Any, options: Mapping[str, Any]) -> Any:
    if layer_kind not in ("linear", "experts", "attn_k_b", "attn_v_b"):
        return None  # embeddings (and kinds added later) are stored as floats in this format
    if quant_config.weight_format != "real_quantized":
        return refuse(layer_name, "quantization_config.export.weight_format", f"not supported by quantplug-quark: export weight_format {quant_config.weight_format!r} "
                                             "(only real_quantized weights are packed)")
    names = list(shard_names) if layer_kind == "experts" else [layer_name]
    if layer_kind == "experts" and all(_stored_float(checkpoint, n) for n in names):
        return None  # Quark quantizes nn.Linear only: fused 3-D experts stay float (dense scheme)
    specs = {n: quant_config.spec_for(n) for n in names}
    kinds = {(s.describe() if s else "float") for s, _ in specs.values()}
    if len(kinds) > 1:
        listing = ", ".join(f"{n}: {s.describe() if s else 'float'} ({why})" for n, (s, why) in specs.items())
        return refuse(layer_name, "quantization_config", f"not supported by quantplug-quark: its shards disagree: {listing}")
    spec, why = next(iter(specs.values()))
    if spec is None:
        return None  # excluded: the core's dense scheme answers
    bad = spec.unsupported()
    if bad:
        return refuse(layer_name, "quantization_config", f"Quark spec not supported by quantplug-quark: {bad} ({why})")
    return MXFP4Scheme(why, cache=bool(options.get("dequantize")))


def _stored_float(checkpoint: Any, module: str) -> bool:
    info = checkpoint.get(module) or checkpoint.get(f"{module}.weight")
    return info is not None and info.is_float


@hookimpl
def quantplug_validate_plan(plan: Any, quant_config: QuarkConfig) -> list[Problem]:
    """Every exact exclude / layer_quant_config name must name a module of the checkpoint (or a
    tensor the plan skips by rule): a wrong prefix would otherwise quantize excluded layers."""
    problems: list[Problem] = []
    modules: set[str] = set()
    for name in plan.checkpoint.tensors:
        parts = name.split(".")
        modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    fused = {f"{n.rsplit('.', 1)[0]}.{f}" for f, shards in PACKED.items() for n in modules
             if n.rsplit(".", 1)[-1] == shards[0]}
    known = modules | fused
    for entry, section in quant_config.exact_names():
        if entry not in known:
            hint = ""
            if plan.prefix and f"{plan.prefix}.{entry}" in known:
                hint = f"; did you mean {plan.prefix}.{entry}? (the checkpoint names the text model under {plan.prefix}.)"
            problems.append(Problem(f"quantization_config.{section} entry {entry!r} matches no module of the "
                                    f"checkpoint{hint}", layer=entry, kind="quark-name"))
    compiled = dict(quant_config.exclude_rx)
    for entry, section in quant_config.patterns():
        if entry.startswith("re:"):
            rx = compiled.get(entry)
            hit = rx is not None and any(rx.fullmatch(m) for m in known)
        else:
            hit = any(fnmatch.fnmatch(m, entry) for m in known)
        if not hit:
            problems.append(Problem(f"quantization_config.{section} pattern {entry!r} matches nothing in this "
                                    "checkpoint", layer=entry, severity="warning", kind="quark-name"))
    return problems


@hookimpl
def quantplug_export(model: Any, plan: Any, destination: Any, options: Mapping[str, Any]) -> Any:
    return export_quark(model, plan, destination, options)
