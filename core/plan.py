"""The load plan: every parameter <- the checkpoint tensors that feed it, decided and checked
from headers alone.

Flow: detect -> architecture -> decisions (prefix, packed modules, attention layout, linear
scheme: each through its hook, the core default answering last, each recorded as a Decision
with its plugin) -> model skeleton (no parameters yet) -> sources -> validate (missing,
unexpected, shape, dtype, decision-vs-tensor mismatches, backend Problems) -> LoadPlan.

Tensor parallel: a :class:`ParamPlan` names whole source tensors and, via ``narrow``, row
ranges of them; ``build_plan(..., world_size=N, rank=r)`` then rewrites each source to rank r's
slice (``Source.slices``, :mod:`quantplug.parallel`) so every rank reads only its bytes.
"""

from __future__ import annotations

import bisect
import operator
import re
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from .checkpoint import TORCH_DTYPES, Checkpoint, storage_shape
from .checkpoint.gguf_index import GGUF_FLOATS
from .contract.config import ModelConfig, check_against_tensors
from .contract.options import LoadOptions
from .errors import PlanError, group_problems
from .layers.linear import LinearScheme, PlannedModule, QuantLinear, SlotSources, Source, StackedLinear
from .memory import gc_paused
from .models.registry import ArchSpec, get_arch
from .options import resolve as resolve_options
from .plugins import PluginManager, get_plugin_manager
from .types import CORE, AttentionLayout, Claim, Decision, PluginInfo, Problem, SkipRule, TensorInfo
from .validation import quant_config_fields


@dataclass
class ParamPlan:
    """One model parameter and the tensors that feed it."""

    param: str
    module: PlannedModule = field(repr=False)
    local: str
    sources: list[tuple[Source, TensorInfo]]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def zero_copy(self) -> bool:
        """Used exactly as stored: one source, whole slot, same dtype -> a view of the file."""
        if len(self.sources) != 1:
            return False
        src, info = self.sources[0]
        if src.slot is not None or src.slices is not None:
            return False
        if info.format == "gguf":
            return GGUF_FLOATS.get(info.dtype, torch.uint8) == self.dtype
        return TORCH_DTYPES.get(info.dtype) == self.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class LoadPlan:
    path: Path
    architecture: str
    model_config: ModelConfig
    backend: str | None
    claim: Claim | None
    quant_config: Any
    prefix: str
    packed_modules: dict[str, list[str]]
    decisions: list[Decision]
    params: list[ParamPlan]
    skipped: dict[str, list[str]]
    problems: list[Problem]
    #: the checked options (typed fields for the core's, a read-only mapping for hooks)
    options: LoadOptions
    checkpoint: Checkpoint = field(repr=False)
    model: nn.Module = field(repr=False)
    plan_seconds: float = 0.0
    #: tensor-parallel split of this plan (``quantplug.parallel.ParallelPlan``), None: one process
    parallel: Any = None
    #: option name -> "given" or "default" (``options`` holds every declared option's value)
    option_sources: dict[str, str] = field(default_factory=dict)
    #: option name -> who declares it ("core", the backend's name, or "undeclared")
    option_owners: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a plan built by hand (tests, vendor kits) with a plain mapping of options
        self.options = LoadOptions.of(self.options)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    def raise_for_problems(self) -> None:
        if self.errors:
            raise PlanError(self.errors, str(self.path))

    def tensors_matching(self, pattern: str) -> list[TensorInfo]:
        """Checkpoint tensors whose name matches the regex ``pattern`` (for validate_plan hooks)."""
        rx = re.compile(pattern)
        return [t for t in self.checkpoint.tensors.values() if rx.search(t.name)]

    def decisions_for(self, layer: str) -> list[Decision]:
        """Decisions whose target is ``layer`` or lies under it (checkpoint, stored or module names:
        ``blk.1.attn_k_b`` finds ``model.layers.1.self_attn.k_b_proj`` in a renamed checkpoint)."""
        for model_name, stored in self.checkpoint.names.items():
            if stored in (layer, f"{layer}.weight", f"{layer}.bias"):
                layer = model_name.rsplit(".", 1)[0]
                break
        keys = {layer, f"{self.prefix}.{layer}" if self.prefix else layer}
        return [d for d in self.decisions
                if d.target in keys or any(d.target.startswith(k + ".") for k in keys)
                or (d.target == "*")]

    def schemes(self) -> dict[str, str]:
        return {d.target: str(d.value) for d in self.decisions if d.hook == "quantplug_linear_scheme"}

    def weight_bytes(self) -> int:
        used = {info.name for p in self.params for _, info in p.sources}
        return sum(self.checkpoint.tensors[n].nbytes for n in used)

    def to_dict(self) -> dict[str, Any]:
        layouts = {d.target: d.value for d in self.decisions if d.hook == "quantplug_attention_layout"}
        return {
            "path": str(self.path),
            "architecture": self.architecture,
            "backend": self.backend or "dense",
            "backend_plugin": str(self.claim.plugin) if self.claim and self.claim.plugin else "core",
            "detect_reason": self.claim.reason if self.claim else "no backend claimed it; all tensors are float",
            "prefix": self.prefix,
            "packed_modules": self.packed_modules,
            "attention_layouts": layouts,
            "schemes": self.schemes(),
            "decisions": [{"hook": d.hook, "target": d.target, "value": str(d.value), "plugin": str(d.plugin),
                           "reason": d.reason} for d in self.decisions],
            "parameters": len(self.params),
            "tensors_used": sum(len(p.sources) for p in self.params),
            "weight_bytes": self.weight_bytes(),
            "skipped": {k: v for k, v in self.skipped.items()},
            "problems": [{"severity": p.severity, "kind": p.kind, "message": p.describe()} for p in self.problems],
            "problem_groups": group_problems(self.problems, severity=True),
            "options": {k: {"value": v, "source": self.option_sources.get(k, "given"),
                            "owner": self.option_owners.get(k, "?")} for k, v in sorted(self.options.items())},
            "plan_ms": round(self.plan_seconds * 1000, 2),
            **({"parallel": self.parallel.to_dict()} if self.parallel is not None else {}),
        }


