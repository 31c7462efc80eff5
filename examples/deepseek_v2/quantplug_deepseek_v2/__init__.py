"""DeepSeek-V2 / V2-Lite / V2.5 (``DeepseekV2ForCausalLM``) for quantplug: a third-party
architecture built from the core's blocks, registered through the ``quantplug.architectures``
entry-point group (``pyproject.toml``) with no change to quantplug's core.

DeepSeek-V2 is DeepSeek-V3's layer stack (MLA, dense MLPs then MoE with shared experts) with
another router: softmax scores over the experts, the top-k taken greedily or within the
``topk_group`` best groups (a group's score is its best expert's, ``group_limited_greedy``),
the chosen scores scaled by ``routed_scaling_factor`` and, where ``norm_topk_prob`` is true,
normalised first (DeepSeek's own modeling code; transformers' ``DeepseekV2TopkRouter`` never
normalises, so released configs, which set it false, agree). No ``e_score_correction_bias``.

What this package declares:

* its config schema (:func:`parse_config`: ``scoring_func`` must be ``softmax``, ``topk_method``
  ``greedy`` or ``group_limited_greedy``; every other key as the core reads DeepSeek-V3's);
* its skeleton: the core's ``DeepseekV3ForCausalLM`` with :class:`SoftmaxRouter` in each MoE
  block. The tensor-parallel plan, dense-state and engine mappings and the latent cache are the
  ones it inherits; every format backend works unchanged because every tensor is planned
  through the core's layers.

The router declares how it routes as data (its ``spec``, a :class:`quantplug.api.RouterSpec`:
softmax scores, greedy or group-max selection, no bias), so the core's whole-stack native decode
step routes it too: a decode step is one native call, as DeepSeek-V3's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from quantplug import api

QUANTPLUG_CONTRACT = "1.11"

TOPK_METHODS = ("greedy", "group_limited_greedy")


def parse_config(config: dict[str, Any], architecture: str, wrapped: bool, file: str) -> api.ModelConfig:
    """DeepSeek-V2's config: the router's keys checked here, the rest by the core's parser."""
    f = api.Fields(config, file)
    f.get_str("scoring_func", "softmax", choices=("softmax",))
    f.get_str("topk_method", "greedy", choices=TOPK_METHODS)
    core = {k: v for k, v in config.items() if k not in ("scoring_func", "topk_method")}
    cfg = api.parse_model_config(core, architecture, wrapped, file)
    return dataclasses.replace(cfg, raw=config)


class SoftmaxRouter(api.FloatParams):
    """DeepSeek-V2's router (``mlp.gate.weight`` [experts, hidden], float32)."""

    qp_fp32 = frozenset({"weight"})
    weight: torch.Tensor

    def __init__(self, cfg: api.ModelConfig, ckpt: str) -> None:
        super().__init__()
        self.qp_init(ckpt)
        self.cfg = cfg
        self.method = str(cfg.raw.get("topk_method", "greedy"))
        self.add_float("weight", (cfg.n_routed_experts, cfg.hidden_size), f"{ckpt}.weight")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids and weights of each row of ``x`` [rows, hidden]: ([rows, k], [rows, k])."""
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).softmax(dim=-1)
        if self.method == "group_limited_greedy":
            groups = scores.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group).amax(dim=-1)
            keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(
                1, torch.topk(groups, cfg.topk_group, dim=-1, sorted=False)[1], True)
            scores = scores.masked_fill(~keep.repeat_interleave(cfg.n_routed_experts // cfg.n_group, dim=1), 0.0)
        w, idx = torch.topk(scores, cfg.num_experts_per_tok, dim=-1, sorted=False)
        if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * cfg.routed_scaling_factor

    @property
    def spec(self) -> api.RouterSpec:
        """This router as data: softmax scores, the top-k greedy or within the best groups by their
        best score, normalised (where ``norm_topk_prob`` and top-k > 1) before the scaling."""
        cfg = self.cfg
        grouped = self.method == "group_limited_greedy"
        return api.RouterSpec(score="softmax", select="group_max" if grouped else "greedy", top_k=cfg.num_experts_per_tok,
                          n_group=cfg.n_group if grouped else 1, topk_group=cfg.topk_group if grouped else 1,
                          norm_topk=cfg.norm_topk_prob and cfg.num_experts_per_tok > 1,
                          scaling=cfg.routed_scaling_factor)

    def route_one(self, x: torch.Tensor) -> tuple[list[int], list[float]]:
        """:meth:`forward` for one token [1, hidden], as Python lists (the MoE block's decode step):
        :func:`quantplug.contract.routing.route` of :attr:`spec`, as the native stack step routes (ties to
        the lower id, the weights' sums in double)."""
        ids, ws = api.route(self.spec, x.reshape(1, -1), self.weight)
        return ids[0], ws[0]


class DeepseekV2ForCausalLM(api.DeepseekV3ForCausalLM):
    """DeepSeek-V3's skeleton with DeepSeek-V2's router in every MoE block."""

    def __init__(self, cfg: api.ModelConfig, d: Any) -> None:
        super().__init__(cfg, d)
        for layer in self.model.layers:
            if isinstance(layer.mlp, api.MoE):
                layer.mlp.gate = SoftmaxRouter(cfg, layer.mlp.gate.qp_ckpt)


DEEPSEEK_V2 = api.ArchSpec("DeepseekV2ForCausalLM", DeepseekV2ForCausalLM, False, (), parse_config)
