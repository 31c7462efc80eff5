"""pluggy's own dispatch (contract 1.11): hooks called through pluggy's callers, hook wrappers
allowed and scoped, and every decision still naming the plugin that made it, a wrapper's override
included."""

from __future__ import annotations

import logging

import pytest
import quantplug
from quantplug import hookimpl
from quantplug.errors import QuantplugError
from quantplug.plugins import Overridden, PluginManager
from quantplug.testing import random_state, tiny_config, write_checkpoint
from quantplug.types import CORE, Claim, PluginInfo, Problem

SCHEME = "quantplug_linear_scheme"
FORCED = "model.layers.1.self_attn.o_proj"


@pytest.fixture
def ckpt(tmp_path):
    cfg = tiny_config(num_hidden_layers=2)
    return write_checkpoint(tmp_path / "c", cfg, random_state(cfg))


def _scheme(tag):
    from quantplug.layers.linear import DenseScheme

    class TagScheme(DenseScheme):
        name = f"dense-{tag}"

    return TagScheme()


class Backend:
    """Claims every checkpoint and answers every linear scheme."""

    def __init__(self, name):
        self.name = name

    @hookimpl
    def quantplug_detect(self, checkpoint):
        return Claim(self.name, {"owner": self.name}, f"{self.name} always claims")

    @hookimpl
    def quantplug_linear_scheme(self, layer_name):
        return _scheme(self.name)


class Counter:
    """A wrapper plugin that only looks: every linear-scheme call and the answer it saw."""

    QUANTPLUG_CONTRACT = "1.11"

    def __init__(self):
        self.seen = []

    @hookimpl(wrapper=True)
    def quantplug_linear_scheme(self, layer_name):
        scheme = yield
        self.seen.append((layer_name, scheme))
        return scheme


class Forcer:
    """A wrapper plugin that overrides one layer's scheme."""

    QUANTPLUG_CONTRACT = "1.11"

    @hookimpl(wrapper=True)
    def quantplug_linear_scheme(self, layer_name):
        scheme = yield
        return _scheme("forced") if layer_name == FORCED else scheme


def _scheme_decisions(plan):
    return [d for d in plan.decisions if d.hook == SCHEME]


def test_a_wrapper_plugin_registers_and_sees_every_call_of_the_hook(pm, ckpt):
    """Wrappers were refused at registration; now a wrapper-only plugin sees every call of the hook
    during plan(), as pluggy's monitoring does, and the decisions still name the core defaults."""
    counter = Counter()
    pm.register(counter, "counter", distribution="counter-dist", version="1.0")
    assert pm.wrapper_plugins() == ["counter"] and "counter" in pm.active()
    calls = []
    undo = pm.pluggy.add_hookcall_monitoring(
        lambda hook, impls, kwargs: calls.append((hook, kwargs.get("layer_name"), [i.plugin_name for i in impls])),
        lambda *a: None)
    try:
        plan = quantplug.plan(ckpt, plugin_manager=pm)
    finally:
        undo()
    decisions = _scheme_decisions(plan)
    scheme_calls = [(layer, impls) for hook, layer, impls in calls if hook == SCHEME]
    assert decisions and len(counter.seen) == len(scheme_calls) > 0
    assert all(impls == ["core", "counter"] for _, impls in scheme_calls)  # wrapper outermost, pluggy's order
    # every decision was a call the wrapper saw, and no call went unrecorded (the plan asks once per
    # distinct (layer, kind, shards): decisions of one layer share it)
    assert {layer for layer, _ in counter.seen} == {d.target for d in decisions}
    assert len(decisions) >= len(counter.seen)
    # the wrapper saw the real answers (not a tagged value) and did not change them: core decided
    assert all(type(s).__name__ == "DenseScheme" for _, s in counter.seen)
    assert {d.plugin for d in decisions} == {CORE} and pm.overrides() == []


def test_a_wrapper_plugin_wraps_whichever_backend_is_selected(pm, ckpt):
    counter = Counter()
    pm.register(counter, "counter")
    pm.register(Backend("alpha"), "alpha", distribution="alpha-dist", version="2")
    pm.register(Backend("beta"), "beta")
    plan = quantplug.plan(ckpt, plugin_manager=pm, backend="alpha")
    assert {type(s).name for _, s in counter.seen} == {"dense-alpha"}
    assert {str(d.plugin) for d in _scheme_decisions(plan)} == {"alpha (alpha-dist 2)"}


