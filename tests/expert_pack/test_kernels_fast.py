"""Kernel modes of the ExpertPack backend (load option ``kernels``) and the grouped MoE dispatch.

* exact (default): chunked dequantize-into-reused-buffer matmul equals dequantize-then-matmul;
* fast: with the native kernels, Q4_0 / Q8_0 as llama.cpp computes them (int8 activation blocks),
  other types exact; without them, the int4-pack kernel for 4-bit-affine types. Either way the
  error against exact is bounded (logits max-rel <= 3e-2, argmax agreement >= 0.95 on these
  fixtures);
* dispatch: experts hit by 0, 1 and many tokens against a per-token reference.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import quantplug
import torch
import torch.nn.functional as F
from quantplug.api import ConfigError, int4pack_rows_separable
from quantplug.models.config import parse_model_config
from quantplug.testing import random_state, tiny_config
from quantplug.kernels import ggml
from quantplug_expert_pack.export import gguf_state, write_gguf
from quantplug_expert_pack.testing import random_rows

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import rel_err  # noqa: E402

# 16 experts of 64 so that every projection has rows in multiples of 16 (the int4 kernel's rule)
CFG = tiny_config(moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                  vocab_size=256)
MC = parse_model_config(CFG, "DeepseekV3ForCausalLM", False)
IDS = torch.randint(0, CFG["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(1))


def _write(root: Path, default_type: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CFG))
    write_gguf(root / "model.gguf", gguf_state(random_state(CFG), MC), MC, default_type=default_type,
               vocab=CFG["vocab_size"])
    return root


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("kernels")
    return {t: _write(base / t, t) for t in ("Q4_0", "Q8_0", "Q4_1")}


def _run(path: Path, kernels: str | None = None) -> tuple[torch.nn.Module, torch.Tensor]:
    model = quantplug.load(path, progress=False, options={} if kernels is None else {"kernels": kernels})
    with torch.inference_mode():
        return model, model(IDS)


@pytest.mark.parametrize("native_built", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q8_0", "Q4_1"])
def test_fast_kernels_error_is_bounded(ckpts, ggml_type, native_built):
    if native_built and ggml.native.library() is None:
        pytest.skip(f"native kernels: {ggml.native.status()}")
    ctx = contextlib.nullcontext() if native_built else ggml.native.disabled()
    with ctx:
        exact_model, exact = _run(ckpts[ggml_type])
        fast_model, fast = _run(ckpts[ggml_type], "fast")
    gate = fast_model.model.layers[1].mlp.experts.gate_proj
    assert getattr(exact_model.model.layers[1].mlp.experts.gate_proj, "_int4", None) is None
    if native_built:   # no second copy: the native kernels read the blocks
        assert getattr(gate, "_int4", None) is None and gate.qp_native is not None
        if ggml_type == "Q4_1":   # no int8-block form: fast is the exact native path
            assert torch.equal(fast, exact)
            return
        assert "fast (int8 activation blocks" in gate.scheme.describe()
    else:
        assert getattr(gate, "_int4", None) is not None
    err = rel_err(fast, exact)
    agree = (fast.argmax(-1) == exact.argmax(-1)).float().mean().item()
    # observed on this fixture: Q4_0 4.6e-3 / 0.996, Q8_0 2.3e-2 / 0.992, Q4_1 2.4e-2 / 0.992 (the
    # largest errors are tokens whose top-4 experts change under bfloat16 activations)
    assert 0 < err <= 3e-2, err          # > 0: the fast path really ran (bfloat16 activations)
    assert agree >= 0.95, agree


def test_unknown_kernels_value_names_the_option(ckpts):
    with pytest.raises(ConfigError, match="kernels"):
        quantplug.plan(ckpts["Q8_0"], options={"kernels": "turbo"})


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q6_K", "MXFP4"])
def test_exact_linear_equals_dequantize_then_matmul(ggml_type, monkeypatch):
    rng = np.random.default_rng(0)
    w = torch.from_numpy(random_rows(ggml_type, (96, 512), rng, scale=1e-2))
    dense = ggml.dequantize(w, ggml_type)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    ref = F.linear(x, dense)
    assert rel_err(ggml.linear(x, w, ggml_type, torch.float32), ref) < 1e-6   # one chunk
    monkeypatch.setattr(ggml, "LINEAR_CHUNK_ELEMS", 512 * 7)                   # 7-row chunks, ragged tail
    assert rel_err(ggml.linear(x, w, ggml_type, torch.float32), ref) < 1e-6
    assert rel_err(ggml.linear(x[0], w, ggml_type, torch.float32), ref[0]) < 1e-6


@pytest.mark.parametrize("ggml_type", ggml.FAST_TYPES)
def test_int4_repack_matches_dequantized_weight(ggml_type):
    rng = np.random.default_rng(1)
    w = torch.from_numpy(random_rows(ggml_type, (2, 48, 512), rng, scale=1e-2))   # stacked, as experts are
    pack, sz = ggml.int4_repack(w, ggml_type)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    for e in range(2):
        ref = F.linear(x, ggml.dequantize(w[e], ggml_type))
        assert rel_err(ggml.int4_linear(x, pack[e], sz[e], ggml_type), ref) < 2e-2
    assert ggml.int4_repack(w[:, :40], ggml_type) is None                       # rows not a multiple of 16
    assert ggml.int4_repack(torch.zeros(16, 22, dtype=torch.uint8), "Q5_0") is None


def _reference_experts(experts, x, idx, w):
    """Token by token, expert by expert: sum_j w[t, j] * expert_{idx[t, j]}(x[t])."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            xt = x[t:t + 1]
            h = F.silu(experts.gate_proj(xt, e)) * experts.up_proj(xt, e)
            out[t] += (experts.down_proj(h, e) * w[t, j])[0]
    return out


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_dispatch_with_experts_hit_by_none_one_and_many_tokens(ckpts, kernels):
    model, _ = _run(ckpts["Q8_0"], kernels)
    experts = model.model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, CFG["hidden_size"], generator=g)
    # expert 3: every token; 5: one token; 0..2, 4, 6..: none, except 7 / 9 / 11 / 12 mixed
    idx = torch.tensor([[3, 7, 9, 5], [3, 7, 9, 11], [3, 11, 12, 7], [3, 12, 9, 7], [3, 7, 11, 12],
                        [12, 3, 9, 11]])
    w = torch.rand(6, 4, generator=g)
    with torch.inference_mode():
        got = experts(x, idx, w)
        ref = _reference_experts(experts, x, idx, w)
        assert rel_err(got, ref) < 1e-6
        one = experts(x[:1], idx[:1], w[:1])           # a single-token step
        assert rel_err(one, ref[:1]) < 1e-6


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q8_0"])
def test_int4_grouped_equals_one_call_per_group(ggml_type):
    """The grouped MoE path (activations converted once, outputs gathered) computes what one
    kernel call per expert computes, bit for bit."""
    rng = np.random.default_rng(2)
    w = torch.from_numpy(random_rows(ggml_type, (4, 32, 256), rng, scale=1e-2))
    pack, sz = ggml.int4_repack(w, ggml_type)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(3))
    groups = [(0, 2), (2, 1), (3, 4)]
    got = ggml.int4_grouped(x, list(zip(pack.unbind(0), sz.unbind(0))), ggml_type, groups)
    want = torch.cat([ggml.int4_linear(x[0:2], pack[0], sz[0], ggml_type), ggml.int4_linear(x[2:3], pack[2], sz[2], ggml_type),
                      ggml.int4_linear(x[3:7], pack[3], sz[3], ggml_type)])
    assert got.dtype == x.dtype and torch.equal(got, want)


