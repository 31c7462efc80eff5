"""compressed-tensors backend against llm-compressor's own exports (tests/data/vendor), the
Kimi-K2.5 release layout, and the compressed-tensors library as the reference decoder."""

from __future__ import annotations

import json
import shutil

import pytest
import quantplug
import torch
from conftest import VENDOR, load_logits, rel_err
from quantplug.errors import ConfigError, LoadError, PlanError
from quantplug.kernels import native
from quantplug.loader import model_bytes
from quantplug.plan import build_plan
from quantplug.testing import random_state, tiny_config, write_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ctp = pytest.importorskip("quantplug_compressed_tensors")
from quantplug_compressed_tensors import kernels  # noqa: E402
from quantplug_compressed_tensors.kernels import Layout  # noqa: E402

W4 = VENDOR / "ct_w4a16_experts_dsv3"
FP8 = VENDOR / "ct_fp8_block_dsv3"
REF_W4 = load_file(str(VENDOR / "ct_w4a16_experts_dsv3.reference.safetensors"))
REF_FP8 = load_file(str(VENDOR / "ct_fp8_block_dsv3.reference.safetensors"))
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
EXPERT_SCHEMES = {"gate_proj", "up_proj", "down_proj"}


def _state(path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _variant(src, dst, edit_config=None, edit_state=None):
    """A copy of a fixture: weight files copied (or rewritten by ``edit_state``), config edited."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    if edit_state is None:
        for f in src.iterdir():
            if f.name != "config.json":
                shutil.copy(f, dst / f.name)
    else:
        save_file(edit_state(_state(src)), str(dst / "model.safetensors"))
    return dst


def _quantized(plan) -> dict[str, str]:
    return {k: v for k, v in plan.schemes().items() if v != "dense"}


# -- vendor fixtures ------------------------------------------------------------------------------

def test_w4a16_experts_match_vendor_logits():
    model, out = load_logits(W4, REF_W4["input_ids"])
    plan = model.quantplug_plan
    assert plan.backend == "compressed_tensors"
    assert rel_err(out, REF_W4["vendor_logits"]) <= 1e-4
    assert rel_err(out, REF_W4["dense_logits"]) > 1e-2  # it really is the quantized model
    quantized = _quantized(plan)
    assert quantized and all(k.rsplit(".", 1)[-1] in EXPERT_SCHEMES and ".mlp.experts." in k for k in quantized)
    assert all(v == "pack-quantized int4 group 32; weight-only" for v in quantized.values())
    experts = model.model.layers[1].mlp.experts.gate_proj
    assert experts.weight_packed.dtype == torch.int32 and experts.weight_packed.shape == (8, 128, 32)
    assert experts.scheme.weight_only


def test_w4a16_in_memory_bytes_within_1_1x_checkpoint():
    model = quantplug.load(W4, dtype=torch.bfloat16, progress=False)  # the checkpoint's own dtype
    assert model_bytes(model) <= 1.1 * model.quantplug_plan.weight_bytes()


def test_fp8_block_emulates_activations_by_default():
    model, out = load_logits(FP8, REF_FP8["input_ids"])
    assert rel_err(out, REF_FP8["vendor_logits_actquant"]) <= 1e-3
    lin = model.model.layers[0].self_attn.q_b_proj  # [192, 128]: a partial 128-row edge block
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale.shape == (2, 1)
    assert "emulated" in lin.scheme.describe() and not lin.scheme.weight_only
    assert model.model.layers[1].mlp.experts.gate_proj.weight.dtype == torch.float8_e4m3fn  # FP8_BLOCK experts


def test_fp8_block_weight_only_option():
    model, out = load_logits(FP8, REF_FP8["input_ids"], options={"activation_quant": "none"})
    assert rel_err(out, REF_FP8["vendor_logits"]) <= 1e-4
    desc = model.model.layers[0].self_attn.o_proj.scheme.describe()
    assert "NOT emulated (activation_quant=none)" in desc
    # what plan / explain show
    assert any("NOT emulated" in d.describe() for d in model.quantplug_plan.decisions_for("model.layers.0.mlp"))


def test_bad_activation_option_is_a_config_error():
    with pytest.raises(ConfigError, match="activation_quant"):
        build_plan(FP8, options={"activation_quant": "int4"})


def test_fixture_tensors_decode_like_compressed_tensors():
    """Our kernels on the fixtures' stored tensors == compressed-tensors' own decompressors (f32 scales)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    for path, module, compressor, suffix in (
            (W4, "model.layers.1.mlp.experts.3.down_proj", PackedQuantizationCompressor, "weight_packed"),
            (FP8, "model.layers.0.self_attn.q_b_proj", FloatQuantizationCompressor, "weight"),
            (FP8, "model.layers.0.mlp.down_proj", FloatQuantizationCompressor, "weight")):
        cfg = json.loads((path / "config.json").read_text())["quantization_config"]
        group = next(iter(cfg["config_groups"].values()))
        scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
        sd = {k.rsplit(".", 1)[-1]: v for k, v in _state(path).items() if k.startswith(module + ".")}
        sd["weight_scale"] = sd["weight_scale"].float()
        want = compressor.decompress(sd, scheme)["weight"]
        w = group["weights"]
        lay = Layout("packed" if suffix == "weight_packed" else "fp8", w["num_bits"], w["strategy"], w["group_size"],
                     tuple(w["block_structure"]) if w["block_structure"] else None, *want.shape)
        got = kernels.dequantize(lay, sd[suffix], sd["weight_scale"])
        assert torch.equal(got, want), module


# -- Kimi-K2.5 release layout ---------------------------------------------------------------------

def _kimi_release(dst):
    """The wrapped INT4 release: language_model. names, int32 weight_shape, the release's own
    four-entry prefix-less ignore list, quantization_config at the top and inside text_config."""
    def config(cfg):
        qc = cfg.pop("quantization_config")
        qc["ignore"] = list(KIMI_IGNORE)
        text = {k: v for k, v in cfg.items() if k != "architectures"}
        text["model_type"] = "kimi_k2"
        text["quantization_config"] = qc
        cfg.clear()
        cfg.update({"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                    "text_config": text, "quantization_config": qc})

    def state(sd):
        out = {f"language_model.{k}": (v.to(torch.int32) if k.endswith("weight_shape") else v) for k, v in sd.items()}
        out["vision_tower.blocks.0.attn.qkv.weight"] = torch.zeros(12, 4, dtype=torch.bfloat16)
        out["mm_projector.proj.0.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
        return out

    return _variant(W4, dst, config, state)


def test_kimi_k25_release_layout_quantizes_only_routed_experts(tmp_path):
    path = _kimi_release(tmp_path / "kimi")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_slice("language_model.model.layers.1.mlp.experts.0.up_proj.weight_shape").get_dtype() == "I32"
    model, out = load_logits(path, REF_W4["input_ids"])
    plan = model.quantplug_plan
    assert plan.prefix == "language_model" and not plan.errors
    schemes = plan.schemes()
    quantized = _quantized(plan)
    assert sorted(quantized) == sorted(f"language_model.model.layers.{i}.mlp.experts.{p}"
                                       for i in (1, 2) for p in EXPERT_SCHEMES)
    # the release's exact "lm_head" excludes language_model.lm_head; attention / shared experts / dense MLP stay dense
    assert schemes["language_model.lm_head"] == "dense"
    assert schemes["language_model.model.layers.1.self_attn.kv_b_proj"] == "dense"
    assert schemes["language_model.model.layers.1.mlp.shared_experts.down_proj"] == "dense"
    assert rel_err(out, REF_W4["vendor_logits"]) <= 1e-4


def test_ignore_name_matching_nothing_is_a_problem_with_hint(tmp_path):
    def config(cfg):
        cfg["quantization_config"]["ignore"] += ["model.layers.0.self_attn.q_a_prj", "re:.*vision_tower.*"]

    plan = build_plan(_variant(W4, tmp_path / "typo", config))
    err = [p.message for p in plan.errors]
    assert len(err) == 1 and "'model.layers.0.self_attn.q_a_prj' matches no module" in err[0]
    assert "did you mean 'model.layers.0.self_attn.q_a_proj'" in err[0]
    assert any("'re:.*vision_tower.*' matches no module" in p.message for p in plan.warnings)


def test_prefixed_ignore_in_an_unwrapped_checkpoint_is_caught(tmp_path):
    """An ignore list written for a wrapped model, on an unwrapped one: exact names match nothing
    (the check that would have caught sglang issue 18370 before any attention got quantized)."""
    def config(cfg):
        cfg["quantization_config"]["ignore"][-1] = "language_model.model.embed_tokens"

    plan = build_plan(_variant(W4, tmp_path / "prefixed", config))
    assert any("'language_model.model.embed_tokens' matches no module" in p.message
               and "did you mean 'model.embed_tokens'" in p.message for p in plan.errors)


# -- refusals: named layer and field, never a silent dense fallback ----------------------------

def _actorder(cfg):
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"


def _sparse(cfg):
    cfg["quantization_config"]["sparsity_config"] = {"format": "sparse-24-bitmask", "sparsity_structure": "2:4",
                                                     "targets": ["Linear"], "ignore": []}


def _nvfp4(cfg):
    """NVFP4 loads (tests/compressed_tensors/test_fp4.py); groups other than 16 are refused."""
    g = cfg["quantization_config"]["config_groups"]["group_0"]
    g["format"] = "nvfp4-pack-quantized"
    g["weights"].update(num_bits=4, type="float", strategy="tensor_group", group_size=64)


def _transform(cfg):
    cfg["quantization_config"]["transform_config"] = {"config_groups": {"R1": {"type": "hadamard"}}}


@pytest.mark.parametrize("edit, field", [
    (_actorder, "config_groups.group_0.weights.actorder"), (_sparse, "quantization_config.sparsity_config"),
    (_nvfp4, "config_groups.group_0.weights"), (_transform, "quantization_config.transform_config")])
def test_unsupported_specs_are_refused_at_plan_time(tmp_path, edit, field):
    plan = build_plan(_variant(W4, tmp_path / "v", edit))
    refused = [p for p in plan.errors if p.kind == "refused"]
    assert refused and all(field in p.message for p in refused)
    assert "model.layers.1.mlp.experts.gate_proj" in {p.layer for p in refused}
    with pytest.raises(PlanError, match="refusing a silent dense fallback"):
        plan.raise_for_problems()


def test_weight_shape_disagreeing_with_the_tensors_fails_the_load(tmp_path):
    def state(sd):
        sd["model.layers.2.mlp.experts.5.up_proj.weight_shape"] = torch.tensor([128, 255])
        return sd

    with pytest.raises(LoadError, match=r"layers\.2\.mlp\.experts\.up_proj \(expert slot 5\)\.weight_shape holds "
                                        r"\[128, 255\]"):
        quantplug.load(_variant(W4, tmp_path / "bad", edit_state=state), progress=False)


# -- kernels against compressed-tensors ----------------------------------------------------------

@pytest.mark.parametrize("bits, cols", [(4, 64), (4, 36), (8, 40), (8, 33)])
def test_pack_unpack_match_compressed_tensors(bits, cols):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(bits * cols)
    lo = -(1 << (bits - 1))
    q = torch.randint(lo, -lo, (24, cols), generator=g, dtype=torch.int8)
    words = pack_to_int32(q, bits)
    assert torch.equal(kernels.pack_rows(q, bits), words)
    assert torch.equal(kernels.unpack_rows(words, bits, cols), unpack_from_int32(words, bits, torch.Size(q.shape)))
    zp = pack_to_int32(q, bits, packed_dim=0)
    assert torch.equal(kernels.unpack_zero_point(zp, bits, 24), q.float())


def _ct_args(**kw):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**kw))


@pytest.mark.parametrize("bits, strategy, group, symmetric", [
    (4, "group", 32, True), (4, "group", 128, False), (4, "channel", None, True), (8, "group", 64, True),
    (8, "channel", None, False)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_packed_dequant_matches_compressed_tensors(bits, strategy, group, symmetric, scale_dtype):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    out_f, in_f = 72, 256
    g = torch.Generator().manual_seed(bits + (group or 0))
    w = torch.randn(out_f, in_f, generator=g)
    scheme = _ct_args(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    n_groups = in_f // group if group else 1
    gw = w.view(out_f, n_groups, -1)
    qmax = (1 << (bits - 1)) - 1
    if symmetric:
        scale, zp = gw.abs().amax(-1) / (qmax + 0.5), None
    else:
        lo, hi = gw.amin(-1).clamp(max=0), gw.amax(-1).clamp(min=0)
        scale = (hi - lo) / (2 * qmax + 1)
        zp = torch.clamp(torch.round(-(qmax + 1) - lo / scale), -(qmax + 1), qmax).to(torch.int8)
    sd = {"weight": w, "weight_scale": scale.to(scale_dtype)}
    if zp is not None:
        sd["weight_zero_point"] = zp
    packed = PackedQuantizationCompressor.compress(sd, scheme)
    want = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    lay = Layout("packed", bits, strategy, group, None, out_f, in_f)
    z = kernels.unpack_zero_point(packed["weight_zero_point"], bits, out_f) if zp is not None else None
    got = kernels.dequantize(lay, packed["weight_packed"], packed["weight_scale"], z, dtype=scale_dtype)
    assert torch.equal(got, want)
    half = kernels.dequantize(lay, packed["weight_packed"], packed["weight_scale"], z, dtype=scale_dtype,
                              rows=(8, 40))
    assert torch.equal(half, want[8:40])


@pytest.mark.parametrize("strategy, shape", [("block", (300, 200)), ("channel", (64, 96)), ("tensor", (40, 64)),
                                             ("int8-channel", (64, 96))])
def test_naive_dequant_matches_compressed_tensors(strategy, shape):
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor

    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f)
    w = torch.randn(out_f, in_f, generator=g)
    is_int = strategy.startswith("int8")
    strategy = strategy.removeprefix("int8-")
    kw = {"block_structure": [128, 128]} if strategy == "block" else {}
    scheme = _ct_args(num_bits=8, type="int" if is_int else "float", symmetric=True, strategy=strategy, **kw)
    lay = Layout("int8" if is_int else "fp8", 8, strategy, None, (128, 128) if strategy == "block" else None, *shape)
    scale = torch.rand(lay.scale_shape(), generator=g) * 0.01 + 1e-3
    compressed = NaiveQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    want = NaiveQuantizationCompressor.decompress(compressed, scheme)["weight"]
    got = kernels.dequantize(lay, compressed["weight"], compressed["weight_scale"])
    assert torch.equal(got, want)
    if strategy == "block":
        assert torch.equal(kernels.dequantize(lay, compressed["weight"], scale, rows=(128, 300)), want[128:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_every_code_decodes_like_torch(dtype):
    """The integer route (e4m3 bits moved into float16, 256 folded into the scale) gives torch's
    own conversion times the scale, for all 256 codes; NaN codes are found and stay NaN."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(16, 16)
    lay = Layout("fp8", 8, "channel", None, None, 16, 16)
    scale = (torch.rand(16, 1, generator=torch.Generator().manual_seed(0)) + 0.1).to(dtype)
    want = (codes.float() * scale.float()).to(dtype)
    got = kernels.dequantize(lay, codes, scale, dtype=dtype)
    assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 2
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    clean = codes.view(torch.uint8).clone()
    clean[(clean & 0x7F) == 0x7F] = 0
    assert not kernels.has_nan_codes(clean.view(torch.float8_e4m3fn))
    for off in range(3):  # unaligned views are checked byte by byte
        b = torch.zeros(40, dtype=torch.uint8)
        b[37] = 0xFF
        assert kernels.has_nan_codes(b[off:].view(torch.float8_e4m3fn))
        assert not kernels.has_nan_codes(b[off:37].view(torch.float8_e4m3fn))


def test_chunk_boundaries_change_nothing(monkeypatch):
    """Chunks ending inside 128-row blocks and scale groups give the same bits as one chunk."""
    g = torch.Generator().manual_seed(5)
    for lay, q, scale in (
            (Layout("fp8", 8, "block", None, (128, 128), 1000, 1100),
             torch.randn(1000, 1100, generator=g).to(torch.float8_e4m3fn), torch.rand(8, 9, generator=g)),
            (Layout("packed", 4, "group", 32, None, 999, 1024),
             torch.randint(-(2 ** 31), 2 ** 31 - 1, (999, 128), generator=g, dtype=torch.int32),
             torch.rand(999, 32, generator=g).to(torch.bfloat16))):
        whole = kernels.dequantize(lay, q, scale, dtype=torch.bfloat16)
        full32 = kernels.dequantize(lay, q, scale)
        monkeypatch.setattr(kernels, "CHUNK", 50 * lay.in_features)
        assert torch.equal(kernels.dequantize(lay, q, scale, dtype=torch.bfloat16), whole)
        assert torch.equal(kernels.dequantize(lay, q, scale, rows=(128, 777)), full32[128:777])
        monkeypatch.undo()


def test_fp8_activation_groups_match_compressed_tensors():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(0)) * 3
    args = QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True, symmetric=True)
    s, z = compute_dynamic_scales_and_zp(x, args, module=torch.nn.Linear(1, 1))
    assert torch.equal(kernels.fp8_quant(x, 128), fake_quantize(x, s, z, args))
    # narrower than a group: one partial group per token (compressed-tensors' own path cannot take it)
    y = x[:, :64]
    s = y.abs().amax(-1, keepdim=True) / 448
    assert torch.equal(kernels.fp8_quant(y, 128), (y / s).to(torch.float8_e4m3fn).float() * s)


# -- W8A8 (int-quantized) and FP8 per-channel checkpoints written by compressed-tensors' compressors -----

def _ct_checkpoint(path, kind: str):
    """A tiny DeepSeek-V3 checkpoint whose linears (experts included) compressed-tensors' own
    compressor wrote: int8 W8A8 (per-channel, dynamic per-token int8 activations) or FP8 per channel."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    cfg = tiny_config()
    state = random_state(cfg, seed=3)
    is_int = kind == "w8a8"
    wargs = {"num_bits": 8, "type": "int" if is_int else "float", "symmetric": True, "strategy": "channel",
             "dynamic": False}
    aargs = {"num_bits": 8, "type": "int" if is_int else "float", "symmetric": True, "strategy": "token",
             "dynamic": True}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**wargs),
                                input_activations=QuantizationArgs(**aargs))
    fmt = "int-quantized" if is_int else "float-quantized"
    out = {}
    for name, t in state.items():
        if not name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            out[name] = t
            continue
        base = name.removesuffix(".weight")
        scale = t.abs().amax(-1, keepdim=True) / (127.5 if is_int else 448.0)
        comp = NaiveQuantizationCompressor.compress({"weight": t, "weight_scale": scale}, scheme)
        out.update({f"{base}.{k}": v for k, v in comp.items()})
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": wargs, "input_activations": aargs,
                                        "output_activations": None, "format": fmt}},
          "ignore": ["lm_head"], "kv_cache_scheme": None}
    write_checkpoint(path, {**cfg, "quantization_config": qc}, out)
    return cfg, out, scheme


@pytest.mark.parametrize("kind", ["w8a8", "fp8_dynamic"])
def test_naive_checkpoint_weight_only_matches_transformers(tmp_path, kind):
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from conftest import hf_logits

    cfg, stored, scheme = _ct_checkpoint(tmp_path / kind, kind)
    ids = torch.randint(0, cfg["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    model, out = load_logits(tmp_path / kind, ids, options={"activation_quant": "none"})
    assert _quantized(model.quantplug_plan) and "lm_head" not in _quantized(model.quantplug_plan)
    dense = {}
    for name, t in stored.items():
        if name.endswith("weight_scale"):
            continue
        if name.endswith(".weight") and f"{name}_scale" in stored:
            sd = {"weight": t, "weight_scale": stored[f"{name}_scale"]}
            dense[name] = NaiveQuantizationCompressor.decompress(sd, scheme)["weight"]
        else:
            dense[name] = t
    assert rel_err(out, hf_logits(cfg, dense, ids)) <= 1e-5


def test_w8a8_emulation_equals_per_token_int8_inputs(tmp_path):
    """Default mode: every quantized linear sees its input int8-quantized per token (s = max|x| / 127)."""
    cfg, _, _ = _ct_checkpoint(tmp_path / "w8a8", "w8a8")
    ids = torch.randint(0, cfg["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    native_model, native_out = load_logits(tmp_path / "w8a8", ids)
    with native.disabled():  # the torch paths, where the patched apply below runs
        model, out = load_logits(tmp_path / "w8a8", ids)
    ref_model, _ = load_logits(tmp_path / "w8a8", ids, options={"activation_quant": "none"})

    def per_token_int8(x):
        s = x.abs().amax(-1, keepdim=True) / 127
        s = torch.where(s == 0, torch.ones_like(s), s)
        return torch.clamp(torch.round(x / s), -128, 127) * s

    with torch.no_grad():
        weight_only = ref_model(ids)
    schemes = {id(m.scheme): m.scheme for m in ref_model.modules()
               if getattr(m, "scheme", None) is not None and m.scheme.name == "compressed-tensors"}
    assert len(schemes) > 10
    for sc in schemes.values():  # every quantized matmul (experts go through apply_grouped -> apply)
        sc.apply = lambda layer, x, index=None, f=sc.apply: f(layer, per_token_int8(x), index)
    with torch.no_grad(), native.disabled():
        ref = ref_model(ids)
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(out, weight_only) > 1e-4  # activations really are quantized
    # the native int8 emulation: the same up to summation order. Where the native row kernels sum
    # in the torch matmul's order the codes agree (1e-5: the AVX-512 build); where they do not (the
    # AVX2 build) a last-bit difference in one layer's output can move one int8 code of the next
    # layer's input, and later positions follow it (measured 1.5e-3 against act quantization's
    # 5.3e-3): then the native logits must still be far nearer the int8 ones than the weight-only
    err = rel_err(native_out, out)
    assert err <= 1e-5 or (err <= 3e-3 and rel_err(native_out, weight_only) > 2 * err), err


# -- export and the conformance kit --------------------------------------------------------------

def test_export_writes_the_fixture_layout(tmp_path):
    dense = write_checkpoint(tmp_path / "dense", {**tiny_config(), "architectures": ["DeepseekV3ForCausalLM"]},
                             random_state(tiny_config()))
    model = quantplug.load(dense, progress=False)
    from quantplug_compressed_tensors.export import export_w4a16

    res = export_w4a16(model, model.quantplug_plan, tmp_path / "out", {})
    got = {k.rsplit(".", 1)[-1] for k in load_file(str(res.files[0])) if ".experts." in k}
    want = {k.rsplit(".", 1)[-1] for k in _state(W4) if ".experts." in k}
    assert got == want == {"weight_packed", "weight_scale", "weight_shape"}
    qc = json.loads((res.path / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((W4 / "config.json").read_text())["quantization_config"]


# The conformance kit runs on this backend in tests/conformance/test_bundled.py.


def test_no_runtime_import_of_compressed_tensors():
    import subprocess
    import sys

    code = ("import sys, quantplug, quantplug_compressed_tensors as p; "
            "quantplug.load(sys.argv[1], progress=False); print('compressed_tensors' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(W4)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
