"""Does a plugin declare (``QUANTPLUG_CONTRACT``) at least the contract version of every feature it
uses? A plugin that declares an older version is accepted by quantplug releases that lack what
it uses: an import error at best, a feature silently not used at worst.

Features and their versions come from the contract itself: each hook's ``.. versionadded::``
(:mod:`quantplug.hookspecs`), :data:`~quantplug.hookspecs.API_SINCE` for the names of
``quantplug.api`` a plugin's package imports, :data:`~quantplug.hookspecs.SCHEME_SINCE` for the
optional ``LinearScheme`` members its schemes define, and 1.11 for a hook wrapper
(``wrapper=True`` / ``hookwrapper=True``). The conformance kit runs
:func:`shortfall` on every backend it tests.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

from .. import hookspecs
from ..layers.linear import LinearScheme

_VERSIONADDED = re.compile(r"\.\. versionadded:: (\d+)\.(\d+)")


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def hook_since(hook: str) -> str:
    """The contract version that added ``hook`` (its spec's ``versionadded``; none: 1.0)."""
    m = _VERSIONADDED.search(getattr(hookspecs, hook).__doc__ or "")
    return f"{m.group(1)}.{m.group(2)}" if m else "1.0"


def _package_files(plugin: object) -> tuple[str, list[Path]]:
    """The top-level package (or module) the plugin object comes from, and its source files."""
    name = plugin.__name__ if inspect.ismodule(plugin) else type(plugin).__module__
    root = name.split(".")[0]
    top = sys.modules.get(root) or importlib.import_module(root)
    paths = getattr(top, "__path__", None)
    if paths is None:
        return root, [Path(top.__file__)] if top.__file__ else []
    return root, sorted(f for p in paths for f in Path(p).rglob("*.py"))


def _api_names(tree: ast.AST) -> set[str]:
    """Names of ``quantplug.api`` a module uses: ``from quantplug.api import X`` and ``quantplug.api.X``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "quantplug.api":
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import) and any(a.name == "quantplug.api" for a in node.names):
            out.add("")  # the module itself: 1.1
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and node.value.attr == "api" and isinstance(node.value.value, ast.Name)
              and node.value.value.id == "quantplug"):
            out.add(node.attr)
    return out


def _sets_reason(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "reason" and isinstance(n.ctx, ast.Store)
               for n in ast.walk(tree))


def _scheme_classes(root: str) -> list[type[LinearScheme]]:
    """LinearScheme subclasses defined in package ``root`` (every submodule that imports)."""
    top = sys.modules.get(root) or importlib.import_module(root)
    modules = [top]
    for info in pkgutil.walk_packages(getattr(top, "__path__", []), prefix=f"{root}."):
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError:  # an optional dependency of one module: its imports are still read (AST)
            continue
    out: dict[str, type[LinearScheme]] = {}
    for mod in modules:
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, LinearScheme) and obj.__module__.split(".")[0] == root:
                out[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(out.values())


def features(plugin: object) -> list[tuple[str, str]]:
    """Every contract feature ``plugin`` (an entry-point module or plugin object) uses, as
    ``(version, what)``: hooks it implements, ``quantplug.api`` names its package imports, optional
    ``LinearScheme`` members its schemes define."""
    out: list[tuple[str, str]] = []
    for name in dir(plugin):
        fn = getattr(plugin, name, None)
        if name.startswith("quantplug_") and callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_impl"):
            out.append((hook_since(name), f"hook {name}"))
            opts = getattr(fn, f"{hookspecs.PROJECT}_impl") or {}
            if opts.get("wrapper") or opts.get("hookwrapper"):
                out.append(("1.11", f"hook wrapper {name}"))
            if name == "quantplug_export" and "plan" in inspect.signature(fn).parameters:
                out.append(("1.1", "quantplug_export(plan=...)"))
    root, files = _package_files(plugin)
    for f in files:
        tree = ast.parse(f.read_text(), str(f))
        for n in sorted(_api_names(tree)):
            out.append((hookspecs.API_SINCE.get(n, "1.1"), f"quantplug.api{'.' + n if n else ''} ({f.name})"))
        if _sets_reason(tree):
            out.append((hookspecs.SCHEME_SINCE["reason"], f"LinearScheme.reason ({f.name})"))
    for cls in _scheme_classes(root):
        for member, since in hookspecs.SCHEME_SINCE.items():
            if member in vars(cls):
                out.append((since, f"{cls.__name__}.{member}"))
    return out


def declared(plugin: object) -> str:
    """The contract version ``plugin`` declares (``QUANTPLUG_CONTRACT``; absent: 1.0)."""
    return str(getattr(plugin, "QUANTPLUG_CONTRACT", "1.0"))


def shortfall(plugin: object) -> list[str]:
    """One line per feature newer than the contract version ``plugin`` declares (empty: fine)."""
    have = _version(declared(plugin))
    return sorted({f"{what} needs contract {since}, the plugin declares {declared(plugin)}"
                   for since, what in features(plugin) if _version(since) > have})
