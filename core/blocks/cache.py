"""Generation caches: the MLA latent cache of one layer (:class:`LatentCache`), the model's
(:class:`MLACache`), and the hybrid cache of a KDA + MLA model (:class:`HybridCache`, one
:class:`KDAState` per KDA layer).

The latent cache keeps, per MLA layer and token, exactly what attention reads from the past: the
normed compressed latent ``c_kv`` (``kv_lora_rank`` values) and the roped shared key ``k_pe``
(``qk_rope_head_dim`` values), in the model dtype (see :class:`quantplug.blocks.mla.MLA`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import QuantplugError

#: tokens a cache grows by when a forward needs more room than it was preallocated for
CHUNK = 256


class GenerationError(QuantplugError):
    """Bad generation arguments, or a sequence longer than the model's context."""


class LatentCache:
    """One MLA layer's cache: latent ``[B, 1, S, kv_lora_rank]`` and roped key ``[B, 1, S, rope]``;
    for a DeepSeek-V3.2 (DSA) layer also the lightning indexer's keys ``index_k``
    ``[B, 1, S, index_head_dim]`` (None for other layers).

    Preallocated for ``capacity`` tokens; a forward that needs more grows every buffer by
    :data:`CHUNK` tokens at a time, never past ``limit``. ``append`` writes the new tokens and
    returns views of every token so far (``[B, 1, L, dim]``: one "head", broadcast over heads).
    Every buffer holds rows ``[0, length)``: the one ``length`` addresses all of them, so setting
    it back rolls the whole layer back.
    """

    #: the per-token buffers, all grown together and addressed by ``length``
    BUFFERS = ("latent", "k_rope", "index_k", "index_scale")

    def __init__(self, batch: int, kv_lora_rank: int, rope_dim: int, *, dtype: torch.dtype,
                 device: torch.device, capacity: int, limit: int, index_dim: int = 0,
                 index_fp8: bool = False) -> None:
        self.limit = limit
        self.length = 0
        cap = max(1, min(capacity, limit))
        # [B, 1, S, dim]: the one "head" axis is stored, so appends and the views handed out are
        # one slice each (a decode step appends in every layer)
        self.latent = torch.empty(batch, 1, cap, kv_lora_rank, dtype=dtype, device=device)
        self.k_rope = torch.empty(batch, 1, cap, rope_dim, dtype=dtype, device=device)
        #: DSA indexer keys (LayerNorm'd, roped; model dtype as transformers caches them, or with
        #: ``index_fp8`` (load option ``indexer=fp8``) e4m3 as DeepSeek's reference caches them,
        #: with one float32 scale per token in ``index_scale`` [B, 1, S, 1])
        self.index_k: torch.Tensor | None = None
        self.index_scale: torch.Tensor | None = None
        if index_dim:
            kdtype = torch.float8_e4m3fn if index_fp8 else dtype
            self.index_k = torch.empty(batch, 1, cap, index_dim, dtype=kdtype, device=device)
            if index_fp8:
                self.index_scale = torch.empty(batch, 1, cap, 1, dtype=torch.float32, device=device)

    @property
    def capacity(self) -> int:
        return self.latent.shape[2]

    def _grow(self, need: int) -> None:
        cap = min(self.limit, -(-need // CHUNK) * CHUNK)
        for name in self.BUFFERS:
            old = getattr(self, name)
            if old is None:
                continue
            new = old.new_empty(old.shape[0], 1, cap, old.shape[3])
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)

    def reserve(self, t: int = 1) -> int:
        """Room for ``t`` more tokens (grown as :meth:`append` grows); returns the first new row's
        index and counts the rows as cached: the caller writes them (a native decode step writes
        its token's latent and key in place). :meth:`unreserve` takes them back on failure."""
        need = self.length + t
        if need > self.limit:
            raise GenerationError(f"sequence of {need} tokens exceeds the model's context of {self.limit} "
                                  "(max_position_embeddings, yarn included)")
        if need > self.capacity:
            self._grow(need)
        pos, self.length = self.length, need
        return pos

    def unreserve(self, t: int = 1) -> None:
        self.length -= t

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on (speculative decoding rolls a rejected draft back):
        only :attr:`length` moves back, since every buffer is addressed by it (the next append
        overwrites the forgotten rows), so any buffer a layer adds rolls back with it."""
        if not 0 <= length <= self.length:
            raise GenerationError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor, index_k: torch.Tensor | None = None,
               index_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, 1, t, kv_lora], k_rope [B, 1, t, rope] -> all cached [B, 1, L, ...] (L = past + t).
        A DSA layer passes its indexer keys ``index_k`` [B, 1, t, index_dim] too, and their
        ``index_scale`` [B, 1, t, 1] when they are FP8 (same rows; :meth:`index_keys` and
        :meth:`index_scales` read them back)."""
        t = latent.shape[-2]
        pos = self.reserve(t)
        try:
            self.latent[:, :, pos:pos + t] = latent
            self.k_rope[:, :, pos:pos + t] = k_rope
            if index_k is not None:
                self.put_index(pos, index_k, index_scale)
        except BaseException:
            self.unreserve(t)
            raise
        return self.latent[:, :, :self.length], self.k_rope[:, :, :self.length]

    def put_index(self, pos: int, index_k: torch.Tensor, index_scale: torch.Tensor | None = None) -> None:
        """Write indexer keys [B, 1, t, index_dim] (and their scales [B, 1, t, 1] when FP8) at rows
        ``[pos, pos + t)``, rows already counted in ``length`` (a path that appended the latent and
        key without them, e.g. the native decode step, writes its token's indexer key after it)."""
        t = index_k.shape[-2]
        if self.index_k is None:
            raise GenerationError("this layer's cache holds no indexer keys (not a DSA layer)")
        if pos < 0 or pos + t > self.length:
            raise GenerationError(f"indexer keys for rows [{pos}, {pos + t}) of a cache of {self.length} rows")
        if (index_scale is None) != (self.index_scale is None) or index_k.dtype != self.index_k.dtype:
            raise GenerationError(f"indexer keys of dtype {index_k.dtype} {'with' if index_scale is not None else 'without'} "
                                  f"scales for a cache of {self.index_k.dtype} keys")
        self.index_k[:, :, pos:pos + t] = index_k
        if self.index_scale is not None and index_scale is not None:
            self.index_scale[:, :, pos:pos + t] = index_scale

    def index_keys(self) -> torch.Tensor:
        """Every cached indexer key, [B, 1, L, index_dim] (a view)."""
        if self.index_k is None:
            raise GenerationError("this layer's cache holds no indexer keys (not a DSA layer)")
        return self.index_k[:, :, :self.length]

    def index_scales(self) -> torch.Tensor | None:
        """The FP8 indexer keys' scales [B, 1, L, 1] (a view); None when the keys are not FP8."""
        return None if self.index_scale is None else self.index_scale[:, :, :self.length]


class MLACache:
    """The model's cache: one :class:`LatentCache` per decoder layer, all of the same length."""

    def __init__(self, layers: Sequence[LatentCache]) -> None:
        self.layers = list(layers)

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def truncate(self, length: int) -> None:
        """Every layer back to ``length`` tokens (:meth:`LatentCache.truncate`)."""
        for c in self.layers:
            c.truncate(length)

    def bytes_per_token(self) -> int:
        """Bytes the cache holds per token, all layers: (kv_lora_rank + qk_rope_head_dim [+ index_head_dim
        for DSA]) x layers x dtype bytes."""
        return sum(sum(b.shape[3] * b.element_size() for b in _buffers(c)) for c in self.layers)

    def nbytes(self) -> int:
        """Bytes allocated (capacity, not length)."""
        return sum(sum(b.nbytes for b in _buffers(c)) for c in self.layers)


def _buffers(c: LatentCache) -> list[torch.Tensor]:
    return [b for b in (getattr(c, n) for n in LatentCache.BUFFERS) if b is not None]


def layer_cache(attn: Any, batch: int, capacity: int, limit: int, *, dtype: torch.dtype,
                device: torch.device) -> LatentCache:
    """An empty :class:`LatentCache` for one MLA module ``attn`` (its latent and rope widths, and
    its DSA indexer's keys when it has one)."""
    indexer = getattr(attn, "indexer", None)
    return LatentCache(batch, attn.kv_lora_rank, attn.qk_rope_head_dim, dtype=dtype, device=device,
                       capacity=capacity, limit=limit, index_dim=getattr(indexer, "head_dim", 0),
                       # getattr: no indexer (None), or a third party's without the option
                       index_fp8=getattr(indexer, "qp_indexer", "") == "fp8")


class KDAState:
    """One KDA layer's generation state: the recurrent state ``state`` [B, H, K, V] (float32, or
    bfloat16 to halve it) and the convolution's last ``width - 1`` inputs ``conv`` [B, 3 * H * K,
    width - 1] (float32), after ``length`` tokens.

    A state cannot be cut back by moving a length as a latent cache can: :meth:`snapshot` keeps a
    copy at the current length (what a speculative decoder takes before a draft), and
    :meth:`truncate` restores the snapshot of the requested length."""

    def __init__(self, batch: int, channels: int, width: int, heads: int, head_dim: int, *,
                 device: torch.device, limit: int, state_dtype: torch.dtype = torch.float32) -> None:
        self.conv = torch.zeros(batch, channels, max(width - 1, 0), dtype=torch.float32, device=device)
        self.state = torch.zeros(batch, heads, head_dim, head_dim, dtype=state_dtype, device=device)
        self.length = 0
        self.limit = limit
        self._snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def advance(self, t: int) -> None:
        """Count ``t`` more tokens (the caller updated the state in place)."""
        if self.length + t > self.limit:
            raise GenerationError(f"sequence of {self.length + t} tokens exceeds the model's context of {self.limit}")
        self.length += t

    def snapshot(self) -> None:
        """Keep a copy of the state at the current length (a later :meth:`truncate` to it restores it)."""
        self._snapshots[self.length] = (self.conv.clone(), self.state.clone())

    def truncate(self, length: int) -> None:
        """Back to ``length`` tokens: the current state, or a :meth:`snapshot` taken at that length."""
        if length == self.length:
            return
        snap = self._snapshots.get(length)
        if snap is None:
            raise GenerationError(f"cannot roll a KDA layer's state back from {self.length} to {length} tokens: "
                                  f"no snapshot at {length} (held: {sorted(self._snapshots) or 'none'})")
        self.conv.copy_(snap[0])
        self.state.copy_(snap[1])
        self.length = length
        self._snapshots = {n: s for n, s in self._snapshots.items() if n <= length}

    def nbytes(self) -> int:
        return self.conv.nbytes + self.state.nbytes


class HybridCache(MLACache):
    """The cache of a KDA + MLA model: per layer a :class:`KDAState` or a
    :class:`~quantplug.generate.LatentCache`, all of the same length."""

    def snapshot(self) -> None:
        for c in self.layers:
            if isinstance(c, KDAState):
                c.snapshot()

    def bytes_per_token(self) -> int:
        """Bytes the MLA layers' caches hold per token (the KDA states do not grow)."""
        return sum(sum(b.shape[3] * b.element_size() for b in (c.latent, c.k_rope)) for c in self.layers
                   if isinstance(c, LatentCache))

    def state_bytes(self) -> int:
        """Bytes of the KDA layers' fixed-size states (recurrent and convolution)."""
        return sum(c.nbytes() for c in self.layers if isinstance(c, KDAState))

    def nbytes(self) -> int:
        return self.state_bytes() + sum(c.latent.nbytes + c.k_rope.nbytes for c in self.layers
                                        if isinstance(c, LatentCache))
