"""A typed facade over pluggy's PluginManager.

* Backends are found through the ``quantplug.backends`` entry-point group, loaded one at a
  time; one that fails to import or to validate is recorded as failed and skipped
  (``QUANTPLUG_STRICT_PLUGINS=1`` makes that a :class:`PluginLoadError`).
* ``QUANTPLUG_PLUGINS`` is an allow-list of backend names (empty string = none),
  ``QUANTPLUG_DISABLE`` a deny-list.
* pluggy calls the hooks: global hooks through ``pm.hook.<name>``, backend hooks through one
  ``subset_hook_caller`` per (hook, selected plugins), so order (last registered first,
  ``tryfirst`` / ``trylast``), ``firstresult`` (from the hook's spec) and None-skipping are
  pluggy's, and ``add_hookcall_monitoring`` / ``enable_tracing`` on :attr:`PluginManager.pluggy`
  see every call.
* Every hook answer comes back stamped with the plugin that gave it. Each implementation's
  function is replaced at registration by a thin one (same arguments, same answer) that checks
  the answer's type (:func:`wrong_answer`), names the plugin in any error it raises, and records
  "this answer is plugin P's" in the record of the current :meth:`PluginManager.call`; answers
  themselves are never tagged, so wrappers see the real ones. A wrapper that returns something
  other than what it received has *overridden* the answer: the answer is stamped with the
  wrapper's :class:`Overridden` info (its name, and whose answer it replaced), and the override is
  logged and kept in :meth:`PluginManager.overrides`.
* Hook wrappers (``@hookimpl(wrapper=True)``, old-style ``hookwrapper=True``) are allowed from
  contract 1.11 (a plugin declaring an older contract with one is refused, as before). Scope: a
  plugin that answers no hook (only wraps) is a *wrapper plugin*, and its wrappers run in every
  call of the hooks they wrap, whichever backend is selected; a plugin that answers any hook is a
  backend, and all its implementations, wrappers included, run only where it is selected.
* Backend hooks are called only on the selected backend, the core defaults and wrapper plugins:
  an installed backend can never answer for, nor wrap, a load it did not claim.
* ``QUANTPLUG_TRACE=1`` logs every hook call, a summary of its arguments and each answer (and
  each override) with the plugin that gave it.
* Contract versions: a plugin built for another major version of the hook contract, or a
  newer minor one, or whose distribution requires a quantplug version other than this one, is
  recorded as failed with why (see :data:`quantplug.hookspecs.CONTRACT_VERSION`).
* Scope is enforced: :meth:`PluginManager.call` refuses a backend hook on every plugin or on
  more than one backend.
"""
from __future__ import annotations

import contextvars
import functools
import importlib.metadata as md
import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
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
#: integer tensors a dense checkpoint may hold beside its floats: index tables, not quantized weights
#: (DeepSeek-V4's hash router table ``layers.L.ffn.gate.tid2eid``)
INDEX_TABLES = (".tid2eid",)

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


@dataclass(frozen=True)
class Overridden(PluginInfo):
    """Who answered, when a hook wrapper replaced the answer: the wrapper's plugin (``name``,
    ``distribution``, ``version``, as for any answer) and whose answer it replaced (``replaced``;
    None when it answered where no implementation had, or replaced an error). Shown as
    ``"tracer (tracer-dist 1.0), overriding core (quantplug 0.6.0)"`` wherever the plan names
    who decided (``Decision.describe``, ``quantplug explain``, the plan's JSON)."""

    replaced: PluginInfo | None = None

    def __str__(self) -> str:
        by = PluginInfo.__str__(self)
        return f"{by}, overriding {self.replaced}" if self.replaced is not None else f"{by}, by its wrapper"


@dataclass(frozen=True)
class Override:
    """One hook wrapper's replacement of an answer (see :meth:`PluginManager.overrides`)."""

    hook: str
    target: str
    by: PluginInfo
    replaced: PluginInfo | None
    before: Any
    after: Any

    def describe(self) -> str:
        at = f"[{self.target}]" if self.target else ""
        whose = f"{self.replaced}'s answer {_summary(self.before)}" if self.replaced is not None else "no answer"
        return f"plugin {self.by}'s wrapper of {self.hook}{at} replaced {whose} with {_summary(self.after)}"


