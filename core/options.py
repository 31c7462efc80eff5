"""Load options: the core's own table, the backends' declarations (``quantplug_options``), and
the check every ``options=`` / ``-o KEY=VALUE`` goes through before any hook sees it.

A plan validates every given option against the core's table and the selected backend's
declarations: an unknown name is a :class:`ConfigError` with a did-you-mean and, when another
installed backend declares it, the name of that backend; a value of the wrong type or outside
the allowed values is a :class:`ConfigError` naming the option, what was expected and who
declares it. The result is one frozen :class:`LoadOptions` (``plan.options``): a typed field per
core option (``options.kernels``, ``options.expert_cache_mb``, ...) read by the core, the
backend's declared options in ``options.extra``, and, for hooks, a read-only mapping of every
option name to its converted value (defaults of the options not given filled in);
``plan.option_sources`` says which were given.

A backend written for a contract older than 1.4 declares nothing: options nobody declares are
then passed to it unchecked, with a plan warning (so older plugins keep working).
"""

from __future__ import annotations

import contextlib
import difflib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .errors import ConfigError, QuantplugError
from .types import CORE, OptionSpec, PluginInfo, Problem

if TYPE_CHECKING:
    from .plugins import PluginManager

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


class OptionText(str):
    """An option value as typed after ``-o KEY=`` on the command line (converted by the declared
    type; for an option nobody declares, decoded as JSON when it is JSON, as before 1.4)."""


@dataclass(frozen=True)
class Declared:
    """One declared option and who declared it."""

    spec: OptionSpec
    owner: PluginInfo


def _specs_of(pm: PluginManager, name: str) -> list[OptionSpec]:
    """Every OptionSpec backend ``name`` declares (checked: values, names, no clash with the core)."""
    out: list[OptionSpec] = []
    for answer, info in pm.call("quantplug_options", [name]):
        seen: set[tuple[str, str]] = set()
        for spec in answer:
            if spec.scope == "load" and spec.name in _CORE_NAMES:
                raise QuantplugError(f"plugin {info} declares option {spec.name!r}, which the core declares (see "
                                     "`quantplug plugins --options`); read it, do not declare it")
            if (spec.name, spec.scope) in seen:
                raise QuantplugError(f"plugin {info} declares option {spec.name!r} twice")
            seen.add((spec.name, spec.scope))
            out.append(spec)
    return out


def declared(pm: PluginManager, scope: str = "load") -> list[Declared]:
    """Every option of ``scope``: the core's, then each active backend's (sorted by backend)."""
    out = [Declared(s, CORE) for s in CORE_OPTIONS if s.scope == scope]
    for name in pm.active():
        info = pm.info(name)
        out += [Declared(s, info) for s in _specs_of(pm, name) if s.scope == scope]
    return out


def _owners(pm: PluginManager, option: str, scope: str, skip: str | None) -> list[PluginInfo]:
    owners = []
    for name in pm.active():
        if name == skip:
            continue
        try:
            specs = _specs_of(pm, name)
        except QuantplugError:
            continue  # a broken declaration elsewhere must not hide the user's real mistake
        if any(s.name == option and s.scope == scope for s in specs):
            owners.append(pm.info(name))
    return owners


@dataclass
class Resolved:
    """The options a plan runs with: every declared option's value, and where each came from."""

    #: option name -> converted value (every declared option; the core's too for scope "load")
    values: dict[str, Any]
    #: option name -> "given" or "default"
    sources: dict[str, str]
    #: option name -> who declares it ("core", a backend, or "undeclared")
    owners: dict[str, str]
    warnings: list[Problem]

    @property
    def options(self) -> LoadOptions:
        """The values as the frozen, typed :class:`LoadOptions` a load runs with (scope "load")."""
        return LoadOptions(**{k: v for k, v in self.values.items() if k in _CORE_NAMES},
                           extra={k: v for k, v in self.values.items() if k not in _CORE_NAMES})


def resolve(pm: PluginManager, backend: str | None, given: Mapping[str, Any] | None,
            scope: str = "load") -> Resolved:
    """Check ``given`` against the core's and ``backend``'s declarations; the converted values
    with every default filled in. Every problem found is said in one :class:`ConfigError`."""
    given = dict(given or {})
    table: dict[str, Declared] = {s.name: Declared(s, CORE) for s in CORE_OPTIONS if s.scope == scope}
    declares = backend is not None and pm.implements(backend, "quantplug_options")
    if backend is not None:
        info = pm.info(backend)
        for spec in _specs_of(pm, backend):
            if spec.scope == scope:
                table[spec.name] = Declared(spec, info)
    by = f"backend {backend}" if backend else "a dense checkpoint (no backend)"
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    owners: dict[str, str] = {}
    errors: list[str] = []
    warnings: list[Problem] = []
    for key in sorted(given, key=str):
        value = given[key]
        if not isinstance(key, str):
            errors.append(f"option name {key!r} is not a string")
            continue
        d = table.get(key)
        if d is None:
            if backend is not None and not declares:
                if isinstance(value, OptionText):
                    with contextlib.suppress(ValueError):
                        value = json.loads(value)
                values[key], sources[key], owners[key] = value, "given", "undeclared"
                warnings.append(Problem(f"option {key}={_shown(value)} passed unchecked: backend {backend} declares "
                                        "no options (written for a contract before 1.4)", severity="warning",
                                        kind="options"))
                continue
            errors.append(_unknown(pm, key, table, backend, by, scope))
            continue
        try:
            values[key] = d.spec.convert(value)
        except ValueError as exc:
            errors.append(f"option {key}={_shown(value)}: expected {exc} (declared by {d.owner})")
            continue
        sources[key], owners[key] = "given", str(d.owner.name)
    if errors:
        raise ConfigError("; ".join(errors))
    for name, d in table.items():
        if name not in values:
            values[name], sources[name], owners[name] = d.spec.default, "default", str(d.owner.name)
    return Resolved(values, sources, owners, warnings)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unknown(pm: PluginManager, key: str, table: Mapping[str, Declared], backend: str | None, by: str,
             scope: str) -> str:
    msg = f"unknown option {key!r} for {by}"
    close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.6)
    if close:
        msg += f"; did you mean {close[0]!r}?"
    owners = _owners(pm, key, scope, backend)
    if owners:
        msg += f" ({key!r} is an option of {', '.join(f'backend {o}' for o in owners)}, which does not load this " \
               "checkpoint)"
    msg += f"; options here: {', '.join(sorted(table))}"
    return msg


def rows(items: Iterable[Declared]) -> list[dict[str, Any]]:
    """``quantplug plugins --options`` rows."""
    return [{"name": d.spec.name, "owner": d.owner.name, "scope": d.spec.scope, "type": d.spec.type.__name__,
             "default": d.spec.default, "choices": list(d.spec.choices) if d.spec.choices is not None else None,
             "expected": d.spec.expected(), "help": d.spec.help} for d in items]


def export_options(pm: PluginManager, backend: str, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """``quantplug_export``'s ``options`` for ``backend``: checked against its declared export
    options (scope ``"export"``), converted, defaults filled."""
    return resolve(pm, backend, given, scope="export").values
