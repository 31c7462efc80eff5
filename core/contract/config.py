"""Normalised model configuration for DeepSeek-V3 and the Kimi family, from config.json.

Both rope spellings load: hub configs (``rope_theta`` + ``rope_scaling`` with ``type`` or
``rope_type``) and transformers >= 5 (``rope_parameters``). Kimi wrappers keep the text
model's config under ``text_config``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..validation import Fields


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
    #: multi-token-prediction layers stored after the decoder layers (DeepSeek-V3: 1); not loaded
    num_nextn_predict_layers: int = 0
    #: DeepSeek-V3.2 sparse attention (DSA): the lightning indexer's query heads H_I, head dim D_I
    #: (q and the one shared key), keys kept per query; all 0 for a model without an indexer
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    #: RoPE of the indexer's rope slice: False (half-split pairs, DeepSeek-V3.2 since the
    #: 2025-11-17 fix and transformers) or True (interleaved pairs, GLM-5)
    indexer_rope_interleave: bool = False

    @property
    def is_wrapper(self) -> bool:
        return bool(self.text_root)

    @property
    def has_indexer(self) -> bool:
        """Whether every attention layer carries DSA's lightning indexer (DeepSeek-V3.2)."""
        return self.index_topk > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace

    def __hash__(self) -> int:
        return hash((self.architecture, self.hidden_size, self.num_hidden_layers))


#: sane upper bounds (the largest released DeepSeek / Kimi models are well inside them)
MAX_VOCAB = 1 << 22
MAX_HIDDEN = 1 << 17
MAX_INTERMEDIATE = 1 << 20
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_RANK = 1 << 16
MAX_EXPERTS = 1 << 14
MAX_POSITIONS = 1 << 24
MAX_THETA = 1e12
MAX_TOPK = 1 << 24

#: architectures / model types whose attention layers carry DSA's lightning indexer
DSA_ARCHITECTURES = frozenset({"DeepseekV32ForCausalLM"})
DSA_MODEL_TYPES = frozenset({"deepseek_v32"})


def _rope(f: Fields, mpe: int) -> RopeConfig:
    # either spelling must be an object when present: a list / number / string is an error, never
    # "no rope scaling" (an empty rope_parameters object does mean the hub keys apply)
    params = f.get_obj("rope_parameters")
    scaling = f.get_obj("rope_scaling")
    if params is not None and params.data:
        src = params
        theta_src = src if src.has("rope_theta") else f
    else:
        src = scaling or Fields({}, f.file, f.sub("rope_scaling"))
        theta_src = f
    # > 1: the frequencies base ** (-2i/d) must decrease (yarn divides by log(theta))
    theta = theta_src.get_float("rope_theta", 1.0, MAX_THETA, 10000.0, open_lo=True)
    key = "rope_type" if src.has("rope_type") else "type"
    rtype = src.get_str(key, "default", choices=("default", "yarn")) if src.data.get(key) != "" else "default"
    if rtype == "default":
        return RopeConfig(theta, "default")
    orig_src = src if src.has("original_max_position_embeddings") else f
    orig = orig_src.get_int("original_max_position_embeddings", 1, MAX_POSITIONS, mpe)
    # yarn extends the context: factor >= 1 (transformers' own rule); betas are rotation counts
    # (32 and 1 in every release): tiny ones overflow yarn's correction range
    factor = src.get_float("factor", 1.0, 1e4, mpe / orig)
    beta_fast = src.get_float("beta_fast", 1e-3, 1e4, 32.0)
    beta_slow = src.get_float("beta_slow", 1e-3, 1e4, 1.0)
    return RopeConfig(
        theta=theta, type="yarn", factor=factor, original_max_position_embeddings=orig,
        beta_fast=beta_fast, beta_slow=beta_slow,
        mscale=src.opt_float("mscale", 0.0, 1e3), mscale_all_dim=src.opt_float("mscale_all_dim", 0.0, 1e3),
        attention_factor=src.opt_float("attention_factor", 0.0, 1e3, open_lo=True),
        truncate=src.get_bool("truncate", True),
    )


