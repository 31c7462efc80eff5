"""A routed MoE's router as data (:class:`RouterSpec`) and its reference route (:func:`route`).

A router scores the experts from its logits (``weight @ x``, float32): ``sigmoid`` (DeepSeek-V3),
``softmax`` (DeepSeek-V2) or ``sqrtsoftplus`` = sqrt(softplus(logit)) (DeepSeek-V4). It then
chooses ``top_k`` experts on the scores plus an optional bias (``has_bias``: DeepSeek-V3's
``e_score_correction_bias``, added for choosing only): ``greedy`` over all experts, or within the
``topk_group`` best of ``n_group`` groups, a group scored by the sum of its two best (``group_top2``:
DeepSeek-V3's ``noaux_tc``) or by its best (``group_max``: DeepSeek-V2's ``group_limited_greedy``).
A router ``by_token`` takes the experts of the token id from a table ``tid2eid`` [vocab, top_k]
instead (DeepSeek-V4's hash layers). The weights are the chosen experts' scores, divided by their
sum (``norm_topk``), times ``scaling``.

The native whole-stack step (``qp_router`` in ``core/kernels/qp_types.h``, ``blocks/router.c``)
routes any router that declares its spec (a ``spec`` property returning a :class:`RouterSpec`)
as :func:`route` does: the same ids, the weights to a float32 rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

#: scoring functions and their ids in the kernels (``QRS_*``)
SCORES = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}
#: selections and their ids in the kernels (``QRT_*``)
SELECTS = {"greedy": 0, "group_top2": 1, "group_max": 2}


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """How a router routes (see the module). ``n_group`` / ``topk_group`` matter to the group
    selections only; ``has_bias`` / ``by_token``: the router's tensors include a bias [experts] /
    a table ``tid2eid`` [vocab, top_k] (int32)."""

    score: str = "sigmoid"
    select: str = "greedy"
    top_k: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk: bool = False
    scaling: float = 1.0
    has_bias: bool = False
    by_token: bool = False

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"router score {self.score!r}: one of {', '.join(SCORES)}")
        if self.select not in SELECTS:
            raise ValueError(f"router selection {self.select!r}: one of {', '.join(SELECTS)}")
        if self.top_k < 1 or self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"router top_k {self.top_k}, n_group {self.n_group}, topk_group {self.topk_group}")


def scores(spec: RouterSpec, logits: torch.Tensor) -> torch.Tensor:
    """float32 scores of float32 ``logits`` [rows, experts], as torch computes them."""
    lg = logits.float()
    if spec.score == "softmax":
        return lg.softmax(dim=-1)
    if spec.score == "sqrtsoftplus":
        return F.softplus(lg).sqrt()
    return lg.sigmoid()


def route(spec: RouterSpec, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
          ids: Sequence[int] | torch.Tensor | None = None, tid2eid: torch.Tensor | None = None
          ) -> tuple[list[list[int]], list[list[float]]]:
    """The route of each row of ``x`` [rows, hidden] (with the router's ``weight`` [experts, hidden];
    without it ``x`` holds the logits [rows, experts]): per row the chosen expert ids, in the order
    chosen (best first; by token: the table's order), and their weights as Python floats.

    The scores are float32 (``scores``); the choice runs on Python floats (double) of the
    scores plus ``bias``, every tie broken toward the lower group / expert id; the weights'
    normalization (sum + 1e-20) and scaling in double (the native kernels round them to float32
    once). ``ids``: each row's token id (``by_token``, with ``tid2eid``)."""
    logits = x.float() if weight is None else F.linear(x.float(), weight.float())
    sc = scores(spec, logits).tolist()
    e = len(sc[0]) if sc else 0
    if spec.by_token:
        if ids is None or tid2eid is None:
            raise ValueError("a router by token needs the token ids and its tid2eid table")
        tok = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        table = tid2eid.tolist()
        chosen = [[int(v) for v in table[int(t)]] for t in tok]
    else:
        b = bias.float().tolist() if spec.has_bias and bias is not None else [0.0] * e
        chosen = []
        for s in sc:
            ch = [v + bv for v, bv in zip(s, b)]
            if spec.select == "greedy":
                cand = list(range(e))
            else:
                per = e // spec.n_group
                if spec.select == "group_top2":
                    gs = [sum(sorted(ch[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(spec.n_group)]
                else:
                    gs = [max(ch[g * per:(g + 1) * per]) for g in range(spec.n_group)]
                groups = sorted(range(spec.n_group), key=lambda g: (-gs[g], g))[:spec.topk_group]
                cand = [j for g in sorted(groups) for j in range(g * per, (g + 1) * per)]
            chosen.append(sorted(cand, key=lambda j: (-ch[j], j))[:spec.top_k])
    weights = []
    for s, idx in zip(sc, chosen):
        w = [s[j] for j in idx]
        if spec.norm_topk:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        weights.append([v * spec.scaling for v in w])
    return chosen, weights
