"""Kimi-Linear (``KimiLinearForCausalLM``) and the released Kimi-K3 (``KimiK3ForConditionalGeneration``).

Both are hybrids of two attention kinds over the core's blocks (docs/architectures/kimi.md):

* **KDA** (Kimi Delta Attention, :class:`~quantplug.blocks.kda.KDA`): a linear-attention recurrence with a fixed-size
  float32 state per head. q / k / v projections, a causal depthwise convolution of width
  ``short_conv_kernel_size`` with SiLU, L2-normed q and k, a per-channel forget gate from a
  low-rank projection (``f_a_proj`` / ``f_b_proj``, ``dt_bias``, ``A_log``: Kimi-Linear's
  ``-exp(A) * softplus``, or K3's bounded ``gate_lower_bound * sigmoid(exp(A) * .)``), beta, the
  delta rule, a per-head RMSNorm gated by ``sigmoid`` of a low-rank (``g_a_proj`` / ``g_b_proj``)
  or full-rank (``g_proj``, K3) output gate, and ``o_proj``. Prompts run the chunked form (chunks of
  :data:`CHUNK` tokens, the WY representation of transformers' / FLA's torch reference), decode
  steps the recurrent one.
* **MLA without RoPE** (the core's :class:`~quantplug.blocks.mla.MLA` with :class:`~quantplug.blocks.mla.NoRope`):
  Kimi-Linear's has a plain ``q_proj``, K3's a q-LoRA and a sigmoid output gate ``g_proj``.

MLPs: a dense gated MLP at layer 0, then MoE under ``block_sparse_moe`` with per-expert ``w1``
(gate), ``w3`` (up), ``w2`` (down), the sigmoid router with ``e_score_correction_bias`` and shared
experts. K3 adds SiTU on every MLP, the latent MoE (``routed_expert_hidden_size``) and attention
residuals (``attn_res_block_size``: the residual stream mixed across depth, per token, by a softmax
over block sums; see :class:`KimiTextModel`).

Layer kinds come from ``linear_attn_config.kda_layers`` / ``full_attn_layers`` (1-based lists, as
the release and sglang read them; transformers' fallback when they are absent does not match the
release, so they are required here).

The generation cache (:class:`HybridCache`) holds one :class:`KDAState` (recurrent state and the
convolution's last inputs) per KDA layer beside one latent cache per MLA layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..blocks.base import Decisions
from ..blocks.base import lin as _lin
from ..blocks.cache import HybridCache as HybridCache
from ..blocks.cache import KDAState as KDAState
from ..blocks.cache import MLACache, layer_cache
from ..blocks.kda import CHUNK as CHUNK
from ..blocks.kda import KDA as KDA
from ..blocks.kda import ShortConv as ShortConv
from ..blocks.kda import chunk_kda as chunk_kda
from ..blocks.kda import l2norm as l2norm
from ..blocks.kda import recurrent_kda as recurrent_kda
from ..blocks.mla import MLA, NoRope
from ..blocks.mlp import MLP
from ..blocks.moe import MoE
from ..blocks.residual import ResScore as ResScore
from ..blocks.residual import attention_residuals
from ..contract.config import (
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_POSITIONS,
    ModelConfig,
    RopeConfig,
    parse_model_config,
)
from ..errors import ConfigError
from ..generate import GenerationMixin
from ..layers.activation import SILU, GatedAct
from ..layers.embedding import Embedding, TiedHead
from ..layers.norm import RMSNorm
from ..layers.rope import Rotary
from ..validation import Fields
from .declarations import (
    ColumnParallel,
    DenseRule,
    EngineEntry,
    EngineExperts,
    EngineLatentAttention,
    EngineMLP,
    EngineRename,
    ExpertParallel,
    FeatureParallel,
    FoldHeads,
    HeadParallel,
    HeadPart,
    HeadSlice,
    TPStyle,
    Unstack,
    VocabParallel,
)

if TYPE_CHECKING:
    from ..contract.options import LoadOptions

#: Kimi-Linear's config keys and the DeepSeek-V3 names the core's parser reads them under
#: (transformers' ``KimiLinearConfig.attribute_map``)
_ALIASES = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "model_max_length": "max_position_embeddings",
}


@dataclass(frozen=True, eq=False)
class KimiConfig(ModelConfig):
    """:class:`ModelConfig` plus the Kimi-Linear / Kimi-K3 fields."""

    #: KDA heads H and head dim K (= V); the depthwise convolution's width
    kda_heads: int = 0
    kda_head_dim: int = 0
    conv_kernel: int = 4
    #: 0-based indices of the KDA layers (the others are MLA)
    kda_layers: frozenset[int] = frozenset()
    #: K3's bounded forget gate (``linear_attn_config.gate_lower_bound``), None: softplus gate
    gate_lower_bound: float | None = None
    #: KDA output gate: one full-rank ``g_proj`` (K3) instead of ``g_a_proj`` / ``g_b_proj``
    full_rank_gate: bool = False
    #: attention residuals' block size (K3), None: the plain pre-norm residual
    attn_res_block_size: int | None = None
    #: latent MoE width (``routed_expert_hidden_size``, K3), None: experts at the hidden width
    latent_size: int | None = None
    latent_norm: bool = False
    #: the activation of every MLP (SiLU, or K3's SiTU)
    act: GatedAct = SILU
    moe_layer_freq: int = 1

    __hash__ = ModelConfig.__hash__

    def is_kda(self, i: int) -> bool:
        return i in self.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def kda_dim(self) -> int:
        """H * K: the width of KDA's q, k, v."""
        return self.kda_heads * self.kda_head_dim


