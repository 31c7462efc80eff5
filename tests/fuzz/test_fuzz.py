"""The fuzz suite: seeded mutations of every parsed input, through read / plan / load + forward.

Default run (CI): 2,036 cases, most of them reader- and plan-level (cheap), 16 through load and
forward (on the small dense / GGUF / expert-pack bases). ``pytest -m slow``: 20,000 cases. ``python -m fuzz.run`` (from tests/) runs any budget
and prints the report. Seeds are fixed: a failure reproduces with the same seed and budget.
"""

from __future__ import annotations

import pytest

from .engine import Fuzzer

CI = {"read": 1300, "plan": 720, "forward": 16}
SLOW = {"read": 9000, "plan": 10000, "forward": 1000}


def _run(tmp_path, seed: int, counts: dict[str, int], **kw) -> None:
    fz = Fuzzer(tmp_path, seed=seed, **kw)
    rep = fz.run(counts)
    print(rep.summary())
    assert rep.cases == sum(counts.values()) >= 2000
    assert not rep.failures, "\n".join(rep.failures[:20])
    assert rep.max_case_s < 20, rep.slowest
    assert rep.rss_growth_mb < 1024


def test_fuzz_ci_budget(tmp_path):
    _run(tmp_path, seed=20261130, counts=CI, forward_kinds=("dense", "gguf", "pack"))


@pytest.mark.slow
def test_fuzz_slow_budget(tmp_path):
    _run(tmp_path, seed=1, counts=SLOW)
