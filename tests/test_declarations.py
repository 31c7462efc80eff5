"""What an architecture declares for the core to read (``quantplug.models.declarations``): the
tensor-parallel plan and the dense-state mapping of an architecture added by a plugin, checked
from headers and in one process (the ranks themselves: tests/parallel); typed StackedLinear
layouts and the open-shape fused part of a Source."""

from __future__ import annotations

import warnings
from pathlib import Path

import archs
import pytest
import quantplug
import quantplug.api as api
import torch
from quantplug.errors import QuantplugError
from quantplug.plugins import PluginManager
from quantplug.testing import random_state, tiny_config, to_layout, write_checkpoint
from torch import nn


def _pm(*plugins: object) -> PluginManager:
    pm = PluginManager(entry_points=False, env={})
    for p in plugins:
        pm.register(p, getattr(p, "name", type(p).__name__.lower()))
    return pm


@pytest.fixture(scope="module")
def tinymoe(tmp_path_factory):
    cfg = tiny_config(architectures=["TinyMoEForCausalLM"])
    state = archs.tiny_moe_state(cfg, seed=2)
    return write_checkpoint(tmp_path_factory.mktemp("tinymoe"), cfg, state), state


def test_a_plugin_architecture_plans_its_declared_split(tinymoe):
    path, _ = tinymoe
    p = quantplug.plan(path, world_size=2, rank=1, plugin_manager=_pm(archs.TinyMoEPlugin()))
    dec = {d.target: d for d in p.decisions if d.hook == "tensor_parallel"}
    assert dec["embed"].value == "vocab-parallel" and dec["head"].value == "column-parallel"
    assert dec["model.layers.0.attn.k_proj"].value == "column-parallel"
    assert dec["model.layers.2.attn.o_proj"].value == "row-parallel"
    assert dec["model.layers.0.ffn.up_proj"].value == "column-parallel"
    assert dec["model.layers.1.ffn.experts"].value == "expert-parallel"
    m = p.model
    # the module interfaces were told what this rank holds: heads [2, 4), experts [4, 8)
    assert m.blocks[0].attn.num_heads == 2 and m.blocks[0].attn.q_proj.out_features == 32
    ex = m.blocks[1].ffn.experts
    assert (ex.first, ex.count, ex.slot_base, ex.gate_proj.n) == (4, 4, 4, 4) and ex.reduce is not None
    src = next(pp for pp in p.params if pp.param == "blocks.0.attn.o_proj.weight").sources[0][0]
    assert src.slices == ((1, 32, 32),)  # rank 1 of 2: input columns 32..64


def test_dense_state_of_a_plugin_architecture(tinymoe):
    path, state = tinymoe
    model = quantplug.load(path, plugin_manager=_pm(archs.TinyMoEPlugin()), progress=False)
    got = api.dense_state(model)
    assert set(got) == set(state)  # experts back to one tensor per expert (Unstack)
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_the_deepseek_declarations_fold_split_kv_and_unstack_experts():
    from quantplug.models.deepseek import DeepseekV3ForCausalLM

    rules = DeepseekV3ForCausalLM.qp_dense_state
    assert {type(r) for r in rules.values()} == {api.Unstack, api.FoldHeads}
    assert rules["model.layers.*.self_attn"] == api.FoldHeads(
        "kv_b_proj", (api.HeadPart("k_b", transpose=True), api.HeadPart("v_b")))


