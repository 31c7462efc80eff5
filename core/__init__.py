"""quantplug: a plugin-based loader for quantized DeepSeek-V3 / Kimi (MLA + MoE) checkpoints."""

from __future__ import annotations

from . import errors, types
from .hookspecs import hookimpl
from .loader import load
from .plan import LoadPlan, plan

from ._version import __version__
__all__ = ["errors", "hookimpl", "load", "plan", "types", "LoadPlan", "__version__"]
