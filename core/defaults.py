"""The core's own answers to the backend hooks, registered as plugin "core" with ``trylast``.

They answer last, so a backend's answer always wins; they make an unquantized checkpoint load
through exactly the same hooks as a quantized one.
"""

from __future__ import annotations

from typing import Any

from .hookspecs import hookimpl
from .layers.linear import DenseScheme, LinearScheme
from .types import AttentionLayout

WRAPPER_PREFIX = "language_model"


@hookimpl(trylast=True)
def quantplug_resolve_prefix(model_config: Any, checkpoint: Any) -> str:
    """Wrappers name text weights ``language_model.*``; infer it from the tensor names."""
    if model_config.is_wrapper and any(n.startswith(WRAPPER_PREFIX + ".") for n in checkpoint.tensors):
        return WRAPPER_PREFIX
    return ""


@hookimpl(trylast=True)
def quantplug_attention_layout() -> AttentionLayout:
    return AttentionLayout("dense", "core default: one kv_b_proj per MLA layer")


@hookimpl(trylast=True)
def quantplug_linear_scheme() -> LinearScheme:
    return DenseScheme()