def test_a_wrapper_that_overrides_one_layer_is_the_decisions_author(pm, ckpt):
    """The overridden decision names the wrapper plugin and whose answer it replaced; the others
    still name who answered them; the override is logged and listed."""
    pm.register(Backend("alpha"), "alpha", distribution="alpha-dist", version="2")
    pm.register(Forcer(), "forcer", distribution="forcer-dist", version="0.1")
    plan = quantplug.plan(ckpt, plugin_manager=pm)
    by = {d.target: d for d in _scheme_decisions(plan)}
    forced = by.pop(FORCED)
    assert forced.value == "dense-forced"
    assert isinstance(forced.plugin, Overridden) and forced.plugin.name == "forcer"
    assert forced.plugin.replaced == PluginInfo("alpha", "alpha-dist", "2")
    assert "(by forcer (forcer-dist 0.1), overriding alpha (alpha-dist 2))" in forced.describe()
    assert by and {str(d.plugin) for d in by.values()} == {"alpha (alpha-dist 2)"}
    assert {d.value for d in by.values()} == {"dense-alpha"}
    [override] = pm.overrides()
    assert (override.hook, override.target, override.by.name, override.replaced.name) == (SCHEME, FORCED, "forcer",
                                                                                          "alpha")
    assert "forcer (forcer-dist 0.1)'s wrapper of quantplug_linear_scheme[" in override.describe()
    # and the plan's JSON says so too
    [row] = [r for r in plan.to_dict()["decisions"] if r["hook"] == SCHEME and r["target"] == FORCED]
    assert row["plugin"].startswith("forcer (forcer-dist 0.1), overriding alpha")


def test_an_old_style_hookwrapper_override_is_attributed_too(pm, ckpt):
    class OldStyle:
        QUANTPLUG_CONTRACT = "1.11"

        @hookimpl(hookwrapper=True)
        def quantplug_linear_scheme(self, layer_name):
            outcome = yield
            if layer_name == FORCED:
                outcome.force_result(_scheme("old"))

    pm.register(OldStyle(), "old")
    plan = quantplug.plan(ckpt, plugin_manager=pm)
    [forced] = [d for d in _scheme_decisions(plan) if d.target == FORCED]
    assert forced.value == "dense-old" and forced.plugin.name == "old" and forced.plugin.replaced == CORE
    assert {d.plugin for d in _scheme_decisions(plan) if d.target != FORCED} == {CORE}


def test_wrappers_nest_and_the_outermost_change_decides(pm, ckpt):
    """An inner wrapper forces a scheme; an outer (tryfirst) one replaces that: the decision names
    the outer wrapper, overriding the inner wrapper's answer."""
    class Outer:
        QUANTPLUG_CONTRACT = "1.11"

        @hookimpl(wrapper=True, tryfirst=True)
        def quantplug_linear_scheme(self, layer_name):
            scheme = yield
            return _scheme("outer") if layer_name == FORCED else scheme

    pm.register(Outer(), "outer")
    pm.register(Forcer(), "forcer")
    plan = quantplug.plan(ckpt, plugin_manager=pm)
    [forced] = [d for d in _scheme_decisions(plan) if d.target == FORCED]
    assert forced.value == "dense-outer" and forced.plugin.name == "outer"
    assert isinstance(forced.plugin.replaced, Overridden) and forced.plugin.replaced.name == "forcer"
    assert forced.plugin.replaced.replaced == CORE
    assert [o.by.name for o in pm.overrides()] == ["forcer", "outer"]


def test_a_backends_wrapper_runs_on_its_own_loads_only(pm, ckpt):
    """A plugin that answers any hook is a backend: its wrappers, like its answers, never touch a
    load it did not claim."""
    class Greedy(Backend):
        QUANTPLUG_CONTRACT = "1.11"

        @hookimpl(wrapper=True, specname=SCHEME)
        def force_everything(self):
            yield
            return _scheme("greedy")

    pm.register(Backend("alpha"), "alpha")
    pm.register(Greedy("greedy"), "greedy")
    assert pm.wrapper_plugins() == []
    plan = quantplug.plan(ckpt, plugin_manager=pm, backend="alpha")
    assert {(d.value, d.plugin.name) for d in _scheme_decisions(plan)} == {("dense-alpha", "alpha")}
    plan = quantplug.plan(ckpt, plugin_manager=pm, backend="greedy")
    assert {(d.value, str(d.plugin)) for d in _scheme_decisions(plan)} == {("dense-greedy", "greedy, overriding greedy")}