class _Decider:
    """Answers the model's questions through the backend's hooks and records every answer."""

    def __init__(self, pm: PluginManager, backend: str | None, ckpt: Checkpoint, arch: ArchSpec,
                 mcfg: ModelConfig, qc: Any, prefix: str, options: LoadOptions, dtype: torch.dtype) -> None:
        self.pm, self.backend, self.ckpt, self.arch, self.mcfg = pm, backend, ckpt, arch, mcfg
        self.qc, self.prefix, self.options, self.model_dtype = qc, prefix, options, dtype
        self.decisions: list[Decision] = []
        self.problems: list[Problem] = []
        self._scheme_cache: dict[tuple[str, str, tuple[str, ...]], tuple[LinearScheme, PluginInfo]] = {}
        self._names = sorted(ckpt.tensors)
        #: multi-token-prediction layers the model builds (:meth:`decide_mtp`)
        self.mtp_layers = 0

    def decide_mtp(self, given: bool) -> None:
        """How many MTP layers to build: the config's ``num_nextn_predict_layers`` when the option
        ``mtp`` is true and the checkpoint stores them. Left at the default, a checkpoint whose
        config declares MTP layers but stores no tensor of them (many conversions drop them) loads
        without them; given true, that is a plan error. Recorded as a decision either way."""
        n, k = self.mcfg.num_hidden_layers, self.mcfg.num_nextn_predict_layers
        if k == 0:
            return
        # where MTP layer j is stored: the model's declaration (DeepSeek-V4: mtp.{k}), else after the main layers
        module = getattr(self.arch.cls, "qp_mtp_module", "model.layers.{layer}")
        names = [self.ck(module.format(layer=n + j, k=j)) for j in range(k)]
        target = names[0]
        if not self.options.mtp:
            self.decisions.append(Decision("mtp_layers", target, 0, CORE,
                                           f"option mtp=false: the {k} MTP layer(s) are skipped (rule mtp-layers)"))
            return
        stored = [name for name in names if self._has_module(name)]
        if not stored:
            if given:
                self.problems.append(Problem(
                    f"option mtp=true, but the checkpoint stores no tensor of its {k} MTP layer(s) "
                    f"(num_nextn_predict_layers = {k}: {target}.*)", layer=target, kind="options"))
            self.decisions.append(Decision("mtp_layers", target, 0, CORE,
                                           f"num_nextn_predict_layers = {k}, but the checkpoint stores no MTP tensor"))
            return
        self.mtp_layers = k
        self.decisions.append(Decision("mtp_layers", target, k, CORE,
                                       f"num_nextn_predict_layers = {k}: {names[0]}" + (f"..{names[-1]}" if k > 1 else "")
                                       + " loaded for speculative decoding (option mtp=false skips them)"))

    def ck(self, rel: str) -> str:
        return f"{self.prefix}.{rel}" if self.prefix else rel

    def ask_scheme(self, name: str, kind: str, shards: Sequence[str]) -> tuple[LinearScheme, PluginInfo]:
        key = (name, kind, tuple(shards))
        if key not in self._scheme_cache:
            scheme, info = self.pm.backend_first(
                self.backend, "quantplug_linear_scheme", layer_name=name, layer_kind=kind,
                shard_names=tuple(shards), quant_config=self.qc, checkpoint=self.ckpt, options=self.options)
            self._scheme_cache[key] = (scheme, info)
        return self._scheme_cache[key]

    def scheme(self, ckpt_name: str, kind: str = "linear", shards: Sequence[str] | None = None) -> LinearScheme:
        shards = list(shards) if shards is not None else [ckpt_name]
        scheme, info = self.ask_scheme(ckpt_name, kind, shards)
        reason = f"{kind}" + (f", {len(shards)} shard(s)" if kind != "linear" else "")
        if scheme.reason:
            reason = f"{reason}: {scheme.reason}"
        self.decisions.append(Decision("quantplug_linear_scheme", ckpt_name, scheme.describe(), info, reason))
        return scheme

    def layout(self, attn: str) -> AttentionLayout:
        layout, info = self.pm.backend_first(
            self.backend, "quantplug_attention_layout", architecture=self.arch.name, layer_name=attn,
            model_config=self.mcfg, quant_config=self.qc, checkpoint=self.ckpt)
        self.decisions.append(Decision("quantplug_attention_layout", attn, layout.kind, info, layout.reason))
        # Cross-check the answer against the tensors present, before any data is read.
        if layout.kind == "dense" and not self._has_module(f"{attn}.kv_b_proj"):
            present = [n for n in (f"{attn}.k_b_proj", f"{attn}.attn_k_b") if self._has_module(n)]
            self.problems.append(Problem(
                f"attention layout 'dense' (decided by {info}) needs {attn}.kv_b_proj, which the checkpoint "
                f"does not have" + (f"; it has {present[0]} (split K/V)" if present else ""),
                layer=attn, plugin=info, kind="layout"))
        if layout.kind == "split_kv":
            for n in (layout.k_b, layout.v_b):
                if n and not self._has_module(n):
                    self.problems.append(Problem(f"attention layout 'split_kv' (decided by {info}) names {n}, "
                                                 "which the checkpoint does not have", layer=attn, plugin=info,
                                                 kind="layout"))
        return layout

    def _has_module(self, name: str) -> bool:
        i = bisect.bisect_left(self._names, name)
        return i < len(self._names) and (self._names[i] == name or self._names[i].startswith(name + "."))

    def expert_layout(self, experts: str) -> str:
        if self._has_module(f"{experts}.gate_up_proj") or f"{experts}.gate_up_proj" in self.ckpt:
            value, why = "fused", "transformers 5 layout: gate_up_proj [E, 2I, H] / down_proj [E, H, I]"
        elif self._has_module(f"{experts}.gate_proj"):
            value, why = "stacked", "one stacked tensor per projection: gate_proj / up_proj [E, I, H], down_proj [E, H, I]"
        elif self._has_module(f"{experts}.0"):
            value, why = "hub", "hub layout: one tensor per expert and projection"
        else:
            value, why = "none", "no routed-expert tensors in the checkpoint (the scheme supplies them, or they are missing)"
        self.decisions.append(Decision("expert_layout", experts, value, CORE, why))
        return value


