"""DeepSeek-V4's attention (SWA / CSA / HCA layers) as a block: its forward is the math.

What it implements (DeepSeek-V4's inference code ``model.py`` ``Attention``; matched against transformers 5.25
``DeepseekV4Attention`` and its compressors / indexer, tests/test_v4_attention.py):

- q: ``q_norm(wq_a x)`` (weighted RMSNorm) -> ``wq_b`` -> [H, head_dim], then an unweighted RMSNorm
  per head; kv: ``kv_norm(wkv x)``, one head shared as key and value (MQA).
- RoPE on the trailing ``qk_rope_head_dim`` dims, interleaved pairs rotated in place
  (:class:`~quantplug.blocks.v4_compressor.V4Rope`): SWA layers ``rope_theta`` without YaRN,
  compressed layers ``compress_rope_theta`` with the config's YaRN frequencies and no magnitude
  factor (q, window kv, compressed entries, indexer q / keys alike).
- Keys of query p: the window p - W < s <= p (``sliding_window`` W), plus on HCA layers every
  compressed entry j < (p + 1) // r, on CSA layers (r = 4) those of them the lightning indexer
  keeps (``index_topk``); one softmax over both (scale head_dim^-1/2) with the per-head
  ``attn_sink`` as an extra logit of zero value.
- The output's rope dims rotated back by -p (the inverse rotation), then the grouped low-rank
  projection: ``wo_a`` block-diagonal over ``o_groups`` groups of heads (``o_lora_rank`` each),
  then ``wo_b``.
- Compressors (``compressor.{wkv,wgate,ape,norm}``): per-channel softmax pooling over each window
  of r tokens (CSA: overlapping windows, 2 * head_dim wide projections), RMSNorm, RoPE at r * j.
- Release tensor names (E2, no ``model.`` prefix) under the base ``layers.L.attn``: ``wq_a``,
  ``q_norm``, ``wq_b``, ``wkv``, ``kv_norm``, ``wo_a``, ``wo_b``, ``attn_sink`` (float32),
  ``compressor.*``, ``indexer.{wq_b,weights_proj}``, ``indexer.compressor.*``.
- A per-sequence cache (:class:`V4AttentionCache`): the last W - 1 window rows, each compressor's
  unfinished window, overlap halves and entries; a forward of t tokens after it attends exactly as
  one forward of the whole sequence would. :meth:`V4Attention.truncate_cache` rolls it back to
  an earlier length (speculative decoding) from a log of the raw per-token rows it keeps.
- A long prompt is attended a block of queries at a time (:data:`ATTN_SCORE_BYTES` of scores; the
  indexer likewise, :data:`~quantplug.blocks.indexer.INDEX_SCORE_BYTES`), each block over its own
  window slice and the compressed entries: memory O(block * (W + t / r)), not O(t^2).

Matched (tests/test_v4_attention.py, tiny float32 config, 48 tokens, W 8, CSA r 4 with top-3 of
up to 12 entries, HCA r 8): prompt output vs transformers max error 0 (bitwise) for SWA, CSA and
HCA; chunked / single-step cached runs vs the prompt and vs transformers' own cached run <= 1.1e-6;
a bf16 model within ~1% of the float32 output.

Not here (yet): DeepSeek's QAT numerics (FP8 round trips of the window / compressed KV, the
indexer's Hadamard + FP4 rounding, E4), tensor parallelism, a ring buffer for the
window (the cache concatenates and trims), a load of
a real (FP8 / E8M0) checkpoint through the plan (the linears take the plan's schemes, but only
dense ones are tested here), per-sequence lengths in one batch (the cache holds one length).
The native one-token step (``quantplug.lower``, C ``qp_window_step``) reads and writes this cache's
tensors as the forward does. The layer config is :class:`V4AttentionConfig` (from the raw ``config.json``); the model around
the block is :mod:`quantplug.models.deepseek_v4`.
Sources disagree on ratios other than 0 / 4 / 128 (E10): like DeepSeek's reference, any ratio
other than 4 is taken as an HCA compressor of that ratio (transformers only knows 4 and 128).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..layers.norm import RMSNorm
from .base import Decisions, lin
from .cache import GenerationError
from .v4_compressor import CompressorState, F32Param, V4AttentionConfig, V4Compressor, V4Indexer, V4Rope

__all__ = ["ATTN_SCORE_BYTES", "V4Attention", "V4AttentionCache", "V4AttentionConfig"]

#: bytes of float32 scores ([heads, queries, keys]) the attention makes at once: a long prompt is
#: attended a block of queries at a time (each over its own window and the compressed entries)
ATTN_SCORE_BYTES = 1 << 28


@dataclass
class V4AttentionCache:
    """One layer's state for one batch of sequences: ``length`` tokens seen, the window's last
    ``sliding_window - 1`` kv rows [b, <= W - 1, head_dim] (the keys a next token can still see),
    and the compressor's / the indexer's :class:`CompressorState`.

    Roll-back (:meth:`V4Attention.truncate_cache`): ``rollback`` is how many tokens back a
    truncation may reach (None: any length, 0: none). The window keeps only W - 1 rows and a
    compressor folds each finished window into one entry, so the cache also logs the raw per-token
    rows the state at an earlier length is made of: the window's kv rows (``log``, positions
    ``log_start ..``) and each compressor's ``wkv`` / ``wgate`` rows; compressed entries are only
    cut (an entry depends on the tokens of its own and the previous window only). With a bound,
    rows older than what a truncation ``rollback`` tokens back needs are dropped after each
    forward: at most W - 1 + ``rollback`` window rows and 2r + ``rollback`` compressor rows."""

    length: int = 0
    window: torch.Tensor | None = None
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)
    rollback: int | None = 0
    log: torch.Tensor | None = None
    log_start: int = 0

    def __post_init__(self) -> None:
        self.compressor.log = self.indexer.log = self.logging

    @property
    def logging(self) -> bool:
        """Whether the roll-back log is kept (``rollback`` None or > 0)."""
        return self.rollback is None or self.rollback > 0

    @property
    def log_end(self) -> int:
        """The position after the last logged window row."""
        return self.log_start + (0 if self.log is None else self.log.shape[1])


class V4Attention(nn.Module):
    """DeepSeek-V4 attention of one layer (see the module docstring); ``base``: its
    text-model-relative checkpoint name, e.g. ``layers.3.attn``."""

    #: the block's checkpoint name (prefix applied)
    qp_ckpt: str
    #: the native one-token step the lowering bound (``quantplug.kernels.compute.WindowAttnStep``), or None
    step: Any = None

    def __init__(self, cfg: V4AttentionConfig, base: str, d: Decisions) -> None:
        super().__init__()
        self.cfg = cfg
        self.qp_ckpt = d.ck(base)
        h, nh, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        assert nh % cfg.o_groups == 0, "num_attention_heads must be a multiple of o_groups"
        self.wq_a = lin(d, f"{base}.wq_a", h, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.eps, d.ck(f"{base}.q_norm"))
        self.wq_b = lin(d, f"{base}.wq_b", cfg.q_lora_rank, nh * hd)
        self.wkv = lin(d, f"{base}.wkv", h, hd)
        self.kv_norm = RMSNorm(hd, cfg.eps, d.ck(f"{base}.kv_norm"))
        self.wo_a = lin(d, f"{base}.wo_a", nh * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = lin(d, f"{base}.wo_b", cfg.o_groups * cfg.o_lora_rank, h)
        self.attn_sink = F32Param((nh,), d.ck(f"{base}.attn_sink"))
        self.rope = V4Rope(cfg.rope if cfg.compress_ratio == 0 else cfg.compress_rope, cfg.rope_dim)
        self.compressor: V4Compressor | None = None
        self.indexer: V4Indexer | None = None
        if cfg.compress_ratio:
            csa = cfg.compress_ratio == 4
            self.compressor = V4Compressor(d, f"{base}.compressor", h, hd, cfg.compress_ratio, csa, cfg.eps,
                                           self.rope)
            if csa:
                self.indexer = V4Indexer(cfg, d, f"{base}.indexer", self.rope)
        self.scale = hd ** -0.5

    def forward(self, x: torch.Tensor, cache: V4AttentionCache | None = None) -> torch.Tensor:
        """x [b, t, hidden] (the ``attn_norm`` output) at positions ``cache.length ..`` (0 .. without
        a cache); the cache, if given, is advanced by the t tokens."""
        cfg = self.cfg
        b, t, _ = x.shape
        nh, hd, w = cfg.num_heads, cfg.head_dim, cfg.sliding_window
        past = cache.length if cache is not None else 0
        pos = torch.arange(past, past + t, device=x.device)
        cos, sin = self.rope.cos_sin(pos)

        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(b, t, nh, hd).transpose(1, 2)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + cfg.eps).to(q.dtype)
        q = self.rope.rotate(q, cos, sin)                                   # [b, nh, t, hd]
        kv = self.rope.rotate(self.kv_norm(self.wkv(x)), cos, sin)          # [b, t, hd]

        # the window's keys: the cached rows, then these tokens
        keys = kv
        if cache is not None and cache.window is not None:
            keys = torch.cat([cache.window, kv], dim=1)
        first = past + t - keys.shape[1]                                    # position of keys[:, 0]
        if cache is not None:
            cache.window = keys[:, max(keys.shape[1] - (w - 1), 0):] if w > 1 else keys[:, :0]

        entries = seen = None
        if self.compressor is not None:
            entries = self.compressor(x, cache.compressor if cache is not None else None)   # [b, n, hd]
            n = entries.shape[1]
            if self.indexer is not None:
                seen = self.indexer(x, qr, pos, cache.indexer if cache is not None else None)
            else:
                seen = (torch.arange(n, device=x.device) < ((pos + 1) // cfg.compress_ratio)[:, None])
                seen = seen.expand(b, t, n)

        # a block of queries at a time: its window's keys (at most rows + W - 1) and the entries
        n = 0 if entries is None else entries.shape[1]
        rows = max(1, ATTN_SCORE_BYTES // (4 * b * nh * (w + n)))
        out = torch.cat([self._attend(q[:, :, i:i + rows], pos[i:i + rows], keys, first, entries,
                                      None if seen is None else seen[:, i:i + rows])
                         for i in range(0, t, rows)], dim=2)                # [b, nh, t, hd]
        out = self.rope.rotate(out, cos, -sin)
        if cache is not None:
            cache.length = past + t
            if cache.logging:
                cache.log = kv if cache.log is None else torch.cat([cache.log, kv], dim=1)
                self._forget(cache)
        return self.wo_b(self._grouped_wo_a(out.transpose(1, 2)))

    def _needed_from(self, n: int) -> int:
        """The first position whose logged rows the state at ``n`` tokens is rebuilt from."""
        first = max(0, n - (self.cfg.sliding_window - 1))
        for comp in (self.compressor, None if self.indexer is None else self.indexer.compressor):
            if comp is not None:
                first = min(first, comp.needed_from(n))
        return first

    def _forget(self, cache: V4AttentionCache) -> None:
        """Drop the logged rows no truncation within ``cache.rollback`` tokens needs."""
        if cache.rollback is None:
            return
        keep = self._needed_from(max(0, cache.length - cache.rollback))
        if cache.log is not None and keep > cache.log_start:
            cut = min(keep, cache.log_end) - cache.log_start
            cache.log, cache.log_start = cache.log[:, cut:], cache.log_start + cut
        cache.compressor.forget_before(keep)
        cache.indexer.forget_before(keep)

    def truncate_cache(self, cache: V4AttentionCache, n: int) -> None:
        """``cache`` back to its first ``n`` tokens: afterwards it is the cache of a sequence that
        never saw the later ones (equal window rows, compressor states and entries, indexer keys).
        Rebuilt from the logged rows (see :class:`V4AttentionCache`); a length they do not reach
        (``rollback`` exceeded, or a cache advanced without logging) is a :class:`GenerationError`
        naming the layer."""
        if n == cache.length:
            return
        where = f"{self.qp_ckpt}: "
        if not 0 <= n <= cache.length:
            raise GenerationError(f"{where}cannot truncate a DeepSeek-V4 attention cache of {cache.length} tokens "
                                  f"to {n}")
        need = self._needed_from(n)
        logs = [(cache.log_start, cache.log_end)]
        logs += [(st.log_start, st.log_end) for st, comp in ((cache.compressor, self.compressor),
                 (cache.indexer, None if self.indexer is None else self.indexer.compressor)) if comp is not None]
        if not cache.logging or any(lo > need or end != cache.length for lo, end in logs):
            bound = ("keeps no roll-back log (rollback=0)" if not cache.logging else
                     f"keeps the rows of positions {max(lo for lo, _ in logs)}..{cache.length - 1} "
                     f"(rollback={cache.rollback})" if all(end == cache.length for _, end in logs) else
                     "was advanced without its roll-back log (a step that does not log its rows)")
            raise GenerationError(f"{where}cannot roll a DeepSeek-V4 attention cache back from {cache.length} to "
                                  f"{n} tokens: that needs the raw rows of positions {need}..{cache.length - 1}, "
                                  f"and the cache {bound}")
        w = self.cfg.sliding_window
        assert cache.log is not None
        if n == 0:
            cache.window = None
        else:
            cache.window = cache.log[:, max(n - (w - 1), 0) - cache.log_start:n - cache.log_start] if w > 1 \
                else cache.log[:, :0]
        cache.log = cache.log[:, :n - cache.log_start]
        if self.compressor is not None:
            self.compressor.truncate_state(cache.compressor, n)
        if self.indexer is not None:
            self.indexer.compressor.truncate_state(cache.indexer, n)
        cache.length = n

    def _attend(self, q: torch.Tensor, pos: torch.Tensor, window: torch.Tensor, first: int,
                entries: torch.Tensor | None, seen: torch.Tensor | None) -> torch.Tensor:
        """Queries q [b, nh, r, hd] at positions ``pos`` [r] (consecutive) over the window keys
        ``window`` [b, k, hd] (keys[:, 0] at position ``first``) they can see (p - W < s <= p) and
        the compressed ``entries`` [b, n, hd] where ``seen`` [b, r, n]; one softmax with the sink
        logit. Returns [b, nh, r, hd] (before the inverse rotation)."""
        b, nh, r, _ = q.shape
        w = self.cfg.sliding_window
        lo = max(int(pos[0]) - w + 1 - first, 0)
        hi = int(pos[-1]) + 1 - first
        keys = window[:, lo:hi]
        kpos = torch.arange(first + lo, first + hi, device=q.device)
        allowed = ((kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - w)).expand(b, r, -1)
        if entries is not None and seen is not None:
            keys = torch.cat([keys, entries], dim=1)
            allowed = torch.cat([allowed, seen], dim=-1)
        scores = (q @ keys.unsqueeze(1).transpose(-1, -2)).float() * self.scale          # [b, nh, r, k]
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        sink = self.attn_sink.weight.float().view(1, nh, 1, 1).expand(b, nh, r, 1)
        logits = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return probs.to(keys.dtype) @ keys.unsqueeze(1)

    def grouped_wo_a(self, o: torch.Tensor) -> torch.Tensor:
        """``wo_a`` block-diagonal over ``o_groups``: o [b, t, G, nh * hd / G] (or [b, t, nh, hd])
        -> [b, t, G * R], as :meth:`forward` computes it (the engines' grouped ``o_a_proj``)."""
        return self._grouped_wo_a(o)

    def _grouped_wo_a(self, o: torch.Tensor) -> torch.Tensor:
        """o [b, t, nh, hd] -> [b, t, G * R]: group g (heads g * nh / G ..) through rows
        g * R .. (g + 1) * R of ``wo_a`` (block-diagonal). A weight-only scheme: its dequantized
        weight per group; any other: the whole ``wo_a`` on each group's input, keeping the
        group's own block (exact for every scheme, G times the work)."""
        cfg = self.cfg
        b, t = o.shape[:2]
        g, r = cfg.o_groups, cfg.o_lora_rank
        grouped = o.reshape(b, t, g, -1)                                      # [b, t, G, nh * hd / G]
        if self.wo_a.scheme.weight_only and self.wo_a.qp_parallel is None:
            wt = self.wo_a.scheme.dequantize(self.wo_a).view(g, r, -1)      # [G, R, in]
            y = torch.einsum("btgi,gri->btgr", grouped, wt.to(grouped.dtype))
        else:
            full = self.wo_a(grouped).view(b, t, g, g, r)                    # [b, t, G(in), G(out), R]
            y = torch.diagonal(full, dim1=2, dim2=3).permute(0, 1, 3, 2)    # [b, t, G, R]
        return y.reshape(b, t, g * r)
