"""Rotary position embeddings: DeepSeek's interleaved rope and yarn scaling with mscale, computed
as transformers computes them."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..contract.config import RopeConfig


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale ("attention factor"), as transformers computes them."""
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv_freq, float(attention_factor)


def softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    scale = qk_head_dim ** -0.5
    if rope.type != "default" and rope.mscale_all_dim:
        m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [B, H, T, d] rotated by cos / sin [B, T, d] (``Rotary.cos_sin``), elementwise as
    transformers does: ``interleave`` pairs (2i, 2i+1), output de-interleaved (halves; transformers'
    ``apply_rotary_pos_emb_interleave``), else half-split pairs (i, i + d/2)
    (``apply_rotary_pos_emb``)."""
    if interleave:
        c = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
        s = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rot * s


class Rotary(nn.Module):
    """Rotary embedding for the ``qk_rope_head_dim`` part of queries and keys: ``cos_sin(positions)``
    then ``rotate(x, cos, sin)``; interleaved pairs (DeepSeek) or halves; yarn via ``RopeConfig``."""

    def __init__(self, rope: RopeConfig, dim: int, interleave: bool) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(rope, dim)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = interleave
        self._rot: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._step_table: tuple[torch.dtype, int, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, d]; cos/sin [B, T, d]."""
        if x.shape[-2] == 1 and cos.shape[-2] == 1:
            # a decode step: one matmul with the step's rotation matrix (made once per forward and
            # shared by every layer's q and k) instead of a dozen elementwise ops
            return torch.matmul(x, self._rotation(cos, sin))
        return rotate_pairs(x, cos, sin, self.interleave)

    def _rotation(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The one-position rotation as a matrix R ([d, d] for one row, else [B, 1, d, d]) with
        ``x @ R`` = :meth:`rotate`'s elementwise result: each output is its two products and
        zeros, summed. Kept for the ``cos`` / ``sin`` it was made from (held, so identity is safe)."""
        memo = self._rot
        if memo is not None and memo[0] is cos and memo[1] is sin:
            return memo[2]
        rot = self._matrices(cos, sin)
        r = rot[0] if rot.shape[0] == 1 else rot.unsqueeze(1)
        object.__setattr__(self, "_rot", (cos, sin, r))
        return r

    def _matrices(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[B, d, d]: the rotation matrix of each row of ``cos`` / ``sin`` [B, 1, d]."""
        b, _, d = cos.shape
        h = d // 2
        c, s = cos[:, 0, :h], sin[:, 0, :h]
        j = torch.arange(h, device=cos.device)
        rot = torch.zeros(b, d, d, dtype=cos.dtype, device=cos.device)
        if self.interleave:  # out[j] = x[2j] c - x[2j+1] s; out[h+j] = x[2j+1] c + x[2j] s
            lo, hi = 2 * j, 2 * j + 1
        else:                # out[j] = x[j] c - x[h+j] s;   out[h+j] = x[h+j] c + x[j] s
            lo, hi = j, h + j
        rot[:, lo, j], rot[:, hi, j], rot[:, hi, h + j], rot[:, lo, h + j] = c, -s, c, s
        return rot

    #: positions per block of :meth:`step_rotation`'s table
    STEP_BLOCK = 64

    def step_rotation(self, pos: int, dtype: torch.dtype) -> torch.Tensor:
        """The rotation matrix of position ``pos`` as the native decode step reads it: float32
        [d, d], the values of :meth:`_rotation` of that position's ``cos_sin`` in ``dtype``. Made
        :data:`STEP_BLOCK` positions at a time and kept (one block), so a decode step costs no
        tensor op here."""
        tab = self._step_table
        if tab is None or tab[0] != dtype or not 0 <= pos - tab[1] < tab[2].shape[0]:
            start = pos - pos % self.STEP_BLOCK
            positions = torch.arange(start, start + self.STEP_BLOCK, device=self.inv_freq.device).unsqueeze(1)
            cos, sin = self.cos_sin(positions, dtype)
            tab = (dtype, start, self._matrices(cos, sin).to(torch.float32).contiguous())
            object.__setattr__(self, "_step_table", tab)
        return tab[2][pos - tab[1]]

    def step_rotations(self, pos: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """The rotation matrices of positions ``pos .. pos + count - 1`` ([count, d, d] float32, each
        :meth:`step_rotation`'s): what a native step of ``count`` tokens of one sequence reads."""
        first = self.step_rotation(pos, dtype)
        tab = self._step_table
        assert tab is not None
        at = pos - tab[1]
        if at + count <= tab[2].shape[0]:
            return tab[2][at:at + count]  # one block: a view, no copy
        return torch.stack([first] + [self.step_rotation(pos + i, dtype) for i in range(1, count)])
