"""Exclusion (ignore) lists of quantization configs, resolved against a checkpoint.

Quantization configs name the modules they leave unquantized in several spellings: ModelOpt's
``exclude_modules`` (exact names and ``*`` wildcards), compressed-tensors' ``ignore`` (exact
names and ``re:`` regexes), GPTQModel / auto-round ``dynamic`` (``-:`` regexes), AWQ's
``modules_to_not_convert`` (name fragments), and all of them sometimes carry the names another
engine gives a module: vLLM fuses ``q_a_proj`` + ``kv_a_proj_with_mqa`` into
``fused_qkv_a_proj`` (``qkv_proj`` in other models), ``gate_proj`` + ``up_proj`` into
``gate_up_proj``, and names experts ``w1`` / ``w2`` / ``w3`` (Mixtral) or ``w13`` (its fused
MoE). A wrong spelling silently quantizes what was meant to stay float (vllm issue 28072), and
an excluded module whose scales were still written is a broken export (vllm PR 45132).

:class:`Exclusions` is written once here and used by every backend:

* an entry is ``re:<regex>`` (``re.match`` or ``re.fullmatch``, the format's choice), a pattern
  with ``*`` / ``?`` / ``[`` (``fnmatch``, ``*`` spanning dots), a ``substring`` entry (AWQ's
  ``modules_to_not_convert``: the name contains it), or an exact module name;
* it is matched against a module's checkpoint name, its name relative to the backend's resolved
  prefix (``language_model`` of Kimi wrappers), each of those under the other engines' names of
  the module (:data:`ALIASES`), and each of their parent modules (excluding
  ``model.layers.1.mlp.experts`` excludes every expert under it);
* :meth:`Exclusions.problems` checks the list against the checkpoint, headers only: a name
  (exact or substring) that names no module is an error with a did-you-mean, a pattern that matches nothing a
  warning, and a quantized tensor (scales, packed weights) stored under an excluded module an
  error naming the entry and the tensor.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError
from .types import Problem
from .validation import regex_problem

#: other engines' module names -> the checkpoint (Hugging Face DeepSeek-V3) shard names they stand for
ALIASES: Mapping[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa"),
    "qkv_proj": ("q_a_proj", "kv_a_proj_with_mqa", "q_proj"),
    "w1": ("gate_proj",),
    "w3": ("up_proj",),
    "w13": ("gate_proj", "up_proj"),
    "w2": ("down_proj",),
}
#: aliases that name expert projections only (``...experts.N.w1``, vLLM FusedMoE ``w13`` / ``w2``)
EXPERT_ALIASES = frozenset({"w1", "w2", "w3", "w13"})
_ALIASES_OF: dict[str, tuple[str, ...]] = {}
for _alias, _shards in ALIASES.items():
    for _shard in _shards:
        _ALIASES_OF[_shard] = (*_ALIASES_OF.get(_shard, ()), _alias)

RegexMode = Literal["match", "fullmatch"]


def modules_of(tensor_names: Iterable[str]) -> frozenset[str]:
    """Every module name of a checkpoint: each dotted prefix of each tensor name (a tensor
    ``a.b.weight`` gives modules ``a`` and ``a.b``)."""
    out: set[str] = set()
    add = out.add
    for name in tensor_names:
        # walk up the parents until one is known: the set stays closed under parents, so the
        # rest of the chain is in it already (a Kimi-K3 index: ~500k names, ~1 new module each)
        m, dot, _ = name.rpartition(".")
        while dot and m not in out:
            add(m)
            m, dot, _ = m.rpartition(".")
    return frozenset(out)


def _is_pattern(entry: str) -> bool:
    return any(c in entry for c in "*?[")


@dataclass(frozen=True)
class Exclusions:
    """One exclusion list of a quantization config, as written, with how to read it.

    ``entries``: the list verbatim. ``source``: where it was read, for messages (e.g.
    ``hf_quant_config.json quantization.exclude_modules``). ``prefix``: the prefix the backend
    resolved (``""`` or ``"language_model"``): entries match with or without it. ``regex``:
    ``re:`` entries use ``re.match`` (compressed-tensors, GPTQModel) or ``re.fullmatch`` (Quark).
    ``substring``: entries without ``re:`` or wildcards match any name containing them (AWQ's
    ``modules_to_not_convert``) instead of naming a module exactly.
    """

    entries: tuple[str, ...]
    source: str
    prefix: str = ""
    regex: RegexMode = "match"
    substring: bool = False

    # -- matching ---------------------------------------------------------------------------

    @functools.cached_property
    def _compiled(self) -> tuple[tuple[str, str, re.Pattern[str] | None], ...]:
        """(entry, kind, compiled) with kind "regex" | "pattern" | "exact" | "substring"."""
        out: list[tuple[str, str, re.Pattern[str] | None]] = []
        for e in self.entries:
            if e.startswith("re:"):
                try:
                    out.append((e, "regex", re.compile(e[3:])))
                except (re.error, RecursionError, OverflowError, ValueError) as exc:
                    raise ConfigError(f"{self.source} entry {e!r}: not a valid regular expression "
                                      f"({regex_problem(exc)})") from None
            elif _is_pattern(e):
                out.append((e, "pattern", re.compile(fnmatch.translate(e))))
            else:
                out.append((e, "substring" if self.substring else "exact", None))
        return tuple(out)

    def _bases(self, module: str) -> tuple[str, ...]:
        """``module`` and, when it lies under the prefix, its name relative to it."""
        p = f"{self.prefix}." if self.prefix else ""
        return (module, module[len(p):]) if p and module.startswith(p) else (module,)

    @staticmethod
    def _spellings(base: str) -> list[str]:
        """``base`` and its other-engine spellings (:data:`ALIASES`; expert-only aliases under
        ``.experts.`` only): the same parent, another last component."""
        parent, _, last = base.rpartition(".")
        spelled = [base]
        aliases = _ALIASES_OF.get(last, ())
        if aliases:
            expert = ".experts." in f".{base}"
            for alias in aliases:
                if alias not in EXPERT_ALIASES or expert:
                    spelled.append(f"{parent}.{alias}" if parent else alias)
        return spelled

    def names_of(self, module: str) -> tuple[str, ...]:
        """The names an entry is matched against for ``module`` (a checkpoint name): the name, the
        name relative to the prefix, their other-engine spellings, and all of their parents."""
        names: list[str] = []
        for b in self._bases(module):
            for s in self._spellings(b):
                parts = s.split(".")
                names += [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        return tuple(dict.fromkeys(names))

    @functools.cached_property
    def _exact_index(self) -> dict[str, int]:
        """Exact entries -> their first position in the list."""
        out: dict[str, int] = {}
        for i, (e, kind, _) in enumerate(self._compiled):
            if kind == "exact":
                out.setdefault(e, i)
        return out

    @functools.cached_property
    def _inexact(self) -> tuple[tuple[int, tuple[str, str, re.Pattern[str] | None]], ...]:
        """(position, compiled) of the regex, wildcard and substring entries, in list order."""
        return tuple((i, c) for i, c in enumerate(self._compiled) if c[1] != "exact")

    def excluded_by(self, module: str) -> str | None:
        """The entry that excludes ``module`` (checkpoint name), or None: the first in list order
        that matches one of its names (exact entries by one dict lookup per name)."""
        names = self.names_of(module)
        index = self._exact_index
        best = min((index[n] for n in names if n in index), default=len(self._compiled))
        for i, c in self._inexact:
            if i > best:
                break
            if self._hit(c, names):
                return c[0]
        return self._compiled[best][0] if best < len(self._compiled) else None

    def _excluded_many(self, modules: Iterable[str]) -> dict[str, str]:
        """:meth:`excluded_by` of many modules -> {module: entry} for the excluded ones.

        When every entry is exact, each entry is looked up once among the sorted modules instead
        of matching each module against every entry (a Kimi-K3 index: 247,296 quantized expert
        modules against an llm-compressor ignore list of 1,347 names). Entry E excludes module M
        iff E is one of M's names: M itself or a parent (through the prefix, too), or an
        other-engine spelling of M (E = parent + alias, M = parent + one of the alias's shards)."""
        if self._inexact:
            return {m: hit for m in modules if (hit := self.excluded_by(m)) is not None}
        import bisect

        ordered = sorted(modules)
        members = set(ordered)
        p = f"{self.prefix}." if self.prefix else ""
        best: dict[str, int] = {}

        def take(m: str, i: int) -> None:
            if best.get(m, i + 1) > i:
                best[m] = i

        for entry, i in self._exact_index.items():
            forms = (entry, p + entry) if p else (entry,)
            for f in forms:
                if f in members:
                    take(f, i)
                under = f + "."
                j = bisect.bisect_left(ordered, under)
                while j < len(ordered) and ordered[j].startswith(under):
                    take(ordered[j], i)
                    j += 1
            parent, _, last = entry.rpartition(".")
            for shard in ALIASES.get(last, ()):
                target = f"{parent}.{shard}" if parent else shard
                if last in EXPERT_ALIASES and ".experts." not in f".{target}":
                    continue
                for f in ((target, p + target) if p else (target,)):
                    if f in members:
                        take(f, i)
        return {m: self._compiled[best[m]][0] for m in modules if m in best}

    def _hit(self, compiled: tuple[str, str, re.Pattern[str] | None], names: tuple[str, ...]) -> bool:
        entry, kind, rx = compiled
        if kind == "exact":
            return entry in names
        if kind == "substring":
            return any(entry in n for n in names)
        assert rx is not None
        find = rx.fullmatch if kind == "regex" and self.regex == "fullmatch" else rx.match
        return any(find(n) for n in names)

    def __bool__(self) -> bool:
        return bool(self.entries)

    # -- checking against a checkpoint ------------------------------------------------------

    def problems(self, tensor_names: Iterable[str], quantized_suffixes: Iterable[str] = (),
                 kind: str = "exclusion", modules: frozenset[str] | None = None) -> list[Problem]:
        """Check the list against a checkpoint's tensor names, headers only.

        * an exact or substring entry that names no module (under any spelling, with or without
          the prefix): an error, with the closest module name as a did-you-mean;
        * a ``re:`` / wildcard entry that matches no module: a warning (vendor lists
          carry generic patterns such as ``*router*``);
        * a tensor ending in one of ``quantized_suffixes`` (``weight_scale``, ``qweight``...)
          stored under an excluded module: an error naming the entry and the tensor (the module
          would load as float while the checkpoint says it was quantized).
        """
        names = tensor_names if isinstance(tensor_names, Mapping | list | tuple) else list(tensor_names)
        if modules is None:
            modules = modules_of(names)
        known: tuple[str, ...] | None = None  # every name of every module: built only for inexact entries
        out: list[Problem] = []
        for compiled in self._compiled:
            entry, how, _ = compiled
            if how == "exact":
                if not self._names_a_module(entry, modules):
                    out.append(Problem(f"{self.source} entry {entry!r} matches no module of this checkpoint"
                                       f"{self._did_you_mean(entry, modules)}", layer=entry, kind=kind))
                continue
            if known is None:
                # the names of a module are its spellings and theirs parents, which are modules
                # (or the spellings of modules) themselves: the union needs no parents
                known = tuple({s for m in modules for b in self._bases(m) for s in self._spellings(b)})
            if how == "substring":  # a name, read as engines read it: still a name that must name something
                if not any(entry in n for n in known):
                    out.append(Problem(f"{self.source} entry {entry!r} is part of no module name of this checkpoint"
                                       f"{self._did_you_mean(entry, modules)}", layer=entry, kind=kind))
            elif not self._hit(compiled, known):
                out.append(Problem(f"{self.source} entry {entry!r} matches no module of this checkpoint",
                                   layer=entry, severity="warning", kind=kind))
        suffixes = tuple(f".{s}" for s in quantized_suffixes)
        stored: dict[str, list[str]] = {}
        for t in names if suffixes else ():
            if t.endswith(suffixes):
                stored.setdefault(t.rpartition(".")[0], []).append(t)
        hits = self._excluded_many(stored) if stored and self._compiled else {}
        for module, found in stored.items():
            hit = hits.get(module)
            if hit is not None:
                out.append(Problem(f"{self.source} entry {hit!r} excludes {module} from quantization, but the "
                                   f"checkpoint stores {', '.join(sorted(found))} for it (quantized data under an "
                                   "excluded module: the list or the export is wrong)", tensor=sorted(found)[0],
                                   layer=module, kind=kind))
        return out

    def _names_a_module(self, entry: str, modules: frozenset[str]) -> bool:
        """Whether exact ``entry`` is a name of some module (:meth:`names_of`), by lookups: a
        module, a module relative to the prefix, or an other-engine spelling of one."""
        p = f"{self.prefix}." if self.prefix else ""
        if entry in modules or (p and p + entry in modules):
            return True
        parent, _, last = entry.rpartition(".")
        for shard in ALIASES.get(last, ()):
            target = f"{parent}.{shard}" if parent else shard
            if last in EXPERT_ALIASES and ".experts." not in f".{target}":
                continue
            if target in modules or (p and p + target in modules):
                return True
        return False

    def _did_you_mean(self, entry: str, modules: frozenset[str]) -> str:
        p = f"{self.prefix}." if self.prefix else ""
        if p and not entry.startswith(p) and f"{p}{entry}" in modules:
            return f"; did you mean {p}{entry!r}?"
        head, _, rest = entry.partition(".")
        if rest and rest in modules:
            return f"; did you mean {rest!r}? (this checkpoint names no module {head!r})"
        last = entry.rsplit(".", 1)[-1]
        pool = sorted(m for m in modules if m.rsplit(".", 1)[-1] == last) or sorted(modules)
        close = difflib.get_close_matches(entry, pool, n=1, cutoff=0.6)
        return f"; did you mean {close[0]!r}?" if close else ""
