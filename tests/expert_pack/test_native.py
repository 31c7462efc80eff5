"""Native Q4_0 / Q8_0 kernels (``quantplug_expert_pack/qpk_kernels.c``, built with the system C
compiler): dequantization bit for bit against gguf-py and the torch kernels, both matrix-vector
modes against float64 references (exact: the exact weights; fast: llama.cpp's int8 blocks,
reproduced here in torch), every grouping the loader uses, and the fallback when no library can
be built. Skipped with the build's reason where this machine has no C compiler."""

from __future__ import annotations

import json
import platform
import zlib
from pathlib import Path

import numpy as np
import pytest
import quantplug
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from quantplug.generate import new_cache
from quantplug.models.config import parse_model_config
from quantplug.testing import random_state, tiny_config
from quantplug.kernels import ggml, native
from quantplug_expert_pack.export import gguf_state, write_gguf
from quantplug_expert_pack.testing import random_blocks, random_rows

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")
TYPES = sorted(native.TYPES)
BLOCK32 = ["Q4_0", "Q8_0"]          # what gguf-py can quantize a model to; K-quants come as raw blocks


def _rows(ggml_type: str, n: int, k: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_rows(ggml_type, (n, k), np.random.default_rng(seed), scale=1e-2))


def _q8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's activation blocks as the C file makes them: d = amax / 127 (float32), q = round
    half to even of x * (1 / d)."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return torch.round(b * inv), d


@needs_native
@pytest.mark.parametrize("ggml_type", TYPES)
def test_dequantize_bit_exact_with_gguf_py_and_the_torch_kernel(ggml_type):
    rng = np.random.default_rng(zlib.crc32(ggml_type.encode()))
    blocks = random_blocks(ggml_type, 4000, rng, 1.0).reshape(40, -1)
    ref = gguf_dequantize(blocks, GGMLQuantizationType[ggml_type])
    got = ggml.dequantize(torch.from_numpy(blocks), ggml_type)            # native path
    np.testing.assert_array_equal(got.numpy().view(np.uint32), np.ascontiguousarray(ref).view(np.uint32))
    # every f16 scale bit pattern (subnormals, inf, nan) agrees with the torch kernel's
    raw = np.random.default_rng(1).integers(0, 256, (1 << 16, native.BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    raw[:, :2] = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    t = torch.from_numpy(raw)
    fast = ggml.dequantize(t, ggml_type)
    with native.disabled():
        slow = ggml.dequantize(t, ggml_type)
    torch.testing.assert_close(fast, slow, rtol=0, atol=0, equal_nan=True)


@needs_native
@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
def test_gemm_both_modes_against_float64_references(ggml_type, m):
    n = 70                                           # rows not a multiple of the 4-row tile
    k = 160 if native.BLOCK_ELEMS[ggml_type] == 32 else 512   # 5 blocks / 2 super-blocks
    w = _rows(ggml_type, n, k, m)
    dense = ggml.dequantize(w, ggml_type).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ dense.t()
    # float32 rounding bound: a few ulps of the sum of |products|
    bound = lambda xs: 1e-6 * (xs.double().abs() @ dense.abs().t()) + 1e-30  # noqa: E731
    exact = native.gemm(x, [w.data_ptr()], [n], ggml_type, "exact")
    assert ((exact.double() - ref).abs() <= bound(x)).all()
    fast = native.gemm(x, [w.data_ptr()], [n], ggml_type, "fast")
    if ggml_type in native.EXACT_ONLY:               # K-quants: the exact path in both modes
        assert torch.equal(fast, exact)
        return
    q, d = _q8_blocks(x)
    # fast: per block, the integer dot product of the codes times d_w * d_x: the same as the exact
    # weights against the int8 blocks' values, up to float32 rounding
    xq = (q * d).reshape(m, k)
    assert ((fast.double() - xq.double() @ dense.t()).abs() <= bound(xq)).all()
    assert 0 < (fast.double() - ref).norm() / ref.norm() < 2e-2          # it is the int8 path


@needs_native
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gemm_groups_place_each_weights_rows_and_columns(mode):
    k = 64
    a, b = _rows("Q4_0", 20, k, 1), _rows("Q4_0", 12, k, 2)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    one = lambda w, xs: native.gemm(xs, [w.data_ptr()], [w.shape[0]], "Q4_0", mode)  # noqa: E731
    side = native.gemm(x, [a.data_ptr(), b.data_ptr()], [20, 12], "Q4_0", mode)      # gate + up
    assert torch.equal(side[:, :20], one(a, x)) and torch.equal(side[:, 20:], one(b, x))
    # a: rows 1..3 of x into y rows 1..3; b: row 4 into y row 0, columns 20.. (rest zero)
    y = native.gemm(x, [a.data_ptr(), b.data_ptr()], [20, 12], "Q4_0", mode, [(1, 3, 1, 0), (4, 1, 0, 20)], out_rows=4)
    assert y.shape == (4, 32)
    assert torch.equal(y[1:4, :20], one(a, x[1:4])) and torch.equal(y[0:1, 20:], one(b, x[4:5]))
    assert not y[0, :20].any() and not y[1:, 20:].any()
    # one x row repeated (stride 0), as a decode step's experts read the token
    rep = native.gemm(x[:1].expand(3, k), [a.data_ptr()], [20], "Q4_0", mode)
    assert torch.equal(rep, one(a, x[:1]).expand(3, -1))


@needs_native
def test_gemm_rejects_what_the_c_code_cannot_do():
    w = _rows("Q8_0", 4, 64, 0)
    with pytest.raises(RuntimeError, match="qpk_kernels gemm failed"):
        native.gemm(torch.randn(1, 48), [w.data_ptr()], [4], "Q8_0", "exact")   # K not whole blocks


@needs_native
def test_threads_split_big_weights_without_changing_results():
    w = _rows("Q4_0", 4096, 512, 4)                                     # 1.2 MB: many parallel tasks
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [native.gemm(x, [w.data_ptr()], [4096], "Q4_0", m) for m in ("exact", "fast")]
        torch.set_num_threads(2)
        two = [native.gemm(x, [w.data_ptr()], [4096], "Q4_0", m) for m in ("exact", "fast")]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))   # each output row is one task's work


