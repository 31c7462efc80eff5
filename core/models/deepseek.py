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

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

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
from ..blocks.mla import MLA
from ..blocks.mlp import MLP
from ..blocks.moe import Experts as Experts
from ..blocks.moe import MoE
from ..blocks.router import Router
from ..generate import GenerationMixin
from ..kernels import compute
from ..kernels.compute import NATIVE_ROWS, DraftStep, StackLayer, StackStep
from ..layers.embedding import Embedding as Embedding
from ..layers.embedding import TiedHead
from ..layers.norm import RMSNorm
from ..layers.rope import Rotary
from .config import ModelConfig
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


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer ``model.layers.{i}``: ``x + attn(norm(x))``, then
    ``x + mlp(norm(x))``; the MLP is a :class:`MoE` from ``first_k_dense_replace`` on, else a
    dense :class:`MLP`."""

    def __init__(self, cfg: ModelConfig, i: int, d: Decisions, rotary: Rotary) -> None:
        super().__init__()
        base = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck(f"{base}.input_layernorm"))
        self.self_attn = MLA(cfg, i, d, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                d.ck(f"{base}.post_attention_layernorm"))
        self.mlp: nn.Module = (MoE(cfg, d, f"{base}.mlp") if cfg.is_moe_layer(i)
                               else MLP(d, f"{base}.mlp", cfg.hidden_size, cfg.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def stack_step(self) -> StackStep | None:
        """The block and ``shared_head.norm`` as one native step (:func:`stack_step`), built on
        first use; None where the block runs another way."""
        st = self.__dict__.get("_stack", False)
        if st is False:
            st = stack_step([self.block], self.head_norm, [self.head_norm])
            object.__setattr__(self, "_stack", st)  # not a submodule: a step over this layer's modules
        return st

    def draft_step(self) -> DraftStep | None:
        """The whole layer as the drafter of a native speculative step (:class:`DraftStep`), built
        on first use; None where the block runs another way."""
        st = self.__dict__.get("_draft", False)
        if st is False:
            st = DraftStep.build(self.stack_step(), self.enorm, self.hnorm, self.eh_proj)
            object.__setattr__(self, "_draft", st)
        return st


def stack_step(layers: Sequence[nn.Module], norm: RMSNorm, extra: Sequence[nn.Module]) -> StackStep | None:
    """The native step of decoder ``layers`` then the final ``norm`` in one call
    (:class:`quantplug.kernels.compute.StackStep`; ``extra``: other modules whose hooks it would
    skip); None when any layer runs another way: experts served from files or split over ranks, a
    piece without a native form, an architecture's own router, a DSA indexer, a float16 model."""
    parts: list[StackLayer] = []
    owners: list[tuple[nn.Module, Any]] = []
    for layer in layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        if attn.step is None or attn.indexer is not None or n1.eps != n2.eps:
            return None
        owners.append((attn, attn.step))
        if isinstance(mlp, MLP):
            if mlp.step is None:
                return None
            parts.append(StackLayer(mla=attn.step, attn_norm=n1.weight, ffn_norm=n2.weight, eps=n1.eps, mlp=mlp.step))
            owners.append((mlp, mlp.step))
            continue
        assert isinstance(mlp, MoE)
        if type(mlp.gate) is not Router:  # the native step routes as Router does (an architecture's own router: not)
            return None
        ex, cfg, shared = mlp.experts, mlp.gate.cfg, mlp.shared_experts
        if (ex.step is None or ex.qp_store is not None or ex.qp_parallel is not None
                or (ex.first, ex.count, ex.slot_base) != (0, ex.n, 0) or len(ex.step.gate.mats) != ex.n
                or (shared is not None and shared.step is None)):
            return None
        owners += [(ex, ex.step)] + ([] if shared is None else [(shared, shared.step)])
        parts.append(StackLayer(mla=attn.step, attn_norm=n1.weight, ffn_norm=n2.weight, eps=n1.eps,
                                experts=ex.step, router=mlp.gate.weight, bias=mlp.gate.e_score_correction_bias,
                                top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                norm_topk=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor,
                                shared=None if shared is None else shared.step))
    modules = [m for layer in layers for m in layer.modules()] + list(extra)
    return StackStep.build(parts, norm.weight, norm.eps, norm.weight.numel(), modules, owners)


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, d: Decisions) -> None:
        super().__init__()
        emb = d.ck("model.embed_tokens")
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, d.scheme(emb, "embedding"), emb, d.model_dtype)
        self.rotary = Rotary(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, d, self.rotary) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck("model.norm"))
        #: the whole stack's decode step (:meth:`_stack_step`)
        self._stack: StackStep | None = None
        self._stack_tried = False

    def qp_fuse(self) -> None:
        """After loading: each MoE layer learns the next one (for expert prefetch)."""
        moes = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]
        for a, b in zip(moes, moes[1:]):
            object.__setattr__(a, "qp_next", b)  # a reference, not a submodule (no second name, no state)
        self._stack, self._stack_tried = None, False  # built on the first decode step, after every layer's fuse

    def _stack_step(self) -> StackStep | None:
        """The whole stack's native decode step (:class:`quantplug.kernels.compute.StackStep`),
        built once on first use; None when any layer runs another way (:func:`stack_step`), and
        always for a DSA model (DeepSeek-V3.2): the stack step composes the layers' MLA steps,
        which neither write the indexer's keys nor select keys, so a DSA model decodes layer by
        layer (each layer's own native MLA step still runs while every key is selected, see
        :meth:`MLA.forward`)."""
        if self._stack is not None or self._stack_tried:
            return self._stack
        self._stack_tried = True
        self._stack = stack_step(list(self.layers), self.norm, [self.norm])
        return self._stack

    def decode_stack(self) -> StackStep | None:
        """The whole stack's one-call decode step (:class:`quantplug.kernels.compute.StackStep`) for
        an engine that keeps its own (paged) latent cache (:func:`quantplug.bridge.paged_decode`);
        None where this model decodes layer by layer (see :meth:`_stack_step`)."""
        return self._stack_step()

    def decode_logits(self, ids: torch.Tensor, cache: MLACache, head: nn.Module,
                      pick: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """One decode step (``ids`` [B, 1] after the ``cache``'s tokens) from token ids to float32
        logits [B, vocab] through ``head``, in one native call: the embedding lookup, the whole
        stack (:meth:`_stack_step`) and the head; what :meth:`forward` and then ``head`` compute.
        Returns (logits, with ``pick`` the greedy tokens [B] = ``logits.argmax(-1)``, else None);
        None (nothing appended) when a piece runs another way: then the caller runs the modules."""
        if ids.dim() != 2 or ids.shape[1] != 1 or ids.shape[0] > NATIVE_ROWS:
            return None
        st = self._stack_step()
        if st is None:
            return None
        bound = self._bindings(head)
        if bound is None:
            return None
        rot = self.rotary.step_rotation(cache.length, st.dtype)
        got = st.logits(ids, bound[0], rot, cache.layers, bound[1], pick)
        if got is None:
            return None
        assert got[1] is not None  # a head was given
        return got[1], got[2]

    def sequence_logits(self, ids: torch.Tensor, cache: MLACache, head: nn.Module,
                        pick: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``ids`` [1, T] (T <= NATIVE_ROWS) after the ``cache``'s tokens (batch 1) in one native
        call: embedding, the whole stack with each token attending causally on the cache and the
        tokens before it, and ``head`` (:meth:`StackStep.sequence`): what :meth:`forward` and then
        ``head`` compute, row by row as T one-token steps. Returns (the final norm [1, T, hidden],
        float32 logits [T, vocab], with ``pick`` the greedy picks [T]); None (nothing appended) when
        a piece runs another way: then the caller runs the modules. Speculative decoding verifies
        its draft this way."""
        if ids.dim() != 2 or ids.shape[0] != 1 or not 1 <= ids.shape[1] <= NATIVE_ROWS:
            return None
        st = self._stack_step()
        bound = None if st is None else self._bindings(head)
        if st is None or bound is None:
            return None
        rot = self.rotary.step_rotations(cache.length, ids.shape[1], st.dtype)
        got = st.sequence(ids[0], None, bound[0], rot, cache.layers, bound[1], pick)
        if got is None:
            return None
        assert got[1] is not None  # a head was given
        return got[0], got[1], got[2]

    def _bindings(self, head: nn.Module) -> tuple[compute.Bound, compute.Bound] | None:
        """The native bindings of the embedding and of ``head`` (any head module), or None when
        either runs another way (split over ranks, hooked, no native form)."""
        emb = self.embed_tokens
        if emb.qp_parallel is not None or _hooked(emb) or _hooked(head) or getattr(head, "qp_parallel", None) is not None:
            return None
        embed = compute.bound(emb)
        hb = compute.bound(head.qp_tied_embedding() if isinstance(head, TiedHead) else head)
        return None if embed is None or hb is None else (embed, hb)

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
        if cache is not None and ids.shape[1] == 1 and ids.shape[0] <= NATIVE_ROWS:
            st = self._stack_step()
            if st is not None:
                out = st(x, self.rotary._rotation(cos, sin), cache.layers)
                if out is not None:
                    return out
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if cache is None else cache.layers[i])
        return self.norm(x)


def _hooked(m: nn.Module) -> bool:
    """Whether a module has forward hooks of its own (a fused step would skip them)."""
    return bool(m._forward_hooks or m._forward_pre_hooks)


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
        if input_ids.shape[1] == 1:
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
        if next_ids.shape[0] == 1 and next_ids.shape[1] <= NATIVE_ROWS:
            got = self._mtp_native(mtp, next_ids, hidden, cache, start)
            if got is not None:
                return got
        positions = torch.arange(start, start + next_ids.shape[1], device=next_ids.device)
        positions = positions.unsqueeze(0).expand(next_ids.shape[0], -1)
        embeds = self.model.embed_tokens(next_ids)
        cos, sin = self.model.rotary.cos_sin(positions, embeds.dtype)
        out = mtp(embeds, hidden.to(embeds.dtype), cos, sin, cache.layers[0])
        return self.lm_head(out).float()

    def speculative_step(self, last: torch.Tensor, draft: torch.Tensor, cache: MLACache,
                         mtp_cache: MLACache) -> tuple[list[int], bool, torch.Tensor, torch.Tensor] | None:
        """One greedy speculative step of batch 1 in one native call (``qp_spec_step``): the main
        model on (``last``, ``draft``) [1] each after the ``cache``'s tokens, accepted when its pick
        after ``last`` is ``draft``; then the first MTP layer on the accepted pairs, appended to
        ``mtp_cache``, and the LM head on its last row. Returns (the picks after ``last`` and after
        ``draft``, accepted, the draft logits [1, vocab] as :meth:`mtp_logits` gives the last row's,
        float32 logits [2, vocab] of both positions); the
        main cache holds both tokens (the caller rolls ``draft`` back when rejected). None when a
        piece runs another way (nothing appended): then the caller runs the modules
        (:meth:`hidden_and_logits`, :meth:`mtp_logits`)."""
        if not len(self.mtp):
            return None
        mtp = self.mtp[0]
        assert isinstance(mtp, MTPLayer)
        st, dr = self.model._stack_step(), mtp.draft_step()
        if st is None or dr is None or _hooked(mtp):
            return None
        bound = self.model._bindings(self.lm_head)
        proj = compute.bound(mtp.eh_proj)
        if bound is None or proj is None:
            return None
        rotary = self.model.rotary
        rot = rotary.step_rotations(cache.length, 2, st.dtype)
        drot = rotary.step_rotations(mtp_cache.length + 1, 2, st.dtype)
        ids = torch.cat([last.reshape(1), draft.reshape(1)])
        got = st.speculate(ids, bound[0], rot, cache.layers, bound[1], dr, proj, mtp_cache.layers, drot)
        if got is None:
            return None
        _, logits, dlogits, (a, b, acc) = got
        return [a, b], acc, dlogits, logits

    def _mtp_native(self, mtp: MTPLayer, next_ids: torch.Tensor, hidden: torch.Tensor, cache: MLACache,
                    start: int) -> torch.Tensor | None:
        """:meth:`mtp_logits` of one sequence with the MTP block, its head norm and the LM head in
        one native call (:meth:`MTPLayer.stack_step`; the norms and ``eh_proj`` before it as the
        modules run them); None when a piece runs another way (nothing appended)."""
        st = mtp.stack_step()
        bound = None if st is None else self.model._bindings(self.lm_head)
        if st is None or bound is None:
            return None
        embeds = self.model.embed_tokens(next_ids)
        u = mtp.mix(embeds, hidden.to(embeds.dtype))[0]
        rot = self.model.rotary.step_rotations(start, next_ids.shape[1], st.dtype)
        got = st.sequence(None, u, None, rot, cache.layers, bound[1])
        if got is None or got[1] is None:
            return None
        return got[1].unsqueeze(0)

    def text_lm(self) -> DeepseekV3ForCausalLM:
        return self


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 with DSA, a lightning :class:`Indexer` in
    every attention layer (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``) whose top
    ``index_topk`` keys are the ones each query attends to. Decodes layer by layer (no whole-stack
    native step: :meth:`TextModel._stack_step`)."""


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

