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

Matched against transformers 5.25's ``DeepseekV4ForCausalLM`` in float32 (tests/test_deepseek_v4.py).
The release's quantized layout (FP8 linears with ``X.scale``, FP4 routed experts) is a backend's
answer like any format's (the ``fp8`` backend); the skeleton only names the modules.
Engines: ``qp_engine_plan`` / ``qp_engine_names`` place the planned modules in transformers'
``DeepseekV4ForCausalLM`` (``quantplug_transformers``); the vLLM plugin refuses V4 (vLLM's own V4
model keeps FP8-quantized compressed KV caches, not this arithmetic).
Not here: the MTP block (``mtp.N.*``: the plan lists its tensors as skipped, rule ``mtp``), the
native lowering (every block runs its torch forward) and
tensor / expert parallelism (no ``qp_tp_plan``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from ..blocks.base import Decisions, lin
from ..blocks.hyper import HyperConnection, HyperHead
from ..blocks.moe import MoE
from ..blocks.v4_attention import V4Attention, V4AttentionCache
from ..blocks.v4_router import HashRouter, V4Router
from ..generate import GenerationMixin
from ..layers.activation import swiglu_clamp
from ..layers.embedding import Embedding
from ..layers.norm import RMSNorm
from .declarations import DenseRule, EngineEntry, EngineExperts, EngineGroupedLinear, EngineRename, Unstack
from .deepseek_v4_config import DeepseekV4Config

_W = ("w1", "w3", "w2")


class DeepseekV4Cache:
    """The generation cache: one :class:`V4AttentionCache` per layer (one length for the batch)."""

    def __init__(self, layers: int) -> None:
        self.layers = [V4AttentionCache() for _ in range(layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def truncate(self, n: int) -> None:
        """Only to its own length: the compressors' pooled windows cannot be rolled back (no
        speculative decoding, which also needs the MTP block V4 does not load here)."""
        if n != self.length:
            raise ValueError(f"a DeepSeek-V4 cache cannot be rolled back from {self.length} to {n} tokens")


class DeepseekV4Block(nn.Module):
    """``layers.L``: mHC around the attention and around the MoE (see the module docstring)."""

    def __init__(self, cfg: DeepseekV4Config, i: int, d: Decisions) -> None:
        super().__init__()
        base = f"layers.{i}"
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.index = i
        self.hash = i < cfg.num_hash_layers
        self.hc_attn = HyperConnection(d.ck(f"{base}.hc_attn"), h, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.attn_norm = RMSNorm(h, eps, d.ck(f"{base}.attn_norm"))
        self.attn = V4Attention(cfg.attention[i], f"{base}.attn", d)
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


class DeepseekV4ForCausalLM(GenerationMixin, nn.Module):
    """DeepSeek-V4's text model and LM head, in the release's names; ``generate`` / ``stream``
    from :class:`quantplug.generate.GenerationMixin` with a :class:`DeepseekV4Cache`."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    #: stacked routed experts back to the release's layout (``quantplug.api.dense_state``): one
    #: tensor per expert named ``w1`` / ``w3`` / ``w2``
    qp_dense_state: ClassVar[Mapping[str, DenseRule]] = {
        "layers.*.ffn.experts": Unstack(stacks=("gate_proj", "up_proj", "down_proj"), stored=_W),
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
        self.mtp = nn.ModuleList()

    def hidden(self, input_ids: torch.Tensor, cache: DeepseekV4Cache | None = None) -> torch.Tensor:
        """The normed hidden states [b, t, hidden] of ``input_ids`` [b, t] (continuing ``cache``)."""
        h = self.embed(input_ids)
        x = h.unsqueeze(-2).expand(*h.shape[:-1], self.config.hc_mult, h.shape[-1]).contiguous()
        caches: list[Any] = [None] * len(self.layers) if cache is None else cache.layers
        for layer, c in zip(self.layers, caches):
            x = layer(x, input_ids, c)
        return self.norm(self.hc_head(x))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: DeepseekV4Cache | None = None) -> torch.Tensor:
        """Logits [b, t, vocab]; positions follow the cache (``positions`` is accepted and unused)."""
        return self.head(self.hidden(input_ids, cache))

    def next_logits(self, input_ids: torch.Tensor, cache: DeepseekV4Cache) -> torch.Tensor:
        """float32 logits [b, vocab] of the last position."""
        return self.head(self.hidden(input_ids, cache)[:, -1]).float()

    def next_tokens(self, input_ids: torch.Tensor, cache: DeepseekV4Cache) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.next_logits(input_ids, cache)
        return logits, logits.argmax(dim=-1)

    def hidden_and_logits(self, input_ids: torch.Tensor, cache: DeepseekV4Cache,
                          last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.hidden(input_ids, cache)
        return hidden, self.head(hidden[:, -1:] if last_only else hidden).float()

    def qp_new_cache(self, batch: int, capacity: int, limit: int) -> DeepseekV4Cache:
        return DeepseekV4Cache(len(self.layers))

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
