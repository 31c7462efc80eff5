"""Counters a backend exposes on a loaded model (contract 1.5).

A backend that serves weights at run time (an expert cache reading from SSD, a remote store...)
registers an object with a ``stats()`` method under a name, from ``quantplug_process_after_loading``
(:func:`expose_stats`); ``quantplug generate`` and users read them through :func:`stats_sources`,
never through a backend's own attributes. Counters are cumulative numbers; a reader takes
differences. Two names have a meaning the CLI relies on:

* ``expert_reads``: routed-expert payloads read from storage (an expert the backend had to fetch
  for a forward: a cache miss), so ``1 - expert_reads / routed experts used`` is a hit rate;
* ``bytes_read``: bytes read from storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from .errors import QuantplugError

#: routed-expert payloads read from storage (see the module docstring)
EXPERT_READS = "expert_reads"
#: bytes read from storage
BYTES_READ = "bytes_read"


@runtime_checkable
class StatsSource(Protocol):
    """Anything with ``stats() -> Mapping[str, float]`` (cumulative counters by name).

    .. versionadded:: 1.5"""

    def stats(self) -> Mapping[str, float]: ...


def expose_stats(model: Any, name: str, source: StatsSource) -> None:
    """Register ``source`` as ``model``'s statistics ``name`` (call it from
    ``quantplug_process_after_loading``); a name already taken by another source is an error.

    .. versionadded:: 1.5"""
    if not isinstance(source, StatsSource):
        raise QuantplugError(f"expose_stats({name!r}): {type(source).__name__} has no stats() method")
    registry: dict[str, StatsSource] | None = model.__dict__.get("quantplug_stats")
    if registry is None:
        registry = {}
        model.__dict__["quantplug_stats"] = registry
    if registry.get(name, source) is not source:
        raise QuantplugError(f"expose_stats: statistics {name!r} are already exposed by another source")
    registry[name] = source


def stats_sources(model: Any) -> Mapping[str, StatsSource]:
    """The statistics sources exposed on ``model`` by name (empty when none).

    .. versionadded:: 1.5"""
    return dict(getattr(model, "__dict__", {}).get("quantplug_stats") or {})