def test_no_compiler_means_torch_paths_and_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.delenv("QUANTPLUG_NATIVE", raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("QUANTPLUG_CACHE", str(tmp_path))
    assert native.library() is None and "no C compiler" in native.status()
    w = _rows("Q4_0", 8, 64, 0)
    assert not ggml.native_ok(w, "Q4_0")
    x = torch.randn(1, 64)
    torch.testing.assert_close(ggml.linear(x, w, "Q4_0", torch.float32), x @ ggml.dequantize(w, "Q4_0").t())
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("QUANTPLUG_NATIVE", "0")
    assert native.library() is None and "disabled" in native.status()


def test_a_failed_build_is_reported_not_raised(monkeypatch, tmp_path):
    if native.library() is None:
        pytest.skip(f"native kernels: {native.status()}")
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setenv("QUANTPLUG_CACHE", str(tmp_path / "cache"))
    assert native.library() is None and "failed" in native.status()
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))   # no half-written library left


CFG = tiny_config(moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                  vocab_size=256)


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory):
    mc = parse_model_config(CFG, "DeepseekV3ForCausalLM", False)
    out = {}
    for t in BLOCK32:
        root = tmp_path_factory.mktemp(t)
        (root / "config.json").write_text(json.dumps(CFG))
        write_gguf(root / "model.gguf", gguf_state(random_state(CFG), mc), mc, default_type=t, vocab=256)
        out[t] = root
    return out


def _decode_logits(path: Path, kernels: str) -> torch.Tensor:
    model = quantplug.load(path, progress=False, options={"kernels": kernels})
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    steps = []
    with torch.inference_mode():
        cache = new_cache(model, 1, 32)
        steps.append(model.next_logits(ids, cache))            # 12 rows: the torch paths
        for t in range(6):                                      # 1 row: native where built
            steps.append(model.next_logits(ids[:, t:t + 1], cache))
    return torch.stack(steps)


@needs_native
@pytest.mark.parametrize("ggml_type", BLOCK32)
def test_decode_with_native_kernels_matches_the_torch_paths(gguf_dirs, ggml_type):
    """Exact: the same numbers as the torch path up to float32 summation order. Fast: the
    native int8-block path stays within the bounds fast mode promises against exact."""
    exact_native = _decode_logits(gguf_dirs[ggml_type], "exact")
    fast_native = _decode_logits(gguf_dirs[ggml_type], "fast")
    with native.disabled():
        exact_torch = _decode_logits(gguf_dirs[ggml_type], "exact")
    torch.testing.assert_close(exact_native, exact_torch, rtol=1e-4, atol=1e-5)
    err = ((fast_native - exact_torch).norm() / exact_torch.norm()).item()
    assert 0 < err <= 3e-2, err
    assert (fast_native.argmax(-1) == exact_torch.argmax(-1)).float().mean() >= 0.95


# widths in whole 32-blocks everywhere, so that every projection, K/V stack included, is packed
# and the one-token MLP and MLA steps run natively in both kernel modes
CFG32 = tiny_config(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16,
                    num_experts_per_tok=4, n_group=4, topk_group=2, vocab_size=256, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                    v_head_dim=32)


