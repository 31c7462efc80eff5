"""DeepSeek-V3 / V3.2 (MLA + MoE, DSA) and Kimi-K2.5: the skeletons, built with full qualified
names from the root out of the core's blocks (:mod:`quantplug.blocks`).

Modules are built from a :class:`Decisions` object (prefix, attention layout and linear
scheme per module, answered by the plugins), on no device: the plan reads each planned
module's ``qp_sources`` and the loader registers the parameters.

DeepSeek-V3.2 sparse attention (DSA, ``index_topk`` in the config): each MLA layer also holds
``self_attn.indexer`` (:class:`~quantplug.blocks.indexer.Indexer`), which scores every cached key
for each query and keeps the top ``index_topk``; attention then reads only those keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from .. import lower
from ..blocks.base import Decisions as Decisions
from ..blocks.base import PlanOracle as PlanOracle
from ..blocks.base import lin as _lin
from ..blocks.cache import LatentCache, MLACache
from ..blocks.indexer import INDEX_SCORE_BYTES as INDEX_SCORE_BYTES
from ..blocks.indexer import Indexer as Indexer
from ..blocks.indexer import IndexerWeights as IndexerWeights
from ..blocks.indexer import LayerNorm as LayerNorm
from ..blocks.indexer import act_quant_ue8m0 as act_quant_ue8m0
from ..blocks.indexer import hadamard as hadamard
from ..blocks.mla import MLA as MLA
from ..blocks.mlp import MLP as MLP
from ..blocks.moe import Experts as Experts
from ..blocks.moe import MoE as MoE
from ..blocks.residual import PreNormLayer
from ..blocks.router import Router as Router
from ..contract.config import ModelConfig
from ..generate import GenerationMixin
from ..layers.embedding import Embedding as Embedding
from ..layers.embedding import TiedHead
from ..layers.norm import RMSNorm
from ..layers.rope import Rotary
from .declarations import (
    ColumnParallel,
    DenseRule,
    EngineEntry,
    EngineExperts,
    EngineLatentAttention,
    EngineMLP,
    ExpertParallel,
    FeatureParallel,
    FoldHeads,
    HeadParallel,
    HeadPart,
    TPStyle,
    Unstack,
    VocabParallel,
)


class DecoderLayer(PreNormLayer):
    """One pre-norm decoder layer ``model.layers.{i}`` (:class:`~quantplug.blocks.residual.PreNormLayer`):
    ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; the attention an :class:`MLA`, the MLP a
    :class:`MoE` from ``first_k_dense_replace`` on, else a dense :class:`MLP`."""

    def __init__(self, cfg: ModelConfig, i: int, d: Decisions, rotary: Rotary) -> None:
        base = f"model.layers.{i}"
        eps = cfg.rms_norm_eps
        super().__init__(RMSNorm(cfg.hidden_size, eps, d.ck(f"{base}.input_layernorm")), MLA(cfg, i, d, rotary),
                         RMSNorm(cfg.hidden_size, eps, d.ck(f"{base}.post_attention_layernorm")),
                         MoE(cfg, d, f"{base}.mlp") if cfg.is_moe_layer(i)
                         else MLP(d, f"{base}.mlp", cfg.hidden_size, cfg.intermediate_size))


class MTPLayer(nn.Module):
    """One multi-token-prediction module (``num_nextn_predict_layers``; DeepSeek-V3 ``model.layers.61``):
    ``enorm`` / ``hnorm`` (RMSNorm of the next token's embedding and of the main model's final
    hidden state), ``eh_proj`` [H, 2H] on ``cat([enorm(e), hnorm(h)])``, a full decoder block (the
    same :class:`DecoderLayer` as the main layers, built with its index so MoE / dense follows
    ``first_k_dense_replace``) and ``shared_head.norm``. The checkpoint's copies of the embedding
    and the LM head (``embed_tokens``, ``shared_head.head``) are not loaded: the main model's serve
    (the plan's skip rule ``mtp-shared-copies``). :meth:`DeepseekV3ForCausalLM.mtp_logits` runs it."""

    def __init__(self, cfg: ModelConfig, i: int, d: Decisions, rotary: Rotary) -> None:
        super().__init__()
        base = f"model.layers.{i}"
        h = cfg.hidden_size
        self.index = i
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, d.ck(f"{base}.enorm"))
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, d.ck(f"{base}.hnorm"))
        self.eh_proj = _lin(d, f"{base}.eh_proj", 2 * h, h)
        self.block = DecoderLayer(cfg, i, d, rotary)
        self.head_norm = RMSNorm(h, cfg.rms_norm_eps, d.ck(f"{base}.shared_head.norm"))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None) -> torch.Tensor:
        """``embeds`` [B, T, H] of tokens t_{j+1}, ``hidden`` [B, T, H] the main model's normed final
        hidden states at j: the normed output [B, T, H] whose LM head gives the draft for t_{j+2}
        (ARCHITECTURES D3: embedding first, hidden state second)."""
        return self.head_norm(self.block(self.mix(embeds, hidden), cos, sin, cache))

    def mix(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The block's input: ``eh_proj(cat([enorm(embeds), hnorm(hidden)]))``."""
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))


