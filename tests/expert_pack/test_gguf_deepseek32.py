"""DeepSeek-V3.2 GGUFs as llama.cpp's converter writes them (arch ``deepseek32``).

``conversion/deepseek.py`` (``DeepseekV32Model``, llama-cpp-python 0.3.36's vendored llama.cpp)
writes the V3 tensors with ``kv_b`` split into ``attn_k_b`` / ``attn_v_b``, the lightning indexer
as ``blk.N.indexer.{attn_q_b, attn_k, k_norm (weight + bias), proj}`` (``proj`` = weights_proj and
the LayerNorm kept F32), the MTP block, and ``deepseek32.attention.indexer.{head_count,
key_length, top_k}``. The reference is independent of quantplug: gguf-py dequantizes the file,
transformers' ``DeepseekV32ForCausalLM`` runs it in float32. ``index_topk`` (5) is smaller than the
prompt (16), so the indexer's selection decides what every query attends to (checked below).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import quantplug
import torch
from quantplug.errors import PlanError
from quantplug.models.config import parse_model_config
from quantplug.plan import build_plan
from quantplug.testing import formats, random_state, tiny_config
from quantplug.testing.reference import hf_model

pytest.importorskip("gguf")

from quantplug_expert_pack.export import gguf_state, write_gguf  # noqa: E402
from quantplug_expert_pack.testing import reference_state  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import rel_err  # noqa: E402

TOPK = 5
CFG = tiny_config(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", q_lora_rank=64,
                  qk_nope_head_dim=32, qk_rope_head_dim=32, index_n_heads=8, index_head_dim=48, index_topk=TOPK)
MC = parse_model_config(CFG, "DeepseekV32ForCausalLM", False)
STATE = random_state(CFG, seed=7)
IDS = torch.randint(0, CFG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
STEPS = 8
INDEXER = ("wq_b", "wk", "k_norm", "weights_proj")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _quantized(root: Path, default: str, types: dict[str, str] | None = None, raw=None) -> Path:
    """config.json + a deepseek32 GGUF written by the plugin's writer (gguf-py's quantizer)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CFG))
    tensors = gguf_state(STATE, MC)
    if raw:
        for name in raw:
            tensors.pop(name)
    write_gguf(root / "model.gguf", tensors, MC, default_type=default, types=types or {}, raw=raw)
    return root


@pytest.fixture(scope="module")
def f32_dir(tmp_path_factory):
    return formats.gguf(tmp_path_factory.mktemp("v32") / "f32", CFG, STATE)


