"""The ``quantplug.architectures`` entry-point group: the core's own architectures register
there as a third party's do, and a broken registration is named, not fatal."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import quantplug
from quantplug import api
from quantplug.models import registry
from quantplug.plan import build_plan
from quantplug.testing import random_state, tiny_config, write_checkpoint


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """Install a distribution (metadata only) whose entry points are ``lines``; the registry is
    read again with it and restored afterwards."""

    def make(name: str, lines: str, module: str = "") -> None:
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[quantplug.architectures]\n{lines}\n")
        if module:
            (tmp_path / f"{name}_mod.py").write_text(module)
        monkeypatch.syspath_prepend(str(tmp_path))
        registry.registered.cache_clear()

    yield make
    sys.modules.pop("fakearch_mod", None)
    registry.registered.cache_clear()


def test_core_architectures_come_from_the_entry_point_group():
    reg = registry.registered()
    for name, spec in registry.ARCHITECTURES.items():
        assert reg.specs[name] is spec
        assert reg.owners[name].startswith("quantplug ")
    assert not reg.failures


def test_a_registered_architecture_is_built(tmp_path, fake_dist):
    fake_dist("fakearch", "MyV3ForCausalLM = fakearch_mod:SPEC", module=(
        "from quantplug import api\n"
        "from quantplug.models.deepseek import DeepseekV3ForCausalLM\n"
        "class My(DeepseekV3ForCausalLM):\n    pass\n"
        "SPEC = api.ArchSpec('MyV3ForCausalLM', My, False, ())\n"))
    cfg = tiny_config()
    cfg["architectures"] = ["MyV3ForCausalLM"]
    path = write_checkpoint(tmp_path / "ck", cfg, random_state(cfg))
    assert registry.registered().owners["MyV3ForCausalLM"] == "fakearch 1.0"
    plan = build_plan(path)
    assert plan.architecture == "MyV3ForCausalLM"


@pytest.mark.parametrize("value, expected", [
    ("fakearch_mod:MISSING", "import failed: AttributeError"),
    ("no_such_module_qp:SPEC", "import failed: ModuleNotFoundError"),
    ("fakearch_mod:NOT_A_SPEC", "is a dict, expected a quantplug.api.ArchSpec"),
    ("fakearch_mod:OTHER_NAME", "is ArchSpec 'Other'; an entry point's name must be its architecture"),
])
def test_a_broken_registration_is_named_when_its_architecture_is_asked_for(tmp_path, fake_dist, value, expected):
    fake_dist("fakearch", f"BrokenForCausalLM = {value}", module=(
        "from quantplug import api\n"
        "from quantplug.models.deepseek import DeepseekV3ForCausalLM\n"
        "NOT_A_SPEC = {}\n"
        "OTHER_NAME = api.ArchSpec('Other', DeepseekV3ForCausalLM, False, ())\n"))
    reg = registry.registered()
    assert "BrokenForCausalLM" not in reg.specs
    assert "DeepseekV3ForCausalLM" in reg.specs  # the others still load
    with pytest.raises(api.UnknownArchitectureError) as e:
        registry.get_arch({"architectures": ["BrokenForCausalLM"]})
    assert "fakearch 1.0" in str(e.value) and expected in str(e.value) and value in str(e.value)


def test_a_name_two_distributions_register_is_refused(fake_dist):
    fake_dist("fakearch", "DeepseekV3ForCausalLM = fakearch_mod:SPEC", module=(
        "from quantplug import api\n"
        "from quantplug.models.deepseek import DeepseekV3ForCausalLM\n"
        "SPEC = api.ArchSpec('DeepseekV3ForCausalLM', DeepseekV3ForCausalLM, False, ())\n"))
    with pytest.raises(api.UnknownArchitectureError, match="already registered by"):
        registry.get_arch({"architectures": ["DeepseekV3ForCausalLM"]})


def test_stale_metadata_is_explained(monkeypatch):
    monkeypatch.setattr(registry, "registered", lambda: registry.Registered({}, {}, {}))
    with pytest.raises(api.UnknownArchitectureError, match="installed metadata is stale"):
        registry.get_arch({"architectures": ["DeepseekV3ForCausalLM"]})


def test_an_architecture_declares_its_config_schema(tmp_path):
    """``ArchSpec.config`` parses config.json for its architecture (here: one that accepts only
    an extra key the core's parser ignores, and refuses a config without it)."""
    from quantplug.errors import ConfigError
    from quantplug.models.config import parse_model_config
    from quantplug.models.deepseek import DeepseekV3ForCausalLM
    from quantplug.plugins import PluginManager

    def parse(config, arch, wrapped, file):
        if config.get("acme_flavour") != "plain":
            raise ConfigError(f"{file}: acme_flavour must be 'plain'")
        return parse_model_config(config, arch, wrapped, file)

    class Plugin:
        @api.hookimpl
        def quantplug_architectures(self):
            return {"AcmeForCausalLM": api.ArchSpec("AcmeForCausalLM", DeepseekV3ForCausalLM, False, (), parse)}

    pm = PluginManager(entry_points=False, env={})
    pm.register(Plugin(), "acme")
    cfg = tiny_config()
    cfg["architectures"] = ["AcmeForCausalLM"]
    path = write_checkpoint(tmp_path / "ck", cfg, random_state(cfg))
    with pytest.raises(ConfigError, match="acme_flavour must be 'plain'"):
        build_plan(path, plugin_manager=pm)
    import json
    conf = json.loads((Path(path) / "config.json").read_text())
    conf["acme_flavour"] = "plain"
    (Path(path) / "config.json").write_text(json.dumps(conf))
    assert build_plan(path, plugin_manager=pm).model_config.architecture == "AcmeForCausalLM"


def test_an_architecture_declares_its_cache(tmp_path):
    """``qp_new_cache(batch, capacity, limit)`` on the text model is the cache generation uses; the
    same tokens as the default cache when it builds the same layers."""
    import torch
    from quantplug.generate import MLACache, layer_cache
    from quantplug.models.deepseek import DeepseekV3ForCausalLM
    from quantplug.plugins import PluginManager

    made: list[tuple[int, int, int]] = []

    class OwnCache(DeepseekV3ForCausalLM):
        def qp_new_cache(self, batch, capacity, limit):
            made.append((batch, capacity, limit))
            emb = self.model.embed_tokens
            return MLACache([layer_cache(layer.self_attn, batch, capacity, limit, dtype=emb.model_dtype,
                                         device=torch.device("cpu")) for layer in self.model.layers])

    class Plugin:
        @api.hookimpl
        def quantplug_architectures(self):
            return {"OwnCacheForCausalLM": api.ArchSpec("OwnCacheForCausalLM", OwnCache, False, ())}

    pm = PluginManager(entry_points=False, env={})
    pm.register(Plugin(), "own")
    cfg = tiny_config()
    state = random_state(cfg)
    plain = quantplug.load(write_checkpoint(tmp_path / "a", cfg, state))
    cfg["architectures"] = ["OwnCacheForCausalLM"]
    own = quantplug.load(write_checkpoint(tmp_path / "b", cfg, state), plugin_manager=pm)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(own.generate(ids, 5, eos_token_id=None), plain.generate(ids, 5, eos_token_id=None))
    assert len(made) == 1 and made[0][:2] == (1, 9) and made[0][2] >= 9
