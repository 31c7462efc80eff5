"""The independent fuzzer as a test: a short fixed-seed, fixed-count run in the default suite, 20,000 cases
under ``-m slow``. Any failure is listed with its reproducer (see docs/fuzzing.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fuzz_indep import run as fuzz_run


def _check(rep: dict, out: Path) -> None:
    lines = [f"[{f['outcome']}] case {f['index']} ({f['seed']}): {' + '.join(f['mutations'])}\n    {f['reason'][:300]}\n"
             f"    reproduce: cd tests && python -m fuzz_indep.run --seed {rep['seed']} --case {f['index']}"
             for f in rep["failures"]]
    assert not lines, f"{len(lines)} failing case(s), inputs under {out}:\n" + "\n".join(lines)


def test_fuzz_indep_short(tmp_path: Path) -> None:
    """The corpus and a fixed 24 cases on one worker (a fixed count, not a time budget: the same
    cases on every machine, however loaded; the 20,000-case run below is the search). The suite's
    other worker runs other tests meanwhile."""
    rep = fuzz_run.run(24, 20260101, 1, tmp_path / "out", sub_every=0, quiet=True)
    assert rep["cases"] == 24, rep
    assert rep["outcomes"].get("ok-same", 0) + rep["outcomes"].get("ok-changed", 0) > 0  # some loads happened
    _check(rep, tmp_path / "out")


@pytest.mark.slow
def test_fuzz_indep_20000(tmp_path: Path) -> None:
    seed = int(os.environ.get("QP_INDEP_FUZZ_SEED", "4242002"))
    rep = fuzz_run.run(20000, seed, 2, tmp_path / "out", quiet=True)
    assert rep["cases"] == 20000
    _check(rep, tmp_path / "out")