class TextModel(nn.Module):
    """``model.*``: the embedding, the decoder layers (its declared stack) and the final norm. Its
    decode entry points are the lowering's (:mod:`quantplug.lower`): one native call for the whole
    stack where every layer has a native step, else None and the layers' forwards run."""

    def __init__(self, cfg: ModelConfig, d: Decisions) -> None:
        super().__init__()
        emb = d.ck("model.embed_tokens")
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, d.scheme(emb, "embedding"), emb, d.model_dtype)
        self.rotary = Rotary(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, d, self.rotary) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck("model.norm"))

    #: the whole stack's native decode step (:func:`quantplug.lower.text_stack`); ``decode_stack``
    #: is what an engine with its own paged cache asks (:func:`quantplug.bridge.paged_decode`)
    _stack_step = decode_stack = lower.text_stack
    #: token ids to logits in one native call, or None (:func:`quantplug.lower.decode_logits`)
    decode_logits = lower.decode_logits
    #: a few tokens of one sequence in one native call, or None (:func:`quantplug.lower.sequence_logits`)
    sequence_logits = lower.sequence_logits

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        """Hidden states [B, T, hidden] of ``ids`` [B, T]; ``positions`` [B, T] default to the
        tokens after the ``cache``'s (0.. without one); with ``cache`` the tokens' latents are
        appended to it (see ``quantplug.generate``)."""
        x = self.embed_tokens(ids)
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if cache is not None:
            out = lower.decode_hidden(self, x, cos, sin, cache)
            if out is not None:
                return out
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if cache is None else cache.layers[i])
        return self.norm(x)


