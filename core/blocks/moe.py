"""Routed experts (:class:`Experts`) and the mixture of experts (:class:`MoE`): a router, the
routed experts, optional shared experts, and Kimi-K3's latent MoE (experts in a narrower space)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..layers.activation import SILU, GatedAct
from ..layers.linear import (
    FusedLayout,
    PerIndexLayout,
    StackedLayout,
    StackedLinear,
    StackLayout,
    fuse_projections,
)
from ..layers.norm import RMSNorm
from .base import Decisions, lin
from .mlp import MLP
from .router import Router

if TYPE_CHECKING:
    from ..contract.config import ModelConfig
    from ..experts import ExpertStore
    from ..options import LoadOptions


class Experts(nn.Module):
    """Routed experts as three stacked linears (gate, up: [E, I, H]; down: [E, H, I]).

    ``hidden``: the experts' input / output width (default ``hidden_size``; Kimi-K3's latent MoE
    gives its latent width); ``names``: the stored names of the gate, up and down projections
    per expert (hub layout: ``{base}.{k}.{name}``; Kimi-Linear stores ``w1``, ``w3``, ``w2``);
    ``act``: the gated activation (the native step computes SiLU or SiTU; a scheme's fused MLP
    only SiLU)."""

    #: the stored per-expert names of (gate_proj, up_proj, down_proj) in DeepSeek's hub layout
    HUB_NAMES = ("gate_proj", "up_proj", "down_proj")
    #: its checkpoint name
    qp_ckpt: str
    #: expert-parallel all-reduce of the routed output (``quantplug.parallel``), None: unsplit
    qp_parallel: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: the experts served from the checkpoint's files (``quantplug.experts``, load option
    #: ``expert_cache_mb``), None: held in memory
    qp_store: ExpertStore | None = None
    #: a step's experts (few tokens) natively in one call, bound by the lowering
    #: (:class:`quantplug.kernels.compute.MLPStep`, :mod:`quantplug.lower`), None: none
    step: Any = None
    #: a token's experts in one call from the scheme (deprecated :meth:`LinearScheme.fuse_mlp`,
    #: bound by the lowering)
    one: Any = None
    #: few tokens x [M, hidden] through their experts ``(x, ids, weights)`` in one native call, and
    #: one token through the scheme's fused MLP ``(x, ids, weights)``: entry points the lowering
    #: binds (:func:`quantplug.lower.experts_step`, :func:`quantplug.lower.experts_one`)
    forward_step: Callable[..., torch.Tensor]
    forward_one: Callable[..., torch.Tensor]

    def __init__(self, cfg: ModelConfig, d: Decisions, base: str, *, hidden: int | None = None,
                 names: tuple[str, str, str] = HUB_NAMES, act: GatedAct = SILU) -> None:
        super().__init__()
        e, h, inter = cfg.n_routed_experts, hidden or cfg.hidden_size, cfg.moe_intermediate_size
        self.act = act
        self.n = e
        #: routed experts [first, first + count) are computed here (expert parallelism:
        #: :meth:`qp_hold_experts` gives each rank a contiguous block); stacked slot = k - slot_base
        #: (0 for schemes that address experts themselves, e.g. an expert pack)
        self.first, self.count, self.slot_base = 0, e, 0
        self.gate_proj: StackedLinear
        self.up_proj: StackedLinear
        self.down_proj: StackedLinear
        ckb = self.qp_ckpt = d.ck(base)
        layout = d.expert_layout(ckb)
        for proj, stored, (i, o) in zip(self.HUB_NAMES, names, ((h, inter), (h, inter), (inter, h))):
            name = f"{ckb}.{proj}"
            src: StackLayout
            if layout in ("hub", "none"):
                src = PerIndexLayout(tuple(f"{ckb}.{k}.{stored}" for k in range(e)))
            elif layout == "stacked":
                src = StackedLayout(name)
            elif proj == "down_proj":
                src = FusedLayout(f"{ckb}.down_proj")
            else:
                src = FusedLayout(f"{ckb}.gate_up_proj", 0 if proj == "gate_proj" else 1, 2)
            shards = [] if layout == "none" else list(src.stored)
            setattr(self, proj, StackedLinear(e, i, o, d.scheme(name, "experts", shards), name, src, d.model_dtype))
        #: gate and up in one grouped call when their scheme fuses them (:meth:`LinearScheme.fuse`)
        self.gate_up: Any = None

    def qp_hold_experts(self, start: int, count: int, slot_base: int,
                        reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """This rank computes routed experts ``[start, start + count)``, expert k in stacked slot
        ``k - slot_base``, its output summed over the ranks by ``reduce`` (``ExpertParallel``: the
        tensor-parallel plan splits them)."""
        self.first, self.count, self.slot_base = start, count, slot_base
        self.qp_parallel = reduce

    def qp_fuse(self) -> None:
        """Sibling projections a scheme runs as one (:meth:`LinearScheme.fuse`): gate and up."""
        self.gate_up = fuse_projections([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, H], idx / w [T, top_k]. Token-expert pairs are sorted by expert once (one
        bincount read back: the only host sync), each projection runs over the hit experts'
        consecutive row groups (``StackedLinear.forward_grouped``), and one ``index_add_`` sums
        the weighted rows back per token, in ascending expert order as a per-expert loop would."""
        if self.qp_store is not None:  # served from the checkpoint's files
            out = self.qp_store.forward(x, idx, w, self.first, self.count, self.slot_base)
            return self.qp_parallel(out) if self.qp_parallel is not None else out
        out = torch.zeros_like(x)
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)                 # by expert, then by token
        counts = torch.bincount(flat, minlength=self.n).tolist()
        lo = sum(counts[:self.first])
        groups = [(e - self.slot_base, counts[e]) for e in range(self.first, self.first + self.count) if counts[e]]
        if not groups:
            return self.qp_parallel(out) if self.qp_parallel is not None else out
        order = order[lo:lo + sum(n for _, n in groups)]
        tok = order // k
        xs = x.index_select(0, tok)
        if self.gate_up is not None:
            gate, up = self.gate_up(xs, groups).split(self.gate_proj.out_features, dim=-1)
            hs = self.act(gate, up)
        else:
            hs = self.act(self.gate_proj.forward_grouped(xs, groups), self.up_proj.forward_grouped(xs, groups))
        hs = self.down_proj.forward_grouped(hs, groups) * w.reshape(-1).index_select(0, order).unsqueeze(-1)
        out.index_add_(0, tok, hs.to(out.dtype))
        if self.qp_parallel is not None:
            out = self.qp_parallel(out)  # sum of every rank's experts: one all-reduce
        return out


