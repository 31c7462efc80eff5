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


def test_route_one_chooses_what_the_router_chooses():
    """The decode step's routing on Python floats (Router.route_one) picks the same experts as
    the tensor router (Router.forward) with weights equal to float32 rounding, over group
    settings, with and without normalization."""
    from quantplug.models.config import parse_model_config
    from quantplug.models.deepseek import Router
    from quantplug.testing import tiny_config

    g = torch.Generator().manual_seed(0)
    for n_exp, groups, topk_group, k, norm in ((16, 4, 2, 4, True), (32, 8, 3, 6, False), (8, 1, 1, 2, True)):
        cfg = parse_model_config(tiny_config(n_routed_experts=n_exp, n_group=groups, topk_group=topk_group,
                                             num_experts_per_tok=k, norm_topk_prob=norm, routed_scaling_factor=2.5),
                                 "DeepseekV3ForCausalLM", False)
        router = Router(cfg, "model.layers.1.mlp.gate")
        router.register_parameter("weight", torch.nn.Parameter(torch.randn(n_exp, cfg.hidden_size, generator=g),
                                                                requires_grad=False))
        router.register_parameter("e_score_correction_bias",
                                  torch.nn.Parameter(torch.randn(n_exp, generator=g) * 0.1, requires_grad=False))
        for _ in range(50):
            x = torch.randn(1, cfg.hidden_size, generator=g)
            idx, w = router(x)
            ids, ws = router.route_one(x)
            order = torch.argsort(idx[0])
            assert sorted(ids) == idx[0][order].tolist()
            got = torch.tensor([ws[ids.index(e)] for e in sorted(ids)])
            torch.testing.assert_close(got, w[0][order], rtol=1e-6, atol=1e-7)


class MLPFusingDense(DenseScheme):
    def fuse_mlp(self, gate, up, down):
        return lambda x: down(torch.nn.functional.silu(gate(x)) * up(x))


def test_fuse_mlp_asks_the_scheme_only_for_matching_unsplit_layers():
    from quantplug.api import fuse_mlp

    gate, up, down = _lin(MLPFusingDense(), 5, 3), _lin(MLPFusingDense(), 5, 3), _lin(MLPFusingDense(), 3, 5)
    f = fuse_mlp(gate, up, down)
    x = torch.randn(1, 3)
    assert f is not None and torch.equal(f(x), down(torch.nn.functional.silu(gate(x)) * up(x)))
    assert fuse_mlp(_lin(DenseScheme(), 5, 3), _lin(DenseScheme(), 5, 3), _lin(DenseScheme(), 3, 5)) is None
    assert fuse_mlp(gate, up, _lin(MLPFusingDense(), 3, 4)) is None                  # down's input is not I
    assert fuse_mlp(gate, _lin(FusingDense(), 5, 3), down) is None                   # two scheme classes
    down.qp_parallel = object()                                                      # tensor-parallel
    assert fuse_mlp(gate, up, down) is None
