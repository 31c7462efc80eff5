"""DeepSeek-V4 GGUFs as llama.cpp's converter writes them (arch ``deepseek4``).

The fixture ``tests/data/vendor/gguf_deepseek4_mxfp4`` is llama.cpp's own converter
(``conversion/deepseek.py`` ``DeepseekV4Model``, llama-cpp-python 0.3.36's tree) run on a tiny
checkpoint in the release's format (FP8 E4M3 dense linears with E8M0 block scales, FP4 routed
experts, BF16 / F32 / I64 elsewhere; ``tests/data/vendor/make_gguf_deepseek4.py``): routed experts
repacked to ggml MXFP4, the FP8 linears dequantized and written Q8_0, the BF16 matrices BF16, 1-D
tensors F32, ``tid2eid`` I32; one sliding-window, one CSA (indexer, top 6 of up to 40 entries) and
one HCA (ratio 128) layer, a hash-routed and two learned MoE layers. Its reference file holds
llama.cpp's own logits (llama-cpp-python 0.3.36) for a 160-token prompt.

References here, none of them quantplug code: gguf-py dequantizes the file and transformers 5.25's
``DeepseekV4ForCausalLM`` runs those weights in float32; the release source the converter read
(regenerated from its seed) decodes the experts by the E2M1 table; llama.cpp's logits.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import quantplug
import torch
from quantplug.errors import PlanError
from quantplug.testing.reference import rel_err

gguf = pytest.importorskip("gguf")


VENDOR = Path(__file__).parents[1] / "data" / "vendor"
FIXTURE = VENDOR / "gguf_deepseek4_mxfp4"
sys.path.insert(0, str(VENDOR))
sys.path.insert(0, str(Path(__file__).parents[1]))
import make_gguf_deepseek4 as maker  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reference() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(VENDOR / "gguf_deepseek4_mxfp4.reference.safetensors"))


@pytest.fixture(scope="module")
def model():
    return quantplug.load(FIXTURE, progress=False)


#: llama.cpp's converter's table (``DeepseekV4Model._map_dsv4_tensor_name`` with gguf-py's
#: TENSOR_NAMES), inverted: GGUF name (``blk.L.`` removed) -> release name (``layers.L.`` removed);
#: written out here, independent of the plugin's own map
CONVERTER = {
    "hc_attn_fn.weight": "hc_attn_fn", "hc_attn_base.weight": "hc_attn_base", "hc_attn_scale.weight": "hc_attn_scale",
    "hc_ffn_fn.weight": "hc_ffn_fn", "hc_ffn_base.weight": "hc_ffn_base", "hc_ffn_scale.weight": "hc_ffn_scale",
    "attn_sinks.weight": "attn.attn_sink", "attn_q_a.weight": "attn.wq_a.weight", "attn_q_b.weight": "attn.wq_b.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight", "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight", "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight", "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight", "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight", "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight", "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight", "ffn_gate_inp.weight": "ffn.gate.weight", "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid", "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight", "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2",
}
CONVERTER_GLOBAL = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
                    "output.weight": "head.weight", "output_hc_fn.weight": "hc_head_fn",
                    "output_hc_base.weight": "hc_head_base", "output_hc_scale.weight": "hc_head_scale"}


@pytest.fixture(scope="module")
def dequantized() -> dict[str, torch.Tensor]:
    """Every tensor of the fixture dequantized by gguf-py, under the release's names (stacked
    experts split per expert as the release stores them)."""
    out: dict[str, torch.Tensor] = {}
    for t in gguf.GGUFReader(str(FIXTURE / "model.gguf")).tensors:
        shape = [int(n) for n in reversed(t.shape.tolist())]
        raw = np.array(t.data) if t.tensor_type == gguf.GGMLQuantizationType.I32 \
            else gguf.quants.dequantize(t.data, t.tensor_type)
        x = torch.from_numpy(np.array(raw).reshape(shape))
        if t.name in CONVERTER_GLOBAL:
            out[CONVERTER_GLOBAL[t.name]] = x.float()
            continue
        _, layer, base = t.name.split(".", 2)
        name = CONVERTER[base]
        if name in ("w1", "w3", "w2"):
            for e in range(x.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.{name}.weight"] = x[e].float().contiguous()
        else:
            out[f"layers.{layer}.{name}"] = x if x.dtype == torch.int32 else x.float()
    return out


def test_plan_keeps_every_ggml_type_packed(model):
    """The converter's types as stored: MXFP4 experts and Q8_0 dense linears packed (their ggml
    blocks, 17 and 34 bytes per 32 values), BF16 matrices BF16, the rest float parameters."""
    plan = model.quantplug_plan
    assert not plan.problems
    by_type: dict[str, set[str]] = {}
    for d in model.decisions:
        if d.hook == "quantplug_linear_scheme" and d.target.startswith("layers."):
            by_type.setdefault(str(d.value), set()).add(d.target.split(".", 2)[-1])
    assert by_type["ggml MXFP4"] == {"ffn.experts.gate_proj", "ffn.experts.up_proj", "ffn.experts.down_proj"}
    assert {"attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
            "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3"} == by_type["ggml Q8_0"]
    assert {"attn.compressor.wkv", "attn.compressor.wgate", "attn.indexer.compressor.wkv",
            "attn.indexer.compressor.wgate"} <= by_type["ggml BF16"]
    sd = dict(model.named_parameters()) | dict(model.named_buffers())
    gate = next(v for k, v in sd.items() if k.endswith("layers.1.ffn.experts.gate_proj.weight"))
    assert gate.dtype == torch.uint8 and tuple(gate.shape) == (8, 32, 64 // 32 * 17)
    wq_b = next(v for k, v in sd.items() if k.endswith("layers.1.attn.wq_b.weight"))
    assert wq_b.dtype == torch.uint8 and tuple(wq_b.shape) == (256, 32 // 32 * 34)
    tid = next(v for k, v in sd.items() if k.endswith("layers.0.ffn.gate.tid2eid"))
    assert tid.dtype in (torch.int32, torch.int64) and tuple(tid.shape) == (maker.V, maker.K)


def test_experts_decode_to_the_release_fp4_values(dequantized):
    """The converter's MXFP4 repack is lossless: gguf-py's decode of every routed expert equals
    the release's FP4 values (E2M1 code times 2^(E8M0 - 127), decoded here from the source the
    converter read, regenerated from its seed); the Q8_0 linears sit within Q8_0's rounding of
    the FP8 source."""
    src = maker.release_state()
    for name, packed in src.items():
        if ".ffn.experts." not in name or not name.endswith(".weight"):
            continue
        codes = packed.view(torch.uint8)
        code = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).long()
        value = maker.E2M1[code & 7] * torch.where(code >= 8, -1.0, 1.0)
        scale = torch.exp2(src[name.removesuffix(".weight") + ".scale"].view(torch.uint8).float() - 127)
        fp4 = value * scale.repeat_interleave(32, -1)
        torch.testing.assert_close(dequantized[name], fp4, rtol=0, atol=0)
    w = src["layers.1.attn.wq_b.weight"].float()
    s = torch.exp2(src["layers.1.attn.wq_b.scale"].view(torch.uint8).float() - 127)
    fp8 = w * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    err = (dequantized["layers.1.attn.wq_b.weight"] - fp8).abs().amax()
    assert 0 < err <= fp8.abs().amax() / 127  # Q8_0: one step of amax / 127 per block, at most


def _tf_state(ref: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (release names) as transformers' state dict of ``ref``."""
    from v4_models import release_names

    out = {}
    for name, p in ref.state_dict().items():
        parts = name.split(".")
        if "experts" in parts and parts[-1] in ("gate_up_proj", "down_proj"):
            base = f"layers.{parts[2]}.ffn.experts"
            if parts[-1] == "gate_up_proj":
                out[name] = torch.stack([torch.cat([tensors[f"{base}.{e}.w1.weight"], tensors[f"{base}.{e}.w3.weight"]])
                                         for e in range(p.shape[0])])
            else:
                out[name] = torch.stack([tensors[f"{base}.{e}.w2.weight"] for e in range(p.shape[0])])
            continue
        (release,) = release_names({name: p}).keys()
        # hash layers: the converter drops gate.bias (llama.cpp routes them by tid2eid alone)
        out[name] = tensors[release].to(p.dtype) if release in tensors else torch.zeros_like(p)
    return out


