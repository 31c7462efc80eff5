"""quantplug backend for DeepSeek's native block FP8 checkpoints (entry point ``fp8``).

DeepSeek-V3 / R1 / V3.1 and Kimi-K2 ship ``quant_method: "fp8"`` with ``weight_block_size``:
every linear of the decoder layers (attention, dense MLP, shared and routed experts) stores
``weight`` F8_E4M3 + ``weight_scale_inv`` F32 per block; embeddings, lm_head, norms and the
router stay BF16. The scheme of a layer follows what the checkpoint stores for it: F8_E4M3 ->
:class:`FP8BlockScheme`, a float weight -> the core's dense scheme (decision reason says so), a
module listed in ``modules_to_not_convert`` / ``ignored_layers`` -> dense, and an FP8 weight
there is a plan-time refusal. The MTP layer (``model.layers.{num_hidden_layers}``) is planned
like the main layers (core option ``mtp``; its BF16 ``eh_proj`` gets the dense scheme).

Options: ``activation_quant`` = ``dynamic`` (default: emulate DeepSeek's per-token, per-128
FP8 activation quantization) or ``none`` (weight-only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from quantplug.api import (
    Claim,
    DenseScheme,
    OptionSpec,
    Problem,
    hookimpl,
    option,
    quant_config_fields,
    refuse,
    stored_dtype,
)

from .config import FP8Config, matches
from .scheme import ACTIVATION_MODES, FP8BlockScheme

__version__ = "0.1.0"
QUANTPLUG_CONTRACT = "1.5"
WRAPPER = "language_model"


@hookimpl
def quantplug_detect(checkpoint: Any) -> Claim | None:
    qc, where = quant_config_fields(checkpoint)
    if qc is None or qc.opt_str("quant_method") != "fp8" or not qc.has("weight_block_size"):
        return None  # per-tensor FP8 (no weight_block_size) is another format
    parsed = FP8Config.parse(qc, where)
    if not any(t.dtype == "F8_E4M3" for t in checkpoint.tensors.values()):
        # the tensors this backend reads are not there: a GGUF converted from an FP8 release that
        # kept its config.json, or a dequantized copy; that checkpoint is another backend's (or dense)
        return None
    return Claim("fp8", parsed, f"config.json {where}.quant_method == 'fp8' with weight_block_size "
                                f"{list(parsed.block)}")


@hookimpl
def quantplug_options() -> list[OptionSpec]:
    return [
        OptionSpec("activation_quant", str, "dynamic", ACTIVATION_MODES,
                   "dynamic: emulate DeepSeek's per-token, per-128 FP8 activation quantization; none: weight-only"),
        OptionSpec("weight_block_size", list, [128, 128], None, "export: FP8 scale block [rows, columns]",
                   scope="export"),
    ]


@hookimpl
def quantplug_linear_scheme(layer_name: str, layer_kind: str, shard_names: Sequence[str],
                            quant_config: FP8Config, checkpoint: Any, options: Mapping[str, Any]) -> Any:
    mode = option(options, "activation_quant", "dynamic", ACTIVATION_MODES)
    if layer_kind not in ("linear", "experts"):
        return None  # embeddings (and kinds added later) are stored as floats in this format
    prefix = WRAPPER if layer_name.startswith(WRAPPER + ".") else ""
    names = list(shard_names) or [layer_name]
    stored = {n: stored_dtype(checkpoint, n) for n in names}
    fp8 = [n for n, (dt, _) in stored.items() if dt == "F8_E4M3"]
    floats = [n for n, (dt, _) in stored.items() if dt is not None and dt != "F8_E4M3"]
    entry = next((e for n in [layer_name, *names] if (e := quant_config.not_converted_by(n, prefix))), None)
    if entry is not None:
        if fp8:
            return refuse(layer_name, f"{quant_config.where}.modules_to_not_convert",
                          f"entry {entry!r} keeps {layer_name} unconverted, but {fp8[0]}.weight is F8_E4M3")
        return None  # listed as not converted: the core's dense scheme
    if floats and fp8:
        return refuse(layer_name, quant_config.where, f"shards mix FP8 and float weights: {fp8[0]} is F8_E4M3, "
                      f"{floats[0]} is {stored[floats[0]][0]}")
    if floats:
        dense = DenseScheme()
        dense.reason = f"stored as {stored[floats[0]][0]} in the checkpoint (not FP8-quantized)"
        return dense
    if layer_kind == "experts" and any(fused for _, fused in stored.values()):
        return refuse(layer_name, quant_config.where, "FP8 routed experts in the transformers 5 fused layout "
                      "(gate_up_proj / down_proj) have no defined scale tensor names; DeepSeek's release stores "
                      "them per expert (experts.{k}.gate_proj.weight + weight_scale_inv)")
    why = "weight F8_E4M3" if fp8 else "quant_method fp8 (weight missing: the plan reports it)"
    return FP8BlockScheme(quant_config.block, mode, quant_config.scale_fmt, reason=why)


@hookimpl
def quantplug_validate_plan(plan: Any, quant_config: FP8Config) -> list[Problem]:
    """Each ``modules_to_not_convert`` / ``ignored_layers`` entry should name something."""
    if not quant_config.not_converted:
        return []
    modules: set[str] = set()
    for name in plan.checkpoint.tensors:
        parts = name.split(".")
        modules.update(".".join(parts[:i]) for i in range(1, len(parts)))
    problems = []
    for entry in quant_config.not_converted:
        if not any(matches(entry, m, plan.prefix) for m in modules):
            problems.append(Problem(f"{quant_config.where}.modules_to_not_convert entry {entry!r} matches no "
                                    "module of the checkpoint", layer=entry, severity="warning", kind="fp8-name"))
    return problems


@hookimpl
def quantplug_export(model: Any, destination: Any, options: Mapping[str, Any], plan: Any) -> Any:
    from .export import export_fp8

    return export_fp8(model, plan, destination, options)