def _layer_list(f: Fields, key: str, layers: int) -> list[int]:
    value = f.data.get(key)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        f.fail(key, value, "a list of 1-based layer numbers")
    bad = [v for v in value if not 1 <= v <= layers]
    if bad:
        f.fail(key, bad[0], f"layer numbers from 1 to num_hidden_layers ({layers}), 1-based")
    return list(value)


def parse_kimi_config(config: dict[str, Any], architecture: str, wrapped: bool, file: str = "config.json") -> KimiConfig:
    """Kimi-Linear's config schema (``kimi_linear``; under ``text_config`` for K3): the keys the core
    reads under DeepSeek names (aliases of :data:`_ALIASES`), checked under their own names here,
    then the KDA, attention-residual, latent-MoE and SiTU fields. Every refusal is a
    :class:`~quantplug.errors.ConfigError` naming ``file`` and the key."""
    top = Fields(config, file)
    f = top
    if wrapped:
        text = top.get_obj("text_config")
        if text is None:
            raise ConfigError(f"{file}: {architecture} needs a 'text_config' object")
        f = text
    where = "text_config." if wrapped else ""
    lin = f.get_obj("linear_attn_config")
    if lin is None:
        tt = f.data.get("model_type")
        hint = (f" (text_config.model_type is {tt!r}: a DeepSeek-V3 layout with an MLA output gate loads as "
                "KimiK25ForConditionalGeneration with mla_use_output_gate: true)" if wrapped else "")
        raise ConfigError(f"{file}: {where}linear_attn_config: missing; {architecture} is a KDA + MLA hybrid whose "
                          f"layer kinds it lists (kda_layers / full_attn_layers){hint}")
    layers = f.get_int("num_hidden_layers", 1, MAX_LAYERS)
    f.get_str("moe_router_activation_func", "sigmoid", choices=("sigmoid",))
    act_name = f.get_str("hidden_act", "silu", choices=("silu", "situ"))
    if not f.get_bool("mla_use_nope", False):
        f.fail("mla_use_nope", f.data.get("mla_use_nope"), "true: quantplug runs Kimi's MLA without RoPE, as every "
                                                           "release is (Kimi-Linear, Kimi-K3)")
    n_routed = f.get_int("num_experts", 0, MAX_EXPERTS, 0) if f.has("num_experts") else None
    if n_routed is not None:
        f.get_int("num_experts_per_token", 1, max(n_routed, 1), 1)
    f.get_int("num_shared_experts", 0, 64, 0)
    f.get_int("num_expert_group", 1, MAX_EXPERTS, 1)
    f.get_bool("moe_renormalize", False)
    f.get_int("model_max_length", 1, MAX_POSITIONS, 4096)
    heads = lin.get_int("num_heads", 1, MAX_HEADS)
    head_dim = lin.get_int("head_dim", 1, MAX_HEAD_DIM)
    kernel = lin.get_int("short_conv_kernel_size", 1, 64, 4)
    kda = _layer_list(lin, "kda_layers", layers)
    full = _layer_list(lin, "full_attn_layers", layers)
    both = sorted(set(kda) & set(full))
    if both:
        lin.fail("kda_layers", both[0], f"layers apart from full_attn_layers (layer {both[0]} is in both)")
    missing = sorted(set(range(1, layers + 1)) - set(kda) - set(full))
    if missing:
        lin.fail("full_attn_layers", full, f"with kda_layers, every layer 1..{layers} (layer {missing[0]} is in "
                                           "neither list)")
    lower = lin.opt_float("gate_lower_bound", -1e4, 0.0)
    if lower is not None and lower >= 0:
        lin.fail("gate_lower_bound", lower, "a negative number (the forget gate's log-decay floor)")
    block = f.opt_int("attn_res_block_size", 1, MAX_LAYERS)
    latent = f.opt_int("routed_expert_hidden_size", 1, 1 << 20)
    act = SILU
    if act_name == "situ":
        # sglang: ``beta or 1.0``; linear_beta 0 / absent: no soft cap on the up projection
        beta = f.get_float("activation_situ_beta", 1e-6, 1e6, 1.0) if f.data.get("activation_situ_beta") else 1.0
        lbeta = f.opt_float("activation_situ_linear_beta", 0.0, 1e6)
        act = GatedAct("situ", beta, lbeta or None)
    # the core's parser on the DeepSeek names (aliases renamed; hidden_act and RoPE are not DeepSeek's here)
    deepseek: dict[str, Any] = {_ALIASES.get(k, k): v for k, v in f.data.items()
            if k not in ("hidden_act", "rope_scaling", "rope_parameters", "moe_router_activation_func")
            and not (k in _ALIASES and _ALIASES[k] in f.data)}
    deepseek.setdefault("n_routed_experts", 0)
    # the router has no groups in these models (1 / 1): the core's grouped router then keeps all
    deepseek.setdefault("n_group", 1)
    deepseek.setdefault("topk_group", 1)
    if not deepseek.get("qk_rope_head_dim"):
        f.fail("qk_rope_head_dim", f.data.get("qk_rope_head_dim"), "a positive even integer (MLA's k_pe width, "
                                                                   "stored even without RoPE)")
    inner = {**config, "text_config": deepseek} if wrapped else deepseek
    base = parse_model_config(inner, architecture, wrapped, file)
    cfg = KimiConfig(**{fld.name: getattr(base, fld.name) for fld in dataclasses.fields(ModelConfig)},
                     kda_heads=heads, kda_head_dim=head_dim, conv_kernel=kernel,
                     kda_layers=frozenset(v - 1 for v in kda), gate_lower_bound=lower,
                     full_rank_gate=lin.get_bool("use_full_rank_gate", False), attn_res_block_size=block,
                     latent_size=latent, latent_norm=f.get_bool("latent_moe_use_norm", False), act=act,
                     moe_layer_freq=f.get_int("moe_layer_freq", 1, MAX_LAYERS, 1))
    return dataclasses.replace(cfg, rope=RopeConfig(10000.0, "default"), raw=f.data)