def _merge_packed(pm: PluginManager, backend: str | None, arch: ArchSpec, qc: Any,
                  problems: list[Problem], from_plugins: set[str] | None = None) -> dict[str, list[str]]:
    merged: dict[str, list[str]] = {k: list(v) for k, v in getattr(arch.cls, "packed_modules_mapping", {}).items()}
    source: dict[str, str] = {k: f"model class {arch.name}" for k in merged}
    from_plugins = set() if from_plugins is None else from_plugins
    for answer, info in pm.backend_all(backend, "quantplug_packed_modules", architecture=arch.name, quant_config=qc):
        for fused, shards in answer.items():
            shards = list(shards)
            if fused in merged and merged[fused] != shards:
                problems.append(Problem(f"packed module {fused!r}: {source[fused]} says {merged[fused]}, "
                                        f"plugin {info} says {shards}", plugin=info, kind="packed"))
                continue
            merged[fused] = shards
            source.setdefault(fused, f"plugin {info}")
            if info.name != "core":
                from_plugins.add(fused)
    return merged


def _check_packed(d: _Decider, model: nn.Module, packed: dict[str, list[str]],
                  from_plugins: set[str] | None = None) -> None:
    """A fused module's scheme is its shards' scheme; shards (and the fused answer) must agree
    where something fuses them: the backend declared the mapping (its kernels run them fused),
    or the checkpoint stores the fused module. The model class's own mapping alone (engines
    that may fuse) asks nothing of a checkpoint that stores and runs the shards apart."""
    from_plugins = from_plugins or set()
    linears = {m.qp_ckpt: m for m in model.modules() if isinstance(m, QuantLinear)}
    for fused, shards in packed.items():
        parents = {n.rsplit(".", 1)[0] for n in linears if n.rsplit(".", 1)[-1] == shards[0]}
        for parent in sorted(parents):
            names = [f"{parent}.{s}" for s in shards]
            if not all(n in linears for n in names):
                continue
            fused_name = f"{parent}.{fused}"
            if fused not in from_plugins and not d._has_module(fused_name):
                continue
            fused_scheme, info = d.ask_scheme(fused_name, "linear", names)
            keys = {n: linears[n].scheme.key for n in names}
            d.decisions.append(Decision("quantplug_linear_scheme", fused_name, fused_scheme.describe(), info,
                                        f"fused module of {', '.join(shards)}"))
            if len(set(keys.values()) | {fused_scheme.key}) > 1:
                listing = ", ".join(f"{n.rsplit('.', 1)[-1]}={k}" for n, k in keys.items())
                d.problems.append(Problem(
                    f"fused module {fused} has shards that disagree: {listing}; as fused: {fused_scheme.key}",
                    layer=fused_name, plugin=info, kind="packed"))


