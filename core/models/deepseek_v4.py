"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, ``model_type: deepseek_v4``; DeepSeek-V4's inference code model.py, transformers 5.25) as a
skeleton of the core's V4 blocks, declared in the release's tensor names (E2: no ``model.``
prefix).

- ``embed.weight`` -> the state X [b, t, hc_mult, hidden]: the embedding copied into every stream.
- Each layer ``layers.L``: ``hc_attn`` (:class:`~quantplug.blocks.hyper.HyperConnection`) around
  ``attn_norm`` + ``attn`` (:class:`~quantplug.blocks.v4_attention.V4Attention`: sliding window,
  CSA or HCA by ``compress_ratios[L]``), then ``hc_ffn`` around ``ffn_norm`` + ``ffn``: a MoE on
  every layer (:class:`~quantplug.blocks.moe.MoE`), hash-routed by token id
  (:class:`~quantplug.blocks.v4_router.HashRouter`, ``gate.tid2eid``) on the first
  ``num_hash_layers`` layers, learned (:class:`~quantplug.blocks.v4_router.V4Router`, ``gate.bias``)
  after; routed experts ``experts.E.w1`` / ``w3`` / ``w2`` and the shared expert
  ``shared_experts.w1`` / ``w3`` / ``w2``, both with the clamped SwiGLU (``swiglu_limit``).
- ``hc_head`` (:class:`~quantplug.blocks.hyper.HyperHead`) collapses the streams, then ``norm``
  and the untied LM head ``head.weight``.
- The MTP block ``mtp.K`` (:class:`DeepseekV4MTP`, DeepSeek-V4's ``MTPBlock``) on the streams
  before ``hc_head``, driven by the generation API's ``speculative="mtp"`` (``hidden_and_logits``
  returns those streams, ``mtp_logits`` drafts, ``qp_new_mtp_cache`` is its own cache); a
  rejected draft is rolled back by :meth:`DeepseekV4Cache.truncate`.

Matched against transformers 5.25's ``DeepseekV4ForCausalLM`` in float32 (tests/test_deepseek_v4.py);
the MTP draft against an independent MTP (tests/test_deepseek_v4_mtp.py).
The release's quantized layout (FP8 linears with ``X.scale``, FP4 routed experts) is a backend's
answer like any format's (the ``fp8`` backend); the skeleton only names the modules.
Engines: ``qp_engine_plan`` / ``qp_engine_names`` place the planned modules in transformers'
``DeepseekV4ForCausalLM`` (``quantplug_transformers``); the vLLM plugin refuses V4 (vLLM's own V4
model keeps FP8-quantized compressed KV caches, not this arithmetic).
Not here: tensor / expert parallelism (no ``qp_tp_plan``). A decode token of a float32 model is one
native call where every block has its native step (:func:`quantplug.lower.hyper_decode_logits`);
else the blocks run (each natively where it can).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..blocks.base import Decisions, lin
from ..blocks.hyper import HyperConnection, HyperHead
from ..blocks.moe import MoE
from ..blocks.v4_attention import V4Attention, V4AttentionCache, V4AttentionConfig
from ..blocks.v4_router import HashRouter, V4Router
from ..generate import GenerationMixin
from ..layers.activation import swiglu_clamp
from ..layers.embedding import Embedding
from ..layers.norm import RMSNorm
from ..lower import hyper_decode_logits
from .declarations import DenseRule, EngineEntry, EngineExperts, EngineGroupedLinear, EngineRename, Unstack
from .deepseek_v4_config import DeepseekV4Config

_W = ("w1", "w3", "w2")


#: how many tokens back a generation cache (:meth:`DeepseekV4ForCausalLM.qp_new_cache`) can be
#: truncated: speculative decoding rolls back one rejected draft per step
ROLLBACK = 16


