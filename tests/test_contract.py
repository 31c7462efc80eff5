"""The versioned plugin contract and the public API (issue 15): contract checks, scope, the
architectures hook, refusals, scheme reasons, the import rule for bundled plugins."""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

import pytest
import quantplug
import quantplug.api as api
import torch
from quantplug.plan import build_plan
from quantplug.plugins import PluginManager
from quantplug.testing import random_state, tiny_config, write_checkpoint

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tiny_config()
    return write_checkpoint(tmp_path_factory.mktemp("dense"), cfg, random_state(cfg))


class Claimer:
    """A backend claiming every checkpoint (for hook tests)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @api.hookimpl
    def quantplug_detect(self, checkpoint):
        return api.Claim(self.name, None, "test claims everything")


# -- the import rule ------------------------------------------------------------------------------

def _quantplug_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "quantplug" or node.module.startswith("quantplug."):
                out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name == "quantplug" or a.name.startswith("quantplug.")]
    return out


def test_bundled_plugins_import_quantplug_only_through_the_api():
    bad = {}
    for path in sorted((ROOT / "plugins").glob("*/quantplug_*/**/*.py")):
        mods = [m for m in _quantplug_imports(path) if m != "quantplug.api"]
        if mods:
            bad[str(path.relative_to(ROOT))] = mods
    assert not bad, f"bundled plugins must import quantplug only through quantplug.api: {bad}"


def test_api_names_are_all_importable_and_documented():
    for name in api.__all__:
        obj = getattr(api, name)
        assert obj is not None, name
        if callable(obj) and not isinstance(obj, type(api.hookimpl)):
            assert (getattr(obj, "__doc__", "") or "").strip(), f"quantplug.api.{name} has no docstring"


def test_old_import_paths_keep_working():
    """Plugins written against what the README documented before 1.1 keep importing."""
    from quantplug import hookimpl
    from quantplug.errors import QuantplugError
    from quantplug.layers.linear import LinearScheme
    from quantplug.types import Claim, TensorSpec

    assert hookimpl is api.hookimpl and LinearScheme is api.LinearScheme
    assert Claim is api.Claim and TensorSpec is api.TensorSpec and QuantplugError is api.QuantplugError


def test_linear_scheme_required_methods_are_abstract():
    class NoDequant(api.LinearScheme):
        def tensor_specs(self, out_features, in_features):
            return []

    with pytest.raises(TypeError, match="dequantize"):
        NoDequant()  # type: ignore[abstract]


# -- contract versions ----------------------------------------------------------------------------

class _Versioned:
    def __init__(self, contract: str) -> None:
        self.QUANTPLUG_CONTRACT = contract

    @api.hookimpl
    def quantplug_detect(self, checkpoint):
        return None


@pytest.mark.parametrize("contract, ok, why", [
    ("1.0", True, ""), (api.CONTRACT_VERSION, True, ""),
    ("2.0", False, "major versions differ"), ("1.99", False, "newer than this quantplug"),
    ("one", False, "expected a string 'MAJOR.MINOR'"),
])
def test_contract_version_checked_at_register(contract, ok, why):
    pm = PluginManager(entry_points=False, env={})
    if ok:
        pm.register(_Versioned(contract), "v")
        assert pm.active() == ["v"]
    else:
        with pytest.raises(api.PluginLoadError, match=why):
            pm.register(_Versioned(contract), "v")


def _install_dist(root: Path, dist: str, module: str, source: str, requires: str = "") -> None:
    """A throwaway installed distribution: a module and its dist-info with one entry point."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    meta = f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n" + (f"Requires-Dist: {requires}\n" if requires else "")
    (info / "METADATA").write_text(meta)
    (info / "entry_points.txt").write_text(f"[quantplug.backends]\n{module} = {module}\n")