def _collect_params(model: nn.Module, ckpt: Checkpoint, dtype: torch.dtype,
                    problems: list[Problem]) -> tuple[list[ParamPlan], set[str]]:
    params: list[ParamPlan] = []
    used: set[str] = set()
    for mname, mod in model.named_modules():
        if not isinstance(mod, PlannedModule):
            continue
        found: dict[str, TensorInfo] = {}
        for local, sources in mod.qp_sources.items():
            resolved: list[tuple[Source, TensorInfo]] = []
            bulk = _slots_in_bulk(sources, ckpt) if type(sources) is SlotSources else None
            if bulk is not None:
                infos = bulk
                used.update(map(_NAME, infos))
                resolved = list(zip(sources, infos))
                found.setdefault(local, infos[0])
            for src in sources if bulk is None else ():
                info = ckpt.get(src.tensor)
                if info is None:
                    if not src.optional:
                        problems.append(Problem(f"missing: the model needs it for {mname}.{local} "
                                                f"(expected {'/'.join(src.dtypes)} {list(src.shape)})",
                                                tensor=ckpt.label(src.tensor), file=str(ckpt.path), kind="missing"))
                    continue
                used.add(info.name)
                if info.dtype not in src.dtypes:
                    problems.append(Problem(f"dtype {info.dtype}, expected {' or '.join(src.dtypes)} "
                                            f"(scheme of {mod.qp_ckpt}: {_scheme_name(mod)})",
                                            tensor=info.label, file=info.file.name, kind="dtype"))
                    continue
                if src.shape and info.shape != tuple(src.shape):
                    problems.append(Problem(f"shape {list(info.shape)}, expected {list(src.shape)} "
                                            f"(scheme of {mod.qp_ckpt}: {_scheme_name(mod)})",
                                            tensor=info.label, file=info.file.name, kind="shape"))
                    continue
                if src.part is not None:
                    # a fused tensor whose spec left the shape open: an equal part of a stored axis
                    axis, nth, parts = src.part
                    if axis >= len(info.shape) or info.shape[axis] % parts:
                        problems.append(Problem(f"shape {list(info.shape)}: axis {axis} does not split into {parts} "
                                                f"equal parts (fused tensor feeding {mname}.{local})",
                                                tensor=info.label, file=info.file.name, kind="shape"))
                        continue
                    rows = info.shape[axis] // parts
                    src = src._replace(narrow=(axis, nth * rows, rows), part=None)
                resolved.append((src, info))
                found.setdefault(local, info)
            if len(resolved) != len(sources) and not all(s.optional for s in sources):
                continue
            if not resolved:
                continue
            stored = set(map(_DTYPE, map(_INFO, resolved)))
            if len(stored) > 1:
                problems.append(_mixed_dtypes(f"{mname}.{local}", [info for _, info in resolved]))
                continue
            target = mod.qp_target_dtype(local, resolved[0][1].dtype, dtype)
            src0, info0 = resolved[0]
            stored_shape = storage_shape(info0)  # GGUF blocks: [..., row_bytes]
            if src0.slot is not None:
                n = len(sources)
                shape = (n, *stored_shape)
            elif src0.narrow is not None:
                axis, _, length = src0.narrow
                shape = tuple(length if i == axis else s for i, s in enumerate(stored_shape))
            else:
                shape = stored_shape
            params.append(ParamPlan(f"{mname}.{local}" if mname else local, mod, local, resolved, shape, target))
        if isinstance(mod, QuantLinear | StackedLinear):
            for p in mod.scheme.check(mod.qp_ckpt, found):
                problems.append(p)
        if type(mod).qp_check is not PlannedModule.qp_check:  # also with nothing found: alternative forms
            problems += mod.qp_check(found)
    return params, used