def test_fast_mode_keeps_mla_kv_heads_dequantized_exactly(ckpts):
    """Under kernels="fast" without the native kernels the per-head MLA K/V stacks (attn_k_b /
    attn_v_b) are dequantized once at load (exact values, shown in the plan) instead of at every
    step; exact mode keeps them packed, and so does fast mode where the native kernels run them,
    there in fast mode as every other Q4_0 / Q8_0 product (llama.cpp rounds attn_k_b's and
    attn_v_b's inputs to Q8_0 blocks as any quantized matmul's)."""
    if ggml.native.library() is not None:
        native_fast, _ = _run(ckpts["Q4_0"], "fast")
        for proj in ("k_b", "v_b"):
            layer = getattr(native_fast.model.layers[0].self_attn, proj)
            assert "cached" not in layer.scheme.describe() and getattr(layer, "_dequantized", None) is None
            assert layer.qp_kernel_mode == "fast" and layer.qp_native.mode == "fast"
    with ggml.native.disabled():
        fast, _ = _run(ckpts["Q4_0"], "fast")
        exact, _ = _run(ckpts["Q4_0"])
    for proj in ("k_b", "v_b"):
        f, e = getattr(fast.model.layers[0].self_attn, proj), getattr(exact.model.layers[0].self_attn, proj)
        assert "cached dense copy" in f.scheme.describe() and "cached" not in e.scheme.describe()
        assert getattr(e, "_dequantized", None) is None
        assert torch.equal(f._dequantized, ggml.dequantize(f.weight, "Q4_0"))
        x = torch.randn(2, f.weight.shape[0], 3, f._dequantized.shape[-1], generator=torch.Generator().manual_seed(4))
        with torch.inference_mode():
            assert rel_err(f.forward_all(x), e.forward_all(x)) < 1e-6


