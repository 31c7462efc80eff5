"""The gated MLP ``down(act(gate(x), up(x)))``: dense layers and shared experts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layers.activation import SILU, GatedAct
from ..layers.linear import fuse_projections
from .base import Decisions, lin


class MLP(nn.Module):
    """Gated MLP ``down(act(gate(x), up(x)))`` (dense layers and shared experts; ``act`` SiLU, or
    Kimi-K3's SiTU). The lowering (:mod:`quantplug.lower`) runs it natively for a few rows where
    the three are bound to weight forms."""

    #: its checkpoint name
    qp_ckpt: str
    #: the whole MLP natively for few rows, bound by the lowering
    #: (:class:`quantplug.kernels.compute.MLPStep`), None: none
    step: Any = None
    #: the whole MLP for one token from the scheme (deprecated :meth:`LinearScheme.fuse_mlp`, bound
    #: by the lowering)
    one: Any = None

    def __init__(self, d: Decisions, base: str, hidden: int, inter: int, act: GatedAct = SILU,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        super().__init__()
        self.qp_ckpt = d.ck(base)
        #: the gated activation (SiLU, or Kimi-K3's SiTU; the native step computes either)
        self.act = act
        #: ``names``: the stored names of gate, up and down (DeepSeek-V4's shared expert: w1, w3, w2)
        self.gate_proj = lin(d, f"{base}.{names[0]}", hidden, inter)
        self.up_proj = lin(d, f"{base}.{names[1]}", hidden, inter)
        self.down_proj = lin(d, f"{base}.{names[2]}", inter, hidden)
        #: gate and up in one call when their scheme fuses them (:meth:`LinearScheme.fuse`)
        self.gate_up: Any = None

    def qp_fuse(self) -> None:
        """Sibling projections a scheme runs as one (:meth:`LinearScheme.fuse`): gate and up."""
        self.gate_up = fuse_projections([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split(self.gate_proj.out_features, dim=-1)
            return self.down_proj(self.act(gate, up))
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
