"""Paired decode speed of two quantplug checkouts on bench_decode's model (A against B).

    python bench/bench_ab.py --a PY:REPO --b PY:REPO --root DIR [--rows R1,R2] [--rounds 4] [--threads 2]

Each side is a Python interpreter with that checkout installed (its own virtual environment) and
the checkout's folder; both read the same exported model directories (``DIR``, made by
``bench_decode.py --root DIR --reps 0``). Every measurement is one fresh process running the
checkout's own ``bench/bench_decode.py --child quantplug``; per round and row the two sides run
back to back, the side going first alternating from round to round, so drift on a shared machine
falls on both. Printed per row: each side's decode ms/token (median and range over the rounds)
and the median of the per-round ratios B / A (below 1: B is faster), the same for the 64-token
prefill; a JSON summary as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import ROWS  # noqa: E402

#: the child's figures compared (bench_decode.child's keys)
KEYS = ("decode_ms", "prefill64_ms")


def side(spec: str) -> tuple[str, Path]:
    py, _, repo = spec.partition(":")
    if not py or not repo:
        raise SystemExit(f"{spec!r}: expected PYTHON:REPO")
    return py, Path(repo)


def run(py: str, repo: Path, path: Path, opts: dict, threads: int) -> dict:
    cmd = [py, str(repo / "bench" / "bench_decode.py"), "--threads", str(threads), "--child", "quantplug", str(path),
           json.dumps(opts)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="PYTHON:REPO of the baseline")
    ap.add_argument("--b", required=True, help="PYTHON:REPO of the contender")
    ap.add_argument("--root", required=True, help="bench_decode.py --root directory (exports made)")
    ap.add_argument("--rows", default="GGUF Q4_0 exact,GGUF Q8_0 fast,FP8 block (act_quant),CT W4A16 experts exact")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    sides = {"A": side(a.a), "B": side(a.b)}
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            raise SystemExit(f"unknown row {r!r}; rows: {', '.join(ROWS)}")
        if not (Path(a.root) / ROWS[r][0]).is_dir():
            raise SystemExit(f"{Path(a.root) / ROWS[r][0]} missing: run bench_decode.py --root {a.root} --reps 0 first")
    res: dict[str, dict[str, list[dict]]] = {r: {"A": [], "B": []} for r in rows}
    for rnd in range(a.rounds):
        for r in rows:
            name, opts = ROWS[r]
            for s in (("A", "B") if rnd % 2 == 0 else ("B", "A")):
                py, repo = sides[s]
                res[r][s].append(run(py, repo, Path(a.root) / name, opts, a.threads))
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr)
    summary = {}
    print(f"{'row':40s} {'A decode ms':>14s} {'B decode ms':>14s} {'B/A decode':>10s} {'B/A prefill':>11s}")
    for r in rows:
        out = {}
        for k in KEYS:
            av, bv = [x[k] for x in res[r]["A"]], [x[k] for x in res[r]["B"]]
            out[k] = {"A": av, "B": bv, "ratio": statistics.median(b / x for x, b in zip(av, bv))}
        d = out["decode_ms"]
        print(f"{r:40s} {statistics.median(d['A']):7.2f} ({min(d['A']):.1f}-{max(d['A']):.1f})"
              f" {statistics.median(d['B']):7.2f} ({min(d['B']):.1f}-{max(d['B']):.1f})"
              f" {d['ratio']:10.3f} {out['prefill64_ms']['ratio']:11.3f}")
        summary[r] = out
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
