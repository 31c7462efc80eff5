"""One KDA decode token (``quantplug.kernels.kda``): the native step against its torch twin over
several steps in a row (B 1 and 3, H 2..4, K 16 / 32 / 128, both forget gates, float32 and bfloat16
states), the short convolution's history against a full causal conv, and the twin against a
whole-sequence recurrence written here from the formulas (ARCHITECTURES.md B3 / C3); the AVX2 and
portable builds."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from quantplug.blocks.kda import kda_step_torch
from quantplug.kernels import native
from quantplug.kernels.kda import kda_step

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

EPS = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def make(b: int, h: int, k: int, w: int, seed: int, state_dtype: torch.dtype = torch.float32) -> dict:
    """A layer's parameters and a sequence state at some point: realistic magnitudes (decays near
    1, a state of the size a few hundred tokens leave)."""
    g = torch.Generator().manual_seed(seed)
    d = h * k
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"conv_w": r(3 * d, w) * 0.5, "conv_state": r(b, 3 * d, w - 1), "dt_bias": r(d),
            "a_log": r(h) * 0.5, "o_norm_w": 1 + 0.1 * r(k), "state": (r(b, h, k, k) * 0.3).to(state_dtype), "gen": g}


def token(p: dict, b: int, h: int, k: int) -> dict:
    """One token's inputs (the projections of x)."""
    g, d = p["gen"], h * k
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"u": r(b, 3 * d), "gpre": r(b, d), "beta_logits": r(b, h), "gate": r(b, d)}


def call(fn, p: dict, t: dict, lower_bound: float | None, state: torch.Tensor, conv_state: torch.Tensor):
    return fn(t["u"], p["conv_w"], conv_state, t["gpre"], p["dt_bias"], p["a_log"], lower_bound, t["beta_logits"],
              t["gate"], p["o_norm_w"], EPS, state)


@needs_native
@pytest.mark.parametrize(("b", "h", "k"), [(1, 2, 16), (3, 3, 32), (1, 4, 128), (3, 2, 128)])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_native_step_equals_the_torch_twin_over_several_steps(b, h, k, lower_bound):
    p = make(b, h, k, 4, seed=b * 100 + h * 10 + k)
    s_nat, s_ref = p["state"].clone(), p["state"].clone()
    c_nat, c_ref = p["conv_state"].clone(), p["conv_state"].clone()
    for _ in range(6):
        t = token(p, b, h, k)
        o = call(kda_step, p, t, lower_bound, s_nat, c_nat)
        ref = call(kda_step_torch, p, t, lower_bound, s_ref, c_ref)
        assert o is not None and o.shape == (b, h * k) and o.dtype == torch.float32
        assert rel(o, ref) < 1e-6, rel(o, ref)
        assert rel(s_nat, s_ref) < 1e-6, rel(s_nat, s_ref)
        assert torch.equal(c_nat, c_ref)  # the history is copied, never computed


@needs_native
@pytest.mark.parametrize(("b", "h", "k"), [(1, 2, 16), (3, 4, 32), (3, 2, 128)])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_bfloat16_state_rounds_the_float_update_and_stays_near_the_float32_run(b, h, k, lower_bound):
    """Per step from the same bfloat16 state the native step and the twin give o within 1e-6 and
    states at most one bfloat16 step apart where the float update sits at a rounding boundary
    (float32 summation order); over 16 steps the bfloat16 state stays within a bound of the float32 run."""
    p = make(b, h, k, 4, seed=7 * k + h, state_dtype=torch.bfloat16)
    s32 = p["state"].float()
    s_nat, c_nat, c32 = p["state"].clone(), p["conv_state"].clone(), p["conv_state"].clone()
    worst, worst_o = 0.0, 0.0
    for _ in range(16):
        t = token(p, b, h, k)
        s_ref, c_ref = s_nat.clone(), c_nat.clone()
        o = call(kda_step, p, t, lower_bound, s_nat, c_nat)
        ref = call(kda_step_torch, p, t, lower_bound, s_ref, c_ref)
        assert o is not None and rel(o, ref) < 1e-6, rel(o, ref)
        diff = (s_nat.float() - s_ref.float()).abs()
        # one bfloat16 step at most (or float32 rounding where the update cancels to near zero)
        assert bool((diff <= s_ref.float().abs() * 2.0 ** -7 + 1e-6 * s_ref.float().abs().max()).all())
        assert float((diff > 0).float().mean()) < 1e-3                   # and only at rounding boundaries
        o32 = call(kda_step, p, t, lower_bound, s32, c32)
        assert o32 is not None
        worst, worst_o = max(worst, rel(s_nat, s32)), max(worst_o, rel(o, o32))
    print(f"bfloat16 state vs the float32 run over 16 steps: S {worst:.2e}, o {worst_o:.2e} of max |.|")
    assert worst < 2e-2 and worst_o < 5e-2


def causal_conv(u: torch.Tensor, w: torch.Tensor, hist: torch.Tensor) -> torch.Tensor:
    """The full causal depthwise conv of a sequence u [T, B, C] with weights w [C, W] after the
    history hist [B, C, W - 1] (zero: a new sequence), as torch's Conv1d(padding=W - 1)[..., :T]."""
    t = u.shape[0]
    x = torch.cat([hist, u.permute(1, 2, 0)], dim=-1)                                # [B, C, W - 1 + T]
    return F.conv1d(x, w.unsqueeze(1), groups=w.shape[0])[..., :t].permute(2, 0, 1)   # [T, B, C]


