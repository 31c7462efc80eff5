"""Kimi-K3 (and Kimi-Linear) in the quantized formats.

* The K3 release's format: compressed-tensors ``mxfp4-pack-quantized`` on the routed experts only,
  packed by compressed-tensors' own compressor, everything else in the release's dtypes, the
  non-expert linears in ``ignore``: logits equal the dequantized model (float32) within 1e-5.
* ModelSlim W4A8 (msmodelslim's Kimi recipe) on K3's linears with a dense FLOAT ``kv_b_proj``: the
  dense kv_b_proj loads (and is kept), experts are W4A8_DYNAMIC; logits equal an emulation (the
  dequantized float32 model with every linear's input quantized as the recipe says).
* Every installed backend's own exporter on K3 and Kimi-Linear: each export loads and matches its
  dequantized weights (weight-only formats within 1e-5), or is refused naming the tensor it cannot
  hold (GGUF's deepseek2 names have no place for KDA's float parameters).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import quantplug
import torch
from kimi_models import k3_config, kimi_linear_config, kimi_state, write_k3_release
from quantplug.api import QuantplugError, dense_state
from quantplug.testing import write_checkpoint
from quantplug.testing.reference import rel_err
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(0))


def _logits(path: Path, **kw) -> torch.Tensor:
    with torch.no_grad():
        return quantplug.load(path, progress=False, **kw)(IDS)


# -- (a) the K3 release: compressed-tensors mxfp4-pack-quantized experts --------------------------

def test_k3_release_mxfp4_experts_equal_the_dequantized_model(tmp_path):
    pytest.importorskip("compressed_tensors")
    release, deq = write_k3_release(tmp_path / "k3", k3_config(), kimi_state(k3_config(), seed=51))
    stored = load_file(str(release / "model.safetensors"))
    e = "language_model.model.layers.1.block_sparse_moe.experts.3.w2"
    packed, scale = stored[f"{e}.weight_packed"], stored[f"{e}.weight_scale"]
    assert packed.dtype == torch.uint8 and packed.shape == (32, 16)        # [out = latent, in / 2]
    assert scale.dtype == torch.uint8 and scale.shape == (32, 1)           # E8M0 [out, in / 32]
    assert stored["language_model.model.layers.0.self_attn.q_conv1d.weight"].dtype == torch.float32
    assert stored["language_model.model.layers.0.self_attn.dt_bias"].dtype == torch.float32
    assert stored["language_model.model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    # low nibble = even column: the compressor's codes against the dequantized weight, by hand
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()
    vals = e2m1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    want = load_file(str(deq / "model.safetensors"))[f"{e}.weight"]
    assert torch.equal(vals * torch.exp2(scale.float() - 127).repeat_interleave(32, -1), want)

    plan = quantplug.plan(release)
    assert plan.backend == "compressed_tensors" and not plan.errors
    schemes = {k.removeprefix("language_model.model.layers."): v for k, v in plan.schemes().items()}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert schemes[f"1.block_sparse_moe.experts.{proj}"].startswith("mxfp4-pack-quantized")
    quantized = [k for k, v in schemes.items() if v != "dense" and ".experts." not in k]
    assert quantized == []  # only routed experts: KDA, MLA, latent projections, shared experts, lm_head bf16
    model = quantplug.load(release, dtype=torch.float32, progress=False)
    ex = model.language_model.model.layers[1].block_sparse_moe.experts.down_proj
    assert ex.weight_packed.dtype == torch.uint8  # experts stay packed
    with torch.no_grad():
        out = model(IDS)
    assert rel_err(out, _logits(deq)) <= 1e-5
    assert rel_err(out, _logits(write_checkpoint(tmp_path / "float", k3_config(),
                                                 kimi_state(k3_config(), seed=51)))) > 1e-3


# -- (b) ModelSlim W4A8 with a dense kv_b_proj ------------------------------------------------------

def _fake_quant(model: torch.nn.Module, desc: dict, tensors: dict) -> None:
    """Quantize every linear's input of ``model`` (the dequantized float32 twin) as the ModelSlim
    export says: W8A8 static with its input_scale / input_offset, *_DYNAMIC per token (Ascend's
    symmetric int8: s = max|x| / 127), FLOAT untouched. Fused paths are turned off so every product
    goes through a hooked linear."""
    from quantplug.layers.linear import QuantLinear, StackedLinear

    def dynamic(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        s = xf.abs().amax(-1, keepdim=True) / 127.0
        s = torch.where(s == 0, torch.ones_like(s), s)
        return (torch.clamp(torch.round(xf / s), -128, 127) * s).to(x.dtype)

    def static(name: str):
        s, o = tensors[f"{name}.input_scale"].float(), tensors[f"{name}.input_offset"].float()
        return lambda x: ((torch.clamp(torch.round(x.float() / s + o), -128, 127) - o) * s).to(x.dtype)

    for mod in model.modules():
        for attr in ("gate_up", "qkv_a", "step", "one"):
            if getattr(mod, attr, None) is not None:
                setattr(mod, attr, None)
        if isinstance(mod, QuantLinear):
            typ = desc.get(f"{mod.qp_ckpt}.weight", "FLOAT")
            fq = None if typ == "FLOAT" else static(mod.qp_ckpt) if typ == "W8A8" else dynamic
            if fq is not None:
                mod.register_forward_pre_hook(lambda m, args, fq=fq: (fq(args[0]),))
        elif isinstance(mod, StackedLinear):
            base = mod.qp_ckpt.rsplit(".", 1)[0]
            stored = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[mod.qp_ckpt.rsplit(".", 1)[1]]
            assert desc[f"{base}.0.{stored}.weight"] == "W4A8_DYNAMIC"
            orig = mod.forward_grouped
            mod.forward_grouped = lambda x, groups, orig=orig: orig(dynamic(x), groups)


def test_k3_modelslim_w4a8_dense_kv_b_matches_emulation(tmp_path):
    pytest.importorskip("quantplug_modelslim")
    from quantplug_modelslim.export import export_modelslim

    cfg = k3_config(num_experts_per_token=8)
    dense = quantplug.load(write_checkpoint(tmp_path / "dense", cfg, kimi_state(cfg, seed=52)), progress=False)
    res, = export_modelslim(dense, dense.quantplug_plan, tmp_path / "ms", {"calibration": [IDS[:, :16]],
                                                                          "recipes": ["w4a8"]})
    desc = json.loads((res.path / "quant_model_description.json").read_text())
    tensors = load_file(str(res.path / "quant_model_weight_w8a8.safetensors"))
    mla = "language_model.model.layers.3.self_attn"
    assert desc[f"{mla}.kv_b_proj.weight"] == "FLOAT" and tensors[f"{mla}.kv_b_proj.weight"].is_floating_point()
    assert desc["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"] == "W4A8_DYNAMIC"
    assert desc["language_model.model.layers.1.self_attn.b_proj.weight"] == "W8A8"  # out = heads: per channel

    plan = quantplug.plan(res.path)
    assert plan.backend == "modelslim" and not plan.errors
    schemes = plan.schemes()
    assert schemes[f"{mla}.kv_b_proj"] == "dense"
    assert {d.value for d in plan.decisions if d.hook == "quantplug_attention_layout"} == {"dense"}
    assert schemes["language_model.model.layers.1.block_sparse_moe.experts.gate_proj"].startswith("W4A8_DYNAMIC")
    assert schemes["language_model.model.layers.1.self_attn.q_proj"].startswith("W8A8 ")
    model = quantplug.load(res.path, progress=False)
    kv_b = model.language_model.model.layers[3].self_attn.kv_b_proj
    assert torch.equal(kv_b.weight, tensors[f"{mla}.kv_b_proj.weight"])  # loaded as stored, not deleted
    with torch.no_grad():
        out = model(IDS)

    deq = tmp_path / "deq"
    deq.mkdir()
    save_file({k: v.float().contiguous() for k, v in dense_state(model).items()}, str(deq / "model.safetensors"))
    (deq / "config.json").write_text(json.dumps(cfg))
    ref = quantplug.load(deq, progress=False)
    _fake_quant(ref, desc, tensors)
    with torch.no_grad():
        emulated = ref(IDS)
    with torch.no_grad():
        quant_err = rel_err(out, dense(IDS))
    # position by position: the emulation is exact up to float rounding (median 2e-7) except where
    # a float product summed in another order than the int8 path flips one rounding tie of a
    # token's int8 code; the flip then follows that token through the later layers (89% of the
    # 140 positions within 1e-5, the worst at 1.8e-2, against a quantization error of ~1)
    pos = ((out - emulated).abs().amax(-1) / emulated.abs().max()).flatten()
    assert pos.median() <= 1e-6 and (pos <= 1e-5).float().mean() >= 0.8, pos
    assert pos.max() <= 0.05 < 0.5 < quant_err


# -- (c) every installed backend's own exporter ------------------------------------------------------

def _exports():
    from quantplug.testing.engines import EXPORTS

    return [r for r in EXPORTS if r.backend is not None]


@pytest.fixture(scope="module")
def kimi_dense(tmp_path_factory):
    from quantplug.testing.probes import isolated_plugin_manager

    root = tmp_path_factory.mktemp("kimi-exports")
    made = {}
    for name, cfg in (("k3", k3_config(num_experts_per_token=8)), ("kimi-linear", kimi_linear_config(
            num_experts_per_token=8))):
        path = write_checkpoint(root / name, cfg, kimi_state(cfg, seed=53))
        made[name] = (cfg, quantplug.load(path, plugin_manager=isolated_plugin_manager(), progress=False))
    return root, made


@pytest.mark.parametrize("arch", ["k3", "kimi-linear"])
@pytest.mark.parametrize("row", _exports(), ids=lambda r: r.label)
def test_every_backend_exporter(kimi_dense, arch, row):
    from quantplug.testing.engines import installed_backends
    from quantplug.testing.probes import isolated_plugin_manager

    backends = installed_backends()
    if row.backend not in backends:
        pytest.skip(f"{row.backend} is not installed")
    root, made = kimi_dense
    cfg, model = made[arch]
    pm = isolated_plugin_manager({row.backend: backends[row.backend]})
    scratch = root / f"{arch}-{row.label}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    if row.backend == "expert_pack":  # llama.cpp deepseek2 names: none for KDA's float parameters
        with pytest.raises(QuantplugError, match=r"model\.layers\.0\.self_attn\.\S+ has no llama\.cpp deepseek2 name"):
            pm.export(row.backend, model=model, destination=scratch, plan=model.quantplug_plan, options=row.options)
        return
    res = pm.export(row.backend, model=model, destination=scratch, plan=model.quantplug_plan,
                    options=row.options)[row.pick]
    plan = quantplug.plan(res.path)
    assert not plan.errors, [p.describe() for p in plan.errors[:3]]
    loaded = quantplug.load(res.path, progress=False)
    deq = scratch / "dequantized"
    deq.mkdir()
    save_file({k: v.float().contiguous() for k, v in dense_state(loaded).items()}, str(deq / "model.safetensors"))
    (deq / "config.json").write_text(json.dumps(cfg))
    weight_only = all(getattr(getattr(m, "scheme", None), "weight_only", True) for m in loaded.modules())
    with torch.no_grad():
        err = rel_err(loaded(IDS[:, :11]), quantplug.load(deq, progress=False)(IDS[:, :11]))
    # weight-only: exact up to float32 rounding (the AVX512 builds' int4 kernels sum in another order
    # than the dequantized model's matmuls: GPTQ / AWQ int4 2.1e-5 there, below 1e-5 on AVX2);
    # activations quantized (fp8, int8, NVFP4's 4-bit codes): a sanity bound (K3's logits move
    # 0.3-0.7 under them, a mis-mapped tensor moves them by more)
    assert err <= (5e-5 if weight_only else 1.0), (row.label, weight_only, err)
