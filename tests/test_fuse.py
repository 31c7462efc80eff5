"""``LinearScheme.fuse`` / ``fuse_projections`` (contract 1.2): when the core asks a scheme to run
sibling projections of one input as one call, and when it does not."""

from __future__ import annotations

import torch
from quantplug.api import DenseScheme
from quantplug.layers.linear import QuantLinear, fuse_projections


class FusingDense(DenseScheme):
    def fuse(self, layers):
        w = torch.cat([layer.weight for layer in layers])
        return lambda x: torch.nn.functional.linear(x, w)


class OtherFusingDense(FusingDense):
    pass


def _lin(scheme, out=4, inp=3):
    layer = QuantLinear(inp, out, scheme, "m.proj", torch.float32)
    layer.register_parameter("weight", torch.nn.Parameter(torch.randn(out, inp), requires_grad=False))
    return layer


def test_fused_when_one_scheme_class_overrides_fuse():
    a, b = _lin(FusingDense()), _lin(FusingDense(), out=5)
    f = fuse_projections([a, b])
    x = torch.randn(2, 3)
    assert f is not None and torch.equal(f(x), torch.cat([a(x), b(x)], dim=-1))


def test_not_fused_otherwise():
    assert fuse_projections([_lin(DenseScheme()), _lin(DenseScheme())]) is None        # default: no fusion
    assert fuse_projections([_lin(FusingDense()), _lin(OtherFusingDense())]) is None  # two scheme classes
    assert fuse_projections([_lin(FusingDense()), _lin(FusingDense(), inp=6)]) is None  # two input widths
    assert fuse_projections([_lin(FusingDense())]) is None                             # nothing to fuse
    split = _lin(FusingDense())
    split.qp_parallel = object()                                                       # tensor-parallel
    assert fuse_projections([split, _lin(FusingDense())]) is None