# K-quant rows need inputs in whole super-blocks of 256
CFGK = tiny_config(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1, vocab_size=256, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=256, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                   v_head_dim=64)
#: a llama-quantize Q4_K_M-like mix (most projections Q4_K, ffn_down Q6_K, attention output Q5_K),
#: with the routed experts' gate / up in Q2_K / Q3_K as the small "dynamic" DeepSeek quants store them
K_MIX = {"ffn_down": "Q6_K", "ffn_down_exps": "Q6_K", "ffn_down_shexp": "Q6_K", "attn_output": "Q5_K",
         "ffn_gate_exps": "Q2_K", "ffn_up_exps": "Q3_K"}
#: random_rows' scale per type, for weights of ~1e-2 (its d times the type's largest scale x code)
K_SCALE = {"Q4_K": 2e-5, "Q5_K": 2e-5, "Q6_K": 5e-6, "Q2_K": 4e-4, "Q3_K": 1e-4}


def write_k_mix(root: Path) -> Path:
    """A GGUF whose linears with 256-multiple rows are K-quant blocks (random valid ones: gguf-py
    cannot quantize to K-quants), the rest Q8_0."""
    mc = parse_model_config(CFGK, "DeepseekV3ForCausalLM", False)
    state = gguf_state(random_state(CFGK), mc)
    rng = np.random.default_rng(7)
    raw = {}
    for name in list(state):
        t = state[name]
        base = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        if t.dim() >= 2 and t.shape[-1] % 256 == 0 and base not in ("token_embd", "output", "ffn_gate_inp"):
            ggml_type = K_MIX.get(base, "Q4_K")
            raw[name] = (random_rows(ggml_type, tuple(t.shape), rng, scale=K_SCALE[ggml_type]), ggml_type)
            del state[name]
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CFGK))
    write_gguf(root / "model.gguf", state, mc, default_type="Q8_0", vocab=256, raw=raw)
    return root


@pytest.fixture(scope="module")
def gguf32(tmp_path_factory):
    mc = parse_model_config(CFG32, "DeepseekV3ForCausalLM", False)
    out = {}
    for t in BLOCK32:
        root = tmp_path_factory.mktemp(f"w32-{t}")
        (root / "config.json").write_text(json.dumps(CFG32))
        write_gguf(root / "model.gguf", gguf_state(random_state(CFG32), mc), mc, default_type=t, vocab=256)
        out[t] = root
    out["K-mix"] = write_k_mix(tmp_path_factory.mktemp("k-mix"))
    return out


