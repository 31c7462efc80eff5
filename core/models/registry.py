"""Architectures quantplug can build: config.json ``architectures[0]`` -> model spec."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..errors import UnknownArchitectureError
from ..types import SkipRule
from . import deepseek


@dataclass(frozen=True)
class ArchSpec:
    """A buildable architecture: ``cls(model_config, oracle)`` builds the skeleton (see
    :class:`~quantplug.models.deepseek.PlanOracle`); ``wrapped``: text config under
    ``text_config`` and text weights under ``language_model.``; ``skip_rules``: checkpoint
    tensors left out on purpose (listed in the plan)."""

    name: str
    cls: type[nn.Module]
    wrapped: bool  # text config under text_config, text weights under language_model.
    skip_rules: tuple[SkipRule, ...]


_TEXT_SKIPS = (
    SkipRule("rotary-cache", r"(^|\.)rotary_emb\.inv_freq$", "rotary frequencies are recomputed from config"),
)
_VISION = (
    SkipRule("vision", r"^(vision_tower|mm_projector|multi_modal_projector)\.",
             "vision weights: quantplug loads the text model only"),
)

ARCHITECTURES: dict[str, ArchSpec] = {
    "DeepseekV3ForCausalLM": ArchSpec("DeepseekV3ForCausalLM", deepseek.DeepseekV3ForCausalLM, False, _TEXT_SKIPS),
    "DeepseekV32ForCausalLM": ArchSpec("DeepseekV32ForCausalLM", deepseek.DeepseekV32ForCausalLM, False, _TEXT_SKIPS),
    "KimiK25ForConditionalGeneration": ArchSpec(
        "KimiK25ForConditionalGeneration", deepseek.KimiK25ForConditionalGeneration, True, _TEXT_SKIPS + _VISION),
    "KimiK3ForConditionalGeneration": ArchSpec(
        "KimiK3ForConditionalGeneration", deepseek.KimiK3ForConditionalGeneration, True, _TEXT_SKIPS + _VISION),
}


def get_arch(config: dict, extra: Mapping[str, ArchSpec] | None = None) -> ArchSpec:
    """The spec for config.json's ``architectures[0]``: the core's own, or one a plugin added
    through ``quantplug_architectures`` (``extra``)."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise UnknownArchitectureError("config.json: 'architectures' must be a non-empty list of strings")
    known = {**ARCHITECTURES, **(extra or {})}
    spec = known.get(archs[0])
    if spec is None:
        raise UnknownArchitectureError(f"config.json architecture {archs[0]!r} is not supported; "
                                       f"supported: {', '.join(known)}")
    return spec
