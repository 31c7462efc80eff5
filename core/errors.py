"""Errors raised by quantplug.

Every error is a :class:`QuantplugError`; its message names the file, tensor, layer or plugin
involved and what was expected, so that one line on stderr is enough to act on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol


class _Problem(Protocol):
    """What the errors read of a :class:`quantplug.types.Problem` (a protocol: ``types`` imports
    this module, not the other way round)."""

    @property
    def message(self) -> str: ...

    @property
    def tensor(self) -> str | None: ...

    @property
    def file(self) -> str | None: ...

    @property
    def layer(self) -> str | None: ...

    @property
    def plugin(self) -> Any: ...

    @property
    def severity(self) -> str: ...

    @property
    def kind(self) -> str: ...

    def describe(self) -> str: ...


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
    """The load plan has problems; all of them are listed, each naming tensor, file or layer.

    Problems sharing one cause are said once (:func:`group_problems`); ``problems`` keeps every one.
    """

    def __init__(self, problems: Sequence[_Problem], path: str = "") -> None:
        self.problems = tuple(problems)
        self.path = path
        self.lines = group_problems(self.problems)
        causes = [ln for ln in self.lines if not ln.startswith("(")]
        distinct = f" ({len(causes)} distinct)" if len(causes) != len(self.problems) else ""
        head = f"{len(self.problems)} problem(s){distinct} in the load plan" + (f" for {path}" if path else "")
        lines = [head + ":"] + [f"  - {ln}" for ln in self.lines]
        super().__init__("\n".join(lines))


#: problem kinds that only restate a refusal of the layer the tensor feeds
_FOLLOW_ON = frozenset({"unexpected", "shape", "dtype", "missing"})
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")
#: at most this many layer / tensor names are spelled out per grouped line
MAX_LISTED = 8


def _module_of(tensor: str) -> str:
    name = tensor.rsplit(" (as ", 1)[-1].rstrip(")") if " (as " in tensor else tensor
    return _EXPERT_INDEX.sub(".experts.", name).rsplit(".", 1)[0]


def group_problems(problems: Sequence[_Problem], severity: bool = False) -> list[str]:
    """One line per cause: problems with the same message, kind, severity and plugin are merged
    into one line listing their layers / tensors; missing / unexpected / shape / dtype problems
    about the tensors of a layer the backend refused (``refuse``) are dropped, the refusal says it."""
    refused = {p.layer for p in problems if p.kind == "refused" and p.layer}
    kept = [p for p in problems
            if not (refused and p.kind in _FOLLOW_ON and p.tensor and _module_of(p.tensor) in refused)]
    dropped = len(problems) - len(kept)
    groups: dict[tuple[str, str, str, str], list[_Problem]] = {}
    for p in kept:
        groups.setdefault((p.severity, p.kind, p.message, str(p.plugin or "")), []).append(p)
    lines = []
    for members in groups.values():
        p = members[0]
        sev = f"{p.severity}: " if severity else ""
        if len(members) == 1:
            lines.append(sev + p.describe())
            continue
        names = [m.tensor or m.layer or m.file or "?" for m in members]
        what = "tensors" if p.tensor else "layers" if p.layer else "files"
        shown = ", ".join(names[:MAX_LISTED]) + (f", and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")
        files = {m.file for m in members}
        where = f" (file {files.pop()})" if len(files) == 1 and p.file and (p.tensor or p.layer) else ""
        by = f" [{p.plugin}]" if p.plugin else ""
        lines.append(f"{sev}{len(members)} {what}{where}: {p.message}{by}: {shown}")
    if dropped:
        lines.append(f"({dropped} missing / unexpected / shape / dtype problem(s) about the tensors of the refused "
                     "layers above are not listed: they follow from the refusal)")
    return lines
class LoadError(QuantplugError):
    """A tensor could not be read or converted while executing a plan."""


class ParallelError(QuantplugError):
    """A rank of a tensor-parallel group failed, or did not reach a collective within the load
    option ``tp_timeout_s``; the message names the rank. The process group is out of step
    afterwards: destroy it and load again."""
