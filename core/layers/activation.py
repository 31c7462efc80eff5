"""Gated-MLP activations ``act(gate, up)`` of a ``down(act(gate(x), up(x)))`` MLP.

SiLU (DeepSeek, Kimi-Linear): ``silu(gate) * up``. SiTU (Kimi-K3, ``hidden_act: situ``; sglang
``SituAndMul``, llama.cpp ``kimi_k3_situ``): ``beta * tanh(gate / beta) * sigmoid(gate) *
(linear_beta * tanh(up / linear_beta) if linear_beta else up)``, in float32, with beta 4.0 and
linear_beta 25.0 in the release; as beta grows it tends to SiLU. The native MLP step computes the
same (``quantplug.kernels.compute.MLPStep.build(..., act=GatedAct.native)``).

Clamped SwiGLU (DeepSeek-V4, ``swiglu_limit``; DS-V4 ``Expert``, transformers ``DeepseekV4MLP`` /
``DeepseekV4Experts._apply_gate``): ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (the gate
clamped from above only, the up side both ways), in float32. No native step computes it yet: its
``native`` form is refused by ``compute.mlp_act`` (a QuantplugError, never a silent unclamped SiLU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def silu_clamp_mul(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's clamped SwiGLU: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``, computed
    in float32 and returned in ``gate``'s dtype."""
    g, u = gate.float().clamp(max=limit), up.float().clamp(min=-limit, max=limit)
    y = F.silu(g) * u
    return y if gate.dtype == torch.float32 else y.to(gate.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the default gated-MLP activation), in the inputs' dtype."""
    return F.silu(gate) * up


@dataclass(frozen=True)
class GatedAct:
    """A gated activation: ``kind`` "silu" (the default), "situ" with its two constants, or
    "silu_clamp" (DeepSeek-V4's clamped SwiGLU, :func:`swiglu_clamp`) with its ``limit``."""

    kind: str = "silu"
    beta: float = 1.0
    linear_beta: float | None = None
    #: "silu_clamp": the clamp ``swiglu_limit``
    limit: float | None = None

    @property
    def is_silu(self) -> bool:
        return self.kind == "silu"

    @property
    def native(self) -> Any:
        """The ``act`` argument of the native MLP step (``MLPStep.build``, ``compute.mlp_over``):
        None for SiLU, else ``("situ", beta, linear_beta)`` or ``("silu_clamp", limit, None)``
        (``compute.mlp_act``)."""
        if self.kind == "silu_clamp":
            return (self.kind, self.limit, None)
        return None if self.kind == "silu" else (self.kind, self.beta, self.linear_beta)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return silu_mul(gate, up)
        if self.kind == "silu_clamp":
            assert self.limit is not None
            return silu_clamp_mul(gate, up, self.limit)
        return situ_mul(gate, up, self.beta, self.linear_beta)


SILU = GatedAct()


def swiglu_clamp(limit: float) -> GatedAct:
    """DeepSeek-V4's gated activation: SiLU with the gate clamped at ``limit`` from above and the up
    side to [-limit, limit] (``swiglu_limit``), for :class:`~quantplug.blocks.MLP` and the routed
    experts alike."""
    if not limit > 0:
        raise ValueError(f"swiglu_limit {limit}: expected > 0")
    return GatedAct("silu_clamp", limit=float(limit))
