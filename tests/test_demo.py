"""`quantplug demo`, the README's main command: every installed exporter's checkpoint loads and
stays close to the dense model it came from."""

from __future__ import annotations

import math

import pytest
import quantplug.demo
from quantplug.cli import main
from quantplug.demo import run_demo
from quantplug.plugins import get_plugin_manager


@pytest.fixture(scope="module")
def demo_rows(tmp_path_factory):
    """One run of the demo (every exporter's checkpoint written, planned, loaded and run) for the
    module's tests."""
    return run_demo(tmp_path_factory.mktemp("demo"))


def test_demo_rows_cover_every_exporting_backend(demo_rows):
    rows = demo_rows
    assert rows[0].backend == "dense" and rows[0].max_rel_err == 0.0
    pm = get_plugin_manager()
    exporters = {r.name for r in pm.records() if pm.implements(r.name, "quantplug_export")}
    assert exporters <= {r.backend for r in rows}
    for r in rows[1:]:
        assert math.isfinite(r.max_rel_err) and 0 < r.max_rel_err < 0.5, r
        assert r.plan_ms > 0 and r.load_ms > 0 and r.bytes > 0
    if "expert_pack" in exporters:  # the pack row serves its experts from the pack: none in the model
        plain, packed = [r for r in rows if r.backend == "expert_pack"]
        # the same weights: equal up to float32 summation order (the pack's experts come through
        # the expert cache's one-expert layers, the plain file's through the stacked ones)
        assert packed.model_bytes < plain.model_bytes and math.isclose(packed.max_rel_err, plain.max_rel_err, rel_tol=1e-5)


def test_demo_cli_prints_table(capsys, monkeypatch, demo_rows):
    """The CLI prints the demo's rows (the run itself is the test above's)."""
    calls = []
    monkeypatch.setattr(quantplug.demo, "run_demo", lambda: calls.append(1) or demo_rows)
    assert main(["demo"]) == 0 and calls == [1]
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("format") and "dense (safetensors, hub layout)" in out
