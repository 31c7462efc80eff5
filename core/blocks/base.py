"""What every block is built with: the plan oracle a model builds itself through (prefix, and every
per-module decision answered by the backend's hooks) and a planned linear made from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

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


def step_reduce(columns: Sequence[nn.Module], rows: Sequence[nn.Module]) -> tuple[bool, Any]:
    """Whether a fused step may run on these layers as this rank holds them, and the all-reduce of
    its partial output: every layer unsplit (no reduce), or the ``columns`` split by output rows
    and the ``rows`` by input features, each holding only its slice (``quantplug.parallel``), with
    no scheme reducing its own integer accumulators (``apply_row_parallel``)."""
    # getattr: any module an architecture passes (a third party's need not be a PlannedModule)
    par = [getattr(m, "qp_parallel", None) for m in (*columns, *rows)]
    if all(p is None for p in par):
        return True, None
    if any(p is None or not getattr(p, "sharded", False) for p in par):
        return False, None
    if any(getattr(p, "kind", "") != "column" or getattr(p, "gather", False) for p in par[:len(columns)]):
        return False, None
    if any(getattr(p, "kind", "") != "row" for p in par[len(columns):]):
        return False, None
    if any(getattr(type(getattr(m, "scheme", None)), "apply_row_parallel", None) is not LinearScheme.apply_row_parallel
           for m in rows):
        return False, None
    last: Any = par[-1]
    return True, last.comm.all_reduce