def test_a_wrapper_adding_to_a_collected_hook_is_named_on_what_it_added(pm, ckpt):
    """All-results hooks: the items a wrapper adds are its own, the others keep their author."""
    class Rules(Backend):
        @hookimpl
        def quantplug_validate_plan(self):
            return [Problem("backend rule", severity="warning")]

    class Policy:
        QUANTPLUG_CONTRACT = "1.11"

        @hookimpl(wrapper=True)
        def quantplug_validate_plan(self):
            answers = yield
            answers.append([Problem("site policy", severity="warning")])
            return answers

    pm.register(Rules("rules"), "rules")
    pm.register(Policy(), "policy", distribution="policy-dist", version="3")
    plan = quantplug.plan(ckpt, plugin_manager=pm)
    by = {p.message: p.plugin for p in plan.warnings}
    assert by["backend rule"].name == "rules" and not isinstance(by["backend rule"], Overridden)
    assert str(by["site policy"]) == "policy (policy-dist 3), by its wrapper"


def test_a_wrapper_of_a_hook_whose_answers_nobody_reads_may_just_yield(pm, ckpt):
    """A timing wrapper of quantplug_process_after_loading that only yields (returns None) is
    fine; the same on validate_plan, whose answers are read, is an error naming it."""
    timed = []

    class Timer:
        QUANTPLUG_CONTRACT = "1.11"

        @hookimpl(wrapper=True)
        def quantplug_process_after_loading(self, model):
            yield
            timed.append(type(model).__name__)

    pm.register(Timer(), "timer")
    quantplug.load(ckpt, plugin_manager=pm, progress=False)
    assert timed == ["DeepseekV3ForCausalLM"]

    class Forgetful:
        QUANTPLUG_CONTRACT = "1.11"

        @hookimpl(wrapper=True)
        def quantplug_validate_plan(self):
            yield

    pm.register(Forgetful(), "forgetful")
    with pytest.raises(QuantplugError, match=r"plugin forgetful's wrapper returned NoneType from "
                                             r"quantplug_validate_plan; expected the list of answers"):
        quantplug.plan(ckpt, plugin_manager=pm)


def test_a_wrappers_wrong_answer_is_an_error_naming_the_wrapper(pm, ckpt):
    class Bad:
        QUANTPLUG_CONTRACT = "1.11"

        @hookimpl(wrapper=True)
        def quantplug_linear_scheme(self):
            yield
            return "dense"

    pm.register(Bad(), "bad", distribution="bad-dist", version="1")
    with pytest.raises(QuantplugError, match=r"plugin bad \(bad-dist 1\)'s wrapper returned str from "
                                             r"quantplug_linear_scheme; expected a quantplug.api.LinearScheme "
                                             r"for model\."):
        quantplug.plan(ckpt, plugin_manager=pm)


def test_a_wrapper_may_not_withdraw_an_answer(pm, ckpt):
    """None in place of the core's answer would leave the plan without a scheme (a raw
    AttributeError in the plan): it is an error naming the wrapper and the layer."""
    class Withdraw:
        QUANTPLUG_CONTRACT = "1.11"

        @hookimpl(wrapper=True)
        def quantplug_linear_scheme(self, layer_name):
            scheme = yield
            return None if layer_name == FORCED else scheme

    pm.register(Withdraw(), "withdraw", distribution="withdraw-dist", version="1")
    with pytest.raises(QuantplugError, match=rf"plugin withdraw \(withdraw-dist 1\)'s wrapper of "
                                             rf"quantplug_linear_scheme returned None in place of an answer "
                                             rf"for {FORCED}"):
        quantplug.plan(ckpt, plugin_manager=pm)


