"""The gated MLP ``down(act(gate(x), up(x)))``: dense layers and shared experts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..kernels import compute
from ..kernels.compute import NATIVE_ROWS, MLPStep
from ..layers.activation import SILU, GatedAct
from ..layers.linear import fuse_mlp, fuse_projections
from .base import Decisions, lin, step_reduce


class MLP(nn.Module):
    """Gated MLP ``down(silu(gate(x)) * up(x))`` (dense layers and shared experts); one native
    call for a few rows where the three are bound to weight forms."""

    #: its checkpoint name
    qp_ckpt: str

    def __init__(self, d: Decisions, base: str, hidden: int, inter: int, act: GatedAct = SILU) -> None:
        super().__init__()
        self.qp_ckpt = d.ck(base)
        #: the gated activation (SiLU, or Kimi-K3's SiTU; the native step computes either)
        self.act = act
        self.gate_proj = lin(d, f"{base}.gate_proj", hidden, inter)
        self.up_proj = lin(d, f"{base}.up_proj", hidden, inter)
        self.down_proj = lin(d, f"{base}.down_proj", inter, hidden)
        #: gate and up in one call when their scheme fuses them (:meth:`LinearScheme.fuse`)
        self.gate_up: Any = None
        #: the whole MLP natively for few rows (:class:`quantplug.kernels.compute.MLPStep`)
        self.step: MLPStep | None = None
        #: the whole MLP for one token from the scheme (deprecated :meth:`LinearScheme.fuse_mlp`)
        self.one: Any = None

    def qp_fuse(self) -> None:
        self.gate_up = fuse_projections([self.gate_proj, self.up_proj])
        ok, reduce = step_reduce([self.gate_proj, self.up_proj], [self.down_proj])
        if ok:
            self.step = MLPStep.build(self.gate_proj, self.up_proj, self.down_proj, stacked=False, reduce=reduce,
                                      act=self.act.native)
        if self.step is None and self.act.is_silu:  # a scheme's fused MLP computes SiLU
            self.one = fuse_mlp(self.gate_proj, self.up_proj, self.down_proj)
            if self.one is not None:
                compute.deprecated_fuse("fuse_mlp", self.gate_proj.scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step is not None and x.numel() <= NATIVE_ROWS * x.shape[-1]:
            y = self.step(x)
            if y is not None:
                return y
        if self.one is not None and x.numel() == x.shape[-1]:
            return self.one(x.reshape(1, -1)).view(x.shape)
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split(self.gate_proj.out_features, dim=-1)
            return self.down_proj(self.act(gate, up))
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