@pytest.mark.parametrize("contract, requires, status, why", [
    ("1.1", "quantplug>=0.2", "active", None),
    ("3.0", "", "failed", "major versions differ"),
    ("1.1", "quantplug<0.2", "failed", "requires 'quantplug<0.2'"),
])
def test_entry_point_plugin_with_incompatible_contract_is_listed_failed(tmp_path, monkeypatch, contract, requires,
                                                                       status, why):
    module = f"qp_contract_probe_{contract.replace('.', '_')}_{status}"
    src = (f"from quantplug.api import hookimpl\nQUANTPLUG_CONTRACT = {contract!r}\n"
           "@hookimpl\ndef quantplug_detect(checkpoint):\n    return None\n")
    _install_dist(tmp_path, module.replace("_", "-"), module, src, requires)
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = PluginManager(env={"QUANTPLUG_PLUGINS": module})
    [rec] = [r for r in pm.records() if r.name == module]
    assert rec.status == status, rec
    if why:
        assert why in (rec.error or "")
    sys.modules.pop(module, None)


def test_deprecated_export_argument_warns_at_register():
    class OldExporter(Claimer):
        @api.hookimpl
        def quantplug_export(self, model, model_config, destination):
            return None

    pm = PluginManager(entry_points=False, env={})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.register(OldExporter("old"), "old")
    assert any("plan.model_config" in str(w.message) for w in caught)


# -- scope ----------------------------------------------------------------------------------------

def test_backend_hooks_cannot_be_called_on_every_plugin():
    pm = PluginManager(entry_points=False, env={})
    with pytest.raises(api.QuantplugError, match="backend hook"):
        pm.call("quantplug_linear_scheme", None, firstresult=True, layer_name="x")
    with pytest.raises(api.QuantplugError, match="one backend"):
        pm.call("quantplug_linear_scheme", ["a", "b"], firstresult=True, layer_name="x")
    with pytest.raises(api.QuantplugError, match="not a hook"):
        pm.call("quantplug_nonsense", None, firstresult=False)


def test_error_raised_in_detect_names_the_plugin(ckpt):
    class Broken:
        @api.hookimpl
        def quantplug_detect(self, checkpoint):
            raise api.ConfigError("quantization_config.bits must be 4")

    pm = PluginManager(entry_points=False, env={})
    pm.register(Broken(), "broken", distribution="broken-dist", version="3")
    with pytest.raises(api.ConfigError, match=r"plugin broken \(broken-dist 3\) in quantplug_detect: "
                                              r"quantization_config.bits"):
        quantplug.plan(ckpt, plugin_manager=pm)


# -- plan(plugin_manager=), scheme reasons, refusals ----------------------------------------------

def test_plan_takes_a_plugin_manager_and_records_scheme_reasons(ckpt):
    class Row8(api.LinearScheme):
        name = "row8"

        def __init__(self, why: str) -> None:
            self.reason = why

        def tensor_specs(self, out_features, in_features):
            return [api.TensorSpec("weight", api.FLOATS, (out_features, in_features))]

        def dequantize(self, layer, index=None):
            return layer.weight if index is None else layer.weight[index]

    class Reasoned(Claimer):
        @api.hookimpl
        def quantplug_linear_scheme(self, layer_name, layer_kind):
            return Row8("config group 0 targets o_proj") if layer_name.endswith("o_proj") else None

    pm = PluginManager(entry_points=False, env={})
    pm.register(Reasoned("reasoned"), "reasoned")
    plan = quantplug.plan(ckpt, plugin_manager=pm)
    [d] = [d for d in plan.decisions_for("model.layers.0.self_attn.o_proj") if d.hook == "quantplug_linear_scheme"]
    assert d.value == "row8" and d.reason == "linear: config group 0 targets o_proj" and d.plugin.name == "reasoned"


def test_refuse_is_one_plan_problem_naming_layer_and_field(ckpt):
    class Refuser(Claimer):
        @api.hookimpl
        def quantplug_linear_scheme(self, layer_name, layer_kind):
            if layer_name == "model.layers.1.self_attn.q_b_proj":
                return api.refuse(layer_name, "config_groups.group_0.weights.actorder", "'group' is not supported")
            return None

    pm = PluginManager(entry_points=False, env={})
    pm.register(Refuser("refuser"), "refuser")
    plan = build_plan(ckpt, plugin_manager=pm)
    [p] = plan.errors
    assert p.layer == "model.layers.1.self_attn.q_b_proj" and "actorder" in p.message and "silent dense" in p.message
    with pytest.raises(api.PlanError):
        plan.raise_for_problems()


