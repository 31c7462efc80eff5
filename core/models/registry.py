"""Architectures quantplug can build: config.json ``architectures[0]`` -> model spec."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import UnknownArchitectureError
from ..types import SkipRule
from . import deepseek


@dataclass(frozen=True)
class ArchSpec:
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
    "KimiK25ForConditionalGeneration": ArchSpec(
        "KimiK25ForConditionalGeneration", deepseek.KimiK25ForConditionalGeneration, True, _TEXT_SKIPS + _VISION),
    "KimiK3ForConditionalGeneration": ArchSpec(
        "KimiK3ForConditionalGeneration", deepseek.KimiK3ForConditionalGeneration, True, _TEXT_SKIPS + _VISION),
}


def get_arch(config: dict) -> ArchSpec:
    archs = config.get("architectures") or []
    if not archs:
        raise UnknownArchitectureError("config.json has no 'architectures' entry")
    spec = ARCHITECTURES.get(archs[0])
    if spec is None:
        raise UnknownArchitectureError(f"config.json architecture {archs[0]!r} is not supported; "
                                       f"supported: {', '.join(ARCHITECTURES)}")
    return spec