class KimiDecoderLayer(nn.Module):
    """``model.layers.{i}``: input / post-attention norms, ``self_attn`` (:class:`KDA` or MLA
    without RoPE), ``mlp`` (dense, layer < ``first_k_dense_replace``) or ``block_sparse_moe``, and
    with attention residuals the two aggregation points ``self_attention_res_*`` / ``mlp_res_*``."""

    def __init__(self, cfg: KimiConfig, i: int, d: Decisions, rotary: Rotary) -> None:
        super().__init__()
        base = f"model.layers.{i}"
        self.index = i
        self.kda = cfg.is_kda(i)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck(f"{base}.input_layernorm"))
        self.self_attn: nn.Module = KDA(cfg, i, d) if self.kda else MLA(cfg, i, d, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                d.ck(f"{base}.post_attention_layernorm"))
        self.mlp: nn.Module
        self.block_sparse_moe: nn.Module
        if cfg.is_moe_layer(i):
            self.block_sparse_moe = MoE(cfg, d, f"{base}.block_sparse_moe", names=("w1", "w3", "w2"), act=cfg.act,
                                        latent=cfg.latent_size, latent_norm=cfg.latent_norm)
        else:
            self.mlp = MLP(d, f"{base}.mlp", cfg.hidden_size, cfg.intermediate_size, cfg.act)
        self.attn_res: ResScore | None = None
        self.mlp_res: ResScore | None = None
        if cfg.attn_res_block_size is not None:
            self.attn_res = ResScore(cfg.hidden_size, d.ck(f"{base}.self_attention"), cfg.rms_norm_eps)
            self.mlp_res = ResScore(cfg.hidden_size, d.ck(f"{base}.mlp"), cfg.rms_norm_eps)

    @property
    def ffn(self) -> nn.Module:
        """The layer's MLP: the dense ``mlp`` or the ``block_sparse_moe``."""
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x), cos, sin, cache)

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """The plain pre-norm residual (no attention residuals)."""
        x = x + self.attend(x, cos, sin, cache)
        return x + self.feed(x)


