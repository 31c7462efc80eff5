"""DeepSeek-native block FP8 backend: tiny checkpoints built here with hidden sizes that are not
multiples of 128 (every matrix has partial edge blocks), checked against transformers on weights
dequantized by an independent rule, and against a straightforward act_quant reference."""

from __future__ import annotations

import json
import math

import pytest
import quantplug
import torch
from conftest import hf_logits, load_logits, rel_err
from quantplug.errors import ConfigError, PlanError
from quantplug.kernels import native
from quantplug.plan import build_plan
from quantplug.testing import tiny_config, wrap_kimi, write_checkpoint

fp8 = pytest.importorskip("quantplug_fp8")
from quantplug_fp8 import kernels  # noqa: E402
from quantplug_fp8.export import LINEAR  # noqa: E402

# hidden 200 = 128 + 72, q_lora 144, kv_a out 40 + 16 = 56, moe_intermediate 136, intermediate 300:
# every FP8 matrix has a partial last block row and / or column
CFG = tiny_config(hidden_size=200, intermediate_size=300, moe_intermediate_size=136, q_lora_rank=144,
                  kv_lora_rank=40, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
QC = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
IDS = torch.randint(0, CFG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))


def ref_dequant(q: torch.Tensor, s: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """w[r, c] = q[r, c] * s[r // bn, c // bk], written the obvious way (no shape inference)."""
    rows, cols = q.shape
    full = s.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.to(torch.float32) * full.to(torch.float32)


def ref_act_quant(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """DeepSeek act_quant, one token row and one group at a time."""
    flat = x.reshape(-1, x.shape[-1]).to(torch.float32)
    out = torch.empty_like(flat)
    for t in range(flat.shape[0]):
        for g0 in range(0, flat.shape[1], group):
            v = flat[t, g0:g0 + group]
            s = torch.clamp(v.abs().max(), min=1e-4) / 448.0
            out[t, g0:g0 + group] = (v / s).to(torch.float8_e4m3fn).to(torch.float32) * s
    return out.view(x.shape).to(x.dtype)


def random_dense(seed: int = 0) -> dict[str, torch.Tensor]:
    from quantplug.testing import random_state

    return random_state(CFG, seed)


def fp8_state(dense: dict[str, torch.Tensor], mtp: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(stored tensors in DeepSeek's layout, the dense weights they stand for)."""
    stored: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in dense.items():
        if LINEAR.search(name):
            q, s = kernels.quantize(w)
            stored[name], stored[name[:-6] + "weight_scale_inv"] = q, s
            ref[name] = ref_dequant(q, s)
        elif name.endswith("e_score_correction_bias"):
            stored[name] = ref[name] = w.float()
        else:
            stored[name] = w.to(torch.bfloat16)
            ref[name] = stored[name].float()
    if mtp:  # DeepSeek-V3's release carries the MTP block as layer num_hidden_layers
        n, h = CFG["num_hidden_layers"], CFG["hidden_size"]
        q, s = kernels.quantize(torch.randn(h, 2 * h) * 0.02)
        stored[f"model.layers.{n}.eh_proj.weight"], stored[f"model.layers.{n}.eh_proj.weight_scale_inv"] = q, s
        stored[f"model.layers.{n}.enorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        q, s = kernels.quantize(torch.randn(CFG["q_lora_rank"], h) * 0.02)
        stored[f"model.layers.{n}.self_attn.q_a_proj.weight"] = q
        stored[f"model.layers.{n}.self_attn.q_a_proj.weight_scale_inv"] = s
    return stored, ref


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    dense = random_dense()
    stored, ref = fp8_state(dense)
    path = write_checkpoint(tmp_path_factory.mktemp("fp8") / "dsv3", {**CFG, "quantization_config": QC}, stored)
    return path, stored, ref


@pytest.fixture(scope="module")
def reference(ckpt):
    return hf_logits(CFG, ckpt[2], IDS)


def test_weight_only_matches_transformers_on_correctly_dequantized_weights(ckpt, reference):
    model, out = load_logits(ckpt[0], IDS, options={"activation_quant": "none"})
    plan = model.quantplug_plan
    assert plan.backend == "fp8"
    assert rel_err(out, reference) <= 1e-5
    # FP8 stays FP8 in memory; scales f32; routed experts stacked [E, out, in]
    attn = model.model.layers[1].self_attn
    assert attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_a_proj_with_mqa.weight_scale_inv.dtype == torch.float32
    assert tuple(attn.kv_a_proj_with_mqa.weight_scale_inv.shape) == (1, 2)  # [56, 200]
    experts = model.model.layers[1].mlp.experts
    assert experts.down_proj.weight.dtype == torch.float8_e4m3fn
    assert tuple(experts.down_proj.weight.shape) == (CFG["n_routed_experts"], 200, 136)
    assert tuple(experts.down_proj.weight_scale_inv.shape) == (CFG["n_routed_experts"], 2, 2)
    fp8_bytes = sum(t.numel() for n, t in ckpt[1].items() if t.dtype == torch.float8_e4m3fn and ".layers.3." not in n)
    held = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    assert held == fp8_bytes
    # floats as stored by the core's dense scheme, with the reason in the plan
    schemes = plan.schemes()
    assert schemes["lm_head"] == "dense" and schemes["model.embed_tokens"] == "dense"
    lm = [d for d in plan.decisions if d.target == "lm_head" and d.hook == "quantplug_linear_scheme"]
    assert "BF16" in lm[0].reason and lm[0].plugin.name == "fp8"
    assert "activation_quant=none" in schemes["model.layers.0.self_attn.q_a_proj"]
    # the MTP layer (layer num_hidden_layers) is skipped by the core's rule, scales included
    skipped = [n for names in plan.skipped.values() for n in names]
    assert "model.layers.3.eh_proj.weight_scale_inv" in skipped
    assert "model.layers.3.self_attn.q_a_proj.weight" in skipped


def test_activation_emulation_equals_reference_act_quant_and_moves_logits_boundedly(ckpt, reference):
    # the torch paths (where the patched apply below runs); the native kernels' emulation is
    # checked against the same reference in tests/kernels and by the conformance kit
    with native.disabled():
        model, out = load_logits(ckpt[0], IDS)
    desc = model.quantplug_plan.schemes()["model.layers.1.mlp.experts.gate_proj"]
    assert "activation_quant=dynamic" in desc and "per token per 128" in desc
    weight_only, out_none = load_logits(ckpt[0], IDS, options={"activation_quant": "none"})
    # the weight-only model with the reference act_quant applied to the input of every FP8 linear
    # (each FP8 scheme's apply: QuantLinear forward and the routed experts' grouped calls)
    # reproduces the default model exactly
    patched = set()
    for mod in weight_only.modules():
        scheme = getattr(mod, "scheme", None)
        if scheme is not None and scheme.name == "fp8-block" and id(scheme) not in patched:
            scheme.apply = lambda layer, x, index=None, orig=scheme.apply: orig(layer, ref_act_quant(x), index)
            patched.add(id(scheme))
    assert len(patched) == 3 * 5 + 3 + 2 * 6  # attention x3 layers, dense MLP, 2 MoE x (shared + experts)
    with torch.no_grad(), native.disabled():
        emulated = weight_only(IDS)
    assert torch.equal(out, emulated)
    native_model, native_out = load_logits(ckpt[0], IDS)  # the native emulation: up to summation order
    assert rel_err(native_out, out) < 1e-5
    # fp8 activations move the logits: per linear by at most 1/16 of |x| (checked on the kernel
    # below); through the model more, where a moved residual flips a top-k expert choice
    err = rel_err(out, out_none)
    assert 1e-3 < err < 0.5, err


def test_kernel_matches_reference_on_real_kv_a_proj_shape():
    # DeepSeek-V3 kv_a_proj_with_mqa: [576, 7168] -> scale [5, 56], last block row 64 rows high
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(576, 7168, generator=g) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(5, 56, generator=g) + 0.5
    assert kernels.scale_shape(576, 7168, (128, 128)) == (5, 56)
    w = kernels.dequantize(q, s)
    assert torch.equal(w, ref_dequant(q, s))
    # rows 512..575 use scale row 4 (a shape-inferred block of 576 // 5 = 115 rows would not)
    assert torch.equal(w[520, :128], q[520, :128].float() * s[4, 0])
    # the same ratio on a small matrix with a small block: [9, 112] in blocks of [2, 2] -> [5, 56]
    q2 = (torch.randn(9, 112, generator=g) * 40).to(torch.float8_e4m3fn)
    s2 = torch.rand(5, 56, generator=g)
    assert torch.equal(kernels.dequantize(q2, s2, (2, 2)), ref_dequant(q2, s2, (2, 2)))
    # bf16 output = f32 product rounded once; stacked experts
    assert torch.equal(kernels.dequantize(q, s, dtype=torch.bfloat16), ref_dequant(q, s).to(torch.bfloat16))
    stack = torch.stack([q2, q2.flip(0)])
    assert torch.equal(kernels.dequantize(stack, torch.stack([s2, s2]), (2, 2))[1],
                       ref_dequant(q2.flip(0), s2, (2, 2)))
    with pytest.raises(quantplug.errors.QuantplugError, match=r"\[5, 56\]"):
        kernels.dequantize(q, s[:4])


def test_chunked_linear_equals_dense_matmul(monkeypatch):
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(700, 300, generator=g) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(6, 3, generator=g)
    x = torch.randn(3, 5, 300, generator=g)
    ref = torch.nn.functional.linear(x, ref_dequant(q, s))
    monkeypatch.setattr(kernels, "LINEAR_CHUNK_ELEMS", 128 * 300)  # one block row per step
    assert torch.allclose(kernels.linear(x, q, s, (128, 128), torch.float32), ref, rtol=1e-5, atol=1e-5)


def test_act_quant_kernel_equals_reference_incl_partial_group_and_ue8m0():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 7, 328, generator=g) * torch.logspace(-3, 2, 328)
    x[0, 0] = 0.0  # all-zero token: amax floor, no NaN
    assert torch.equal(kernels.act_quant(x), ref_act_quant(x))  # 328 = 2 x 128 + a partial 72
    assert torch.equal(kernels.act_quant(x)[0, 0], torch.zeros(328))
    # the bound: each element moves by at most half an fp8 step, 2**-4 of itself (3 mantissa
    # bits) or, in the subnormal range, half the smallest step: 2**-10 of its group's scale
    y, s = kernels.act_quant(x), torch.zeros_like(x)
    for g0 in range(0, 328, 128):
        grp = x[..., g0:g0 + 128]
        s[..., g0:g0 + 128] = grp.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    assert bool(((y - x).abs() <= torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)).all())
    # ue8m0 (DeepSeek-V3.1 scale_fmt): power-of-two scales, every quantized value within fp8 range
    y = kernels.act_quant(x, scale_fmt="ue8m0")
    v = x[1, 3, :128]
    s = 2.0 ** math.ceil(math.log2(max(float(v.abs().max()), 1e-4) / 448.0))
    assert torch.equal(y[1, 3, :128], (v / s).to(torch.float8_e4m3fn).float() * s)


def test_quantize_roundtrip_is_bit_exact():
    g = torch.Generator().manual_seed(5)
    q, s = kernels.quantize(torch.randn(300, 200, generator=g))
    assert s.shape == (3, 2) and q.dtype == torch.float8_e4m3fn
    q2, s2 = kernels.quantize(kernels.dequantize(q, s))
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


def _write(tmp_path, stored, cfg=None, name="c"):
    return write_checkpoint(tmp_path / name, cfg or {**CFG, "quantization_config": QC}, stored)


def test_missing_scale_is_plan_time_problem_naming_it(ckpt, tmp_path):
    stored = dict(ckpt[1])
    del stored["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    plan = build_plan(_write(tmp_path, stored))
    msgs = [p.describe() for p in plan.errors]
    assert any("model.layers.1.self_attn.kv_b_proj.weight_scale_inv" in m and "missing" in m for m in msgs), msgs


def test_wrong_block_shape_names_tensor_and_expected_shape(ckpt, tmp_path):
    stored = dict(ckpt[1])
    stored["model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"] = torch.ones(1, 2)  # [136, 200] -> [2, 2]
    stored["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] = torch.ones(2, 1)  # [144, 200] -> [2, 2]
    with pytest.raises(PlanError) as e:
        quantplug.plan(_write(tmp_path, stored))
    msg = str(e.value)
    assert "model.layers.2.mlp.experts.5.up_proj.weight_scale_inv" in msg and "expected [2, 2]" in msg
    assert "model.layers.0.self_attn.q_a_proj.weight_scale_inv, file model.safetensors: shape [2, 1], expected [2, 2]" in msg


def test_bad_option_and_bad_config_are_errors_naming_them(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="activation_quant"):
        quantplug.plan(ckpt[0], options={"activation_quant": "int8"})
    cfg = {**CFG, "quantization_config": {**QC, "weight_block_size": [128]}}
    with pytest.raises(ConfigError, match=r"quantization_config.weight_block_size = \[128\]"):
        quantplug.plan(_write(tmp_path, ckpt[1], cfg))


def test_modules_to_not_convert(ckpt, tmp_path):
    stored = dict(ckpt[1])
    dense_o = ckpt[2]["model.layers.0.self_attn.o_proj.weight"].to(torch.bfloat16)
    stored["model.layers.0.self_attn.o_proj.weight"] = dense_o
    del stored["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    qc = {**QC, "modules_to_not_convert": ["lm_head", "layers.0.self_attn.o_proj", "model.layers.9.mlp"]}
    plan = build_plan(_write(tmp_path, stored, {**CFG, "quantization_config": qc}))
    assert not plan.errors, [p.describe() for p in plan.errors]
    assert plan.schemes()["model.layers.0.self_attn.o_proj"] == "dense"
    assert plan.schemes()["model.layers.1.self_attn.o_proj"].startswith("fp8 e4m3 block [128, 128]")
    assert [p.layer for p in plan.warnings] == ["model.layers.9.mlp"]  # names nothing: a warning
    # a listed module stored in FP8 is refused, naming the field
    qc["modules_to_not_convert"] = ["model.layers.1.self_attn.q_b_proj"]
    plan = build_plan(_write(tmp_path, stored, {**CFG, "quantization_config": qc}, "d"))
    msgs = [p.describe() for p in plan.errors]
    assert any("modules_to_not_convert" in m and "q_b_proj" in m for m in msgs), msgs


def test_kimi_wrapped_variant_loads(ckpt, reference, tmp_path):
    stored = {k: v for k, v in ckpt[1].items() if ".layers.3." not in k}
    cfg, tensors = wrap_kimi(dict(CFG), stored)
    cfg["text_config"]["quantization_config"] = QC  # as the Kimi releases: inside text_config
    model, out = load_logits(write_checkpoint(tmp_path / "kimi", cfg, tensors), IDS,
                             options={"activation_quant": "none"})
    plan = model.quantplug_plan
    assert plan.prefix == "language_model" and plan.backend == "fp8"
    assert plan.schemes()["language_model.model.layers.2.mlp.experts.up_proj"].startswith("fp8")
    assert plan.schemes()["language_model.lm_head"] == "dense"
    assert rel_err(out, reference) <= 1e-5


def test_export_roundtrip_and_cli_explain(tmp_path, capsys):
    from quantplug.cli import main
    from quantplug.plugins import get_plugin_manager

    dense_dir = write_checkpoint(tmp_path / "dense", CFG, random_dense(1))
    dense = quantplug.load(dense_dir)
    pm = get_plugin_manager()
    [res] = pm.export("fp8", model=dense, destination=tmp_path / "out", plan=dense.quantplug_plan)
    cfg = json.loads((res.path / "config.json").read_text())
    assert cfg["quantization_config"] == QC
    model, out = load_logits(res.path, IDS, options={"activation_quant": "none"})
    with torch.no_grad():
        ref = dense(IDS)
    assert 0 < rel_err(out, ref) < 0.1
    assert main(["explain", str(res.path), "model.layers.1.self_attn.kv_a_proj_with_mqa",
                 "-o", "activation_quant=none"]) == 0
    assert "activation_quant=none" in capsys.readouterr().out


def test_bfloat16_model_dtype(ckpt):
    model, out = load_logits(ckpt[0], IDS, dtype=torch.bfloat16, options={"activation_quant": "none"})
    _, ref = load_logits(ckpt[0], IDS, options={"activation_quant": "none"})
    w = model.model.layers[1].self_attn.q_b_proj
    assert w.weight.dtype == torch.float8_e4m3fn and w.weight_scale_inv.dtype == torch.float32
    assert torch.equal(w.scheme.dequantize(w), ref_dequant(w.weight, w.weight_scale_inv).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), ref) < 5e-2
    _, dyn = load_logits(ckpt[0], IDS, dtype=torch.bfloat16)
    assert torch.isfinite(dyn).all()


@pytest.mark.parametrize("scale", [0.37, 2.0 ** 110])  # the second is too large to fold 2**8 into
def test_every_byte_value_decodes_as_torch_does(scale):
    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(2, 128)  # subnormals, +-0, NaN codes
    s = torch.tensor([[scale]])
    ours, ref = kernels.dequantize(q, s), q.float() * s
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)) and int(torch.isnan(ref).sum()) == 2
    assert torch.equal(ours.nan_to_num(), ref.nan_to_num())
    real = ~torch.isnan(ref)
    assert torch.equal(torch.signbit(ours[real]), torch.signbit(ref[real]))  # -0.0 stays -0.0
