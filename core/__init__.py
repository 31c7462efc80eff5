"""quantplug: a plugin-based loader for quantized DeepSeek-V3 / Kimi (MLA + MoE) checkpoints."""

from __future__ import annotations

from . import errors, types
from ._version import __version__
from .hookspecs import hookimpl
from .loader import load
from .plan import LoadPlan, plan

__all__ = ["errors", "hookimpl", "load", "plan", "types", "LoadPlan", "__version__"]
