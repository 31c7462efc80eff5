"""A typed facade over pluggy's PluginManager.

* Backends are found through the ``quantplug.backends`` entry-point group, loaded one at a
  time; one that fails to import or to validate is recorded as failed and skipped
  (``QUANTPLUG_STRICT_PLUGINS=1`` makes that a :class:`PluginLoadError`).
* ``QUANTPLUG_PLUGINS`` is an allow-list of backend names (empty string = none),
  ``QUANTPLUG_DISABLE`` a deny-list.
* Every hook answer comes back stamped with the plugin that gave it.
* Backend hooks are called only on the selected backend and the core defaults.
* ``QUANTPLUG_TRACE=1`` logs every hook call, a summary of its arguments and each answer.
* Hooks run through pluggy's own callers (a subset caller per plugin: each answer is known to be
  that plugin's), so pluggy's tracing and ``add_hookcall_monitoring`` on :attr:`PluginManager.pluggy`
  see every call; whether the first answer wins comes from the hook's spec.
* Contract versions: a plugin built for another major version of the hook contract, or a
  newer minor one, or whose distribution requires a quantplug version other than this one, is
  recorded as failed with why (see :data:`quantplug.hookspecs.CONTRACT_VERSION`).
* Scope: global hooks go to every active plugin; backend hooks only to the one backend
  selected and the core defaults. :meth:`PluginManager.call` refuses anything else.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from . import hookspecs
from ._version import __version__
from .errors import AmbiguousBackendError, NoBackendError, PlanError, PluginLoadError, QuantplugError
from .types import CORE, Claim, ExportResult, PluginInfo
from .validation import quant_config_fields

ENTRY_POINT_GROUP = "quantplug.backends"
CORE_NAME = "core"

log = logging.getLogger("quantplug.plugins")
trace_log = logging.getLogger("quantplug.trace")

Status = Literal["active", "disabled", "failed"]


@dataclass
class PluginRecord:
    """What ``quantplug plugins`` shows for one backend."""

    name: str
    distribution: str
    version: str
    status: Status
    hooks: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def info(self) -> PluginInfo:
        return PluginInfo(self.name, self.distribution, self.version)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "distribution": self.distribution, "version": self.version,
                "status": self.status, "hooks": list(self.hooks), "error": self.error}


def parse_contract(value: Any, where: str) -> tuple[int, int]:
    """``"1.1"`` -> (1, 1); anything else is a :class:`PluginLoadError` naming ``where``."""
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise PluginLoadError(f"{where}: QUANTPLUG_CONTRACT = {value!r}; expected a string 'MAJOR.MINOR' "
                              f"such as {hookspecs.CONTRACT_VERSION!r}")
    return int(parts[0]), int(parts[1])


def contract_problem(plugin: object, dist: Any = None) -> str | None:
    """Why ``plugin`` (its module / object, and its distribution) cannot run under this quantplug,
    or None. Checks the plugin's declared ``QUANTPLUG_CONTRACT`` against
    :data:`~quantplug.hookspecs.CONTRACT_VERSION` (same major, minor not newer) and the
    distribution's ``Requires-Dist: quantplug ...`` specifier against the installed version."""
    have = parse_contract(hookspecs.CONTRACT_VERSION, "quantplug")
    declared = getattr(plugin, "QUANTPLUG_CONTRACT", "1.0")
    want = parse_contract(declared, "plugin")
    if want[0] != have[0]:
        return (f"written for hook contract {declared}, this quantplug {__version__} speaks contract "
                f"{hookspecs.CONTRACT_VERSION} (major versions differ)")
    if want[1] > have[1]:
        return (f"written for hook contract {declared}, newer than this quantplug's "
                f"{hookspecs.CONTRACT_VERSION}; upgrade quantplug")
    for line in (getattr(dist, "requires", None) or []) if dist is not None else []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name.lower() != "quantplug" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            ok = req.specifier.contains(Version(__version__), prereleases=True)
        except InvalidVersion:
            ok = True
        if not ok:
            return f"its distribution requires {line!r}, installed quantplug is {__version__}"
    return None


