"""Architectures quantplug can build: config.json ``architectures[0]`` -> model spec.

An architecture is registered through the ``quantplug.architectures`` entry-point group: the
entry point's name is the ``architectures[0]`` it builds, its value an :class:`ArchSpec`. The
core's own (DeepSeek-V3, DeepSeek-V3.2, Kimi-K2.5 / K2.6, Kimi-Linear, the released Kimi-K3)
register there from quantplug's own ``pyproject.toml``, exactly as a third party's distribution
does::

    [project.entry-points."quantplug.architectures"]
    DeepseekV2ForCausalLM = "acme_arch:DEEPSEEK_V2"

A backend plugin can still add an architecture beside its format through the
``quantplug_architectures`` hook (contract 1.1); both kinds are checked for clashes.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import QuantplugError, UnknownArchitectureError
from ..types import SkipRule
from . import deepseek, kimi
from .config import ModelConfig, parse_model_config

log = logging.getLogger("quantplug")

#: the entry-point group architectures register in
ENTRY_POINT_GROUP = "quantplug.architectures"

#: ``config(config_json, architecture, wrapped, file)`` -> the model config the skeleton is built from
ConfigParser = Callable[[dict[str, Any], str, bool, str], ModelConfig]


@dataclass(frozen=True)
class ArchSpec:
    """A buildable architecture: ``cls(model_config, oracle)`` builds the skeleton (see
    :class:`~quantplug.models.deepseek.PlanOracle`); ``wrapped``: text config under
    ``text_config`` and text weights under ``language_model.``; ``skip_rules``: checkpoint
    tensors left out on purpose (listed in the plan); ``config``: the architecture's config
    schema, a parser from config.json to the model config (default: the core's DeepSeek-V3
    parser, :func:`quantplug.api.parse_model_config`); it raises ``ConfigError`` naming
    the file and key of anything it refuses."""

    name: str
    cls: type[nn.Module]
    wrapped: bool  # text config under text_config, text weights under language_model.
    skip_rules: tuple[SkipRule, ...]
    config: ConfigParser | None = None

    def parse_config(self, config: dict[str, Any], file: str = "config.json") -> ModelConfig:
        """The model config of ``config`` (config.json's content) under this architecture's schema."""
        parse = self.config or parse_model_config
        return parse(config, self.name, self.wrapped, file)


_TEXT_SKIPS = (
    SkipRule("rotary-cache", r"(^|\.)rotary_emb\.inv_freq$", "rotary frequencies are recomputed from config"),
)
_VISION = (
    SkipRule("vision", r"^(vision_tower|mm_projector|multi_modal_projector)\.",
             "vision weights: quantplug loads the text model only"),
)

#: the core's own architectures (registered through quantplug's entry points, below)
DEEPSEEK_V3 = ArchSpec("DeepseekV3ForCausalLM", deepseek.DeepseekV3ForCausalLM, False, _TEXT_SKIPS)
DEEPSEEK_V32 = ArchSpec("DeepseekV32ForCausalLM", deepseek.DeepseekV32ForCausalLM, False, _TEXT_SKIPS)
KIMI_K25 = ArchSpec("KimiK25ForConditionalGeneration", deepseek.KimiK25ForConditionalGeneration, True,
                    _TEXT_SKIPS + _VISION)
KIMI_LINEAR = ArchSpec("KimiLinearForCausalLM", kimi.KimiLinearForCausalLM, False, _TEXT_SKIPS, kimi.parse_kimi_config)
KIMI_K3 = ArchSpec("KimiK3ForConditionalGeneration", kimi.KimiK3ForConditionalGeneration, True,
                   _TEXT_SKIPS + _VISION, kimi.parse_kimi_config)

#: the core's own architectures by name (what quantplug's ``pyproject.toml`` registers)
ARCHITECTURES: dict[str, ArchSpec] = {s.name: s for s in (DEEPSEEK_V3, DEEPSEEK_V32, KIMI_K25, KIMI_LINEAR, KIMI_K3)}


@dataclass(frozen=True)
class Registered:
    """What the ``quantplug.architectures`` entry points gave: ``specs`` by name, the
    distribution of each (``owners``), and the entries that could not be used (``failures``:
    name -> why, naming the distribution and the entry point's value)."""

    specs: Mapping[str, ArchSpec]
    owners: Mapping[str, str]
    failures: Mapping[str, str]


def _dist_name(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.metadata['Name']} {dist.version}" if dist is not None else "an unknown distribution"


@functools.lru_cache(maxsize=1)
def registered() -> Registered:
    """Every architecture of the ``quantplug.architectures`` entry-point group, loaded once per
    process (``registered.cache_clear()`` reads the group again). An entry point that does not
    import, is not an :class:`ArchSpec`, names another architecture than its ``name``, or repeats
    a name another distribution registered, is left out and recorded in ``failures`` (logged; a
    plan for that architecture raises its message)."""
    specs: dict[str, ArchSpec] = {}
    owners: dict[str, str] = {}
    failures: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = _dist_name(ep)
        if (ep.name, ep.value) in seen:  # one distribution found twice on sys.path (an editable install)
            continue
        seen.add((ep.name, ep.value))
        where = f"architecture entry point {ep.name!r} = {ep.value!r} of {dist}"
        if ep.name in specs:
            failures[ep.name] = f"{where}: {ep.name!r} is already registered by {owners[ep.name]}"
            specs.pop(ep.name)
            continue
        try:
            obj = ep.load()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 (a third party's import failure is reported, not fatal)
            failures[ep.name] = f"{where}: import failed: {type(exc).__name__}: {exc}"
            continue
        if not isinstance(obj, ArchSpec):
            failures[ep.name] = f"{where}: is a {type(obj).__name__}, expected a quantplug.api.ArchSpec"
        elif obj.name != ep.name:
            failures[ep.name] = f"{where}: is ArchSpec {obj.name!r}; an entry point's name must be its architecture"
        else:
            specs[ep.name], owners[ep.name] = obj, dist
    for why in failures.values():
        log.warning("quantplug: %s", why)
    return Registered(specs, owners, failures)


def get_arch(config: dict, extra: Mapping[str, ArchSpec] | None = None) -> ArchSpec:
    """The spec for config.json's ``architectures[0]``: a registered one (entry points), or one
    a plugin added through ``quantplug_architectures`` (``extra``)."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise UnknownArchitectureError("config.json: 'architectures' must be a non-empty list of strings")
    reg = registered()
    known = {**reg.specs, **(extra or {})}
    spec = known.get(archs[0])
    if spec is not None:
        return spec
    if archs[0] in reg.failures:
        raise UnknownArchitectureError(f"config.json architecture {archs[0]!r}: {reg.failures[archs[0]]}")
    hint = ""
    if not any(name in reg.specs for name in ARCHITECTURES):
        hint = (f" (quantplug's own architectures are not registered in the {ENTRY_POINT_GROUP!r} entry-point "
                "group: its installed metadata is stale; reinstall it, e.g. pip install -e .)")
    raise UnknownArchitectureError(f"config.json architecture {archs[0]!r} is not supported; "
                                   f"supported: {', '.join(sorted(known)) or 'none'}{hint}")


def check_plugin_architectures(answers: list[tuple[Mapping[str, Any], Any]]) -> dict[str, ArchSpec]:
    """The architectures backend plugins add (``quantplug_architectures`` answers with the plugin
    that gave each), checked: each key is its spec's name, and no name is registered twice."""
    reg = registered()
    out: dict[str, ArchSpec] = {}
    owner: dict[str, Any] = {}
    for answer, info in answers:
        for name, spec in answer.items():
            if spec.name != name:
                raise QuantplugError(f"plugin {info}: quantplug_architectures[{name!r}] is ArchSpec "
                                     f"{spec.name!r}; its name must be its key")
            if name in reg.specs or name in out:
                other = (f"{reg.owners[name]} (entry point {ENTRY_POINT_GROUP})" if name in reg.specs
                         else f"plugin {owner[name]}")
                raise QuantplugError(f"plugin {info} adds architecture {name!r}, which {other} already defines")
            out[name], owner[name] = spec, info
    return out
