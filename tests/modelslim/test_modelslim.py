"""ModelSlim backend against msmodelslim's own export (tests/data/vendor) and derived variants."""

from __future__ import annotations

import json
import shutil

import pytest
import quantplug
import torch
from conftest import VENDOR, load_logits, rel_err
from quantplug.errors import ConfigError
from quantplug.loader import model_bytes
from quantplug.plan import build_plan
from safetensors.torch import load_file, save_file

pytest.importorskip("quantplug_modelslim")
from quantplug_modelslim.schemes import dynamic_quant, pack_int4_rows, unpack_int4_rows  # noqa: E402

FIX = VENDOR / "modelslim_w8a8_dsv3"
REF = load_file(str(VENDOR / "modelslim_w8a8_dsv3.reference.safetensors"))


def _run(path, **kw):
    return load_logits(path, REF["input_ids"], **kw)


def test_vendor_fixture_msmodelslim_numerics():
    model, out = _run(FIX, options={"activation_quant": "msmodelslim"})
    assert model.quantplug_plan.backend == "modelslim"
    vendor = REF["vendor_logits"]
    per_pos = (out - vendor).abs().amax(-1) / vendor.abs().max()
    # 23 of 24 positions' inputs agree to float rounding; sequence 0 from position 4 on differs
    # by one activation rounding tie (see the next test), which attention then carries forward.
    assert bool((per_pos[1] <= 1e-5).all()) and bool((per_pos[0, :4] <= 1e-5).all())
    assert rel_err(out, vendor) <= 1e-2
    assert rel_err(out, REF["dense_logits"]) > 2e-2  # far closer to the vendor's quantized model than to dense
    assert model_bytes(model) <= 1.1 * model.quantplug_plan.weight_bytes()
    assert model.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.int8


def test_vendor_gap_is_exactly_one_rounding_tie(monkeypatch):
    """The whole remaining gap is one int8 activation: layer 1 kv_b_proj, token (0, 4), channel 60,
    where x / input_scale + input_offset = 72.5000229 (x is 2 float32 ulps above the exact .5 tie).
    We round it to 73; msmodelslim's float32 pipeline, whose upstream rounding differs by those 2
    ulps, rounds to 72. Forcing that single element to 72 reproduces the vendor's logits at every
    position to float rounding, so every other number in the emulation is right."""
    import quantplug_modelslim.schemes as S

    model, _ = _run(FIX, options={"activation_quant": "msmodelslim"})
    target = model.model.layers[1].self_attn.kv_b_proj
    original = S.W8A8Static.apply
    seen = {}

    def apply(self, layer, x, index=None):
        if layer is not target:
            return original(self, layer, x, index)
        s, o = layer.input_scale.float(), layer.input_offset.float()
        v = (x.float() / s + o).reshape(-1, x.shape[-1])
        seen["v"] = float(v[4, 60])
        q = torch.clamp(torch.round(v), -128, 127)
        q[4, 60] -= 1  # the vendor's side of the tie
        acc = torch.nn.functional.linear(q.double(), layer.weight.double()) + layer.quant_bias.double()
        return (acc.float() * layer._deq).reshape(*x.shape[:-1], -1).to(x.dtype)

    monkeypatch.setattr(S.W8A8Static, "apply", apply)
    with torch.no_grad():
        out = model(REF["input_ids"])
    assert abs(seen["v"] - 72.5) < 3e-5  # a tie up to float rounding, not a formula difference
    vendor = REF["vendor_logits"]
    assert float(((out - vendor).abs().amax(-1) / vendor.abs().max()).max()) <= 1e-5


def test_activation_mode_is_in_plan_and_differs():
    _, ms = _run(FIX, options={"activation_quant": "msmodelslim"})
    model, asc = _run(FIX)
    schemes = model.quantplug_plan.schemes()
    assert "ascend" in schemes["model.layers.0.mlp.gate_proj"]
    assert 1e-3 < rel_err(asc, ms) < 0.1


def test_unknown_activation_mode_is_a_config_error():
    with pytest.raises(ConfigError, match=r"option activation_quant='fp8': expected one of 'ascend', 'msmodelslim' "
                                          r"\(declared by modelslim"):
        build_plan(FIX, options={"activation_quant": "fp8"})