def _steps(model: torch.nn.Module, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        cache = new_cache(model, 1, 32)
        logits = [model.next_logits(ids, cache)]
        for t in range(n):
            logits.append(model.next_logits(ids[:, t:t + 1], cache))
    return torch.stack(logits), torch.cat([c.latent[:, :, :cache.length] for c in cache.layers])


def _unfuse_one_token(model: torch.nn.Module) -> None:
    for mod in model.modules():
        if getattr(mod, "one", None) is not None:
            mod.one = None


@needs_native
@pytest.mark.parametrize("ggml_type", [*BLOCK32, "K-mix"])
@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_one_token_native_steps_equal_the_composed_path(gguf32, ggml_type, kernels):
    """Every MLA layer, dense MLP, shared and routed expert block of a decode step in one native
    call (fuse_attention / fuse_mlp) computes what the model's own path computes on the same
    native linears: the same logits and cached latents up to float32 summation order."""
    model = quantplug.load(gguf32[ggml_type], progress=False, options={"kernels": kernels})
    layers = model.model.layers
    assert all(layer.self_attn.one is not None for layer in layers)
    assert layers[0].mlp.one is not None and layers[1].mlp.experts.one is not None
    assert layers[1].mlp.shared_experts.one is not None
    fused_logits, fused_latent = _steps(model)
    _unfuse_one_token(model)
    logits, latent = _steps(model)
    torch.testing.assert_close(fused_latent, latent, rtol=1e-4, atol=1e-5)
    tol = 1e-4 if kernels == "exact" else 5e-3   # fast: an activation's int8 rounding can flip at a tie
    assert ((fused_logits - logits).norm() / logits.norm()).item() < tol


@needs_native
def test_one_token_steps_decline_what_they_cannot_run(gguf32, gguf_dirs):
    # widths not in whole blocks (the tiny default model): no native MLA step, the model's own runs
    model = quantplug.load(gguf_dirs["Q4_0"], progress=False)
    assert all(layer.self_attn.one is None for layer in model.model.layers)
    # a bfloat16 model: exact native kernels decline (the reference rounds weights to bfloat16)
    bf16 = quantplug.load(gguf32["Q8_0"], progress=False, dtype=torch.bfloat16)
    assert all(layer.self_attn.one is None for layer in bf16.model.layers)
    x = torch.randn(1, CFG32["hidden_size"], dtype=torch.bfloat16)
    mlp = bf16.model.layers[0].mlp
    if mlp.one is not None:                       # declines per call: the composed path runs
        torch.testing.assert_close(mlp.one(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    # the library switched off after loading: every fused step falls back, same logits
    f32 = quantplug.load(gguf32["Q8_0"], progress=False)
    want, _ = _steps(f32)
    with native.disabled():
        got, _ = _steps(f32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_native
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_non_finite_activations_give_nan_not_finite_garbage(mode):
    w = _rows("Q4_0", 8, 64, 0)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    y = native.gemm(x, [w.data_ptr()], [8], "Q4_0", mode)
    assert not torch.isfinite(y).any()          # the torch path: NaN (and inf * 0 = NaN) in every row


@needs_native
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -march levels")
@pytest.mark.parametrize(("march", "isa"), [("x86-64-v3", 2), ("x86-64", 0)])
def test_avx2_and_portable_builds_compute_the_same(monkeypatch, tmp_path, gguf32, march, isa):
    """The C file's other SIMD paths (AVX2 without VNNI, portable C), built for older x86 levels
    and run here: each agrees with the float64 references, and the one-token steps with the
    model's own path."""
    monkeypatch.setenv("QUANTPLUG_NATIVE_MARCH", march)
    monkeypatch.setenv("QUANTPLUG_CACHE", str(tmp_path))
    lib = native._build()
    assert lib.qpk_isa() == isa
    monkeypatch.setattr(native, "_lib", lib)
    monkeypatch.setattr(native, "_tried", True)
    for ggml_type in TYPES:
        for m in (1, 5):
            test_gemm_both_modes_against_float64_references(ggml_type, m)
    for mode in ("exact", "fast"):
        test_gemm_groups_place_each_weights_rows_and_columns(mode)
    test_dequantize_bit_exact_with_gguf_py_and_the_torch_kernel("Q4_0")
    for kernels in ("exact", "fast"):
        test_one_token_native_steps_equal_the_composed_path(gguf32, "Q4_0", kernels)
    test_one_token_native_steps_equal_the_composed_path(gguf32, "K-mix", "exact")


@needs_native
def test_k_quant_model_decodes_as_the_torch_path(gguf32):
    """A Q2_K..Q6_K mix (as llama-quantize's Q4_K_M and the dynamic quants write): the native K-quant kernels
    (exact in both modes) give the torch dequantize-then-matmul logits up to summation order."""
    path = gguf32["K-mix"]
    schemes = quantplug.plan(path).to_dict()["schemes"].values()
    assert {f"ggml {t}" for t in K_SCALE} <= set(schemes)
    native_exact = _decode_logits(path, "exact")
    with native.disabled():
        torch_exact = _decode_logits(path, "exact")
    assert torch.isfinite(torch_exact).all()
    torch.testing.assert_close(native_exact, torch_exact, rtol=1e-4, atol=1e-5)


@needs_native
def test_gemm_refuses_groups_outside_x_or_y():
    w = _rows("Q8_0", 4, 64, 0)
    x = torch.randn(3, 64)
    for bad in ([(2, 2, 0, 0)], [(0, 1, 3, 0)], [(-1, 1, 0, 0)], [(0, 0, 0, 0)]):
        with pytest.raises(ValueError, match="do not fit"):
            native.gemm(x, [w.data_ptr()], [4], "Q8_0", "exact", bad, out_rows=3)
    with pytest.raises(ValueError, match="row counts"):
        native.gemm(x, [w.data_ptr()], [4, 4], "Q8_0", "exact")


@needs_native
def test_inputs_that_do_not_fit_the_weights_are_refused_before_the_c_code(gguf32):
    from quantplug.errors import QuantplugError

    w = _rows("Q4_K", 8, 512, 0)
    x = torch.randn(1, 256)
    handle = ggml.NativeWeight(w, "Q4_K")
    assert handle.k == 512
    with pytest.raises(QuantplugError, match="256 values per row"):
        ggml.native_linear(x, [handle], "Q4_K", "exact")
    with pytest.raises(QuantplugError, match="outside the stack"):
        ggml.native_grouped(torch.randn(1, 512), [handle], "Q4_K", "exact", [(3, 1)])
    model = quantplug.load(gguf32["Q8_0"], progress=False)
    one = model.model.layers[1].mlp.experts.one
    with pytest.raises(QuantplugError, match="do not fit"):
        one(torch.randn(1, CFG32["hidden_size"]), [99], [1.0])
