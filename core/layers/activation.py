"""Gated-MLP activations: ``act(gate, up)`` of a ``down(act(gate(x), up(x)))`` MLP.

SiLU (DeepSeek, Kimi-Linear): ``silu(gate) * up``. SiTU (Kimi-K3, ``hidden_act: situ``; sglang
``SituAndMul``, llama.cpp ``kimi_k3_situ``): ``beta * tanh(gate / beta) * sigmoid(gate) *
(linear_beta * tanh(up / linear_beta) if linear_beta else up)``, in float32, with beta 4.0 and
linear_beta 25.0 in the release; as beta grows it tends to SiLU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def situ_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU of ``gate`` times the (soft-capped) ``up``, computed in float32, returned in ``gate``'s dtype."""
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (act * u).to(gate.dtype)


@dataclass(frozen=True)
class GatedAct:
    """A gated activation: ``kind`` "silu" (the default, and the one every native step computes)
    or "situ" with its two constants."""

    kind: str = "silu"
    beta: float = 1.0
    linear_beta: float | None = None

    @property
    def is_silu(self) -> bool:
        return self.kind == "silu"

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        return situ_mul(gate, up, self.beta, self.linear_beta)


SILU = GatedAct()
