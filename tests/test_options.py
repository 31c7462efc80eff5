"""Load options (issue 22): declared by the core and by each backend (``quantplug_options``),
checked by the plan (unknown name: a did-you-mean naming the backend that owns it; wrong type or
value: the expected type / choices and the owner), converted from ``-o`` text by the declared
type, listed by ``quantplug plugins --options`` and shown by ``plan`` / ``explain``."""

from __future__ import annotations

import json

import pytest
import quantplug
from quantplug import hookimpl
from quantplug.cli import main
from quantplug.errors import ConfigError, QuantplugError
from quantplug.options import CORE_OPTIONS
from quantplug.plan import build_plan
from quantplug.plugins import PluginManager
from quantplug.types import Claim, OptionSpec


fp8_ckpt = pytest.fixture(scope="module", name="fp8_ckpt")(lambda two_layer: two_layer("fp8"))
dense_ckpt = pytest.fixture(scope="module", name="dense_ckpt")(lambda two_layer: two_layer("dense"))


def test_issue_example_bogus_option_is_refused_on_an_fp8_checkpoint(fp8_ckpt):
    # before: load succeeded and ignored both options
    with pytest.raises(ConfigError, match=r"unknown option 'bogus_option' for backend fp8.*options here: "
                                          r"activation_quant, expert_cache_mb, expert_prefetch, expert_readers, indexer, kda_state, kernels, mmap, "
                                          r"mtp, strict_split"):
        quantplug.load(fp8_ckpt, options={"bogus_option": 1, "expert_cache_mb": 8}, progress=False)


def test_typo_gets_a_did_you_mean(dense_ckpt):
    with pytest.raises(ConfigError, match=r"unknown option 'kernel' .*did you mean 'kernels'\?"):
        build_plan(dense_ckpt, options={"kernel": "fast"})


def test_an_option_of_another_backend_names_its_owner(fp8_ckpt):
    with pytest.raises(ConfigError, match=r"unknown option 'dequantize' for backend fp8 .*'dequantize' is an option "
                                          r"of backend expert_pack .*backend quark"):
        build_plan(fp8_ckpt, options={"dequantize": True})


def test_wrong_type_and_value_name_option_expectation_and_owner(fp8_ckpt, dense_ckpt):
    with pytest.raises(ConfigError, match=r"option kernels='turbo': expected one of 'exact', 'fast' "
                                          r"\(declared by core \(quantplug "):
        build_plan(dense_ckpt, options={"kernels": "turbo"})
    with pytest.raises(ConfigError, match=r"option activation_quant=1: expected one of 'dynamic', 'none' "
                                          r"\(declared by fp8 \(quantplug-fp8"):
        build_plan(fp8_ckpt, options={"activation_quant": 1})
    with pytest.raises(ConfigError, match=r"option expert_cache_mb=-1: expected a number in \[0, "):
        build_plan(dense_ckpt, options={"expert_cache_mb": -1})
    with pytest.raises(ConfigError, match=r"option strict_split='maybe': expected true or false"):
        build_plan(dense_ckpt, options={"strict_split": "maybe"})
    with pytest.raises(ConfigError, match=r"option mmap=1: expected true or false"):
        build_plan(dense_ckpt, options={"mmap": 1})  # an int is not a bool


def test_every_problem_is_said_in_one_error(dense_ckpt):
    with pytest.raises(ConfigError) as exc:
        build_plan(dense_ckpt, options={"kernels": "x", "bogus": 1})
    assert "unknown option 'bogus'" in str(exc.value) and "option kernels='x'" in str(exc.value)


def test_hooks_get_converted_values_and_every_default(dense_ckpt):
    plan = build_plan(dense_ckpt, options={"strict_split": "true", "expert_cache_mb": "2.5"})
    assert plan.options["strict_split"] is True and plan.options["expert_cache_mb"] == 2.5
    assert plan.options["kernels"] == "exact" and plan.options["mmap"] is True and plan.options["tp_timeout_s"] == 60
    assert plan.option_sources == {"strict_split": "given", "expert_cache_mb": "given", "kernels": "default",
                                   "mmap": "default", "tp_timeout_s": "default", "expert_prefetch": "default",
                                   "expert_readers": "default", "indexer": "default", "kda_state": "default", "mtp": "default"}
    d = plan.to_dict()["options"]
    assert d["strict_split"] == {"value": True, "source": "given", "owner": "core"}


