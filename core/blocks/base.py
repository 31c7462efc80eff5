"""What every block is built with: the plan oracle a model builds itself through (prefix, and every
per-module decision answered by the backend's hooks) and a planned linear made from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..layers.linear import LinearScheme, QuantLinear
from ..types import AttentionLayout


class PlanOracle(Protocol):
    """What the model asks the plan while it builds itself: the prefix, and every decision
    (scheme, attention layout, expert layout), each answered through the backend's hooks and
    recorded by the plan as a :class:`~quantplug.types.Decision`. An architecture added through
    ``quantplug_architectures`` builds itself with this, as :class:`DeepseekV3ForCausalLM` does."""

    prefix: str
    model_dtype: torch.dtype

    def ck(self, rel: str) -> str:
        """Checkpoint name of a text-model-relative name (prefix applied)."""
        ...

    def scheme(self, ckpt_name: str, kind: str = "linear", shards: Sequence[str] | None = None) -> LinearScheme:
        """Scheme for one linear (``kind`` "linear"), expert projection ("experts"), MLA K/V
        stack ("attn_k_b" / "attn_v_b") or the token embedding ("embedding"); ``shards``:
        checkpoint modules feeding it."""
        ...

    def layout(self, attn_ckpt_name: str) -> AttentionLayout: ...

    #: how many multi-token-prediction layers to build (``num_nextn_predict_layers``, or 0 when the
    #: load option ``mtp`` is false or the checkpoint stores none); an oracle without it builds none
    mtp_layers: int

    def expert_layout(self, experts_ckpt_name: str) -> str:
        """``"hub"`` (per-expert tensors), ``"fused"`` (transformers 5 gate_up_proj / down_proj),
        ``"stacked"`` (one [E, out, in] tensor per projection, GGUF ``ffn_*_exps``) or ``"none"``
        (no expert tensors: the scheme serves them, e.g. from an expert pack)."""
        ...


#: the name before contract 1.1 (it read like the :class:`Decision` record it produces)
Decisions = PlanOracle


def lin(d: Decisions, rel: str, i: int, o: int) -> QuantLinear:
    """A planned linear ``rel`` (text-model-relative name) of ``i`` -> ``o`` features, its scheme
    from the plan."""
    name = d.ck(rel)
    return QuantLinear(i, o, d.scheme(name), name, d.model_dtype)
