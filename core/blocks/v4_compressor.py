"""DeepSeek-V4's KV compressor and lightning indexer (DeepSeek-V4's inference code ``model.py`` ``Compressor`` / ``Indexer``; transformers 5.25
``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` / ``DeepseekV4Indexer``), with the
layer config and V4's interleaved partial RoPE they share with
:class:`~quantplug.blocks.v4_attention.V4Attention`.

Release tensor names (E2), relative to the attention's base name ``layers.L.attn``:
``compressor.{wkv,wgate,ape,norm}``, ``indexer.{wq_b,weights_proj}``,
``indexer.compressor.{wkv,wgate,ape,norm}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..contract.config import RopeConfig
from ..layers.linear import FloatParams
from ..layers.norm import RMSNorm
from ..layers.rope import rope_inv_freq
from .base import Decisions, lin
from .indexer import INDEX_SCORE_BYTES, IndexerWeights


@dataclass(frozen=True)
class V4AttentionConfig:
    """One V4 attention layer's dims (E1). ``compress_ratio``: 0 sliding window only (SWA), 4 CSA
    (overlapping compressor and the lightning indexer), any other ratio HCA (compressor only)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratio: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    eps: float
    #: SWA layers' rope (``rope_theta``, no YaRN)
    rope: RopeConfig
    #: compressed layers' rope (``compress_rope_theta`` with the config's YaRN, no magnitude factor)
    compress_rope: RopeConfig

    @property
    def kind(self) -> str:
        """"swa", "csa" or "hca"."""
        return "swa" if self.compress_ratio == 0 else "csa" if self.compress_ratio == 4 else "hca"

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], layer: int) -> V4AttentionConfig:
        """Layer ``layer``'s config from a release ``config.json`` (``compress_ratios[layer]`` is
        the ratio itself, E1/E10)."""
        rd = int(raw.get("qk_rope_head_dim", 64))
        scaling = raw.get("rope_scaling") or {}
        if scaling.get("type", scaling.get("rope_type")) == "yarn":
            compress = RopeConfig(float(raw.get("compress_rope_theta", 160000.0)), "yarn",
                                  factor=float(scaling.get("factor", 1.0)),
                                  original_max_position_embeddings=int(scaling.get(
                                      "original_max_position_embeddings", 4096)),
                                  beta_fast=float(scaling.get("beta_fast", 32.0)),
                                  beta_slow=float(scaling.get("beta_slow", 1.0)), attention_factor=1.0)
        else:
            compress = RopeConfig(float(raw.get("compress_rope_theta", 160000.0)), "default")
        ratios = raw.get("compress_ratios") or []
        return cls(
            hidden_size=int(raw["hidden_size"]), num_heads=int(raw["num_attention_heads"]),
            head_dim=int(raw.get("head_dim", 512)), rope_dim=rd, q_lora_rank=int(raw["q_lora_rank"]),
            o_groups=int(raw["o_groups"]), o_lora_rank=int(raw["o_lora_rank"]),
            sliding_window=int(raw["sliding_window"]),
            compress_ratio=int(ratios[layer]) if layer < len(ratios) else 0,
            index_n_heads=int(raw.get("index_n_heads", 64)), index_head_dim=int(raw.get("index_head_dim", 128)),
            index_topk=int(raw.get("index_topk", 512)), eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig(float(raw.get("rope_theta", 10000.0)), "default"), compress_rope=compress)


