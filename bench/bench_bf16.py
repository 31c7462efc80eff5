"""bfloat16 against float32 decode of one model per format, paired in one process.

    python bench/bench_bf16.py --root DIR [--rows ROW,...] [--threads 1] [--rounds 30]

``DIR`` is a ``bench_decode.py --root`` directory (its exports of the bench model). Per format,
one process loads the checkpoint twice, as a float32 and as a bfloat16 model, prefills the same
64-token prompt into each model's latent cache, then times one-token decode steps (the one native
call of ``next_tokens``, the cache truncated back after each) of the two models in turns:
``--rounds`` rounds of 10 steps each, process CPU time with one thread (wall clock with more),
the median step after the first 50. Both models see the same machine state within a round, so
the ratio holds still where fresh-process wall clock times (``bench_decode.py --dtype both``)
drift by 10-30% between rounds on a shared machine; each format still gets its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import ROWS  # noqa: E402

STEPS = 10


def child(path: str, options: dict, threads: int, rounds: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import quantplug
    from quantplug.generate import new_cache
    from quantplug.kernels import native

    clock = time.process_time if threads == 1 else time.perf_counter
    models = {}
    prompt = torch.tensor([[1 + 37 * i % 2000 for i in range(64)]])
    for dtype in (torch.float32, torch.bfloat16):
        lm = quantplug.load(path, dtype=dtype, progress=False, options=options).text_lm()
        cache = new_cache(lm, 1, 128)
        with torch.inference_mode():
            lm.hidden_and_logits(prompt, cache)
        models[str(dtype).removeprefix("torch.")] = (lm, cache, cache.length)
    ids = torch.tensor([[7]])
    times: dict[str, list[float]] = {d: [] for d in models}
    pairs0 = native.pair_tasks()
    with torch.inference_mode():
        for _ in range(rounds):
            for d, (lm, cache, base) in models.items():
                for _ in range(STEPS):
                    t0 = clock()
                    lm.next_tokens(ids, cache)
                    times[d].append(clock() - t0)
                    cache.truncate(base)
    ms = {d: 1e3 * statistics.median(t[50:]) for d, t in times.items()}
    return {**ms, "ratio": ms["bfloat16"] / ms["float32"], "pair_tasks": native.pair_tasks() - pairs0,
            "native": native.status()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="a bench_decode.py --root directory")
    ap.add_argument("--rows", default=None, help="comma-separated subset of bench_decode's rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--child", nargs=2, metavar=("PATH", "OPTIONS"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], json.loads(a.child[1]), a.threads, a.rounds)))
        return
    root = Path(a.root)
    rows = [r for r in ROWS if (a.rows is None or r in a.rows.split(",")) and (root / ROWS[r][0]).is_dir()]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    print("| format | float32 ms/step | bfloat16 ms/step | bfloat16 / float32 |")
    print("|---|---:|---:|---:|")
    for row in rows:
        d, opts = ROWS[row]
        out = subprocess.run([sys.executable, __file__, "--root", a.root, "--threads", str(a.threads),
                              "--rounds", str(a.rounds), "--child", str(root / d), json.dumps(opts)],
                             env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {row} | {r['float32']:.2f} | {r['bfloat16']:.2f} | {r['ratio']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
