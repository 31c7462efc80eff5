"""DeepSeek-V4's blocks through the native kernels: the clamped SwiGLU as the native gated MLP's
activation (``act=("silu_clamp", limit, None)``, dense and stacked steps against
``quantplug.layers.activation.silu_clamp_mul`` on float32, FP8 block and FP4 E8M0-group-32 weights),
the hyper-connection mix (``compute.HyperStep``, C ``qp_hyper_pre`` / ``qp_hyper_post``) against
``quantplug.blocks.hyper``'s torch math, and the tiny V4 model decoding with its MoE (both router
kinds, by the routers' declared specs) and mHC lowered, against transformers 5.25."""

from __future__ import annotations

import pytest
import torch
from quantplug.blocks.hyper import HyperConnection, HyperHead
from quantplug.errors import QuantplugError
from quantplug.kernels import compute, native
from quantplug.kernels.compute import HyperStep, MLPStep
from quantplug.kernels.forms import Form, Weights
from quantplug.layers.activation import silu_clamp_mul
from test_mlp_situ import H, Layer, mlp, ref_mlp, rel

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIM = 0.6


def count_calls(monkeypatch: pytest.MonkeyPatch, *names: str) -> dict[str, int]:
    """Count the calls of the native library's functions ``names`` (a dict that fills as they run)."""
    lib = native.library()
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(lib, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(lib, name, counted)
    return calls


def clamp_act(limit: float):
    return lambda g, u: silu_clamp_mul(g, u, limit)


def fp8_mlp(seed: int) -> tuple[Layer, Layer, Layer]:
    """A gated MLP with FP8 E4M3 weights and E8M0 scales per 128 x 128 block (the release's dense form)."""
    g = torch.Generator().manual_seed(seed)

    def w(n: int, k: int) -> Layer:
        codes = (torch.randn(n, k, generator=g) * 0.5).to(torch.float8_e4m3fn)
        scale = torch.randint(124, 128, (n // 128, k // 128), dtype=torch.uint8, generator=g)
        return Layer(Weights(Form("FP8", scale="E8M0", group=128, rows=128), codes, scale=scale), n, k, None)
    return w(128, H), w(128, H), w(H, 128)


@needs_native
@pytest.mark.parametrize("form", ["F32", "FP4", "FP8"])
def test_dense_clamped_swiglu_step_equals_the_torch_formula(form):
    layers = fp8_mlp(3) if form == "FP8" else mlp(form, None)
    step = MLPStep.build(*layers, stacked=False, act=("silu_clamp", LIM, None))
    assert step is not None and step.act == (compute.MLP_ACTS["silu_clamp"], LIM, 0.0)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1)) * 2
    got, want = step(x), ref_mlp(layers, x, clamp_act(LIM))
    assert rel(got, want) < 1e-5
    # the clamp cuts here: the unclamped SwiGLU is far from it
    assert rel(ref_mlp(layers, x, lambda a, b: torch.nn.functional.silu(a) * b), want) > 1e-2


@needs_native
@pytest.mark.parametrize("form", ["F32", "FP4"])
def test_routed_clamped_swiglu_step_equals_the_torch_formula(form):
    layers = mlp(form, 4, seed=5)
    step = MLPStep.build(*layers, stacked=True, act=("silu_clamp", LIM, None))
    assert step is not None
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(2)) * 2
    pairs = [(0, 1, 0.25), (1, 1, 0.5), (1, 2, 1.25), (0, 3, 0.75)]  # (row, slot, weight), by slot
    got = step(x, pairs)
    want = torch.zeros_like(got)
    for r, s, w in pairs:
        want[r] += w * ref_mlp(layers, x[r:r + 1], clamp_act(LIM), slot=s)[0]
    assert rel(got, want) < 1e-5


@needs_native
def test_clamp_keeps_nan_and_refuses_bad_limits():
    layers = mlp("F32", None)
    step = MLPStep.build(*layers, stacked=False, act=("silu_clamp", LIM, None))
    x = torch.randn(1, H)
    x[0, 3] = float("nan")
    assert torch.isnan(step(x)).all()  # fminf would have turned the NaN into the limit
    for bad in (("silu_clamp", 0.0, None), ("silu_clamp", float("inf"), None), ("silu_clamp", 1.0, 2.0)):
        with pytest.raises(QuantplugError, match="silu_clamp"):
            compute.mlp_act(bad)


