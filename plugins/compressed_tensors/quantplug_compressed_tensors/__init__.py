"""quantplug backend for compressed-tensors checkpoints (entry point ``compressed_tensors``):
the format of llm-compressor exports and of the official Kimi-K2-Thinking / Kimi-K2.5 releases.

Every decision is a hook answer: the ``language_model`` prefix of Kimi wrappers (from the tensor
names), the per-layer config group (``targets`` / ``ignore`` matched through that prefix), the
scheme (pack-quantized int4 / int8, naive int8, FP8 E4M3 per tensor / channel / group / block;
activation emulation), plan-time refusals of what this plugin cannot compute, and the check that
every exact ``ignore`` / ``targets`` name names a module of the checkpoint.

The compressed-tensors library is not imported at run time: it costs ~2 s of imports
(transformers, pydantic) and is needed only as the reference decoder in tests and benchmarks.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from quantplug.api import (
    Claim,
    Exclusions,
    OptionSpec,
    Problem,
    hookimpl,
    modules_of,
    option,
    quant_config_fields,
    refuse,
)

from . import fp4
from .config import FORMATS, LINEAR_CLASSES, CTConfig, Group, is_class_name, match_name
from .schemes import CTScheme

__version__ = "0.1.0"
QUANTPLUG_CONTRACT = "1.7"
ACTIVATION_MODES = ("emulate", "none")
#: tensors only a quantized module stores (an ignored module holding one is a plan error)
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale", "input_global_scale",
                  "input_scale", "weight_shape", "weight_g_idx")


@hookimpl
def quantplug_detect(checkpoint: Any) -> Claim | None:
    qc, where = quant_config_fields(checkpoint)
    if qc is None or qc.opt_str("quant_method") != "compressed-tensors":
        return None
    prefix = "language_model" if any(n.startswith("language_model.") for n in checkpoint.tensors) else ""
    cfg = CTConfig.parse(qc, prefix, where)
    return Claim("compressed_tensors", cfg, f"config.json {where}.quant_method == 'compressed-tensors' "
                 f"(format {cfg.format}, {len(cfg.groups)} config group(s))")


@hookimpl
def quantplug_options() -> list[OptionSpec]:
    return [OptionSpec("activation_quant", str, "emulate", ACTIVATION_MODES,
                       "emulate: quantize activations as the config's input_activations say; none: weight-only")]


@hookimpl
def quantplug_resolve_prefix(quant_config: CTConfig) -> str:
    # Kimi-K2.5 / K2.6 name text weights language_model.*; ignore / targets are matched both
    # with and without it (the release's "lm_head" means language_model.lm_head)
    return quant_config.prefix


def _global_refusal(layer: str, qc: CTConfig) -> Any:
    if qc.status != "compressed":
        return refuse(layer, f"{qc.where}.quantization_status", f"{qc.status!r}: only 'compressed' checkpoints "
                      "store quantized weights")
    if qc.transforms:
        return refuse(layer, f"{qc.where}.transform_config", "transforms (rotations / Hadamard) are not "
                      "supported by quantplug-compressed-tensors")
    if qc.sparsity:
        return refuse(layer, f"{qc.where}.sparsity_config", f"sparsity {qc.sparsity} (e.g. 2:4) is not supported "
                      "by quantplug-compressed-tensors")
    return None


def _scheme(layer: str, group: Group, why: str, mode: str, kernels: str = "exact") -> Any:
    base = f"config_groups.{group.name}"
    w, act = group.weights, group.input_activations
    fmt = group.format
    if w is None:
        return refuse(layer, f"{base}.weights", "activation-only quantization (no weight args) is not supported")
    if group.output_activations is not None:
        return refuse(layer, f"{base}.output_activations", "output activation quantization is not supported")
    if "nvfp4" in fmt or "mxfp4" in fmt or w.strategy == "tensor_group" or (w.type == "float" and w.num_bits == 4):
        return fp4.scheme(layer, group, why, mode)  # nvfp4- / mxfp4-pack-quantized (or a refusal)
    if fmt not in FORMATS:
        return refuse(layer, f"{base}.format", f"format {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
    if w.actorder not in (None, "static"):
        return refuse(layer, f"{base}.weights.actorder", f"actorder {w.actorder!r} needs a g_idx permutation, "
                      "which quantplug-compressed-tensors does not apply")
    if w.dynamic not in (False, None):
        return refuse(layer, f"{base}.weights.dynamic", "dynamic weight quantization is not a stored format")
    if fmt == "pack-quantized":
        if w.type != "int" or w.num_bits not in (4, 8):
            return refuse(layer, f"{base}.weights.num_bits", f"pack-quantized {w.type}{w.num_bits}: only int4 and "
                          "int8 are supported")
        if w.strategy not in ("group", "channel", "tensor") or (w.strategy == "group" and not w.group_size):
            return refuse(layer, f"{base}.weights.strategy", f"pack-quantized strategy {w.strategy!r} "
                          "(supported: group with group_size, channel, tensor)")
        if not w.symmetric and w.strategy == "tensor":
            return refuse(layer, f"{base}.weights.symmetric", "asymmetric per-tensor packing is not supported")
        kind = "packed"
    else:
        if (w.type, w.num_bits) not in (("int", 8), ("float", 8)):
            return refuse(layer, f"{base}.weights.type", f"{fmt} {w.type}{w.num_bits}: only int8 and fp8 "
                          "weights are supported")
        if w.strategy not in ("tensor", "channel", "group", "block") or (
                w.strategy == "block" and not w.block_structure) or (w.strategy == "group" and not w.group_size):
            return refuse(layer, f"{base}.weights.strategy", f"strategy {w.strategy!r} is not supported "
                          "(tensor, channel, group with group_size, block with block_structure)")
        if w.type == "float" and not w.symmetric:
            return refuse(layer, f"{base}.weights.symmetric", "asymmetric fp8 weights are not supported")
        kind = "int8" if w.type == "int" else "fp8"
    if act is not None:
        dynamic = act.dynamic in (True, "local")
        ok = act.symmetric and act.num_bits == 8 and act.type in ("int", "float") and (
            (dynamic and act.strategy == "token")
            or (dynamic and act.type == "float" and act.strategy == "group" and bool(act.group_size))
            or (not dynamic and act.strategy == "tensor"))
        if not ok:
            return refuse(layer, f"{base}.input_activations", f"{act.type}{act.num_bits} {act.strategy} "
                          f"{'dynamic' if dynamic else 'static'}{'' if act.symmetric else ' asymmetric'}: supported "
                          "are symmetric 8-bit dynamic per token, fp8 dynamic per token group, static per tensor")
    return CTScheme(fmt, kind, w, act, mode, why, kernels)


@hookimpl
def quantplug_linear_scheme(layer_name: str, layer_kind: str, shard_names: Sequence[str], quant_config: CTConfig,
                            checkpoint: Any, options: Mapping[str, Any]) -> Any:
    qc = quant_config
    mode = option(options, "activation_quant", "emulate", ACTIVATION_MODES)
    kernels = options["kernels"]  # the core's option, checked by the plan (quantplug.api.LoadOptions)
    if layer_kind == "embedding":
        group, why = qc.group_for(layer_name)
        if group is None:
            return None
        hit = any(not t.startswith("re:") and t not in LINEAR_CLASSES
                  or t.startswith("re:") and match_name(layer_name, t) for t in group.targets)
        info = checkpoint.get(f"{layer_name}.weight")
        if hit and (info is None or not info.is_float):
            return refuse(layer_name, f"config_groups.{group.name}.targets",
                          "quantized embeddings are not supported by quantplug-compressed-tensors")
        return None
    if layer_kind not in ("linear", "experts"):
        return None  # split MLA K/V never occurs in this format; later kinds: stored as floats
    names = list(shard_names) if shard_names else [layer_name]
    if layer_kind == "experts" and any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names):
        # transformers 5 fused 3-D experts: compressed-tensors quantizes nn.Linear modules only
        if all(_is_float(checkpoint, n) for n in names):
            return None
        return refuse(layer_name, "config_groups", "quantized fused 3-D expert tensors are not a compressed-tensors "
                      "layout quantplug knows")
    answers = [(n, *a) for n, a in zip(names, qc.groups_for(names))]
    groups = {g.name if g else None for _, g, _ in answers}
    if groups == {None}:
        return None  # ignored or not targeted: the core's dense scheme answers
    if len(groups) > 1:
        listing = "; ".join(f"{n}: {g.name if g else 'float'} ({why})" for n, g, why in answers[:4])
        return refuse(layer_name, "config_groups / ignore", f"the modules feeding it disagree: {listing}")
    refusal = _global_refusal(layer_name, qc)
    if refusal is not None:
        return refusal
    name, group, why = answers[0]
    assert group is not None
    if group.weights and group.weights.actorder is None and checkpoint.get(f"{name}.weight_g_idx") is not None:
        return refuse(layer_name, f"config_groups.{group.name}.weights.actorder",
                      f"{name}.weight_g_idx is stored: g_idx permutations are not supported")
    return _scheme(layer_name, group, why, mode, kernels)


def _is_float(checkpoint: Any, module: str) -> bool:
    info = checkpoint.get(module) or checkpoint.get(f"{module}.weight")
    return info is not None and info.is_float


@hookimpl
def quantplug_validate_plan(plan: Any, quant_config: CTConfig) -> list[Problem]:
    """Exact ``ignore`` / ``targets`` names must name a module of the checkpoint (a wrong prefix
    would quantize, or fail to ignore, the wrong layers: sglang issue 18370); patterns that match
    nothing are warnings."""
    qc = quant_config
    modules = modules_of(plan.checkpoint.tensors)
    p = f"{qc.prefix}." if qc.prefix else ""
    names: set[str] | None = None  # every module by both names: built only for a pattern to match

    def names_a_module(entry: str) -> bool:
        return entry in modules or bool(p) and p + entry in modules

    # ignore: the core's resolver (names through the prefix and other engines' spellings, a
    # did-you-mean, quantized tensors stored under an ignored module); targets: checked here
    ignore = tuple(e for e in qc.ignore if e not in LINEAR_CLASSES and not is_class_name(e))
    problems: list[Problem] = Exclusions(ignore, f"{qc.where}.ignore", qc.prefix).problems(
        plan.checkpoint.tensors, QUANT_SUFFIXES, kind="ct-name", modules=modules)
    entries = [(e, "ignore") for e in qc.ignore if is_class_name(e)] + [
        (t, f"config_groups.{g.name}.targets") for g in qc.groups for t in g.targets]
    for entry, section in entries:
        if entry in LINEAR_CLASSES:
            continue
        if entry.startswith("re:"):
            if names is None:
                names = {n for m in modules for n in qc.names_of(m)}
            if not any(match_name(n, entry) for n in names):
                problems.append(Problem(f"{qc.where}.{section} pattern {entry!r} matches no module of this "
                                        "checkpoint", layer=entry, severity="warning", kind="ct-name"))
        elif is_class_name(entry):
            problems.append(Problem(f"{qc.where}.{section} entry {entry!r} looks like a module class; "
                                    "quantplug-compressed-tensors maps class targets onto 'Linear' only",
                                    layer=entry, severity="warning", kind="ct-name"))
        elif not names_a_module(entry):
            last = entry.rsplit(".", 1)[-1]
            pool = sorted(n for n in modules if n.rsplit(".", 1)[-1] == last) or sorted(modules)
            close = difflib.get_close_matches(entry, pool, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(Problem(f"{qc.where}.{section} entry {entry!r} matches no module of the checkpoint"
                                    f"{hint}", layer=entry, kind="ct-name"))
    if qc.kv_cache_scheme:
        problems.append(Problem(f"{qc.where}.kv_cache_scheme: KV-cache quantization is not emulated (the cache "
                                "stays in the model dtype)", severity="warning", kind="ct-kv-cache"))
    return problems


@hookimpl
def quantplug_export(model: Any, destination: Any, options: Mapping[str, Any], plan: Any) -> Any:
    from .export import export_w4a16

    return export_w4a16(model, plan, destination, options)
