"""quantplug backend for NVIDIA ModelOpt checkpoints (entry point ``modelopt``): nvidia/DeepSeek-R1-FP4,
-0528-FP4, Kimi-K2.x NVFP4 and every ``export_hf_checkpoint`` output of quant_algo NVFP4,
W4A16_NVFP4, FP8 (per tensor) and MIXED_PRECISION (per-module ``quantized_layers``).

Decisions, each a hook answer: the claim (``hf_quant_config.json`` or config.json
``quant_method: "modelopt"``), the ``language_model`` prefix (from the tensor names), the
per-layer algorithm (``exclude_modules`` / ``ignore`` resolved through
:class:`quantplug.api.Exclusions`: exact names, wildcards, other engines' names, through the
prefix), the scheme (what the checkpoint stores for the layer), plan-time refusals of algorithms
this plugin does not compute, and the checks of the exclusion list against the checkpoint.

Options (declared in :func:`quantplug_options`): ``activation_quant`` = ``emulate`` (default: NVFP4
/ FP8 activations quantized from the stored ``input_scale`` as the deployed kernels do) or ``none``
(weight-only); export: ``algo`` and ``input_amax``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from quantplug.api import Claim, DenseScheme, OptionSpec, Problem, hookimpl, refuse, stored_dtype

from .config import SUPPORTED, LayerAlgo, ModelOptConfig
from .export import ALGOS
from .schemes import ACTIVATION_MODES, FP8Scheme, NVFP4Scheme

__version__ = "0.1.0"
QUANTPLUG_CONTRACT = "1.5"
#: tensors that only a quantized module stores
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")
QUANTIZED_DTYPES = ("U8", "F8_E4M3", "I8")


@hookimpl
def quantplug_detect(checkpoint: Any) -> Claim | None:
    cfg = ModelOptConfig.parse(checkpoint)
    if cfg is None:
        return None
    return Claim("modelopt", cfg, f"{cfg.where}.quant_algo == {cfg.algo!r} ({cfg.producer})")


@hookimpl
def quantplug_options() -> list[OptionSpec]:
    return [
        OptionSpec("activation_quant", str, "emulate", ACTIVATION_MODES,
                   "emulate: NVFP4 / FP8 activations quantized from the stored input_scale; none: weight-only"),
        OptionSpec("algo", str, "W4A16_NVFP4", ALGOS, "export: the quant_algo written", scope="export"),
        OptionSpec("input_amax", float, 16.0, None, "export: the activation amax the input scales assume",
                   minimum=1e-6, maximum=1e30, scope="export"),
    ]


@hookimpl
def quantplug_resolve_prefix(quant_config: ModelOptConfig) -> str:
    return quant_config.prefix


@hookimpl
def quantplug_linear_scheme(layer_name: str, layer_kind: str, shard_names: Sequence[str],
                            quant_config: ModelOptConfig, checkpoint: Any, options: Mapping[str, Any]) -> Any:
    qc = quant_config
    mode = options["activation_quant"]
    if layer_kind == "embedding":
        dtype, _ = stored_dtype(checkpoint, layer_name)
        if dtype in QUANTIZED_DTYPES:
            return refuse(layer_name, qc.where, f"a quantized embedding ({dtype}) is not a ModelOpt layout quantplug "
                          "knows")
        return None
    if layer_kind not in ("linear", "experts"):
        return None  # split MLA K/V does not occur in this format; later kinds: stored as floats
    names = list(shard_names) if shard_names else [layer_name]
    stored = {n: stored_dtype(checkpoint, n) for n in names}
    if layer_kind == "experts" and any(fused for _, fused in stored.values()):
        if all(dt is not None and dt not in QUANTIZED_DTYPES for dt, _ in stored.values()):
            return None  # transformers 5 fused 3-D experts in float: ModelOpt writes quantized ones per expert
        return refuse(layer_name, qc.where, "quantized routed experts in the transformers 5 fused layout "
                      "(gate_up_proj / down_proj) have no ModelOpt scale names; its exports store them per expert")
    answers: list[tuple[str, LayerAlgo | None, str]] = []
    for n in names:
        algo = qc.algo_for(n)
        dtype = stored[n][0]
        if algo is not None and dtype is not None and dtype not in QUANTIZED_DTYPES \
                and checkpoint.get(f"{n}.weight_scale") is None:
            # the config says quantized, the checkpoint holds floats and no scales: load what is
            # stored (validate_plan warns: a wrong exclude spelling is the usual cause)
            answers.append((n, None, f"stored as {dtype} (no weight_scale) although {algo.why}"))
        elif algo is None:
            if dtype in QUANTIZED_DTYPES:  # validate_plan names the entry and the scales stored
                mixed = qc.algo == "MIXED_PRECISION"
                return refuse(layer_name, f"{qc.where}.quantized_layers" if mixed else qc.exclude.source,
                              ("not listed" if mixed else f"entry {qc.exclude.excluded_by(n)!r} excludes {n}")
                              + f", but its weight is stored as {dtype} (quantized)")
            answers.append((n, None, qc.why_unquantized(n)))
        else:
            answers.append((n, algo, algo.why))
    kinds = {(a.algo, a.group_size) if a else None for _, a, _ in answers}
    if len(kinds) > 1:
        listing = "; ".join(f"{n}: {a.algo if a else 'float'} ({why})" for n, a, why in answers[:4])
        return refuse(layer_name, qc.where, f"the modules feeding it disagree: {listing}")
    name, algo, why = answers[0]
    if algo is None:
        dense = DenseScheme()
        dense.reason = why
        return dense
    if algo.algo not in SUPPORTED:
        return refuse(layer_name, f"{qc.where}.quant_algo", f"{algo.algo} is not supported by quantplug-modelopt "
                      f"(supported: {', '.join(SUPPORTED)}, MIXED_PRECISION of those)")
    act = checkpoint.get(f"{name}.input_scale") is not None
    if algo.algo == "FP8":
        return FP8Scheme(act, mode, why)
    group = algo.group_size or 16
    if group != 16:
        return refuse(layer_name, f"{qc.where}.group_size", f"NVFP4 group_size {group}: the format's blocks are 16")
    return NVFP4Scheme(group, act and algo.algo == "NVFP4", mode, why)


@hookimpl
def quantplug_validate_plan(plan: Any, quant_config: ModelOptConfig) -> list[Problem]:
    """The exclusion list against the checkpoint (names that match nothing, scales stored for an
    excluded module), MIXED_PRECISION's layer names, float layers the config says are quantized,
    and the KV-cache algorithm (not emulated)."""
    qc = quant_config
    tensors = plan.checkpoint.tensors
    problems = qc.exclude.problems(tensors, QUANT_SUFFIXES, kind="modelopt-name")
    if qc.algo == "MIXED_PRECISION":
        problems += qc.layer_map.problems(tensors, kind="modelopt-name")
    for name, info in tensors.items():
        if not name.endswith(".weight") or not info.is_float or len(info.shape) != 2:
            continue
        module = name[: -len(".weight")]
        algo = qc.algo_for(module)
        if algo is not None and f"{module}.weight_scale" not in tensors and "embed_tokens" not in module:
            problems.append(Problem(f"{module} is stored as {info.dtype} although {algo.why} says {algo.algo}; "
                                    "it loads as stored (is an exclude entry misspelled?)", layer=module,
                                    severity="warning", kind="modelopt-float"))
    if qc.kv_cache_algo:
        problems.append(Problem(f"{qc.where}.kv_cache_quant_algo {qc.kv_cache_algo!r}: KV-cache quantization is not "
                                "emulated (the latent cache stays in the model dtype)", severity="warning",
                                kind="modelopt-kv-cache"))
    return problems


@hookimpl
def quantplug_export(model: Any, destination: Any, options: Mapping[str, Any], plan: Any) -> Any:
    from .export import export_modelopt

    return export_modelopt(model, plan, destination, options)
