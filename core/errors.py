"""Errors raised by quantplug.

Every error is a :class:`QuantplugError`; its message names the file, tensor, layer or plugin
involved and what was expected, so that one line on stderr is enough to act on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .types import Problem


class QuantplugError(Exception):
    """Base class of every error quantplug raises on purpose."""


class CheckpointError(QuantplugError):
    """A checkpoint file or directory is missing, truncated, corrupt or inconsistent."""


class ConfigError(QuantplugError):
    """config.json (or a quantization sidecar) is missing a key or holds a value we cannot use."""


class PluginLoadError(QuantplugError):
    """A plugin failed to import or to register (hook name or signature not in the contract)."""


class NoBackendError(QuantplugError):
    """No installed backend claimed a checkpoint that is not plain floating point."""


class AmbiguousBackendError(QuantplugError):
    """More than one backend claimed a checkpoint and none was named explicitly."""


class UnknownArchitectureError(QuantplugError):
    """config.json names an architecture quantplug has no model for."""


class PlanError(QuantplugError):
    """The load plan has problems; all of them are listed, each naming tensor, file or layer."""

    def __init__(self, problems: Sequence[Problem], path: str = "") -> None:
        self.problems = tuple(problems)
        self.path = path
        head = f"{len(self.problems)} problem(s) in the load plan" + (f" for {path}" if path else "")
        lines = [head + ":"] + [f"  - {p.describe()}" for p in self.problems]
        super().__init__("\n".join(lines))

    def one_line(self) -> str:
        first = self.problems[0].describe() if self.problems else ""
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"PlanError: {first}{more}"


class LoadError(QuantplugError):
    """A tensor could not be read or converted while executing a plan."""
