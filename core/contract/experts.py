"""What the expert store (:mod:`quantplug.experts`, load option ``expert_cache_mb``) needs of a
model's routed experts: :class:`RoutedExpertStacks`, the shape of the core's
``quantplug.models.deepseek.Experts`` (three stacked linears ``gate_proj`` / ``up_proj`` /
``down_proj``, one slot per expert). A protocol, so the store finds them without importing the
models (which import the store)."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable


@runtime_checkable
class RoutedExpertStacks(Protocol):
    """Routed experts as three stacked linears (gate, up: [E, I, H]; down: [E, H, I]) named
    ``gate_proj``, ``up_proj`` and ``down_proj`` (``quantplug.models.deepseek.Experts``)."""

    #: the stored per-expert names of (gate_proj, up_proj, down_proj) in DeepSeek's hub layout
    HUB_NAMES: ClassVar[tuple[str, str, str]]
    #: the module's checkpoint name
    qp_ckpt: str
    #: the experts served from the checkpoint's files (an ``ExpertStore``), None: held in memory
    qp_store: Any
