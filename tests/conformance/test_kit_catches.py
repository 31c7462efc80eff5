"""The kit fails broken backends, at the check that names the fault, with a message to act on.

Each broken backend is the worked example (examples/acme_quant) with one fault, run through the
kit in a pytester session exactly as a vendor's suite would run it.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

# the worked example, importable without being installed
EXAMPLE = Path(__file__).parents[2] / "examples" / "acme_quant"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

pytest_plugins = ["pytester"]

BROKEN = {
    # detect claims every checkpoint
    "greedy_acme": """
        import acme_quant
        from acme_quant import *  # noqa: F403
        from quantplug.api import Claim, hookimpl
        from acme_quant import AcmeConfig

        @hookimpl
        def quantplug_detect(checkpoint):
            return Claim("acme", AcmeConfig(8, frozenset({"lm_head"})), "every checkpoint is mine")
        """,
    # forward skips the per-row scales (dequantize still applies them)
    "unscaled_acme": """
        import torch.nn.functional as F
        import acme_quant
        from acme_quant import *  # noqa: F403
        from acme_quant import Int8RowScheme
        from quantplug.api import hookimpl

        class NoScaleForward(Int8RowScheme):
            def apply(self, layer, x, index=None):
                w, _ = self._tensors(layer, index)
                return F.linear(x.float(), w.float()).to(x.dtype)

        @hookimpl
        def quantplug_linear_scheme(layer_name, layer_kind, shard_names, quant_config):
            original = acme_quant.quantplug_linear_scheme(layer_name=layer_name, layer_kind=layer_kind,
                                                          shard_names=shard_names, quant_config=quant_config)
            return None if original is None else NoScaleForward()
        """,
    # forward and dequantize both skip the scales: self-consistent, wrong
    "scaleless_acme": """
        import acme_quant
        from acme_quant import *  # noqa: F403
        from acme_quant import Int8RowScheme
        from quantplug.api import hookimpl

        class NoScale(Int8RowScheme):
            def dequantize(self, layer, index=None):
                w, _ = self._tensors(layer, index)
                return w.float().to(layer.model_dtype)

            def apply(self, layer, x, index=None):
                return super(Int8RowScheme, self).apply(layer, x, index)

        @hookimpl
        def quantplug_linear_scheme(layer_name, layer_kind, shard_names, quant_config):
            original = acme_quant.quantplug_linear_scheme(layer_name=layer_name, layer_kind=layer_kind,
                                                          shard_names=shard_names, quant_config=quant_config)
            return None if original is None else NoScale()
        """,
    # detect reads the weights; the config is a mutable dict; every layer kind gets a scheme
    "sloppy_acme": """
        import acme_quant
        from acme_quant import *  # noqa: F403
        from acme_quant import Int8RowScheme
        from quantplug.api import Claim, hookimpl

        @hookimpl
        def quantplug_detect(checkpoint):
            qc = checkpoint.config.get("quantization_config") or {}
            if qc.get("quant_method") != "acme":
                return None
            for f in checkpoint.files:
                with open(f, "rb") as fh:
                    fh.read()  # "sniffing" the data
            return Claim("acme", {"ignore": ["lm_head"]}, "acme")

        @hookimpl
        def quantplug_linear_scheme(layer_name, layer_kind, quant_config):
            return None if layer_name.endswith("lm_head") else Int8RowScheme()
        """,
    # a batched expert kernel (apply_grouped) that forgets the scales; apply itself is right
    "batched_acme": """
        import torch
        import torch.nn.functional as F
        import acme_quant
        from acme_quant import *  # noqa: F403
        from acme_quant import Int8RowScheme
        from quantplug.api import hookimpl

        class Batched(Int8RowScheme):
            def apply_grouped(self, layer, x, groups):
                outs, start = [], 0
                for slot, n in groups:
                    w, _ = self._tensors(layer, slot)
                    outs.append(F.linear(x[start:start + n].float(), w.float()))
                    start += n
                return torch.cat(outs).to(x.dtype)

        @hookimpl
        def quantplug_linear_scheme(layer_name, layer_kind, shard_names, quant_config):
            original = acme_quant.quantplug_linear_scheme(layer_name=layer_name, layer_kind=layer_kind,
                                                          shard_names=shard_names, quant_config=quant_config)
            return None if original is None else Batched()
        """,
    # a scale the scheme needs is declared optional: the plan cannot name it when it is missing
    "lax_acme": """
        import acme_quant
        from acme_quant import *  # noqa: F403
        from acme_quant import Int8RowScheme
        from quantplug.api import TensorSpec, hookimpl

        class Lax(Int8RowScheme):
            def tensor_specs(self, out_features, in_features):
                return [TensorSpec("weight", ("I8",), (out_features, in_features)),
                        TensorSpec("weight_scale", ("F32",), (out_features, 1), optional=True, target="F32")]

        @hookimpl
        def quantplug_linear_scheme(layer_name, layer_kind, shard_names, quant_config):
            original = acme_quant.quantplug_linear_scheme(layer_name=layer_name, layer_kind=layer_kind,
                                                          shard_names=shard_names, quant_config=quant_config)
            return None if original is None else Lax()
        """,
}

SUITE = """
import acme_quant
from quantplug.testing import BackendConformance
{imports}