def _variant(dst, *, kimi=False, hub=False, float_kv_b=False):
    shutil.copytree(FIX, dst)
    sd = load_file(str(FIX / "quant_model_weight_w8a8.safetensors"))
    desc = json.loads((FIX / "quant_model_description.json").read_text())
    if float_kv_b:
        for i in range(3):
            b = f"model.layers.{i}.self_attn.kv_b_proj"
            w = (sd[f"{b}.weight"].float() - sd[f"{b}.weight_offset"]) * sd[f"{b}.weight_scale"]
            for suffix in ("weight", "weight_scale", "weight_offset", "input_scale", "input_offset", "quant_bias",
                           "deq_scale"):
                sd.pop(f"{b}.{suffix}")
                desc.pop(f"{b}.{suffix}")
            sd[f"{b}.weight"] = w
            desc[f"{b}.weight"] = "FLOAT"
    if hub:
        for name in [n for n in sd if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")]:
            t = sd.pop(name)
            typ = desc.pop(name)
            base = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    half = t.shape[1] // 2
                    parts = {"gate_proj": t[e, :half], "up_proj": t[e, half:]}
                else:
                    parts = {"down_proj": t[e]}
                for proj, w in parts.items():
                    sd[f"{base}.{e}.{proj}.weight"] = w.clone()
                    desc[f"{base}.{e}.{proj}.weight"] = typ
    cfg = json.loads((FIX / "config.json").read_text())
    if kimi:
        sd = {f"language_model.{k}": v for k, v in sd.items()}
        sd["vision_tower.patch.weight"] = torch.zeros(2, 2)
        desc = {(f"language_model.{k}" if k not in ("model_quant_type", "version") else k): v for k, v in desc.items()}
        desc["vision_tower.patch.weight"] = "FLOAT"
        text = {k: v for k, v in cfg.items() if k != "architectures"}
        cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}
    save_file(sd, str(dst / "quant_model_weight_w8a8.safetensors"))
    (dst / "quant_model_description.json").write_text(json.dumps(desc))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_kimi_hub_experts_float_kv_b_gets_dense_layout_and_matches(tmp_path):
    plain = _variant(tmp_path / "plain", float_kv_b=True)
    kimi = _variant(tmp_path / "kimi", kimi=True, hub=True, float_kv_b=True)
    opts = {"activation_quant": "msmodelslim"}
    ref_model, ref = _run(plain, options=opts)
    model, out = _run(kimi, options=opts)
    plan = model.quantplug_plan
    assert plan.prefix == "language_model"
    layouts = [d for d in plan.decisions if d.hook == "quantplug_attention_layout"]
    assert layouts and all(d.value == "dense" and d.plugin.name == "core" for d in layouts)
    schemes = plan.schemes()
    assert schemes["language_model.model.layers.1.self_attn.kv_b_proj"] == "dense"
    assert schemes["language_model.model.layers.1.self_attn.q_a_proj"].startswith("W8A8 ")
    assert rel_err(out, ref) <= 1e-5
    # the FLOAT kv_b changes the logits: against the all-W8A8 fixture they must differ
    assert rel_err(out, REF["vendor_logits"]) > 1e-3


def test_description_key_without_tensor_and_tensor_without_key(tmp_path):
    dst = shutil.copytree(FIX, tmp_path / "c")
    desc = json.loads((dst / "quant_model_description.json").read_text())
    desc["model.layers.9.self_attn.o_proj.weight"] = "W8A8"
    desc.pop("model.layers.0.self_attn.o_proj.quant_bias")
    (dst / "quant_model_description.json").write_text(json.dumps(desc))
    msgs = [p.describe() for p in build_plan(dst).errors]
    assert any("model.layers.9.self_attn.o_proj.weight" in m for m in msgs)
    assert any("model.layers.0.self_attn.o_proj.quant_bias" in m and "no key" in m for m in msgs)


def test_unsupported_type_names_layer(tmp_path):
    dst = shutil.copytree(FIX, tmp_path / "c")
    desc = json.loads((dst / "quant_model_description.json").read_text())
    desc["model.layers.0.self_attn.o_proj.weight"] = "W4A4_MXFP4"
    (dst / "quant_model_description.json").write_text(json.dumps(desc))
    msgs = [p.describe() for p in build_plan(dst).errors]
    assert any("model.layers.0.self_attn.o_proj" in m and "W4A4_MXFP4" in m for m in msgs)