class V4Rope(nn.Module):
    """V4's RoPE: interleaved pairs (2i, 2i+1) of the trailing ``dim`` dims, rotated in place
    (no de-interleave, unlike V3's transformers layout), cos / sin without any YaRN magnitude
    factor (transformers forces ``attention_factor = 1``)."""

    inv_freq: torch.Tensor

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        inv_freq, _ = rope_inv_freq(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dim = dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., t] -> float32 cos, sin [..., t, dim / 2]."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        return freqs.cos(), freqs.sin()

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., t, D]: its last ``dim`` dims rotated by cos / sin [..., t, dim / 2] (broadcast
        over x's leading dims), in float32; the rest unchanged. ``-sin`` rotates back."""
        nope, r = x[..., : -self.dim], x[..., -self.dim:].float()
        x1, x2 = r[..., 0::2], r[..., 1::2]
        rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat([nope, rot.to(x.dtype)], dim=-1)


class F32Param(FloatParams):
    """One float32 tensor loaded from ``ckpt`` (``attn_sink``, ``ape``), held as ``weight``."""

    qp_fp32 = frozenset({"weight"})
    weight: torch.Tensor

    def __init__(self, shape: tuple[int, ...], ckpt: str) -> None:
        super().__init__()
        self.qp_init(ckpt)
        self.add_float("weight", shape, ckpt)


@dataclass
class CompressorState:
    """What a compressor carries between calls of one sequence: the tokens of the unfinished
    window (``kv`` / ``gate`` [b, < r, width], gate without ``ape``), the previous window's first
    halves (overlap only; [b, r, dim]), and the entries emitted so far [b, n, dim].

    With ``log`` set (the attention cache's ``rollback``), also the raw ``wkv`` / ``wgate`` rows of
    the recent tokens (``log_kv`` / ``log_gate`` [b, k, width], positions ``log_start ..``), from
    which :meth:`V4Compressor.truncate_state` rebuilds the state at an earlier length."""

    kv: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    log: bool = False
    log_kv: torch.Tensor | None = None
    log_gate: torch.Tensor | None = None
    log_start: int = 0

    @property
    def count(self) -> int:
        return 0 if self.entries is None else self.entries.shape[1]

    @property
    def log_end(self) -> int:
        """The position after the last logged row."""
        return self.log_start + (0 if self.log_kv is None else self.log_kv.shape[1])

    def forget_before(self, position: int) -> None:
        """Drop the logged rows of positions < ``position``."""
        if self.log_kv is not None and self.log_gate is not None and position > self.log_start:
            cut = min(position, self.log_end) - self.log_start
            self.log_kv, self.log_gate = self.log_kv[:, cut:], self.log_gate[:, cut:]
            self.log_start += cut


class V4Compressor(nn.Module):
    """Compresses each window of ``ratio`` tokens into one entry (E4): per channel a softmax over
    the window's tokens of ``wgate x + ape[t mod r]`` weighting ``wkv x``; ``overlap`` (CSA, r = 4):
    wkv / wgate / ape are 2 * dim wide, the first half of window j - 1's tokens joins window j's
    second halves (8 slots). Then ``norm`` and RoPE on the last ``rope_dim`` dims at the window's
    first position r * j."""

    def __init__(self, d: Decisions, base: str, hidden: int, dim: int, ratio: int, overlap: bool,
                 eps: float, rope: V4Rope) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = dim * (2 if overlap else 1)
        self.wkv = lin(d, f"{base}.wkv", hidden, width)
        self.wgate = lin(d, f"{base}.wgate", hidden, width)
        self.ape = F32Param((ratio, width), d.ck(f"{base}.ape"))
        self.norm = RMSNorm(dim, eps, d.ck(f"{base}.norm"))
        self.rope = [rope]  # shared with the attention (not a child: one buffer)

    def forward(self, x: torch.Tensor, state: CompressorState | None = None) -> torch.Tensor:
        """x [b, t, hidden], the tokens after those ``state`` has seen (from position 0 without a
        state). Returns every entry so far [b, n, dim] (with a state: its earlier ones and those
        the completed windows add; a state keeps the unfinished window's tokens)."""
        kv, gate = self.wkv(x), self.wgate(x)
        st = state if state is not None else CompressorState()
        if st.log:
            st.log_kv = kv if st.log_kv is None else torch.cat([st.log_kv, kv], dim=1)
            st.log_gate = gate if st.log_gate is None else torch.cat([st.log_gate, gate], dim=1)
        first = st.count * self.ratio
        if st.kv is not None and st.kv.shape[1]:
            assert st.gate is not None
            kv, gate = torch.cat([st.kv, kv], dim=1), torch.cat([st.gate, gate], dim=1)
        usable = kv.shape[1] // self.ratio * self.ratio
        st.kv, st.gate = kv[:, usable:], gate[:, usable:]
        new = self._windows(kv[:, :usable], gate[:, :usable], first, st)
        st.entries = new if st.entries is None else torch.cat([st.entries, new], dim=1)
        return st.entries

    def needed_from(self, length: int) -> int:
        """The first position whose raw rows the state at ``length`` tokens is made of: the
        unfinished window's, and with ``overlap`` the previous window's too."""
        return max(0, (length // self.ratio - (1 if self.overlap else 0)) * self.ratio)

    def truncate_state(self, st: CompressorState, n: int) -> None:
        """``st`` back to the state after the first ``n`` tokens, equal to having seen only them:
        the entries of the windows before n // r kept; the unfinished window's rows and (overlap)
        the previous window's first halves, ``ape`` added as :meth:`_windows` adds it, rebuilt
        from the logged rows (which must reach back to :meth:`needed_from`)."""
        c, r, dim = n // self.ratio, self.ratio, self.dim
        if st.entries is not None:
            st.entries = st.entries[:, :c]
        if st.log_kv is None or st.log_gate is None:
            st.kv = st.gate = st.prev_kv = st.prev_gate = None
            return
        lo = st.log_start
        st.kv, st.gate = st.log_kv[:, c * r - lo:n - lo], st.log_gate[:, c * r - lo:n - lo]
        st.prev_kv = st.prev_gate = None
        if self.overlap and c:
            st.prev_kv = st.log_kv[:, (c - 1) * r - lo:c * r - lo, :dim]
            st.prev_gate = st.log_gate[:, (c - 1) * r - lo:c * r - lo, :dim] + self.ape.weight[:, :dim]
        st.log_kv, st.log_gate = st.log_kv[:, :n - lo], st.log_gate[:, :n - lo]

    def _windows(self, kv: torch.Tensor, gate: torch.Tensor, first: int, st: CompressorState) -> torch.Tensor:
        """Entries of the whole windows kv / gate [b, n * r, width] starting at position ``first``."""
        b, r, dim = kv.shape[0], self.ratio, self.dim
        n = kv.shape[1] // r
        if n == 0:
            return kv.new_zeros(b, 0, dim)
        kv = kv.view(b, n, r, -1)
        gate = gate.view(b, n, r, -1) + self.ape.weight
        if self.overlap:
            slots_kv = kv.new_zeros(b, n, 2 * r, dim)
            slots_gate = gate.new_full((b, n, 2 * r, dim), float("-inf"))
            slots_kv[:, :, r:], slots_gate[:, :, r:] = kv[..., dim:], gate[..., dim:]
            slots_kv[:, 1:, :r], slots_gate[:, 1:, :r] = kv[:, :-1, :, :dim], gate[:, :-1, :, :dim]
            if st.prev_kv is not None and st.prev_gate is not None:
                slots_kv[:, 0, :r], slots_gate[:, 0, :r] = st.prev_kv, st.prev_gate
            st.prev_kv, st.prev_gate = kv[:, -1, :, :dim], gate[:, -1, :, :dim]
            kv, gate = slots_kv, slots_gate
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        entries = self.norm(pooled)
        rope = self.rope[0]
        cos, sin = rope.cos_sin(torch.arange(n, device=kv.device) * r + first)
        return rope.rotate(entries, cos, sin)


class V4Indexer(nn.Module):
    """The lightning indexer of a CSA layer (E4): keys from its own overlapping compressor
    (``index_head_dim`` wide), queries ``wq_b qr`` with RoPE, score
    ``I[p, j] = sum_h w_h ReLU(q_h . K_j) * d^-1/2`` with ``w = weights_proj(x) * H_I^-1/2``; keeps
    the top ``index_topk`` of the entries query p sees (j < (p + 1) // r)."""

    def __init__(self, cfg: V4AttentionConfig, d: Decisions, base: str, rope: V4Rope) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = cfg.compress_ratio
        self.wq_b = lin(d, f"{base}.wq_b", cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = IndexerWeights(cfg.hidden_size, cfg.index_n_heads, d.ck(f"{base}.weights_proj"))
        self.compressor = V4Compressor(d, f"{base}.compressor", cfg.hidden_size, cfg.index_head_dim,
                                       cfg.compress_ratio, True, cfg.eps, rope)
        self.rope = [rope]

    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                state: CompressorState | None = None) -> torch.Tensor:
        """x [b, t, hidden], qr [b, t, q_lora_rank], positions [t]. Returns [b, t, n] bool: the
        compressed entries each query attends to (selected and visible)."""
        b, t, _ = x.shape
        keys = self.compressor(x, state)                                    # [b, n, d]
        n = keys.shape[1]
        if n == 0:
            return torch.zeros(b, t, 0, dtype=torch.bool, device=x.device)
        rope = self.rope[0]
        cos, sin = rope.cos_sin(positions)
        q = self.wq_b(qr).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q = rope.rotate(q, cos, sin).float()                                # [b, h, t, d]
        w = self.weights_proj(x) * self.n_heads ** -0.5                     # [b, t, h] float32
        kf = keys.float().transpose(-1, -2).unsqueeze(1)                    # [b, 1, d, n]
        entry = torch.arange(n, device=x.device)
        keep = torch.zeros(b, t, n, dtype=torch.bool, device=x.device)
        rows = max(1, INDEX_SCORE_BYTES // (4 * b * self.n_heads * n))
        for i in range(0, t, rows):
            e = min(t, i + rows)
            scores = torch.relu(q[:, :, i:e] @ kf) * self.head_dim ** -0.5  # [b, h, rows, n]
            index = (scores * w[:, i:e].transpose(1, 2).unsqueeze(-1)).sum(dim=1)   # [b, rows, n]
            visible = entry < ((positions[i:e] + 1) // self.ratio)[:, None]
            index = index.masked_fill(~visible, float("-inf"))
            top = index.topk(min(self.topk, n), dim=-1).indices
            keep[:, i:e].scatter_(-1, top, True)
            keep[:, i:e] &= visible
        return keep