def parse_model_config(config: dict[str, Any], architecture: str, wrapped: bool,
                       file: str = "config.json") -> ModelConfig:
    """Typed, range-checked :class:`ModelConfig` from config.json; every failure is a
    :class:`ConfigError` naming ``file``, the key path and what was expected."""
    top = Fields(config, file)
    root = ""
    f = top
    if wrapped:
        text = top.get_obj("text_config")
        if text is None:
            raise ConfigError(f"{file}: {architecture} needs a 'text_config' object")
        f, root = text, "language_model"
    f.get_str("scoring_func", "sigmoid", choices=("sigmoid",))
    f.get_str("hidden_act", "silu", choices=("silu",))
    layers = f.get_int("num_hidden_layers", 1, MAX_LAYERS)
    n_routed = (f.get_int("n_routed_experts", 0, MAX_EXPERTS) if f.has("n_routed_experts")
                else f.get_int("num_local_experts", 0, MAX_EXPERTS, 0))
    n_group = f.get_int("n_group", 1, max(n_routed, 1), 1)
    if n_routed % n_group:
        f.fail("n_group", n_group, f"a divisor of n_routed_experts ({n_routed})")
    per_group = n_routed // n_group
    if n_group > 1 and per_group < 2:
        f.fail("n_group", n_group, f"at most n_routed_experts / 2 = {n_routed // 2} (group scores sum each "
                                   "group's top-2 experts)")
    topk_group = f.get_int("topk_group", 1, n_group, 1)
    top_k = f.get_int("num_experts_per_tok", 1, topk_group * per_group) if n_routed else 0
    mpe = f.get_int("max_position_embeddings", 1, MAX_POSITIONS, 4096)
    tie = f.get_bool("tie_word_embeddings", top.get_bool("tie_word_embeddings", False) if wrapped else False)
    model_type = top.get_str("model_type", "")
    q_lora_rank = f.opt_int("q_lora_rank", 1, MAX_RANK)
    rope_dim = _even(f, "qk_rope_head_dim")
    dsa = (_indexer(f, architecture, q_lora_rank, rope_dim)
           if architecture in DSA_ARCHITECTURES or model_type in DSA_MODEL_TYPES else {})
    return ModelConfig(
        architecture=architecture,
        model_type=model_type,
        text_root=root,
        vocab_size=f.get_int("vocab_size", 1, MAX_VOCAB),
        hidden_size=f.get_int("hidden_size", 1, MAX_HIDDEN),
        intermediate_size=f.get_int("intermediate_size", 1, MAX_INTERMEDIATE),
        moe_intermediate_size=f.get_int("moe_intermediate_size", 1 if n_routed else 0, MAX_INTERMEDIATE,
                                        ConfigError if n_routed else 0),
        num_hidden_layers=layers,
        num_attention_heads=f.get_int("num_attention_heads", 1, MAX_HEADS),
        q_lora_rank=q_lora_rank,
        kv_lora_rank=f.get_int("kv_lora_rank", 1, MAX_RANK),
        qk_nope_head_dim=f.get_int("qk_nope_head_dim", 1, MAX_HEAD_DIM),
        qk_rope_head_dim=rope_dim,
        v_head_dim=f.get_int("v_head_dim", 1, MAX_HEAD_DIM),
        n_routed_experts=n_routed,
        num_experts_per_tok=top_k,
        n_shared_experts=f.get_int("n_shared_experts", 0, 64, 0),
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=f.get_bool("norm_topk_prob", False),
        routed_scaling_factor=f.get_float("routed_scaling_factor", 0.0, 1e6, 1.0, open_lo=True),
        first_k_dense_replace=f.get_int("first_k_dense_replace", 0, layers, 0),
        rms_norm_eps=f.get_float("rms_norm_eps", 1e-12, 1.0, 1e-6),  # a subnormal eps is 0 in fp32
        rope=_rope(f, mpe),
        rope_interleave=f.get_bool("rope_interleave", True),
        max_position_embeddings=mpe,
        tie_word_embeddings=tie,
        attention_bias=f.get_bool("attention_bias", False),
        mla_use_output_gate=f.get_bool("mla_use_output_gate", False),
        raw=f.data,
        num_nextn_predict_layers=f.get_int("num_nextn_predict_layers", 0, MAX_LAYERS, 0),
        **dsa,
    )