class _CallRecord:
    """One :meth:`PluginManager.call` in progress: each implementation's non-None answer with its
    plugin (in the order pluggy called them), and each wrapper's change of the result (innermost
    first, as the wrappers finish)."""

    __slots__ = ("answers", "changes", "first", "hook", "kwargs")

    def __init__(self, hook: str, kwargs: Mapping[str, Any], first: bool) -> None:
        self.hook = hook
        self.kwargs = kwargs
        self.first = first
        self.answers: list[tuple[Any, PluginInfo]] = []
        #: (wrapper, result it received, result it returned); list results as copies
        self.changes: list[tuple[PluginInfo, Any, Any]] = []

    def target(self) -> str:
        return str(self.kwargs.get("layer_name", ""))


#: The call whose answers the instrumented implementations record (None outside
#: :meth:`PluginManager.call`, e.g. a direct call through ``PluginManager.pluggy``).
_current: contextvars.ContextVar[_CallRecord | None] = contextvars.ContextVar("quantplug_call", default=None)


def _named_error(exc: Exception, info: PluginInfo, hook: str) -> Exception | None:
    """The error to raise for ``exc``, raised by plugin ``info``'s implementation of ``hook``:
    one naming the plugin, or None to re-raise ``exc`` as it is (a PlanError, the core's own, or a
    QuantplugError that names the plugin already)."""
    if isinstance(exc, PlanError):
        return None
    if isinstance(exc, QuantplugError):
        if info.name == CORE_NAME or f"plugin {info.name}" in str(exc) or f"plugin {info.name!r}" in str(exc):
            return None
        try:
            return type(exc)(f"plugin {info} in {hook}: {exc}")
        except TypeError:  # a subclass with another constructor: keep it as raised
            return None
    return QuantplugError(f"plugin {info} failed in {hook}: {type(exc).__name__}: {exc}")


