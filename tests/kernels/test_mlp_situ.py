"""Kimi-K3's SiTU as the native gated MLP's activation (``MLPStep.build(..., act=("situ", beta,
linear_beta))``): dense and stacked (routed experts) steps against the torch formula
(``quantplug.layers.activation.situ_mul``) on float32, Q8_0 and MXFP4-style FP4 weights; SiLU
stays the default; the whole-stack step declines SiTU; bad parameters are refused."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from quantplug.errors import QuantplugError
from quantplug.kernels import compute, native
from quantplug.kernels.compute import MLPStep, StackLayer, StackStep
from quantplug.kernels.forms import Form, Weights
from quantplug.kernels.native import Bound
from quantplug.kernels.reference import reference_dequantize
from quantplug.layers.activation import situ_mul
from quantplug_expert_pack.testing import random_rows

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, INTER, E = 128, 96, 4
SITU = ("situ", 4.0, 25.0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def weights(form: str, n: int, k: int, slots: int | None, seed: int) -> Weights:
    """Random weights [slots, n, k] (or [n, k]) in ``form``, of a size that makes activations
    reach SiTU's saturating range (|gate| past beta, |up| past linear_beta now and then)."""
    g = torch.Generator().manual_seed(seed)
    lead = (slots,) if slots else ()
    if form == "F32":
        return Weights(Form("F32"), torch.randn(*lead, n, k, generator=g) * 0.3)
    if form == "Q8_0":
        rows = random_rows("Q8_0", (int(np.prod(lead)) * n if lead else n, k), np.random.default_rng(seed), scale=2e-2)
        return Weights(Form("Q8_0"), torch.from_numpy(rows).reshape(*lead, n, -1))
    assert form == "FP4"  # MXFP4: e2m1 codes, E8M0 scales per 32 inputs (Kimi-K3's routed experts)
    codes = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(121, 126, (*lead, n, k // 32), dtype=torch.uint8, generator=g)
    return Weights(Form("FP4", scale="E8M0", group=32), codes, scale=scale)


class Layer(torch.nn.Module):
    """A bound linear as compute.bound() reads it (no sentinel: always live)."""

    def __init__(self, w: Weights, n: int, k: int, slots: int | None) -> None:
        super().__init__()
        self.qp_native = Bound(w, n, k, slots, torch.float32, "exact", "test")
        self.w, self.n, self.k, self.slots = w, n, k, slots

    def dense(self, slot: int | None = None) -> torch.Tensor:
        return reference_dequantize(self.w, self.n, self.k, slot)


def mlp(form: str, slots: int | None, seed: int = 0) -> tuple[Layer, Layer, Layer]:
    return (Layer(weights(form, INTER, H, slots, seed), INTER, H, slots),
            Layer(weights(form, INTER, H, slots, seed + 1), INTER, H, slots),
            Layer(weights(form, H, INTER, slots, seed + 2), H, INTER, slots))


def ref_mlp(layers: tuple[Layer, Layer, Layer], x: torch.Tensor, act, slot: int | None = None) -> torch.Tensor:
    g, u, d = (m.dense(slot) for m in layers)
    return act(x @ g.t(), x @ u.t()) @ d.t()


@needs_native
@pytest.mark.parametrize("form", ["F32", "Q8_0", "FP4"])
@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_dense_situ_step_equals_the_torch_formula(form, linear_beta):
    layers = mlp(form, None)
    step = MLPStep.build(*layers, stacked=False, act=("situ", 4.0, linear_beta))
    assert step is not None and step.act == (compute.MLP_ACTS["situ"], 4.0, linear_beta or 0.0)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1)) * 2
    want = ref_mlp(layers, x, lambda g, u: situ_mul(g, u, 4.0, linear_beta))
    got = step(x)
    # float32 sums in the kernels' order (AVX512's 32-wide Q8_0 tile: 1.02e-6 from torch's matmul)
    assert got is not None and rel(got, want) < 2e-6, rel(got, want)
    # SiTU is not SiLU here (the inputs reach tanh's bend)
    assert rel(ref_mlp(layers, x, lambda g, u: F.silu(g) * u), want) > 1e-3


