"""DeepSeek-V4-Flash / V4-Pro release layouts at their real dimensions (header-only): the inventory
against the release headers' counts and sizes (config, tensors, dtypes), the files the
safetensors library accepts, and the plan of both layouts from headers alone through the fp8 backend
(FP8 dense linears with E8M0 block scales, FP4 routed experts), MTP block included, no problem."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest
from quantplug.plan import build_plan
from quantplug.testing.probes import forbid_data_reads
from quantplug.testing.scale import (
    DEEPSEEK_V4_SHARDS,
    deepseek_v4_config,
    deepseek_v4_tensors,
    release_tensors,
    write_header_only,
)
from safetensors import safe_open

#: (tensors, bytes, MTP tensors) of the release headers (third-party listings; Flash's MTP shard)
RELEASES = {"flash": (69_187, 159_609_485_896, 1_575), "pro": (145_116, 864_704_792_696, 2_343)}
SERVED = {"expert_cache_mb": 4096}


@pytest.mark.parametrize("variant", ["flash", "pro"])
def test_v4_inventory_is_the_release(variant):
    cfg = deepseek_v4_config(variant)
    tensors = deepseek_v4_tensors(cfg)
    assert release_tensors(cfg) == tensors
    n, nbytes, mtp = RELEASES[variant]
    names = [t.name for t in tensors]
    assert len(tensors) == len(set(names)) == n
    assert sum(t.nbytes for t in tensors) == nbytes
    assert abs(nbytes / 2**30 - (148.6 if variant == "flash" else 805.3)) < 0.05
    assert sum(name.startswith("mtp.0.") for name in names) == mtp
    by = {t.name: t for t in tensors}
    d, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    layers = cfg["num_hidden_layers"]
    # FP4 experts I8 [N, K/2] + F8_E8M0 [N, K/32]; FP8 dense F8_E4M3 + F8_E8M0 [N/128, K/128]
    assert (by["layers.7.ffn.experts.131.w1.weight"].dtype, by["layers.7.ffn.experts.131.w1.weight"].shape) == \
        ("I8", (inter, d // 2))
    assert (by["layers.7.ffn.experts.131.w2.scale"].dtype, by["layers.7.ffn.experts.131.w2.scale"].shape) == \
        ("F8_E8M0", (d, inter // 32))
    wq_b = by["layers.7.attn.wq_b.weight"]
    assert wq_b.dtype == "F8_E4M3" and wq_b.shape == (cfg["num_attention_heads"] * 512, cfg["q_lora_rank"])
    assert by["layers.7.attn.wq_b.scale"].shape == (wq_b.shape[0] // 128, wq_b.shape[1] // 128)
    assert by["layers.7.attn.wo_a.weight"].shape == ((16384, 4096) if variant == "pro" else (8192, 4096))
    assert by["layers.0.hc_attn_fn"].shape == (24, 4 * d) and by["hc_head_fn"].shape == (4, 4 * d)
    # hash routing on the first num_hash_layers layers, the learned bias after and in the MTP block
    tid = [i for i in range(layers) if f"layers.{i}.ffn.gate.tid2eid" in by]
    assert tid == [0, 1, 2] and by["layers.0.ffn.gate.tid2eid"].dtype == "I64"
    assert all(f"layers.{i}.ffn.gate.bias" in by for i in range(3, layers)) and "mtp.0.ffn.gate.bias" in by
    # compressors per compress_ratios: CSA (4) with the indexer, HCA (128) without, none at 0
    ratios = cfg["compress_ratios"]
    assert len(ratios) == layers + 1 and ratios[-1] == 0
    for i in range(layers):
        has_c, has_i = f"layers.{i}.attn.compressor.ape" in by, f"layers.{i}.attn.indexer.wq_b.weight" in by
        assert (has_c, has_i) == (ratios[i] > 0, ratios[i] == 4), i
        if ratios[i]:
            assert by[f"layers.{i}.attn.compressor.ape"].shape == (ratios[i], 1024 if ratios[i] == 4 else 512)
    kinds = Counter(ratios[:layers])
    assert kinds == ({0: 2, 4: 21, 128: 20} if variant == "flash" else {128: 31, 4: 30})
    assert not any(n.startswith("mtp.0.attn.compressor") for n in names)
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.scale", "mtp.0.enorm.weight", "mtp.0.hc_head_fn"} <= set(names)
    assert not any(re.match(r"mtp\.0\.(emb|head)", n) for n in names)  # no embedding / head copy


@pytest.fixture(scope="module")
def flash(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_header_only(tmp_path_factory.mktemp("v4") / "DeepSeek-V4-Flash", deepseek_v4_config("flash"))


def test_v4_flash_header_only_files(flash):
    shards = sorted(flash.glob("*.safetensors"))
    assert len(shards) == DEEPSEEK_V4_SHARDS["flash"] == 46
    assert shards[-1].name == "model-00046-of-00046.safetensors"
    index = json.loads((flash / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == 69_187 and index["metadata"]["total_size"] == RELEASES["flash"][1]
    assert sum(f.stat().st_blocks * 512 for f in shards) < 64 << 20  # headers only
    with safe_open(str(shards[-1]), framework="pt") as fh:  # the MTP block alone in the last shard
        keys = list(fh.keys())
        assert len(keys) == 1_575 and all(k.startswith("mtp.0.") for k in keys)
        assert str(fh.get_slice("mtp.0.ffn.experts.3.w2.scale").get_dtype()) in ("F8_E8M0", "float8_e8m0fnu")


def test_v4_flash_plans_from_headers(flash):
    c = time.process_time()
    with forbid_data_reads(flash) as reads:
        p = build_plan(flash, options=SERVED)
    cpu = time.process_time() - c
    assert not reads, reads.events
    assert p.architecture == "DeepseekV4ForCausalLM" and p.model_config.num_hidden_layers == 43
    assert cpu < 30, f"{cpu:.1f} s CPU"  # a guard against superlinear work, not a speed figure
    mtp = sorted(n for names in p.skipped.values() for n in names if n.startswith("mtp."))
    used = {info.name for pp in p.params for _, info in pp.sources}
    # the MTP block is planned: loaded, or skipped by a named rule, every one of its 1,575 tensors
    assert len(mtp) + sum(n.startswith("mtp.") for n in used) == 1_575
    assert p.backend == "fp8" and not p.problems, [q.describe() for q in p.problems][:5]
    experts = {d.value for d in p.decisions if d.hook == "quantplug_linear_scheme" and ".experts." in d.target}
    assert experts and all("fp4" in str(v).lower() for v in experts), experts


@pytest.mark.slow
def test_v4_pro_plans_from_headers(tmp_path):
    path = write_header_only(tmp_path / "DeepSeek-V4-Pro", deepseek_v4_config("pro"))
    assert len(list(path.glob("*.safetensors"))) == 64
    with forbid_data_reads(path) as reads:
        p = build_plan(path, options=SERVED)
    assert not reads, reads.events
    assert p.model_config.num_hidden_layers == 61 and p.model_config.n_routed_experts == 384
    assert p.backend == "fp8" and not p.problems, [q.describe() for q in p.problems][:5]
    mtp = [n for names in p.skipped.values() for n in names if n.startswith("mtp.")]
    used = {info.name for pp in p.params for _, info in pp.sources}
    assert len(mtp) + sum(n.startswith("mtp.") for n in used) == 2_343