def test_cli_text_is_converted_by_the_declared_type(fp8_ckpt, capsys):
    assert main(["plan", str(fp8_ckpt), "--json", "-o", "activation_quant=none", "-o", "mmap=false"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["options"]["activation_quant"] == {"value": "none", "source": "given", "owner": "fp8"}
    assert d["options"]["mmap"]["value"] is False
    assert main(["plan", str(fp8_ckpt), "-o", "kernel=fast"]) == 1
    err = capsys.readouterr().err
    assert "did you mean 'kernels'" in err and "Traceback" not in err


def test_plan_and_explain_show_the_effective_options(fp8_ckpt, capsys):
    assert main(["plan", str(fp8_ckpt), "-o", "activation_quant=none"]) == 0
    out = capsys.readouterr().out
    assert 'activation_quant="none" (fp8, given)' in out and 'kernels="exact" (core, default)' in out
    assert main(["explain", str(fp8_ckpt), "model.layers.0.self_attn.q_a_proj"]) == 0
    assert 'options: activation_quant="dynamic" (fp8, default)' in capsys.readouterr().out


def test_plugins_options_lists_every_option(capsys):
    assert main(["plugins", "--options", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {(r["name"], r["owner"], r["scope"]): r for r in rows}
    for spec in CORE_OPTIONS:
        assert (spec.name, "core", "load") in by
    assert by[("kernels", "core", "load")]["choices"] == ["exact", "fast"]
    assert by[("activation_quant", "compressed_tensors", "load")]["default"] == "emulate"
    assert by[("activation_quant", "fp8", "load")]["choices"] == ["dynamic", "none"]
    assert by[("activation_quant", "modelslim", "load")]["default"] == "ascend"
    assert by[("dequantize", "quark", "load")]["type"] == "bool"
    assert by[("dequantize", "expert_pack", "load")]["help"]
    assert by[("pack", "expert_pack", "export")]["default"] is True
    assert main(["plugins", "--options"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["NAME", "OWNER", "SCOPE", "TYPE", "DEFAULT", "CHOICES", "HELP"]
    assert "tp_timeout_s" in out and "expert_cache_mb" in out


def test_option_spec_validates_itself():
    with pytest.raises(QuantplugError, match="must be an identifier"):
        OptionSpec("bad-name", str, "x")
    with pytest.raises(QuantplugError, match="type"):
        OptionSpec("x", dict, {})
    with pytest.raises(ValueError):
        OptionSpec("x", int, "3")  # a default of the wrong type is the plugin's bug
    spec = OptionSpec("n", int, 1, minimum=0, maximum=4)
    assert spec.convert("3") == 3 and spec.expected() == "an integer in [0, 4]"
    with pytest.raises(ValueError):
        spec.convert(True)
    with pytest.raises(ValueError):
        spec.convert("3.5")
    assert OptionSpec("l", list, [1, 2]).default == (1, 2)
    assert OptionSpec("f", float, 1.0).convert("2") == 2.0


def test_float_option_refuses_nan_and_inf(dense_ckpt):
    for bad in ("nan", "inf", float("nan")):
        with pytest.raises(ConfigError, match="tp_timeout_s"):
            build_plan(dense_ckpt, options={"tp_timeout_s": bad})


class _Owner:
    """A backend that claims every checkpoint and declares options (or, ``legacy``, declares none)."""

    QUANTPLUG_CONTRACT = "1.4"

    def __init__(self, specs):
        self.specs = specs

    @hookimpl
    def quantplug_detect(self, checkpoint):
        return Claim("own", None, "claims everything")


def test_a_backend_cannot_redeclare_a_core_option(dense_ckpt):
    class Bad(_Owner):
        @hookimpl
        def quantplug_options(self):
            return [OptionSpec("kernels", str, "exact", ("exact",))]

    pm = PluginManager(entry_points=False)
    pm.register(Bad([]), "own")
    with pytest.raises(QuantplugError, match="declares option 'kernels', which the core declares"):
        build_plan(dense_ckpt, plugin_manager=pm)


def test_declared_options_reach_the_hooks(dense_ckpt):
    seen = {}

    class Good(_Owner):
        @hookimpl
        def quantplug_options(self):
            return [OptionSpec("level", int, 2, (1, 2, 3), "how hard")]

        @hookimpl
        def quantplug_linear_scheme(self, options):
            seen.update(options)

    pm = PluginManager(entry_points=False)
    pm.register(Good([]), "own")
    build_plan(dense_ckpt, plugin_manager=pm, options={"level": "3"})
    assert seen["level"] == 3 and seen["kernels"] == "exact"
    with pytest.raises(ConfigError, match=r"option level=7: expected one of 1, 2, 3 \(declared by own\)"):
        build_plan(dense_ckpt, plugin_manager=pm, options={"level": 7})


def test_a_pre_1_4_backend_gets_undeclared_options_with_a_warning(dense_ckpt):
    class Legacy:
        QUANTPLUG_CONTRACT = "1.3"

        @hookimpl
        def quantplug_detect(self, checkpoint):
            return Claim("old", None, "claims everything")

    pm = PluginManager(entry_points=False)
    pm.register(Legacy(), "old")
    plan = build_plan(dense_ckpt, plugin_manager=pm, options={"vendor_knob": 5})
    assert plan.options["vendor_knob"] == 5 and plan.option_owners["vendor_knob"] == "undeclared"
    assert any("vendor_knob=5 passed unchecked" in w.message for w in plan.warnings)


def test_api_option_helper_keeps_working():
    from quantplug.api import option

    assert option({"kernels": "fast"}, "kernels", "exact", ("exact", "fast")) == "fast"
    with pytest.raises(ConfigError, match="option x='z'"):
        option({"x": "z"}, "x", "a", ("a",))


# -- the backends added with contract 1.4 forms: ModelOpt, GPTQ, AWQ --------------------------------

def test_gptq_and_awq_declare_their_options():
    """GPTQ / AWQ read no load option of their own (before: they declared nothing, so any option
    passed unchecked with a warning) and declare their export options."""
    from conftest import VENDOR

    for fixture, backend in (("gptq_autoround_dsv3", "gptq"), ("awq_autoround_dsv3", "awq")):
        with pytest.raises(ConfigError, match=rf"unknown option 'activation_quant' for backend {backend} .*"
                                              r"'activation_quant' is an option of backend .*modelopt"):
            build_plan(VENDOR / fixture, options={"activation_quant": "none"})
        plan = build_plan(VENDOR / fixture)
        assert not [p for p in plan.problems if p.kind == "options"]


def test_modelopt_declares_activation_quant():
    from conftest import VENDOR

    with pytest.raises(ConfigError, match=r"option activation_quant='dynamic': expected one of 'emulate', 'none' "
                                          r"\(declared by modelopt \(quantplug-modelopt"):
        build_plan(VENDOR / "modelopt_nvfp4_dsv3", options={"activation_quant": "dynamic"})
    plan = build_plan(VENDOR / "modelopt_nvfp4_dsv3", options={"activation_quant": "none"})
    assert plan.option_owners["activation_quant"] == "modelopt"


def test_plugins_options_lists_the_new_backends(capsys):
    assert main(["plugins", "--options", "--json"]) == 0
    rows = {(r["owner"], r["scope"], r["name"]) for r in json.loads(capsys.readouterr().out)}
    assert {("modelopt", "load", "activation_quant"), ("modelopt", "export", "algo"),
            ("modelopt", "export", "input_amax"), ("gptq", "export", "group_size"), ("gptq", "export", "sym"),
            ("awq", "export", "group_size"), ("awq", "export", "sym")} <= rows


#: the exports whose backend has fast kernels for some layer (LinearScheme.takes_fast)
FAST = {"compressed-tensors-w4a16", "gguf-q8_0", "gguf-q4_0", "gguf-q8_0-expert-pack"}


def test_kernels_fast_is_honoured_or_refused_by_every_bundled_backend(tmp_path):
    """Issue: kernels=fast silently did nothing on five backends. Every bundled backend's export
    of one model, planned with kernels=fast: where a layer takes it the plan records a fast
    scheme; elsewhere the plan refuses the option, naming the backend."""
    from quantplug.errors import PlanError
    from quantplug.testing.engines import EXPORTS, export_formats, mla_config

    cfg = mla_config(num_hidden_layers=2)
    paths = export_formats(tmp_path, cfg)
    assert set(paths) >= FAST | {"fp8-block", "modelslim-w4a8", "quark-mxfp4", "modelopt-nvfp4", "gptq-int4", "dense"}
    backend = {e.label: e.backend for e in EXPORTS}
    for label, path in paths.items():
        if label in FAST:
            plan = quantplug.plan(path, options={"kernels": "fast"})
            fast = [m for m in plan.model.modules() if hasattr(m, "scheme") and m.scheme.takes_fast()]
            assert fast, label
            continue
        who = f"backend {backend[label]}" if backend[label] else "the dense"
        with pytest.raises(PlanError, match=rf"option kernels=fast: {who}.* has no fast kernels"):
            quantplug.plan(path, options={"kernels": "fast"}).raise_for_problems()
        assert not quantplug.plan(path, options={"kernels": "exact"}).problems, label


def test_load_options_fields_are_the_core_table():
    """Issue 33: one frozen, typed options object. Its fields are exactly the core's table
    (names, defaults, types), so a core option added to one and not the other fails here."""
    import dataclasses

    from quantplug.api import KERNELS, LoadOptions

    fields = {f.name: f for f in dataclasses.fields(LoadOptions) if f.name != "extra"}
    assert list(fields) == [o.name for o in CORE_OPTIONS]
    hints = __import__("typing").get_type_hints(LoadOptions)
    for o in CORE_OPTIONS:
        assert fields[o.name].default == o.default and hints[o.name] is o.type, o.name
    assert KERNELS == next(o for o in CORE_OPTIONS if o.name == "kernels").choices


def test_plan_options_is_a_frozen_typed_read_only_mapping(fp8_ckpt):
    import copy
    import dataclasses
    import pickle

    from quantplug.api import LoadOptions

    plan = build_plan(fp8_ckpt, options={"kernels": "exact", "expert_readers": "2", "activation_quant": "none"})
    opts = plan.options
    assert isinstance(opts, LoadOptions)
    assert opts.kernels == "exact" and opts.expert_readers == 2 and opts.expert_cache_mb == 0.0
    assert dict(opts.extra) == {"activation_quant": "none"}
    # the mapping hooks receive: every name, core first, then the backend's
    assert list(opts) == [o.name for o in CORE_OPTIONS] + ["activation_quant"] and len(opts) == len(CORE_OPTIONS) + 1
    assert opts["activation_quant"] == "none" and opts.get("nope", 7) == 7 and "kernels" in opts
    assert opts == {**dict(opts)} and dict(opts)["expert_readers"] == 2
    with pytest.raises(KeyError):
        opts["nope"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.kernels = "fast"  # type: ignore[misc]
    with pytest.raises(TypeError):
        opts.extra["activation_quant"] = "emulate"  # type: ignore[index]
    assert pickle.loads(pickle.dumps(opts)) == opts and copy.deepcopy(opts) == opts
    # a plan built by hand with a plain mapping gets one too, checked
    assert LoadOptions.of({"kernels": "fast", "knob": 1}) == {**dict(LoadOptions()), "kernels": "fast", "knob": 1}
    with pytest.raises(ConfigError, match=r"option kernels='turbo'"):
        LoadOptions.of({"kernels": "turbo"})
    with pytest.raises(QuantplugError, match="core option"):
        LoadOptions(extra={"mmap": False})
