"""DeepSeek-V3 / Kimi-K2 / Kimi-K3 at their real dimensions: the header-only release inventories,
the plan of a 163-shard index (issue 20: < 2 s, no tensor data read) and of K3's 497,052 tensors,
and the streamed random-weight slice writers (FP8 safetensors and the same weights as GGUF Q4_0)
at tiny dimensions."""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import quantplug
import torch
from quantplug.testing.probes import forbid_data_reads
from quantplug.testing.scale import (
    DEEPSEEK_V3_SHARDS,
    KIMI_K3_SHARDS,
    DiskSpaceError,
    ShardWriter,
    StoredTensor,
    check_free_disk,
    deepseek_v3_config,
    kimi_k2_config,
    kimi_k3_config,
    release_tensors,
    safetensors_header,
    slice_config,
    write_header_only,
)
from quantplug.testing.slice import FP8_VALUES, WeightSource, q4_0, write_fp8_checkpoint, write_gguf_q4_0
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
#: A guard against superlinear work in the plan (a per-tensor scan of all tensors, a hook call per
#: tensor), not a speed figure: issue 20's "< 2 s" is measured by ``bench/bench_core.py --release``
#: (docs/benchmarks.md). CPU time of one plan swings 2x between the machines CI runs on (1.0 s on
#: an AVX-512 machine, 2.2-2.4 s on an AVX2 one, for the same 163-shard index); a quadratic
#: regression at 92k-140k tensors costs minutes, so 4x the figure catches it on either.
PLAN_BUDGET_S = 8.0


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_header_only(tmp_path_factory.mktemp("dsv3") / "DeepSeek-V3")


# ---------------------------------------------------------------------------------------------
# inventories
# ---------------------------------------------------------------------------------------------