_NAME = operator.attrgetter("name")
_DTYPE = operator.attrgetter("dtype")
_INFO = operator.itemgetter(1)
_SHAPE = operator.attrgetter("shape")
_TENSOR = operator.itemgetter(0)  # Source.tensor


def _slots_in_bulk(sources: SlotSources, ckpt: Checkpoint) -> list[TensorInfo] | None:
    """The tensors of per-slot sources when every one is present with an accepted dtype and the
    expected shape (checked at C speed: one map over the names, set checks of dtypes and shapes);
    None when any is not, or there are none: then the sources are checked one by one, which
    reports each problem as before."""
    if not sources:
        return None
    got = list(map(ckpt.tensors.get, map(_TENSOR, sources)))
    if not all(got):  # a TensorInfo is always true: C-level, where ``None in got`` called each one's __eq__
        return None
    infos = cast("list[TensorInfo]", got)
    dtypes = set(map(_DTYPE, infos))
    if not dtypes.issubset(sources.dtypes) or len(dtypes) > 1:
        return None
    if sources.shape and set(map(_SHAPE, infos)) != {tuple(sources.shape)}:
        return None
    return infos


def _mixed_dtypes(param: str, infos: list[TensorInfo]) -> Problem:
    """The tensors feeding one parameter (a stack of experts) in more than one dtype: the problem
    names the first tensor whose dtype is not the most common one (the outlier: one expert stored
    apart from its 255 siblings), and how many there are."""
    counts: dict[str, int] = {}
    for d in map(_DTYPE, infos):
        counts[d] = counts.get(d, 0) + 1
    common = max(counts, key=lambda d: (counts[d], d == infos[0].dtype))
    odd = [info for info in infos if info.dtype != common]
    first = odd[0]
    more = f" ({len(odd)} of {len(infos)} tensors differ)" if len(odd) > 1 else ""
    return Problem(f"dtype {first.dtype}, but the other tensors feeding {param} are {common}{more}: "
                   f"they mix dtypes {sorted(counts)}", tensor=first.label, file=first.file.name, kind="dtype")