# -- architectures --------------------------------------------------------------------------------

def test_plugin_adds_an_architecture(tmp_path):
    """The test architecture (tests/archs.py; under 2-rank tensor parallelism in tests/parallel)."""
    from archs import MyMLA, MyMLAPlugin

    cfg = tiny_config(architectures=["MyMLAForCausalLM"])
    path = write_checkpoint(tmp_path / "my", cfg, random_state(cfg))
    pm = PluginManager(entry_points=False, env={})
    with pytest.raises(api.UnknownArchitectureError, match="MyMLAForCausalLM"):
        build_plan(path, plugin_manager=pm)
    pm.register(MyMLAPlugin(), "arch")
    model = quantplug.load(path, plugin_manager=pm, progress=False)
    assert isinstance(model, MyMLA)
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, cfg["vocab_size"])


def test_architecture_clash_names_both(tmp_path, ckpt):
    from quantplug.models.deepseek import DeepseekV3ForCausalLM
    from quantplug.models.registry import ArchSpec

    class Arch:
        @api.hookimpl
        def quantplug_architectures(self):
            return {"DeepseekV3ForCausalLM": ArchSpec("DeepseekV3ForCausalLM", DeepseekV3ForCausalLM, False, ())}

    pm = PluginManager(entry_points=False, env={})
    pm.register(Arch(), "arch")
    with pytest.raises(api.QuantplugError, match=r"which quantplug \S+ \(entry point quantplug.architectures\) already defines"):
        build_plan(ckpt, plugin_manager=pm)


# -- dense_state ----------------------------------------------------------------------------------

def test_dense_state_round_trips_the_hub_layout(tmp_path):
    from quantplug.testing import wrap_kimi

    cfg = tiny_config()
    state = random_state(cfg, seed=3)
    wcfg, wstate = wrap_kimi(cfg, state, vision=False)
    path = write_checkpoint(tmp_path / "kimi", wcfg, wstate)
    model = quantplug.load(path, progress=False)
    got = api.dense_state(model)
    assert set(got) == set(wstate)
    for name, t in wstate.items():
        assert torch.equal(got[name], t.float()), name
    assert api.plan_of(model).prefix == "language_model"
    names = [n for n, _ in api.named_linears(model)]
    assert "language_model.lm_head" in names and not any(".experts." in n for n in names)


# -- messages a user can act on ------------------------------------------------------------------

def test_no_backend_error_says_fp8(tmp_path):
    cfg = tiny_config(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    state = random_state(cfg)
    name = "model.layers.0.self_attn.o_proj.weight"
    state[name] = state[name].to(torch.float8_e4m3fn)
    path = write_checkpoint(tmp_path / "fp8", cfg, state)
    pm = PluginManager(entry_points=False, env={})
    with pytest.raises(api.NoBackendError, match=r"1 tensor\(s\) are FP8 \(F8_E4M3; first: "
                                                 r"model.layers.0.self_attn.o_proj.weight.*quant_method 'fp8'"):
        build_plan(path, plugin_manager=pm)


def test_explain_accepts_tensor_names(ckpt, capsys):
    from quantplug.cli import main

    assert main(["explain", str(ckpt), "model.layers.1.self_attn.kv_b_proj.weight"]) == 0
    out = capsys.readouterr().out
    assert "linear_scheme" in out and "model.layers.1.self_attn.kv_b_proj" in out and "dense" in out


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_tensor_spec_shape_none_works_for_stacked_experts(tmp_path, layout):
    """A scheme may leave shapes to its own check(): stacked experts (hub slots, and fused
    gate_up_proj halves resolved from the header) load and compute as with explicit shapes."""
    from quantplug.testing import to_layout

    class Open(api.LinearScheme):
        name = "open-shape"

        def tensor_specs(self, out_features, in_features):
            return [api.TensorSpec("weight", api.FLOATS, None)]

        def dequantize(self, layer, index=None):
            return layer.weight if index is None else layer.weight[index]

    class OpenExperts(Claimer):
        @api.hookimpl
        def quantplug_linear_scheme(self, layer_kind):
            return Open() if layer_kind == "experts" else None

    cfg = tiny_config()
    state = random_state(cfg, seed=5)
    path = write_checkpoint(tmp_path / layout, cfg, to_layout(state, layout))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    ref = quantplug.load(path, plugin_manager=PluginManager(entry_points=False, env={}), progress=False)
    pm = PluginManager(entry_points=False, env={})
    pm.register(OpenExperts("open"), "open")
    model = quantplug.load(path, plugin_manager=pm, progress=False)
    assert "open-shape" in model.quantplug_plan.schemes().values()
    with torch.no_grad():
        # the open-shape experts run the scheme's torch path, the reference's the core's native
        # one: equal up to the order of float32 sums
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-5, atol=1e-6)


