"""DeepSeek-V3's router: grouped top-k over sigmoid scores shifted by ``e_score_correction_bias``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..contract.routing import RouterSpec
from ..layers.linear import FloatParams

if TYPE_CHECKING:
    from ..contract.config import ModelConfig


class Router(FloatParams):
    """Sigmoid router; ``e_score_correction_bias`` shifts the choice only, not the weights."""

    qp_fp32 = frozenset({"weight", "e_score_correction_bias"})
    e_score_correction_bias: torch.Tensor

    def __init__(self, cfg: ModelConfig, ckpt: str) -> None:
        super().__init__()
        self.qp_init(ckpt)
        self.cfg = cfg
        self.add_float("weight", (cfg.n_routed_experts, cfg.hidden_size), f"{ckpt}.weight")
        self.add_float("e_score_correction_bias", (cfg.n_routed_experts,), f"{ckpt}.e_score_correction_bias")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        e = cfg.n_routed_experts
        xf = x if x.dtype == torch.float32 else x.float()
        wf = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        scores = F.linear(xf, wf).sigmoid()
        choice = (scores + self.e_score_correction_bias).view(-1, cfg.n_group, e // cfg.n_group)
        group_scores = choice.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        # experts of the groups not chosen are out of the running
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, False)
        choice = choice.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, e)
        idx = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * cfg.routed_scaling_factor

    def route_one(self, x: torch.Tensor) -> tuple[list[int], list[float]]:
        """:meth:`forward` for one token [1, hidden], the choice made on Python floats: the token's
        top-k expert ids and weights (for a decode step a dozen list operations cost less than
        the tensor ops' dispatch). The scores are :meth:`forward`'s float32 sigmoids; sums and the
        normalization run in double precision (the weights may differ from :meth:`forward`'s in
        the last float32 bit, and an exact tie between two experts' biased scores is broken
        toward the lower id, where ``torch.topk`` leaves it unspecified)."""
        cfg = self.cfg
        xf = x if x.dtype == torch.float32 else x.float()
        wf = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        scores = F.linear(xf, wf).sigmoid_()[0].tolist()
        bias = self.e_score_correction_bias
        if getattr(self, "_bias_list", (None,))[0] is not bias:  # the parameter's values, read once
            self._bias_list = (bias, bias.tolist())
        choice = [s + b for s, b in zip(scores, self._bias_list[1])]
        per = cfg.n_routed_experts // cfg.n_group
        group_scores = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(cfg.n_group)]
        groups = sorted(range(cfg.n_group), key=lambda g: (-group_scores[g], g))[:cfg.topk_group]
        cand = [e for g in groups for e in range(g * per, (g + 1) * per)]
        idx = sorted(cand, key=lambda e: (-choice[e], e))[:cfg.num_experts_per_tok]
        w = [scores[e] for e in idx]
        if cfg.norm_topk_prob:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        return idx, [v * cfg.routed_scaling_factor for v in w]

    @property
    def spec(self) -> RouterSpec | None:
        """How this router routes, as data (:mod:`quantplug.contract.routing`; the native stack step routes
        by it); None for a subclass with a routing of its own (it declares its own spec)."""
        if type(self).forward is not Router.forward or type(self).route_one is not Router.route_one:
            return None
        cfg = self.cfg
        return RouterSpec(score="sigmoid", select="group_top2", top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                          topk_group=cfg.topk_group, norm_topk=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor,
                          has_bias=True)
