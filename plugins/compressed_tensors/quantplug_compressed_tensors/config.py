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
from dataclasses import dataclass
from typing import Any

from quantplug.api import ConfigError

#: class names quantplug maps onto its layers: every linear and routed-expert projection is an
#: ``nn.Linear`` in the Hugging Face model (the router and the embedding are not)
LINEAR_CLASSES = ("Linear", "LinearBase")
#: formats whose weights this plugin decodes
FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")


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
    def parse(cls, obj: Any, where: str) -> QuantArgs | None:
        if obj is None:
            return None
        if not isinstance(obj, dict):
            raise ConfigError(f"quantization_config.{where}: expected an object, got {type(obj).__name__}")
        try:
            bits = int(obj.get("num_bits", 8))
            gs = obj.get("group_size")
            block = obj.get("block_structure")
            if isinstance(block, str):  # older configs: "128x128"
                block = [int(v) for v in block.lower().split("x")]
            strategy = obj.get("strategy")
            if strategy is None:  # compressed-tensors infers it: group_size -> group, else tensor
                strategy = "group" if gs else ("block" if block else "tensor")
            return cls(num_bits=bits, type=str(obj.get("type", "int")), symmetric=bool(obj.get("symmetric", True)),
                       strategy=str(strategy), group_size=int(gs) if gs is not None else None,
                       block_structure=(int(block[0]), int(block[1])) if block else None,
                       dynamic=obj.get("dynamic", False),
                       actorder=None if obj.get("actorder") in (None, False) else str(obj.get("actorder")),
                       raw=tuple(sorted((k, repr(v)) for k, v in obj.items())))
        except (TypeError, ValueError, IndexError) as exc:
            raise ConfigError(f"quantization_config.{where}: cannot read {obj!r} ({exc})") from None

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
    def parse(cls, qc: dict[str, Any], prefix: str, where: str) -> CTConfig:
        groups_raw = qc.get("config_groups") or {}
        ignore = qc.get("ignore") or []
        if not isinstance(groups_raw, dict) or not isinstance(ignore, list):
            raise ConfigError(f"{where}: config_groups must be an object and ignore a list")
        fmt = str(qc.get("format") or "dense")
        groups = []
        for name, g in groups_raw.items():
            if not isinstance(g, dict):
                raise ConfigError(f"{where}.config_groups.{name}: expected an object")
            targets = g.get("targets") or []
            if isinstance(targets, str):
                targets = [targets]
            base = f"config_groups.{name}"
            groups.append(Group(name, tuple(str(t) for t in targets),
                                QuantArgs.parse(g.get("weights"), f"{base}.weights"),
                                QuantArgs.parse(g.get("input_activations"), f"{base}.input_activations"),
                                QuantArgs.parse(g.get("output_activations"), f"{base}.output_activations"),
                                str(g.get("format") or fmt)))
        sparsity = qc.get("sparsity_config") or None
        sparse_fmt = None
        if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
            sparse_fmt = str(sparsity.get("format")) + (
                f" {sparsity.get('sparsity_structure')}" if sparsity.get("sparsity_structure") else "")
        return cls(groups=tuple(groups), ignore=tuple(str(x) for x in ignore), format=fmt,
                   status=str(qc.get("quantization_status") or "compressed"), prefix=prefix,
                   kv_cache_scheme=qc.get("kv_cache_scheme") is not None,
                   transforms=bool(qc.get("transform_config")), sparsity=sparse_fmt,
                   version=qc.get("version"), where=where)

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

    def ignored_by(self, module: str) -> str | None:
        names = self.names_of(module)
        for entry, rx in self._compiled[0]:
            if entry in LINEAR_CLASSES or (rx.match(names[-1]) or rx.match(names[0]) if rx else entry in names):
                return entry
        return None

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