def _scheme_name(mod: PlannedModule) -> str:
    scheme = getattr(mod, "scheme", None)
    return scheme.describe() if scheme is not None else "float"


def _skips(ckpt: Checkpoint, arch: ArchSpec, mcfg: ModelConfig, prefix: str,
           used: set[str], mtp_layers: int = 0) -> tuple[dict[str, list[str]], list[str]]:
    rules = list(arch.skip_rules)
    p = re.escape(prefix + ".") if prefix else ""
    n = mcfg.num_hidden_layers
    if mtp_layers:
        rules.append(SkipRule("mtp-shared-copies", rf"^{p}model\.layers\.(\d+)\.(embed_tokens|shared_head\.head)\.",
                              "the MTP layers' stored copies of the embedding and LM head: the main model's "
                              "embed_tokens and lm_head serve them"))
    rules.append(SkipRule("mtp-layers", rf"^{p}model\.layers\.(\d+)\.",
                          f"layers >= num_hidden_layers ({n}): multi-token-prediction heads"))
    # the layer index a rule's first group must fall in
    ranges = {"mtp-shared-copies": range(n, n + mtp_layers), "mtp-layers": range(n, 1 << 62)}
    compiled = [(r, re.compile(r.pattern)) for r in rules]
    skipped: dict[str, list[str]] = defaultdict(list)
    unexpected: list[str] = []
    for name in ckpt.tensors:
        if name in used:
            continue
        for rule, rx in compiled:
            m = rx.search(name)
            if m and (rule.name not in ranges or int(m.group(1)) in ranges[rule.name]):
                skipped[f"{rule.name}: {rule.reason}"].append(name)
                break
        else:
            unexpected.append(name)
    return dict(skipped), unexpected


def build_plan(path: str | Path, *, backend: str | None = None, options: Mapping[str, Any] | None = None,
               dtype: torch.dtype = torch.float32, plugin_manager: PluginManager | None = None,
               world_size: int = 1, rank: int = 0, comm: Any = None) -> LoadPlan:
    """Compute the plan from headers only; problems are collected in ``plan.problems``.

    ``world_size`` > 1: the plan of rank ``rank`` of a tensor-/expert-parallel load
    (:func:`quantplug.parallel.shard_plan`; ``plan.parallel`` has every rank's bytes)."""
    with gc_paused():
        p = _build_plan(path, backend, options, dtype, plugin_manager)
        if world_size > 1:
            from .parallel import shard_plan

            t0 = time.perf_counter()
            shard_plan(p, world_size, rank, comm)
            p.plan_seconds += time.perf_counter() - t0
        p.problems += _memory_problems(p)
        return p


