"""The model configuration (:class:`ModelConfig`, :class:`RopeConfig`, :func:`parse_model_config`)
lives in :mod:`quantplug.contract.config` (what architectures and hooks are written against);
re-exported here."""

from ..contract.config import (
    DSA_ARCHITECTURES,
    DSA_MODEL_TYPES,
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_RANK,
    MAX_THETA,
    MAX_TOPK,
    MAX_VOCAB,
    ModelConfig,
    RopeConfig,
    check_against_tensors,
    parse_model_config,
)

__all__ = [
    "DSA_ARCHITECTURES", "DSA_MODEL_TYPES", "MAX_EXPERTS", "MAX_HEADS", "MAX_HEAD_DIM", "MAX_HIDDEN",
    "MAX_INTERMEDIATE", "MAX_LAYERS", "MAX_POSITIONS", "MAX_RANK", "MAX_THETA", "MAX_TOPK", "MAX_VOCAB",
    "ModelConfig", "RopeConfig", "check_against_tensors", "parse_model_config",
]
