"""The core's compute layer: weight forms and the kernels that run them (torch and native C).

Backends describe how their stored tensors encode a weight (a *form*); the kernels here compute
with those forms. See the package modules for each form's layout and arithmetic.
"""

from . import compute, forms, ggml, native
from .forms import ActQuant, Form, Weights

__all__ = ["ActQuant", "Form", "Weights", "compute", "forms", "ggml", "native"]
