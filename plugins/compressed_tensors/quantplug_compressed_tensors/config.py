"""compressed-tensors' ``quantization_config``, parsed once into frozen values.

Matching (compressed-tensors ``utils/match.py``): a target or ignore entry is ``re:<regex>``
(``re.match`` on the module name: anchored at the start only), an exact module name, or a module
class name ("Linear"). When several targets of the config groups match a module, exact names
win over regexes, regexes over class names (``match_targets`` order; ties by the entry's text).

quantplug matches every entry against the checkpoint name of a module *and* its name relative
to the resolved prefix (``language_model.`` in Kimi wrappers): the tool stores the list verbatim,
and the Kimi-K2.5 release's exact ``"lm_head"`` means ``language_model.lm_head``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from quantplug.api import Fields

#: class names quantplug maps onto its layers: every linear and routed-expert projection is an
#: ``nn.Linear`` in the Hugging Face model (the router and the embedding are not)
LINEAR_CLASSES = ("Linear", "LinearBase")
#: formats whose weights this plugin decodes
FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")
_BLOCK_TEXT = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")


@dataclass(frozen=True)
class QuantArgs:
    """One ``QuantizationArgs`` object (weights, input_activations or output_activations)."""

    num_bits: int
    type: str  # "int" | "float"
    symmetric: bool
    strategy: str  # tensor | channel | group | block | token | tensor_group | attn_head
    group_size: int | None
    block_structure: tuple[int, int] | None
    dynamic: Any  # True | False | "local"
    actorder: str | None
    raw: tuple[tuple[str, Any], ...]

    @classmethod
    def parse(cls, obj: Fields | dict[str, Any] | None, where: str = "") -> QuantArgs | None:
        """Read one QuantizationArgs object, every field typed (compressed-tensors' own defaults
        for absent ones: 8 bits, int, symmetric, strategy from group_size / block_structure)."""
        if obj is None:
            return None
        f = obj if isinstance(obj, Fields) else Fields(obj, "config.json", f"quantization_config.{where}")
        bits = f.get_int("num_bits", 1, 64, 8)
        gs = f.opt_int("group_size", -1, 1 << 24)
        if gs == 0:
            f.fail("group_size", gs, "a positive group size, -1 (per channel) or null")
        block: tuple[int, ...] | None
        text = f.raw("block_structure")
        if isinstance(text, str):  # older configs: "128x128"
            m = _BLOCK_TEXT.match(text)
            sizes = tuple(int(v) for v in m.groups()) if m is not None else ()
            f.expect(len(sizes) == 2 and all(v > 0 for v in sizes), "block_structure",
                     "[rows, columns] or 'RxC' with positive sizes")
            block = sizes
        else:
            block = f.int_list("block_structure", 1, 1 << 16, length=2)
        strategy = f.opt_str("strategy")
        if strategy is None:  # compressed-tensors infers it: group_size -> group (-1: channel), block, else tensor
            strategy = "channel" if gs == -1 else "group" if gs else "block" if block else "tensor"
        elif gs == -1 and strategy != "channel":
            f.fail("group_size", gs, f"a positive group size for strategy {strategy!r} (-1 means per channel)")
        dynamic = f.raw("dynamic", False)
        f.expect(dynamic in (True, False, "local") and type(dynamic) in (bool, str), "dynamic", "true, false or 'local'")
        act = f.raw("actorder")
        f.expect(act is None or type(act) in (bool, str), "actorder", "a string, a boolean or null")
        return cls(num_bits=bits, type=f.get_str("type", "int", choices=("int", "float")),
                   symmetric=f.get_bool("symmetric", True), strategy=strategy,
                   group_size=gs if gs and gs > 0 else None, block_structure=(block[0], block[1]) if block else None,
                   dynamic=dynamic, actorder=None if act in (None, False) else "group" if act is True else str(act),
                   raw=tuple(sorted((k, repr(v)) for k, v in f.data.items())))

    def describe(self) -> str:
        kind = f"{self.type}{self.num_bits}" if self.type == "int" else f"fp{self.num_bits}"
        if self.type == "float" and self.num_bits == 8:
            kind = "fp8 e4m3"
        if self.strategy == "group":
            how = f"group {self.group_size}"
        elif self.strategy == "block" and self.block_structure:
            how = f"block {self.block_structure[0]}x{self.block_structure[1]}"
        else:
            how = f"per-{self.strategy}"
        sym = "" if self.symmetric else ", zero point"
        return f"{kind} {how}{sym}"


@dataclass(frozen=True)
class Group:
    """One entry of ``config_groups``."""

    name: str
    targets: tuple[str, ...]
    weights: QuantArgs | None
    input_activations: QuantArgs | None
    output_activations: QuantArgs | None
    format: str


@dataclass(frozen=True)
class CTConfig:
    """The parsed config, plus the prefix under which the checkpoint names the text model."""

    groups: tuple[Group, ...]
    ignore: tuple[str, ...]
    format: str
    status: str
    prefix: str
    kv_cache_scheme: bool
    transforms: bool
    sparsity: str | None
    version: str | None
    where: str  # "quantization_config" or "text_config.quantization_config"

    @classmethod
    def parse(cls, qc: Fields, prefix: str, where: str) -> CTConfig:
        fmt = qc.opt_str("format") or "dense"
        groups = []
        for name, g in qc.entries("config_groups"):
            assert g is not None
            targets = g.str_list("targets", single=True)
            for i, t in enumerate(targets):
                if t.startswith("re:"):
                    g.regex(f"targets[{i}]", t[3:])
            groups.append(Group(name, targets, QuantArgs.parse(g.get_obj("weights")),
                                QuantArgs.parse(g.get_obj("input_activations")),
                                QuantArgs.parse(g.get_obj("output_activations")),
                                g.opt_str("format") or fmt))
        ignore = qc.str_list("ignore")
        for i, e in enumerate(ignore):
            if e.startswith("re:"):
                qc.regex(f"ignore[{i}]", e[3:])
        sparsity = qc.get_obj("sparsity_config")
        sparse_fmt = None
        if sparsity is not None and sparsity.opt_str("format") not in (None, "dense"):
            structure = sparsity.opt_str("sparsity_structure")
            sparse_fmt = str(sparsity.opt_str("format")) + (f" {structure}" if structure else "")
        return cls(groups=tuple(groups), ignore=ignore, format=fmt,
                   status=qc.opt_str("quantization_status") or "compressed", prefix=prefix,
                   kv_cache_scheme=qc.get_obj("kv_cache_scheme") is not None,
                   transforms=bool(transform.data) if (transform := qc.get_obj("transform_config")) else False,
                   sparsity=sparse_fmt, version=qc.opt_str("version"), where=where)

    # -- matching -------------------------------------------------------------------------------

    def names_of(self, module: str) -> tuple[str, ...]:
        """The names an entry is matched against: the checkpoint name, and the name relative to
        the prefix when the module lies under it."""
        p = f"{self.prefix}." if self.prefix else ""
        if p and module.startswith(p):
            return (module, module[len(p):])
        return (module,)

    @functools.cached_property
    def _compiled(self) -> tuple[list[tuple[str, re.Pattern[str] | None]], list[tuple[str, re.Pattern[str], Group]]]:
        """Compiled ``re:`` entries (a Kimi-size plan matches ~70,000 expert modules)."""
        ignore = [(e, re.compile(e[3:]) if e.startswith("re:") else None) for e in self.ignore]
        regex = sorted(((t, re.compile(t[3:]), g) for g in self.groups for t in g.targets if t.startswith("re:")),
                       key=lambda x: x[0])
        return ignore, regex

    @functools.cached_property
    def _ignore_index(self) -> tuple[dict[str, int], list[tuple[int, str, re.Pattern[str] | None]]]:
        """Exact ignore names -> their first position; (position, entry, regex) of the others (class
        names, ``re:`` entries) in list order. llm-compressor lists every unquantized linear by
        name (Kimi-K3: 1,347 names), which one dict lookup per name answers."""
        exact: dict[str, int] = {}
        others = []
        for i, (entry, rx) in enumerate(self._compiled[0]):
            if rx is None and entry not in LINEAR_CLASSES:
                exact.setdefault(entry, i)
            else:
                others.append((i, entry, rx))
        return exact, others

    def ignored_by(self, module: str) -> str | None:
        """The first ignore entry (in list order) that matches ``module``, or None."""
        names = self.names_of(module)
        exact, others = self._ignore_index
        best = min((exact[n] for n in names if n in exact), default=len(self.ignore))
        for i, entry, rx in others:
            if i > best:
                break
            if rx is None or rx.match(names[-1]) or rx.match(names[0]):  # rx None: a class name, every linear
                return entry
        return self.ignore[best] if best < len(self.ignore) else None

    @functools.cached_property
    def _by_name(self) -> frozenset[str] | None:
        """Module names (as stored: prefixed and not) that an exact ignore entry or an exact target
        names, when no entry is a regex and no ignore entry a class name (then every other linear
        gets one answer, :meth:`groups_for`); None otherwise."""
        if any(rx is not None or e in LINEAR_CLASSES for e, rx in self._compiled[0]) or self._compiled[1]:
            return None
        names = set(self._ignore_index[0]) | {t for g in self.groups for t in g.targets if t not in LINEAR_CLASSES}
        p = f"{self.prefix}." if self.prefix else ""
        return frozenset(names | {p + n for n in names} if p else names)

    def groups_for(self, modules: Sequence[str]) -> list[tuple[Group | None, str]]:
        """:meth:`group_for` of each module. Without regexes (and class names in ``ignore``), a
        module that no entry names gets the class targets' answer, computed once: the routed
        experts of a Kimi-K3 plan (247,296 modules) take set lookups, not a match each."""
        named = self._by_name
        if named is None or len(modules) < 2:
            return [self.group_for(m) for m in modules]
        hit = named.intersection(modules)
        if not hit:
            return [self._class_answer] * len(modules)
        return [self.group_for(m) if m in hit else self._class_answer for m in modules]

    @functools.cached_property
    def _class_answer(self) -> tuple[Group | None, str]:
        """:meth:`group_for` of a module that no exact entry names (regex-free configs)."""
        found = sorted((t, g.name) for g in self.groups for t in g.targets if t in LINEAR_CLASSES)
        if found:
            t, name = found[0]
            g = next(g for g in self.groups if g.name == name)
            return g, f"config_groups.{g.name} targets {t!r}"
        return None, "no config group targets it"

    def group_for(self, module: str) -> tuple[Group | None, str]:
        """The config group quantizing linear ``module`` and why (None: not targeted or ignored)."""
        hit = self.ignored_by(module)
        if hit is not None:
            return None, f"ignore entry {hit!r}"
        names = self.names_of(module)
        exact = sorted((t, g.name) for g in self.groups for t in g.targets if not t.startswith("re:") and t in names)
        if not exact:
            for t, rx, g in self._compiled[1]:
                if any(rx.match(n) for n in names):
                    return g, f"config_groups.{g.name} targets {t!r}"
        found = exact or sorted((t, g.name) for g in self.groups for t in g.targets if t in LINEAR_CLASSES)
        if found:
            t, name = found[0]
            g = next(g for g in self.groups if g.name == name)
            return g, f"config_groups.{g.name} targets {t!r}"
        return None, "no config group targets it"


def match_name(name: str, entry: str) -> bool:
    """compressed-tensors' ``match_name``: ``re:`` entries ``re.match`` (start-anchored), others equal."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name


def is_class_name(entry: str) -> bool:
    """An entry that names a module class rather than a module ("Linear", "MoEGate")."""
    return not entry.startswith("re:") and "." not in entry and entry[:1].isupper()