class MoE(nn.Module):
    """Mixture of experts: ``gate`` (the router: ``gate(x)`` -> expert ids and weights per row,
    ``gate.route_one`` for one token, which a lowered decode step asks), the routed :class:`Experts`
    and optional shared experts (an :class:`MLP`). An architecture may put its own router in ``gate``.

    ``latent`` (Kimi-K3's latent MoE, ``routed_expert_hidden_size``): the routed experts work in a
    narrower space: ``z = routed_expert_down_proj(x)``, the weighted sum of the chosen experts of
    ``z`` (an RMSNorm ``routed_expert_norm`` of that sum when ``latent_norm``: the sum of every
    rank's experts, before the norm), then ``routed_expert_up_proj`` back to the hidden width; the
    router and the shared experts read ``x`` at full width. ``names`` / ``act``: the experts' stored
    projection names and the activation of every MLP here (see :class:`Experts`); ``gate``: the
    router (default DeepSeek-V3's :class:`Router` at ``{base}.gate``; e.g. DeepSeek-V4's
    ``quantplug.blocks.v4_router.V4Router`` / ``HashRouter``).

    ``forward(x, ids=None)``: ``ids`` are the token ids of x's rows (x's leading shape), for a
    router that routes by token (DeepSeek-V4's hash layers); given, they reach the gate as
    ``gate(rows, ids=ids)`` and the block's own routed path runs (never a lowered one, which
    routes without ids); None (every other caller): unchanged."""

    #: the next MoE layer, whose likely experts a decode step prefetches when experts are served
    #: from the checkpoint's files (set by the lowering after loading, :func:`quantplug.lower.accelerate`)
    qp_next: MoE | None = None
    #: load option ``expert_prefetch``
    qp_prefetch: bool = True

    def qp_configure(self, options: LoadOptions) -> None:
        """Takes load option ``expert_prefetch`` (it acts only where experts are served)."""
        self.qp_prefetch = options.expert_prefetch

    def __init__(self, cfg: ModelConfig, d: Decisions, base: str, *, names: tuple[str, str, str] = Experts.HUB_NAMES,
                 act: GatedAct = SILU, latent: int | None = None, latent_norm: bool = False,
                 gate: nn.Module | None = None,
                 shared_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        super().__init__()
        #: the router (any module routing as :class:`Router` does: ``gate(rows)``, ``route_one``, ``spec``)
        self.gate: Any = gate if gate is not None else Router(cfg, d.ck(f"{base}.gate"))
        #: the latent width of the routed experts (None: they read the hidden states themselves)
        self.latent = latent
        if latent is not None:
            self.routed_expert_down_proj = lin(d, f"{base}.routed_expert_down_proj", cfg.hidden_size, latent)
            self.routed_expert_up_proj = lin(d, f"{base}.routed_expert_up_proj", latent, cfg.hidden_size)
        self.routed_expert_norm = (RMSNorm(latent, cfg.rms_norm_eps, d.ck(f"{base}.routed_expert_norm"))
                                   if latent is not None and latent_norm else None)
        self.experts = Experts(cfg, d, f"{base}.experts", hidden=latent, names=names, act=act)
        self.shared_experts = (MLP(d, f"{base}.shared_experts", cfg.hidden_size,
                                   cfg.moe_intermediate_size * cfg.n_shared_experts, act, names=shared_names)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.latent is None:
            out = self._route_rows(x, x.reshape(-1, x.shape[-1]), x.shape, ids)
        else:
            flat = x.reshape(-1, x.shape[-1])
            z = self._route_rows(flat, self.routed_expert_down_proj(flat), (flat.shape[0], self.latent), ids)
            if self.routed_expert_norm is not None:
                z = self.routed_expert_norm(z)
            out = self.routed_expert_up_proj(z).view(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(self, route: torch.Tensor, flat: torch.Tensor, shape: Any) -> torch.Tensor:
        """The routed experts' weighted sum for the rows of ``flat`` [N, width] (the hidden states,
        or their latent), chosen by the router on ``route`` [N, hidden]; shaped ``shape``."""
        idx, w = self.gate(route.reshape(-1, route.shape[-1]))
        return self.experts(flat, idx, w).view(shape)

    def _route_rows(self, route: torch.Tensor, flat: torch.Tensor, shape: Any, ids: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_routed` (lowered or not) without token ids; with them, the gate routes by them."""
        if ids is None:
            return self._routed(route, flat, shape)
        idx, w = self.gate(route.reshape(-1, route.shape[-1]), ids=ids)
        return self.experts(flat, idx, w).view(shape)
