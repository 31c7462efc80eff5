"""Inventory problems are reported at plan time, all together, naming tensor and file, with no
tensor data read."""

from __future__ import annotations

import json

import pytest
import quantplug
import torch
from quantplug.checkpoint import Checkpoint
from quantplug.errors import CheckpointError, PlanError, QuantplugError
from quantplug.testing import random_state, tiny_config, write_checkpoint


@pytest.fixture(autouse=True)
def no_data_reads(monkeypatch):
    def boom(self, info):
        raise AssertionError(f"tensor data of {info.name} was read at plan time")

    monkeypatch.setattr(Checkpoint, "raw", boom)
    monkeypatch.setattr(Checkpoint, "tensor", boom)


def _write(tmp_path, mutate=None, **kw):
    cfg = tiny_config()
    state = random_state(cfg)
    if mutate:
        mutate(state)
    return write_checkpoint(tmp_path / "c", cfg, state, **kw)


def test_missing_tensor(tmp_path):
    path = _write(tmp_path, lambda s: s.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    with pytest.raises(PlanError) as e:
        quantplug.plan(path)
    assert "model.layers.1.self_attn.kv_b_proj.weight" in str(e.value)
    assert "missing" in str(e.value)


def test_extra_tensor(tmp_path):
    path = _write(tmp_path, lambda s: s.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(PlanError) as e:
        quantplug.plan(path)
    assert "model.layers.0.mystery.weight" in str(e.value) and "unexpected" in str(e.value)
    assert "model.safetensors" in str(e.value)


def test_wrong_shape(tmp_path):
    path = _write(tmp_path, lambda s: s.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 64)))
    with pytest.raises(PlanError) as e:
        quantplug.plan(path)
    msg = str(e.value)
    assert "model.layers.0.self_attn.o_proj.weight" in msg and "[64, 64]" in msg and "[64, 128]" in msg


class ClaimAll:
    """A backend that claims everything and leaves every decision to the core defaults."""

    @quantplug.hookimpl
    def quantplug_detect(self, checkpoint):
        return quantplug.types.Claim("claimall", None, "test backend")


def test_wrong_dtype(tmp_path):
    from quantplug.plan import build_plan
    from quantplug.plugins import PluginManager

    path = _write(tmp_path, lambda s: s.__setitem__(
        "model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 128, dtype=torch.int8)))
    pm = PluginManager(entry_points=False, env={})
    pm.register(ClaimAll(), "claimall")
    p = build_plan(path, plugin_manager=pm)
    assert [x.kind for x in p.errors] == ["dtype"]
    msg = p.errors[0].describe()
    assert "model.layers.0.self_attn.o_proj.weight" in msg and "I8" in msg and "dense" in msg


def test_all_problems_reported_together(tmp_path):
    def mutate(s):
        s.pop("model.norm.weight")
        s["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
        s["junk"] = torch.zeros(1)

    with pytest.raises(PlanError) as e:
        quantplug.plan(_write(tmp_path, mutate))
    kinds = sorted(p.kind for p in e.value.problems)
    assert kinds == ["missing", "shape", "unexpected"]


def test_shard_missing_from_disk(tmp_path):
    path = _write(tmp_path, shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        quantplug.plan(path)


def test_file_not_in_index_and_name_in_two_shards(tmp_path):
    path = _write(tmp_path, shards=2)
    idx = json.loads((path / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    other = "model-00002-of-00002.safetensors" if idx["weight_map"][name].endswith("1-of-00002.safetensors") else \
        "model-00001-of-00002.safetensors"
    idx["weight_map"][name] = other
    (path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        quantplug.plan(path)
    (path / "stray.safetensors").write_bytes((path / other).read_bytes())
    with pytest.raises(CheckpointError, match="stray.safetensors"):
        quantplug.plan(path)


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_safetensors(tmp_path, damage):
    path = _write(tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        quantplug.plan(path)


def test_unknown_architecture_and_bad_config(tmp_path):
    path = _write(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(QuantplugError, match="LlamaForCausalLM"):
        quantplug.plan(path)
    (path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json"):
        quantplug.plan(path)


def test_nonfloat_without_backend(tmp_path):
    from quantplug.errors import NoBackendError
    from quantplug.plan import build_plan
    from quantplug.plugins import PluginManager

    path = _write(tmp_path, lambda s: s.__setitem__("model.layers.0.self_attn.o_proj.weight",
                                                    torch.zeros(64, 128, dtype=torch.int8)))
    with pytest.raises(NoBackendError, match="o_proj.weight is I8"):
        build_plan(path, plugin_manager=PluginManager(entry_points=False, env={}))