def _indexer_problems(mcfg: ModelConfig, options: LoadOptions) -> list[Problem]:
    """Load option ``indexer=fp8`` (DeepSeek's reference FP8 indexer, DSA models) needs heads it can
    rotate and quantize as one block: ``index_head_dim`` a power of two of at most 128."""
    d = mcfg.index_head_dim
    if options.indexer != "fp8" or not mcfg.has_indexer or (d <= 128 and d & (d - 1) == 0):
        return []
    return [Problem(f"option indexer='fp8': index_head_dim = {d} must be a power of two of at most 128 (one "
                    "Hadamard block and one e4m3 scale per head); indexer='exact' takes any", kind="options")]


def _kernels_problems(model: nn.Module, options: LoadOptions, backend: str | None, claim: Any) -> list[Problem]:
    """Option ``kernels=fast`` where no planned layer's scheme takes it
    (:meth:`LinearScheme.takes_fast`): a plan error naming the backend (it used to do nothing,
    silently). The bundled schemes that take it: the GGUF backend's types with a fast kernel, the
    compressed-tensors pack-quantized int4 ones."""
    if options.kernels != "fast":
        return []
    schemes: dict[str, bool] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear | StackedLinear):
            name = m.scheme.describe()
            schemes[name] = schemes.get(name, False) or bool(m.scheme.takes_fast())
    if any(schemes.values()):
        return []
    who = f"backend {claim.plugin or backend}" if backend else "the dense (unquantized) checkpoint"
    return [Problem(f"option kernels=fast: {who} has no fast kernels for this checkpoint's layers (schemes: "
                    f"{', '.join(sorted(schemes)) or 'none'}); they run exact. Fast kernels exist for GGUF "
                    "(backend expert_pack) and compressed-tensors int4: use kernels=exact here", kind="options")]


def _memory_problems(plan: LoadPlan) -> list[Problem]:
    """The routed experts against the memory they may use: with ``expert_cache_mb`` the cache must
    hold one step's experts of a layer; without it, what the load copies into memory of its own
    (everything not a zero-copy view of the files: converted tensors, stacked experts) must fit
    this machine's available memory. Both from headers, before any tensor data is read."""
    from . import experts, memory

    if plan.problems:
        return []
    budget = plan.options.expert_cache_mb
    if budget > 0:
        why = experts.check_budget(plan, int(budget * (1 << 20)))
        return [Problem(why, kind="options")] if why else []
    owned = sum(pp.nbytes for pp in plan.params if not pp.zero_copy)
    avail = memory.available_memory()
    if owned > avail:
        return [Problem(f"loading copies {owned / (1 << 30):.1f} GiB into memory (routed experts and converted tensors) "
                        f"but this machine has {avail / (1 << 30):.1f} GiB available: set expert_cache_mb to a budget "
                        "in MiB to read the routed experts from the checkpoint's files on demand", kind="options")]
    return []


