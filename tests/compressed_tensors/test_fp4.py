"""compressed-tensors nvfp4- / mxfp4-pack-quantized against auto-round 0.16.1's llm_compressor
exports (tests/data/vendor), compressed-tensors' own decoding and activation steps (float32), and
the conformance kit on checkpoints written by a small writer of this file."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import quantplug
import torch
from conftest import VENDOR, load_logits, rel_err
from quantplug.loader import model_bytes
from quantplug.testing import BackendConformance
from safetensors.torch import load_file, save_file

pytest.importorskip("quantplug_compressed_tensors")
from quantplug_compressed_tensors import fp4  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_generate import check_cached_equals_recompute  # noqa: E402

NV = VENDOR / "ct_nvfp4_autoround_dsv3"
MX = VENDOR / "ct_mxfp4_autoround_dsv3"
REF = {p: load_file(str(p) + ".reference.safetensors") for p in (NV, MX)}


@pytest.mark.parametrize("path", [NV, MX], ids=["nvfp4", "mxfp4"])
def test_weight_only_matches_compressed_tensors_decoding(path):
    ref = REF[path]
    model, out = load_logits(path, ref["input_ids"], options={"activation_quant": "none"}, progress=False)
    assert model.quantplug_plan.backend == "compressed_tensors"
    assert rel_err(out, ref["vendor_logits"]) <= 1e-5  # observed 8.9e-7 / 6.9e-7
    assert rel_err(out, ref["dense_logits"]) > 1e-1


@pytest.mark.parametrize("path", [NV, MX], ids=["nvfp4", "mxfp4"])
def test_activation_emulation_matches_compressed_tensors_forward_quantize(path):
    ref = REF[path]
    model, out = load_logits(path, ref["input_ids"], progress=False)
    assert rel_err(out, ref["vendor_logits_actquant"]) <= 1e-5  # observed 0.0 for both
    assert rel_err(out, ref["vendor_logits"]) > 1e-2
    assert "emulated" in model.model.layers[0].self_attn.q_a_proj.scheme.describe()


def test_weights_stay_packed():
    model = quantplug.load(NV, dtype=torch.bfloat16, progress=False)
    lin = model.model.layers[1].mlp.experts.down_proj
    assert lin.weight_packed.dtype == torch.uint8 and lin.weight_packed.shape == (8, 256, 64)
    assert lin.weight_scale.dtype == torch.float8_e4m3fn and lin.weight_global_scale.shape == (8, 1)
    assert model_bytes(model) <= 1.05 * model.quantplug_plan.weight_bytes()
    mx = quantplug.load(MX, progress=False).model.layers[0].self_attn.o_proj
    assert mx.weight_scale.dtype == torch.uint8 and mx.weight_scale.shape == (256, 4)


def test_dequantize_equals_compressed_tensors_steps_in_float32():
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    for path, layout in ((NV, fp4.NVFP4), (MX, fp4.MXFP4)):
        st = load_file(str(path / "model.safetensors"))
        m = "model.layers.2.mlp.experts.6.up_proj"
        packed, scale = st[m + ".weight_packed"], st[m + ".weight_scale"]
        gs = st.get(m + ".weight_global_scale")
        q = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        s = decompress_mx_scale(scale).float() if layout is fp4.MXFP4 else scale.float()
        args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group" if gs is not None else "group",
                                group_size=layout.group)
        want = dequantize(x_q=q, scale=s, args=args, global_scale=gs, dtype=torch.float32)
        assert torch.equal(fp4.dequantize(layout, packed, scale, gs), want)
        # the library's own decompressor works in bfloat16: ours rounds once from float32
        assert torch.equal(fp4.dequantize(layout, packed, scale, gs, torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("layout", [fp4.NVFP4, fp4.MXFP4], ids=["nvfp4", "mxfp4"])
def test_activation_quant_equals_compressed_tensors(layout):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 128, generator=g) * torch.exp(torch.randn(3, 5, 128, generator=g) * 2)
    x[0, 0, :32] = 0.0  # an all-zero group
    x[1, 1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * 2.0 ** -3  # ties
    if layout is fp4.NVFP4:
        args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local",
                                scale_dtype=torch.float8_e4m3fn)
        gs = torch.tensor([448.0 * 6 / 20.0])
    else:
        args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, dynamic=True,
                                scale_dtype=torch.uint8)
        gs = None
    scale, zp = compute_dynamic_scales_and_zp(x, args, None, global_scale=gs)
    want = fake_quantize(x, scale, zp, args, global_scale=gs)
    assert torch.equal(fp4.act_quant(layout, x, gs), want)


@pytest.mark.parametrize("path", [NV, MX], ids=["nvfp4", "mxfp4"])
def test_cached_generate_equals_recompute(path):
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    check_cached_equals_recompute(quantplug.load(path, options={"activation_quant": "none"}, progress=False), ids,
                                  steps=4)
    # with activation emulation: per token and group, as in the batched recompute
    check_cached_equals_recompute(quantplug.load(path, progress=False), ids, steps=4, tol=1e-3)


# -- a small writer (compressed-tensors' rules) and the conformance kit -----------------------------

LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|"
                    r"o_proj|gate_proj|up_proj|down_proj)\.weight$")


def _quantize(w: torch.Tensor, layout: fp4.FP4Layout) -> dict[str, torch.Tensor]:
    """RTN as compressed-tensors: NVFP4 global scale 448 * 6 / amax, block scales e4m3(gs * amax16 / 6);
    MXFP4 power-of-two e8m0 scales per 32 (its round_to_power_2 rule)."""
    wf = w.float()
    g = wf.unflatten(-1, (-1, layout.group))
    amax = g.abs().amax(-1)
    out: dict[str, torch.Tensor] = {}
    if layout is fp4.NVFP4:
        gs = (448.0 * 6 / wf.abs().amax()).reshape(1)
        s = (gs * amax / 6).clamp(max=448).to(torch.float8_e4m3fn)
        b = s.float() / gs
        out.update(weight_scale=s, weight_global_scale=gs)
    else:
        e = (127 + torch.floor(torch.log2(fp4._power_of_two(amax))) - 2).clamp(0, 255)
        b = torch.exp2(e - 127)
        out["weight_scale"] = e.to(torch.uint8)
    q = fp4.e2m1_round((g / b.unsqueeze(-1)).clamp(-6, 6)).flatten(-2)
    mag = (q.abs().unsqueeze(-1) == fp4.E2M1[:8]).to(torch.uint8).argmax(-1).to(torch.uint8)
    codes = mag | (((q < 0) & (mag != 0)).to(torch.uint8) << 3)
    out["weight_packed"] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return out


def write_fp4(path: Path, config: dict, dense: dict, layout: fp4.FP4Layout) -> None:
    fmt = f"{layout.name}-pack-quantized"
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False, "group_size": layout.group,
               "strategy": "tensor_group" if layout is fp4.NVFP4 else "group"}
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
          "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                               "input_activations": None, "format": fmt}}}
    tensors: dict[str, torch.Tensor] = {}
    for name, w in dense.items():
        if LINEAR.search(name):
            base = name[: -len(".weight")]
            tensors.update({f"{base}.{k}": v.contiguous() for k, v in _quantize(w, layout).items()})
        else:
            tensors[name] = w.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(dict(config, quantization_config=qc)))


class TestNVFP4(BackendConformance):
    backend = "compressed_tensors"
    options = {"activation_quant": "none"}

    def write_checkpoint(self, path, config, dense_state):
        write_fp4(path, config, dense_state, fp4.NVFP4)


class TestMXFP4(BackendConformance):
    backend = "compressed_tensors"
    options = {"activation_quant": "none"}

    def write_checkpoint(self, path, config, dense_state):
        write_fp4(path, config, dense_state, fp4.MXFP4)