def _indexer(f: Fields, architecture: str, q_lora_rank: int | None, rope_dim: int) -> dict[str, Any]:
    """DSA's indexer fields (DeepSeek-V3.2). Absent ones take transformers' defaults (64 heads,
    head dim 128, top-2048), as ``DeepseekV32Config`` does; the plan then checks the indexer's
    tensor shapes against them. The indexer's query projection reads MLA's compressed query, so
    ``q_lora_rank`` is required; its rope slice (the first ``qk_rope_head_dim`` dims) must fit in
    the head."""
    if q_lora_rank is None:
        f.fail("q_lora_rank", None, f"an integer: {architecture}'s indexer projects MLA's compressed query "
                                    "(q_a_layernorm(q_a_proj(x))), so the model needs q_lora_rank")
    heads = f.get_int("index_n_heads", 1, MAX_HEADS, 64)
    dim = f.get_int("index_head_dim", 1, MAX_HEAD_DIM, 128)
    if dim < rope_dim:
        f.fail("index_head_dim", dim, f"at least qk_rope_head_dim ({rope_dim}): the indexer's q / k start with "
                                      "their rope part")
    return {"index_n_heads": heads, "index_head_dim": dim,
            "index_topk": f.get_int("index_topk", 1, MAX_TOPK, 2048),
            "indexer_rope_interleave": f.get_bool("indexer_rope_interleave", False)}


def _even(f: Fields, key: str) -> int:
    v = f.get_int(key, 2, MAX_HEAD_DIM)
    if v % 2:
        f.fail(key, v, "an even integer (rotary pairs)")
    return v


def check_against_tensors(cfg: ModelConfig, names: Iterable[str], file: str = "config.json") -> None:
    """Counts that size the model must match the tensors present, before the model skeleton is
    built: a corrupt ``num_hidden_layers`` or ``n_routed_experts`` (a million layers) would
    otherwise make plan construction loop for minutes just to report everything missing."""
    last = cfg.num_hidden_layers - 1
    layer_key = f"model.layers.{last}."
    gguf_key = f"blk.{last}."
    hub0, hub_last = ".experts.0.", f".experts.{cfg.n_routed_experts - 1}."
    # substring searches over all names joined at once (C speed; a Kimi-K3 index has ~500,000): a
    # key without a newline matches the joined text only inside one name
    names = names if isinstance(names, Collection) else list(names)
    joined = "\n".join(names)
    has_layer = layer_key in joined or ("\n" + gguf_key in "\n" + joined
                                         and any(n.startswith(gguf_key) for n in names)) or (
        f"\nlayers.{last}." in "\n" + joined)  # DeepSeek-V4's release names (no model. prefix)
    has_hub = bool(cfg.n_routed_experts) and hub0 in joined
    has_last_expert = bool(cfg.n_routed_experts) and hub_last in joined
    if has_layer and (has_last_expert or not cfg.n_routed_experts):
        return
    where = f"{file}: {'text_config.' if cfg.text_root else ''}"
    if not has_layer:
        raise ConfigError(f"{where}num_hidden_layers = {cfg.num_hidden_layers}, but the checkpoint holds no tensor "
                          f"of layer {last} (model.layers.{last}.* / blk.{last}.*)")
    if has_hub and not has_last_expert:
        raise ConfigError(f"{where}n_routed_experts = {cfg.n_routed_experts}, but the checkpoint holds no tensor "
                          f"of expert {cfg.n_routed_experts - 1} (*.experts.{cfg.n_routed_experts - 1}.*)")