class DeepseekV3ForCausalLM(GenerationMixin, nn.Module):
    """DeepSeek-V3 / Kimi-K2 text model: ``model.*`` and ``lm_head``; ``generate`` / ``stream``
    from :class:`quantplug.generate.GenerationMixin`."""

    packed_modules_mapping = {
        "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    #: how the model splits over tensor-parallel ranks (``quantplug.parallel`` reads it); the
    #: split serving engines use (vLLM ``models/deepseek_v2.py``, DeepSeek-V3 ``inference/model.py``)
    qp_tp_plan: ClassVar[Mapping[str, TPStyle]] = {
        "model.embed_tokens": VocabParallel(),
        "model.layers.*.self_attn": HeadParallel(column=("q_proj", "q_b_proj", "kv_b_proj", "g_proj"),
                                                 row=("o_proj",), stacks=("k_b", "v_b")),
        "model.layers.*.mlp": FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",)),
        "model.layers.*.mlp.shared_experts": FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",)),
        "model.layers.*.mlp.experts": ExpertParallel(stacks=("gate_proj", "up_proj", "down_proj")),
        "lm_head": ColumnParallel(gather=True),
        # the MTP layers' decoder blocks split as the main layers (eh_proj and the norms replicate)
        "mtp.*.block.self_attn": HeadParallel(column=("q_proj", "q_b_proj", "kv_b_proj", "g_proj"),
                                              row=("o_proj",), stacks=("k_b", "v_b")),
        "mtp.*.block.mlp": FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",)),
        "mtp.*.block.mlp.shared_experts": FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",)),
        "mtp.*.block.mlp.experts": ExpertParallel(stacks=("gate_proj", "up_proj", "down_proj")),
    }
    #: how an engine's own DeepSeek-V3 module tree (vLLM, transformers) takes the planned
    #: modules (``quantplug.bridge`` reads it)
    qp_engine_plan: ClassVar[Mapping[str, EngineEntry]] = {
        "model.layers.*.self_attn": EngineLatentAttention(unsupported=(
            ("g_proj", "the MLA output gate (mla_use_output_gate) is not part of the engines' DeepSeek-V3 attention"),
        )),
        "model.layers.*.mlp": EngineMLP(),
        "model.layers.*.mlp.shared_experts": EngineMLP(),
        "model.layers.*.mlp.experts": EngineExperts(),
    }
    #: stacked layers back to the hub layout (``quantplug.api.dense_state`` reads it)
    qp_dense_state: ClassVar[Mapping[str, DenseRule]] = {
        "model.layers.*.mlp.experts": Unstack(stacks=("gate_proj", "up_proj", "down_proj")),
        "model.layers.*.self_attn": FoldHeads("kv_b_proj", (HeadPart("k_b", transpose=True), HeadPart("v_b"))),
        "mtp.*.block.mlp.experts": Unstack(stacks=("gate_proj", "up_proj", "down_proj")),
        "mtp.*.block.self_attn": FoldHeads("kv_b_proj", (HeadPart("k_b", transpose=True), HeadPart("v_b"))),
    }

    def __init__(self, cfg: ModelConfig, d: Decisions) -> None:
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg, d)
        self.lm_head: nn.Module
        if cfg.tie_word_embeddings:
            self.lm_head = TiedHead(self.model.embed_tokens)
        else:
            self.lm_head = _lin(d, "lm_head", cfg.hidden_size, cfg.vocab_size)
        #: the multi-token-prediction layers the plan loads (``PlanOracle.mtp_layers``: the config's
        #: ``num_nextn_predict_layers`` unless the load option ``mtp`` is false or the checkpoint
        #: stores none), indices ``num_hidden_layers + k``
        n = cfg.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(cfg, n + k, d, self.model.rotary)
                                 for k in range(int(getattr(d, "mtp_layers", 0) or 0)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; ``positions`` / ``cache`` as :meth:`TextModel.forward`."""
        return self.lm_head(self.model(input_ids, positions, cache))

    def next_logits(self, input_ids: torch.Tensor, cache: MLACache) -> torch.Tensor:
        """float32 logits [B, vocab] of the last position only (the LM head runs on one token)."""
        return self._next(input_ids, cache, False)[0]

    def next_tokens(self, input_ids: torch.Tensor, cache: MLACache) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`next_logits` and the greedy pick from them (``argmax(-1)``, [B] int64); a decode
        step picks in the same native call as it computes the logits."""
        logits, picks = self._next(input_ids, cache, True)
        assert picks is not None
        return logits, picks

    def _next(self, input_ids: torch.Tensor, cache: MLACache, pick: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode step in one native call where :meth:`TextModel.decode_logits` runs it, else
        the modules; (logits, the greedy picks when ``pick``)."""
        y = self.model.decode_logits(input_ids, cache, self.lm_head, pick)
        if y is not None:
            return y
        logits = self.lm_head(self.model(input_ids, None, cache)[:, -1]).float()
        return logits, (logits.argmax(dim=-1) if pick else None)

    def hidden_and_logits(self, input_ids: torch.Tensor, cache: MLACache,
                          last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model on ``input_ids`` [B, T] after the ``cache``'s tokens (appended to it): its
        normed final hidden states [B, T, H] (the LM head's input, what the MTP layer reads) and
        float32 logits [B, T, vocab], or with ``last_only`` [B, 1, vocab] of the last position (a
        prompt). Speculative decoding prefills and verifies T = 2 tokens this way."""
        if not last_only and input_ids.shape[1] > 1:
            got = self.model.sequence_logits(input_ids, cache, self.lm_head)
            if got is not None:  # one native call (a speculative verify)
                return got[0], got[1].unsqueeze(0)
        hidden = self.model(input_ids, None, cache)
        return hidden, self.lm_head(hidden[:, -1:] if last_only else hidden).float()

    def mtp_logits(self, next_ids: torch.Tensor, hidden: torch.Tensor, cache: MLACache,
                   layer: int = 0) -> torch.Tensor:
        """Draft logits (float32 [B, T, vocab]) of MTP layer ``layer`` (ARCHITECTURES D3):
        ``next_ids`` [B, T] are tokens t_{j+1}, ``hidden`` [B, T, H] the main model's normed final
        hidden states at positions j (:meth:`hidden_and_logits`); row j's logits predict t_{j+2}.
        ``cache`` is the MTP layer's own one-layer cache (:func:`quantplug.generate.new_mtp_cache`),
        whose entry j holds the pair (h_j, t_{j+1}); the T new pairs are appended. Positions: the
        shifted token's own, j + 1 (transformers' MtpModel; vLLM gives j: RoPE logits depend on
        relative positions only, so both agree as long as one is used throughout).
        The lookup and head are the main model's ``embed_tokens`` and ``lm_head``."""
        mtp = self.mtp[layer]
        assert isinstance(mtp, MTPLayer)
        start = cache.length + 1
        got = lower.mtp_logits(self, mtp, next_ids, hidden, cache, start)
        if got is not None:  # one native call
            return got
        positions = torch.arange(start, start + next_ids.shape[1], device=next_ids.device)
        positions = positions.unsqueeze(0).expand(next_ids.shape[0], -1)
        embeds = self.model.embed_tokens(next_ids)
        cos, sin = self.model.rotary.cos_sin(positions, embeds.dtype)
        out = mtp(embeds, hidden.to(embeds.dtype), cos, sin, cache.layers[0])
        return self.lm_head(out).float()

    #: one greedy speculative step in one native call, or None (:func:`quantplug.lower.speculative_step`)
    speculative_step = lower.speculative_step

    def text_lm(self) -> DeepseekV3ForCausalLM:
        return self


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 with DSA, a lightning :class:`Indexer` in
    every attention layer (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``) whose top
    ``index_topk`` keys are the ones each query attends to. Decodes layer by layer (no whole-stack
    native step: :func:`quantplug.lower.text_stack`)."""


class KimiK25ForConditionalGeneration(GenerationMixin, nn.Module):
    """Kimi-K2.5 / K2.6: the DeepSeek-V3 text model under ``language_model``; vision not loaded."""

    packed_modules_mapping = DeepseekV3ForCausalLM.packed_modules_mapping

    def __init__(self, cfg: ModelConfig, d: Decisions) -> None:
        super().__init__()
        self.config = cfg
        self.language_model = DeepseekV3ForCausalLM(cfg, d)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, cache)

    def text_lm(self) -> DeepseekV3ForCausalLM:
        return self.language_model

