"""``cd tests && python -m fuzz.run --cases 10000 --seed 7``: one fuzz run, report on stdout."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from .engine import Fuzzer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--forward-share", type=float, default=0.05)
    ap.add_argument("--read-share", type=float, default=0.45)
    ap.add_argument("--outcomes", type=Path, default=None,
                    help="write every case's label and outcome here, one per line (to compare two runs of a seed)")
    args = ap.parse_args()
    fwd = int(args.cases * args.forward_share)
    read = int(args.cases * args.read_share)
    counts = {"read": read, "plan": args.cases - fwd - read, "forward": fwd}
    with tempfile.TemporaryDirectory() as tmp:
        rep = Fuzzer(Path(tmp), seed=args.seed, log=args.outcomes is not None).run(counts)
    if args.outcomes is not None:
        args.outcomes.write_text("".join(f"{outcome}\t{label}\n" for label, outcome in rep.log))
    print(rep.summary())
    for f in rep.failures:
        print("FAIL", f)
    for w in rep.wrapped:
        print("WRAPPED", w)
    for mb, case in sorted(rep.rss_jumps, reverse=True)[:10]:
        print(f"RSS +{mb} MB", case)
    return 1 if rep.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
