"""DeepSeek-V4's routers (DS-V4 ``inference/model.py`` ``Gate``, transformers ``DeepseekV4TopKRouter`` /
``DeepseekV4HashRouter``).

Both score every expert ``s = sqrt(softplus(gate.weight @ x))`` in float32 and weight the chosen
experts by ``routed_scaling_factor * s[sel] / sum(s[sel])``. They differ in the choice:

- :class:`V4Router` (layers >= ``num_hash_layers``): the ``top_k`` best of ``s + gate.bias`` over
  all experts (no groups; the bias chooses, it does not weight).
- :class:`HashRouter` (layers < ``num_hash_layers``): ``gate.tid2eid[token_id]``, a fixed table
  [vocab, top_k]; no bias.

The hash router needs each row's token id: :meth:`quantplug.blocks.MoE.forward` takes them as
``ids`` (the input ids, shaped as the hidden states' leading dims) and passes them to its gate as
``gate(x, ids=ids)`` only when given, so a router that does not route by token (and every caller
that passes none) is unchanged. Both declare their :class:`RouterSpec` (``spec``) so the native
stack step can route them (its bias is read from ``e_score_correction_bias``, here the release's
``gate.bias``; the table from ``tid2eid``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..contract.routing import RouterSpec, route
from ..layers.linear import FloatParams, Source

if TYPE_CHECKING:
    from ..contract.config import ModelConfig

#: the stored dtypes a token -> experts table may have (DS-V4 int32, transformers int64)
TID2EID_DTYPES = ("I32", "I64")


class V4Router(FloatParams):
    """DeepSeek-V4's learned router: greedy top-k of ``sqrt(softplus(logits)) + bias`` (``gate.bias``,
    held as ``e_score_correction_bias`` as DeepSeek-V3's router names it), weights the chosen
    scores normalized (``norm_topk_prob``) and scaled (``routed_scaling_factor``). ``ids`` is
    accepted and ignored (an MoE passes the token ids to whichever router it holds)."""

    qp_fp32 = frozenset({"weight", "e_score_correction_bias"})
    # registered by the loader from the plan; declared for type checkers
    weight: torch.Tensor
    e_score_correction_bias: torch.Tensor

    def __init__(self, cfg: ModelConfig, ckpt: str) -> None:
        super().__init__()
        self.qp_init(ckpt)
        self.cfg = cfg
        self.add_float("weight", (cfg.n_routed_experts, cfg.hidden_size), f"{ckpt}.weight")
        self.add_float("e_score_correction_bias", (cfg.n_routed_experts,), f"{ckpt}.bias")

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``sqrt(softplus(weight @ x))`` [rows, experts] of x [rows, hidden]."""
        xf = x if x.dtype == torch.float32 else x.float()
        wf = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        return F.softplus(F.linear(xf, wf)).sqrt()

    def _weights(self, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        w = scores.gather(1, idx)
        if self.cfg.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, hidden] -> expert ids [rows, top_k] (int64) and their float32 weights."""
        s = self.scores(x.reshape(-1, x.shape[-1]))
        idx = torch.topk(s + self.e_score_correction_bias.float(), k=self.cfg.num_experts_per_tok, dim=-1,
                         sorted=False)[1]
        return idx, self._weights(s, idx)

    def route_one(self, x: torch.Tensor) -> tuple[list[int], list[float]]:
        """One token [1, hidden] routed on Python floats (:func:`quantplug.contract.routing.route`:
        ties toward the lower id; the weights to a float32 rounding of :meth:`forward`'s)."""
        ids, ws = route(self.spec, x.reshape(1, -1), self.weight, self.e_score_correction_bias)
        return ids[0], ws[0]

    @property
    def spec(self) -> RouterSpec:
        cfg = self.cfg
        return RouterSpec(score="sqrtsoftplus", select="greedy", top_k=cfg.num_experts_per_tok,
                          norm_topk=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor, has_bias=True)


class HashRouter(V4Router):
    """DeepSeek-V4's hash router (the first ``num_hash_layers`` layers): the experts of row r are
    ``tid2eid[ids[r]]`` (``gate.tid2eid`` [vocab, top_k], int32 or int64 as stored), in the table's
    order; the weights are the learned gate's scores of them, normalized and scaled as
    :class:`V4Router`'s. No bias. ``forward`` needs ``ids`` (a ValueError otherwise: a hash layer
    cannot route without the tokens), and so does routing one token (:meth:`route_ids`)."""

    qp_fp32 = frozenset({"weight"})
    tid2eid: torch.Tensor

    def __init__(self, cfg: ModelConfig, ckpt: str) -> None:
        FloatParams.__init__(self)
        self.qp_init(ckpt)
        self.cfg = cfg
        self.add_float("weight", (cfg.n_routed_experts, cfg.hidden_size), f"{ckpt}.weight")
        self.qp_sources["tid2eid"] = [Source(f"{ckpt}.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok),
                                             TID2EID_DTYPES)]

    def qp_target_dtype(self, name: str, stored: str, model_dtype: torch.dtype) -> torch.dtype:
        if name == "tid2eid":
            return torch.int64  # an index tensor as torch takes it (gather)
        return super().qp_target_dtype(name, stored, model_dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, hidden], ids: the rows' token ids (any shape of ``rows`` elements) -> expert ids
        [rows, top_k] (int64) and their float32 weights."""
        if ids is None:
            raise ValueError(f"{self.qp_ckpt}: a hash-routed layer needs the token ids (MoE.forward(x, ids=...))")
        s = self.scores(x.reshape(-1, x.shape[-1]))
        idx = self.tid2eid[ids.reshape(-1).to(device=self.tid2eid.device, dtype=torch.long)].long()
        return idx, self._weights(s, idx)

    def route_one(self, x: torch.Tensor) -> tuple[list[int], list[float]]:
        raise ValueError(f"{self.qp_ckpt}: a hash-routed layer needs the token ids; route_one has none")

    def route_ids(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """Rows x [rows, hidden] with their token ids, routed on Python floats
        (:func:`quantplug.contract.routing.route`)."""
        return route(self.spec, x.reshape(-1, x.shape[-1]), self.weight, ids=ids.reshape(-1), tid2eid=self.tid2eid)

    @property
    def spec(self) -> RouterSpec:
        cfg = self.cfg
        return RouterSpec(score="sqrtsoftplus", select="greedy", top_k=cfg.num_experts_per_tok,
                          norm_topk=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor, by_token=True)