class DeepseekV4Cache:
    """A cache of V4 attention layers (the decoder's, or an MTP block's): one
    :class:`V4AttentionCache` per layer, one length for the batch. :meth:`truncate` rolls every
    layer back (:meth:`V4Attention.truncate_cache`) to any length at most ``rollback`` tokens back
    (None: any length; the cache then keeps every token's raw rows)."""

    def __init__(self, attention: Sequence[V4Attention], rollback: int | None = None) -> None:
        self.attention = list(attention)
        self.rollback = rollback
        self.layers = [V4AttentionCache(rollback=rollback) for _ in self.attention]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def truncate(self, n: int) -> None:
        """Every layer back to its first ``n`` tokens, as if it had never seen the later ones."""
        for attn, c in zip(self.attention, self.layers):
            attn.truncate_cache(c, n)

    def bytes_per_token(self) -> int:
        """Bytes the cache grows by per token (the compressed entries and indexer keys; the
        window ring and the unfinished windows are fixed-size), in the entries' dtype."""
        total = 0.0
        for attn, c in zip(self.attention, self.layers):
            for comp, st in ((attn.compressor, c.compressor),
                             (None if attn.indexer is None else attn.indexer.compressor, c.indexer)):
                if comp is not None:
                    size = st.entries.element_size() if st.entries is not None else 4
                    total += comp.dim * size / comp.ratio
        return round(total)


