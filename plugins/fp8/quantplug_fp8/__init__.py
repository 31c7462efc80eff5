"""quantplug backend for DeepSeek's native block FP8 checkpoints (entry point ``fp8``).

DeepSeek-V3 / R1 / V3.1 and Kimi-K2 ship ``quant_method: "fp8"`` with ``weight_block_size``:
every linear of the decoder layers (attention, dense MLP, shared and routed experts) stores
``weight`` F8_E4M3 + ``weight_scale_inv`` F32 per block; embeddings, lm_head, norms and the
router stay BF16. The scheme of a layer follows what the checkpoint stores for it: F8_E4M3 ->
:class:`FP8BlockScheme`, a float weight -> the core's dense scheme (decision reason says so), a
module listed in ``modules_to_not_convert`` / ``ignored_layers`` -> dense, and an FP8 weight
there is a plan-time refusal. The MTP layer (``model.layers.{num_hidden_layers}``) is planned
like the main layers (core option ``mtp``; its BF16 ``eh_proj`` gets the dense scheme).

DeepSeek-V4 (``model_type: deepseek_v4``, release names): every FP8 linear's scale is ``X.scale``,
F8_E8M0 or F32 as its header says; routed experts are FP4 (``X.weight`` I8 [N, K/2] + ``X.scale``
F8_E8M0 [N, K/32], :class:`FP4ExpertScheme`) or FP8 as ``expert_dtype`` says (top level, or inside
``quantization_config``), each expert's stored dtype deciding where the config is silent. A stored
dtype that contradicts ``expert_dtype``, or an I8 weight outside the routed experts, is a plan-time
refusal naming the tensor.

Options: ``activation_quant`` = ``dynamic`` (default: emulate DeepSeek's per-token, per-128
FP8 activation quantization) or ``none`` (weight-only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from quantplug.api import (
    Claim,
    DenseScheme,
    Fields,
    OptionSpec,
    Problem,
    hookimpl,
    option,
    quant_config_fields,
    refuse,
    stored_dtype,
)

from .config import FP8Config, matches
from .scheme import ACTIVATION_MODES, FP4ExpertScheme, FP8BlockScheme

__version__ = "0.1.0"
QUANTPLUG_CONTRACT = "1.5"
WRAPPER = "language_model"


@hookimpl
def quantplug_detect(checkpoint: Any) -> Claim | None:
    qc, where = quant_config_fields(checkpoint)
    if qc is None or qc.opt_str("quant_method") != "fp8" or not qc.has("weight_block_size"):
        return None  # per-tensor FP8 (no weight_block_size) is another format
    parsed = FP8Config.parse(qc, where, Fields(checkpoint.config, str(checkpoint.path / "config.json")))
    if not any(t.dtype == "F8_E4M3" or (parsed.v4 and t.dtype == "I8" and t.name.endswith(".weight"))
               for t in checkpoint.tensors.values()):
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
        OptionSpec("expert_dtype", str, "fp4", ("fp4", "fp8"), "export of a DeepSeek-V4 model: its routed experts as "
                   "FP4 E2M1 with E8M0 scales per 32 (the release) or as FP8 blocks", scope="export"),
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
    if quant_config.v4:
        answer = _v4_scheme(layer_name, layer_kind, names, stored, quant_config, checkpoint, mode)
        if answer is not None:
            return answer
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
    return FP8BlockScheme(quant_config.block, mode, quant_config.scale_fmt, reason=why,
                          scale_suffix=quant_config.scale_suffix, scale_dtype=_scale_dtype(checkpoint, fp8, quant_config))


def _scale_dtype(checkpoint: Any, names: Sequence[str], qc: FP8Config) -> str:
    """"E8M0" where the header stores the first scale of ``names`` as F8_E8M0, else "F32" (the
    scheme's spec then checks every shard's scale against it)."""
    for n in names:
        info = checkpoint.get(f"{n}.{qc.scale_suffix}")
        if info is not None:
            return "E8M0" if info.dtype == "F8_E8M0" else "F32"
    return "F32"


def _v4_scheme(layer_name: str, layer_kind: str, names: Sequence[str], stored: Mapping[str, tuple[str | None, bool]],
               qc: FP8Config, checkpoint: Any, mode: str) -> Any:
    """DeepSeek-V4's answers that differ from V3's: FP4 routed experts, ``expert_dtype`` against the
    headers, scale dtypes that differ between shards; None: the V3 rules (FP8 / float) apply."""
    def tensor(n: str) -> str:
        return f"{n}.weight"

    i8 = [n for n, (dt, _) in stored.items() if dt == "I8"]
    fp8 = [n for n, (dt, _) in stored.items() if dt == "F8_E4M3"]
    if layer_kind != "experts":
        if i8:
            return refuse(layer_name, "weight dtype", f"{tensor(i8[0])} is I8 (packed FP4), which DeepSeek-V4 "
                          "stores only for routed experts; expected F8_E4M3 + .scale or a float weight")
        scales = {checkpoint.get(f"{n}.scale").dtype for n in fp8 if checkpoint.get(f"{n}.scale") is not None}
        if len(scales) > 1:
            return refuse(layer_name, "scale dtype", f"shards store scales as {' and '.join(sorted(scales))}")
        return None
    want = qc.expert_dtype
    if want == "fp4" and fp8:
        return refuse(layer_name, qc.expert_dtype_key, f"{tensor(fp8[0])} is F8_E4M3 but {qc.expert_dtype_key} is "
                      "'fp4': expected I8 [N, K/2] packed E2M1 + F8_E8M0 .scale [N, K/32]")
    if want == "fp8" and i8:
        return refuse(layer_name, qc.expert_dtype_key, f"{tensor(i8[0])} is I8 (packed FP4) but "
                      f"{qc.expert_dtype_key} is 'fp8': expected F8_E4M3 [N, K] + .scale [ceil(N/"
                      f"{qc.block[0]}), ceil(K/{qc.block[1]})]")
    if i8 and fp8:
        return refuse(layer_name, "weight dtype", f"routed experts mix FP4 and FP8: {tensor(i8[0])} is I8, "
                      f"{tensor(fp8[0])} is F8_E4M3")
    floats = [n for n, (dt, _) in stored.items() if dt is not None and dt not in ("I8", "F8_E4M3")]
    if i8 and floats:
        return refuse(layer_name, "weight dtype", f"routed experts mix FP4 and float weights: {tensor(i8[0])} is "
                      f"I8, {tensor(floats[0])} is {stored[floats[0]][0]}")
    if want == "fp4" and floats:
        return refuse(layer_name, qc.expert_dtype_key, f"{tensor(floats[0])} is {stored[floats[0]][0]} but "
                      f"{qc.expert_dtype_key} is 'fp4': expected I8 [N, K/2] packed E2M1 + F8_E8M0 .scale [N, K/32]")
    if i8 or want == "fp4":
        src = f"{qc.expert_dtype_key} 'fp4'" if want == "fp4" else "weight I8 (packed FP4)"
        return FP4ExpertScheme(mode, qc.block[1], qc.scale_fmt, reason=src)
    scales = {checkpoint.get(f"{n}.scale").dtype for n in fp8 if checkpoint.get(f"{n}.scale") is not None}
    if len(scales) > 1:
        return refuse(layer_name, "scale dtype", f"routed experts store scales as {' and '.join(sorted(scales))}")
    return None


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