class KimiTextModel(nn.Module):
    """``model.*``: the embedding, the layers, the final norm and, with attention residuals, the
    output aggregation ``output_attn_res_*``.

    Attention residuals (``attn_res_block_size`` = B; sglang ``AttnResidual``, llama.cpp
    ``kimi-k3.cpp``): a per-forward bank of block sums, row 0 the embedding. Layer L's attention
    reads the mix of the bank and the current partial sum (none at L = 0); where L % B == 0 the
    partial sum so far becomes a bank row and restarts at 0; the MLP reads the mix of the bank and
    the partial sum after attention; the final norm reads the mix of the bank and the last partial
    sum. No state crosses forwards."""

    def __init__(self, cfg: KimiConfig, d: Decisions) -> None:
        super().__init__()
        emb = d.ck("model.embed_tokens")
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, d.scheme(emb, "embedding"), emb, d.model_dtype)
        self.rotary = NoRope(cfg.qk_rope_head_dim)
        self.layers = nn.ModuleList(KimiDecoderLayer(cfg, i, d, self.rotary) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck("model.norm"))
        self.block = cfg.attn_res_block_size
        self.output_res: ResScore | None = None
        if self.block is not None:
            self.output_res = ResScore(cfg.hidden_size, d.ck("model.output_attn"), cfg.rms_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, cache: MLACache | None = None) -> torch.Tensor:
        """Normed hidden states [B, T, hidden] of ``ids`` [B, T] (no position input: ``positions``
        is accepted and unused); with ``cache`` the tokens continue it."""
        h = self.embed_tokens(ids)
        cos, sin = self.rotary.cos_sin(torch.zeros(ids.shape, dtype=torch.long, device=ids.device), h.dtype)
        caches: list[Any] = [None] * len(self.layers) if cache is None else cache.layers
        if self.block is None:
            for layer, c in zip(self.layers, caches):
                h = layer(h, cos, sin, c)
            return self.norm(h)
        assert self.output_res is not None
        return self.norm(attention_residuals(self.layers, h, caches, self.block, self.output_res, cos, sin))