def test_int4_packing_hand_example():
    # rows 0..3 of one column: 1, -2, 7, -8 -> bytes (1 | (-2 & 15) << 4), (7 | (-8 & 15) << 4)
    q = torch.tensor([[1], [-2], [7], [-8]])
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.int8 and packed.shape == (2, 1)
    assert packed.view(torch.uint8).flatten().tolist() == [0x01 | 0xE0, 0x07 | 0x80]
    assert unpack_int4_rows(packed).flatten().tolist() == [1, -2, 7, -8]


def test_dynamic_quant_formulas():
    x = torch.tensor([[-1.0, 0.5, 2.0]])
    q, s, o = dynamic_quant(x, "msmodelslim")
    assert torch.allclose(s, torch.tensor([[3.0 / 255]])) and o.item() == round(-128 + 1.0 / (3.0 / 255))
    q, s, o = dynamic_quant(x, "ascend")
    assert torch.allclose(s, torch.tensor([[2.0 / 127]])) and q.tolist() == [[-64.0, 32.0, 127.0]] and o.item() == 0


def test_export_w8a8_and_w4a8_within_quantization_error(tmp_path):
    from quantplug.testing import random_state, tiny_config, write_checkpoint
    from quantplug_modelslim.export import export_modelslim

    cfg = tiny_config(hidden_size=128, moe_intermediate_size=64, intermediate_size=128)
    dense = quantplug.load(write_checkpoint(tmp_path / "dense", cfg, random_state(cfg, seed=2)))
    ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = dense(ids)
    results = {r.path.name: r for r in export_modelslim(dense, dense.quantplug_plan, tmp_path / "ms",
                                                             {"calibration": [ids]})}
    errs = {}
    for name, res in results.items():
        model = quantplug.load(res.path)
        with torch.no_grad():
            errs[name] = rel_err(model(ids), ref)
        assert model_bytes(model) <= 1.1 * model.quantplug_plan.weight_bytes()
        if name == "w4a8":
            schemes = model.quantplug_plan.schemes()
            assert schemes["model.layers.1.mlp.experts.gate_proj"].startswith("W4A8_DYNAMIC")
            assert schemes["model.layers.1.self_attn.kv_b_proj"] == "dense"
            experts = model.model.layers[1].mlp.experts.gate_proj
            # the int4 weight repacked once into the core's INT4 form (same bytes), the stored one released
            assert experts._int4k.dtype == torch.uint8 and not hasattr(experts, "weight")
    # int8 everywhere is within a few percent; int4 experts cost more but stay bounded
    assert errs["w8a8"] < 0.05 and errs["w4a8"] < 0.25 and errs["w8a8"] < errs["w4a8"]


def test_export_float_dtype_writes_unquantized_tensors_as_a_bfloat16_release_stores_them(tmp_path):
    """``float_dtype="bfloat16"``: FLOAT linears (lm_head, W4A8's kv_b_proj), embeddings and norms
    as BF16, the router's correction bias F32, quantized tensors unchanged; it loads and gives the
    float32 export's logits within bfloat16 rounding."""
    import json
    import struct

    from quantplug.testing import random_state, tiny_config, write_checkpoint
    from quantplug_modelslim.export import export_modelslim

    cfg = tiny_config(hidden_size=128, moe_intermediate_size=64, intermediate_size=128)
    dense = quantplug.load(write_checkpoint(tmp_path / "dense", cfg, random_state(cfg, seed=2)))
    ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    f32, = export_modelslim(dense, dense.quantplug_plan, tmp_path / "f32", {"calibration": [ids], "recipes": ["w4a8"]})
    bf16, = export_modelslim(dense, dense.quantplug_plan, tmp_path / "bf16",
                             {"calibration": [ids], "recipes": ["w4a8"], "float_dtype": "bfloat16"})

    def dtypes(res) -> dict[str, str]:
        with open(res.files[0], "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            return {k: v["dtype"] for k, v in json.loads(fh.read(n)).items() if k != "__metadata__"}

    a, b = dtypes(f32), dtypes(bf16)
    assert b["lm_head.weight"] == b["model.embed_tokens.weight"] == b["model.norm.weight"] == "BF16"
    assert b["model.layers.1.self_attn.kv_b_proj.weight"] == "BF16"
    assert b["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    assert {k for k, v in a.items() if v != b[k]} == {k for k, v in b.items() if v == "BF16"}
    assert all(v == "F32" for k, v in a.items() if b[k] == "BF16")
    with torch.no_grad():
        want = quantplug.load(f32.path)(ids)
        got = quantplug.load(bf16.path)(ids)
    assert 0 < rel_err(got, want) < 2e-2
