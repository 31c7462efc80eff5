"""The kit's parts on their own: format fixtures, the data-read probe, damage helpers, the pytest
plugin's fixtures, write_checkpoint(dtype=)."""

from __future__ import annotations

import importlib.metadata as md
import mmap
import os

import pytest
import quantplug
import torch
from quantplug.checkpoint import Checkpoint
from quantplug.errors import PlanError
from quantplug.plan import build_plan
from quantplug.plugins import ENTRY_POINT_GROUP, PluginManager
from quantplug.testing import random_state, tiny_config, write_checkpoint
from quantplug.testing.formats import FORMATS, write_format_fixtures
from quantplug.testing.probes import forbid_data_reads, rename_stored_tensor, truncate_file
from safetensors import safe_open

INSTALLED = {ep.name: ep for ep in md.entry_points(group=ENTRY_POINT_GROUP)}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    cfg = tiny_config(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, q_lora_rank=128,
                      kv_lora_rank=128, qk_rope_head_dim=32, num_hidden_layers=2, n_routed_experts=4, n_group=2)
    return write_format_fixtures(tmp_path_factory.mktemp("formats"), cfg, random_state(cfg))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_fixture_is_claimed_by_its_bundled_backend_only(fixtures, fmt):
    """Keeps the fixtures honest: the bundled backend of each format claims it, no other does."""
    if fmt not in INSTALLED:
        pytest.skip(f"bundled backend {fmt!r} is not installed")
    pm = PluginManager(env={"QUANTPLUG_PLUGINS": ",".join(n for n in FORMATS if n in INSTALLED)})
    claimants = [info.name for claim, info in pm.call("quantplug_detect", None, firstresult=False,
                                                      checkpoint=Checkpoint.open(fixtures[fmt]))]
    assert claimants == [fmt]


def test_probe_sees_reads_past_the_header_only(tmp_path):
    cfg = tiny_config(num_hidden_layers=1)
    path = write_checkpoint(tmp_path / "c", cfg, random_state(cfg))
    file = path / "model.safetensors"
    with forbid_data_reads(path, lambda: "a test") as reads:
        with open(file, "rb") as fh:  # a header read is fine
            n = int.from_bytes(fh.read(8), "little")
            fh.read(n)
        assert not reads
        with pytest.raises(AssertionError, match="during a test"), open(file, "rb") as fh:
            fh.seek(8 + n)
            fh.read(4)
        fd = os.open(file, os.O_RDONLY)
        try:
            with pytest.raises(AssertionError, match="os.pread of model.safetensors"):
                os.pread(fd, 16, 8 + n)
            with pytest.raises(AssertionError, match="mmap of model.safetensors"):
                mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        ckpt = Checkpoint.open(path)  # the core's header reader is trusted
        with pytest.raises(AssertionError, match="Checkpoint.tensor"):
            ckpt.tensor(next(iter(ckpt.tensors.values())))
    assert len(reads.events) == 4
    with open(file, "rb") as fh:  # restored afterwards
        assert len(fh.read()) == file.stat().st_size


def test_plan_reads_nothing_for_dense_and_gguf(fixtures, tmp_path):
    cfg = tiny_config(num_hidden_layers=2)
    dense = write_checkpoint(tmp_path / "d", cfg, random_state(cfg))
    for path in (dense, fixtures["expert_pack"]):
        with forbid_data_reads(path) as reads:
            build_plan(path, plugin_manager=PluginManager(env={"QUANTPLUG_PLUGINS": "expert_pack"}))
        assert not reads, reads.events


