"""The whole plugin contract: every hook quantplug calls, when, and what an answer means.

Hooks are called with keyword arguments only. An implementation may accept any subset of a
hook's arguments (pluggy matches by name), so a hook can gain arguments without breaking
plugins. Two kinds of hooks (a test checks these lists against :data:`GLOBAL_HOOKS` and
:data:`BACKEND_HOOKS`):

* **global** hooks are called on every registered plugin: ``quantplug_detect``,
  ``quantplug_architectures``, ``quantplug_cli_commands``;
* **backend** hooks are called only on the backend selected for a checkpoint and on the core's
  own defaults, which are registered ``trylast`` and therefore answer last: ``quantplug_options``,
  ``quantplug_tensor_names``, ``quantplug_resolve_prefix``, ``quantplug_packed_modules``,
  ``quantplug_attention_layout``, ``quantplug_linear_scheme``, ``quantplug_validate_plan``,
  ``quantplug_process_after_loading``, and ``quantplug_export`` (called on one backend, chosen by
  name). An installed plugin can never change a load it did not claim.

Answers are frozen dataclasses from :mod:`quantplug.types` (or a ``LinearScheme`` object), never
dicts with magic keys. The plugin manager stamps every answer with the plugin that gave it, and
the plan records it as a :class:`~quantplug.types.Decision`.

Each spec below is the one source of its hook's contract: whether the first answer wins
(``firstresult``) and what an answer must be (``answers``); the plugin manager reads both
from here. pluggy calls the hooks (global hooks through ``pm.hook.<name>``, backend hooks through
one subset caller per hook and selected backend), so order, ``firstresult`` and None-skipping are
pluggy's, and its tracing and ``add_hookcall_monitoring`` (on
``quantplug.plugins.PluginManager.pluggy``) see every call.

**Hook wrappers** (``@hookimpl(wrapper=True)``, old-style ``hookwrapper=True``; contract 1.11)
observe or adjust answers as pytest plugins do. A plugin that answers no hook, only wraps, is a
*wrapper plugin*: its wrappers run in every call of the hooks they wrap, whichever backend is
selected. A plugin that answers any hook is a backend: all its implementations, wrappers
included, run only on the loads it claimed. Every answer is still recorded as one plugin's
decision: a wrapper that returns something other than what it received has overridden it, and
the decision names the wrapper's plugin and whose answer it replaced
(``quantplug.plugins.Overridden``); its answer is checked like any other.

.. versionadded:: 1.11 hook wrappers (refused before; plugins declaring an older contract load
   and answer as they did).
.. versionchanged:: 1.11 pluggy calls the hooks: order, ``firstresult`` and None-skipping are its.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

from .types import AttentionLayout, Claim, ExportResult, OptionSpec, Problem

if TYPE_CHECKING:
    import torch

    from .contract.arch import ArchSpec
    from .contract.checkpoint import CheckpointView as Checkpoint
    from .contract.config import ModelConfig
    from .contract.plan import LoadPlanView as LoadPlan
    from .contract.scheme import LinearScheme

PROJECT = "quantplug"


def answers(expected: str, kinds: Any, items: Any = None) -> Any:
    """Declare what a hook's non-None answer must be: an instance of ``kinds()`` and, for a
    sequence answer, every item (for a mapping, every value) an instance of ``items()``;
    ``expected`` says so in words for error messages. ``kinds`` / ``items`` are callables so the
    types may live in modules this one cannot import at load time."""

    def mark(fn: Any) -> Any:
        fn.qp_answer = (expected, kinds, items)
        return fn

    return mark


#: Version of this hook contract (``MAJOR.MINOR``). A plugin declares the version it was written
#: for as ``QUANTPLUG_CONTRACT = "1.1"`` in its entry-point module (absent: "1.0"); the manager
#: accepts it when the major versions match and its minor is not newer than this one, and marks
#: it failed otherwise, saying why. Minor versions only add (hooks, arguments, names in
#: ``quantplug.api``); a major version may remove or rename.
#:
#: * 1.0: the hooks as first released (detect ... export, cli_commands).
#: * 1.1: ``quantplug.api``; ``LinearScheme.reason``; ``quantplug_export`` receives ``plan``;
#:   ``quantplug_architectures``; contract checking.
#: * 1.2: ``LinearScheme.fuse`` (optional): sibling projections of one input run as one call;
#:   ``quantplug.api.int4pack_rows_separable`` (whether torch's int4 layout splits at given rows)
#:   and ``fuse_int4_packs`` (the shared half of an int4 scheme's ``fuse``).
#: * 1.3: ``LinearScheme.fuse_mlp`` and ``fuse_attention`` (optional): a gated MLP (dense, shared
#:   or a decode step's routed experts) and an MLA decode step for one token in one call;
#:   ``quantplug.api.fuse_mlp`` / ``fuse_attention``.
#:   Design note: the hooks decide *what* is loaded; since 1.2 a scheme may also offer how
#:   a group of its layers runs (``fuse``, ``fuse_mlp``), asked by the model after loading and
#:   recorded nowhere in the plan because it never changes what is read or computed, only how.
#: * 1.4: ``LinearScheme.form`` (optional): a scheme describes its loaded tensors as one of the
#:   core's weight forms (``quantplug.api.Form`` / ``Weights`` / ``ActQuant``: ggml blocks, int4 /
#:   int8 with scales and zero points, FP8 with block / channel / tensor scales, FP4 with E8M0 or
#:   E4M3 + global scales, floats; activation quantization as a property of the form) and the
#:   core computes every product, the one-token MLP / routed-expert steps and the absorbed MLA
#:   decode step natively. ``fuse_mlp`` / ``fuse_attention`` are deprecated (still honoured where
#:   the core has no step for the layers; removed at 2.0).
#:   Design note (storage vs compute): backends know storage, the core knows compute; the form is
#:   the whole interface between them, so a third-party backend that declares an existing form
#:   runs natively with no C of its own.
#:   ``quantplug_options`` (backend): the options a backend reads, as
#:   :class:`~quantplug.types.OptionSpec`; the plan checks every given option against them and
#:   the core's own (``kernels``, ``strict_split``, ``mmap``, ``expert_cache_mb``,
#:   ``expert_prefetch``, ``expert_readers``, ``tp_timeout_s``); ``quantplug.api.Fields``
#:   (typed config readers with key paths) and ``quantplug.api.quant_config_fields``; also new in
#:   ``quantplug.api`` with 1.4 (they were not in quantplug 0.4.0, the release of 1.3):
#:   ``Exclusions`` / ``ALIASES`` / ``modules_of`` (exclusion lists), ``ggml`` / ``native`` (the
#:   core's kernels), ``read_json``, ``config_fields``, ``sidecar_fields``.
#: * 1.5: an architecture declares what the core reads of it: its tensor-parallel plan
#:   (``qp_tp_plan``: module pattern -> ``ColumnParallel`` / ``RowParallel`` /
#:   ``FeatureParallel`` / ``HeadParallel`` / ``ExpertParallel`` / ``VocabParallel``, with the
#:   module interfaces ``HeadGroup`` / ``ExpertGroup`` / ``TiedModule``) and its dense-state
#:   mapping (``qp_dense_state``: ``Unstack`` / ``FoldHeads``), so an architecture added through
#:   ``quantplug_architectures`` loads tensor-parallel and exports with no core change;
#:   ``StackedLinear`` layouts as ``FusedLayout`` / ``PerIndexLayout`` / ``StackedLayout`` (the
#:   tagged tuples are deprecated). ``quantplug.api.StatsSource`` / ``expose_stats`` /
#:   ``stats_sources``: counters a backend exposes on a loaded model (from
#:   ``quantplug_process_after_loading``), read by ``quantplug generate`` and users through a
#:   declared protocol instead of a backend's attributes; ``quantplug.api.stored_dtype`` (what a
#:   module's weight is stored as, fused experts included); ``quantplug.api.qpack`` (the
#:   version-2 expert pack of safetensors checkpoints: layout constants and reader).
#: * 1.6: architectures register through the ``quantplug.architectures`` entry-point group (the
#:   core's own too; ``quantplug_architectures`` stays for a backend that adds one beside its
#:   format); ``ArchSpec.config`` declares an architecture's config schema; an architecture
#:   declares how engines take its modules (``qp_engine_plan``: ``EngineLatentAttention`` /
#:   ``EngineMLP`` / ``EngineExperts``, module protocols ``LatentAttention`` / ``RoutedExperts``)
#:   instead of the bridge testing model classes; the core's DeepSeek-V3 blocks are public for
#:   composition (``DeepseekV3ForCausalLM``, ``DecoderLayer``, ``MLA``, ``MLP``, ``MoE``,
#:   ``Experts``, ``Router``, ``parse_model_config``).
#:   Design note: an architecture is a declaration the core reads (config schema, skeleton,
#:   tensor-parallel plan, dense-state and engine mappings); the core holds no list of them.
#: * 1.7: ``LinearScheme.takes_fast`` (optional): whether a layer runs faster kernels under
#:   ``kernels=fast``; a plan whose layers all answer False refuses the option, naming the backend.
#:   ``quantplug.api.HeadSlice`` (a per-head float parameter of a head-parallel module);
#:   ``PlannedModule.qp_check`` (plan-time checks of tensors whose shape several layouts satisfy).
#:   Hooks are called through pluggy's own callers (``PluginManager.pluggy`` monitoring sees each),
#:   and whether a hook's first answer wins is its spec's alone.
#: * 1.8: ``quantplug.api.LoadOptions``: the ``options`` every hook receives (and ``plan.options``)
#:   is one frozen object, a typed field per core option (``options.kernels``,
#:   ``options.expert_cache_mb``, ...) and the backend's options in ``options.extra``; it stays a
#:   read-only ``Mapping[str, Any]`` of every option name, so hooks reading ``options[name]`` /
#:   ``options.get(name)`` work unchanged. ``quantplug.api.KERNELS`` (the values of ``kernels``).
#:   Under ``kernels=fast`` the core runs a layer's native products in fast mode exactly where its
#:   scheme's ``takes_fast()`` answers True (it read a ``kernels`` attribute of the scheme before).
#:   Module state is declared: every ``qp_*`` attribute the core sets on a module is a field its
#:   class declares (``PlannedModule``: ``qp_parallel``, ``qp_native``, ``qp_kernel_mode``;
#:   ``Experts.qp_store`` / ``qp_parallel``; ``MoE.qp_next`` / ``qp_prefetch``), and load options
#:   reach modules one way, ``qp_configure(options)`` (protocol ``TakesOptions``, called by the
#:   loader on every module defining it before loading; the loader no longer sets
#:   ``qp_prefetch`` / ``qp_indexer`` / ``qp_state_dtype`` on whichever module has one, nor
#:   ``qp_served_params`` on the model). A test scans the core for undeclared ones.
#: * 1.9: ``Checkpoint.add_pack(pack)``: a backend whose format names an expert pack itself (the
#:   GGUF backend's version-1 packs, named by a GGUF file's metadata) adds its payloads to the
#:   checkpoint as tensors (protocol ``quantplug.api.qpack.Pack``), from ``quantplug_tensor_names``;
#:   the core then loads them, or serves them through its one expert cache (``expert_cache_mb``,
#:   ``expert_prefetch``, ``expert_readers``), with each payload's sha256 checked on first read,
#:   as a version-2 pack's. Design note: one expert cache; a backend supplies storage, not a cache.
#: * 1.10: engines take more architectures. ``EngineRename`` (a text model class's
#:   ``qp_engine_names``: the names an engine gives its modules where they differ from the
#:   checkpoint's, e.g. Kimi-Linear's ``block_sparse_moe`` -> ``mlp``) and ``EngineFloats`` (a
#:   module's ``qp_engine_floats()``: its float tensors in the engine's form, e.g. KDA's three
#:   convolutions as one), read by ``quantplug.bridge``; ``qp_engine_refusal`` may be decided per
#:   instance (a config's features). Under an engine's tensor parallelism
#:   (``quantplug.parallel.EngineComm``) each rank loads its share and the bridge hands the engine
#:   each rank's part of every projection; the engine runs the collectives. Design note: an engine
#:   integration owns its process group; quantplug plans, reads and splits, never communicates in
#:   the engine's forward.
#: * 1.11: pluggy calls the hooks (one dispatcher: order, ``firstresult`` and None-skipping are
#:   its own), and hook wrappers are allowed (``@hookimpl(wrapper=True)``, old-style
#:   ``hookwrapper=True``; refused before 1.11): a plugin that only wraps wraps every load's hooks,
#:   a backend's wrappers run on its own loads only; an answer a wrapper replaces is recorded as
#:   the wrapper plugin's decision, naming whose answer it replaced
#:   (``quantplug.plugins.Overridden``, ``PluginManager.overrides()``). Plugins written for 1.10 or
#:   older load and answer as before. Routers as data: ``quantplug.api.RouterSpec`` (score,
#:   selection, bias, normalization, scaling, routing by token id) and its reference ``route``; a
#:   router module's ``spec`` lets the native whole-stack step route for it (the core's Router
#:   and DeepSeek-V2's softmax router both).
#:
#: A plugin declares at least the version of every feature it uses (:data:`API_SINCE`,
#: :data:`SCHEME_SINCE`, each hook's ``versionadded``); ``quantplug.testing.contract`` checks it
#: and the conformance kit runs that check.
CONTRACT_VERSION = "1.11"
#: When each name of ``quantplug.api`` entered the contract; names not listed date from 1.1, when
#: ``quantplug.api`` itself was added.
API_SINCE: dict[str, str] = {
    "fuse_int4_packs": "1.2", "int4pack_rows_separable": "1.2",
    "fuse_mlp": "1.3", "fuse_attention": "1.3",
    "ActQuant": "1.4", "Form": "1.4", "Weights": "1.4", "OptionSpec": "1.4", "Fields": "1.4", "config_fields": "1.4",
    "quant_config_fields": "1.4", "sidecar_fields": "1.4", "read_json": "1.4", "ALIASES": "1.4", "Exclusions": "1.4",
    "modules_of": "1.4", "ggml": "1.4", "native": "1.4",
    "StatsSource": "1.5", "expose_stats": "1.5", "stats_sources": "1.5", "stored_dtype": "1.5",
    "qpack": "1.5", "safetensors_header": "1.5",
    **dict.fromkeys(("ColumnParallel", "RowParallel", "FeatureParallel", "HeadParallel", "ExpertParallel",
                     "VocabParallel", "HeadGroup", "ExpertGroup", "TiedModule", "Unstack", "FoldHeads", "HeadPart",
                     "DeclarationError", "FusedLayout", "PerIndexLayout", "StackedLayout", "StackLayout"), "1.5"),
    **dict.fromkeys(("DecoderLayer", "DeepseekV3ForCausalLM", "Experts", "MLA", "MLP", "MoE", "Router",
                     "parse_model_config", "EngineExperts", "EngineLatentAttention", "EngineMLP", "LatentAttention",
                     "RoutedExperts"), "1.6"),
    "HeadSlice": "1.7",
    "LoadOptions": "1.8", "KERNELS": "1.8", "TakesOptions": "1.8",
    "EngineFloats": "1.10", "EngineRename": "1.10",
    "RouterSpec": "1.11", "route": "1.11",
}
#: When each optional ``LinearScheme`` member a scheme may define entered the contract (members
#: not listed: 1.0).
SCHEME_SINCE: dict[str, str] = {
    "reason": "1.1", "split": "1.1", "apply_row_parallel": "1.1", "apply_grouped": "1.1", "apply_all": "1.1",
    "fuse": "1.2", "fuse_mlp": "1.3", "fuse_attention": "1.3", "form": "1.4", "takes_fast": "1.7",
}
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Hooks called on every plugin.
GLOBAL_HOOKS = frozenset({"quantplug_detect", "quantplug_cli_commands", "quantplug_architectures"})
#: Hooks called only on the selected backend plus the core defaults.
BACKEND_HOOKS = frozenset({
    "quantplug_options",
    "quantplug_tensor_names",
    "quantplug_resolve_prefix",
    "quantplug_packed_modules",
    "quantplug_attention_layout",
    "quantplug_linear_scheme",
    "quantplug_validate_plan",
    "quantplug_process_after_loading",
    "quantplug_export",  # called on one backend, chosen by name
})


def _arch_spec() -> tuple[type, ...]:
    from .contract.arch import ArchSpec

    return (ArchSpec,)


def _linear_scheme() -> tuple[type, ...]:
    from .contract.scheme import LinearScheme

    return (LinearScheme,)


# ---------------------------------------------------------------------------------------------
# Detection (global)
# ---------------------------------------------------------------------------------------------

@hookspec
@answers("quantplug.api.Claim or None", lambda: (Claim,))
def quantplug_detect(checkpoint: Checkpoint) -> Claim | None:
    """Say whether this backend can load ``checkpoint``.

    Global hook, called once per load on **every** plugin, after the checkpoint's headers,
    config.json and sidecar JSON files have been read (no tensor data). All answers are collected.

    Return a :class:`Claim` carrying the parsed, frozen quantization config (passed back to
    every backend hook as ``quant_config``) and a human reason, or None: "not mine".

    No claim: the checkpoint loads as dense if all its tensors are floating point, else
    :class:`NoBackendError` lists the installed backends. Several claims:
    :class:`AmbiguousBackendError` lists every claimant, unless ``backend=`` names one.
    Raising :class:`QuantplugError` here means "mine, but broken" and stops the load.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 a QuantplugError raised here is reported with the plugin's name.

    Example::

        @hookimpl
        def quantplug_detect(checkpoint):
            qc, where = quant_config_fields(checkpoint)  # typed readers (quantplug.api.Fields)
            if qc is None or qc.opt_str("quant_method") != "acme":
                return None
            return Claim("acme", AcmeConfig.parse(qc), f"{where}.quant_method == 'acme'")
    """


@hookspec
@answers("a mapping of architecture name -> quantplug.api.ArchSpec", lambda: (Mapping,), _arch_spec)
def quantplug_architectures() -> Mapping[str, ArchSpec] | None:
    """Add model architectures: ``{config.json architectures[0]: ArchSpec}``.

    Global hook, called once per plan on every plugin, before detection. The core's own
    (DeepSeek-V3, Kimi-K2.5/K2.6, Kimi-K3) answer first; a plugin may add names, not replace
    them (a name both the core and a plugin define, or two plugins define, is an error naming
    both). ``ArchSpec.cls(model_config, oracle)`` builds the skeleton from the core's planned
    layers (``quantplug.api``: ``QuantLinear``, ``StackedLinear``, ``Embedding``, ``RMSNorm``),
    asking ``oracle.scheme(...)`` / ``oracle.layout(...)`` for every decision, so every backend
    works with the new architecture unchanged. The model config is parsed by the core
    (DeepSeek-V3-style keys); an architecture with other keys reads them from
    ``model_config.raw``.

    The model class declares, for the core to read, how it splits over tensor-parallel ranks
    (class attribute ``qp_tp_plan``) and how its stacked layers go back to dense tensors
    (``qp_dense_state``); see :mod:`quantplug.models.declarations`. Without ``qp_tp_plan`` it
    loads under tensor parallelism with every module replicated.

    .. versionadded:: 1.1
    .. versionchanged:: 1.5 ``qp_tp_plan`` / ``qp_dense_state`` declarations.

    Example::

        @hookimpl
        def quantplug_architectures():
            return {"MyMLAForCausalLM": ArchSpec("MyMLAForCausalLM", MyModel, False, ())}
    """


# ---------------------------------------------------------------------------------------------
# Options (backend-scoped)
# ---------------------------------------------------------------------------------------------

@hookspec
@answers("a sequence of quantplug.api.OptionSpec", lambda: (Sequence,), lambda: (OptionSpec,))
def quantplug_options() -> Sequence[OptionSpec] | None:
    """Declare every option this backend reads: name, type, default, allowed values, one line of help.

    Backend hook, called on one backend at a time: for the selected backend when a plan checks
    the options it was given, and on every active backend for ``quantplug plugins --options``
    and for an unknown option's "which backend owns it" hint. Return a sequence of
    :class:`~quantplug.types.OptionSpec` (``scope="load"``: ``load`` / ``plan`` ``options=`` and
    ``-o KEY=VALUE``; ``scope="export"``: the ``options`` of ``quantplug_export``), or None / ``[]``.

    The plan then refuses (``ConfigError`` at plan time) an option neither the core nor the
    selected backend declares (with a did-you-mean, and naming the installed backend that does
    declare it), and a value of the wrong type or outside ``choices`` / the bounds (naming the
    option, what was expected and the declaring plugin). Every other hook receives ``options``
    converted to the declared types (a ``-o`` string ``"true"`` arrives as ``True``), with the
    default of every declared option that was not given; read them with ``options[name]``.
    ``options`` is a :class:`~quantplug.api.LoadOptions` (1.8): a read-only mapping of every
    option name, with a typed field per core option (``options.kernels``) and the backend's own
    in ``options.extra``.
    Do not declare the core's own options (``kernels``, ``strict_split``, ``mmap``,
    ``expert_cache_mb``, ``expert_prefetch``, ``expert_readers``, ``indexer``, ``kda_state``, ``mtp``,
    ``tp_timeout_s``): read them (already checked: ``options["kernels"]`` is one of
    ``quantplug.api.KERNELS``; do not check them again against a copy of the choices).
    A backend that does not implement this hook (written for contract 1.3 or older) gets
    undeclared options unchecked, with a plan warning.

    .. versionadded:: 1.4
    .. versionchanged:: 1.8 hooks receive ``options`` as a :class:`~quantplug.api.LoadOptions`.

    Example::

        @hookimpl
        def quantplug_options():
            return [OptionSpec("activation_quant", str, "emulate", ("emulate", "none"),
                               "emulate the activation quantization the config names, or none")]
    """


# ---------------------------------------------------------------------------------------------
# Decisions (backend-scoped)
# ---------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
@answers("a mapping of model tensor name -> stored tensor name", lambda: (Mapping,), lambda: (str,))
def quantplug_tensor_names(
    architecture: str, model_config: ModelConfig, quant_config: Any, checkpoint: Checkpoint
) -> Mapping[str, str] | None:
    """Map the model's tensor names to the names the checkpoint stores, for formats that do not
    use Hugging Face names (GGUF: ``model.layers.3.self_attn.q_a_proj.weight`` is stored as
    ``blk.3.attn_q_a.weight``).

    Backend hook, called once per load, before every other decision hook. Stops at first
    non-None result; the core default answers None (names are used as stored). Return
    ``{model_name: stored_name}``; it may name tensors the checkpoint lacks (then a missing
    tensor is reported under its stored name). Every later hook, the plan and the loader see
    model names; messages show both (``blk.3.attn_k_b.weight (as ...k_b_proj.weight)``). Model
    names of stacked tensors follow the core's layouts: routed experts
    ``...mlp.experts.{gate,up,down}_proj.weight`` [E, out, in], split MLA
    ``...self_attn.{k_b_proj,v_b_proj}.weight``; one tensor per expert under the hub names
    ``...mlp.experts.{e}.{gate,up,down}_proj.weight``.

    A format that keeps tensors in a file the core does not index (the GGUF backend's version-1
    expert pack, named by the GGUF's metadata) adds them here, before they are renamed, with
    ``checkpoint.add_pack(pack)`` (1.9; ``pack`` follows ``quantplug.api.qpack.Pack``): they are
    then the checkpoint's tensors, loaded or served by the core's expert cache like any other.

    .. versionadded:: 1.0
    .. versionchanged:: 1.9 ``Checkpoint.add_pack``.

    Example::

        @hookimpl
        def quantplug_tensor_names(model_config, checkpoint):
            if not checkpoint.gguf_metadata:
                return None
            return {f"model.layers.{i}.input_layernorm.weight": f"blk.{i}.attn_norm.weight"
                    for i in range(model_config.num_hidden_layers)}
    """


@hookspec(firstresult=True)
@answers("str", lambda: (str,))
def quantplug_resolve_prefix(
    architecture: str, model_config: ModelConfig, quant_config: Any, checkpoint: Checkpoint
) -> str | None:
    """Name the prefix under which the checkpoint (and the quant config) name the text model.

    Backend hook, called once per load. Stops at first non-None result. ``""`` means "no
    prefix" (``model.layers.0...``); ``"language_model"`` means the text weights are named
    ``language_model.model.layers.0...`` (Kimi-K2.5 / K2.6 / K3 wrappers). Return None to let
    the core default infer it from the tensor names.

    .. versionadded:: 1.0

    Example::

        @hookimpl
        def quantplug_resolve_prefix(model_config):
            return "language_model" if model_config.is_wrapper else ""
    """


@hookspec
@answers("a mapping of fused name -> shard names", lambda: (Mapping,))
def quantplug_packed_modules(architecture: str, quant_config: Any) -> Mapping[str, Sequence[str]] | None:
    """Add fused-module names and their shards, e.g. ``{"gate_up_proj": ["gate_proj", "up_proj"]}``.

    Backend hook, called once per load; all answers are merged with the model class's own
    ``packed_modules_mapping``. An entry that names the same fused module with different shards
    is a :class:`PlanError` naming both sources. None: nothing to add. The mapping lets the plan
    ask for a fused module's scheme and check that its shards agree (one excluded and one
    quantized is a Problem).

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 shards must agree only where something fuses them (a fused
       module present in the checkpoint, or a backend that stores them fused).

    Example::

        @hookimpl
        def quantplug_packed_modules():
            return {"fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]}
    """


@hookspec(firstresult=True)
@answers("quantplug.api.AttentionLayout", lambda: (AttentionLayout,))
def quantplug_attention_layout(
    architecture: str, layer_name: str, model_config: ModelConfig, quant_config: Any, checkpoint: Checkpoint
) -> AttentionLayout | None:
    """Choose how the MLA layer ``layer_name`` (checkpoint name of ``...self_attn``) stores K/V.

    Backend hook, called once per attention layer. Stops at first non-None result. The core
    default answers ``AttentionLayout("dense")`` (one ``kv_b_proj``). A backend whose format
    splits ``kv_b`` returns ``AttentionLayout("split_kv", k_b=..., v_b=...)`` naming the
    tensors. The plan cross-checks the answer against the tensors present: a dense layout
    without ``kv_b_proj`` or a split one without its tensors is a Problem before any data is read.
    A backend with nothing to say about attention simply does not implement this hook.

    .. versionadded:: 1.0

    Example::

        @hookimpl
        def quantplug_attention_layout(layer_name, checkpoint):
            if f"{layer_name}.k_b_proj.weight" in checkpoint:
                return AttentionLayout("split_kv", "k_b/v_b present",
                                       k_b=f"{layer_name}.k_b_proj", v_b=f"{layer_name}.v_b_proj")
            return None
    """


@hookspec(firstresult=True)
@answers("a quantplug.api.LinearScheme", _linear_scheme)
def quantplug_linear_scheme(
    layer_name: str,
    layer_kind: str,
    shard_names: Sequence[str],
    quant_config: Any,
    checkpoint: Checkpoint,
    options: Mapping[str, Any],
) -> LinearScheme | None:
    """Return the :class:`~quantplug.layers.linear.LinearScheme` for one linear (or expert group).

    Backend hook, called for every linear of the model, for every fused module of the packed
    mapping (``shard_names`` = its shards) and for every routed-expert projection. Stops at
    first non-None result; the core default answers a dense scheme.

    ``layer_name`` is the checkpoint name (prefix applied), e.g.
    ``language_model.model.layers.3.self_attn.q_a_proj``. ``layer_kind`` is ``"linear"``,
    ``"experts"`` (stacked routed experts; ``shard_names`` lists the checkpoint modules that feed
    it, per-expert or fused), ``"attn_k_b"`` / ``"attn_v_b"`` (split MLA, stacked per head) or
    ``"embedding"`` (the token embedding [vocab, hidden], looked up by row through the scheme's
    ``embed``). Return None for a kind your format stores as plain floats (the core's dense
    scheme answers); kinds may be added over time, so answer None for one you do not know.
    The answers for a fused module and for each of its shards must agree (equal ``key``), else
    the plan reports a Problem. ``options``: the load options, checked against their declarations
    (``quantplug_options``) and converted, with every declared default filled in (a read-only
    mapping, :class:`~quantplug.api.LoadOptions` since 1.8).

    Tensor parallelism (``quantplug.parallel``; a load under a torch.distributed group of N > 1
    ranks, or ``plan(path, world_size=N)``). How a stored tensor splits is the scheme's answer,
    never the core's guess: ``scheme.split(direction, out_features, in_features)`` is asked for
    ``"out"`` (column-parallel: q_b_proj / q_proj, kv_b_proj, g_proj, gate / up projections,
    the embedding and lm_head by vocabulary rows) and ``"in"`` (row-parallel: o_proj,
    down_proj, with an all-reduce) and returns, per spec suffix, a
    :class:`~quantplug.layers.linear.SplitRule` ``(axis, features, units, once)``:

    * ``axis``: the stored axis that follows the split dimension; each ``features`` layer
      features map to ``units`` stored indices (packing and block sizes: MXFP4 weight along in
      ``(1, 2, 1)`` and its scales ``(1, 32, 1)``; ModelSlim W4A8 two rows per byte along out
      ``(0, 2, 1)``; ggml Q4_K rows along in ``(1, 256, 144)``). The core checks that every
      rank's slice starts and ends on a multiple of ``features`` and that the stored axis has
      ``full / features * units`` entries;
    * ``axis=None``: the tensor is whole on every rank (per-tensor input scales; per-output
      scales under a row split); with ``once=True`` (row split) it is a per-output additive
      term kept on rank 0 and zero elsewhere, so the all-reduce adds it once (ModelSlim W8A8
      ``quant_bias``);
    * a string instead of rules: why this scheme cannot split that way (ModelSlim dynamic
      per-token activation quantization spans the whole input row, so its row-parallel
      layers are replicated).

    Where the rules are missing (the default ``split`` returns None: third-party schemes that
    declare nothing), or a slice would cut a block or group, the layer is replicated on every
    rank: a ``tensor_parallel`` decision with the reason, its bytes counted on every rank
    (option ``strict_split`` turns it into a plan Problem). A replicated column layer computes
    its full output and keeps the rank's slice; a replicated row layer all-gathers its input:
    exact either way. In attention, one projection that cannot split replicates the layer's
    whole attention (one head count per layer). Stacked layers are not asked: routed experts
    split by expert (each rank a contiguous block, ``kind="experts"`` tensors along their
    leading axis, or per-expert tensors whole), split MLA ``k_b`` / ``v_b`` stacks by head. A
    scheme that serves experts itself (no tensors, e.g. an expert pack) is called with global
    expert indices, only for the experts of its rank. A row-parallel layer runs
    ``scheme.apply_row_parallel(layer, x, all_reduce)``: by default the all-reduce of
    ``apply``; a scheme with an exact integer accumulator reduces that before scaling
    (ModelSlim W8A8), so the sum over ranks equals one process bit for bit.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 ``scheme.reason`` is recorded with the decision; ``quantplug.api.refuse``;
       ``LinearScheme.split`` declares tensor-parallel splits.
    .. versionchanged:: 1.8 ``options`` is a :class:`~quantplug.api.LoadOptions` (a read-only
       mapping, as before, with typed fields for the core's options).

    Example::

        @hookimpl
        def quantplug_linear_scheme(layer_name, quant_config):
            if quant_config.is_excluded(layer_name):
                return None           # the core's dense scheme answers
            return MXFP4Scheme()
    """


@hookspec
@answers("a sequence of quantplug.api.Problem", lambda: (Sequence,), lambda: (Problem,))
def quantplug_validate_plan(plan: LoadPlan, quant_config: Any) -> Sequence[Problem] | None:
    """Check the finished plan against the format's own rules, from headers only.

    Backend hook, called once per plan; all answers are collected. Return Problems (errors stop
    the load, warnings are listed in the plan), or None / ``[]``. Every Problem should name the
    tensor or layer and what was expected.

    .. versionadded:: 1.0

    Example::

        @hookimpl
        def quantplug_validate_plan(plan):
            return [Problem("MLA K projection must be GGUF Q4_0, found Q8_0", tensor=t.name)
                    for t in plan.tensors_matching("attn_k_b") if t.dtype != "Q4_0"]
    """


@hookspec
def quantplug_process_after_loading(model: torch.nn.Module, quant_config: Any, options: Mapping[str, Any]) -> None:
    """Post-process the whole model after every tensor is loaded (and each scheme's own
    ``process_after_loading`` has run).

    Backend hook, called once per load on the selected backend; return value ignored. A backend
    that serves weights at run time exposes its counters here with
    ``quantplug.api.expose_stats(model, name, source)`` (1.5): ``quantplug generate`` reports them
    (``expert_reads`` / ``bytes_read`` with a meaning it relies on, see ``quantplug.stats``).

    .. versionadded:: 1.0

    Example::

        @hookimpl
        def quantplug_process_after_loading(model, quant_config, options):
            expose_stats(model, "acme_decoder", quant_config.decoder)  # .stats() -> counters
    """


@hookspec
def quantplug_cli_commands(subparsers: Any) -> None:
    """Add backend-specific subcommands to the ``quantplug`` CLI (optional hook).

    Global hook, called once on every plugin while the CLI builds its parser. ``subparsers`` is
    the ``argparse`` sub-parser action: add a parser and ``set_defaults(fn=...)`` with a
    function ``(args) -> int`` (exit code). A :class:`QuantplugError` it raises is printed as one
    line (traceback only with ``--debug``). Use a name that starts with the backend's own name.

    .. versionadded:: 1.0

    Example::

        @hookimpl
        def quantplug_cli_commands(subparsers):
            p = subparsers.add_parser("acme-pack", help="repack an acme checkpoint")
            p.add_argument("path")
            p.set_defaults(fn=lambda args: acme_pack(args.path))
    """


# ---------------------------------------------------------------------------------------------
# Export (called on one backend, by name)
# ---------------------------------------------------------------------------------------------

@hookspec(firstresult=True, warn_on_impl_args={
    "model_config": DeprecationWarning("quantplug_export(model_config=...) is deprecated since contract 1.1: "
                                       "use plan.model_config"),
})
@answers("quantplug.api.ExportResult or a sequence of them", lambda: (ExportResult, Sequence), lambda: (ExportResult,))
def quantplug_export(
    model: torch.nn.Module, model_config: ModelConfig, destination: Path, options: Mapping[str, Any],
    plan: LoadPlan,
) -> ExportResult | Sequence[ExportResult] | None:
    """Write a checkpoint in this backend's format from a dense model (optional hook).

    Called on one backend, chosen by name (``quantplug demo``, tests, vendor test kits).
    ``model`` is a dense quantplug model; ``model_config`` its config; ``plan`` the
    :class:`LoadPlan` it was loaded from (``plan.prefix``, ``plan.checkpoint.config``).
    ``quantplug.api.dense_state(model)`` gives its weights as dense tensors in the hub layout,
    under the checkpoint's names: quantize those. ``destination`` is an
    empty directory to write config.json and weights into (or subdirectories of it). Return what
    was written: one ``ExportResult``, or several when the backend writes variants (the demo
    loads each; ExpertPack writes a plain GGUF and one with an expert pack).

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 ``plan`` added; ``model_config`` deprecated (``plan.model_config``):
       pluggy warns when a plugin registers an implementation that asks for it.

    Example::

        @hookimpl
        def quantplug_export(model, plan, destination):
            write_quark_checkpoint(dense_state(model), plan.checkpoint.config, destination)
            return ExportResult(destination, "quark-mxfp4")
    """