def _hyper(n: int, d: int, seed: int, head: bool = False):
    g = torch.Generator().manual_seed(seed)
    m = n if head else (2 + n) * n
    mod = HyperHead("hc_head", d, hc_mult=n) if head else HyperConnection("hc", d, hc_mult=n)
    mod.fn = torch.randn(m, n * d, generator=g) * (n * d) ** -0.5
    mod.base = torch.randn(m, generator=g) * 0.5
    mod.scale = torch.rand(1 if head else 3, generator=g) + 0.5
    return mod


@needs_native
@pytest.mark.parametrize("n,d,rows", [(4, 64, 1), (4, 96, 3), (2, 40, 2)])
def test_hyper_step_equals_the_blocks_math(n, d, rows):
    mod = _hyper(n, d, seed=n + d)
    step = HyperStep.build(mod, n, mod.sinkhorn_iters, mod.hc_eps, mod.norm_eps, head=False)
    assert step is not None
    x = torch.randn(rows, n, d, generator=torch.Generator().manual_seed(7))
    pre, post, comb = mod.weights(x)
    u, npre, npost, ncomb = step.pre(x)
    assert rel(npre, pre) < 1e-6 and rel(npost, post) < 1e-6 and rel(ncomb, comb) < 1e-5
    assert rel(u, HyperConnection.collapse(x, pre)) < 1e-5
    f = torch.randn(rows, d)
    assert rel(step.post(f, x, npost, ncomb), HyperConnection.expand(f, x, post, comb)) < 1e-5
    # the Sinkhorn iterations matter: one iteration's matrix is not the block's
    mod.sinkhorn_iters = 1
    assert rel(mod.weights(x)[2], comb) > 1e-4
    head = _hyper(n, d, seed=1, head=True)
    hstep = HyperStep.build(head, n, 1, head.hc_eps, head.norm_eps, head=True)
    assert rel(hstep.pre(x)[0], head(x)) < 1e-5


@needs_native
def test_hyper_step_declines_what_it_cannot_run():
    mod = _hyper(4, 32, seed=0)
    step = HyperStep.build(mod, 4, 20, 1e-6, 1e-6, head=False)
    assert step.pre(torch.randn(1, 4, 32, dtype=torch.bfloat16)) is None  # float32 streams only
    mod.fn = mod.fn.clone()  # tensors replaced after binding
    assert step.pre(torch.randn(1, 4, 32)) is None
    mod.fn = mod.fn.to(torch.bfloat16)
    assert HyperStep.build(mod, 4, 20, 1e-6, 1e-6, head=False) is None


# -- the tiny DeepSeek-V4 model with its MoE and mHC lowered --------------------------------------------

@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from v4_models import reference_model, write_float_checkpoint

    # q_lora_rank 32: the native products take inputs in multiples of 32 (the release's are of 128);
    # at the shared tiny model's 24 the attention declines its native step and runs its forward
    ref = reference_model(q_lora_rank=32)
    return ref, write_float_checkpoint(tmp_path_factory.mktemp("v4n") / "ckpt", ref, config={"q_lora_rank": 32})


@needs_native
def test_v4_decode_runs_moe_and_mhc_natively_and_equals_transformers(v4, monkeypatch):
    import quantplug
    from quantplug.blocks.v4_router import HashRouter

    ref, path = v4
    model = quantplug.load(path)
    layers = list(model.layers)
    assert isinstance(layers[0].ffn.gate, HashRouter)  # both router kinds are in the model
    for layer in layers:
        assert layer.ffn.experts.step is not None and layer.ffn.shared_experts.step is not None
        assert layer.hc_attn.step is not None and layer.hc_ffn.step is not None
        assert layer.ffn.experts.step.act[0] == compute.MLP_ACTS["silu_clamp"]
        assert layer.attn.step is not None
    assert model.hc_head.step is not None
    calls = count_calls(monkeypatch, "qp_mlp", "qp_hyper_pre", "qp_hyper_post", "qp_window_step")
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(11))
    model._stack = None  # block by block here (the whole-stack step: test_v4_decodes_in_one_native_call_per_token)
    cache = model.qp_new_cache(1, 64, 64)
    seq = ids
    with torch.no_grad():
        got = model.next_logits(ids, cache)  # the prompt: its rows run the blocks' own forwards
        for c in calls:
            calls[c] = 0
        steps = 14  # crosses the window (8) and several compression windows (4 and 8) while decoding
        for i in range(steps):
            seq = torch.cat([seq, got.argmax(-1, keepdim=True)], dim=1)
            got = model.next_logits(seq[:, -1:], cache)
            want = ref(seq).logits[:, -1]
            assert float((got - want).abs().max() / want.abs().max()) < 1e-5, i
    n = len(layers)
    # per decode token: the routed and the shared experts of every layer, two mixes per layer and the head
    assert calls == {"qp_mlp": 2 * n * steps, "qp_hyper_pre": (2 * n + 1) * steps, "qp_hyper_post": 2 * n * steps,
                     "qp_window_step": n * steps}