class DeepseekV4Block(nn.Module):
    """``layers.L`` (or an MTP block ``mtp.K``: ``base``): mHC around the attention and around the
    MoE (see the module docstring); layer ``i`` routes by token id below ``num_hash_layers``."""

    def __init__(self, cfg: DeepseekV4Config, i: int, d: Decisions, base: str | None = None,
                 attention: V4AttentionConfig | None = None) -> None:
        super().__init__()
        base = base or f"layers.{i}"
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.index = i
        self.hash = i < cfg.num_hash_layers
        self.hc_attn = HyperConnection(d.ck(f"{base}.hc_attn"), h, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.attn_norm = RMSNorm(h, eps, d.ck(f"{base}.attn_norm"))
        self.attn = V4Attention(attention or cfg.attention[i], f"{base}.attn", d)
        self.hc_ffn = HyperConnection(d.ck(f"{base}.hc_ffn"), h, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.ffn_norm = RMSNorm(h, eps, d.ck(f"{base}.ffn_norm"))
        gate_ck = d.ck(f"{base}.ffn.gate")
        gate = HashRouter(cfg, gate_ck) if self.hash else V4Router(cfg, gate_ck)
        self.ffn = MoE(cfg, d, f"{base}.ffn", names=_W, act=swiglu_clamp(cfg.swiglu_limit), gate=gate,
                       shared_names=_W)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, cache: V4AttentionCache | None = None) -> torch.Tensor:
        """x: the streams [b, t, hc_mult, hidden]; ids: the token ids [b, t] (hash routing)."""
        x = self.hc_attn(x, lambda u: self.attn(self.attn_norm(u), cache))
        return self.hc_ffn(x, lambda u: self.ffn(self.ffn_norm(u), ids=ids))


class DeepseekV4MTP(nn.Module):
    """DeepSeek-V4's multi-token-prediction block ``mtp.K`` (DeepSeek-V4's inference code
    ``MTPBlock``): at position p it reads the main model's streams X_p after the last block (before
    ``hc_head``) and the next token t_{p+1}, mixes them per stream as
    ``U_k = e_proj(enorm(embed(t_{p+1}))) + h_proj(hnorm(X_{p,k}))``, runs a full block (layer
    index ``num_hidden_layers + K``: its ``compress_ratios`` entry, 0 in the releases: sliding
    window only; a learned router with ``gate.bias``), then its own ``hc_head`` and ``norm``; the
    main model's ``head`` gives the logits of t_{p+2}. The embedding and the head are the main
    model's (the release stores no copy; stored ``mtp.K.emb.*`` / ``mtp.K.head.*`` copies are
    skipped by the plan, rule ``mtp-copies``)."""

    def __init__(self, cfg: DeepseekV4Config, k: int, d: Decisions) -> None:
        super().__init__()
        base, h, eps = f"mtp.{k}", cfg.hidden_size, cfg.rms_norm_eps
        i = cfg.num_hidden_layers + k
        self.e_proj = lin(d, f"{base}.e_proj", h, h)
        self.h_proj = lin(d, f"{base}.h_proj", h, h)
        self.enorm = RMSNorm(h, eps, d.ck(f"{base}.enorm"))
        self.hnorm = RMSNorm(h, eps, d.ck(f"{base}.hnorm"))
        self.block = DeepseekV4Block(cfg, i, d, base, V4AttentionConfig.from_hf(cfg.raw, i))
        self.hc_head = HyperHead(d.ck(f"{base}.hc_head"), h, hc_mult=cfg.hc_mult, hc_eps=cfg.hc_eps,
                                 norm_eps=eps)
        self.norm = RMSNorm(h, eps, d.ck(f"{base}.norm"))

    def forward(self, embeds: torch.Tensor, streams: torch.Tensor, ids: torch.Tensor,
                cache: V4AttentionCache | None = None) -> torch.Tensor:
        """``embeds`` [b, t, hidden] of the tokens t_{p+1} (``ids`` [b, t]), ``streams`` [b, t,
        hc_mult, hidden] the main model's X_p: the normed output [b, t, hidden] the head reads."""
        u = self.e_proj(self.enorm(embeds)).unsqueeze(-2) + self.h_proj(self.hnorm(streams))
        return self.norm(self.hc_head(self.block(u, ids, cache)))


class DeepseekV4ForCausalLM(GenerationMixin, nn.Module):
    """DeepSeek-V4's text model and LM head, in the release's names; ``generate`` / ``stream``
    from :class:`quantplug.generate.GenerationMixin` with a :class:`DeepseekV4Cache`."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    #: the checkpoint module of MTP block k (the plan's ``mtp_layers`` decision looks for it)
    qp_mtp_module: ClassVar[str] = "mtp.{k}"
    #: stacked routed experts back to the release's layout (``quantplug.api.dense_state``): one
    #: tensor per expert named ``w1`` / ``w3`` / ``w2``
    qp_dense_state: ClassVar[Mapping[str, DenseRule]] = {
        "layers.*.ffn.experts": Unstack(stacks=("gate_proj", "up_proj", "down_proj"), stored=_W),
        "mtp.*.block.ffn.experts": Unstack(stacks=("gate_proj", "up_proj", "down_proj"), stored=_W),
    }

    def __init__(self, cfg: DeepseekV4Config, d: Decisions) -> None:
        super().__init__()
        self.config = cfg
        emb = d.ck("embed")
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, d.scheme(emb, "embedding"), emb, d.model_dtype)
        self.layers = nn.ModuleList(DeepseekV4Block(cfg, i, d) for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(d.ck("hc_head"), cfg.hidden_size, hc_mult=cfg.hc_mult, hc_eps=cfg.hc_eps,
                                 norm_eps=cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck("norm"))
        self.head = lin(d, "head", cfg.hidden_size, cfg.vocab_size)
        #: the MTP blocks the plan loads (``PlanOracle.mtp_layers``: the config's
        #: ``num_nextn_predict_layers`` unless the load option ``mtp`` is false or the checkpoint
        #: stores none), ``mtp.K`` (:attr:`qp_mtp_module`)
        self.mtp = nn.ModuleList(DeepseekV4MTP(cfg, k, d) for k in range(int(getattr(d, "mtp_layers", 0) or 0)))

    def streams(self, input_ids: torch.Tensor, cache: DeepseekV4Cache | None = None) -> torch.Tensor:
        """The 4-stream state X [b, t, hc_mult, hidden] after the last block (before ``hc_head``)
        of ``input_ids`` [b, t] (continuing ``cache``): what the MTP block reads."""
        h = self.embed(input_ids)
        x = h.unsqueeze(-2).expand(*h.shape[:-1], self.config.hc_mult, h.shape[-1]).contiguous()
        caches: list[Any] = [None] * len(self.layers) if cache is None else cache.layers
        for layer, c in zip(self.layers, caches):
            x = layer(x, input_ids, c)
        return x

    def hidden(self, input_ids: torch.Tensor, cache: DeepseekV4Cache | None = None) -> torch.Tensor:
        """The normed hidden states [b, t, hidden] of ``input_ids`` [b, t] (continuing ``cache``)."""
        return self.norm(self.hc_head(self.streams(input_ids, cache)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: DeepseekV4Cache | None = None) -> torch.Tensor:
        """Logits [b, t, vocab]; positions follow the cache (``positions`` is accepted and unused)."""
        return self.head(self.hidden(input_ids, cache))

    def next_logits(self, input_ids: torch.Tensor, cache: DeepseekV4Cache) -> torch.Tensor:
        """float32 logits [b, vocab] of the last position (a decode token: the whole model in one
        native call where every piece has its native step, :func:`quantplug.lower.hyper_decode_logits`)."""
        got = hyper_decode_logits(self, input_ids, cache)
        if got is not None:
            return got[0]
        return self.head(self.hidden(input_ids, cache)[:, -1]).float()

    def next_tokens(self, input_ids: torch.Tensor, cache: DeepseekV4Cache) -> tuple[torch.Tensor, torch.Tensor]:
        got = hyper_decode_logits(self, input_ids, cache, pick=True)
        if got is not None:
            return got[0], got[1] if got[1] is not None else got[0].argmax(dim=-1)
        logits = self.next_logits(input_ids, cache)
        return logits, logits.argmax(dim=-1)

    def hidden_and_logits(self, input_ids: torch.Tensor, cache: DeepseekV4Cache,
                          last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model on ``input_ids`` [b, t] after the ``cache``'s tokens (appended to it): the
        streams X [b, t, hc_mult, hidden] before ``hc_head`` (:meth:`streams`: what
        :meth:`mtp_logits` reads) and float32 logits [b, t, vocab] (``last_only``: [b, 1, vocab])."""
        x = self.streams(input_ids, cache)
        return x, self.head(self.norm(self.hc_head(x[:, -1:] if last_only else x))).float()

    def mtp_logits(self, next_ids: torch.Tensor, hidden: torch.Tensor, cache: DeepseekV4Cache,
                   layer: int = 0) -> torch.Tensor:
        """Draft logits (float32 [b, t, vocab]) of MTP block ``layer`` (:class:`DeepseekV4MTP`):
        ``next_ids`` [b, t] are the tokens t_{p+1}, ``hidden`` [b, t, hc_mult, hidden] the main
        model's streams X_p (:meth:`hidden_and_logits`); row p's logits predict t_{p+2}. ``cache``
        is the block's own (:meth:`qp_new_mtp_cache`), whose entry p holds the pair (X_p, t_{p+1})
        at position p (the main model's, as DeepSeek's reference and vLLM run it; its sliding
        window attends by relative position only); the t new pairs are appended. The lookup and
        the head are the main model's ``embed`` and ``head``."""
        mtp = self.mtp[layer]
        assert isinstance(mtp, DeepseekV4MTP)
        embeds = self.embed(next_ids)
        out = mtp(embeds, hidden.to(embeds.dtype), next_ids, cache.layers[0])
        return self.head(out).float()

    def qp_new_cache(self, batch: int, capacity: int, limit: int) -> DeepseekV4Cache:
        """The main model's generation cache (truncates up to :data:`ROLLBACK` tokens back)."""
        return DeepseekV4Cache([layer.attn for layer in self.layers if isinstance(layer, DeepseekV4Block)], ROLLBACK)

    def qp_new_mtp_cache(self, batch: int, capacity: int, limit: int) -> DeepseekV4Cache:
        """The first MTP block's own cache (:func:`quantplug.generate.new_mtp_cache`)."""
        mtp = self.mtp[0]
        assert isinstance(mtp, DeepseekV4MTP)
        return DeepseekV4Cache([mtp.block.attn], ROLLBACK)

    def text_lm(self) -> DeepseekV4ForCausalLM:
        return self

    #: how an engine's own DeepSeek-V4 module tree (transformers' ``DeepseekV4ForCausalLM``) takes
    #: the planned modules (``quantplug.bridge`` reads it): the routed experts called as
    #: ``fn(x, topk_ids, topk_weights)`` (the clamped SwiGLU inside), ``wo_a`` as the grouped
    #: ``o_a_proj`` (block-diagonal over ``o_groups``)
    qp_engine_plan: ClassVar[Mapping[str, EngineEntry]] = {
        "layers.*.ffn.experts": EngineExperts(),
        "layers.*.attn": EngineGroupedLinear(member="wo_a", product="grouped_wo_a"),
    }
    #: the names transformers' ``DeepseekV4ForCausalLM`` (5.25) gives the release's modules (its
    #: conversion of the release's checkpoint): ``attn`` -> ``self_attn`` (``wq_a`` -> ``q_a_proj`` ...,
    #: ``attn_sink`` -> ``sinks``), the indexer under ``self_attn.compressor.indexer`` (its compressor's
    #: tensors directly there, ``weights_proj`` under ``scorer``), compressors' ``wkv`` / ``wgate`` /
    #: ``ape`` / ``norm`` -> ``kv_proj`` / ``gate_proj`` / ``position_bias`` / ``kv_norm``, ``hc_attn`` /
    #: ``hc_ffn`` -> ``attn_hc`` / ``ffn_hc``, ``ffn`` -> ``mlp``, the text model under ``model.``
    qp_engine_names: ClassVar[tuple[EngineRename, ...]] = (
        EngineRename(r"^embed(?=\.|$)", "model.embed_tokens"),
        EngineRename(r"^head(?=\.|$)", "lm_head"),
        EngineRename(r"^norm(?=\.|$)", "model.norm"),
        EngineRename(r"^hc_head\.(fn|base|scale)$", r"model.hc_head.hc_\1"),
        EngineRename(r"^layers\.", "model.layers."),
        EngineRename(r"\.hc_(attn|ffn)(?=\.|$)", r".\1_hc"),
        EngineRename(r"\.attn_norm(?=\.|$)", ".input_layernorm"),
        EngineRename(r"\.ffn_norm(?=\.|$)", ".post_attention_layernorm"),
        EngineRename(r"\.compressor\.wkv(?=\.|$)", ".compressor.kv_proj"),
        EngineRename(r"\.compressor\.wgate(?=\.|$)", ".compressor.gate_proj"),
        EngineRename(r"\.compressor\.ape\.weight$", ".compressor.position_bias"),
        EngineRename(r"\.compressor\.norm(?=\.|$)", ".compressor.kv_norm"),
        EngineRename(r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
        EngineRename(r"\.attn\.indexer\.wq_b(?=\.|$)", ".attn.compressor.indexer.q_b_proj"),
        EngineRename(r"\.attn\.indexer\.weights_proj(?=\.|$)", ".attn.compressor.indexer.scorer.weights_proj"),
        EngineRename(r"\.attn\.wq_a(?=\.|$)", ".attn.q_a_proj"),
        EngineRename(r"\.attn\.q_norm(?=\.|$)", ".attn.q_a_norm"),
        EngineRename(r"\.attn\.wq_b(?=\.|$)", ".attn.q_b_proj"),
        EngineRename(r"\.attn\.wkv(?=\.|$)", ".attn.kv_proj"),
        EngineRename(r"\.attn\.wo_a(?=\.|$)", ".attn.o_a_proj"),
        EngineRename(r"\.attn\.wo_b(?=\.|$)", ".attn.o_b_proj"),
        EngineRename(r"\.attn\.attn_sink\.weight$", ".attn.sinks"),
        EngineRename(r"\.attn(?=\.|$)", ".self_attn"),
        EngineRename(r"\.ffn(?=\.|$)", ".mlp"),
    )
