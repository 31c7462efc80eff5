"""DeepSeek-V4's config schema (``model_type: deepseek_v4``; DeepSeek-V4's inference code ModelArgs, transformers 5.25 DeepseekV4Config): the release
``config.json`` checked field by field (every refusal a :class:`~quantplug.errors.ConfigError`
naming the file and the key), read into :class:`DeepseekV4Config`.

The core's :class:`ModelConfig` fields are filled from the V4 keys (the MoE fields as they are;
MLA's ``kv_lora_rank`` / ``v_head_dim`` / ``qk_nope_head_dim`` from ``head_dim``, which V4's
attention does not use), and the V4 fields beside them: per-layer attention configs
(:class:`~quantplug.blocks.v4_attention.V4AttentionConfig`, ``compress_ratios[L]`` the ratio
itself, E10), ``num_hash_layers``, ``swiglu_limit`` and the mHC fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..blocks.v4_attention import V4AttentionConfig
from ..contract.config import (
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_RANK,
    MAX_TOPK,
    ModelConfig,
    RopeConfig,
    parse_model_config,
)
from ..validation import Fields

#: keys the core's DeepSeek-V3 parser would refuse or misread; V4 checks them here
_OWN = ("scoring_func", "hidden_act", "rope_scaling", "rope_parameters", "topk_method", "compress_ratios",
        "num_nextn_predict_layers", "max_position_embeddings")


@dataclass(frozen=True, eq=False)
class DeepseekV4Config(ModelConfig):
    """:class:`ModelConfig` plus DeepSeek-V4's fields (E1)."""

    #: mHC: streams, Sinkhorn iterations, epsilon
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    #: layers < num_hash_layers route by ``gate.tid2eid``
    num_hash_layers: int = 0
    #: the clamp of the experts' SwiGLU (routed and shared)
    swiglu_limit: float = 10.0
    #: the attention config of each decoder layer
    attention: tuple[V4AttentionConfig, ...] = ()
    #: MTP blocks the config declares (``num_nextn_predict_layers``: ``mtp.N.*``)
    mtp_blocks: int = 0

    __hash__ = ModelConfig.__hash__


def _ratios(f: Fields, layers: int) -> list[int]:
    value = f.data.get("compress_ratios")
    f.has("compress_ratios")
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        f.fail("compress_ratios", value, "a list of integers, one compression ratio per layer (0: sliding window "
                                         "only, 4: CSA, other: HCA)")
    if len(value) < layers:
        f.fail("compress_ratios", value, f"at least num_hidden_layers ({layers}) entries")
    bad = [v for v in value if v < 0 or v == 1 or v > 1 << 16]
    if bad:
        f.fail("compress_ratios", bad[0], "ratios 0 (sliding window only) or 2 .. 65536")
    return list(value[:layers])


def parse_deepseek_v4_config(config: dict[str, Any], architecture: str, wrapped: bool,
                             file: str = "config.json") -> DeepseekV4Config:
    """The V4 schema of ``config`` (see the module docstring)."""
    f = Fields(config, file)
    f.get_str("scoring_func", "sqrtsoftplus", choices=("sqrtsoftplus",))
    f.get_str("topk_method", "noaux_tc", choices=("noaux_tc",))
    f.get_str("hidden_act", "silu", choices=("silu",))
    layers = f.get_int("num_hidden_layers", 1, MAX_LAYERS)
    hidden = f.get_int("hidden_size", 1, MAX_HIDDEN)
    heads = f.get_int("num_attention_heads", 1, MAX_HEADS)
    f.get_int("num_key_value_heads", 1, 1, 1)
    head_dim = f.get_int("head_dim", 2, MAX_HEAD_DIM, 512)
    rope_dim = f.get_int("qk_rope_head_dim", 2, head_dim, 64)
    if rope_dim % 2:
        f.fail("qk_rope_head_dim", rope_dim, "an even integer (rotary pairs)")
    f.get_int("q_lora_rank", 1, MAX_RANK)
    groups = f.get_int("o_groups", 1, heads)
    if heads % groups:
        f.fail("o_groups", groups, f"a divisor of num_attention_heads ({heads})")
    f.get_int("o_lora_rank", 1, MAX_RANK)
    f.get_int("sliding_window", 1, 1 << 20)
    ratios = _ratios(f, layers)
    if 4 in ratios:
        f.get_int("index_n_heads", 1, MAX_HEADS, 64)
        f.get_int("index_head_dim", rope_dim, MAX_HEAD_DIM, 128)
        f.get_int("index_topk", 1, MAX_TOPK, 512)
    f.get_float("compress_rope_theta", 1.0, 1e12, 160000.0)
    scaling = f.get_obj("rope_scaling")
    if scaling is not None:
        kind = scaling.get_str("type", scaling.data.get("rope_type") or "yarn", choices=("yarn",))
        if kind == "yarn":
            scaling.get_float("factor", 1.0, 1e6, 1.0)
    n_routed = f.get_int("n_routed_experts", 1, MAX_EXPERTS)
    f.get_int("num_experts_per_tok", 1, n_routed)
    f.get_int("n_group", 1, 1, 1)
    f.get_int("topk_group", 1, 1, 1)
    f.get_int("moe_intermediate_size", 1, MAX_INTERMEDIATE)
    hash_layers = f.get_int("num_hash_layers", 0, layers, 0)
    limit = f.get_float("swiglu_limit", 0.0, 1e6, 10.0, open_lo=True)
    hc_mult = f.get_int("hc_mult", 1, 64, 4)
    iters = f.get_int("hc_sinkhorn_iters", 1, 1000, 20)
    hc_eps = f.get_float("hc_eps", 0.0, 1.0, 1e-6)
    mtp = f.get_int("num_nextn_predict_layers", 0, MAX_LAYERS, 0)
    mpe = f.get_int("max_position_embeddings", 1, 1 << 24, 1 << 20)
    # the core fields from the V4 keys (MLA's dims from head_dim: unused by V4's attention)
    deepseek: dict[str, Any] = {k: v for k, v in f.data.items() if k not in _OWN}
    deepseek.update(kv_lora_rank=head_dim, qk_nope_head_dim=max(head_dim - rope_dim, 1), v_head_dim=head_dim,
                    intermediate_size=f.data["moe_intermediate_size"], n_group=1, topk_group=1)
    deepseek.setdefault("norm_topk_prob", True)
    base = parse_model_config(deepseek, architecture, False, file)
    attention = tuple(V4AttentionConfig.from_hf(f.data, i) for i in range(layers))
    cfg = DeepseekV4Config(**{fld.name: getattr(base, fld.name) for fld in dataclasses.fields(ModelConfig)},
                           hc_mult=hc_mult, hc_sinkhorn_iters=iters, hc_eps=hc_eps, num_hash_layers=hash_layers,
                           swiglu_limit=limit, attention=attention, mtp_blocks=mtp)
    return dataclasses.replace(cfg, model_type=f.get_str("model_type", "deepseek_v4"), hidden_size=hidden,
                               num_nextn_predict_layers=mtp,
                               rope=RopeConfig(f.get_float("rope_theta", 1.0, 1e12, 10000.0), "default"),
                               max_position_embeddings=mpe, raw=f.data)