@dataclass(frozen=True)
class Answer:
    """What a hook's non-None answer must be: an instance of ``kind`` and, for a sequence answer,
    every item (for a mapping answer, every value) an instance of ``items``."""

    kind: tuple[type, ...]
    expected: str
    items: tuple[type, ...] | None = None


@functools.cache
def answer_types() -> dict[str, Answer]:
    """Every hook's answer type, as its spec declares it (:func:`quantplug.hookspecs.answers`),
    checked in one place (:func:`wrong_answer`) for every plugin."""
    out: dict[str, Answer] = {}
    for name in dir(hookspecs):
        declared = getattr(getattr(hookspecs, name), "qp_answer", None)
        if name.startswith("quantplug_") and declared is not None:
            expected, kinds, items = declared
            out[name] = Answer(tuple(kinds()), expected, None if items is None else tuple(items()))
    return out


def wrong_answer(hook: str, value: Any) -> str | None:
    """Why ``value`` (not None) is not a valid answer of ``hook`` ("returned X from hook; expected
    Y"), or None when it is (or the hook's answer is not checked: ``quantplug_cli_commands``)."""
    spec = answer_types().get(hook)
    if spec is None:
        return None
    if not isinstance(value, spec.kind) or isinstance(value, str | bytes) and str not in spec.kind:
        return f"returned {type(value).__name__} from {hook}; expected {spec.expected}"
    if spec.items is None or isinstance(value, spec.items):
        return None  # ExportResult itself, or no item type
    items = cast(Iterable[Any], value.values() if isinstance(value, Mapping) else value)
    for item in items:
        if not isinstance(item, spec.items):
            return f"returned {type(item).__name__} in {hook}; expected {spec.expected}"
    return None


def _env_list(env: Mapping[str, str], key: str) -> set[str] | None:
    if key not in env:
        return None
    return {p.strip() for p in env[key].split(",") if p.strip()}