@pytest.mark.skipif(ggml.native.library() is None, reason="native kernels not built")
@pytest.mark.parametrize("proj", ["k_b", "v_b"])
def test_fast_mla_kv_heads_round_a_prompts_inputs_as_a_step(ckpts, proj):
    """Under kernels="fast" a prompt's per-head K/V products (many tokens, several sequences)
    are the native fast products, as a decode step's: each head's rows through that head's
    int8-activation product, bit for bit, and not the exact product (which rounds no input)."""
    model = quantplug.load(ckpts["Q8_0"], progress=False, options={"kernels": "fast"})
    layer = getattr(model.model.layers[0].self_attn, proj)
    b = layer.qp_native
    nh = len(b.mats)
    x = torch.randn(2, nh, 40, b.k, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        got = layer.forward_all(x)
    want = torch.stack([torch.stack([ggml.native.gemm(x[s, h].contiguous(), [b.ptr(h)]) for h in range(nh)])
                        for s in range(2)])
    assert torch.equal(got, want)
    dense = ggml.dequantize(layer.weight, "Q8_0")
    exact = torch.matmul(x, dense.transpose(-1, -2))
    assert 0 < rel_err(got, exact) < 2e-2


def test_scratch_made_in_inference_mode_serves_later_plain_work(ckpts, monkeypatch):
    """The per-thread dequantization buffers, first allocated inside ``torch.inference_mode``, stay
    writable outside it: a plain forward afterwards, and a load that dequantizes (fast mode's MLA
    K/V stacks) after an inference-mode forward, both work."""
    import threading

    monkeypatch.setattr(ggml, "_LOCAL", threading.local())  # no buffers yet
    with ggml.native.disabled():  # the torch kernels: the ones with per-thread scratch
        model = quantplug.load(ckpts["Q4_0"], progress=False)
        with torch.inference_mode():
            first = model(IDS[:1])
        with torch.no_grad():
            assert torch.equal(model(IDS[:1]), first)
        fast = quantplug.load(ckpts["Q4_0"], progress=False, options={"kernels": "fast"})
        assert fast.model.layers[0].self_attn.k_b._dequantized.shape[0] == CFG["num_attention_heads"]


def _unfuse(model):
    for mod in model.modules():
        for attr in ("gate_up", "qkv_a"):
            if getattr(mod, attr, None) is not None:
                setattr(mod, attr, None)


def test_fast_mode_fuses_sibling_projections_bit_for_bit(ckpts, monkeypatch):
    """kernels="fast" without the native kernels: gate+up (routed experts, shared experts, dense
    MLP) and q_a+kv_a run as one int4 call each (LinearScheme.fuse); the logits equal the
    one-call-per-layer model's bit for bit, each layer still works alone (its pack is a view of
    the fused one) and the only extra memory is the fused scales-and-zeros. With the native
    kernels the core runs siblings as one native call, each layer's own result bit for bit."""
    from quantplug.loader import model_bytes
    from quantplug_expert_pack.schemes import GGMLScheme

    if ggml.native.library() is not None:
        model = quantplug.load(ckpts["Q4_0"], progress=False, options={"kernels": "fast"})
        experts = model.model.layers[1].mlp.experts
        assert experts.gate_up is not None and experts.gate_up.fn is None
        x = torch.randn(3, CFG["hidden_size"], generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            groups = [(2, 1), (7, 2)]
            both = experts.gate_up(x, groups)
            inter = experts.gate_proj.out_features
            assert torch.equal(both[:, :inter], experts.gate_proj.forward_grouped(x, groups))
            assert torch.equal(both[:, inter:], experts.up_proj.forward_grouped(x, groups))
    with ggml.native.disabled():
        model = quantplug.load(ckpts["Q4_0"], progress=False, options={"kernels": "fast"})
        layer0, layer1 = model.model.layers[0], model.model.layers[1]
        for fused in (layer1.mlp.experts.gate_up, layer1.mlp.shared_experts.gate_up):   # 64 + 64 rows
            assert isinstance(fused.fn, ggml.Int4Fused)
        # 96 + 96 (dense MLP) and 48 + 48 rows (q_a, kv_a) straddle the int4 kernel's row blocks on
        # this CPU when the probe says so: then they are not fused
        for fused, rows in ((layer0.mlp.gate_up, (96, 96)), (layer0.self_attn.qkv_a, (48, 48))):
            if int4pack_rows_separable(rows):
                assert isinstance(fused.fn, ggml.Int4Fused)
            else:   # no int4 fusion: the core's native call where built, else one product each
                assert fused.fn is None
        experts = layer1.mlp.experts
        xs = torch.randn(12, CFG["hidden_size"], generator=torch.Generator().manual_seed(6))
        with torch.inference_mode():
            got = model(IDS)
            groups = [(2, 1), (7, xs.shape[0] - 1)]
            both = experts.gate_up(xs, groups)
            inter = experts.gate_proj.out_features
            assert torch.equal(both[:, :inter], experts.gate_proj.forward_grouped(xs, groups))
            assert torch.equal(both[:, inter:], experts.up_proj.forward_grouped(xs, groups))
            shared = layer1.mlp.shared_experts
            gu = shared.gate_up(xs)
            assert torch.equal(gu[:, shared.gate_proj.out_features:], shared.up_proj(xs))
            _unfuse(model)
            assert torch.equal(model(IDS), got)
        extra = sum(m._int4_fused_sz.numel() * 2 for m in model.modules() if getattr(m, "_int4_fused_sz", None) is not None)
        monkeypatch.setattr(GGMLScheme, "fuse", lambda self, layers: None)
        unfused = quantplug.load(ckpts["Q4_0"], progress=False, options={"kernels": "fast"})
        assert unfused.model.layers[1].mlp.experts.gate_up.fn is None
        assert model_bytes(model) == model_bytes(unfused) + extra


def test_no_int4_fusion_in_exact_mode_or_when_the_int4_layout_does_not_split(ckpts, monkeypatch):
    from quantplug.layers import linear

    with ggml.native.disabled():
        exact = quantplug.load(ckpts["Q4_0"], progress=False)
        assert exact.model.layers[1].mlp.experts.gate_up.fn is None and exact.model.layers[0].self_attn.qkv_a.fn is None
        monkeypatch.setattr(linear, "int4pack_rows_separable", lambda rows: False)  # where fuse_int4_packs asks
        fast = quantplug.load(ckpts["Q4_0"], progress=False, options={"kernels": "fast"})
        assert fast.model.layers[1].mlp.experts.gate_up.fn is None and fast.model.layers[0].self_attn.qkv_a.fn is None


def test_int4_rows_separable_probe_agrees_with_the_kernel_layout():
    """The probe's answer is what a full repack shows: stacked packs of parts that it calls
    separable are the pack of the stacked codes."""
    g = torch.Generator().manual_seed(6)
    for rows in ((64, 64), (256, 160), (16, 48)):
        parts = [torch.randint(0, 16, (n, 256), generator=g, dtype=torch.int32) for n in rows]
        whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat(parts), 1)
        each = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(p, 1) for p in parts])
        assert int4pack_rows_separable(rows) == torch.equal(whole, each), rows


def test_q_a_and_kv_a_fused_when_their_rows_split_the_kernel_layout(tmp_path):
    cfg = tiny_config(moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                      vocab_size=256, q_lora_rank=64, kv_lora_rank=48, qk_rope_head_dim=16)
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_gguf(tmp_path / "model.gguf", gguf_state(random_state(cfg), mc), mc, default_type="Q4_0", vocab=256)
    if not int4pack_rows_separable((64, 64)):
        pytest.skip("this CPU's int4 layout does not split at 64 rows")
    with ggml.native.disabled():   # the int4 kernel: what fast mode runs without native kernels
        model = quantplug.load(tmp_path, progress=False, options={"kernels": "fast"})
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.qkv_a.fn, ggml.Int4Fused)
        with torch.inference_mode():
            for rows in (2, 8):
                x = torch.randn(rows, cfg["hidden_size"], generator=torch.Generator().manual_seed(7))
                qkv = attn.qkv_a(x)
                assert torch.equal(qkv[:, :64], attn.q_a_proj(x)) and torch.equal(qkv[:, 64:], attn.kv_a_proj_with_mqa(x))
            got = model(IDS[:2])
            _unfuse(model)
            assert torch.equal(model(IDS[:2]), got)