class _Named(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for k, v in children.items():
            setattr(self, k, v)


def _lin(name: str) -> api.QuantLinear:
    return api.QuantLinear(8, 8, api.DenseScheme(), name, torch.float32)


def _root(plan: dict, **children: nn.Module) -> nn.Module:
    cls = type("Root", (_Named,), {"qp_tp_plan": plan})
    return cls(**children)


def test_declaration_errors_name_the_class_pattern_and_module():
    from quantplug.models.declarations import declared

    styles = (api.FeatureParallel, api.HeadParallel, api.ColumnParallel)
    mlp = api.FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",))
    half = _root({"mlp": mlp}, mlp=_Named(gate_proj=_lin("g"), down_proj=_lin("d")))
    with pytest.raises(api.DeclarationError, match=r"Root.qp_tp_plan\['mlp'\]: mlp holds \['gate_proj', 'down_proj'\]"):
        list(declared(half, "qp_tp_plan", styles))
    twice = _root({"a.*": api.ColumnParallel(), "*.b": api.ColumnParallel()}, a=_Named(b=_lin("ab")))
    with pytest.raises(api.DeclarationError, match=r"a.b is named by \['a.\*', '\*.b'\]"):
        list(declared(twice, "qp_tp_plan", styles))
    wrong = _root({"x": "colwise"}, x=_lin("x"))
    with pytest.raises(api.DeclarationError, match=r"Root.qp_tp_plan\['x'\] is str"):
        list(declared(wrong, "qp_tp_plan", styles))
    # a module without the members of an entry is not that role: nothing applies
    moe = _root({"mlp": mlp}, mlp=_Named(experts=_lin("e")))
    assert list(declared(moe, "qp_tp_plan", styles)) == []


def test_a_head_group_must_implement_its_interface(tinymoe, monkeypatch):
    path, _ = tinymoe
    monkeypatch.delattr(archs.Attention, "qp_hold_heads")
    with pytest.raises(api.DeclarationError, match="blocks.0.attn .Attention. is split by HeadParallel but does not "
                                                   "implement qp_heads / qp_hold_heads"):
        quantplug.plan(path, world_size=2, plugin_manager=_pm(archs.TinyMoEPlugin()))


def test_an_architecture_without_a_plan_is_replicated(tmp_path):
    cfg = tiny_config(architectures=["TinyMoEForCausalLM"])
    path = write_checkpoint(tmp_path / "t", cfg, archs.tiny_moe_state(cfg))

    class Undeclared(archs.TinyMoE):
        qp_tp_plan: dict = {}

    class Plugin:
        @api.hookimpl
        def quantplug_architectures(self):
            return {"TinyMoEForCausalLM": api.ArchSpec("TinyMoEForCausalLM", Undeclared, False, ())}

    p = quantplug.plan(path, world_size=2, plugin_manager=_pm(Plugin()))
    assert p.parallel is not None and p.parallel.sharded_bytes == 0
    assert all(pp.sources[0][0].slices is None for pp in p.params)


# -- typed StackedLinear layouts and the open-shape fused part ---------------------------------------

def test_tuple_layouts_still_work_with_a_deprecation_warning():
    scheme = api.DenseScheme()
    cases = [(("fused", "x.gate_up_proj", (1, 2)), api.FusedLayout("x.gate_up_proj", 1, 2)),
             (("per_index", ["x.0.p", "x.1.p"]), api.PerIndexLayout(("x.0.p", "x.1.p"))),
             (("stacked", "x.p"), api.StackedLayout("x.p"))]
    for old, new in cases:
        with pytest.warns(DeprecationWarning, match="tagged tuples are deprecated"):
            a = api.StackedLinear(2, 4, 3, scheme, "x.p", old, torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            b = api.StackedLinear(2, 4, 3, scheme, "x.p", new, torch.float32)
        assert a.layout == new and a.qp_sources == b.qp_sources
    with pytest.raises(api.QuantplugError, match="expected FusedLayout, PerIndexLayout or StackedLayout"), \
            pytest.warns(DeprecationWarning):
        api.StackedLinear(2, 4, 3, scheme, "x.p", ("glued", "x"), torch.float32)
    with pytest.raises(api.QuantplugError, match="part 2 of 2"):
        api.FusedLayout("x", 2, 2)


class _OpenShape(api.DenseScheme):
    """Dense weights whose spec leaves the shape to the header (as a scheme checking shapes itself)."""

    name = "open"

    def tensor_specs(self, out_features, in_features):
        return [api.TensorSpec("weight", api.FLOATS, None)]


class _OpenExperts:
    name = "open"

    @api.hookimpl
    def quantplug_detect(self, checkpoint):
        return api.Claim("open", None, "test")

    @api.hookimpl
    def quantplug_linear_scheme(self, layer_kind):
        return _OpenShape() if layer_kind == "experts" else None


def test_a_fused_part_of_open_shape_is_resolved_from_the_header(tmp_path):
    cfg = tiny_config()
    state = random_state(cfg, seed=4)
    path = write_checkpoint(tmp_path / "fused", cfg, to_layout(state, "fused"))
    p = quantplug.plan(path, plugin_manager=_pm(_OpenExperts()))
    up = next(pp for pp in p.params if pp.param == "model.layers.1.mlp.experts.up_proj.weight")
    declared_src = p.model.model.layers[1].mlp.experts.up_proj.qp_sources["weight"][0]
    assert declared_src.part == (1, 1, 2) and declared_src.narrow is None  # rows unknown until the header
    src = up.sources[0][0]
    assert src.part is None and src.narrow == (1, 32, 32)  # part 1 of 2 of gate_up_proj's 64 rows
    ref = quantplug.load(write_checkpoint(tmp_path / "hub", cfg, state), progress=False)
    got = quantplug.load(path, plugin_manager=_pm(_OpenExperts()), progress=False)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.allclose(got(ids), ref(ids), atol=1e-5)
    # rows that do not halve: a shape problem naming the tensor, before any data is read
    bad = dict(to_layout(state, "fused"))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    bad[name] = bad[name][:, :-1]
    with pytest.raises(api.PlanError, match="axis 1 does not split into 2 equal parts"):
        quantplug.plan(write_checkpoint(tmp_path / "bad", cfg, bad), plugin_manager=_pm(_OpenExperts())).raise_for_problems()


# -- engine mappings (qp_engine_plan) ---------------------------------------------------------------

def test_bridge_and_parallel_know_no_model_class():
    """The engine bridge and the tensor-parallel loader read declarations only: neither imports
    an architecture's module."""
    import ast

    import quantplug.bridge
    import quantplug.parallel

    for mod in (quantplug.bridge, quantplug.parallel):
        tree = ast.parse(Path(mod.__file__).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any("deepseek" in m or "kimi" in m for m in imported), (mod.__name__, imported)


def test_engine_plan_names_the_merged_projections_and_refuses_unsupported_members(tmp_path):
    """A model class that is not DeepSeek's MLA class, declaring the same engine plan, is mapped
    the same way; a member the plan marks unsupported is refused by name."""
    from quantplug import bridge
    from quantplug.models import deepseek
    from quantplug.models.declarations import EngineLatentAttention

    cfg = tiny_config()
    path = write_checkpoint(tmp_path / "ck", cfg, random_state(cfg))
    model = quantplug.load(path)
    names = set(bridge.planned_modules(model))
    assert {"model.layers.0.self_attn.fused_qkv_a_proj", "model.layers.0.mlp.gate_up_proj",
            "model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.1.mlp.experts"} <= names
    assert set(bridge.absorbed_attention(model)) == {f"model.layers.{i}.self_attn" for i in range(cfg["num_hidden_layers"])}

    plan = dict(deepseek.DeepseekV3ForCausalLM.qp_engine_plan)
    plan["model.layers.*.self_attn"] = EngineLatentAttention(unsupported=(("o_proj", "no place for it here"),))
    sub = type("Sub", (deepseek.DeepseekV3ForCausalLM,), {"qp_engine_plan": plan})
    model.__class__ = sub
    with pytest.raises(QuantplugError, match=r"model\.layers\.0\.self_attn\.o_proj: no place for it here"):
        bridge.planned_modules(model)
    plan.pop("model.layers.*.mlp")
    plan["model.layers.*.self_attn"] = deepseek.DeepseekV3ForCausalLM.qp_engine_plan["model.layers.*.self_attn"]
    assert "model.layers.0.mlp.gate_up_proj" not in bridge.planned_modules(model)  # undeclared: not merged