#: how a Kimi layer's attention splits over tensor-parallel ranks: one entry for both kinds (members
#: a layer does not hold are skipped). MLA as DeepSeek-V3's; KDA by head as sglang's
#: ``KimiDeltaAttention``: q / k / v, ``f_b_proj``, the output gate (``g_proj`` or ``g_b_proj``)
#: and ``b_proj`` (one feature per head) column-parallel, the convolutions' channels, ``dt_bias``
#: and ``A_log`` by head, ``o_proj`` row-parallel; ``f_a_proj`` / ``g_a_proj`` (low rank) and
#: ``o_norm`` (per head dim) replicated
_ATTENTION_TP = HeadParallel(
    column=("q_proj", "q_b_proj", "kv_b_proj", "g_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "b_proj"),
    row=("o_proj",), stacks=("k_b", "v_b"),
    floats=(HeadSlice("q_conv1d.weight"), HeadSlice("k_conv1d.weight"), HeadSlice("v_conv1d.weight"),
            HeadSlice("dt_bias"), HeadSlice("A_log", per_head=1), HeadSlice("A", per_head=1)))
_MLP_TP = FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",))
_EXPERTS = ("gate_proj", "up_proj", "down_proj")


class KimiLinearForCausalLM(GenerationMixin, nn.Module):
    """Kimi-Linear (``kimi_linear``): ``model.*`` and ``lm_head``; ``generate`` / ``stream`` from
    :class:`quantplug.generate.GenerationMixin` with a :class:`HybridCache`."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    #: how the model splits over tensor-parallel ranks (``quantplug.parallel`` reads it): attention by
    #: head (:data:`_ATTENTION_TP`), routed experts expert-parallel (their latent partial sums
    #: all-reduced inside :class:`~quantplug.blocks.moe.Experts`, before ``routed_expert_norm``:
    #: the norm of the sum, not the sum of norms), the dense MLP and shared experts by feature; the
    #: latent ``routed_expert_down_proj`` / ``routed_expert_up_proj``, the router and the attention
    #: residuals' float parameters replicated
    qp_tp_plan: ClassVar[Mapping[str, TPStyle]] = {
        "model.embed_tokens": VocabParallel(),
        "model.layers.*.self_attn": _ATTENTION_TP,
        "model.layers.*.mlp": _MLP_TP,
        "model.layers.*.block_sparse_moe.shared_experts": _MLP_TP,
        "model.layers.*.block_sparse_moe.experts": ExpertParallel(stacks=_EXPERTS),
        "lm_head": ColumnParallel(gather=True),
    }
    #: stacked layers back to the release's layout (``quantplug.api.dense_state`` reads it): routed
    #: experts one tensor per expert named ``w1`` / ``w3`` / ``w2``; split MLA ``k_b`` / ``v_b`` (a
    #: GGUF) folded into ``kv_b_proj``
    qp_dense_state: ClassVar[Mapping[str, DenseRule]] = {
        "model.layers.*.block_sparse_moe.experts": Unstack(stacks=_EXPERTS, stored=("w1", "w3", "w2")),
        "model.layers.*.self_attn": FoldHeads("kv_b_proj", (HeadPart("k_b", transpose=True), HeadPart("v_b"))),
    }
    #: how an engine's own Kimi-Linear module tree (transformers' ``KimiLinearForCausalLM``) takes the
    #: planned modules (``quantplug.bridge`` reads it): the MLA layers as DeepSeek-V3's (the entry
    #: applies to the layers holding ``kv_a_proj_with_mqa``; a KDA layer's projections are plain
    #: linears), the dense MLP and shared experts as gated MLPs, the routed experts called as
    #: ``fn(x, topk_ids, topk_weights)``
    qp_engine_plan: ClassVar[Mapping[str, EngineEntry]] = {
        "model.layers.*.self_attn": EngineLatentAttention(unsupported=(
            ("g_proj", "the MLA output gate (mla_use_output_gate) is not part of the engines' Kimi-Linear attention"),
        )),
        "model.layers.*.mlp": EngineMLP(),
        "model.layers.*.block_sparse_moe.shared_experts": EngineMLP(),
        "model.layers.*.block_sparse_moe.experts": EngineExperts(),
    }
    #: the engines' names for what quantplug names as the release does (transformers' conversion
    #: mapping for ``kimi_linear``): the MoE block is ``mlp``, the forget gate's members sit under
    #: ``self_attn.forget_gate`` (the q / k / v convolutions become one ``conv1d``: :meth:`KDA.qp_engine_floats`)
    qp_engine_names: ClassVar[tuple[EngineRename, ...]] = (
        EngineRename(r"\.block_sparse_moe(?=\.|$)", ".mlp"),
        EngineRename(r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)(?=\.|$)", r".self_attn.forget_gate.\1"),
    )
    #: the KDA state's dtype in a new cache (float32; bfloat16 halves it, as sglang's
    #: ``--mamba-ssm-dtype bfloat16``)
    qp_state_dtype: torch.dtype = torch.float32

    def qp_configure(self, options: LoadOptions) -> None:
        """Takes load option ``kda_state``."""
        self.qp_state_dtype = torch.bfloat16 if options.kda_state == "bfloat16" else torch.float32

    def __init__(self, cfg: KimiConfig, d: Decisions) -> None:
        super().__init__()
        self.config = cfg
        self.model = KimiTextModel(cfg, d)
        self.lm_head: nn.Module
        if cfg.tie_word_embeddings:
            self.lm_head = TiedHead(self.model.embed_tokens)
        else:
            self.lm_head = _lin(d, "lm_head", cfg.hidden_size, cfg.vocab_size)
        self.mtp = nn.ModuleList()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, positions, cache))

    def next_logits(self, input_ids: torch.Tensor, cache: MLACache) -> torch.Tensor:
        """float32 logits [B, vocab] of the last position (the LM head runs on one token)."""
        return self.lm_head(self.model(input_ids, None, cache)[:, -1]).float()

    def next_tokens(self, input_ids: torch.Tensor, cache: MLACache) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.next_logits(input_ids, cache)
        return logits, logits.argmax(dim=-1)

    def hidden_and_logits(self, input_ids: torch.Tensor, cache: MLACache,
                          last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(input_ids, None, cache)
        return hidden, self.lm_head(hidden[:, -1:] if last_only else hidden).float()

    def qp_new_cache(self, batch: int, capacity: int, limit: int) -> HybridCache:
        """A :class:`HybridCache`: a :class:`KDAState` per KDA layer (state dtype
        :attr:`qp_state_dtype`), a latent cache per MLA layer."""
        emb = self.model.embed_tokens
        device = next(iter(emb.parameters())).device
        layers: list[Any] = []
        for layer in self.model.layers:
            attn = layer.self_attn
            if isinstance(attn, KDA):
                layers.append(KDAState(batch, 3 * attn.dim, attn.width, attn.heads, attn.head_dim, device=device,
                                       limit=limit, state_dtype=self.qp_state_dtype))
            else:
                layers.append(layer_cache(attn, batch, capacity, limit, dtype=emb.model_dtype, device=device))
        return HybridCache(layers)

    def text_lm(self) -> KimiLinearForCausalLM:
        return self

    @property
    def qp_engine_refusal(self) -> str | None:
        """Why the engine bridges (``quantplug.bridge``) refuse this model: the Kimi-K3 features its
        config enables, which transformers' ``KimiLinearForCausalLM`` does not compute (its config
        would silently drop them); None for a Kimi-Linear model."""
        cfg = self.config
        lacks = [what for on, what in (
            (cfg.attn_res_block_size is not None, "attention residuals (attn_res_block_size)"),
            (cfg.latent_size is not None, "the latent MoE (routed_expert_hidden_size)"),
            (not cfg.act.is_silu, f"the {cfg.act.kind} activation (hidden_act)"),
            (cfg.full_rank_gate, "the full-rank KDA output gate (use_full_rank_gate)"),
            (cfg.gate_lower_bound is not None, "the bounded forget gate (gate_lower_bound)"),
            (cfg.mla_use_output_gate, "the MLA output gate (mla_use_output_gate)"),
            (cfg.moe_layer_freq != 1, "MoE layers every moe_layer_freq layers"),
        ) if on]
        if not lacks:
            return None
        return (f"transformers' KimiLinearForCausalLM has no {', '.join(lacks)} (Kimi-K3's features); run it with "
                "quantplug.load / generate")


class KimiK3ForConditionalGeneration(GenerationMixin, nn.Module):
    """The released Kimi-K3: Kimi-Linear's text model (with K3's features, see the module
    docstring) under ``language_model``; vision not loaded."""

    packed_modules_mapping = KimiLinearForCausalLM.packed_modules_mapping
    #: why the engine bridges (quantplug.bridge) refuse it
    qp_engine_refusal: ClassVar[str] = (
        "the released Kimi-K3 (attention residuals, latent MoE, SiTU, full-rank KDA output gate, bounded forget "
        "gate, MLA output gate) has no model class in transformers or vLLM to bridge into; run it with "
        "quantplug.load / generate")

    def __init__(self, cfg: KimiConfig, d: Decisions) -> None:
        super().__init__()
        self.config = cfg
        self.language_model = KimiLinearForCausalLM(cfg, d)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, cache)

    def text_lm(self) -> KimiLinearForCausalLM:
        return self.language_model
