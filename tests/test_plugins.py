"""The plugin contract and manager: registration, validation, scoping, provenance, tracing,
and the real entry-point path a third-party vendor takes."""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import quantplug
from quantplug import hookimpl, hookspecs
from quantplug.errors import AmbiguousBackendError, NoBackendError, PluginLoadError
from quantplug.plan import build_plan
from quantplug.plugins import PluginManager
from quantplug.testing import random_state, tiny_config, write_checkpoint
from quantplug.types import AttentionLayout, Claim


@pytest.fixture
def ckpt(tmp_path):
    cfg = tiny_config(num_hidden_layers=2)
    return write_checkpoint(tmp_path / "c", cfg, random_state(cfg))


class Claimer:
    def __init__(self, name):
        self.name = name

    @hookimpl
    def quantplug_detect(self, checkpoint):
        return Claim(self.name, {"owner": self.name}, f"{self.name} always claims")


def _scheme_cls(tag):
    from quantplug.layers.linear import DenseScheme

    class TagScheme(DenseScheme):
        name = f"dense-{tag}"

    return TagScheme


class SchemeBackend(Claimer):
    @hookimpl
    def quantplug_linear_scheme(self, layer_name, quant_config):
        assert quant_config == {"owner": self.name}
        return _scheme_cls(self.name)()


def test_misspelled_hook_fails_naming_plugin_and_hook(pm):
    class Typo:
        @hookimpl
        def quantplug_linear_schema(self):
            return None

    with pytest.raises(PluginLoadError) as e:
        pm.register(Typo(), "typo")
    assert "typo" in str(e.value) and "quantplug_linear_schema" in str(e.value)
    assert "typo" not in pm.active()


def test_argument_not_in_spec_fails(pm):
    class Extra:
        @hookimpl
        def quantplug_detect(self, checkpoint, tokenizer):
            return None

    with pytest.raises(PluginLoadError) as e:
        pm.register(Extra(), "extra")
    assert "extra" in str(e.value) and "tokenizer" in str(e.value)


def test_two_claims_are_ambiguous_and_named_backend_wins(pm, ckpt):
    pm.register(Claimer("alpha"), "alpha", distribution="alpha-dist", version="1.0")
    pm.register(Claimer("beta"), "beta", distribution="beta-dist", version="2.0")
    with pytest.raises(AmbiguousBackendError) as e:
        build_plan(ckpt, plugin_manager=pm)
    assert "alpha (alpha-dist 1.0)" in str(e.value) and "beta (beta-dist 2.0)" in str(e.value)
    plan = build_plan(ckpt, plugin_manager=pm, backend="beta")
    assert plan.backend == "beta" and str(plan.claim.plugin) == "beta (beta-dist 2.0)"
    with pytest.raises(NoBackendError, match="gamma"):
        build_plan(ckpt, plugin_manager=pm, backend="gamma")


def test_claim_must_carry_own_name(pm, ckpt):
    pm.register(Claimer("someone-else"), "liar")
    with pytest.raises(quantplug.errors.QuantplugError, match="liar"):
        build_plan(ckpt, plugin_manager=pm)


def test_backend_hooks_scoped_to_selected_backend(pm, ckpt):
    pm.register(SchemeBackend("alpha"), "alpha")
    pm.register(SchemeBackend("beta"), "beta")
    plan = build_plan(ckpt, plugin_manager=pm, backend="alpha")
    schemes = {d.value for d in plan.decisions if d.hook == "quantplug_linear_scheme"}
    assert schemes == {"dense-alpha"}
    assert {d.plugin.name for d in plan.decisions if d.hook == "quantplug_linear_scheme"} == {"alpha"}


def test_core_defaults_answer_last_and_are_stamped(pm, ckpt):
    class LayoutOnly(Claimer):
        @hookimpl
        def quantplug_attention_layout(self, layer_name):
            return None if layer_name.endswith("0.self_attn") else AttentionLayout("dense", "layout says so")

    pm.register(LayoutOnly("lay"), "lay", distribution="lay-dist", version="0.3")
    plan = build_plan(ckpt, plugin_manager=pm)
    by = {d.target: d for d in plan.decisions if d.hook == "quantplug_attention_layout"}
    assert str(by["model.layers.0.self_attn"].plugin).startswith("core (quantplug")
    assert str(by["model.layers.1.self_attn"].plugin) == "lay (lay-dist 0.3)"