def test_rename_and_truncate_safetensors_and_gguf(fixtures, tmp_path):
    cfg = tiny_config(num_hidden_layers=1)
    path = write_checkpoint(tmp_path / "c", cfg, random_state(cfg), shards=2)
    ckpt = Checkpoint.open(path)
    name = "model.layers.0.self_attn.o_proj.weight"
    new = rename_stored_tensor(ckpt.tensors[name].file, name)
    with pytest.raises(PlanError) as e:
        quantplug.plan(path)
    assert f"tensor {name}" in str(e.value) and "missing" in str(e.value) and new in str(e.value)
    gguf = fixtures["expert_pack"] / "model.gguf"
    import shutil

    copy = tmp_path / "g"
    shutil.copytree(fixtures["expert_pack"], copy)
    rename_stored_tensor(copy / "model.gguf", "blk.0.attn_output.weight")
    names = set(Checkpoint.open(copy).tensors)
    assert "blk.0.attn_output.weighX" in names and "blk.0.attn_output.weight" not in names
    assert os.path.getsize(copy / "model.gguf") == os.path.getsize(gguf)
    cut = truncate_file(copy / "model.gguf", 1000)
    assert cut == os.path.getsize(gguf) - 1000


def test_write_checkpoint_dtype_casts_plain_floats_only(tmp_path):
    tensors = {"f32": torch.randn(4, 4), "bf16": torch.randn(4, 4).bfloat16(),
               "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn), "e8m0": torch.ones(4, 1).to(torch.float8_e8m0fnu),
               "i8": torch.ones(4, 4, dtype=torch.int8), "i32": torch.ones(4, dtype=torch.int32)}
    path = write_checkpoint(tmp_path / "c", {}, tensors, dtype=torch.float16)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    assert got["f32"].dtype == got["bf16"].dtype == torch.float16
    assert got["fp8"].dtype == torch.float8_e4m3fn and torch.equal(got["fp8"].view(torch.uint8),
                                                                   tensors["fp8"].view(torch.uint8))
    assert got["e8m0"].dtype == torch.float8_e8m0fnu
    assert got["i8"].dtype == torch.int8 and got["i32"].dtype == torch.int32


def test_pytest_plugin_fixtures(pytestconfig, quantplug_tiny_checkpoint, quantplug_reference,
                                quantplug_plugin_manager, quantplug_distribution):
    """The fixtures the pytest11 plugin ships, as a backend's own tests use them."""
    assert pytestconfig.pluginmanager.hasplugin("quantplug")  # loaded through the pytest11 entry point
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared box
    try:
        _check_fixtures(quantplug_tiny_checkpoint, quantplug_reference, quantplug_plugin_manager,
                        quantplug_distribution)
    finally:
        torch.set_num_threads(threads)


def _check_fixtures(quantplug_tiny_checkpoint, quantplug_reference, quantplug_plugin_manager, quantplug_distribution):
    pm = quantplug_plugin_manager()
    ids = torch.tensor([[1, 2, 3, 4]])
    for layout in ("deepseek_v3", "fused", "kimi_k25", "tied", "sharded"):
        path, config, state = quantplug_tiny_checkpoint(layout, num_hidden_layers=2)
        model = quantplug.load(path, plugin_manager=pm, progress=False)
        text = config.get("text_config", config)
        ref_state = {k.removeprefix("language_model."): v for k, v in state.items()
                     if not k.startswith(("vision_tower", "mm_projector"))}
        cfg = tiny_config(num_hidden_layers=2, tie_word_embeddings=bool(text.get("tie_word_embeddings")))
        with torch.no_grad():
            got = model(ids)
        ref = quantplug_reference(cfg, ref_state, ids)
        assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5, layout
    quantplug_distribution("probe-quant", "0.3", {"probe": "probe_quant"}, modules={"probe_quant": (
        "from quantplug.api import Claim, hookimpl\n"
        "@hookimpl\n"
        "def quantplug_detect(checkpoint):\n"
        "    return Claim('probe', None, 'probe') if checkpoint.config.get('probe') else None\n")})
    rec = {r.name: r for r in PluginManager(env={"QUANTPLUG_PLUGINS": "probe"}).records()}["probe"]
    assert rec.status == "active" and rec.distribution == "probe-quant" and rec.version == "0.3"
