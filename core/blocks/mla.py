"""Multi-head latent attention (MLA): q-LoRA or a plain ``q_proj``, RoPE or none (:class:`NoRope`),
an optional output gate, a dense ``kv_b_proj`` or its per-head split ``k_b`` / ``v_b``, and with
DSA (DeepSeek-V3.2) a lightning :class:`~quantplug.blocks.indexer.Indexer`.

MLA output gate (``mla_use_output_gate``, as Kimi-K3's MLA has one): ``g_proj`` (Linear
hidden_size -> num_heads * v_head_dim, no bias); the attention output, before ``o_proj``, is
multiplied elementwise by ``sigmoid(g_proj(hidden_states))`` of the block's (normed) input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..contract.config import RopeConfig
from ..layers.linear import StackedLayout, StackedLinear, fuse_projections
from ..layers.norm import RMSNorm
from ..layers.rope import Rotary, softmax_scale
from .base import Decisions, lin
from .cache import LatentCache
from .indexer import Indexer

if TYPE_CHECKING:
    from ..contract.config import ModelConfig


class MLA(nn.Module):
    """Multi-head latent attention; ``kv_b_proj`` dense, or split per head into k_b / v_b; with
    DSA (DeepSeek-V3.2) a lightning :class:`Indexer` choosing the keys each query attends to."""

    #: its checkpoint name
    qp_ckpt: str
    #: the native decode step the lowering bound (:class:`quantplug.kernels.compute.MLAStep`,
    #: :mod:`quantplug.lower`), None: none
    step: Any = None
    #: a decode step in one call from o_proj's scheme (deprecated :meth:`LinearScheme.fuse_attention`,
    #: bound by the lowering)
    one: Any = None

    def __init__(self, cfg: ModelConfig, i: int, d: Decisions, rotary: Rotary) -> None:
        super().__init__()
        base = f"model.layers.{i}.self_attn"
        self.qp_ckpt = d.ck(base)
        self.cfg = cfg
        self.rotary = [rotary]
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.q_lora = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = lin(d, f"{base}.q_proj", h, nh * cfg.qk_head_dim)
        else:
            self.q_a_proj = lin(d, f"{base}.q_a_proj", h, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, d.ck(f"{base}.q_a_layernorm"))
            self.q_b_proj = lin(d, f"{base}.q_b_proj", cfg.q_lora_rank, nh * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(d, f"{base}.kv_a_proj_with_mqa", h, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, d.ck(f"{base}.kv_a_layernorm"))
        self.layout = d.layout(d.ck(base))
        if self.layout.kind == "dense":
            self.kv_b_proj = lin(d, f"{base}.kv_b_proj", cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        else:
            assert self.layout.k_b and self.layout.v_b
            self.k_b = StackedLinear(nh, cfg.qk_nope_head_dim, cfg.kv_lora_rank, d.scheme(self.layout.k_b, "attn_k_b"),
                                     self.layout.k_b, StackedLayout(self.layout.k_b), d.model_dtype)
            self.v_b = StackedLinear(nh, cfg.kv_lora_rank, cfg.v_head_dim, d.scheme(self.layout.v_b, "attn_v_b"),
                                     self.layout.v_b, StackedLayout(self.layout.v_b), d.model_dtype)
        if cfg.mla_use_output_gate:
            self.g_proj = lin(d, f"{base}.g_proj", h, nh * cfg.v_head_dim)
        self.o_proj = lin(d, f"{base}.o_proj", nh * cfg.v_head_dim, h)
        #: DSA's lightning indexer (DeepSeek-V3.2), None for dense MLA
        self.indexer: Indexer | None = Indexer(cfg, f"{base}.indexer", d) if cfg.has_indexer else None
        self.scale = softmax_scale(cfg.rope, cfg.qk_head_dim)
        #: heads computed here: all of them, or this rank's share under tensor parallelism
        #: (:meth:`qp_hold_heads`: q/kv_b/g_proj/k_b/v_b hold these heads, o_proj all-reduces)
        self.num_heads = nh
        #: latent dims the cache holds per token (not split over ranks)
        self.kv_lora_rank, self.qk_rope_head_dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        #: per-head widths of the K / V up-projections (:class:`~quantplug.models.declarations.LatentAttention`)
        self.qk_nope_head_dim, self.v_head_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        self._kv_b_heads: tuple[torch.Tensor, torch.Tensor] | None = None
        #: q_a_proj and kv_a_proj_with_mqa (same input) in one call when their scheme fuses them
        self.qkv_a: Any = None

    def qp_heads(self) -> int:
        """All heads of the layer (``HeadParallel``: the tensor-parallel plan splits them)."""
        return self.cfg.num_attention_heads

    def qp_hold_heads(self, start: int, count: int) -> None:
        """This rank computes heads ``[start, start + count)`` (its linears and stacks hold them)."""
        self.num_heads = count

    def qp_fuse(self) -> None:
        """Sibling projections a scheme runs as one (:meth:`LinearScheme.fuse`): q_a and kv_a."""
        if self.q_lora is not None:
            self.qkv_a = fuse_projections([self.q_a_proj, self.kv_a_proj_with_mqa])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None) -> torch.Tensor:
        """x [b, t, hidden]; with ``cache`` the t tokens follow the ``cache.length`` cached ones
        (their latent is appended) and attend to all of them (with DSA: to those the indexer keeps).

        DSA (an :class:`Indexer`): while every query has at most ``index_topk`` causal keys
        (``cache.length + t <= index_topk``) the indexer keeps all of them and DSA is dense MLA, so
        every path below runs unchanged, a lowered decode step included (:mod:`quantplug.lower`);
        the indexer only caches its keys (written after the step, at the rows it appended). Past
        that, :meth:`_attend` runs with ``sparse``: a prompt masks each query's unselected keys; a
        decode step gathers its selected latent rows and attends on those only (cost follows
        ``index_topk``, not the context), in torch (no native step).
        """
        ix = self.indexer
        if ix is None:
            return self._attend(x, cos, sin, cache)
        past = cache.length if cache is not None else 0
        if past + x.shape[1] > ix.topk:
            return self._attend(x, cos, sin, cache, sparse=True)
        if cache is None:
            return self._attend(x, cos, sin, None)
        keys, scales = ix.keys(x, cos, sin)
        out = self._attend(x, cos, sin, cache)
        cache.put_index(past, keys, scales)
        return out

    def _attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None,
                sparse: bool = False) -> torch.Tensor:
        """Attention of ``x`` (see :meth:`forward`); ``sparse``: DSA with the indexer's selection
        (the indexer's keys are appended with the latent).

        Without a cache, or for the first chunk into an empty one, the dense layout runs the
        expanded form (K/V per head from ``kv_b_proj``), exactly as a forward without cache.
        Later chunks attend on the cached latent: the split K/V layout and a dense ``kv_b_proj``
        whose scheme is ``weight_only`` use the absorbed form (q_nope through W_UK, attention on
        the latent, W_UV after); any other dense scheme (one that quantizes activations) expands
        K/V from the cached latent through its own ``apply`` (exact, O(cached tokens) per step).
        """
        cfg = self.cfg
        b, t, _ = x.shape
        nh, nope, rope, v = self.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qr, q, ckv = self._qr_q_latent(x)
        q = q.view(b, t, nh, nope + rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
        kv_nope, k_rot = torch.split(ckv, [self.kv_lora_rank, rope], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(b, 1, t, self.kv_lora_rank)
        k_rot = k_rot.reshape(b, 1, t, rope)
        rot = self.rotary[0]
        q_rot, k_rot = rot.rotate(q_rot, cos, sin), rot.rotate(k_rot, cos, sin)
        past = 0
        ikeys = iscales = None
        if sparse:
            assert self.indexer is not None
            ikeys, iscales = self.indexer.keys(x, cos, sin)          # [b, 1, t, index_head_dim]
        if cache is not None:
            past = cache.length
            kv_nope, k_rot = cache.append(kv_nope, k_rot, ikeys, iscales)   # [b, 1, past + t, ...]
            if sparse:
                ikeys, iscales = cache.index_keys(), cache.index_scales()
        keep = None  # DSA prompt: [b, 1, t, n], True where a query attends (causal and selected)
        if sparse:
            assert self.indexer is not None and ikeys is not None and qr is not None
            idx = self.indexer.select(x, qr, cos, sin, ikeys[:, 0], None if iscales is None else iscales[:, 0],
                                      past)                                  # [b, t, k]
            if t == 1:
                # a decode step reads its selected rows only (all are <= its position)
                kv_nope, k_rot = _rows(kv_nope, idx), _rows(k_rot, idx)
            else:
                n = kv_nope.shape[-2]
                causal = ~torch.ones(t, n, dtype=torch.bool, device=x.device).triu(past + 1)
                chosen = torch.zeros(b, t, n, dtype=torch.bool, device=x.device).scatter_(-1, idx, True)
                keep = (chosen & causal).unsqueeze(1)
        if self.layout.kind != "dense":
            # Absorbed form (llama.cpp): scores = (q_nope k_b) . c + q_rot . k_rot; out = (p c) v_b^T.
            q_lat = self.k_b.forward_all(q_pass)                      # [b, nh, t, kv_lora]
            out = self.v_b.forward_all(self._latent_attention(q_lat, q_rot, kv_nope, k_rot, past, keep))
        elif past == 0 and kv_nope.shape[-2] == t:
            kv = self.kv_b_proj(kv_nope).view(b, t, nh, nope + v).transpose(1, 2)
            k_nope, val = torch.split(kv, [nope, v], dim=-1)
            k = torch.cat([k_nope, k_rot.expand(-1, nh, -1, -1)], dim=-1)
            qs = torch.cat([q_pass, q_rot], dim=-1)
            if keep is None:
                out = F.scaled_dot_product_attention(qs, k, val, is_causal=True, scale=self.scale)
            else:
                out = F.scaled_dot_product_attention(qs, k, val, attn_mask=keep, scale=self.scale)
        elif self.kv_b_proj.scheme.weight_only:
            w_uk, w_uv_t = self._kv_b_per_head()
            out = self._latent_attention(q_pass @ w_uk, q_rot, kv_nope, k_rot, past, keep) @ w_uv_t
        else:
            n = kv_nope.shape[-2]
            kv = self.kv_b_proj(kv_nope).view(b, n, nh, nope + v).transpose(1, 2)
            k_nope, val = torch.split(kv, [nope, v], dim=-1)
            k = torch.cat([k_nope, k_rot.expand(-1, nh, -1, -1)], dim=-1)
            qs = torch.cat([q_pass, q_rot], dim=-1)
            mask = keep
            if mask is None and t > 1:
                mask = ~torch.ones(t, n, dtype=torch.bool, device=x.device).triu(past + 1)
            out = F.scaled_dot_product_attention(qs, k, val, attn_mask=mask, scale=self.scale)
        out = out.transpose(1, 2).reshape(b, t, nh * v)
        if cfg.mla_use_output_gate:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)

    def _q_and_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries (all heads, nope + rope each) and the compressed KV (latent + rope key,
        before its norm) of ``x``; q_a and kv_a in one call when their scheme fused them."""
        _, q, ckv = self._qr_q_latent(x)
        return q, ckv

    def _qr_q_latent(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """:meth:`_q_and_latent` with the compressed query ``qr = q_a_layernorm(q_a_proj(x))`` first
        (None without q LoRA); DSA's indexer reads it."""
        if self.qkv_a is not None:
            q_lat, ckv = self.qkv_a(x).split([self.q_a_proj.out_features, self.kv_a_proj_with_mqa.out_features], dim=-1)
            qr = self.q_a_layernorm(q_lat)
            return qr, self.q_b_proj(qr), ckv
        if self.q_lora is None:
            return None, self.q_proj(x), self.kv_a_proj_with_mqa(x)
        qr = self.q_a_layernorm(self.q_a_proj(x))
        return qr, self.q_b_proj(qr), self.kv_a_proj_with_mqa(x)

    def _latent_attention(self, q_lat: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor,
                          k_rot: torch.Tensor, past: int, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Attention on the latent: q_lat [b, nh, t, kv_lora], q_rot [b, nh, t, rope] against the
        latent [b, 1, n, kv_lora] and k_rot [b, 1, n, rope] of n = past + t tokens; query i sees
        keys <= past + i, or with ``keep`` [b, 1, t, n] the keys where it is True (DSA).
        Returns p @ latent [b, nh, t, kv_lora]."""
        t, n = q_lat.shape[-2], latent.shape[-2]
        scores = (q_lat @ latent.transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * self.scale
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        elif t > 1:
            mask = torch.ones(t, n, dtype=torch.bool, device=q_lat.device).triu(past + 1)
            scores = scores.masked_fill(mask, float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
        return p @ latent

    def _kv_b_per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``kv_b_proj`` [nh * (nope + v), kv_lora] per head for the absorbed decode: W_UK
        [nh, nope, kv_lora] and W_UV^T [nh, kv_lora, v]. Made once, on the first decode step,
        through the scheme's ``dequantize``: views of the weight for the core's dense scheme (no
        memory), otherwise one dense copy of this layer's kv_b_proj kept on the module."""
        if self._kv_b_heads is None:
            nope, v = self.cfg.qk_nope_head_dim, self.cfg.v_head_dim
            w = self.kv_b_proj.scheme.dequantize(self.kv_b_proj).view(self.num_heads, nope + v, self.kv_lora_rank)
            self._kv_b_heads = (w[:, :nope], w[:, nope:].transpose(1, 2))
        return self._kv_b_heads


def _rows(cached: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The rows ``idx`` [b, 1, k] of ``cached`` [b, 1, n, dim]: [b, 1, k, dim]."""
    dim = cached.shape[-1]
    return torch.gather(cached, 2, idx.unsqueeze(-1).expand(-1, -1, -1, dim))


class NoRope(Rotary):
    """MLA without RoPE (``mla_use_nope``): rotations by angle 0 (cos 1, sin 0), exactly the
    identity, so every MLA path of the core (the native step included) runs unchanged."""

    def __init__(self, dim: int) -> None:
        super().__init__(RopeConfig(10000.0, "default"), dim, True)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*positions.shape, self.inv_freq.numel() * 2)
        return (torch.ones(shape, dtype=dtype, device=positions.device),
                torch.zeros(shape, dtype=dtype, device=positions.device))
