"""The public plugin API: the one module a quantplug backend imports.

Everything a backend needs is here, and everything here is public: names are kept (or
deprecated with a warning for at least one minor contract version) across versions of the
contract :data:`CONTRACT_VERSION`. Anything not re-exported here is private to the core and may
change without notice; the bundled backends import quantplug only through this module (a test
enforces it).

Groups:

* the contract: :data:`hookimpl`, :data:`CONTRACT_VERSION`, the hook names (``HOOKS``);
* answers: :class:`Claim`, :class:`AttentionLayout`, :class:`Problem`, :class:`ExportResult`,
  :class:`TensorSpec` (and what a scheme is given: :class:`TensorInfo`), :class:`OptionSpec`
  (``quantplug_options``);
* schemes: :class:`LinearScheme` (abstract), :class:`DenseScheme`, :func:`refuse` (a plan-time
  refusal naming the layer and the field, never a silent dense fallback), :data:`LAYER_KINDS`,
  :class:`SplitRule` (how a stored tensor follows a tensor-parallel split: ``LinearScheme.split``);
* what hooks receive: :class:`Checkpoint`, :class:`ModelConfig`, :class:`RopeConfig`,
  :class:`LoadPlan`, :class:`LoadOptions` (``options``: the checked load options, a read-only
  mapping with a typed field per core option, 1.8) and the values of the core's options
  (:data:`KERNELS`); :class:`TakesOptions` (a module that takes the load's options, 1.8);
* validated config reading (1.4): :class:`Fields` (typed field readers with key paths),
  :func:`config_fields`, :func:`quant_config_fields`, :func:`sidecar_fields`, :func:`read_json`
  (a JSON file, size and nesting bounded);
* reading: :func:`stored_dtype` (what a module's weight is stored as, 1.5),
  :func:`read_gguf_header` / :class:`GGUFHeader`, :data:`GGUF_FLOATS`,
  :data:`TORCH_DTYPES`, :data:`SAFETENSORS_DTYPES`, :func:`read_into`; :func:`contained` /
  :func:`check_inside` (a file name read from checkpoint metadata must stay inside its directory);
  :data:`qpack` (the version-2 expert pack of safetensors checkpoints: its layout and reader);
* run-time statistics (1.5): :class:`StatsSource` (``stats() -> Mapping[str, float]``),
  :func:`expose_stats` (a backend registers one on the loaded model), :func:`stats_sources`;
* exporting: :func:`dense_state` (a loaded model back to dense tensors, hub layout),
  :func:`named_linears`, :func:`convert_expert_layout`, :func:`plan_of`;
* adding an architecture (``quantplug_architectures``): :class:`ArchSpec`, :class:`PlanOracle`
  and the planned layers a model is built from (:class:`QuantLinear`, :class:`StackedLinear` with
  its :class:`StackLayout`, :class:`Embedding`, :class:`RMSNorm`, :class:`FloatParams`,
  :class:`Rotary`); what the architecture declares for the core to read (1.5): its
  tensor-parallel plan ``qp_tp_plan`` (:class:`ColumnParallel`, :class:`RowParallel`,
  :class:`FeatureParallel`, :class:`HeadParallel` (:class:`HeadSlice`), :class:`ExpertParallel`,
  :class:`VocabParallel`, with the module interfaces :class:`HeadGroup`, :class:`ExpertGroup`,
  :class:`TiedModule`) and its dense-state mapping ``qp_dense_state`` (:class:`Unstack`,
  :class:`FoldHeads`); a router declared as data (1.11): :class:`RouterSpec` (the native
  whole-stack step routes by a router module's ``spec``) and its reference :func:`route`;
* errors: :class:`QuantplugError` and its subclasses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import torch
from torch import nn

from .blocks import MLA, MLP, Experts, MoE, Router
from .checkpoint import TORCH_DTYPES, Checkpoint, qpack, storage_shape
from .checkpoint.gguf_index import GGUF_FLOATS, GGUFHeader, SkippedArray, ggml_types, read_gguf_header
from .checkpoint.safetensors_index import write_header as safetensors_header
from .contract.arch import ArchSpec, PlanOracle
from .contract.config import ModelConfig, RopeConfig, parse_model_config
from .contract.options import KERNELS, LoadOptions, TakesOptions
from .contract.routing import RouterSpec, route
from .contract.scheme import (
    FLOATS,
    FusedLayout,
    LinearScheme,
    PerIndexLayout,
    SplitRule,
    StackedLayout,
    StackLayout,
)
from .errors import (
    AmbiguousBackendError,
    CheckpointError,
    ConfigError,
    LoadError,
    NoBackendError,
    PlanError,
    PluginLoadError,
    QuantplugError,
    UnknownArchitectureError,
)
from .exclusions import ALIASES, Exclusions, modules_of
from .hookspecs import BACKEND_HOOKS, CONTRACT_VERSION, GLOBAL_HOOKS, hookimpl
from .kernels import ggml, native
from .kernels.forms import ActQuant, Form, Weights
from .layers.embedding import Embedding
from .layers.linear import (
    DenseScheme,
    FloatParams,
    QuantLinear,
    RefusedScheme,
    StackedLinear,
    fuse_attention,
    fuse_int4_packs,
    fuse_mlp,
    int4pack_rows_separable,
)
from .layers.norm import RMSNorm
from .layers.rope import Rotary
from .memory import read_into
from .models.declarations import (
    ColumnParallel,
    DeclarationError,
    EngineExperts,
    EngineFloats,
    EngineGroupedLinear,
    EngineLatentAttention,
    EngineMLP,
    EngineRename,
    ExpertGroup,
    ExpertParallel,
    FeatureParallel,
    FoldHeads,
    HeadGroup,
    HeadParallel,
    HeadPart,
    HeadSlice,
    LatentAttention,
    RoutedExperts,
    RowParallel,
    TiedModule,
    Unstack,
    VocabParallel,
    ckpt_name,
    declared,
)
from .models.deepseek import DecoderLayer, DeepseekV3ForCausalLM
from .plan import LoadPlan
from .stats import StatsSource, expose_stats, stats_sources
from .types import (
    FLOAT_DTYPES,
    SAFETENSORS_DTYPES,
    AttentionLayout,
    Claim,
    Decision,
    ExportResult,
    OptionSpec,
    PluginInfo,
    Problem,
    SkipRule,
    TensorInfo,
    TensorSpec,
)
from .validation import Fields, check_inside, contained, read_json
from .validation import quant_config_fields as _quant_config_fields

#: What a scheme's ``dequantize`` / ``apply`` / ``embed`` / ``process_after_loading`` receive as
#: ``layer``: the planned module (``QuantLinear``, ``StackedLinear``, ``Embedding``) holding one
#: parameter per spec suffix (``layer.weight``, ``layer.weight_scale``...; stacked ones with a
#: leading slot dimension), ``layer.model_dtype`` and, for stacks, ``layer.n``. Typed ``Any``
#: because those attributes come from the scheme's own specs.
Layer: TypeAlias = Any

#: Every hook of the contract, by scope.
HOOKS = GLOBAL_HOOKS | BACKEND_HOOKS

#: The layer kinds ``quantplug_linear_scheme`` is asked about (answer None for kinds you do not know).
LAYER_KINDS = ("linear", "experts", "attn_k_b", "attn_v_b", "embedding")


def refuse(layer_name: str, field: str, why: str) -> RefusedScheme:
    """A scheme answer that refuses a layer at plan time.

    Return it from ``quantplug_linear_scheme`` when the format asks for something the backend
    cannot compute (``actorder``, 2:4 sparsity, an unknown ``group_size``...). The plan then
    holds one error Problem naming ``layer_name`` and the config ``field`` (problems with the
    same field and reason are grouped in messages); no dense fallback happens.
    """
    return RefusedScheme(layer_name, field, why)


def dense_state(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The loaded model's weights as dense tensors, in the Hugging Face hub layout.

    Names are the checkpoint's text-model names (Kimi wrappers keep ``language_model.``;
    GGUF checkpoints come back under Hugging Face names). Stacked layers follow the
    architecture's ``qp_dense_state`` declaration (:mod:`quantplug.models.declarations`): for
    DeepSeek-V3, routed experts one tensor per expert and projection
    (``...experts.{k}.gate_proj.weight``, :class:`Unstack`), split MLA ``k_b`` / ``v_b`` folded
    back into ``kv_b_proj`` (:class:`FoldHeads`). Every quantized weight goes through its scheme's
    ``dequantize``; exporters quantize these tensors into their own format.
    """
    rules = {id(mod): (name, mod, rule) for name, mod, rule in declared(model, "qp_dense_state", (Unstack, FoldHeads))}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mod in model.modules():
        if id(mod) in seen:
            continue
        if id(mod) in rules:
            name, _, rule = rules[id(mod)]
            for stack in _stacks(mod, rule, name):
                seen.add(id(stack))
            _dense_declared(out, name, mod, rule, dtype)
        elif isinstance(mod, QuantLinear | Embedding):
            out[f"{mod.qp_ckpt}.weight"] = mod.scheme.dequantize(mod).detach().to(dtype).contiguous()
        elif isinstance(mod, StackedLinear):
            raise QuantplugError(f"dense_state: stacked linear {mod.qp_ckpt} is named by no qp_dense_state entry of "
                                 "its architecture (Unstack / FoldHeads)")
        elif isinstance(mod, FloatParams):
            for local, sources in mod.qp_sources.items():
                t = getattr(mod, local, None)
                if t is None:
                    continue
                # index tensors (DeepSeek-V4's tid2eid) stay integers
                out[sources[0].tensor] = (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous()
    return out


def _stacks(mod: nn.Module, rule: Unstack | FoldHeads, name: str) -> list[StackedLinear]:
    children = dict(mod.named_children())
    members = rule.stacks if isinstance(rule, Unstack) else tuple(p.member for p in rule.parts)
    out = []
    for m in members:
        child = children.get(m)
        if not isinstance(child, StackedLinear):
            raise DeclarationError(f"qp_dense_state: {name}.{m} is {type(child).__name__}, expected a StackedLinear")
        out.append(child)
    return out


def _dense_declared(out: dict[str, torch.Tensor], name: str, mod: nn.Module, rule: Unstack | FoldHeads,
                    dtype: torch.dtype) -> None:
    stacks = _stacks(mod, rule, name)
    if isinstance(rule, Unstack):
        # experts served from the checkpoint's files (core Experts.qp_store); getattr: a third
        # party's module declared by Unstack need not have one
        store = getattr(mod, "qp_store", None)
        for j, lin in enumerate(stacks):
            base, proj = lin.qp_ckpt.rsplit(".", 1)
            proj = rule.stored[j] if rule.stored else proj
            for k in range(lin.n):
                w = store.dequantize(lin, k) if store is not None else lin.scheme.dequantize(lin, k)
                out[f"{base}.{k}.{proj}.weight"] = w.detach().to(dtype).contiguous()
        return
    if len({s.n for s in stacks}) != 1:
        raise DeclarationError(f"qp_dense_state: {name}: FoldHeads parts hold {[s.n for s in stacks]} heads")
    heads: list[torch.Tensor] = []
    for h in range(stacks[0].n):
        for stack, part in zip(stacks, rule.parts):
            w = stack.scheme.dequantize(stack, h).detach().to(dtype)
            heads.append(w.t() if part.transpose else w)
    out[f"{ckpt_name(mod, name)}.{rule.into}.weight"] = torch.cat(heads).contiguous()


def named_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(checkpoint module name, module)`` of every linear of layer kind ``"linear"`` (the modules
    ``quantplug_linear_scheme`` is asked about one by one: attention and dense-MLP projections,
    shared experts, ``lm_head``; not routed experts, MLA K/V stacks, the router or the embedding).
    ``module(x)`` runs it; forward hooks on it see its input (calibration)."""
    return [(m.qp_ckpt, m) for m in model.modules() if isinstance(m, QuantLinear)]


def convert_expert_layout(state: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Routed experts between the hub layout (``experts.{k}.{proj}.weight``, ``layout="hub"``) and
    the transformers 5 fused one (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``,
    ``layout="fused"``); other tensors pass through."""
    if layout not in ("hub", "fused"):
        raise QuantplugError(f"convert_expert_layout: layout {layout!r}; expected 'hub' or 'fused'")
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        if ".mlp.experts." not in name:
            out[name] = t
            continue
        base, rest = name.split(".mlp.experts.", 1)
        if layout == "fused" and rest[0].isdigit():
            idx, proj, _ = rest.split(".", 2)
            groups.setdefault(base, {}).setdefault(int(idx), {})[proj] = t
        elif layout == "hub" and not rest[0].isdigit():
            for k in range(int(t.shape[0])):
                if rest == "gate_up_proj":
                    inter = t.shape[1] // 2
                    out[f"{base}.mlp.experts.{k}.gate_proj.weight"] = t[k, :inter].clone()
                    out[f"{base}.mlp.experts.{k}.up_proj.weight"] = t[k, inter:].clone()
                else:
                    out[f"{base}.mlp.experts.{k}.down_proj.weight"] = t[k].clone()
        else:
            out[name] = t
    for base, experts in groups.items():
        ks = sorted(experts)
        out[f"{base}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[k]["gate_proj"], experts[k]["up_proj"]]) for k in ks])
        out[f"{base}.mlp.experts.down_proj"] = torch.stack([experts[k]["down_proj"] for k in ks])
    return out


def plan_of(model: nn.Module) -> LoadPlan:
    """The :class:`LoadPlan` a model was loaded from (exporters read prefix, config, options)."""
    plan = getattr(model, "quantplug_plan", None)
    if not isinstance(plan, LoadPlan):
        raise QuantplugError(f"{type(model).__name__} was not loaded by quantplug (no load plan attached)")
    return plan


def config_fields(checkpoint: Checkpoint) -> Fields:
    """config.json as :class:`Fields`: typed, range-checked readers whose failures are one
    ``ConfigError`` line naming the file and the key path (``.../config.json: quantization_config.
    weight_block_size = [0, 128]: expected a list of 2 integers in [1, 65536]``).

    .. versionadded:: 1.4"""
    return Fields(checkpoint.config, str(checkpoint.path / "config.json"))


def quant_config_fields(checkpoint: Checkpoint) -> tuple[Fields | None, str]:
    """config.json's ``quantization_config`` (or, in Kimi wrappers, ``text_config``'s) as
    :class:`Fields`, and its key path; ``(None, "")`` when there is none. Not an object, or a
    ``quant_method`` that is not a string: a ``ConfigError`` (the core checks this before detection).

    .. versionadded:: 1.4"""
    return _quant_config_fields(checkpoint.config, str(checkpoint.path / "config.json"))


def sidecar_fields(checkpoint: Checkpoint, name: str) -> Fields | None:
    """A sidecar JSON file next to config.json (bounded read) as :class:`Fields`, or None when
    absent; a file that is not a JSON object is a ``ConfigError`` naming it.

    .. versionadded:: 1.4"""
    data = checkpoint.sidecar(name)
    if data is None:
        return None
    return Fields(data, str(checkpoint.path / name))


def stored_dtype(checkpoint: Checkpoint, module: str) -> tuple[str | None, bool]:
    """What the checkpoint stores as ``module``'s weight: the dtype of ``{module}.weight``, or of
    ``module`` itself when that is one tensor (transformers 5 fused routed experts,
    ``experts.gate_up_proj``), and whether it is such a fused tensor; ``(None, False)`` when neither
    exists (the plan reports the missing tensor).

    .. versionadded:: 1.5"""
    info = checkpoint.get(f"{module}.weight")
    if info is not None:
        return info.dtype, False
    info = checkpoint.get(module)
    return (info.dtype, True) if info is not None else (None, False)


def unsplit_features(layer: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of a linear before any tensor-parallel split: a split
    layer's ``out_features`` / ``in_features`` are this rank's slice, but a stored shape record
    (compressed-tensors ``weight_shape``) holds the whole layer's."""
    if not isinstance(layer, QuantLinear | StackedLinear):
        raise QuantplugError(f"unsplit_features: {type(layer).__name__} is not a QuantLinear or StackedLinear")
    return layer.full_features


def option(options: Mapping[str, Any], key: str, default: Any, choices: tuple[Any, ...] | None = None) -> Any:
    """``options[key]`` (the ``-o KEY=VALUE`` / ``options=`` value) or ``default``, checked
    against ``choices``: a wrong value is a :class:`ConfigError` naming the key and the choices.

    Since contract 1.4 the plan has already checked every declared option (``quantplug_options``)
    and filled in its default, so ``options[key]`` is enough; this stays for plugins that read
    options they do not declare."""
    value = options.get(key, default)
    if choices is not None and value not in choices:
        raise ConfigError(f"option {key}={value!r}: expected one of {', '.join(map(repr, choices))}")
    return value


__all__ = [
    "CONTRACT_VERSION", "HOOKS", "LAYER_KINDS", "Layer", "hookimpl",
    # the compute layer (weight forms and their kernels)
    "ActQuant", "Form", "Weights", "ggml", "native",
    # answers and values
    "AttentionLayout", "Claim", "Decision", "ExportResult", "OptionSpec", "PluginInfo", "Problem", "SkipRule",
    "TensorInfo", "TensorSpec",
    # schemes
    "DenseScheme", "FLOATS", "LinearScheme", "RefusedScheme", "SplitRule", "fuse_attention", "fuse_int4_packs", "fuse_mlp", "int4pack_rows_separable",
    "refuse",
    # exclusion / ignore lists
    "ALIASES", "Exclusions", "modules_of",
    # what hooks receive
    "Checkpoint", "KERNELS", "LoadOptions", "LoadPlan", "ModelConfig", "RopeConfig", "TakesOptions",
    # reading
    "FLOAT_DTYPES", "GGUF_FLOATS", "GGUFHeader", "SAFETENSORS_DTYPES", "SkippedArray", "TORCH_DTYPES",
    "check_inside", "contained", "ggml_types", "qpack", "read_gguf_header", "read_into", "safetensors_header",
    "storage_shape", "stored_dtype",
    # validated config reading (1.4)
    "Fields", "config_fields", "quant_config_fields", "read_json", "sidecar_fields",
    # run-time statistics (1.5)
    "StatsSource", "expose_stats", "stats_sources",
    # exporting
    "convert_expert_layout", "dense_state", "named_linears", "option", "plan_of", "unsplit_features",
    # adding an architecture
    "ArchSpec", "Embedding", "FloatParams", "PlanOracle", "QuantLinear", "RMSNorm", "Rotary", "StackedLinear",
    "FusedLayout", "PerIndexLayout", "StackLayout", "StackedLayout",
    # ... from the core's blocks (1.6): the DeepSeek-V3 model and its parts, its config parser
    "DecoderLayer", "DeepseekV3ForCausalLM", "Experts", "MLA", "MLP", "MoE", "Router", "parse_model_config",
    # ... a router declared as data (1.11)
    "RouterSpec", "route",
    # ... declaring how engines take it (qp_engine_plan, 1.6)
    "EngineExperts", "EngineGroupedLinear", "EngineLatentAttention", "EngineMLP", "LatentAttention", "RoutedExperts",
    # ... renaming its modules for the engines and giving them float tensors in their form (1.10)
    "EngineFloats", "EngineRename",
    # ... and declaring its tensor-parallel plan (qp_tp_plan) and dense-state mapping (qp_dense_state)
    "ColumnParallel", "DeclarationError", "ExpertGroup", "ExpertParallel", "FeatureParallel", "FoldHeads", "HeadGroup",
    "HeadParallel", "HeadPart", "HeadSlice", "RowParallel", "TiedModule", "Unstack", "VocabParallel",
    # errors
    "AmbiguousBackendError", "CheckpointError", "ConfigError", "LoadError", "NoBackendError", "PlanError",
    "PluginLoadError", "QuantplugError", "UnknownArchitectureError",
]