def _build_plan(path: str | Path, backend: str | None, options: Mapping[str, Any] | None,
                dtype: torch.dtype, plugin_manager: PluginManager | None) -> LoadPlan:
    t0 = time.perf_counter()
    pm = plugin_manager or get_plugin_manager()
    given = dict(options or {})
    ckpt = Checkpoint.open(path)
    arch = get_arch(ckpt.config, pm.architectures())
    mcfg = arch.parse_config(ckpt.config, str(ckpt.path / "config.json"))
    check_against_tensors(mcfg, ckpt.tensors)
    quant_config_fields(ckpt.config, str(ckpt.path / "config.json"))  # an object with a string quant_method, if any
    claim = pm.detect(ckpt, backend)
    be = claim.backend if claim else None
    qc = claim.quant_config if claim else None
    resolved = resolve_options(pm, be, given)  # every given option checked before any hook reads one
    opts = resolved.options
    problems: list[Problem] = list(resolved.warnings)
    decisions: list[Decision] = []
    if claim is not None:
        decisions.append(Decision("quantplug_detect", "*", claim.backend, claim.plugin or CORE, claim.reason))

    names, ninfo = pm.backend_first(be, "quantplug_tensor_names", architecture=arch.name, model_config=mcfg,
                                    quant_config=qc, checkpoint=ckpt)
    if names is not None:
        ckpt = ckpt.renamed(dict(names))
        renamed = sum(1 for t in ckpt.tensors.values() if t.stored_name)
        decisions.append(Decision("quantplug_tensor_names", "*", f"{renamed} of {len(ckpt.tensors)} tensors renamed",
                                  ninfo, "the checkpoint does not use the model's tensor names"))
    prefix, pinfo = pm.backend_first(be, "quantplug_resolve_prefix", architecture=arch.name, model_config=mcfg,
                                     quant_config=qc, checkpoint=ckpt)
    prefix = prefix.rstrip(".")
    decisions.append(Decision("quantplug_resolve_prefix", "*", prefix or "(none)", pinfo,
                              "text weights named " + (f"{prefix}.model.layers..." if prefix else "model.layers...")))
    from_plugins: set[str] = set()
    packed = _merge_packed(pm, be, arch, qc, problems, from_plugins)
    decider = _Decider(pm, be, ckpt, arch, mcfg, qc, prefix, opts, dtype)
    decider.decide_mtp(resolved.sources.get("mtp") == "given")
    model = arch.cls(mcfg, decider)
    _check_packed(decider, model, packed, from_plugins)
    decisions += decider.decisions
    problems += decider.problems
    problems += _indexer_problems(mcfg, opts)
    problems += _kernels_problems(model, opts, be, claim)
    params, used = _collect_params(model, ckpt, dtype, problems)
    skipped, unexpected = _skips(ckpt, arch, mcfg, prefix, used, decider.mtp_layers)
    for name in unexpected:
        info = ckpt.tensors[name]
        problems.append(Problem("unexpected: no parameter of the model takes it and no skip rule covers it",
                                tensor=info.label, file=info.file.name, kind="unexpected"))
    plan = LoadPlan(Path(path), arch.name, mcfg, be, claim, qc, prefix, packed, decisions, params, skipped,
                    problems, opts, ckpt, model, option_sources=resolved.sources,
                    option_owners=resolved.owners)
    for answer, by in pm.backend_all(be, "quantplug_validate_plan", plan=plan, quant_config=qc):
        for p in answer:
            plan.problems.append(p if p.plugin else Problem(p.message, p.tensor, p.file, p.layer, by,
                                                            p.severity, p.kind))
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def plan(path: str | Path, *, backend: str | None = None, options: Mapping[str, Any] | None = None,
         dtype: torch.dtype = torch.float32, plugin_manager: PluginManager | None = None,
         world_size: int = 1, rank: int = 0) -> LoadPlan:
    """The LoadPlan for ``path`` (headers only), or :class:`PlanError` listing every problem.

    ``world_size`` > 1: rank ``rank``'s share of a tensor-parallel load; ``plan.parallel``
    shows every rank's bytes and each split decision, without starting any rank.

    ``plugin_manager``: an explicit manager (tests, vendor kits: ``PluginManager(entry_points=False)``
    plus ``register``); default the process-wide one built from the installed entry points."""
    p = build_plan(path, backend=backend, options=options, dtype=dtype, plugin_manager=plugin_manager,
                   world_size=world_size, rank=rank)
    p.raise_for_problems()
    return p
