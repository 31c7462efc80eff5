"""The options type: :class:`LoadOptions` (what one load runs with, ``plan.options``), the core's
own option table (:data:`CORE_OPTIONS`) it is built from, and :class:`TakesOptions` (how options
reach modules). Checking given options against the declarations of the core and the backends
(the resolution) is :mod:`quantplug.options`, which re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError, QuantplugError
from ..types import OptionSpec

#: the values of the ``kernels`` option
KERNELS = ("exact", "fast")
#: the values of the ``indexer`` option (DSA models): transformers' float32 scoring, or DeepSeek's
#: reference FP8 indexer (:class:`quantplug.models.deepseek.Indexer`)
INDEXER_MODES = ("exact", "fp8")
#: the values of the ``kda_state`` option (KDA models: Kimi-Linear, Kimi-K3)
KDA_STATES = ("float32", "bfloat16")

#: options the core reads itself (one table; a backend may not declare these names again)
CORE_OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec("kernels", str, "exact", KERNELS,
               "exact: results equal dequantize-then-matmul; fast: faster kernels with a documented error"),
    OptionSpec("strict_split", bool, False, None,
               "tensor parallel: a layer that cannot split is a plan error instead of being replicated"),
    OptionSpec("mmap", bool, True, None,
               "true: weights used as stored are zero-copy views of the mapped file; false: copied into "
               "private memory (network / changing file systems: a file truncated later cannot SIGBUS)"),
    OptionSpec("expert_cache_mb", float, 0.0, None,
               "MiB of memory for routed experts read on demand from the checkpoint's files (any format) or "
               "an expert pack; 0: experts held in memory", minimum=0.0, maximum=float(1 << 30)),
    OptionSpec("expert_prefetch", bool, True, None,
               "with expert_cache_mb: a decode step starts reading the next MoE layer's likely experts (its "
               "router on the current hidden state) while this layer computes"),
    OptionSpec("expert_readers", int, 4, None,
               "with expert_cache_mb: threads reading missing experts in parallel (positional reads; 1: one "
               "read at a time)", minimum=1, maximum=64),
    OptionSpec("indexer", str, "exact", INDEXER_MODES,
               "DeepSeek-V3.2 (DSA) models: exact: the lightning indexer scores in float32 as transformers does; "
               "fp8: as DeepSeek's reference (Hadamard rotation, e4m3 per-head quantization with power-of-two "
               "scales, FP8 key cache)"),
    OptionSpec("kda_state", str, "float32", KDA_STATES,
               "KDA models (Kimi-Linear, Kimi-K3): dtype of the recurrent state a generation cache holds per "
               "KDA layer and sequence (bfloat16 halves it: 207 instead of 414 MiB per sequence at Kimi-K3's "
               "size, as sglang's --mamba-ssm-dtype bfloat16; updated in float32, stored rounded)"),
    OptionSpec("mtp", bool, True, None,
               "load the checkpoint's multi-token-prediction layers (num_nextn_predict_layers; speculative "
               "decoding drafts with them); false: skip them as before (saves their memory). Default: loaded "
               "when the checkpoint stores them; given true: a checkpoint without them is a plan error"),
    OptionSpec("tp_timeout_s", float, 60.0, None,
               "tensor parallel: seconds a rank waits in a forward collective for the others before raising, "
               "naming the ranks that did not arrive", minimum=0.001, maximum=1e6),
)
_CORE_NAMES = frozenset(o.name for o in CORE_OPTIONS)
_CORE_SPECS = {o.name: o for o in CORE_OPTIONS}

_NO_EXTRA: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, eq=False)
class LoadOptions(Mapping[str, Any]):
    """The options one load runs with (``plan.options``), checked and converted by the plan.

    One typed field per option of the core's table (``CORE_OPTIONS``, same names and
    defaults): the core reads these fields and hands the object to what needs it. The options the
    selected backend declares (``quantplug_options``; for a backend declaring none, the options
    passed to it unchecked) are in ``extra``, read-only.

    It is also a read-only ``Mapping[str, Any]`` of every option name (the core's first, then the
    backend's) to its value, which is what hooks receive as ``options``: ``options["kernels"]``,
    ``options.get("activation_quant")``, ``dict(options)`` work as they did when it was a dict.
    Equal to any mapping with the same items. Frozen: a load's options do not change after its
    plan (``dataclasses.replace`` makes a changed copy).

    .. versionadded:: 1.8
    """

    kernels: str = "exact"
    strict_split: bool = False
    mmap: bool = True
    expert_cache_mb: float = 0.0
    expert_prefetch: bool = True
    expert_readers: int = 4
    indexer: str = "exact"
    kda_state: str = "float32"
    mtp: bool = True
    tp_timeout_s: float = 60.0
    #: the backend's options (name -> converted value), read-only
    extra: Mapping[str, Any] = field(default_factory=lambda: _NO_EXTRA)

    def __post_init__(self) -> None:
        clash = sorted(_CORE_NAMES.intersection(self.extra))
        if clash:
            raise QuantplugError(f"LoadOptions.extra names core option(s) {', '.join(clash)}: they are fields")
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    @classmethod
    def of(cls, values: Mapping[str, Any] | None) -> LoadOptions:
        """``values`` (option name -> value) as a LoadOptions: core options converted by their
        declaration (a wrong value is a :class:`~quantplug.api.ConfigError`), the rest in ``extra``
        as given. A LoadOptions is returned as it is. For code that builds a
        :class:`~quantplug.api.LoadPlan` itself; a plan's own options are checked against every
        declaration first."""
        if isinstance(values, LoadOptions):
            return values
        core: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in (values or {}).items():
            spec = _CORE_SPECS.get(key)
            if spec is None:
                extra[key] = value
                continue
            try:
                core[key] = spec.convert(value)
            except ValueError as exc:
                raise ConfigError(f"option {key}={_shown(value)}: expected {exc} (declared by core)") from None
        return cls(**core, extra=extra)

    def __getitem__(self, key: str) -> Any:
        if key in _CORE_NAMES:
            return getattr(self, key)
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        yield from _FIELD_NAMES
        yield from self.extra

    def __len__(self) -> int:
        return len(_FIELD_NAMES) + len(self.extra)

    def __contains__(self, key: object) -> bool:
        return key in _CORE_NAMES or key in self.extra

    def __reduce__(self) -> tuple[Any, ...]:
        # the read-only view of ``extra`` does not pickle; the values do
        return (_restore, (dict(self.items()),))


@runtime_checkable
class TakesOptions(Protocol):
    """A module that takes the load's options: the loader calls ``qp_configure(options)`` on
    every module of the model that defines it, once, after the plan and before any tensor is
    loaded. The one way load options reach modules; what a module keeps of them is its own
    declared fields (``PlannedModule.qp_kernel_mode``, ``MoE.qp_prefetch``, ``Indexer.qp_indexer``,
    ``KimiLinearForCausalLM.qp_state_dtype``).

    .. versionadded:: 1.8
    """

    def qp_configure(self, options: LoadOptions) -> None: ...


def _restore(values: dict[str, Any]) -> LoadOptions:
    return LoadOptions.of(values)


#: the core options' fields, in the table's order
_FIELD_NAMES = tuple(f.name for f in fields(LoadOptions) if f.name != "extra")
if set(_FIELD_NAMES) != _CORE_NAMES or any(
        f.default != _CORE_SPECS[f.name].default for f in fields(LoadOptions) if f.name != "extra"):
    raise AssertionError("LoadOptions' fields must be CORE_OPTIONS' names and defaults")  # pragma: no cover
_FIELD_NAMES = tuple(o.name for o in CORE_OPTIONS)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
