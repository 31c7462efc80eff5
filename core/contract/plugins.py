"""What code below :mod:`quantplug.plugins` calls on a plugin manager: :class:`PluginCalls`
(option resolution, :mod:`quantplug.options`, asks the backends' declarations through it). A
protocol that :class:`quantplug.plugins.PluginManager` satisfies."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from ..types import PluginInfo


class PluginCalls(Protocol):
    """The calls of :class:`quantplug.plugins.PluginManager` option resolution makes."""

    def call(self, hook: str, plugins: Iterable[str] | None, **kwargs: Any) -> list[tuple[Any, PluginInfo]]: ...

    def active(self) -> list[str]: ...

    def info(self, name: str) -> PluginInfo: ...

    def implements(self, name: str, hook: str) -> bool: ...
