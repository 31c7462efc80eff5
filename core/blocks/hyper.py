"""DeepSeek-V4's manifold-constrained hyper-connections (mHC; DS-V4 ``inference/model.py``
``Block.hc_pre`` / ``hc_post`` / ``hc_head``, transformers ``DeepseekV4HyperConnection`` /
``DeepseekV4HyperHead``): a residual scheme of ``hc_mult`` (N) streams per token.

The state X is [..., N, D] (the embedding copied into every stream). Around each sub-layer
(attention, then the MoE) a :class:`HyperConnection` mixes: from ``flat = X`` as one [N*D] row,
RMS-normalized without a weight (``rms_norm_eps``), ``mix = fn @ flat`` ([(2 + N) * N] values)
gives ``pre = sigmoid(mix[:N] * scale0 + base[:N]) + hc_eps``, ``post = 2 * sigmoid(mix[N:2N] *
scale1 + base[N:2N])`` and a matrix ``comb`` [N, N] = Sinkhorn-Knopp of ``mix[2N:] * scale2 +
base[2N:]`` (softmax over rows + hc_eps, columns normalized, then ``hc_sinkhorn_iters - 1`` more
row / column normalizations, each ``/ (sum + hc_eps)``). The sub-layer reads ``u = sum_k pre_k X_k``
and its output f goes back as ``X'_k = post_k * f + sum_j comb[j, k] X_j`` (j the source stream).
:class:`HyperHead` collapses the streams once at the end (``pre`` only, no Sinkhorn) before the
final norm. The weights and the Sinkhorn run in float32; the mixes in the streams' dtype (as
transformers does).

Parameters are float32 and named as the release stores them: ``layers.L.hc_attn_fn`` /
``_base`` / ``_scale`` ([(2 + N) * N, N * D], [(2 + N) * N], [3]), ``hc_ffn_*`` likewise, and
``hc_head_fn`` / ``_base`` / ``_scale`` ([N, N * D], [N], [1]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..layers.linear import FloatParams


def _mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """``fn @ rmsnorm(flat(x))`` in float32: x [..., N, D] -> [..., rows of fn]."""
    flat = x.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return F.linear(flat, fn.float())


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """DS-V4's ``hc_split_sinkhorn`` on [..., N, N] float32 logits: softmax over the last axis plus
    ``eps``, columns divided by their sums (+ eps), then ``iters - 1`` times rows, then columns."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(FloatParams):
    """One mHC site (``layers.L.hc_attn`` or ``layers.L.hc_ffn``: ``base``) of ``hc_mult`` streams of
    ``hidden`` features. ``forward(x, sublayer)``: x [..., N, D] -> the new streams, ``sublayer``
    taking the collapsed [..., D] input (its norm included) to its [..., D] output. :meth:`weights`,
    :meth:`collapse` and :meth:`expand` are its three steps."""

    qp_fp32 = frozenset({"fn", "base", "scale"})
    #: the native mix the lowering bound (``quantplug.kernels.compute.HyperStep``), or None
    step: Any = None
    # registered by the loader from the plan; declared for type checkers
    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor

    def __init__(self, base: str, hidden: int, hc_mult: int = 4, sinkhorn_iters: int = 20, hc_eps: float = 1e-6,
                 norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.qp_init(base)
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        m = (2 + hc_mult) * hc_mult
        self.add_float("fn", (m, hc_mult * hidden), f"{base}_fn")
        self.add_float("base", (m,), f"{base}_base")
        self.add_float("scale", (3,), f"{base}_scale")

    def weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 ``pre`` [..., N], ``post`` [..., N] and ``comb`` [..., N, N] (comb[j, k]: from
        stream j into stream k) of the streams x [..., N, D]."""
        n = self.hc_mult
        mix = _mixes(x, self.fn, self.norm_eps)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        b = self.base.float()
        s0, s1, s2 = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s0 + b[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s1 + b[n:2 * n])
        logits = (comb_w * s2 + b[2 * n:]).unflatten(-1, (n, n))
        return pre, post, sinkhorn(logits, self.sinkhorn_iters, self.hc_eps)

    @staticmethod
    def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The sub-layer's input ``sum_k pre_k X_k`` [..., D], in x's dtype."""
        return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)

    @staticmethod
    def expand(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The new streams ``X'_k = post_k * f + sum_j comb[j, k] X_j`` [..., N, D], in x's dtype."""
        dt = x.dtype
        return post.to(dt).unsqueeze(-1) * f.to(dt).unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), x)

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        pre, post, comb = self.weights(x)
        return self.expand(sublayer(self.collapse(x, pre)), x, post, comb)


class HyperHead(FloatParams):
    """The final collapse of the streams (``hc_head``: ``base``): x [..., N, D] -> ``sum_k pre_k X_k``
    [..., D] with ``pre = sigmoid(mix * scale + base) + hc_eps``; the final norm follows."""

    qp_fp32 = frozenset({"fn", "base", "scale"})
    #: the native collapse the lowering bound (``quantplug.kernels.compute.HyperStep``), or None
    step: Any = None
    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor

    def __init__(self, base: str, hidden: int, hc_mult: int = 4, hc_eps: float = 1e-6, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.qp_init(base)
        self.hc_mult, self.hc_eps, self.norm_eps = hc_mult, hc_eps, norm_eps
        self.add_float("fn", (hc_mult, hc_mult * hidden), f"{base}_fn")
        self.add_float("base", (hc_mult,), f"{base}_base")
        self.add_float("scale", (1,), f"{base}_scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = _mixes(x, self.fn, self.norm_eps)
        pre = torch.sigmoid(mix * self.scale.float() + self.base.float()) + self.hc_eps
        return HyperConnection.collapse(x, pre)