# -- contract hygiene (issue 23) --------------------------------------------------------------------

def test_every_installed_backend_declares_the_contract_of_what_it_uses():
    """Every bundled plugin and the example declare at least the version of each hook, api name and
    optional scheme member they use (before: modelopt, gptq and awq declared 1.1 and imported
    ``quantplug.api.Exclusions``, new in 1.4)."""
    import importlib.metadata as md

    from quantplug.testing.contract import features, shortfall

    eps = {ep.name: ep for ep in md.entry_points(group="quantplug.backends")}
    assert {"compressed_tensors", "expert_pack", "fp8", "gptq", "awq", "modelopt", "modelslim", "quark"} <= set(eps)
    for name, ep in sorted(eps.items()):
        plugin = ep.load()
        assert features(plugin), name
        assert shortfall(plugin) == [], (name, shortfall(plugin))


def test_contract_check_names_each_newer_feature(tmp_path, monkeypatch):
    pkg = tmp_path / "oldplug"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'from quantplug.api import Fields, LinearScheme, hookimpl\n'
        'QUANTPLUG_CONTRACT = "1.1"\n'
        'class S(LinearScheme):\n'
        '    def tensor_specs(self, o, i): return []\n'
        '    def dequantize(self, layer, index=None): return None\n'
        '    def form(self, layer): return None\n'
        '    def fuse(self, layers): return None\n'
        '@hookimpl\n'
        'def quantplug_options(): return []\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    from quantplug.testing.contract import shortfall

    found = shortfall(importlib.import_module("oldplug"))
    assert found == ["S.form needs contract 1.4, the plugin declares 1.1",
                     "S.fuse needs contract 1.2, the plugin declares 1.1",
                     "hook quantplug_options needs contract 1.4, the plugin declares 1.1",
                     "quantplug.api.Fields (__init__.py) needs contract 1.4, the plugin declares 1.1"], found


def test_hookspecs_prose_matches_the_hook_scopes():
    """The module docstring lists the global and the backend hooks (it once said quantplug_detect
    was the only global hook), and each hook's own docstring says its scope."""
    from quantplug import hookspecs

    doc = hookspecs.__doc__ or ""
    glob = doc.split("* **global** hooks", 1)[1].split("* **backend** hooks", 1)[0]
    back = doc.split("* **backend** hooks", 1)[1].split("\n\n", 1)[0]
    named = __import__("re").compile(r"``(quantplug_\w+)``")
    assert set(named.findall(glob)) == hookspecs.GLOBAL_HOOKS
    assert set(named.findall(back)) == hookspecs.BACKEND_HOOKS
    assert set(PluginManager.hook_names()) == hookspecs.GLOBAL_HOOKS | hookspecs.BACKEND_HOOKS
    for name in hookspecs.GLOBAL_HOOKS:
        assert "Global hook" in getattr(hookspecs, name).__doc__, name
    for name in hookspecs.BACKEND_HOOKS - {"quantplug_export"}:
        assert "Backend hook" in getattr(hookspecs, name).__doc__, name


