"""Normalised model configuration for DeepSeek-V3 and the Kimi family, from config.json.

Both rope spellings load: hub configs (``rope_theta`` + ``rope_scaling`` with ``type`` or
``rope_type``) and transformers >= 5 (``rope_parameters``). Kimi wrappers keep the text
model's config under ``text_config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    text_root: str  # module prefix of the text model inside the wrapper: "" or "language_model"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mla_use_output_gate: bool
    raw: Any  # the text config dict as read (not compared, not hashed)

    @property
    def is_wrapper(self) -> bool:
        return bool(self.text_root)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace

    def __hash__(self) -> int:
        return hash((self.architecture, self.hidden_size, self.num_hidden_layers))


def _rope(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        src = dict(params)
        theta = src.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        src = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", 10000.0)
    rtype = src.get("rope_type", src.get("type", "default")) or "default"
    if rtype not in ("default", "yarn"):
        raise ConfigError(f"rope type {rtype!r} is not supported (expected 'default' or 'yarn')")
    if rtype == "default":
        return RopeConfig(float(theta), "default")
    mpe = int(cfg.get("max_position_embeddings", 4096))
    orig = int(src.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or mpe)
    factor = src.get("factor")
    return RopeConfig(
        theta=float(theta), type="yarn",
        factor=float(factor) if factor is not None else mpe / orig,
        original_max_position_embeddings=orig,
        beta_fast=float(src.get("beta_fast") or 32), beta_slow=float(src.get("beta_slow") or 1),
        mscale=src.get("mscale"), mscale_all_dim=src.get("mscale_all_dim"),
        attention_factor=src.get("attention_factor"), truncate=bool(src.get("truncate", True)),
    )


def _get(cfg: dict[str, Any], key: str, default: Any = ConfigError) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ConfigError:
        raise ConfigError(f"config.json: text config has no {key!r}")
    return default


def parse_model_config(config: dict[str, Any], architecture: str, wrapped: bool) -> ModelConfig:
    text: Any = config
    root = ""
    if wrapped:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"config.json: {architecture} needs a 'text_config' object")
        root = "language_model"
    scoring = text.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"config.json: scoring_func {scoring!r} is not supported (DeepSeek-V3 routing is sigmoid)")
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported (expected 'silu')")
    heads = int(_get(text, "num_attention_heads"))
    tie = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    q_lora = text.get("q_lora_rank")
    n_routed = int(text.get("n_routed_experts") or text.get("num_local_experts") or 0)
    cfg = ModelConfig(
        architecture=architecture,
        model_type=str(config.get("model_type", "")),
        text_root=root,
        vocab_size=int(_get(text, "vocab_size")),
        hidden_size=int(_get(text, "hidden_size")),
        intermediate_size=int(_get(text, "intermediate_size")),
        moe_intermediate_size=int(_get(text, "moe_intermediate_size", 0)),
        num_hidden_layers=int(_get(text, "num_hidden_layers")),
        num_attention_heads=heads,
        q_lora_rank=int(q_lora) if q_lora is not None else None,
        kv_lora_rank=int(_get(text, "kv_lora_rank")),
        qk_nope_head_dim=int(_get(text, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_get(text, "qk_rope_head_dim")),
        v_head_dim=int(_get(text, "v_head_dim")),
        n_routed_experts=n_routed,
        num_experts_per_tok=int(_get(text, "num_experts_per_tok", 0)),
        n_shared_experts=int(_get(text, "n_shared_experts", 0)),
        n_group=int(_get(text, "n_group", 1)),
        topk_group=int(_get(text, "topk_group", 1)),
        norm_topk_prob=bool(_get(text, "norm_topk_prob", False)),
        routed_scaling_factor=float(_get(text, "routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(_get(text, "first_k_dense_replace", 0)),
        rms_norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
        rope=_rope(text),
        rope_interleave=bool(text.get("rope_interleave", True)),
        max_position_embeddings=int(_get(text, "max_position_embeddings", 4096)),
        tie_word_embeddings=tie,
        attention_bias=bool(text.get("attention_bias", False)),
        mla_use_output_gate=bool(text.get("mla_use_output_gate", False)),
        raw=text,
    )
    if n_routed and n_routed % cfg.n_group:
        raise ConfigError(f"config.json: n_routed_experts {n_routed} is not divisible by n_group {cfg.n_group}")
    if not math.isfinite(cfg.routed_scaling_factor):
        raise ConfigError("config.json: routed_scaling_factor is not finite")
    return cfg