def test_packed_module_conflict_names_both_sources(pm, ckpt):
    class Packer(Claimer):
        @hookimpl
        def quantplug_packed_modules(self):
            return {"gate_up_proj": ["up_proj", "gate_proj"]}

    pm.register(Packer("packer"), "packer")
    plan = build_plan(ckpt, plugin_manager=pm)
    [p] = [p for p in plan.errors if p.kind == "packed"]
    assert "model class DeepseekV3ForCausalLM" in p.message and "packer" in p.message


def test_fused_shards_that_disagree_are_a_problem(pm, ckpt):
    class Split(Claimer):
        @hookimpl
        def quantplug_packed_modules(self):
            return {"fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]}  # this backend fuses them

        @hookimpl
        def quantplug_linear_scheme(self, layer_name):
            return _scheme_cls("q")() if layer_name.endswith("q_a_proj") else None

    pm.register(Split("split"), "split")
    plan = build_plan(ckpt, plugin_manager=pm)
    msgs = [p.message for p in plan.errors if p.kind == "packed"]
    assert msgs and "fused_qkv_a_proj_with_mqa" in msgs[0] and "q_a_proj=dense-q" in msgs[0]


def test_shards_may_differ_where_nothing_fuses_them(pm, ckpt):
    """The model class's own packed mapping alone does not force agreement: the checkpoint stores
    q_a_proj and kv_a_proj_with_mqa apart and quantplug runs them apart."""
    class Split(Claimer):
        @hookimpl
        def quantplug_linear_scheme(self, layer_name):
            return _scheme_cls("q")() if layer_name.endswith("q_a_proj") else None

    pm.register(Split("split"), "split")
    plan = build_plan(ckpt, plugin_manager=pm)
    assert not [p for p in plan.errors if p.kind == "packed"]


def test_validate_plan_problems_are_collected_and_stamped(pm, ckpt):
    class Validator(Claimer):
        @hookimpl
        def quantplug_validate_plan(self, plan):
            return [quantplug.types.Problem("custom rule", tensor=plan.tensors_matching(r"o_proj")[0].name)]

    pm.register(Validator("val"), "val", distribution="val-dist", version="9")
    plan = build_plan(ckpt, plugin_manager=pm)
    [p] = plan.errors
    assert "custom rule" in p.describe() and "val (val-dist 9)" in p.describe()


def test_process_after_loading_called_on_backend_only(pm, ckpt):
    calls = []

    class Post(Claimer):
        @hookimpl
        def quantplug_process_after_loading(self, model, quant_config):
            calls.append((self.name, quant_config["owner"]))

    pm.register(Post("post"), "post")
    pm.register(Post("other"), "other")
    quantplug.load(ckpt, backend="post", plugin_manager=pm)
    assert calls == [("post", "post")]


def test_plugin_exception_is_wrapped_naming_plugin(pm, ckpt):
    class Crash(Claimer):
        @hookimpl
        def quantplug_resolve_prefix(self):
            raise KeyError("boom")

    pm.register(Crash("crash"), "crash", distribution="crash-dist", version="1")
    with pytest.raises(quantplug.errors.QuantplugError, match=r"crash \(crash-dist 1\) failed in quantplug_resolve_prefix"):
        build_plan(ckpt, plugin_manager=pm)


#: hook -> (a wrong answer, the words of what was expected): one check in the plugin manager
WRONG_ANSWERS = {
    "quantplug_detect": ({"backend": "w"}, "quantplug.api.Claim or None"),
    "quantplug_architectures": (["DeepseekV3ForCausalLM"], "a mapping of architecture name"),
    "quantplug_options": ("activation_quant", "a sequence of quantplug.api.OptionSpec"),
    "quantplug_tensor_names": ([("a", "b")], "a mapping of model tensor name"),
    "quantplug_resolve_prefix": (b"language_model", "expected str"),
    "quantplug_packed_modules": ("gate_up_proj", "a mapping of fused name"),
    "quantplug_attention_layout": ("dense", "quantplug.api.AttentionLayout"),
    "quantplug_linear_scheme": ("dense", "a quantplug.api.LinearScheme"),
    "quantplug_validate_plan": (["a problem as text"], "a sequence of quantplug.api.Problem"),
}


@pytest.mark.parametrize("hook", sorted(WRONG_ANSWERS))
def test_a_wrong_answer_type_is_one_error_naming_plugin_hook_and_type(pm, ckpt, hook):
    """Every hook's answer is checked once, in the plugin manager: a wrong type is a QuantplugError
    naming the plugin (distribution, version), the hook, the type returned and what was expected."""
    value, expected = WRONG_ANSWERS[hook]

    def answer(self, **kwargs):
        return value

    answer.__name__ = hook
    body: dict = {hook: hookimpl(answer)}
    if hook != "quantplug_detect":
        body["quantplug_detect"] = Claimer.quantplug_detect
    if hook == "quantplug_options":
        body["QUANTPLUG_CONTRACT"] = "1.4"
    cls = type("Wrong", (Claimer,), body)
    pm.register(cls("wrong"), "wrong", distribution="wrong-dist", version="2")
    with pytest.raises(quantplug.errors.QuantplugError) as err:
        build_plan(ckpt, plugin_manager=pm)
    msg = str(err.value)
    bad = type(value[0]).__name__ if hook == "quantplug_validate_plan" else type(value).__name__
    assert f"plugin wrong (wrong-dist 2) returned {bad} " in msg and hook in msg and expected in msg, msg
    if hook == "quantplug_linear_scheme":
        assert " for model.layers.0.self_attn.q_a_proj" in msg or " for model." in msg


def test_validate_plan_answering_one_problem_instead_of_a_list_is_named(pm, ckpt):
    """Before the check lived in the manager, a lone Problem reached ``for p in answer`` in the
    plan: a raw TypeError ("'Problem' object is not iterable") with no plugin named."""
    class One(Claimer):
        @hookimpl
        def quantplug_validate_plan(self):
            return quantplug.types.Problem("only one")

    pm.register(One("one"), "one")
    with pytest.raises(quantplug.errors.QuantplugError, match=r"plugin one returned Problem from "
                                                              r"quantplug_validate_plan; expected a sequence"):
        build_plan(ckpt, plugin_manager=pm)


def test_export_answer_type_is_checked(pm, tmp_path):
    class Exporter(Claimer):
        @hookimpl
        def quantplug_export(self, destination):
            return [quantplug.types.ExportResult(destination, "ok"), str(destination)]

    pm.register(Exporter("exp"), "exp")
    with pytest.raises(quantplug.errors.QuantplugError, match=r"plugin exp returned str in quantplug_export; "
                                                              r"expected quantplug.api.ExportResult"):
        pm.call("quantplug_export", ["exp"], firstresult=True, destination=tmp_path)


def test_trace_logs_every_call(ckpt, caplog):
    pm = PluginManager(entry_points=False, env={"QUANTPLUG_TRACE": "1"})
    with caplog.at_level(logging.DEBUG, logger="quantplug.trace"):
        build_plan(ckpt, plugin_manager=pm)
    text = caplog.text
    assert "quantplug_resolve_prefix(" in text and "quantplug_linear_scheme(layer_name=" in text
    assert "[core (quantplug" in text


class Observed(SchemeBackend):
    """A backend implementing the load-time hooks too, so plan, load and generate all call it."""

    @hookimpl
    def quantplug_validate_plan(self, plan):
        return []

    @hookimpl
    def quantplug_process_after_loading(self, model):
        model.observed = True


def test_pluggy_monitoring_sees_every_hook_call_of_plan_load_and_generate(pm, ckpt):
    """pluggy calls the hooks: add_hookcall_monitoring sees every call that plan, load and generate
    make, backend hooks with the selected backend and the core defaults only (the manager used to
    call the implementations itself, and pluggy's tools saw nothing: then ``seen`` is empty)."""
    import torch

    pm.register(Observed("acme"), "acme")
    pm.register(Observed("other"), "other")
    seen: list[tuple[str, list[str]]] = []
    undo = pm.pluggy.add_hookcall_monitoring(
        lambda hook, impls, kwargs: seen.append((hook, [i.plugin_name for i in impls])), lambda *a: None)
    try:
        model = quantplug.load(ckpt, plugin_manager=pm, progress=False, backend="acme")
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    finally:
        undo()
    plan = model.quantplug_plan
    assert {h for h, _ in seen} >= {"quantplug_detect", "quantplug_resolve_prefix",
                                    "quantplug_linear_scheme", "quantplug_attention_layout",
                                    "quantplug_validate_plan", "quantplug_process_after_loading"}
    for hook, impls in seen:  # scope: a backend hook never reaches the backend that was not selected
        assert "other" not in impls or hook not in hookspecs.BACKEND_HOOKS, (hook, impls)
    assert {"acme", "core"} <= {p for h, impls in seen if h == "quantplug_linear_scheme" for p in impls}
    assert model.observed
    # every recorded decision of a hook was a call pluggy saw, by the plugin the decision names
    for hook in ("quantplug_linear_scheme", "quantplug_attention_layout", "quantplug_resolve_prefix"):
        decided = [d.plugin.name for d in plan.decisions if d.hook == hook]
        assert decided and set(decided) <= {p for h, impls in seen if h == hook for p in impls}, hook


def test_first_result_and_answer_types_come_from_the_specs(pm):
    from quantplug.errors import QuantplugError
    from quantplug.plugins import answer_types

    first = {n for n in PluginManager.hook_names() if pm.firstresult(n)}
    assert first == {"quantplug_tensor_names", "quantplug_resolve_prefix", "quantplug_attention_layout",
                     "quantplug_linear_scheme", "quantplug_export"}
    # every hook that answers declares what an answer is, on its spec
    assert set(answer_types()) == set(PluginManager.hook_names()) - {"quantplug_process_after_loading",
                                                                     "quantplug_cli_commands"}
    assert all(getattr(hookspecs, n).qp_answer[0] == a.expected for n, a in answer_types().items())
    with pytest.raises(QuantplugError, match=r"quantplug_detect: its spec says firstresult=False"):
        pm.call("quantplug_detect", None, firstresult=True, checkpoint=None)


def test_every_hookspec_documented_and_exercised():
    tests_src = "".join(p.read_text() for p in Path(__file__).parent.rglob("*.py"))
    plugins_root = Path(__file__).parents[1] / "plugins"
    plugin_src = "".join(p.read_text() for p in plugins_root.rglob("*.py")) if plugins_root.exists() else ""
    for name in PluginManager.hook_names():
        fn = getattr(hookspecs, name)
        doc = fn.__doc__ or ""
        assert len(doc) > 100 and "Example" in doc, f"{name} needs a full docstring"
        assert f"def {name}(" in tests_src + plugin_src, f"no test or plugin implements {name}"
    # and the docs say backend/global and firstresult correctly
    for name in hookspecs.BACKEND_HOOKS:
        assert "Backend hook" in getattr(hookspecs, name).__doc__ or name == "quantplug_export"


def test_export_hook_called_by_name(pm, tmp_path):
    class Exporter(Claimer):
        @hookimpl
        def quantplug_export(self, model, destination):
            (destination / "marker").write_text(type(model).__name__)
            return quantplug.types.ExportResult(destination, "marker")

    pm.register(Exporter("exp"), "exp")
    [(res, info)] = pm.call("quantplug_export", ["exp"], firstresult=True, model=object(), model_config=None,
                            destination=tmp_path, options={})
    assert res.format == "marker" and info.name == "exp" and (tmp_path / "marker").read_text() == "object"


def test_core_imports_no_plugin():
    core = Path(quantplug.__file__).parent
    for f in core.rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                assert not any(n.startswith("quantplug_") for n in names), f"{f} imports a plugin"
        text = f.read_text()
        for cls in ("QuarkConfig", "ModelSlimConfig", "ExpertPackConfig"):
            assert cls not in text, f"{f} names {cls}"


# --- the real entry-point path -----------------------------------------------------------------

def _make_dist(site: Path, dist: str, version: str, module: str, source: str, ep_name: str) -> None:
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[quantplug.backends]\n{ep_name} = {module}\n")
    (info / "RECORD").write_text("")


@pytest.fixture
def vendor_site(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    # module names of their own: the example distribution's acme_quant may already be imported here
    _make_dist(site, "acme-quant", "1.2.3", "qp_site_acme_quant", """
        from quantplug import hookimpl
        from quantplug.types import Claim

        @hookimpl
        def quantplug_detect(checkpoint):
            qc = checkpoint.config.get("quantization_config") or {}
            return Claim("acme", qc, "quant_method acme") if qc.get("quant_method") == "acme" else None

        @hookimpl
        def quantplug_resolve_prefix(model_config):
            return None
        """, "acme")
    _make_dist(site, "broken-quant", "0.0.1", "qp_site_broken_quant", "import does_not_exist_anywhere\n", "broken")
    return site


def _cli(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("QUANTPLUG_")}
    e["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in sys.path if p])
    e.update(env)
    return subprocess.run([sys.executable, "-m", "quantplug.cli", *args], capture_output=True, text=True, env=e,
                          timeout=120)


@pytest.fixture
def vendor_cli(vendor_site, monkeypatch, capsys):
    """``vendor_cli(*args, **env)``: the CLI run in this process with ``vendor_site`` on sys.path and
    only the given ``QUANTPLUG_*`` variables set (a fresh interpreter per call costs ~2 s of torch
    import; the subprocess test above checks the discovery in a fresh interpreter)."""
    from quantplug.cli import main
    from quantplug.plugins import reset_plugin_manager

    monkeypatch.syspath_prepend(str(vendor_site))
    for name in ("qp_site_acme_quant", "qp_site_broken_quant"):  # imported afresh from this test's site
        monkeypatch.delitem(sys.modules, name, raising=False)

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        for k in [k for k in os.environ if k.startswith("QUANTPLUG_")]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        reset_plugin_manager()
        rc = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), rc, out.out, out.err)

    return run


def test_entry_point_vendor_active_broken_failed(vendor_site):
    r = _cli(vendor_site, "plugins", "--json")
    assert r.returncode == 0, r.stderr
    recs = {p["name"]: p for p in json.loads(r.stdout)}
    acme = recs["acme"]
    assert acme["status"] == "active" and acme["distribution"] == "acme-quant" and acme["version"] == "1.2.3"
    assert acme["hooks"] == ["quantplug_detect", "quantplug_resolve_prefix"] and acme["error"] is None
    broken = recs["broken"]
    assert broken["status"] == "failed" and "does_not_exist_anywhere" in broken["error"]
    assert broken["distribution"] == "broken-quant"
    table = _cli(vendor_site, "plugins")
    assert table.returncode == 0 and "acme-quant" in table.stdout and "failed" in table.stdout


def test_entry_point_strict_disable_allow(vendor_cli):
    r = vendor_cli("plugins", "--json", QUANTPLUG_STRICT_PLUGINS="1")
    assert r.returncode == 1 and "broken" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = vendor_cli("plugins", "--json", QUANTPLUG_DISABLE="acme,broken")
    recs = {p["name"]: p for p in json.loads(r.stdout)}
    assert recs["acme"]["status"] == "disabled" and recs["broken"]["status"] == "disabled"
    r = vendor_cli("plugins", "--json", QUANTPLUG_PLUGINS="acme")
    recs = {p["name"]: p for p in json.loads(r.stdout)}
    assert recs["acme"]["status"] == "active" and recs["broken"]["status"] == "disabled"
    r = vendor_cli("plugins", "--json", QUANTPLUG_PLUGINS="")
    assert all(p["status"] == "disabled" for p in json.loads(r.stdout))


def test_entry_point_vendor_detects_checkpoint(vendor_cli, tmp_path):
    cfg = tiny_config(num_hidden_layers=1, quantization_config={"quant_method": "acme"})
    path = write_checkpoint(tmp_path / "acme", cfg, random_state(cfg))
    r = vendor_cli("plan", str(path), "--json", QUANTPLUG_PLUGINS="acme")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["backend"] == "acme" and d["backend_plugin"] == "acme (acme-quant 1.2.3)"