def _summary(value: Any, limit: int = 80) -> str:
    if hasattr(value, "tensors") and hasattr(value, "path"):
        return f"<{type(value).__name__} {value.path}>"
    if hasattr(value, "architecture") and hasattr(value, "hidden_size"):
        return f"<ModelConfig {value.architecture}>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PluginManager:
    """Loads, validates and calls quantplug plugins.

    ``PluginManager()`` loads the core defaults and every entry point allowed by the
    environment; tests use ``PluginManager(entry_points=False)`` and :meth:`register`.
    """

    def __init__(self, *, entry_points: bool = True, env: Mapping[str, str] | None = None) -> None:
        self.env: Mapping[str, str] = os.environ if env is None else env
        self.strict = self.env.get("QUANTPLUG_STRICT_PLUGINS", "") not in ("", "0")
        self.trace = self.env.get("QUANTPLUG_TRACE", "") not in ("", "0")
        if self.trace and not trace_log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("quantplug-trace: %(message)s"))
            trace_log.addHandler(handler)
            trace_log.setLevel(logging.DEBUG)
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._records: dict[str, PluginRecord] = {}
        #: pluggy's caller of (hook, one plugin), made on first use; cleared when plugins change
        self._subsets: dict[tuple[str, str], Any] = {}
        from . import defaults

        self._pm.register(defaults, name=CORE_NAME)
        if entry_points:
            self.load_entry_points()

    # -- loading ------------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        allow = _env_list(self.env, "QUANTPLUG_PLUGINS")
        deny = _env_list(self.env, "QUANTPLUG_DISABLE") or set()
        eps = sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        for ep in eps:
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else ""
            version = dist.version if dist is not None else ""
            if ep.name in self._records:
                self._fail(ep.name, dist_name, version,
                           f"entry point name {ep.name!r} is also provided by "
                           f"{self._records[ep.name].distribution}; backend names must be unique")
                continue
            if (allow is not None and ep.name not in allow) or ep.name in deny:
                why = "not in QUANTPLUG_PLUGINS" if allow is not None and ep.name not in allow else "in QUANTPLUG_DISABLE"
                self._records[ep.name] = PluginRecord(ep.name, dist_name, version, "disabled", error=why)
                continue
            try:
                obj = ep.load()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 (any import-time failure of third-party code, a
                # native library's panic included, is reported, not fatal)
                self._fail(ep.name, dist_name, version,
                           f"import of {ep.value!r} failed: {type(exc).__name__}: {exc}")
                continue
            try:
                problem = contract_problem(obj, dist)
            except PluginLoadError as exc:
                problem = str(exc)
            if problem:
                self._fail(ep.name, dist_name, version, problem)
                continue
            try:
                self.register(obj, ep.name, distribution=dist_name, version=version)
            except PluginLoadError as exc:
                self._fail(ep.name, dist_name, version, str(exc))

    def _fail(self, name: str, dist: str, version: str, error: str) -> None:
        self._records[name] = PluginRecord(name, dist, version, "failed", error=error)
        message = f"plugin {name!r} ({dist} {version}) skipped: {error}"
        if self.strict:
            raise PluginLoadError(message + " [QUANTPLUG_STRICT_PLUGINS=1]")
        log.warning(message)

    def register(self, plugin: object, name: str, *, distribution: str = "", version: str = "") -> None:
        """Register ``plugin`` (module, class or instance with hookimpls) as backend ``name``.

        Raises :class:`PluginLoadError` naming the plugin and hook when a hookimpl has no spec
        (a misspelled hook), asks for an argument the spec lacks, or is a wrapper.
        """
        if name == CORE_NAME or name in self._records and self._records[name].status == "active":
            raise PluginLoadError(f"plugin name {name!r} is already registered")
        why = contract_problem(plugin)
        if why:
            raise PluginLoadError(f"plugin {name!r} ({distribution} {version}): {why}")
        self._subsets.clear()
        try:
            self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(f"plugin {name!r} ({distribution} {version}): {exc}") from None
        try:
            self._check_plugin(plugin, name)
        except PluginLoadError:
            self._pm.unregister(plugin)
            raise
        hooks = sorted(h.name for h in (self._pm.get_hookcallers(plugin) or []))
        self._records[name] = PluginRecord(name, distribution, version, "active", hooks)

    def _check_plugin(self, plugin: object, name: str) -> None:
        where = f"plugin {name!r}"
        for caller in self._pm.get_hookcallers(plugin) or []:
            if caller.spec is None:
                raise PluginLoadError(f"{where}: hook {caller.name!r} is not in the quantplug contract "
                                      f"(misspelled?); known hooks: {', '.join(self.hook_names())}")
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and (impl.hookwrapper or impl.wrapper):
                    raise PluginLoadError(f"{where}: hook {caller.name!r} is a wrapper; quantplug hooks "
                                          "answer, they do not wrap")
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(f"{where}: {exc}") from None

    # -- introspection ------------------------------------------------------------------------

    @property
    def pluggy(self) -> pluggy.PluginManager:
        """The underlying pluggy manager: for pluggy's own tools (``add_hookcall_monitoring``,
        ``enable_tracing``), which see every hook call. Register plugins with :meth:`register`, not
        here (its checks and records would be skipped)."""
        return self._pm

    @staticmethod
    def hook_names() -> list[str]:
        return sorted(n for n in dir(hookspecs) if n.startswith("quantplug_"))

    def records(self) -> list[PluginRecord]:
        return sorted(self._records.values(), key=lambda r: r.name)

    def active(self) -> list[str]:
        return [r.name for r in self.records() if r.status == "active"]

    def info(self, name: str) -> PluginInfo:
        if name == CORE_NAME:
            return CORE
        rec = self._records.get(name)
        return rec.info if rec else PluginInfo(name)

    def implements(self, name: str, hook: str) -> bool:
        rec = self._records.get(name)
        return rec is not None and rec.status == "active" and hook in rec.hooks

    # -- calling ------------------------------------------------------------------------------

    def firstresult(self, hook: str) -> bool:
        """Whether ``hook``'s first non-None answer wins (its spec's ``firstresult``)."""
        spec = getattr(self._pm.hook, hook).spec
        return bool(spec is not None and spec.opts.get("firstresult"))

    def _caller(self, hook: str, name: str) -> Any:
        """pluggy's caller of ``hook`` holding only plugin ``name``'s implementation."""
        key = (hook, name)
        sub = self._subsets.get(key)
        if sub is None:
            keep = self._pm.get_plugin(name)
            sub = self._pm.subset_hook_caller(hook, remove_plugins=[p for p in self._pm.get_plugins() if p is not keep])
            self._subsets[key] = sub
        return sub

    def call(self, hook: str, plugins: Iterable[str] | None, *, firstresult: bool | None = None,
             **kwargs: Any) -> list[tuple[Any, PluginInfo]]:
        """Call ``hook`` on the named plugins (None: all) in pluggy's order; stamp each answer.

        Implementations run last-registered first with ``tryfirst``/``trylast`` honoured, each
        through pluggy's caller of that one plugin, and receive only the arguments they name. With
        a ``firstresult`` hook (the spec decides; ``firstresult``, if given, must agree) the first
        non-None answer ends the call. An exception that is not a QuantplugError is wrapped in one
        naming the plugin and hook; a QuantplugError that does not name its plugin gets the name
        prefixed.

        Scope is enforced here: a backend hook must name its plugins (one backend, and/or
        "core"); ``plugins=None`` (every plugin) is allowed for global hooks only.
        """
        if hook in hookspecs.BACKEND_HOOKS:
            if plugins is None:
                raise QuantplugError(f"{hook} is a backend hook: it is called on one backend and the core "
                                     "defaults, never on every plugin")
            backends = [p for p in plugins if p != CORE_NAME]
            if len(backends) > 1:
                raise QuantplugError(f"{hook} is a backend hook: called on one backend, not {backends}")
        elif hook not in hookspecs.GLOBAL_HOOKS:
            raise QuantplugError(f"{hook} is not a hook of the quantplug contract")
        first = self.firstresult(hook)
        if firstresult is not None and firstresult != first:
            raise QuantplugError(f"{hook}: its spec says firstresult={first}; a caller cannot change that")
        allowed = None if plugins is None else set(plugins)
        caller = getattr(self._pm.hook, hook)
        answers: list[tuple[Any, PluginInfo]] = []
        for impl in reversed(caller.get_hookimpls()):
            if allowed is not None and impl.plugin_name not in allowed:
                continue
            info = self.info(impl.plugin_name)
            try:
                result = self._caller(hook, impl.plugin_name)(**kwargs)
            except PlanError:
                raise
            except QuantplugError as exc:
                if info.name == CORE_NAME or f"plugin {info.name}" in str(exc) or f"plugin {info.name!r}" in str(exc):
                    raise
                try:
                    named = type(exc)(f"plugin {info} in {hook}: {exc}")
                except TypeError:  # a subclass with another constructor: keep it as raised
                    raise exc from None
                raise named from exc
            except Exception as exc:
                raise QuantplugError(f"plugin {info} failed in {hook}: {type(exc).__name__}: {exc}") from exc
            if not first:  # pluggy's list of the one plugin's non-None answers
                result = result[0] if result else None
            if self.trace:
                summary = ", ".join(f"{k}={_summary(v)}" for k, v in kwargs.items())
                trace_log.debug("%s(%s) -> %s [%s]", hook, summary, _summary(result), info)
            if result is None:
                continue
            wrong = wrong_answer(hook, result)
            if wrong:
                target = f" for {kwargs['layer_name']}" if "layer_name" in kwargs else ""
                raise QuantplugError(f"plugin {info} {wrong}{target}")
            answers.append((result, info))
            if first:
                break
        return answers

    def backend_first(self, backend: str | None, hook: str, **kwargs: Any) -> tuple[Any, PluginInfo]:
        """First non-None answer of a backend hook: the backend's, else the core default's."""
        plugins = [CORE_NAME] + ([backend] if backend else [])
        answers = self.call(hook, plugins, **kwargs)
        if not answers:
            return None, CORE
        return answers[0]

    def backend_all(self, backend: str | None, hook: str, **kwargs: Any) -> list[tuple[Any, PluginInfo]]:
        plugins = [CORE_NAME] + ([backend] if backend else [])
        return self.call(hook, plugins, **kwargs)

    def export(self, backend: str, *, model: Any, destination: Any, plan: Any,
               options: Mapping[str, Any] | None = None) -> list[ExportResult]:
        """``quantplug_export`` of ``backend``: ``options`` checked against its declared export
        options (defaults filled in), every answer an :class:`ExportResult`; ``[]`` when the backend
        writes nothing for this model."""
        from .options import export_options

        answers = self.call("quantplug_export", [backend], model=model,
                            model_config=plan.model_config, destination=destination,
                            options=export_options(self, backend, options), plan=plan)
        if not answers:
            return []
        value = answers[0][0]
        return list(value) if isinstance(value, Sequence) else [value]

    # -- architectures ------------------------------------------------------------------------

    def architectures(self) -> dict[str, Any]:
        """Architectures added by plugins (``quantplug_architectures``), checked for clashes with
        each other and with those registered through the ``quantplug.architectures`` entry points."""
        from .contract.arch import check_plugin_architectures

        return check_plugin_architectures(self.call("quantplug_architectures", None))

    # -- detection ----------------------------------------------------------------------------

    def detect(self, checkpoint: Any, backend: str | None = None) -> Claim | None:
        """Collect every Claim; pick the backend (None: dense) or raise, listing the candidates."""
        installed = self.active()
        if backend is not None and backend not in installed:
            raise NoBackendError(f"backend {backend!r} is not installed or not active; installed: "
                                 f"{', '.join(installed) or 'none'}")
        claims = []
        for claim, info in self.call("quantplug_detect", installed, checkpoint=checkpoint):
            if claim.backend != info.name:
                raise QuantplugError(f"plugin {info} claimed as {claim.backend!r}; a Claim must carry the "
                                     "backend's own entry-point name")
            claims.append(Claim(claim.backend, claim.quant_config, claim.reason, info))
        if backend is not None:
            for c in claims:
                if c.backend == backend:
                    return c
            raise NoBackendError(f"backend {backend!r} was named but does not recognise {checkpoint.path}")
        if len(claims) > 1:
            listing = "; ".join(f"{c.backend} ({c.plugin}): {c.reason}" for c in claims)
            raise AmbiguousBackendError(f"{len(claims)} backends claim {checkpoint.path}: {listing}. "
                                        "Pass backend=NAME (CLI: --backend NAME) to choose one.")
        if claims:
            return claims[0]
        nonfloat = [t for t in checkpoint.tensors.values() if not t.is_float]
        if nonfloat:
            t = nonfloat[0]
            fp8 = [x for x in nonfloat if x.dtype.startswith("F8_")]
            what = (f"{len(fp8)} tensor(s) are FP8 ({', '.join(sorted({x.dtype for x in fp8}))}; first: "
                    f"{fp8[0].name} in {fp8[0].file.name}): quantized weights that need a backend"
                    if fp8 else f"{len(nonfloat)} tensor(s) are quantized or integer, not float (first: "
                    f"{t.name} is {t.dtype} in {t.file.name})")
            qc, _ = quant_config_fields(checkpoint.config, str(checkpoint.path / "config.json"))
            method = qc.opt_str("quant_method") if qc is not None else None
            hint = f"; config.json says quant_method {method!r}" if method else ""
            raise NoBackendError(
                f"no installed backend recognises {checkpoint.path}, and it is not dense: {what}{hint}; "
                f"installed backends: {', '.join(installed) or 'none'}")
        return None


_default: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager (entry points loaded once, honouring the environment then)."""
    global _default
    if _default is None:
        _default = PluginManager()
    return _default


def reset_plugin_manager() -> None:
    global _default
    _default = None
