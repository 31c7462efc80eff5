"""The core's compute layer: weight forms and the kernels that run them (torch and native C).

Backends describe how their stored tensors encode a weight (a *form*); the kernels here compute
with those forms. See the package modules for each form's layout and arithmetic.
"""

from . import ggml, native

__all__ = ["ggml", "native"]