def test_logits_equal_transformers_on_the_dequantized_tensors(model, dequantized, tmp_path):
    """quantplug on the GGUF (MXFP4 / Q8_0 / BF16 blocks as stored) against transformers 5.25's
    DeepseekV4ForCausalLM on gguf-py's dequantization of the same file, and against quantplug's
    float V4 loading those dequantized tensors from safetensors: all within 1e-5."""
    from quantplug.testing import write_checkpoint

    ids = maker.prompt()
    with torch.no_grad():
        ours = model(ids)
        ref = maker.reference_model()
        ref.load_state_dict(_tf_state(ref, dequantized))
        tf = ref(ids).logits
        flt = quantplug.load(write_checkpoint(tmp_path / "f", json.loads((FIXTURE / "config.json").read_text()),
                                              dequantized), progress=False)(ids)
    assert rel_err(ours, tf) < 1e-5 and (ours - tf).abs().max() < 1e-4
    assert rel_err(ours, flt) < 1e-5
    # the indexer's selection decides: keeping every CSA entry gives other logits
    indexer = model.layers[1].attn.indexer
    topk, indexer.topk = indexer.topk, 1 << 20
    try:
        with torch.no_grad():
            assert rel_err(model(ids), ours) > 1e-2
    finally:
        indexer.topk = topk


