"""The hook implementations shared by the ``gptq`` and ``awq`` backends: each entry-point module
imports the shared hooks below and answers ``quantplug_detect`` / ``quantplug_export`` for its own
packing (AutoRound's ``packing_format`` picks which one claims)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from quantplug.api import (
    Claim,
    DenseScheme,
    OptionSpec,
    Problem,
    hookimpl,
    quant_config_fields,
    refuse,
    stored_dtype,
)

from .config import IntConfig, packing_of
from .kernels import AWQ, gptq
from .scheme import IntPackScheme

#: the hook-contract version both backends are written for
CONTRACT = "1.5"
#: tensors only a quantized module stores (an excluded module holding one is a plan error)
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
LINEAR = re.compile(r"\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)$")


def detect(checkpoint: Any, backend: str) -> Claim | None:
    qc, where = quant_config_fields(checkpoint)
    if qc is None or packing_of(qc) != backend:
        return None
    prefix = "language_model" if any(n.startswith("language_model.") for n in checkpoint.tensors) else ""
    cfg = IntConfig.parse(qc, where, prefix)
    if cfg is None:
        return None
    how = f", packing_format {qc.get_str('packing_format', 'auto_round:auto_gptq')}" if cfg.method == "auto-round" else ""
    return Claim(backend, cfg, f"config.json {where}.quant_method == {cfg.method!r}{how} ({cfg.default.describe()})")


#: the export options both backends declare (``quantplug_options``)
EXPORT_OPTIONS = [
    OptionSpec("group_size", int, 32, None, "export: inputs per int4 group (scales and zero points per group)",
               minimum=1, maximum=1 << 20, scope="export"),
    OptionSpec("sym", bool, False, None, "export: symmetric int4 (zero point 8) instead of per-group zero points",
               scope="export"),
]


def _stored(checkpoint: Any, module: str) -> tuple[str | None, bool]:
    """(what ``module`` stores: "packed" | a float dtype | None, whether it is a fused expert tensor)."""
    if checkpoint.get(f"{module}.qweight") is not None:
        return "packed", False
    return stored_dtype(checkpoint, module)


@hookimpl
def quantplug_options() -> list[OptionSpec]:
    return list(EXPORT_OPTIONS)  # no load options of their own (the core's apply)


@hookimpl
def quantplug_resolve_prefix(quant_config: IntConfig) -> str:
    return quant_config.prefix


@hookimpl
def quantplug_linear_scheme(layer_name: str, layer_kind: str, shard_names: Sequence[str], quant_config: IntConfig,
                            checkpoint: Any) -> Any:
    qc = quant_config
    if layer_kind == "embedding":
        if _stored(checkpoint, layer_name)[0] == "packed":
            return refuse(layer_name, qc.where, "a quantized embedding is not a GPTQ / AWQ layout quantplug knows")
        return None
    if layer_kind not in ("linear", "experts"):
        return None
    names = list(shard_names) if shard_names else [layer_name]
    stored = {n: _stored(checkpoint, n) for n in names}
    if layer_kind == "experts" and any(fused for _, fused in stored.values()):
        if all(dt not in (None, "packed") for dt, _ in stored.values()):
            return None
        return refuse(layer_name, qc.where, "quantized routed experts in the transformers 5 fused layout have no "
                      f"{qc.packing} tensor names; exports store them per expert")
    answers = []
    for n in names:
        lq, why = qc.layer(n)
        kind = stored[n][0]
        if lq is None and kind == "packed":
            return refuse(layer_name, qc.exclude.source if "entry" in why else qc.where,
                          f"{why} leaves {n} unquantized, but {n}.qweight is stored")
        if lq is not None and kind not in (None, "packed"):
            lq, why = None, f"stored as {kind} (no qweight) although {why} says {qc.default.describe()}"
        answers.append((n, lq, why))
    kinds = {lq for _, lq, _ in answers}
    if len({(k.bits, k.group_size, k.sym, k.desc_act) if k else None for k in kinds}) > 1:
        listing = "; ".join(f"{n}: {lq.describe() if lq else 'float'} ({why})" for n, lq, why in answers[:4])
        return refuse(layer_name, qc.where, f"the modules feeding it disagree: {listing}")
    _, lq, why = answers[0]
    if lq is None:
        dense = DenseScheme()
        dense.reason = why
        return dense
    if qc.data_type != "int":
        return refuse(layer_name, f"{qc.where}.data_type", f"{qc.data_type!r}: only integer weights are supported")
    if lq.bits not in (4, 8) or (lq.group_size <= 0 and lq.group_size != -1):
        return refuse(layer_name, qc.where, f"{lq.describe()} ({why}): supported are 4 / 8 bits, group_size > 0 or -1")
    if qc.packing == "awq" and (lq.bits != 4 or lq.desc_act):
        return refuse(layer_name, qc.where, f"AWQ GEMM {lq.describe()}: only 4-bit without act-order is defined")
    pack = gptq(qc.checkpoint_format) if qc.packing == "gptq" else AWQ
    return IntPackScheme(pack, lq, why)


@hookimpl
def quantplug_validate_plan(plan: Any, quant_config: IntConfig) -> list[Problem]:
    qc, kind = quant_config, f"{quant_config.packing}-name"
    tensors = plan.checkpoint.tensors
    problems = qc.exclude.problems(tensors, QUANT_SUFFIXES, kind=kind)
    for name, info in tensors.items():
        if not name.endswith(".weight") or not info.is_float or len(info.shape) != 2:
            continue
        module = name[: -len(".weight")]
        if not LINEAR.search(module):
            continue
        lq, why = qc.layer(module)
        if lq is not None:
            problems.append(Problem(f"{module} is stored as {info.dtype} although {why} quantizes it "
                                    f"({lq.describe()}); it loads as stored (is an exclusion missing?)",
                                    layer=module, severity="warning", kind=f"{kind}-float"))
    return problems


def backend(packing: str) -> dict[str, Any]:
    """The namespace of entry-point module ``packing`` ("gptq" | "awq"): its contract version, the
    shared hooks, and ``quantplug_detect`` / ``quantplug_export`` for this packing."""

    @hookimpl
    def quantplug_detect(checkpoint: Any) -> Claim | None:
        return detect(checkpoint, packing)

    @hookimpl
    def quantplug_export(model: Any, destination: Path, options: Mapping[str, Any], plan: Any) -> Any:
        from .export import export_int

        return export_int(model, plan, destination, options, packing)

    return {"QUANTPLUG_CONTRACT": CONTRACT, "__version__": "0.1.0", "quantplug_detect": quantplug_detect,
            "quantplug_export": quantplug_export, "quantplug_options": quantplug_options,
            "quantplug_resolve_prefix": quantplug_resolve_prefix, "quantplug_linear_scheme": quantplug_linear_scheme,
            "quantplug_validate_plan": quantplug_validate_plan}