def test_deepseek_v3_inventory_is_the_release():
    cfg = deepseek_v3_config()
    tensors = release_tensors(cfg)
    by_name = {t.name: t for t in tensors}
    assert len(by_name) == len(tensors) == 91_991
    params = sum(t.numel for t in tensors if not t.name.endswith("weight_scale_inv"))
    main = sum(t.numel for t in tensors if not t.name.endswith("weight_scale_inv") and (t.layer or 0) < 61)
    # the release's README: 671B main model + the MTP module = "685B" on the hub (which counts scales too)
    assert round(main / 1e9) == 671
    assert round(sum(t.numel for t in tensors) / 1e9) == 685 and round(params / 1e9, 1) == 684.5
    moe = {t.layer for t in tensors if ".mlp.experts." in t.name}
    assert moe == set(range(3, 62))  # first 3 dense, then MoE, the MTP layer 61 included
    assert {t.layer for t in tensors if ".mlp.experts.255." in t.name} == moe
    # FORMATS.md: kv_a_proj_with_mqa [576, 7168] has a [5, 56] scale (partial last block row)
    kva = "model.layers.7.self_attn.kv_a_proj_with_mqa"
    assert (by_name[f"{kva}.weight"].dtype, by_name[f"{kva}.weight"].shape) == ("F8_E4M3", (576, 7168))
    assert (by_name[f"{kva}.weight_scale_inv"].dtype, by_name[f"{kva}.weight_scale_inv"].shape) == ("F32", (5, 56))
    for t in tensors:  # every FP8 weight has its block scale
        if t.dtype == "F8_E4M3":
            s = by_name[t.name + "_scale_inv"]
            assert s.shape == (math.ceil(t.shape[0] / 128), math.ceil(t.shape[1] / 128)), t.name
    assert by_name["model.layers.3.mlp.gate.weight"].dtype == "BF16"
    assert by_name["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert by_name["model.layers.61.eh_proj.weight"].shape == (7168, 14336)
    assert {t.dtype for t in tensors if t.layer == 61 and "experts" not in t.name and "self_attn" not in t.name
            and "shared_experts" not in t.name and not t.name.endswith("bias")} == {"BF16"}
    assert by_name["lm_head.weight"].shape == by_name["model.embed_tokens.weight"].shape == (129280, 7168)


def test_kimi_k2_inventory_matches_the_published_counts():
    # Kimi-K2-Instruct's published inventory: 139,644 tensors, 1,026,470,731,056 parameters
    tensors = release_tensors(kimi_k2_config())
    assert len(tensors) == 139_644
    assert sum(t.numel for t in tensors) == 1_026_470_731_056
    assert {t.layer for t in tensors if ".mlp.experts.383." in t.name} == set(range(1, 61))
    assert max(t.layer or 0 for t in tensors) == 60  # no MTP layer


#: Kimi-K3 (ARCHITECTURES C2): 92 MoE layers x 896 experts x 3 projections x (weight_packed, weight_scale)
K3_EXPERT_TENSORS = 92 * 896 * 3 * 2


@pytest.fixture(scope="module")
def k3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_header_only(tmp_path_factory.mktemp("k3") / "Kimi-K3", kimi_k3_config())


# ~7 s (497,052 tensors listed): the inventory of the header-only K3 release that the slow plan test
# below and bench/make_k3_slice.py write
@pytest.mark.slow
def test_kimi_k3_inventory_is_architectures_c2():
    cfg = kimi_k3_config()
    text = cfg["text_config"]
    assert (cfg["model_type"], text["model_type"]) == ("kimi_k3", "kimi_linear")
    tensors = release_tensors(cfg)
    by_name = {t.name: t for t in tensors}
    assert len(by_name) == len(tensors) == 497_052
    experts = [t for t in tensors if ".experts." in t.name]
    assert len(experts) == K3_EXPERT_TENSORS == 494_592
    assert {t.dtype for t in experts} == {"U8"}
    # 1.56 TB (1.42 TiB): the MXFP4 experts 1.446 TB of it; 2.78 T parameters (two per packed byte)
    assert sum(t.nbytes for t in tensors) == 1_559_965_415_552
    assert sum(t.nbytes for t in experts) == 1_446_456_066_048
    params = sum(t.numel * (2 if t.name.endswith("weight_packed") else 1) for t in tensors
                 if not t.name.endswith("weight_scale"))
    assert params == 2_779_484_476_000
    m = "language_model.model.layers.5.block_sparse_moe"
    assert by_name[f"{m}.experts.895.w1.weight_packed"].shape == (3072, 1792)
    assert by_name[f"{m}.experts.895.w3.weight_scale"].shape == (3072, 112)
    assert by_name[f"{m}.experts.0.w2.weight_packed"].shape == (3584, 1536)
    assert by_name[f"{m}.experts.0.w2.weight_scale"].shape == (3584, 96)
    assert by_name[f"{m}.routed_expert_down_proj.weight"].shape == (3584, 7168)
    assert by_name[f"{m}.shared_experts.down_proj.weight"].shape == (7168, 6144)
    assert by_name[f"{m}.gate.e_score_correction_bias"].dtype == "BF16"
    kda = "language_model.model.layers.0.self_attn"  # 1-based layer 1: KDA
    assert (by_name[f"{kda}.A_log"].dtype, by_name[f"{kda}.A_log"].shape) == ("F32", (96,))
    assert (by_name[f"{kda}.q_conv1d.weight"].dtype, by_name[f"{kda}.q_conv1d.weight"].shape) == ("F32", (12288, 1, 4))
    assert by_name[f"{kda}.dt_bias"].dtype == "F32"
    assert by_name["language_model.model.layers.0.mlp.gate_proj.weight"].shape == (33792, 7168)
    kinds = {t.layer: ("kda" if t.name.endswith("self_attn.A_log") else "mla") for t in tensors
             if t.name.endswith(("self_attn.A_log", "self_attn.q_a_proj.weight"))}
    assert sorted(k for k, v in kinds.items() if v == "mla") == [*range(3, 92, 4), 92]
    assert len(kinds) == 93 and sum(v == "kda" for v in kinds.values()) == 69
    assert {t.layer for t in experts} == set(range(1, 93))
    assert by_name["language_model.lm_head.weight"].shape == by_name["language_model.model.embed_tokens.weight"].shape
    assert tensors[0].name == "language_model.model.embed_tokens.weight" and tensors[-1].name == "language_model.lm_head.weight"
    qc = text["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert len(qc["ignore"]) == 1347 and "language_model.lm_head" in qc["ignore"]
    assert not any(".experts." in e for e in qc["ignore"])


# ~30 s (93 header-only shards written, one 497,052-tensor plan): a scale benchmark; the DeepSeek-V3
# and Kimi-K2 plans above check the same path by default
@pytest.mark.slow
def test_plan_of_kimi_k3_header_only(k3):
    """The released K3 layout (497,052 tensors, 93 shards) plans through compressed-tensors with
    the routed experts served from the files; no tensor data read; CPU time under the same
    per-tensor guard as DeepSeek-V3's (5.4x its tensors)."""
    shards = sorted(k3.glob("*.safetensors"))
    assert len(shards) == KIMI_K3_SHARDS and shards[0].name == "model-00001-of-000093.safetensors"
    assert sum(f.stat().st_blocks * 512 for f in shards) < 256 << 20  # headers only: ~130 MB
    c, t = time.process_time(), time.perf_counter()
    with forbid_data_reads(k3) as reads:
        p = quantplug.plan(k3, options=SERVED)
    cpu, wall = time.process_time() - c, time.perf_counter() - t
    assert not reads, reads.events
    assert p.backend == "compressed_tensors" and not p.problems, p.problems[:5]
    assert p.architecture == "KimiK3ForConditionalGeneration" and p.prefix == "language_model"
    assert p.model_config.n_routed_experts == 896 and p.model_config.num_hidden_layers == 93
    schemes = {d.value for d in p.decisions if d.hook == "quantplug_linear_scheme" and ".experts." in d.target}
    assert len(schemes) == 1 and "mxfp4" in next(iter(schemes)), schemes
    assert sum(len(pp.sources) for pp in p.params) == len(p.checkpoint.tensors) == 497_052
    assert cpu < PLAN_BUDGET_S * 5.4, f"plan of Kimi-K3's 93-shard index: {cpu:.2f} s CPU ({wall:.2f} s wall)"


def test_header_only_checkpoint_is_sparse_and_valid(dsv3):
    shards = sorted(dsv3.glob("*.safetensors"))
    assert len(shards) == DEEPSEEK_V3_SHARDS
    assert shards[0].name == "model-00001-of-000163.safetensors"
    assert shards[-1].name == "model-00163-of-000163.safetensors"
    index = json.loads((dsv3 / "model.safetensors.index.json").read_text())
    total = sum(t.nbytes for t in release_tensors(deepseek_v3_config()))
    assert index["metadata"]["total_size"] == total and len(index["weight_map"]) == 91_991
    apparent = sum(f.stat().st_size for f in shards)
    on_disk = sum(f.stat().st_blocks * 512 for f in shards)
    assert apparent > total > 680e9
    assert on_disk < 64 << 20, f"the header-only checkpoint takes {on_disk:,} bytes of disk"
    with safe_open(str(shards[40]), framework="pt") as fh:  # the safetensors library accepts it
        name = next(iter(fh.keys()))
        assert index["weight_map"][name] == shards[40].name
    cfg = json.loads((dsv3 / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}


# ---------------------------------------------------------------------------------------------
# plan at scale
# ---------------------------------------------------------------------------------------------

#: the routed experts served from the files: a plan that would copy them into memory must fit
#: this machine's available memory (test_experts_larger_than_memory_are_a_plan_error_naming_the_numbers)
SERVED = {"expert_cache_mb": 4096}


@pytest.fixture(scope="module")
def dsv3_served(dsv3: Path) -> tuple[quantplug.LoadPlan, float, float, list]:
    """The 163-shard index planned once with SERVED (no tensor data read): the plan, its CPU and
    wall seconds, and the data reads seen (none expected)."""
    c, t = time.process_time(), time.perf_counter()
    with forbid_data_reads(dsv3) as reads:
        p = quantplug.plan(dsv3, options=SERVED)
    return p, time.process_time() - c, time.perf_counter() - t, list(reads.events)


def test_plan_of_the_163_shard_index_reads_no_data_and_stays_linear(dsv3_served):
    p, cpu, wall, reads = dsv3_served
    assert not reads, reads
    assert p.backend == "fp8" and not p.problems
    assert p.model_config.num_hidden_layers == 61 and p.model_config.n_routed_experts == 256
    # the MTP layer 61 loads (option mtp, default true) but for its copies of the embedding and lm_head
    skipped = [n for names in p.skipped.values() for n in names]
    assert sorted(skipped) == ["model.layers.61.embed_tokens.weight", "model.layers.61.shared_head.head.weight"]
    used = {info.name for pp in p.params for _, info in pp.sources}
    assert {t.name for t in release_tensors(deepseek_v3_config()) if t.layer == 61} - used == set(skipped)
    # CPU time: wall time on this shared 2-core machine swings with the other engineers' load
    # (measured 1.3 s wall for 0.9 s CPU at load 8, 11 s wall for 1.7 s CPU at load 14)
    assert cpu < PLAN_BUDGET_S, f"plan of the 163-shard DeepSeek-V3 index: {cpu:.2f} s CPU ({wall:.2f} s wall)"


def test_experts_larger_than_memory_are_a_plan_error_naming_the_numbers(dsv3, monkeypatch):
    """Without expert_cache_mb, the routed experts a load would copy into memory (620.1 GiB at
    DeepSeek-V3 size, the MTP layer 61's 10.6 included) must fit the machine's available memory; the error says both and the fix."""
    from quantplug import memory

    monkeypatch.setattr(memory, "available_memory", lambda: 20 << 30)
    with pytest.raises(quantplug.errors.PlanError, match=r"loading copies 620.1 GiB into memory \(routed experts and "
                                                         r"converted tensors\) but this machine has 20.0 GiB available: "
                                                         r"set expert_cache_mb"):
        quantplug.plan(dsv3)
    monkeypatch.setattr(memory, "available_memory", lambda: 2 << 40)  # a 2 TiB machine
    assert not quantplug.plan(dsv3).problems


def test_experts_from_ssd_at_deepseek_v3_size_attach_in_seconds(dsv3, dsv3_served):
    """expert_cache_mb on the 163-shard index: 59 MoE layers (58 + the MTP layer 61) x 256 experts x
    3 projections x (weight, scale) addressed per expert from the headers (90,624 byte ranges), in
    CPU seconds."""
    from quantplug import experts

    plan = dsv3_served[0]  # SERVED: expert_cache_mb 4096 (the plan's model is this test's to attach to)
    assert not plan.problems
    c = time.process_time()
    skip, cache, kept = experts.attach(plan, plan.model, 4096 << 20)
    cpu = time.process_time() - c
    assert cache is not None and not kept
    stores = [m.qp_store for m in plan.model.modules() if getattr(m, "qp_store", None) is not None]
    assert len(stores) == 59 and len(skip) == 59 * 3 * 2
    pieces = sum(len(v) for st in stores for proj in st.pieces.values() for v in proj.values())
    assert pieces == 59 * 256 * 3 * 2
    assert stores[0].slot_bytes == 3 * (2048 * 7168 + 16 * 56 * 4)  # F8_E4M3 weights + F32 block scales
    assert cpu < PLAN_BUDGET_S, f"attach: {cpu:.2f} s CPU"
    cache.close()
    # a budget below one step's 8 experts is a plan error naming the numbers
    with pytest.raises(quantplug.errors.PlanError, match=r"holds less than one step's routed experts of a layer: "
                                                         r"8 experts of 42.01 MiB each = 336.1 MiB"):
        quantplug.plan(dsv3, options={"expert_cache_mb": 300}).raise_for_problems()


# ~10 s (61 header-only shards written, one 139,644-tensor plan): the DeepSeek-V3 plan above checks
# the same path (and its guard against superlinear work) by default
@pytest.mark.slow
def test_plan_of_kimi_k2_header_only(tmp_path):
    root = write_header_only(tmp_path / "Kimi-K2", kimi_k2_config())
    assert (root / "model-1-of-61.safetensors").is_file() and (root / "model-61-of-61.safetensors").is_file()
    c, t = time.process_time(), time.perf_counter()
    with forbid_data_reads(root) as reads:
        p = quantplug.plan(root, options=SERVED)
    cpu, wall = time.process_time() - c, time.perf_counter() - t
    assert not reads, reads.events
    assert p.backend == "fp8" and not p.problems
    assert p.model_config.n_routed_experts == 384 and p.model_config.num_attention_heads == 64
    assert sum(len(v) for v in p.skipped.values()) == 61  # rotary_emb.inv_freq, one per layer
    # 139,644 tensors (1.5x DeepSeek-V3's): the same budget per tensor
    assert cpu < PLAN_BUDGET_S * 1.5, f"plan of Kimi-K2's 61-shard index: {cpu:.2f} s CPU ({wall:.2f} s wall)"


def test_cli_plan_of_the_real_layout_fits_a_screen(dsv3, capsys):
    """Issue 23: the text plan of the 671B layout was 73 lines of up to 1,783 characters (108,115
    bytes: every layer repeated every projection's scheme). Identical layers are grouped and each
    scheme is described once; ``--json`` keeps every decision."""
    from quantplug.cli import main

    assert main(["plan", str(dsv3), "-o", "expert_cache_mb=4096"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 40 and len(out.encode()) < 4096, (len(lines), len(out.encode()))
    assert "backend:      fp8" in out and "problems:     none" in out
    assert "  layers 0-2 (3): attention dense; [1] all 8 projections" in lines
    assert "  layers 3-60 (58): attention dense; [1] all 11 projections" in lines
    fp8 = [ln for ln in lines if "fp8 e4m3 block [128, 128]" in ln]
    assert fp8 == ["  [1] fp8 e4m3 block [128, 128], weight_scale_inv f32; activations fp8 e4m3 per token per 128 "
                   "(DeepSeek act_quant; activation_quant=dynamic) (673 modules)"]  # 662 + the MTP layer's 11
    assert main(["plan", str(dsv3), "--json", "-o", "expert_cache_mb=4096"]) == 0
    d = json.loads(capsys.readouterr().out)
    # dense layers, MoE layers (the MTP layer 61 too), embedding + lm_head, the MTP layer's eh_proj
    assert len(d["schemes"]) == 3 * 8 + 59 * 11 + 2 + 1 and len(d["decisions"]) > 700
    # 8-rank tensor parallel: ranks of equal bytes on one line, equal splits over layers on one line
    assert main(["plan", str(dsv3), "--tp", "8", "-o", "expert_cache_mb=4096"]) == 0
    tp = capsys.readouterr().out.splitlines()
    assert len(tp) <= 40, len(tp)  # was 509 lines (162,744 bytes)
    # the MTP layer 61 splits as the main layers
    assert "  model.layers.{3-61}.mlp.experts: expert-parallel (experts per rank [32, 32, 32, 32, 32, 32, 32, 32] " \
           "(contiguous blocks); router replicated; one all-reduce) x59" in tp


def test_cli_explain_at_scale(dsv3, capsys):
    """``explain`` of a prefix covering every layer folds rows that differ only in the layer index
    (was 785 lines, 201 KB); a routed expert's own tensor name and a skipped MTP tensor resolve."""
    from quantplug.cli import main

    assert main(["explain", str(dsv3), "model.layers"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) <= 30, len(out)
    assert any(re.match(r"linear_scheme +model\.layers\.\{3-61\}\.mlp\.experts\.gate_proj \(x59\) +\[1\] ", ln)
               for ln in out), out
    assert sum("fp8 e4m3 block" in ln for ln in out) == 1
    assert main(["explain", str(dsv3), "model.layers.3.mlp.experts.7.gate_proj.weight"]) == 0
    out = capsys.readouterr().out
    assert "feeds parameter model.layers.3.mlp.experts.gate_proj.weight slot 7" in out
    assert main(["explain", str(dsv3), "model.layers.61.shared_head.head.weight"]) == 0
    assert "skipped by rule mtp-shared-copies" in capsys.readouterr().out
    assert main(["explain", str(dsv3), "model.layer.3.mlp"]) == 1
    assert "did you mean 'model.layers.3.mlp" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# streaming writer
# ---------------------------------------------------------------------------------------------

def test_shard_writer_streams_a_valid_safetensors_file(tmp_path):
    tensors = [StoredTensor("a", "F8_E4M3", (4, 8)), StoredTensor("b", "F32", (3,)), StoredTensor("c", "BF16", (2, 2))]
    a = torch.randn(4, 8).to(torch.float8_e4m3fn)
    b = torch.tensor([1.0, -2.0, 3.5])
    c = torch.randn(2, 2).to(torch.bfloat16)
    f = tmp_path / "x.safetensors"
    with ShardWriter(f, tensors, drop_cache_every=16) as w:
        w.write("a", a[:1].view(torch.uint8).numpy())  # a tensor may come in pieces
        w.write("a", a[1:].view(torch.uint8).numpy())
        w.write("b", b.numpy())
        w.write("c", c.view(torch.int16).numpy())
    assert f.stat().st_size == len(safetensors_header(tensors)) + 32 + 12 + 8
    with safe_open(str(f), framework="pt") as fh:
        assert torch.equal(fh.get_tensor("a").view(torch.uint8), a.view(torch.uint8))
        assert torch.equal(fh.get_tensor("b"), b) and torch.equal(fh.get_tensor("c"), c)


def test_shard_writer_refuses_wrong_order_overrun_and_early_close(tmp_path):
    tensors = [StoredTensor("a", "F32", (2,)), StoredTensor("b", "F32", (2,))]
    w = ShardWriter(tmp_path / "x.safetensors", tensors)
    with pytest.raises(ValueError, match="got b, expected a"):
        w.write("b", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="12 more bytes, but only 8"):
        w.write("a", np.zeros(3, np.float32))
    w.write("a", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="closed before b"):
        w.close()


def test_free_disk_check_names_the_numbers(tmp_path):
    free = check_free_disk(tmp_path, 1)
    with pytest.raises(DiskSpaceError, match=r"need .* GiB \(.* bytes\) .* only .* GiB .* free"):
        check_free_disk(tmp_path / "new" / "dir", free + (1 << 40))


def test_make_dsv3_slice_refuses_when_the_disk_is_too_small(tmp_path, capsys):
    """The script's main() in this process (as ``python bench/make_dsv3_slice.py`` runs it)."""
    import runpy

    script = runpy.run_path(str(ROOT / "bench" / "make_dsv3_slice.py"))  # __name__ is not __main__: defines only
    rc = script["main"](["--out", str(tmp_path / "s"), "--dry-run"])
    dry = capsys.readouterr()
    assert json.loads(dry.out)["bytes"] == 15_802_320_320, dry.err  # 2 layers: 1 dense + 1 MoE
    assert rc == (0 if json.loads(dry.out)["fits"] else 1)
    rc = script["main"](["--out", str(tmp_path / "s"), "--layers", "4", "--reserve-gb", "1000000"])
    bad = capsys.readouterr()
    assert rc == 1
    assert "refused" in bad.err and "36.16 GiB (38,826,215,296 bytes)" in bad.err
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------------------------
# random-weight slices (tiny dimensions)
# ---------------------------------------------------------------------------------------------

def _tiny_slice() -> dict:
    cfg = slice_config(3)
    cfg.update(hidden_size=256, intermediate_size=320, moe_intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=160, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
               v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, vocab_size=1000)
    return cfg


def test_fp8_slice_loads_and_holds_the_documented_values(tmp_path):
    cfg = _tiny_slice()
    source = WeightSource(seed=5)
    res = write_fp8_checkpoint(tmp_path / "fp8", cfg, source, shard_bytes=1_500_000)
    assert len(res.files) == 3 and res.bytes_written == sum(t.nbytes for t in release_tensors(cfg))
    model = quantplug.load(res.path, dtype=torch.float32, options={"activation_quant": "none"})
    stored = {t.name: t for t in release_tensors(cfg)}
    from quantplug.api import dense_state

    state = dense_state(model)
    for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight"):
        want = np.concatenate(list(source.dense(stored[name], stored[name + "_scale_inv"])))
        assert torch.equal(state[name], torch.from_numpy(want)), name  # exact: code value * block scale
    big = torch.cat([state[f"model.layers.2.mlp.experts.{k}.{p}_proj.weight"].flatten()
                     for k in range(16) for p in ("gate", "up", "down")])
    assert abs(big.std().item() / 0.02 - 1) < 0.05
    with safe_open(str(res.path / "model-00002-of-000003.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
        name = next(n for n in names if n.endswith("experts.3.up_proj.weight"))
        codes = fh.get_tensor(name).float()
    assert codes.abs().max().item() == 448.0  # every block reaches E4M3's maximum, as amax / 448 scaling does
    assert torch.equal(state["model.layers.1.mlp.gate.e_score_correction_bias"], torch.zeros(16))
    assert torch.equal(state["model.norm.weight"], torch.ones(256))
    router = state["model.layers.1.mlp.gate.weight"]
    assert router.dtype == torch.float32 and abs(router.std().item() / 0.02 - 1) < 0.05
    logits = model(torch.tensor([[1, 5, 9, 200]]))
    assert torch.isfinite(logits).all() and logits.std() > 0.05
    # deterministic in the seed, per tensor
    again = WeightSource(seed=5).tensor(stored["model.layers.1.mlp.experts.2.up_proj.weight"])
    other = WeightSource(seed=6).tensor(stored["model.layers.1.mlp.experts.2.up_proj.weight"])
    with safe_open(str(res.files[0]), framework="pt") as fh:
        first = next(iter(fh.keys()))
    assert first == "model.embed_tokens.weight"
    assert not np.array_equal(again, other)
    assert set(np.unique(FP8_VALUES[again])) <= set(np.unique(FP8_VALUES))


def test_gguf_q4_0_slice_is_the_fp8_slice_quantized_by_gguf_py(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    cfg = _tiny_slice()
    source = WeightSource(seed=7)
    fp8 = write_fp8_checkpoint(tmp_path / "fp8", cfg, source)
    q4 = write_gguf_q4_0(tmp_path / "q4", cfg, source)
    assert "quantization_config" not in json.loads((q4.path / "config.json").read_text())
    from quantplug.api import dense_state

    state = dense_state(quantplug.load(fp8.path, dtype=torch.float32, options={"activation_quant": "none"}))
    reader = gguf.GGUFReader(str(q4.files[0]))
    got = {t.name: t for t in reader.tensors}
    nh, nope, vd, kl = 4, 32, 32, 64
    kv_b = state["model.layers.1.self_attn.kv_b_proj.weight"].reshape(nh, nope + vd, kl)
    expected = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output.weight": state["lm_head.weight"],
        "blk.0.ffn_down.weight": state["model.layers.0.mlp.down_proj.weight"],
        "blk.1.attn_kv_a_mqa.weight": state["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"],
        "blk.1.attn_k_b.weight": kv_b[:, :nope, :].transpose(1, 2),
        "blk.1.attn_v_b.weight": kv_b[:, nope:, :],
        "blk.2.ffn_up_exps.weight": torch.stack([state[f"model.layers.2.mlp.experts.{k}.up_proj.weight"]
                                                 for k in range(16)]),
        "blk.2.ffn_gate_inp.weight": state["model.layers.2.mlp.gate.weight"],
        "blk.2.exp_probs_b.bias": state["model.layers.2.mlp.gate.e_score_correction_bias"],
    }
    for name, w in expected.items():
        t = got[name]
        arr = w.contiguous().numpy()
        want = arr if t.tensor_type.name == "F32" else quantize(arr, gguf.GGMLQuantizationType.Q4_0)
        assert t.tensor_type.name == ("F32" if name.startswith("blk.2.ffn_gate_inp") or name.endswith("bias")
                                      else "Q4_0"), name
        assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)), name
    plan = quantplug.plan(q4.path)
    assert plan.backend == "expert_pack" and not plan.problems
    model = quantplug.load(q4.path, dtype=torch.float32)
    assert torch.isfinite(model(torch.tensor([[3, 4]]))).all()


def test_q4_0_is_gguf_py_bit_for_bit():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((300, 256)) * 0.02).astype(np.float32)
    x[0] = 0.0  # d = 0
    x[1, :32] = np.tile(np.float32([0.5, -0.5]), 16)  # |max| tie of opposite signs: the first wins
    x[2, :32] = np.tile(np.float32([-0.5, 0.5]), 16)
    x[3:200] = rng.choice(FP8_VALUES[np.isfinite(FP8_VALUES)] * np.float32(1e-4), size=(197, 256))  # many ties
    x[200, 5] = np.float32(1e-40)  # subnormal maximum
    x[201] = np.float32(6e4)  # d overflows fp16
    assert np.array_equal(q4_0(x), quantize(x, gguf.GGMLQuantizationType.Q4_0))
    stacked = x[:288].reshape(3, 96, 256)
    assert np.array_equal(q4_0(stacked).reshape(-1), quantize(stacked, gguf.GGMLQuantizationType.Q4_0).reshape(-1))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("QUANTPLUG_DSV3_SLICE"), reason="set QUANTPLUG_DSV3_SLICE to a slice written "
                    "by bench/make_dsv3_slice.py (15.8 GB; ~14 GB of RAM to load)")
def test_real_dimension_slice_plans_loads_and_forwards():
    path = Path(os.environ["QUANTPLUG_DSV3_SLICE"])
    p = quantplug.plan(path)
    assert p.model_config.hidden_size == 7168 and p.model_config.n_routed_experts == 256 and not p.problems
    model = quantplug.load(path, dtype=torch.bfloat16)
    logits = model(torch.tensor([[1000, 2000]]))
    assert logits.shape == (1, 2, 129280) and torch.isfinite(logits.float()).all()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("QUANTPLUG_DSV3_SLICE4"), reason="set QUANTPLUG_DSV3_SLICE4 to a 4-layer slice "
                    "(bench/make_dsv3_slice.py --layers 4: 38.8 GB, larger than a 24 GiB machine's RAM)")
def test_real_dimension_slice_larger_than_ram_generates_with_experts_from_ssd():
    import resource

    path = Path(os.environ["QUANTPLUG_DSV3_SLICE4"])
    model = quantplug.load(path, dtype=torch.bfloat16, options={"expert_cache_mb": 3072}, progress=False)
    assert model.load_report["experts_on_demand_bytes"] > 30e9
    out = model.generate(torch.tensor([[1000, 2000, 3000]]), max_new_tokens=4)
    assert out.shape == (1, 7)
    from quantplug.api import stats_sources

    st = stats_sources(model)["expert_cache"].stats()
    assert st["peak_bytes"] <= 3072 << 20 and st["misses"] > 0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 12 * (1 << 30)
