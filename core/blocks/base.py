"""What every block is built with: the plan oracle a model builds itself through (prefix, and every
per-module decision answered by the backend's hooks) and a planned linear made from it."""

from __future__ import annotations

from ..contract.arch import PlanOracle
from ..layers.linear import QuantLinear

#: the name before contract 1.1 (it read like the :class:`Decision` record it produces)
Decisions = PlanOracle


def lin(d: Decisions, rel: str, i: int, o: int) -> QuantLinear:
    """A planned linear ``rel`` (text-model-relative name) of ``i`` -> ``o`` features, its scheme
    from the plan."""
    name = d.ck(rel)
    return QuantLinear(i, o, d.scheme(name), name, d.model_dtype)