def test_core_docs_cite_no_file_outside_the_project():
    """A ``NAME.md`` cited in the core's docstrings or comments is a file of this project (hookspecs
    cited DESIGN.md, which lives outside it); ``owner/repo path.md`` names another project's."""
    import re

    ours = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    for f in (ROOT / "core").rglob("*.py"):
        for m in re.finditer(r"(?<![\w/.-])([A-Za-z_][\w-]*\.md)\b", f.read_text()):
            assert m.group(1) in ours, f"{f.relative_to(ROOT)} cites {m.group(1)}, which is not in the project"


def test_api_since_names_exist():
    from quantplug import hookspecs
    from quantplug.layers.linear import LinearScheme

    assert set(hookspecs.API_SINCE) <= set(api.__all__)
    assert all(hasattr(LinearScheme, m) for m in hookspecs.SCHEME_SINCE if m != "reason")


def test_stored_dtype_reads_weights_and_fused_expert_stacks(tmp_path):
    cfg = tiny_config(num_hidden_layers=2)
    path = write_checkpoint(tmp_path / "f", cfg, random_state(cfg, layout="fused"))
    ckpt = api.Checkpoint.open(path)
    assert api.stored_dtype(ckpt, "model.layers.0.self_attn.q_a_proj") == ("F32", False)
    assert api.stored_dtype(ckpt, "model.layers.1.mlp.experts.gate_up_proj") == ("F32", True)
    assert api.stored_dtype(ckpt, "model.layers.1.mlp.experts.0.gate_proj") == (None, False)


def test_the_api_imports_nothing_from_the_test_kit():
    """quantplug.api is what plugins build on; the test kit (pytest, transformers references) is
    not part of it: no import of quantplug.testing in api.py, at module level or inside a function."""
    import ast

    tree = ast.parse((ROOT / "core" / "api.py").read_text())
    bad = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
           and (n.module or "").split(".")[0] == "testing" or isinstance(n, ast.ImportFrom) and n.module
           and "testing" in n.module.split(".")]
    assert not bad, bad


# -- module state: declared fields, not ad-hoc attributes (issue 33 item 2) -----------------------

#: ``qp_`` attributes core sets on things that are not modules, and why
_QP_NOT_MODULE_STATE = {"qp_answer": "hookspecs.answers marks hook-spec functions, not modules"}


def _base_names(node: ast.ClassDef) -> list[str]:
    out = []
    for b in node.bases:
        b = b.value if isinstance(b, ast.Subscript) else b
        if isinstance(b, ast.Name):
            out.append(b.id)
        elif isinstance(b, ast.Attribute):
            out.append(b.attr)
    return out