@needs_native
@pytest.mark.parametrize("form", ["F32", "Q8_0", "FP4"])
def test_stacked_situ_step_equals_the_torch_formula(form):
    layers = mlp(form, E, seed=3)
    step = MLPStep.build(*layers, stacked=True, act=SITU)
    assert step is not None
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2)) * 2
    pairs = sorted([(0, 1, 0.7), (0, 3, 0.3), (1, 0, 1.1), (1, 1, 0.2), (2, 3, 0.5)], key=lambda p: p[1])
    want = torch.zeros(3, H)
    for r, s, w in sorted(pairs):  # each row's experts in ascending slot order, as the step sums them
        want[r] += w * ref_mlp(layers, x[r:r + 1], lambda g, u: situ_mul(g, u, *SITU[1:]), s)[0]
    got = step(x, pairs)
    assert got is not None and rel(got, want) < 1e-6, rel(got, want)
    # the expert-cache entry (mlp_over) takes the activation too
    one = [tuple(Layer(Weights(m.w.form, *[t[s] if t is not None else None for t in (m.w.weight, m.w.scale)]),
                       m.n, m.k, None) for m in layers) for s in range(E)]
    over = compute.mlp_over(one, x, [(r, s, w) for r, s, w in pairs], act=SITU)
    assert over is not None and rel(over, want) < 1e-6


@needs_native
@pytest.mark.parametrize("stacked", [False, True])
def test_silu_stays_the_default(stacked):
    layers = mlp("Q8_0", E if stacked else None, seed=5)
    step = MLPStep.build(*layers, stacked=stacked)
    assert step is not None and step.act == compute.SILU
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(4))
    pairs = [(0, 2, 1.0), (1, 2, 0.5)] if stacked else None
    want = ref_mlp(layers, x, lambda g, u: F.silu(g) * u, 2 if stacked else None)
    if stacked:
        want = want * torch.tensor([[1.0], [0.5]])
    got = step(x, pairs)
    assert got is not None and rel(got, want) < 1e-6


@needs_native
def test_bad_activations_are_refused():
    layers = mlp("F32", None)
    for act in (("gelu", 1.0, 1.0), ("situ", 0.0, 25.0), ("situ", 4.0, -1.0), ("situ", float("inf"), 1.0), "situ"):
        with pytest.raises(QuantplugError):
            MLPStep.build(*layers, stacked=False, act=act)
    step = MLPStep.build(*layers, stacked=False, act=SITU)
    assert step is not None
    step.act = (compute.MLP_ACTS["situ"], 0.0, 25.0)  # the C code checks too
    with pytest.raises(QuantplugError, match="code -1"):
        step(torch.randn(1, H))
    step.act = (7, 1.0, 1.0)
    with pytest.raises(QuantplugError, match="code -1"):
        step(torch.randn(1, H))


@needs_native
def test_the_whole_stack_step_takes_silu_mlps_only(monkeypatch):
    """qp_stack_step runs its MLPs with SiLU: a layer whose MLP step is SiTU's declines the stack."""
    monkeypatch.setattr(StackStep, "__init__", lambda self, *a: None)
    mla = types.SimpleNamespace(wround=0, reduce=None, h=H)
    norm = torch.ones(H)

    def build(act):
        step = MLPStep.build(*mlp("F32", None), stacked=False, act=act)
        layer = StackLayer(mla=mla, attn_norm=norm, ffn_norm=norm, eps=1e-6, mlp=step)  # type: ignore[arg-type]
        return StackStep.build([layer], norm, 1e-6, H, [], [])

    assert isinstance(build(None), StackStep)
    assert build(SITU) is None


def test_the_activation_ids_are_the_c_files():
    import re

    src = "\n".join(f.read_text() for f in native.sources())
    enums = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"\bQM_([A-Z0-9_]+) = (\d+)", src)}
    assert enums == compute.MLP_ACTS