def naive_sequence(p: dict, toks: list[dict], lower_bound: float | None, h: int, k: int) -> torch.Tensor:
    """KDA over a whole sequence from the formulas, one loop over tokens and heads: conv first (over
    all T tokens at once), then the recurrence per head; o [T, B, D]."""
    b, d = toks[0]["u"].shape[0], h * k
    c = F.silu(causal_conv(torch.stack([t["u"] for t in toks]), p["conv_w"], torch.zeros_like(p["conv_state"])))
    s = p["state"].float().clone()
    out = torch.empty(len(toks), b, d)
    for i, t in enumerate(toks):
        for bb in range(b):
            for hh in range(h):
                sl = slice(hh * k, (hh + 1) * k)
                q, kk, v = c[i, bb, sl], c[i, bb, d + hh * k:d + (hh + 1) * k], c[i, bb, 2 * d + hh * k:2 * d + (hh + 1) * k]
                q = q / torch.sqrt(q.pow(2).sum() + 1e-6) * k ** -0.5
                kk = kk / torch.sqrt(kk.pow(2).sum() + 1e-6)
                beta = torch.sigmoid(t["beta_logits"][bb, hh])
                pre = t["gpre"][bb, sl] + p["dt_bias"][sl]
                a = p["a_log"][hh].exp()
                g = lower_bound * torch.sigmoid(a * pre) if lower_bound is not None else -a * F.softplus(pre)
                sh = s[bb, hh] * g.exp()[:, None]
                sh = sh + beta * kk[:, None] * (v - (kk[:, None] * sh).sum(0))[None, :]
                s[bb, hh] = sh
                o = (q[:, None] * sh).sum(0)
                o = o * torch.rsqrt(o.pow(2).mean() + EPS) * p["o_norm_w"]
                out[i, bb, sl] = o * torch.sigmoid(t["gate"][bb, sl])
    return out


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("w", [4, 2])
def test_steps_from_a_new_sequence_equal_the_whole_sequence_recurrence(lower_bound, w):
    """T calls of the twin (and of the native step) from zero conv history equal the formulas run
    over the whole sequence with a full causal conv; the history then holds the last W - 1 inputs."""
    b, h, k, steps = 2, 3, 16, 9
    p = make(b, h, k, w, seed=11)
    toks = [token(p, b, h, k) for _ in range(steps)]
    want = naive_sequence(p, toks, lower_bound, h, k)
    runs = [kda_step_torch] + ([kda_step] if native.library() is not None else [])
    for fn in runs:
        s, c = p["state"].clone(), torch.zeros_like(p["conv_state"])
        got = torch.stack([call(fn, p, t, lower_bound, s, c) for t in toks])
        assert rel(got, want) < 1e-5, (fn.__name__, rel(got, want))
        last = torch.stack([t["u"] for t in toks[-(w - 1):]], dim=-1) if w > 1 else c
        assert torch.equal(c, last)


def test_the_conv_history_shifts_one_input_per_step():
    """The step's conv output is the causal conv's at each position (checked through q alone: a
    head whose k, v, gates are fixed), and its history the last W - 1 inputs, oldest first."""
    b, h, k, w = 1, 2, 16, 4
    p = make(b, h, k, w, seed=3)
    u = torch.randn(6, b, 3 * h * k, generator=torch.Generator().manual_seed(5))
    full = causal_conv(u, p["conv_w"], torch.zeros_like(p["conv_state"]))
    hist = torch.zeros_like(p["conv_state"])
    for t in range(6):
        x = torch.cat([hist, u[t].unsqueeze(-1)], dim=-1)
        torch.testing.assert_close((x * p["conv_w"]).sum(-1), full[t], rtol=1e-6, atol=1e-6)
        kda_step_torch(u[t], p["conv_w"], hist, torch.zeros(b, h * k), p["dt_bias"], p["a_log"], None,
                       torch.zeros(b, h), torch.zeros(b, h * k), p["o_norm_w"], EPS, p["state"].clone())
        assert torch.equal(hist[..., -1], u[t]) and (t < 1 or torch.equal(hist[..., -2], u[t - 1]))


@needs_native
def test_native_step_declines_what_it_does_not_take():
    b, h, k = 1, 2, 16
    p = make(b, h, k, 4, seed=1)
    t = token(p, b, h, k)
    args = lambda **kw: {**t, **{n: p[n] for n in ("conv_w", "dt_bias", "a_log", "o_norm_w")},  # noqa: E731
                         "conv_state": p["conv_state"].clone(), "state": p["state"].clone(), **kw}

    def run(a: dict):
        return kda_step(a["u"], a["conv_w"], a["conv_state"], a["gpre"], a["dt_bias"], a["a_log"], None,
                        a["beta_logits"], a["gate"], a["o_norm_w"], EPS, a["state"])

    assert run(args()) is not None
    assert run(args(u=t["u"].bfloat16())) is None                                   # not float32
    assert run(args(state=p["state"].transpose(-1, -2))) is None                    # not contiguous
    assert run(args(state=p["state"].half())) is None                               # float16 state
    assert run(args(gate=t["gate"][:, :-1])) is None                                # wrong shape
    assert run(args(a_log=p["a_log"].repeat(k))) is None                             # A_log per channel
    assert run(args(conv_w=p["conv_w"].requires_grad_())) is None                   # autograd
    with native.disabled():
        assert run(args()) is None


@needs_native
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -march levels")
@pytest.mark.parametrize(("march", "isa"), [("x86-64-v3", 2), ("x86-64", 0)])
def test_avx2_and_portable_builds_compute_the_same(monkeypatch, march_build, march, isa):
    lib = march_build(march)
    assert lib.qp_isa() == isa
    monkeypatch.setattr(native, "_lib", lib)
    monkeypatch.setattr(native, "_tried", True)
    for lb in (None, -5.0):
        test_native_step_equals_the_torch_twin_over_several_steps(3, 2, 128, lb)
        test_bfloat16_state_rounds_the_float_update_and_stays_near_the_float32_run(1, 2, 32, lb)