def test_llama_cpp_logits(model):
    """llama.cpp's own logits (stored; llama-cpp-python 0.3.36) on the same file. Its CPU kernels
    round activations to Q8_0 blocks before every Q8_0 / MXFP4 product (bf16 before BF16 ones), so
    quantplug's exact logits sit ~1% from them per position (measured: median 1.02%, 7 of 160
    positions above 5%, at most 12.1%; 97-99% equal argmax), as one prompt batch or one token per
    decode alike. On the all-F32 copy of the file (every tensor dequantized by
    gguf-py: the same values) nothing is rounded and they agree to float32 accumulation order
    (measured 3.8e-7): llama.cpp's deepseek4 graph and quantplug compute the same function,
    indexer selection, compressed entries, hash routing and mHC included."""
    ref = _reference()
    ids = ref["input_ids"]
    assert torch.equal(ids, maker.prompt())
    with torch.no_grad():
        ours = model(ids)
    assert rel_err(ours, ref["llama_cpp_f32_prompt"]) < 2e-6
    for key in ("llama_cpp_prompt", "llama_cpp_steps"):
        theirs = ref[key].float()
        per_pos = ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1))[0]
        assert per_pos.median() < 0.03 and per_pos.max() < 0.25, (key, per_pos.median(), per_pos.max())
        assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.95


def _rewrite(dst: Path, change: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
             arch: str | None = None) -> Path:
    """A copy of the fixture with metadata keys changed (same value type) or tensors dropped."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURE / "config.json", dst / "config.json")
    r = gguf.GGUFReader(str(FIXTURE / "model.gguf"))
    w = gguf.GGUFWriter(str(dst / "model.gguf"), arch or "deepseek4")
    change = change or {}
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = change.get(key, f.contents())
        if arch is not None and key.startswith("deepseek4."):
            key = arch + key[len("deepseek4"):]
        if value is not None:
            w.add_key_value(key, value, f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize(("key", "value", "field"), [
    ("deepseek4.attention.compress_ratios", [0, 4, 4, 0], "compress_ratios"),
    ("deepseek4.attention.sliding_window", 128, "sliding_window"),
    ("deepseek4.hyper_connection.count", 2, "hc_mult"),
    ("deepseek4.hyper_connection.sinkhorn_iterations", 10, "hc_sinkhorn_iters"),
    ("deepseek4.hash_layer_count", 2, "num_hash_layers"),
    ("deepseek4.attention.indexer.top_k", 512, "index_topk"),
    ("deepseek4.attention.output_group_count", 4, "o_groups"),
    ("deepseek4.swiglu_clamp_exp", [10.0, 10.0, 10.0], "swiglu_limit"),
    ("deepseek4.expert_weights_scale", 2.5, "routed_scaling_factor"),
    ("deepseek4.attention.compress_rope_freq_base", 10000.0, "compress_rope_theta"),
    ("deepseek4.rope.scaling.factor", 4.0, "rope_scaling.factor"),
    ("deepseek4.expert_gating_func", 2, "scoring_func"),
    ("deepseek4.attention.head_count", 8, "num_attention_heads"),
    ("deepseek4.attention.key_length", 128, "head_dim"),
])
def test_metadata_contradicting_config_is_refused_naming_the_key(tmp_path, key, value, field):
    root = _rewrite(tmp_path / "m", {key: value})
    with pytest.raises(PlanError) as e:
        quantplug.plan(root)
    msg = str(e.value)
    assert key in msg and field in msg and "model.gguf" in msg, msg


def test_required_metadata_absent_is_refused(tmp_path):
    root = _rewrite(tmp_path / "m", {"deepseek4.hyper_connection.count": None})
    with pytest.raises(PlanError, match=r"deepseek4\.hyper_connection\.count is absent"):
        quantplug.plan(root)


def test_architecture_mismatch_is_refused(tmp_path):
    """A deepseek4 file under another config, and a V4 config over a deepseek2 file."""
    root = _rewrite(tmp_path / "v3", arch="deepseek2")
    with pytest.raises(PlanError, match=r"general.architecture is 'deepseek2' but config.json is "
                                        r"DeepseekV4ForCausalLM; expected 'deepseek4'"):
        quantplug.plan(root)


def test_deepseek4_file_under_another_config_is_refused(tmp_path):
    from quantplug.testing import tiny_config

    root = tmp_path / "v3"
    root.mkdir()
    shutil.copy(FIXTURE / "model.gguf", root / "model.gguf")
    (root / "config.json").write_text(json.dumps(tiny_config(vocab_size=maker.V)))
    with pytest.raises(PlanError, match=r"general.architecture is 'deepseek4' but config.json is "
                                        r"DeepseekV3ForCausalLM; expected DeepseekV4ForCausalLM"):
        quantplug.plan(root)


def test_experts_served_from_the_gguf_through_the_cache(model):
    """``expert_cache_mb``: the MXFP4 experts read from the GGUF on demand, the same logits."""
    ids = maker.prompt()[:, :40]
    cached = quantplug.load(FIXTURE, progress=False, options={"expert_cache_mb": 0.02})

    def held(m: Any) -> int:
        e = m.layers[1].ffn.experts
        return len(list(e.parameters())) + len(list(e.buffers()))

    assert held(cached) == 0 and held(model) > 0  # served from the file, not loaded
    with torch.no_grad():
        torch.testing.assert_close(cached(ids), model(ids), rtol=0, atol=1e-6)


def test_missing_tensor_is_named_by_its_llama_cpp_name(tmp_path):
    root = _rewrite(tmp_path / "m", drop=("blk.1.indexer_compressor_kv.weight", "blk.0.ffn_gate_tid2eid.weight"))
    with pytest.raises(PlanError) as e:
        quantplug.plan(root)
    assert "blk.1.indexer_compressor_kv.weight" in str(e.value) and "blk.0.ffn_gate_tid2eid.weight" in str(e.value)


def test_cached_decode_equals_the_prompt(model):
    """Prefill of 120 tokens then one token at a time through the HCA boundary (128) equals the
    prompt's logits, on the packed weights."""
    from quantplug.generate import new_cache

    ids = maker.prompt()[:, :136]
    with torch.no_grad():
        full = model(ids)
        cache = new_cache(model, 1, 136)
        first = model(ids[:, :120], cache=cache)
        steps = [model.next_logits(ids[:, i:i + 1], cache) for i in range(120, 136)]
    torch.testing.assert_close(first, full[:, :120], rtol=0, atol=2e-5)
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 120:], rtol=0, atol=2e-5)