def undeclared_qp_assignments(root: Path) -> list[str]:
    """Every assignment of a ``qp_*`` attribute in the Python files under ``root`` that no class
    there declares: ``self.qp_x = ...`` in a method of class C must be declared (annotated or
    assigned in a class body, or a method) by C or one of its bases defined under ``root``; any
    other target (``mod.qp_x = ...``, ``setattr(mod, "qp_x", ...)``, ``object.__setattr__``) by
    some class under ``root`` (its type is not known statically; a runtime check covers it)."""
    declares: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    found: list[tuple[str, str | None, str, str]] = []  # (where, class if self.<name>, object, name)
    Assign, AnnAssign, AugAssign, Call, ClassDef = ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Call, ast.ClassDef
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if "qp_" not in text:
            # only files that mention qp_ can assign or declare one (parsing all of core takes
            # seconds); a base class in such a file ends a chain early: a false failure, never a false pass
            continue
        rel = path.relative_to(root.parent)
        stack: list[tuple[ast.AST, str | None]] = [(ast.parse(text, str(path)), None)]
        while stack:
            node, cls = stack.pop()
            for child in ast.iter_child_nodes(node):
                kind = type(child)
                if kind is ClassDef:
                    assert isinstance(child, ast.ClassDef)
                    names = declares.setdefault(child.name, set())
                    bases.setdefault(child.name, []).extend(_base_names(child))
                    for item in child.body:
                        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            names.add(item.target.id)
                        elif isinstance(item, ast.Assign):
                            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                        elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                            names.add(item.name)
                    stack.append((child, child.name))
                    continue
                targets: list[tuple[ast.AST, str]] = []
                if kind is Assign or kind is AnnAssign or kind is AugAssign:
                    for t in child.targets if isinstance(child, ast.Assign) else [child.target]:
                        for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                            if isinstance(e, ast.Attribute) and e.attr.startswith("qp_"):
                                targets.append((e.value, e.attr))
                elif kind is Call:
                    assert isinstance(child, ast.Call)
                    f, args = child.func, child.args
                    if ((isinstance(f, ast.Attribute) and f.attr == "__setattr__" or isinstance(f, ast.Name)
                         and f.id == "setattr") and len(args) >= 2 and isinstance(args[1], ast.Constant)
                            and str(args[1].value).startswith("qp_")):
                        targets.append((args[0], str(args[1].value)))
                for obj, name in targets:
                    own = cls if isinstance(obj, ast.Name) and obj.id == "self" else None
                    found.append((f"{rel}:{child.lineno}", own, ast.unparse(obj), name))
                stack.append((child, cls))
    anywhere = set().union(*declares.values())

    def declared_on(c: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
        if c in seen or c not in declares:
            return False
        return name in declares[c] or any(declared_on(b, name, seen | {c}) for b in bases[c])

    bad = []
    for where, own, obj, name in found:
        if name in _QP_NOT_MODULE_STATE:
            continue
        if own is not None and not declared_on(own, name):
            bad.append(f"{where}: {obj}.{name} (class {own} nor its bases declare it)")
        elif own is None and name not in anywhere:
            bad.append(f"{where}: {obj}.{name} (no class declares it)")
    return bad


def test_core_sets_no_undeclared_qp_attribute():
    """Issue 33: module state is declared fields (or protocols), not ad-hoc ``qp_*`` attributes:
    every ``qp_*`` attribute core assigns is declared on a class. Before: 39 distinct names,
    several (the loader's qp_served_params on the model, per-model settings through setattr)
    declared nowhere."""
    assert undeclared_qp_assignments(ROOT / "core") == []


def test_the_qp_scan_finds_an_ad_hoc_attribute(tmp_path):
    pkg = tmp_path / "core"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "class Layer:\n    qp_native = None\n    qp_done: bool\n"
        "    def __init__(self):\n        self.qp_native = 1\n        self.qp_done = True\n        self.qp_extra = 2\n"
        "class Sub(Layer):\n    def f(self):\n        self.qp_native, self.qp_more = 1, 2\n"
        "def load(model, mod):\n    model.qp_served = set()\n    mod.qp_native = 3\n"
        "    setattr(mod, 'qp_mode', 1)\n    object.__setattr__(mod, 'qp_done', 1)\n")
    assert sorted(b.split(": ", 1)[1] for b in undeclared_qp_assignments(pkg)) == sorted([
        "self.qp_extra (class Layer nor its bases declare it)", "self.qp_more (class Sub nor its bases declare it)",
        "model.qp_served (no class declares it)", "mod.qp_mode (no class declares it)"])


def test_loaded_modules_hold_only_declared_qp_state(ckpt):
    """The runtime side of the scan above: after a load (experts served from the files, so the
    expert stores attach), every ``qp_*`` entry of a module's ``__dict__`` is declared on its class
    (a class attribute or an annotation somewhere in its MRO), and the model carries none of its own."""
    model = quantplug.load(ckpt, progress=False, options={"expert_cache_mb": 64})
    undeclared = [(name, attr) for name, m in model.named_modules() for attr in vars(m)
                  if attr.startswith("qp_") and not any(attr in vars(c) or attr in vars(c).get("__annotations__", {})
                                                        for c in type(m).__mro__)]
    assert undeclared == []
    assert any(getattr(m, "qp_store", None) is not None for m in model.modules())  # the stores did attach
    # what the loader fills on the model itself: declared fields of its class, each set
    loaded = ("quantplug_plan", "decisions", "load_report", "load_seconds", "quantplug_stats")
    assert all(any(a in vars(c).get("__annotations__", {}) for c in type(model).__mro__) for a in loaded)
    assert all(getattr(model, a) is not None for a in loaded)