def test_a_wrapper_that_raises_is_named(pm, ckpt):
    class Crash:
        QUANTPLUG_CONTRACT = "1.11"

        @hookimpl(wrapper=True)
        def quantplug_attention_layout(self):
            yield
            raise KeyError("boom")

    pm.register(Crash(), "crash", distribution="crash-dist", version="1")
    with pytest.raises(QuantplugError, match=r"plugin crash \(crash-dist 1\) failed in quantplug_attention_layout: "
                                             r"KeyError"):
        quantplug.plan(ckpt, plugin_manager=pm)


def test_a_wrapper_sees_an_implementations_error_named_and_passes_it_on(pm, ckpt):
    seen = []

    class Broken(Backend):
        @hookimpl
        def quantplug_linear_scheme(self, layer_name):
            raise ValueError("no such layer")

    class Watcher:
        QUANTPLUG_CONTRACT = "1.11"

        @hookimpl(wrapper=True)
        def quantplug_linear_scheme(self):
            try:
                return (yield)
            except QuantplugError as exc:
                seen.append(str(exc))
                raise

    pm.register(Broken("broken"), "broken", distribution="broken-dist", version="4")
    pm.register(Watcher(), "watcher")
    with pytest.raises(QuantplugError, match=r"^plugin broken \(broken-dist 4\) failed in quantplug_linear_scheme: "
                                             r"ValueError: no such layer") as err:
        quantplug.plan(ckpt, plugin_manager=pm)
    assert seen == [str(err.value)]


def test_trace_logs_answers_and_overrides(ckpt, caplog):
    pm = PluginManager(entry_points=False, env={"QUANTPLUG_TRACE": "1"})
    pm.register(Forcer(), "forcer", distribution="forcer-dist", version="0.1")
    with caplog.at_level(logging.DEBUG, logger="quantplug"):
        quantplug.plan(ckpt, plugin_manager=pm)
    text = caplog.text
    assert f"quantplug_linear_scheme(layer_name='{FORCED}'" in text and "[core (quantplug" in text
    assert "-> <TagScheme dense-forced> [forcer (forcer-dist 0.1), overriding core (quantplug" in text
    assert f"forcer (forcer-dist 0.1)'s wrapper of quantplug_linear_scheme[{FORCED}] replaced core" in text


def test_an_older_contract_plugin_loads_and_decides_as_before(pm, ckpt):
    class Old(Backend):
        QUANTPLUG_CONTRACT = "1.0"

    pm.register(Old("old"), "old", distribution="old-dist", version="0.0.1")
    plan = quantplug.plan(ckpt, plugin_manager=pm)
    assert {str(d.plugin) for d in _scheme_decisions(plan)} == {"old (old-dist 0.0.1)"}
    assert not any(isinstance(d.plugin, Overridden) for d in plan.decisions)


def test_the_contract_checker_asks_1_11_of_a_wrapper():
    from quantplug.testing.contract import shortfall

    class Unversioned:
        @hookimpl(wrapper=True)
        def quantplug_linear_scheme(self):
            return (yield)

    assert any("hook wrapper quantplug_linear_scheme needs contract 1.11" in s for s in shortfall(Unversioned()))
    assert not any("wrapper" in s for s in shortfall(Counter()))


def test_the_guides_wrapper_example_runs(pm, ckpt, caplog):
    """The example wrapper plugin of docs/writing-a-backend.md, as written: it logs every scheme
    decision and overrides lm_head's, and the plan names it for that one."""
    import re
    import types
    from pathlib import Path

    guide = (Path(__file__).parents[1] / "docs" / "writing-a-backend.md").read_text()
    section = guide[guide.index("## Hook wrappers"):]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("acme_policy")
    exec(compile(source, "writing-a-backend.md", "exec"), module.__dict__)
    pm.register(module, "acme-policy", distribution="acme-policy", version="1.0")
    with caplog.at_level(logging.INFO, logger="acme_policy"):
        plan = quantplug.plan(ckpt, plugin_manager=pm)
    decisions = _scheme_decisions(plan)
    assert len([r for r in caplog.records if r.name == "acme_policy"]) >= len({d.target for d in decisions}) > 1
    assert {d.target for d in decisions if d.plugin.name == "acme-policy"} == {"lm_head"}
    [head] = [d for d in decisions if d.target == "lm_head"]
    assert str(head.plugin) == "acme-policy (acme-policy 1.0), overriding core (quantplug " + quantplug.__version__ + ")"
