"""Architectures quantplug can build: config.json ``architectures[0]`` -> model spec.

An architecture is registered through the ``quantplug.architectures`` entry-point group: the
entry point's name is the ``architectures[0]`` it builds, its value an :class:`ArchSpec`. The
core's own (DeepSeek-V3, DeepSeek-V3.2, DeepSeek-V4, Kimi-K2.5 / K2.6, Kimi-Linear, the released Kimi-K3)
register there from quantplug's own ``pyproject.toml``, exactly as a third party's distribution
does::

    [project.entry-points."quantplug.architectures"]
    DeepseekV2ForCausalLM = "acme_arch:DEEPSEEK_V2"

A backend plugin can still add an architecture beside its format through the
``quantplug_architectures`` hook (contract 1.1); both kinds are checked for clashes.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..contract.arch import (
    ENTRY_POINT_GROUP,
    ArchSpec,
    ConfigParser,
    Registered,
    check_plugin_architectures,
    registered,
)
from ..errors import UnknownArchitectureError
from ..types import SkipRule
from . import deepseek, deepseek_v4, deepseek_v4_config, kimi

__all__ = [
    "ARCHITECTURES", "DEEPSEEK_V3", "DEEPSEEK_V4", "DEEPSEEK_V32", "ENTRY_POINT_GROUP", "KIMI_K25", "KIMI_K3", "KIMI_LINEAR",
    "ArchSpec", "ConfigParser", "Registered", "check_plugin_architectures", "get_arch", "registered",
]

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

_MTP = (SkipRule("mtp-copies", r"^mtp\.\d+\.(emb|head)\.", "copies of the embedding / head in DeepSeek-V4's MTP "
                 "block: the main model's embed and head serve it (DeepSeek's convert.py drops them too)"),
        SkipRule("mtp", r"^mtp\.\d+\.", "DeepSeek-V4's multi-token-prediction block: not loaded (load option "
                 "mtp=false, or num_nextn_predict_layers = 0: see the mtp_layers decision)"),)
DEEPSEEK_V4 = ArchSpec("DeepseekV4ForCausalLM", deepseek_v4.DeepseekV4ForCausalLM, False, _TEXT_SKIPS + _MTP,
                       deepseek_v4_config.parse_deepseek_v4_config)

#: the core's own architectures by name (what quantplug's ``pyproject.toml`` registers)
ARCHITECTURES: dict[str, ArchSpec] = {s.name: s for s in (DEEPSEEK_V3, DEEPSEEK_V32, DEEPSEEK_V4, KIMI_K25, KIMI_LINEAR,
                                                         KIMI_K3)}


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
