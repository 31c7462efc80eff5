"""Native ggml kernels vs the torch paths, per call: one input row (a decode step) through a packed
[rows, 512] matrix, exact mode (``ggml.linear``), and dequantizing it into a reused buffer.

    python bench/bench_native.py [--reps 3] [--threads 2] [--rows 2048,16384]

Each (type, kernels) contender runs in a fresh process (``--child``), contenders alternate, and
the best of ``--reps`` rounds is reported (each round: best of 20 calls after 3 warm-up calls,
wall clock). "torch" is the same process with ``QUANTPLUG_NATIVE=0``. Weights are random valid
blocks (``quantplug_expert_pack.testing.random_rows``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TYPES = ("Q4_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def child(ggml_type: str, rows: int, threads: int) -> dict:
    import numpy as np
    import torch
    from quantplug.kernels import ggml, native
    from quantplug_expert_pack.testing import random_rows

    torch.set_num_threads(threads)
    w = torch.from_numpy(random_rows(ggml_type, (rows, 512), np.random.default_rng(0), scale=1e-3))
    x = torch.randn(1, 512)
    out = torch.empty(rows * 512)

    def best(fn) -> float:
        for _ in range(3):
            fn()
        t = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            fn()
            t = min(t, time.perf_counter() - t0)
        return t * 1e6

    return {"linear_us": best(lambda: ggml.linear(x, w, ggml_type, torch.float32)),
            "dequant_us": best(lambda: ggml.dequantize(w, ggml_type, out=out)), "native": native.status()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="2048,16384")
    ap.add_argument("--child", nargs=3, metavar=("TYPE", "ROWS", "THREADS"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]), int(a.child[2]))))
        return
    from quantplug.kernels import native

    print(f"native kernels: {native.status()}", file=sys.stderr)  # built once, before the timed children
    cases = [(t, int(r), k) for t in TYPES for r in a.rows.split(",") for k in ("native", "torch")]
    best: dict[tuple, dict] = {}
    for _ in range(a.reps):
        for t, r, k in cases:
            env = dict(os.environ, QUANTPLUG_NATIVE="1" if k == "native" else "0", OMP_NUM_THREADS=str(a.threads))
            out = subprocess.run([sys.executable, __file__, "--child", t, str(r), str(a.threads)], env=env,
                                 capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            key = (t, r, k)
            if key not in best:
                best[key] = res
            else:
                best[key] = {m: min(best[key][m], res[m]) if m != "native" else res[m] for m in res}
    for t in TYPES:
        for r in a.rows.split(","):
            n, tr = best[(t, int(r), "native")], best[(t, int(r), "torch")]
            print(f"{t:5s} {r:>6s}x512  1-row exact linear: native {n['linear_us']:8.0f} us, torch {tr['linear_us']:8.0f} us "
                  f"({tr['linear_us'] / n['linear_us']:5.1f}x)   dequantize into a buffer: native {n['dequant_us']:8.0f} us, "
                  f"torch {tr['dequant_us']:8.0f} us ({tr['dequant_us'] / n['dequant_us']:5.1f}x)")
    print(json.dumps({"|".join(map(str, k)): v for k, v in best.items()}))


if __name__ == "__main__":
    main()