{classes}
"""

CLASS = """
class Test_{name}(BackendConformance):
    backend = "acme"
    plugin = {name}
    layouts = ("deepseek_v3",)

    def write_checkpoint(self, path, config, dense_state):
        acme_quant.write_acme(path, config, dense_state)
"""

#: test class -> (checks selected, checks that must fail, text each failure must contain)
EXPECT = {
    "greedy_acme": ("claim", {"test_does_not_claim_a_dense_checkpoint": "claimed a plain dense deepseek_v3 checkpoint",
                              "test_does_not_claim_other_formats": "users with the bundled"}),
    # the forward runs the core's products on the (right) declared form: the fault shows where
    # apply is compared with dequantize and with the form
    "unscaled_acme": ("forward or apply or weights or form", {
        "test_apply_agrees_with_dequantize": "apply(layer, x) must equal x @ dequantize(layer).T",
        "test_form_agrees_with_the_scheme": "the form's product vs apply"}),
    "scaleless_acme": ("forward or apply or weights or form", {
        "test_dequantized_weights_are_close_to_the_source": "check that dequantize applies the scales",
        "test_form_agrees_with_the_scheme": "form values vs dequantize"}),
    "sloppy_acme": ("reads or frozen or unknown", {
        "test_plan_reads_no_tensor_data": "planning backend acme's deepseek_v3 checkpoint read tensor data",
        "test_hook_answers_are_frozen_and_repeatable": "Claim.quant_config is a dict",
        "test_unknown_layer_kind_gets_none": "return None for kinds you do not handle"}),
    "batched_acme": ("apply", {"test_apply_agrees_with_dequantize": "apply_grouped rel err"}),
    "lax_acme": ("missing", {"test_missing_tensor_is_named_at_plan_time": "Declare every tensor a scheme needs"}),
}


@pytest.fixture
def run_broken(pytester):
    def run():
        for name, source in BROKEN.items():
            pytester.makepyfile(**{name: textwrap.dedent(source)})
        suite = SUITE.format(imports="\n".join(f"import {n}" for n in BROKEN),
                             classes="\n".join(CLASS.format(name=n) for n in BROKEN))
        pytester.makepyfile(test_broken_backends=suite)
        pytester.syspathinsert()
        select = " or ".join(f"(Test_{n} and ({sel}))" for n, (sel, _) in EXPECT.items())
        return pytester.inline_run("-k", select, "-p", "no:cacheprovider")
    return run


def test_kit_fails_each_broken_backend_at_the_right_check(run_broken):
    from quantplug.kernels import native

    expect = {name: (sel, dict(failing)) for name, (sel, failing) in EXPECT.items()}
    forward = "declared form disagrees with their scheme"
    if native.library() is None:  # the torch paths: the broken apply itself runs the forward
        expect["unscaled_acme"][1]["test_forward_matches_transformers"] = forward
    else:  # the native kernels compute from the (right) form, unlike the scaleless dequantize
        expect["scaleless_acme"][1]["test_forward_matches_transformers"] = forward
    reprec = run_broken()
    reports = [r for r in reprec.getreports("pytest_runtest_logreport") if r.when == "call"]
    by_class: dict[str, dict[str, list]] = {}
    for r in reports:
        cls, test = r.nodeid.split("::")[1:3]
        by_class.setdefault(cls.removeprefix("Test_"), {}).setdefault(test.split("[")[0], []).append(r)
    for name, (_, failing) in expect.items():
        got = by_class[name]
        for test, text in failing.items():
            outcomes = [r.outcome for r in got[test]]
            assert "failed" in outcomes, f"{name}: {test} should fail, got {outcomes}"
            message = "\n".join(str(r.longrepr) for r in got[test] if r.failed)
            assert text in message, f"{name}: {test} failed without {text!r}:\n{message}"
        # the checks selected but not aimed at this fault pass: the failures point at the fault
        for test, rs in got.items():
            if test not in failing:
                assert all(r.outcome in ("passed", "skipped") for r in rs), f"{name}: {test} {[r.longrepr for r in rs]}"