def test_export_writes_llama_cpp_layout_and_loads_back(model, tmp_path):
    """The plugin's exporter on the loaded fixture: a deepseek4 GGUF with llama.cpp's converter's
    names, types and metadata. Every tensor's type and shape equal the converter's; BF16, F32 and
    I32 tensors are byte-identical, MXFP4 experts decode to the same values (gguf-py's quantizer
    may give a block whose largest code is 3 the next lower exponent), Q8_0 ones are re-quantized
    from their own dequantization; every deepseek4 metadata key has the converter's value. The
    export and its expert-pack copy load back to the fixture's logits."""
    from quantplug.plugins import get_plugin_manager

    results = get_plugin_manager().export("expert_pack", model=model, destination=tmp_path / "out",
                                          plan=model.quantplug_plan)
    plain, packed = (r.path for r in results)
    ours = gguf.GGUFReader(str(plain / "model.gguf"))
    theirs = gguf.GGUFReader(str(FIXTURE / "model.gguf"))
    mine = {t.name: t for t in ours.tensors}
    assert set(mine) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        o = mine[t.name]
        assert o.tensor_type == t.tensor_type and list(o.shape) == list(t.shape), t.name
        if t.tensor_type == gguf.GGMLQuantizationType.MXFP4:  # same values (a block may take another exponent)
            assert np.array_equal(gguf.quants.dequantize(o.data, o.tensor_type),
                                  gguf.quants.dequantize(t.data, t.tensor_type)), t.name
        elif t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            assert np.array_equal(np.array(o.data), np.array(t.data)), t.name
    keys = [k for k in theirs.fields if k.startswith("deepseek4.")]
    for k in keys:
        assert k in ours.fields, k
        a, b = ours.fields[k].contents(), theirs.fields[k].contents()
        if isinstance(b, str):
            assert a == b, k
            continue
        assert np.allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=1e-7), (k, a, b)
    ids = maker.prompt()[:, :40]
    with torch.no_grad():
        ref = model(ids)
        for p in (plain, packed):
            assert rel_err(quantplug.load(p, progress=False)(ids), ref) < 1e-5
    assert (packed / "experts.qpack").is_file()


@pytest.mark.skipif(not os.environ.get("QUANTPLUG_LLAMA_CPP"),
                    reason="QUANTPLUG_LLAMA_CPP (a llama.cpp tree with its converter) not set")
def test_fixture_is_the_converters_output(tmp_path):
    """llama.cpp's converter on the regenerated release source writes the fixture byte for byte."""
    src = maker.write_source(tmp_path / "src")
    maker.convert(Path(os.environ["QUANTPLUG_LLAMA_CPP"]), src, tmp_path / "model.gguf")
    assert (tmp_path / "model.gguf").read_bytes() == (FIXTURE / "model.gguf").read_bytes()