def _same_items(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


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
        #: pluggy's caller of (hook, plugins kept), made on first use; cleared when plugins change
        self._subsets: dict[tuple[str, frozenset[str]], Any] = {}
        #: plugins that answer no hook, only wrap: their wrappers run whichever backend is selected
        self._wrapper_plugins: set[str] = set()
        self._overrides: deque[Override] = deque(maxlen=1000)
        from . import defaults

        self._pm.register(defaults, name=CORE_NAME)
        self._instrument(defaults, CORE)
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
        (a misspelled hook) or asks for an argument the spec lacks. Hook wrappers
        (``wrapper=True``, old-style ``hookwrapper=True``; contract 1.11) are allowed: a plugin
        whose implementations are all wrappers wraps the hooks of every load (see :meth:`call`).
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
        impls = [impl for c in self._pm.get_hookcallers(plugin) or [] for impl in c.get_hookimpls()
                 if impl.plugin is plugin]
        if impls and all(impl.wrapper or impl.hookwrapper for impl in impls):
            self._wrapper_plugins.add(name)
        self._instrument(plugin, PluginInfo(name, distribution, version))

    def _check_plugin(self, plugin: object, name: str) -> None:
        where = f"plugin {name!r}"
        for caller in self._pm.get_hookcallers(plugin) or []:
            if caller.spec is None:
                raise PluginLoadError(f"{where}: hook {caller.name!r} is not in the quantplug contract "
                                      f"(misspelled?); known hooks: {', '.join(self.hook_names())}")
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

    def overrides(self) -> list[Override]:
        """The answers hook wrappers replaced in this manager's calls (the latest 1000), oldest
        first. Each is also logged (logger ``quantplug.plugins``, INFO) and the decision made of it
        names the wrapper (:class:`Overridden`)."""
        return list(self._overrides)

    def wrapper_plugins(self) -> list[str]:
        """The plugins that answer no hook, only wrap: theirs wrap every load's hooks."""
        return sorted(self._wrapper_plugins)

    def _hook_caller(self, hook: str, plugins: Iterable[str] | None) -> Any:
        """pluggy's caller of ``hook``: every plugin's (``plugins=None``), else one subset caller
        keeping ``plugins`` and the wrapper plugins, made on first use."""
        if plugins is None:
            return getattr(self._pm.hook, hook)
        keep = frozenset(plugins) | self._wrapper_plugins
        key = (hook, keep)
        sub = self._subsets.get(key)
        if sub is None:
            remove = [p for n, p in self._pm.list_name_plugin() if p is not None and n not in keep]
            sub = self._subsets[key] = self._pm.subset_hook_caller(hook, remove_plugins=remove)
        return sub

    # -- instrumentation: attribution, answer checks, errors and tracing, per implementation ----

    def _instrument(self, plugin: object, info: PluginInfo) -> None:
        """Replace the function of each of ``plugin``'s hook implementations by a thin one (same
        arguments, same answer) that checks and records its answer, or its wrapper's change of
        the result, in the current call's record, and names ``info`` in the errors it raises."""
        for caller in self._pm.get_hookcallers(plugin) or []:
            first = self.firstresult(caller.name)
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                fn = impl.function
                if impl.hookwrapper:
                    thin = self._old_style_wrapper(fn, caller.name, info, first)
                elif impl.wrapper:
                    thin = self._wrapper(fn, caller.name, info, first)
                else:
                    thin = self._answering(fn, caller.name, info)
                functools.update_wrapper(thin, fn)
                setattr(impl, "function", thin)  # noqa: B010 (pluggy types HookImpl.function as Final)

    @staticmethod
    def _record(hook: str) -> _CallRecord | None:
        rec = _current.get()
        return rec if rec is not None and rec.hook == hook else None

    def _trace(self, hook: str, rec: _CallRecord | None, value: Any, info: PluginInfo) -> None:
        if self.trace:
            summary = ", ".join(f"{k}={_summary(v)}" for k, v in rec.kwargs.items()) if rec is not None else "..."
            trace_log.debug("%s(%s) -> %s [%s]", hook, summary, _summary(value), info)

    @staticmethod
    def _check(hook: str, value: Any, info: PluginInfo, rec: _CallRecord | None, what: str = "") -> None:
        wrong = wrong_answer(hook, value)
        if wrong:
            target = f" for {rec.target()}" if rec is not None and rec.target() else ""
            raise QuantplugError(f"plugin {info}{what} {wrong}{target}")

    def _answering(self, fn: Callable[..., Any], hook: str, info: PluginInfo) -> Callable[..., Any]:
        def answer(*args: Any, **kwargs: Any) -> Any:
            rec = self._record(hook)
            try:
                value = fn(*args, **kwargs)
            except Exception as exc:
                named = _named_error(exc, info, hook)
                if named is None:
                    raise
                raise named from exc
            self._trace(hook, rec, value, info)
            if value is not None:
                self._check(hook, value, info, rec)
                if rec is not None:
                    rec.answers.append((value, info))
            return value

        return answer

    @staticmethod
    def _start(gen: Any, hook: str, info: PluginInfo) -> Any:
        """Run a wrapper up to its yield."""
        try:
            return next(gen)
        except StopIteration:
            raise QuantplugError(f"plugin {info}: its wrapper of {hook} did not yield") from None
        except Exception as exc:
            named = _named_error(exc, info, hook)
            if named is None:
                raise
            raise named from exc

    def _wrapper(self, fn: Callable[..., Any], hook: str, info: PluginInfo,
                 first: bool) -> Callable[..., Generator[Any, Any, Any]]:
        def wrap(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            rec = self._record(hook)
            gen = fn(*args, **kwargs)
            sent = self._start(gen, hook, info)
            try:
                received = yield sent
            except BaseException as exc:  # the implementations raised: the wrapper sees it
                try:
                    gen.throw(exc)
                except StopIteration as stop:  # it answered instead
                    return self._changed(hook, info, rec, first, None, stop.value)
                except Exception as raised:
                    named = None if raised is exc else _named_error(raised, info, hook)
                    if named is None:
                        raise
                    raise named from raised
                gen.close()
                raise QuantplugError(f"plugin {info}: its wrapper of {hook} yielded twice") from exc
            before = list(received) if isinstance(received, list) else received
            try:
                gen.send(received)
            except StopIteration as stop:
                return self._changed(hook, info, rec, first, before, stop.value)
            except Exception as exc:
                named = _named_error(exc, info, hook)
                if named is None:
                    raise
                raise named from exc
            gen.close()
            raise QuantplugError(f"plugin {info}: its wrapper of {hook} yielded twice")

        return wrap

    def _old_style_wrapper(self, fn: Callable[..., Any], hook: str, info: PluginInfo,
                           first: bool) -> Callable[..., Generator[Any, Any, None]]:
        def wrap(*args: Any, **kwargs: Any) -> Generator[Any, Any, None]:
            rec = self._record(hook)
            gen = fn(*args, **kwargs)
            outcome: pluggy.Result[Any] = yield self._start(gen, hook, info)
            failed = outcome.exception is not None
            received = None if failed else outcome.get_result()
            before = list(received) if isinstance(received, list) else received
            try:
                gen.send(outcome)
            except StopIteration:
                pass
            except Exception as exc:
                named = _named_error(exc, info, hook)
                if named is None:
                    raise
                raise named from exc
            else:
                gen.close()
                raise QuantplugError(f"plugin {info}: its wrapper of {hook} yielded twice")
            if outcome.exception is None and (failed or outcome.get_result() is not received
                                              or isinstance(received, list)):
                after = outcome.get_result()
                checked = self._changed(hook, info, rec, first, before, after)
                if checked is not after:
                    outcome.force_result(checked)

        return wrap

    def _changed(self, hook: str, info: PluginInfo, rec: _CallRecord | None, first: bool, before: Any,
                 after: Any) -> Any:
        """A wrapper returned ``after`` having received ``before`` (a copy, for a list): check it
        and, where it differs, record and log the override."""
        if first:
            if after is before:
                return after
            if after is None:  # the core's defaults answer last: None would leave the plan without one
                target = f" for {rec.target()}" if rec is not None and rec.target() else ""
                raise QuantplugError(f"plugin {info}'s wrapper of {hook} returned None in place of an "
                                     f"answer{target}; a wrapper returns the answer it received, or its own")
            self._check(hook, after, info, rec, "'s wrapper")
        else:
            if after is None and hook not in answer_types() and isinstance(before, list):
                return before  # a hook whose answers nobody reads (a timing wrapper that only yields)
            if not isinstance(after, list):
                raise QuantplugError(f"plugin {info}'s wrapper returned {type(after).__name__} from {hook}; "
                                     "expected the list of answers it received, changed or not "
                                     "(`return (yield)`)")
            if isinstance(before, list) and _same_items(before, after):
                return after
            for item in after:
                if item is not None:
                    self._check(hook, item, info, rec, "'s wrapper")
            after = list(after)
        if rec is None:  # a direct pluggy call: nothing to attribute
            return after
        rec.changes.append((info, before, after))
        replaced = None
        for old in (before if isinstance(before, list) else [before]):
            if old is not None and not any(old is x for x in (after if isinstance(after, list) else [after])):
                replaced = self._origin(rec, old, len(rec.changes) - 1)
                break
        override = Override(hook, rec.target(), info, replaced, before, after)
        self._overrides.append(override)
        log.info("%s", override.describe())
        self._trace(hook, rec, after, Overridden(info.name, info.distribution, info.version, replaced))
        return after

    def _origin(self, rec: _CallRecord, value: Any, upto: int) -> PluginInfo:
        """Who gave ``value``: the outermost of the first ``upto`` wrapper changes that introduced
        it (as :class:`Overridden`, naming whose answer it replaced), else the implementation that
        answered it."""
        for i in range(upto - 1, -1, -1):
            by, before, after = rec.changes[i]
            if rec.first:
                introduced = after is value
            else:
                introduced = (any(x is value for x in after)
                              and not any(x is value for x in (before if isinstance(before, list) else [])))
            if not introduced:
                continue
            replaced: PluginInfo | None = None
            if rec.first and before is not None:
                replaced = self._origin(rec, before, i)
            elif not rec.first and isinstance(before, list) and len(before) == len(after):
                j = next(k for k, x in enumerate(after) if x is value)
                replaced = self._origin(rec, before[j], i) if before[j] is not None else None
            return Overridden(by.name, by.distribution, by.version, replaced)
        for answered, info in rec.answers:
            if answered is value:
                return info
        raise QuantplugError(f"{rec.hook}: an answer ({_summary(value)}) came from an implementation this "
                             "plugin manager did not register; register plugins with PluginManager.register, "
                             "not on PluginManager.pluggy")

    def call(self, hook: str, plugins: Iterable[str] | None, *, firstresult: bool | None = None,
             **kwargs: Any) -> list[tuple[Any, PluginInfo]]:
        """Call ``hook`` through pluggy on the named plugins (None: all) and the wrapper plugins;
        stamp each answer with the plugin that gave it.

        pluggy orders the implementations (last registered first, ``tryfirst`` / ``trylast``
        honoured, wrappers around the rest), passes each only the arguments it names, skips None
        answers and, for a ``firstresult`` hook (the spec decides; ``firstresult``, if given, must
        agree), stops at the first answer. An exception that is not a QuantplugError is wrapped in
        one naming the plugin and hook; a QuantplugError that does not name its plugin gets the
        name prefixed; an answer of the wrong type is an error naming the plugin. An answer a
        wrapper replaced is stamped :class:`Overridden` (the wrapper's plugin and whose answer it
        replaced).

        Scope is enforced here: a backend hook must name its plugins (one backend, and/or
        "core"); ``plugins=None`` (every plugin) is allowed for global hooks only. A plugin that
        answers any hook runs only where it is named; the wrappers of a plugin that answers none
        (:meth:`wrapper_plugins`) run in every call of the hooks they wrap.
        """
        if hook in hookspecs.BACKEND_HOOKS:
            if plugins is None:
                raise QuantplugError(f"{hook} is a backend hook: it is called on one backend and the core "
                                     "defaults, never on every plugin")
            plugins = list(plugins)
            backends = [p for p in plugins if p != CORE_NAME]
            if len(backends) > 1:
                raise QuantplugError(f"{hook} is a backend hook: called on one backend, not {backends}")
        elif hook not in hookspecs.GLOBAL_HOOKS:
            raise QuantplugError(f"{hook} is not a hook of the quantplug contract")
        first = self.firstresult(hook)
        if firstresult is not None and firstresult != first:
            raise QuantplugError(f"{hook}: its spec says firstresult={first}; a caller cannot change that")
        caller = self._hook_caller(hook, plugins)
        rec = _CallRecord(hook, kwargs, first)
        token = _current.set(rec)
        try:
            result = caller(**kwargs)
        except pluggy.HookCallError as exc:
            missing = [impl for impl in caller.get_hookimpls() if not set(impl.argnames) <= set(kwargs)]
            who = f"plugin {self.info(missing[0].plugin_name)} failed in {hook}" if missing else hook
            raise QuantplugError(f"{who}: HookCallError: {exc}") from None
        finally:
            _current.reset(token)
        if first:
            return [] if result is None else [(result, self._origin(rec, result, len(rec.changes)))]
        return [(value, self._origin(rec, value, len(rec.changes))) for value in result if value is not None]

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
        # integer tables that are data, not quantized weights (DeepSeek-V4's token -> experts table)
        nonfloat = [t for t in checkpoint.tensors.values()
                    if not t.is_float and not (t.name.endswith(INDEX_TABLES) and t.dtype in ("I32", "I64"))]
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
