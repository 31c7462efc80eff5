"""quantplug backend for Huawei msModelSlim exports (entry point ``modelslim``).

ModelSlim has nothing to say about attention layout, so this plugin does not implement
``quantplug_attention_layout``: a FLOAT ``kv_b_proj`` keeps the core's dense layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from quantplug.api import Claim, ConfigError, OptionSpec, Problem, hookimpl, refuse, sidecar_fields

from .schemes import ACTIVATION_MODES, W4A8Dynamic, W8A8Dynamic, W8A8Static

#: the hook-contract version this plugin is written for (quantplug.api.CONTRACT_VERSION)
QUANTPLUG_CONTRACT = "1.4"

__version__ = "0.1.0"
GLOBAL_KEYS = {"model_quant_type", "version", "group_size", "metadata", "kv_quant_type", "fa_quant_type",
               "kv_cache_type", "reduce_quant_type", "model_type"}
PACKED = {"gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}


@dataclass(frozen=True)
class ModelSlimConfig:
    file: str
    model_quant_type: str
    types: Mapping[str, str]
    globals: Mapping[str, Any]

    def type_of(self, tensor: str) -> str | None:
        return self.types.get(tensor)


def _description_file(checkpoint: Any) -> str | None:
    names = checkpoint.sidecar_names
    if "quant_model_description.json" in names:
        return "quant_model_description.json"
    older = [n for n in names if n.startswith("quant_model_description_") and n.endswith(".json")]
    return older[0] if older else None


@hookimpl
def quantplug_detect(checkpoint: Any) -> Claim | None:
    name = _description_file(checkpoint)
    if name is None:
        return None
    if not isinstance(checkpoint.sidecar(name), dict):
        raise ConfigError(f"{checkpoint.path / name}: expected a JSON object of tensor name -> type")
    desc = sidecar_fields(checkpoint, name)
    assert desc is not None
    # every key but the global ones names a tensor and must map to a type string (a number or a
    # list there is an error, never a silently skipped tensor)
    types = {k: desc.get_str(k) for k in desc.data if k not in GLOBAL_KEYS}
    globals_: dict[str, Any] = {}
    for key in GLOBAL_KEYS & set(desc.data):
        if key == "group_size":
            globals_[key] = desc.get_int(key, 0, 1 << 20, 0)
        elif key == "metadata":
            meta = desc.get_obj(key)
            globals_[key] = MappingProxyType(dict(meta.data)) if meta is not None else None
        else:
            globals_[key] = desc.opt_str(key)
    cfg = ModelSlimConfig(name, globals_.get("model_quant_type") or "", MappingProxyType(types),
                          MappingProxyType(globals_))
    return Claim("modelslim", cfg, f"{name} beside config.json (model_quant_type {cfg.model_quant_type or '?'})")


@hookimpl
def quantplug_options() -> list[OptionSpec]:
    return [
        OptionSpec("activation_quant", str, "ascend", ACTIVATION_MODES,
                   "ascend: the activation quantization vllm-ascend computes; msmodelslim: the tool's own numerics"),
        OptionSpec("recipes", list, ["w8a8", "w4a8"], None, "export: which ModelSlim checkpoints to write",
                   scope="export"),
        OptionSpec("calibration", list, None, None, "export: calibration batches (token id tensors)", scope="export"),
        OptionSpec("float_dtype", str, "float32", ("float32", "bfloat16", "float16"),
                   "export: dtype of the FLOAT (unquantized) tensors written; a release quantized from a "
                   "bfloat16 model stores them as bfloat16", scope="export"),
    ]


@hookimpl
def quantplug_resolve_prefix(model_config: Any, quant_config: ModelSlimConfig) -> str:
    # description keys are full checkpoint names; the Kimi wrappers name them language_model.*
    if model_config.is_wrapper and any(k.startswith("language_model.") for k in quant_config.types):
        return "language_model"
    return ""


@hookimpl
def quantplug_packed_modules() -> Mapping[str, Sequence[str]]:
    return PACKED


def _weight_key(cfg: ModelSlimConfig, module: str) -> str:
    return f"{module}.weight" if f"{module}.weight" in cfg.types else module


@hookimpl
def quantplug_linear_scheme(layer_name: str, layer_kind: str, shard_names: Sequence[str],
                            quant_config: ModelSlimConfig, options: Mapping[str, Any]) -> Any:
    if layer_kind not in ("linear", "experts", "attn_k_b", "attn_v_b"):
        return None  # embeddings (and kinds added later) are stored as floats in this format
    names = list(shard_names) if shard_names else [layer_name]
    types = {n: quant_config.type_of(_weight_key(quant_config, n)) for n in names}
    missing = [n for n, t in types.items() if t is None]
    if missing:
        return refuse(layer_name, quant_config.file, f"{quant_config.file} has no type for {_weight_key(quant_config, missing[0])}")
    kinds = set(types.values())
    if len(kinds) > 1:
        return refuse(layer_name, quant_config.file, "shards have different description types: "
                           + ", ".join(f"{n.rsplit('.', 1)[-1]}={t}" for n, t in types.items()))
    kind = kinds.pop()
    mode = str(options.get("activation_quant", "ascend"))  # checked against the declared choices by the plan
    if kind == "FLOAT":
        return None  # the core's dense scheme
    if kind == "W8A8":
        return W8A8Static()
    group = int(quant_config.globals.get("group_size") or 0)
    if kind == "W8A8_DYNAMIC":
        return W8A8Dynamic(mode, group)
    if kind == "W4A8_DYNAMIC":
        return W4A8Dynamic(mode, group)
    return refuse(layer_name, quant_config.file, f"description type {kind!r} is not supported by quantplug-modelslim "
                       "(supported: FLOAT, W8A8, W8A8_DYNAMIC, W4A8_DYNAMIC)")


@hookimpl
def quantplug_validate_plan(plan: Any, quant_config: ModelSlimConfig) -> list[Problem]:
    problems = []
    tensors = plan.checkpoint.tensors
    for key in quant_config.types:
        if key not in tensors:
            problems.append(Problem(f"{quant_config.file} key {key!r} matches no tensor of the checkpoint",
                                    layer=key, kind="modelslim-key"))
    for name, info in tensors.items():
        if not info.is_float and name not in quant_config.types:
            problems.append(Problem(f"quantized tensor ({info.dtype}) has no key in {quant_config.file}",
                                    tensor=name, file=info.file.name, kind="modelslim-key"))
    return problems


@hookimpl
def quantplug_export(model: Any, plan: Any, destination: Any, options: Mapping[str, Any]) -> Any:
    from .export import export_modelslim

    return export_modelslim(model, plan, destination, options)
