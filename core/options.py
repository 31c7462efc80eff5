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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .contract.options import (
    _CORE_NAMES,
    CORE_OPTIONS,
    INDEXER_MODES,
    KDA_STATES,
    KERNELS,
    LoadOptions,
    TakesOptions,
    _shown,
)
from .errors import ConfigError, QuantplugError
from .types import CORE, OptionSpec, PluginInfo, Problem

if TYPE_CHECKING:
    from .contract.plugins import PluginCalls as PluginManager

__all__ = [
    "CORE_OPTIONS", "INDEXER_MODES", "KDA_STATES", "KERNELS", "Declared", "LoadOptions", "OptionText", "Resolved",
    "TakesOptions", "declared", "export_options", "resolve", "rows",
]

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