def _cache_tensors(cache) -> dict[str, torch.Tensor]:
    out = {}
    for i, c in enumerate(cache.layers):
        out[f"{i}.window"] = c.window
        for part in ("compressor", "indexer"):
            st = getattr(c, part)
            for f in ("kv", "gate", "prev_kv", "prev_gate", "entries"):
                t = getattr(st, f)
                if t is not None:
                    out[f"{i}.{part}.{f}"] = t
    return out


@needs_native
def test_v4_native_attention_keeps_the_torch_cache_and_the_paths_switch(v4):
    """The native attention step writes the cache the blocks' forwards write (window, unfinished
    windows, overlap halves, entries): the torch path continues a native run and the other way
    round, every step equal to transformers, and both caches agree tensor for tensor."""
    import quantplug

    ref, path = v4
    native_m, torch_m = quantplug.load(path), quantplug.load(path)
    native_m._stack = torch_m._stack = None  # block by block
    for layer in torch_m.layers:
        layer.attn.step = None  # the block's own forward
    ids = torch.randint(0, 96, (1, 3), generator=torch.Generator().manual_seed(5))
    cn, ct = native_m.qp_new_cache(1, 64, 64), torch_m.qp_new_cache(1, 64, 64)
    seq = ids
    with torch.no_grad():
        got = native_m.next_logits(ids, cn)
        torch_m.next_logits(ids, ct)
        for i in range(18):
            seq = torch.cat([seq, got.argmax(-1, keepdim=True)], dim=1)
            if i == 6:  # switch: the torch path continues on the native path's cache
                saved = [layer.attn.step for layer in native_m.layers]
                for layer in native_m.layers:
                    layer.attn.step = None
            if i == 11:  # and back
                for layer, s in zip(native_m.layers, saved):
                    layer.attn.step = s
            got = native_m.next_logits(seq[:, -1:], cn)
            torch_m.next_logits(seq[:, -1:], ct)
            want = ref(seq).logits[:, -1]
            assert float((got - want).abs().max() / want.abs().max()) < 1e-5, i
    a, b = _cache_tensors(cn), _cache_tensors(ct)
    assert a.keys() == b.keys() and any(k.endswith("indexer.entries") for k in a)
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert float((a[k] - b[k]).abs().max()) <= 1e-5 * max(1.0, float(b[k].abs().max())), k



@needs_native
def test_v4_decodes_in_one_native_call_per_token(v4, monkeypatch):
    """Greedy generation: every token after the prompt's is one ``qp_hyper_decode_step`` call (the
    per-block kernels are not called), with the tokens of the per-block native path and of the
    blocks' torch forwards, and each step's logits equal to transformers' (float32, 1e-5)."""
    import quantplug

    ref, path = v4
    model = quantplug.load(path)
    calls = count_calls(monkeypatch, "qp_hyper_decode_step", "qp_window_step", "qp_mlp", "qp_hyper_pre")
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(21))
    new = 16  # crosses the window and the compression windows, new entries appear while decoding
    with torch.no_grad():
        out = model.generate(ids, new, eos_token_id=None)
    n = len(model.layers)
    # the prompt's rows ran block by block (one call per MLP and per mix, its attention in torch); every
    # decode token after it is one call, nothing per block
    assert calls == {"qp_hyper_decode_step": new - 1, "qp_window_step": 0, "qp_mlp": 2 * n, "qp_hyper_pre": 2 * n + 1}
    want = ref.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, want)
    # the per-block native steps, and the blocks' own forwards, give the same tokens
    model._stack = None
    with torch.no_grad():
        assert torch.equal(model.generate(ids, new, eos_token_id=None), out)
        for layer in model.layers:
            layer.attn.step = layer.hc_attn.step = layer.hc_ffn.step = None
            layer.ffn.experts.step = layer.ffn.shared_experts.step = None
        assert torch.equal(model.generate(ids, new, eos_token_id=None), out)
    assert calls["qp_hyper_decode_step"] == new - 1