def _hf_greedy(hf, ids):
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        logits = [out.logits[:, -1]]
        for _ in range(STEPS):
            out = hf(logits[-1].argmax(-1, keepdim=True), cache=out.cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.cat([ids, torch.stack([x.argmax(-1) for x in logits[:STEPS]], dim=1)], dim=1)


def _check_against_reference(root: Path, ref_state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    """quantplug's logits and greedy tokens against transformers on ``ref_state``; returns the logits
    and their relative error."""
    model = quantplug.load(root, progress=False)
    hf = hf_model(CFG, ref_state)
    with torch.no_grad():
        ours, ref = model(IDS), hf(IDS).logits
    err = rel_err(ours, ref)
    assert err <= 1e-5
    assert torch.equal(model.generate(IDS, STEPS, eos_token_id=None), _hf_greedy(hf, IDS))
    return ours, err


def test_f32_file_plans_llama_cpp_names_and_matches_transformers(f32_dir):
    from gguf import GGUFReader

    r = GGUFReader(f32_dir / "model.gguf")
    assert r.fields["general.architecture"].contents() == "deepseek32"
    assert r.fields["deepseek32.attention.indexer.top_k"].contents() == TOPK
    stored = {t.name for t in r.tensors}
    for t in ("attn_q_b", "attn_k", "k_norm", "proj"):
        assert f"blk.1.indexer.{t}.weight" in stored
    assert "blk.1.indexer.k_norm.bias" in stored and "blk.1.attn_k_b.weight" in stored
    assert not any("kv_b" in n for n in stored)  # llama.cpp's deepseek32 loader requires split K/V

    model = quantplug.load(f32_dir, progress=False)
    plan = model.quantplug_plan
    assert plan.backend == "expert_pack" and not plan.problems
    assert set(plan.to_dict()["attention_layouts"].values()) == {"split_kv"}
    labels = {p.param: p.sources[0][1].label for p in plan.params}
    assert labels["model.layers.2.self_attn.indexer.wk.weight"] == (
        "blk.2.indexer.attn_k.weight (as model.layers.2.self_attn.indexer.wk.weight)")
    assert labels["model.layers.2.self_attn.indexer.k_norm.bias"].startswith("blk.2.indexer.k_norm.bias")
    assert labels["model.layers.2.self_attn.indexer.weights_proj.weight"].startswith("blk.2.indexer.proj.weight")
    ix = model.model.layers[0].self_attn.indexer
    assert ix.weights_proj.weight.dtype == torch.float32 and ix.k_norm.bias.dtype == torch.float32
    with torch.no_grad():
        ours = model(IDS)
    ref = hf_model(CFG, STATE)
    with torch.no_grad():
        assert rel_err(ours, ref(IDS).logits) <= 1e-5
    assert torch.equal(model.generate(IDS, STEPS, eos_token_id=None), _hf_greedy(ref, IDS))
    # the selection matters: every key kept (dense MLA) gives other logits
    for layer in model.model.layers:
        layer.self_attn.indexer.topk = 1 << 20
    with torch.no_grad():
        assert rel_err(model(IDS), ref(IDS).logits) > 1e-3


@pytest.mark.parametrize("default,types", [
    ("Q8_0", {}),
    ("Q4_0", {"indexer.attn_q_b": "Q8_0", "token_embd": "Q4_0"}),
])
def test_quantized_file_matches_transformers_on_gguf_py_weights(tmp_path, f32_dir, default, types):
    root = _quantized(tmp_path / default, default, types)
    ours, _ = _check_against_reference(root, reference_state(root, MC))
    plan = quantplug.plan(root)
    schemes = plan.to_dict()["schemes"]
    assert schemes["model.layers.1.self_attn.indexer.wk"] == f"ggml {default}"
    assert schemes["model.layers.1.self_attn.indexer.wq_b"] == f"ggml {types.get('indexer.attn_q_b', default)}"
    dtypes = {t.stored_name: t.dtype for t in plan.checkpoint.tensors.values()}
    assert dtypes["blk.1.indexer.proj.weight"] == "F32" and dtypes["blk.1.indexer.k_norm.bias"] == "F32"
    # the quantization is real: the F32 file's logits are elsewhere
    with torch.no_grad():
        f32 = quantplug.load(f32_dir, progress=False)(IDS)
    assert rel_err(ours, f32) > 1e-4


def test_missing_indexer_tensor_is_named_at_plan_time(tmp_path):
    state = {k: v for k, v in STATE.items() if k != "model.layers.1.self_attn.indexer.wk.weight"}
    root = formats.gguf(tmp_path / "c", CFG, state)
    with pytest.raises(PlanError, match=r"blk\.1\.indexer\.attn_k\.weight"):
        quantplug.load(root, progress=False)


def test_metadata_contradicting_config_is_a_plan_problem(tmp_path):
    root = formats.gguf(tmp_path / "c", CFG, STATE)
    (root / "config.json").write_text(json.dumps({**CFG, "index_topk": 7}))
    msgs = [p.message for p in build_plan(root).problems]
    assert any("deepseek32.attention.indexer.top_k = 5" in m and "index_topk = 7" in m for m in msgs), msgs
    with pytest.raises(PlanError, match="index_topk = 7"):
        quantplug.load(root, progress=False)


def test_architecture_contradicting_config_is_a_plan_problem(tmp_path):
    root = formats.gguf(tmp_path / "c", CFG, STATE)
    v3 = {**{k: v for k, v in CFG.items() if not k.startswith("index")}, "architectures": ["DeepseekV3ForCausalLM"],
          "model_type": "deepseek_v3"}
    (root / "config.json").write_text(json.dumps(v3))
    msgs = [p.message for p in build_plan(root).problems]
    assert any("'deepseek32' but config.json is DeepseekV3ForCausalLM" in m for m in msgs), msgs
    # and a V3.2 config beside a deepseek2 file (no indexer tensors)
    root2 = formats.gguf(tmp_path / "v3", v3, random_state(v3))
    (root2 / "config.json").write_text(json.dumps(CFG))
    msgs = [p.message for p in build_plan(root2).problems]
    assert any("'deepseek2' but config.json is DeepseekV32ForCausalLM" in m and "'deepseek32'" in m for m in msgs)


def test_quantized_weights_proj_is_refused_by_name(tmp_path):
    """The converter writes indexer.proj F32; llama-quantize would quantize a 2-D proj unless told
    not to. quantplug holds weights_proj as a float32 parameter: the plan refuses it by name."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    name = "blk.2.indexer.proj.weight"
    w = STATE["model.layers.2.self_attn.indexer.weights_proj.weight"].numpy()
    root = _quantized(tmp_path / "c", "Q8_0", raw={name: (quantize(w, GGMLQuantizationType.Q8_0), "Q8_0")})
    plan = build_plan(root)
    ours = [p for p in plan.problems if p.tensor and p.tensor.startswith(name) and "weights_proj.weight as a float" in p.message]
    assert len(ours) == 1 and ours[0].message.startswith("Q8_0") and "--tensor-type indexer.proj=f32" in ours[0].message
    with pytest.raises(PlanError, match=r"blk\.2\.indexer\.proj\.weight"):
        quantplug.load(root, progress=False)


def test_mtp_block_with_its_indexer_loads_and_speculates_like_greedy(tmp_path):
    """The converter keeps V3.2's MTP block (blk.3: nextn.* plus a whole DSA block, indexer included)
    and counts it in block_count with nextn_predict_layers = 1."""
    cfg = {**CFG, "num_nextn_predict_layers": 1}
    root = formats.gguf(tmp_path / "mtp", cfg, random_state(cfg, seed=12, mtp=True))
    from gguf import GGUFReader

    r = GGUFReader(root / "model.gguf")
    assert r.fields["deepseek32.block_count"].contents() == 4
    assert r.fields["deepseek32.nextn_predict_layers"].contents() == 1
    m = quantplug.load(root, progress=False)
    assert not m.quantplug_plan.problems
    assert m.mtp[0].block.self_attn.indexer is not None
    labels = {p.param: p.sources[0][1].label for p in m.quantplug_plan.params}
    assert labels["mtp.0.block.self_attn.indexer.wk.weight"].startswith("blk.3.indexer.attn_k.weight")
    prompt = IDS[:1, :8]
    plain = m.generate(prompt, 12, eos_token_id=None)
    spec = m.generate(prompt, 12, eos_token_id=None, speculative="mtp")
    assert torch.equal(plain, spec)


def test_export_writes_deepseek32_and_its_expert_pack_loads(f32_dir, tmp_path):
    """The plugin's exporter on a loaded V3.2: a Q8_0 deepseek32 GGUF (attn_k_b Q4_0, indexer.proj
    F32) and a copy with the routed experts in an expert pack; both load and match transformers on
    gguf-py's dequantization of the exported file."""
    from gguf import GGUFReader
    from quantplug.plugins import get_plugin_manager

    model = quantplug.load(f32_dir, progress=False)
    results = get_plugin_manager().export("expert_pack", model=model, destination=tmp_path / "out",
                                          plan=model.quantplug_plan)
    plain, packed = (r.path for r in results)
    r = GGUFReader(plain / "model.gguf")
    assert r.fields["general.architecture"].contents() == "deepseek32"
    assert r.fields["deepseek32.attention.indexer.head_count"].contents() == CFG["index_n_heads"]
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.1.indexer.attn_k.weight"] == "Q8_0" and types["blk.1.indexer.proj.weight"] == "F32"
    assert types["blk.1.indexer.k_norm.bias"] == "F32"
    hf = hf_model(CFG, reference_state(plain, MC))
    with torch.no_grad():
        ref = hf(IDS).logits
        outs = [quantplug.load(p, progress=False)(IDS) for p in (plain, packed)]
    assert rel_err(outs[0], ref) <= 1e-5 and rel_err(outs[1], ref) <= 1e-5
    assert (packed / "experts.qpack").is_file()
