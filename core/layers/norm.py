"""RMSNorm (float32 statistics, as DeepSeek-V3 and transformers compute them).

The rotary embedding lives in :mod:`quantplug.layers.rope`; its names stay importable from here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import FloatParams


class RMSNorm(FloatParams):
    """``weight * x / sqrt(mean(x^2) + eps)``, statistics in float32; one float parameter
    ``weight`` [dim] loaded from ``<ckpt>.weight``."""

    def __init__(self, dim: int, eps: float, ckpt: str) -> None:
        super().__init__()
        self.qp_init(ckpt)
        self.eps = eps
        self.add_float("weight", (dim,), f"{ckpt}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, the same float32 arithmetic as below (bit-identical; 1.4x faster per
            # call at decode, where a step runs 4 norms per layer)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


# moved to quantplug.layers.rope in 0.2 (contract 1.1); kept importable from here
from .rope import Rotary, rope_inv_freq, softmax_scale, yarn_get_mscale  # noqa: E402

__all__ = ["RMSNorm", "Rotary", "rope_inv_freq", "softmax_scale", "yarn_get_mscale"]
