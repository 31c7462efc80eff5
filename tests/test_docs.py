"""The README and docs/ stay true: the set-up line installs every bundled distribution, the quick
start runs, and no page reads as a work log."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _setup_line(page: Path) -> str:
    lines = [ln for ln in page.read_text().splitlines() if ln.startswith("python3 -m venv .venv")]
    assert len(lines) == 1, f"{page.name}: expected one set-up command line, found {len(lines)}"
    return lines[0]


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_setup_line_installs_every_plugin_and_the_transformers_bridge(page: str) -> None:
    words = shlex.split(_setup_line(ROOT / page).replace("&&", " "))
    editable = {words[i + 1].rstrip("/") for i, w in enumerate(words[:-1]) if w == "-e"}
    wanted = {f"plugins/{p.parent.name}" for p in (ROOT / "plugins").glob("*/pyproject.toml")}
    wanted |= {".", "integrations/transformers"}
    assert wanted <= editable, f"{page}: the set-up line misses {sorted(wanted - editable)}"
    assert "requirements-dev.txt" in words


def test_readme_python_quick_start_runs(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block is not None, "README.md has no python quick start"
    code = block.group(1).replace('"/tmp/qp-tiny"', repr(str(tmp_path / "tiny")))
    assert len(code.strip().splitlines()) <= 10
    exec(compile(code, "README.md quick start", "exec"), {})


#: wording of a work log, not of documentation (the docs say what is, not what changed when)
WORK_LOG = re.compile(
    r"\bissue[ -]?\d+\b(?!_)|\bthis session\b|\bthe session before\b|\bearlier (?:session|run|code)\b"
    r"|\bprevious run\b|\(target\b|\btarget:|\bthis time\b|\bno longer\b|\bat the start of\b|\bused to\b",
    re.I)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_log_wording(page: Path) -> None:
    hits = [f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r}"
            for n, line in enumerate(page.read_text().splitlines(), 1)
            for m in WORK_LOG.finditer(re.sub(r"`[^`]*`", "", line))]
    assert not hits, "work-log wording:\n" + "\n".join(hits)


def test_readme_is_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
