"""examples/acme_quant as a real distribution: built into a wheel by pip, installed (unpacked onto
a path, as pip installs a pure-Python wheel), found through its entry point by `quantplug plugins`,
and its own test suite (the 15-line conformance class) run by pytest as the vendor runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "acme_quant"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("acme-dist")
    src = root / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(root / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    [wheel] = (root / "wheel").glob("acme_quant-1.0.0-*.whl")
    site = root / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUANTPLUG_", "PYTEST_"))}
    env["PYTHONPATH"] = str(site)
    env["OMP_NUM_THREADS"] = "1"  # one process among many on a shared CI box
    return env


def test_installed_example_is_an_active_backend(site):
    r = subprocess.run([sys.executable, "-m", "quantplug.cli", "plugins", "--json"], capture_output=True, text=True,
                       env=_env(site), timeout=120)
    assert r.returncode == 0, r.stderr
    acme = {p["name"]: p for p in json.loads(r.stdout)}["acme"]
    assert acme["status"] == "active" and acme["distribution"] == "acme-quant" and acme["version"] == "1.0.0"
    assert acme["hooks"] == ["quantplug_detect", "quantplug_export", "quantplug_linear_scheme", "quantplug_options"]


@pytest.mark.slow  # a second interpreter importing torch + transformers; test_acme.py runs the same kit in-process
def test_example_suite_passes_the_kit_as_the_vendor_runs_it(site, tmp_path):
    project = tmp_path / "acme-quant"  # the vendor's checkout, minus the package (it is installed)
    shutil.copytree(EXAMPLE / "tests", project / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(EXAMPLE / "pyproject.toml", project)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"], cwd=project,
                       capture_output=True, text=True, env=_env(site), timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
