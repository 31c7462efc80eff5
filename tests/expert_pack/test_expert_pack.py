"""GGUF checkpoints (llama.cpp deepseek2 layout) and expert packs, end to end.

The reference is independent of quantplug: gguf-py dequantizes the GGUF, transformers'
DeepseekV3ForCausalLM runs the result (kv_b rebuilt from attn_k_b / attn_v_b).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import quantplug
import torch
from quantplug import experts
from quantplug.api import dense_state, stats_sources
from quantplug.checkpoint.gguf_index import read_gguf_header
from quantplug.cli import main
from quantplug.errors import CheckpointError, LoadError, PlanError
from quantplug.models.config import parse_model_config
from quantplug.testing import random_state, tiny_config, wrap_kimi
from quantplug_expert_pack.build import build_pack
from quantplug_expert_pack.export import gguf_state, write_gguf
from quantplug_expert_pack.pack import HEADER_SIZE, PACK_NAME, ExpertPack
from quantplug_expert_pack.testing import random_rows, reference_state

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import VENDOR, hf_logits, rel_err  # noqa: E402

# moe_intermediate_size 256 so the routed experts' down projection can be a K-quant (256-blocks)
CFG = tiny_config(moe_intermediate_size=256, q_lora_rank=64)
MC = parse_model_config(CFG, "DeepseekV3ForCausalLM", False)
IDS = torch.randint(0, CFG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
TYPES = {"attn_k_b": "Q4_0", "attn_v_b": "Q5_0", "attn_q_b": "Q4_1", "attn_output": "Q5_1",
         "ffn_gate_exps": "MXFP4", "ffn_up_exps": "Q8_0", "output": "Q8_0", "token_embd": "Q5_1"}


def write_tiny_gguf(root: Path, cfg=CFG, *, split_kv=True, types=TYPES, k_quants=True, config=None) -> Path:
    """config.json + model.gguf with mixed ggml types; ffn_down_exps as random Q4_K / Q6_K blocks."""
    mc = parse_model_config(cfg, cfg["architectures"][0], "text_config" in cfg)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or cfg))
    state = random_state(cfg.get("text_config", cfg))
    tensors = gguf_state(state, mc, split_kv=split_kv)
    raw = {}
    if k_quants:
        rng = np.random.default_rng(0)
        for i in range(mc.num_hidden_layers):
            name = f"blk.{i}.ffn_down_exps.weight"
            if name in tensors:
                t = tensors.pop(name)
                raw[name] = (random_rows("Q4_K" if i % 2 else "Q6_K", tuple(t.shape), rng, scale=2e-4),
                             "Q4_K" if i % 2 else "Q6_K")
    write_gguf(root / "model.gguf", tensors, mc, default_type="Q8_0", types=types, vocab=cfg.get("vocab_size"),
               raw=raw)
    return root


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    root = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "ckpt")
    ref = hf_logits(CFG, reference_state(root, MC), IDS)
    return root, ref


def _logits(path, **kw):
    model = quantplug.load(path, progress=False, **kw)
    with torch.no_grad():
        return model, model(IDS)


def test_gguf_loads_and_matches_transformers_on_gguf_py_weights(gguf_dir):
    root, ref = gguf_dir
    model, out = _logits(root)
    assert rel_err(out, ref) <= 1e-5
    plan = model.quantplug_plan
    assert plan.backend == "expert_pack" and not plan.problems
    d = plan.to_dict()
    assert d["attention_layouts"]["model.layers.0.self_attn"] == "split_kv"
    assert d["schemes"]["model.layers.0.self_attn.k_b_proj"] == "ggml Q4_0"
    assert d["schemes"]["model.layers.1.mlp.experts.down_proj"] == "ggml Q4_K"
    assert d["schemes"]["model.layers.2.mlp.experts.down_proj"] == "ggml Q6_K"
    assert d["schemes"]["model.embed_tokens"] == "ggml Q5_1"  # quantized token_embd: rows dequantized on lookup
    # quantized weights stay packed: uint8 blocks, zero-copy views of the mapped file
    kb = model.model.layers[0].self_attn.k_b.weight
    assert kb.dtype == torch.uint8 and tuple(kb.shape) == (4, 32, 18)
    names = {d["target"]: d["value"] for d in d["decisions"] if d["hook"] == "quantplug_tensor_names"}
    assert names["*"].startswith(f"{len(plan.checkpoint.tensors)} of")


def test_legacy_attn_kv_b_is_dense_layout_and_matches(tmp_path):
    root = write_tiny_gguf(tmp_path / "legacy", split_kv=False, types={"attn_kv_b": "Q8_0"}, k_quants=False)
    ref = hf_logits(CFG, reference_state(root, MC), IDS)
    model, out = _logits(root)
    assert rel_err(out, ref) <= 1e-5
    layouts = model.quantplug_plan.to_dict()["attention_layouts"]
    assert set(layouts.values()) == {"dense"}


def test_expert_pack_build_then_load_matches(gguf_dir, tmp_path):
    src, ref = gguf_dir
    root = tmp_path / "packed"
    shutil.copytree(src, root)
    before = (root / "model.gguf").stat().st_size
    res = build_pack(root, progress=False)
    assert res.layers == 2 and res.experts == 8 and res.entries == 48
    assert (root / "model.gguf").stat().st_size < before - res.moved_bytes * 0.9
    pack = ExpertPack(root / PACK_NAME)
    assert all(pack.entry(1, e, r).offset % 4096 == 0 for e in range(8) for r in ("gate_proj", "up_proj", "down_proj"))
    plan = quantplug.plan(root)
    # the pack's payloads are the checkpoint's per-expert GGUF tensors, under their slab's name
    info = plan.checkpoint.tensors["model.layers.1.mlp.experts.5.down_proj.weight"]
    assert (info.stored_name, info.file.name, info.dtype, info.shape) == (
        "blk.1.ffn_down_exps.weight[5]", PACK_NAME, "Q4_K", (64, 256))
    assert {d.value for d in plan.decisions if d.hook == "expert_layout"} == {"hub"}
    budget_mb = 1.5 * experts.step_bytes(plan) / (1 << 20)  # a step and a half: far below the 16 experts' total
    model, out = _logits(root, options={"expert_cache_mb": budget_mb})
    assert rel_err(out, ref) <= 1e-5
    stats = stats_sources(model)["expert_cache"].stats()
    assert stats["evictions"] > 0 and stats["peak_bytes"] <= stats["budget_bytes"]
    assert model.quantplug_plan.to_dict()["schemes"]["model.layers.1.mlp.experts.down_proj"] == "ggml Q4_K"
    _, in_memory = _logits(root)
    assert torch.equal(in_memory, out)


def test_corrupt_pack_payload_fails_on_first_read_naming_entry(gguf_dir, tmp_path):
    root = tmp_path / "corrupt"
    shutil.copytree(gguf_dir[0], root)
    build_pack(root, progress=False)
    pack = ExpertPack(root / PACK_NAME)
    entry = pack.entry(2, 5, "up_proj")
    with open(root / PACK_NAME, "r+b") as fh:
        fh.seek(entry.offset + 3)
        b = fh.read(1)
        fh.seek(entry.offset + 3)
        fh.write(bytes([b[0] ^ 0xFF]))
    want = r"experts\.qpack: tensor blk\.2\.ffn_up_exps\.weight expert 5: checksum mismatch in layer 2 expert 5 up_proj"
    quantplug.plan(root)  # the index is intact: plans
    with pytest.raises(CheckpointError, match=want):  # in memory: while loading
        quantplug.load(root, progress=False)
    model = quantplug.load(root, progress=False, options={"expert_cache_mb": 1})  # served: nothing read yet
    with pytest.raises(CheckpointError, match=want):  # the first read of that expert
        dense_state(model)


def test_truncated_or_foreign_pack_is_a_plan_time_error(gguf_dir, tmp_path):
    root = tmp_path / "trunc"
    shutil.copytree(gguf_dir[0], root)
    build_pack(root, progress=False)
    pack_path = root / PACK_NAME
    data = pack_path.read_bytes()
    pack_path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"experts\.qpack: truncated expert pack: entry layer 2 expert 7 "
                                              r"down_proj \(Q6_K \[64, 256\]\) at offset \d+ and 0 after it lie"):
        quantplug.plan(root)
    pack_path.write_bytes(data[:HEADER_SIZE + 10])
    with pytest.raises(CheckpointError, match="truncated"):
        quantplug.plan(root)
    bad = bytearray(data)
    bad[HEADER_SIZE + 5] ^= 1  # inside the index
    pack_path.write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match="index checksum mismatch"):
        quantplug.plan(root)
    pack_path.unlink()
    with pytest.raises(CheckpointError, match="moved to experts.qpack .* is missing"):
        quantplug.plan(root)


def test_v1_pack_is_storage_of_the_checkpoint_checked_like_its_other_files(gguf_dir, tmp_path):
    """The pack follows the core's pack protocol; its file is one of those the loader checks for
    changes between plan and load (a pack rebuilt or replaced meanwhile is a LoadError naming it)."""
    from quantplug.api import qpack
    from quantplug.loader import execute
    from quantplug.plan import build_plan

    root = tmp_path / "changed"
    shutil.copytree(gguf_dir[0], root)
    build_pack(root, progress=False)
    pack = ExpertPack(root / PACK_NAME)
    assert isinstance(pack, qpack.Pack) and len(pack.tensors()) == 48
    i = pack.payload_at(pack.entry(2, 3, "down_proj").offset + 5)
    assert pack.payload_span(i) == (pack.entry(2, 3, "down_proj").offset, pack.entry(2, 3, "down_proj").size)
    plan = build_plan(root, options={"expert_cache_mb": 1})
    data = (root / PACK_NAME).read_bytes()
    (root / PACK_NAME).unlink()
    (root / PACK_NAME).write_bytes(data)  # the same bytes, a new file: not the one the plan read
    with pytest.raises(LoadError, match=r"experts\.qpack: changed since the plan was made \((replaced|rewritten)"):
        execute(plan, progress=False)


def test_cache_budget_below_one_step_is_a_plan_problem(gguf_dir, tmp_path):
    root = tmp_path / "small"
    shutil.copytree(gguf_dir[0], root)
    build_pack(root, progress=False)
    with pytest.raises(PlanError, match="holds less than one step's routed experts of a layer"):
        quantplug.plan(root, options={"expert_cache_mb": 0.001})


def _k3(tmp_path, k_b_type, arch="KimiK3ForConditionalGeneration"):
    cfg = tiny_config(moe_intermediate_size=64, mla_use_output_gate=True)
    wrapped, _ = wrap_kimi(cfg, {}, arch, vision=False)
    root = tmp_path / f"k3-{k_b_type}"
    return write_tiny_gguf(root, wrapped, types={"attn_k_b": k_b_type}, k_quants=False), wrapped


def test_kimi_k3_gguf_with_output_gate_matches(tmp_path):
    root, wrapped = _k3(tmp_path, "Q4_0", "KimiK25ForConditionalGeneration")
    text = wrapped["text_config"]
    mc = parse_model_config(wrapped, "KimiK25ForConditionalGeneration", True)
    state = reference_state(root, mc)
    assert "model.layers.0.self_attn.g_proj.weight" in state  # stored as blk.0.attn_gate
    model, out = _logits(root)
    # transformers has no K3 gate: compare against quantplug's dense path on the same weights
    dense = tmp_path / "k3-dense"
    from quantplug.testing import write_checkpoint

    write_checkpoint(dense, wrapped, {f"language_model.{k}": v for k, v in state.items()})
    _, ref = _logits(dense)
    assert rel_err(out, ref) <= 1e-5
    assert text["mla_use_output_gate"]


def test_metadata_contradicting_config_is_a_problem(tmp_path):
    bad_cfg = dict(CFG, num_experts_per_tok=3)
    root = write_tiny_gguf(tmp_path / "meta", config=bad_cfg, k_quants=False)
    with pytest.raises(PlanError, match=r"deepseek2\.expert_used_count = 2 contradicts config\.json num_experts_per_tok = 3"):
        quantplug.plan(root)


@pytest.mark.parametrize("name", ["gguf_iq4_nl_dsv3", "gguf_kimi_linear_q8_0"])
def test_head_count_contradicting_config_is_a_problem(tmp_path, name):
    # llama.cpp writes {arch}.attention.head_count (gguf-py Keys.Attention.HEAD_COUNT); a file saying
    # 2 heads under a config.json saying 10 is named as such, not only by the shapes it breaks
    root = tmp_path / name
    shutil.copytree(VENDOR / name, root)
    cfg = json.loads((root / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["num_attention_heads"] = 10
    (root / "config.json").write_text(json.dumps(cfg))
    arch = "deepseek2" if "dsv3" in name else "kimi-linear"
    with pytest.raises(PlanError, match=rf"{arch}\.attention\.head_count = 2 contradicts config\.json "
                                        r"num_attention_heads = 10"):
        quantplug.plan(root)


@pytest.mark.parametrize("value,want", [
    ("false", "deepseek2.expert_weights_norm = 'false': expected a boolean"),
    (1, "deepseek2.expert_weights_norm = 1: expected a boolean"),
    (False, "deepseek2.expert_weights_norm = False contradicts config.json norm_topk_prob = True"),
    (True, None),
])
def test_expert_weights_norm_must_be_a_boolean_equal_to_the_config(value, want):
    # a string 'false' is truthy: it must not pass for the boolean key
    from quantplug_expert_pack import _check_norm

    msgs = [p.message for p in _check_norm({"deepseek2.expert_weights_norm": value}, "deepseek2",
                                          SimpleNamespace(norm_topk_prob=True), "model.gguf")]
    assert msgs == ([] if want is None else [f"GGUF {want}"])


def test_missing_gguf_tensor_is_named_by_its_llama_cpp_name(gguf_dir, tmp_path):
    from gguf import GGUFReader

    src = gguf_dir[0]
    reader = GGUFReader(src / "model.gguf")
    mc = MC
    tensors = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors if t.tensor_type.name in ("F32", "F16")}
    root = tmp_path / "missing"
    root.mkdir()
    shutil.copy(src / "config.json", root)
    raw = {t.name: (np.array(t.data), t.tensor_type.name) for t in reader.tensors
           if t.tensor_type.name not in ("F32", "F16") and t.name != "blk.1.attn_v_b.weight"}
    write_gguf(root / "model.gguf", {k: v.float() for k, v in tensors.items()}, mc, raw=raw)
    with pytest.raises(PlanError, match=r"blk\.1\.attn_v_b\.weight \(as model\.layers\.1\.self_attn\.v_b_proj\.weight\).*missing"):
        quantplug.plan(root)


def test_cli_build_plan_and_explain(gguf_dir, tmp_path, capsys):
    root = tmp_path / "cli"
    shutil.copytree(gguf_dir[0], root)
    assert main(["expert-pack", "build", str(root), "--in-place"]) == 0
    assert "48 entries" in capsys.readouterr().out
    assert main(["expert-pack", "build", str(root), "--in-place"]) == 1  # already built: one line, no traceback
    err = capsys.readouterr().err
    assert "already has an expert pack" in err and "Traceback" not in err
    assert main(["plan", str(root), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["backend"] == "expert_pack" and "experts.qpack" in d["detect_reason"]
    assert main(["explain", str(root), "model.layers.1.self_attn"]) == 0
    out = capsys.readouterr().out
    assert "split_kv" in out and "expert_pack (quantplug-expert-pack" in out
    assert main(["explain", str(root), "blk.1.attn_k_b"]) == 0  # llama.cpp names work too
    assert "ggml Q4_0" in capsys.readouterr().out
    assert main(["forward", str(root), "--tokens", "1,2,3", "-o", "expert_cache_mb=1"]) == 0


def test_index_keeps_digests_that_end_in_nul_bytes():
    """numpy 'S' fields strip trailing NULs; the index must round-trip every sha256 exactly."""
    from quantplug_expert_pack.pack import ENTRY_DTYPE

    digest = bytes(range(1, 31)) + b"\x00\x00"
    idx = np.zeros(1, dtype=ENTRY_DTYPE)
    idx[0] = (1, 2, 0, 8, 4, 32, 4096, 136, digest)
    back = np.frombuffer(idx.tobytes(), dtype=ENTRY_DTYPE)
    assert bytes(back[0]["sha256"]) == digest


def test_split_gguf_files_with_an_mtp_block_load_and_pack(tmp_path):
    """Two GGUF files (llama.cpp's split files), plus two blk.3.* tensors of the multi-token-prediction
    layer past num_hidden_layers (a stub: the layer would not load, so mtp=false): the plan lists
    those as skipped under their model names; build packs across both files."""
    cfg = dict(CFG, num_nextn_predict_layers=1)
    root = tmp_path / "split"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg))
    tensors = gguf_state(random_state(CFG), MC)
    first = {n: t for n, t in tensors.items() if n.startswith(("blk.0.", "blk.1.", "token_embd"))}
    second = {n: t for n, t in tensors.items() if n not in first}
    second["blk.3.attn_norm.weight"] = torch.ones(CFG["hidden_size"])
    second["blk.3.nextn.eh_proj.weight"] = torch.zeros(CFG["hidden_size"], 2 * CFG["hidden_size"])
    write_gguf(root / "model-00001-of-00002.gguf", first, MC, types=TYPES)
    write_gguf(root / "model-00002-of-00002.gguf", second, MC, types=TYPES)
    ref = hf_logits(CFG, reference_state_without_mtp(root, tmp_path / "ref"), IDS)
    model, out = _logits(root, options={"mtp": False})
    assert rel_err(out, ref) <= 1e-5
    skipped = model.quantplug_plan.to_dict()["skipped"]
    assert any(k.startswith("mtp-layers") and {"model.layers.3.eh_proj.weight", "model.layers.3.input_layernorm.weight"}
               <= set(v) for k, v in skipped.items())
    with_experts = {f for f in root.glob("*.gguf") if any("_exps." in t.name for t in read_gguf_header(f).tensors)}
    assert len(with_experts) == 2  # the routed experts are spread over both files
    res = build_pack(root, progress=False)
    assert set(res.gguf_files) == with_experts and res.entries == 48
    _, packed = _logits(root, options={"expert_cache_mb": 1, "mtp": False})
    assert rel_err(packed, ref) <= 1e-5


def reference_state_without_mtp(root, tmp):
    """gguf-py's reference weights, leaving out the MTP block (transformers does not load it)."""
    from gguf import GGUFReader, GGUFWriter

    tmp.mkdir()
    for f in sorted(root.glob("*.gguf")):
        r = GGUFReader(f)
        if any(t.name.startswith("blk.3.") for t in r.tensors):
            w_tensors = {t.name: t for t in r.tensors if not t.name.startswith("blk.3.")}
            w = GGUFWriter(str(tmp / f.name), "deepseek2")
            for t in w_tensors.values():
                w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        else:
            shutil.copy(f, tmp / f.name)
    return reference_state(tmp, MC)


def test_payload_sha256_reads_through_the_checkpoint_byte_reader(tmp_path, monkeypatch):
    """``qpack.payload_sha256`` hashes a payload's file bytes in chunks through ``memory.read_runs``
    (the one checkpoint byte reader): the digest of the bytes at the offset whatever the chunk size,
    and a payload running past the end of the file is a CheckpointError naming it."""
    import hashlib
    import os

    from quantplug.checkpoint import qpack
    from quantplug.errors import CheckpointError

    data = os.urandom(10_000)
    f = tmp_path / "p.bin"
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    try:
        monkeypatch.setattr(qpack, "_VERIFY_CHUNK", 777)  # many chunks, a short last one
        assert qpack.payload_sha256(fd, 123, 9_000, where="x") == hashlib.sha256(data[123:9_123]).digest()
        with pytest.raises(CheckpointError, match=r"blk\.1 expert 3: short read in bytes 9,000\.\.11,000"):
            qpack.payload_sha256(fd, 9_000, 2_000, where="blk.1 expert 3")
    finally:
        os.close(fd)


def test_gguf_keeping_its_fp8_source_config_is_claimed_by_the_gguf_backend_alone(tmp_path):
    # llama.cpp's converter output next to the FP8 release's config.json (quantization_config fp8,
    # weight_block_size): the fp8 backend reads F8_E4M3 tensors, none of which is there, so it does
    # not claim the directory ("claimed by 2 backends" before)
    fp8 = dict(CFG, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]})
    root = write_tiny_gguf(tmp_path / "fp8-source", config=fp8, k_quants=False)
    plan = quantplug.plan(root)
    assert plan.backend == "expert_pack"