@needs_native
def test_v4_stack_logits_equal_transformers_and_the_paths_share_the_cache(v4):
    """Each decode step's logits equal transformers' (float32, 1e-5) while the whole-stack call and
    the blocks' torch forwards take turns on one cache, new compressed entries appearing in both."""
    import quantplug

    ref, path = v4
    model = quantplug.load(path)
    ids = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(8))
    cache = model.qp_new_cache(1, 64, 64)
    seq, stack = ids, None
    with torch.no_grad():
        got = model.next_logits(ids, cache)
        for i in range(17):
            seq = torch.cat([seq, got.argmax(-1, keepdim=True)], dim=1)
            torch_turn = 5 <= i < 10
            if torch_turn:  # the modules' forwards: no stack, no attention step
                model._stack = None
                saved = [layer.attn.step for layer in model.layers]
                for layer in model.layers:
                    layer.attn.step = None
            got = model.next_logits(seq[:, -1:], cache)
            if torch_turn:
                for layer, st in zip(model.layers, saved):
                    layer.attn.step = st
                model._stack = stack
            elif stack is None:
                stack = model._stack
                assert stack is not None
            want = ref(seq).logits[:, -1]
            assert float((got - want).abs().max() / want.abs().max()) < 1e-5, i


@needs_native
@pytest.mark.parametrize("act", ["none", "dynamic"])
def test_v4_release_format_decodes_in_one_native_call_per_token(v4, tmp_path, monkeypatch, act):
    """The release's FP8 (E8M0 blocks) dense linears and FP4 (E8M0 per 32) routed experts
    (``write_v4_release``): one native call per decode token, the tokens of the blocks' torch
    forwards; weight-only (``activation_quant=none``) also transformers' on the dequantized weights."""
    import quantplug
    import v4_models

    ref, _ = v4
    monkeypatch.setitem(v4_models.CONFIG, "q_lora_rank", 32)
    values = v4_models.write_v4_release(tmp_path / "rel", ref)
    opts = {"activation_quant": act}
    model, plain = quantplug.load(tmp_path / "rel", options=opts), quantplug.load(tmp_path / "rel", options=opts)
    plain._stack = None
    for layer in plain.layers:
        layer.attn.step = layer.hc_attn.step = layer.hc_ffn.step = layer.ffn.experts.step = None
        layer.ffn.shared_experts.step = None
    calls = count_calls(monkeypatch, "qp_hyper_decode_step")
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(2))
    new = 12
    with torch.no_grad():
        out = model.generate(ids, new, eos_token_id=None)
        assert calls["qp_hyper_decode_step"] == new - 1
        assert torch.equal(plain.generate(ids, new, eos_token_id=None), out)
        if act == "none":
            want = v4_models.set_release_weights(ref, values).generate(
                ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert torch.equal(out, want)


@needs_native
def test_v4_stack_declines_for_hooks_and_replaced_tensors(v4, monkeypatch):
    """A forward hook on a block, or a replaced router weight, sends decoding block by block (the
    hook is called; the tokens stay the one-call path's)."""
    import quantplug

    _, path = v4
    model = quantplug.load(path)
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model.generate(ids, 6, eos_token_id=None)
    calls = count_calls(monkeypatch, "qp_hyper_decode_step")
    seen = []
    handle = model.layers[1].ffn.register_forward_hook(lambda *a: seen.append(1))
    with torch.no_grad():
        assert torch.equal(model.generate(ids, 6, eos_token_id=None), want)
    assert calls["qp_hyper_decode_step"] == 0 and len(seen) == 6  # the prompt and five decode tokens through the block
    handle.remove()
    gate = model.layers[2].ffn.gate
    gate.weight = torch.nn.Parameter(gate.weight.detach().clone(), requires_grad=False)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, 6, eos_token_id=None), want)
    assert calls["qp_hyper_decode_step"] == 0


@needs_native
def test_v4_native_tokens_keep_the_rollback_log(v4):
    """The native steps log the raw rows the cache's roll-back needs (as the blocks' forwards do): a
    cache advanced natively truncates back (speculative decoding's rejected draft) and decodes on,
    every step equal to transformers' (float32, 1e-5)."""
    import quantplug
    from quantplug.models.deepseek_v4 import ROLLBACK

    ref, path = v4
    model = quantplug.load(path)
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(12))
    cache = model.qp_new_cache(1, 64, 64)
    seq = ids
    back = min(2, ROLLBACK)
    with torch.no_grad():
        got = model.next_logits(ids, cache)
        for i in range(14):
            if i in (6, 11):  # two tokens back, then on again from there (their entries rebuilt)
                cache.truncate(cache.length - back)
                seq = seq[:, :-back]
                got = ref(seq).logits[:, -1]  # the pick after the kept tokens
            seq = torch.cat([seq, got.argmax(-1, keepdim=True)], dim=1)
            got = model.next_logits(seq[:, -1:], cache)
            want = ref(seq).logits[:, -1]
            assert float((got - want).abs().max() / want.abs().max()) < 1e-5, i
    assert model._stack is not None and cache.length == seq.shape[1]
