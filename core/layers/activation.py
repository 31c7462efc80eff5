"""Gated-MLP activations ``act(gate, up)`` on the torch path: SiLU's ``silu(gate) * up`` and
Kimi-K3's SiTU (:func:`situ_mul`). The native MLP step computes the same
(``quantplug.kernels.compute.MLPStep.build(..., act=("situ", beta, linear_beta))``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Kimi-K3's ``activation_situ_beta`` / ``activation_situ_linear_beta``
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0


def situ_mul(gate: torch.Tensor, up: torch.Tensor, beta: float = SITU_BETA,
             linear_beta: float | None = SITU_LINEAR_BETA) -> torch.Tensor:
    """SiTU-and-multiply: ``beta * tanh(gate / beta) * sigmoid(gate) * (linear_beta * tanh(up /
    linear_beta) if linear_beta else up)``, computed in float32 and returned in ``gate``'s dtype
    (sglang's ``SituAndMul``). As beta grows it tends to ``silu(gate) * up``."""
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    y = a * (linear_beta * torch.tanh(u / linear_beta) if linear_beta else u)
    return y if gate.dtype == torch.float32 else y.to(gate.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the default gated-MLP activation), in the inputs' dtype."""
    return F.silu(gate) * up
