"""Speculative decoding with the MTP layer vs plain greedy, on the trained tiny DeepSeek-V3
(``tests/data/trained/dsv3-tiny``, made by ``bench/train_tiny.py``; run by hand, figures go into
docs/benchmarks.md with this command line).

    python bench/bench_mtp.py [--rounds 5] [--new 64] [--threads 2] [--dtypes float32,bfloat16] [--profile]

Each contender (plain ``generate`` / ``generate(..., speculative="mtp")``, per dtype) runs in a
fresh process, alternating (the order flips every round), ``--rounds`` times: load, one warm-up
generation, then ``--reps`` timed generations of ``--new`` tokens from the same prompt (the first
``--prompt`` tokens of the held-out text), EOS disabled; decode tokens/s is
``Generation.tokens_per_second()`` (tokens after the first over the decode time: the same clock for
both), best of the reps. The tokens of every run must equal plain greedy's. Reported: the median
over rounds of each contender's decode tokens/s, their ratio, the acceptance rate, and the load
average before and after.

``--profile``: in this process, per dtype, the time of one plain decode step (the whole-stack
native step), the 2-token verify forward (``hidden_and_logits``) and one MTP draft pass
(``mtp_logits``), medians of many calls; and a cProfile of a speculative generation (top
functions by own time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "data" / "trained" / "dsv3-tiny"

CHILD = r"""
import json, sys, torch, quantplug
from quantplug.eval import text_tokens
path, dtype, mode, new, threads, reps, n_prompt = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8])
torch.set_num_threads(threads)
tokens, _ = text_tokens(path, open(f"{path}/heldout.txt").read())
prompt = torch.tensor([tokens[:n_prompt]])
m = quantplug.load(path, dtype=getattr(torch, dtype), progress=False)
spec = "mtp" if mode == "mtp" else None
best, acc, out = 0.0, None, None
for r in range(reps + 1):
    g = m.stream(prompt, new, eos_token_id=None, speculative=spec)
    toks = [int(t[0]) for t in g]
    if r == 0:
        continue  # warm-up
    out = toks
    best = max(best, g.tokens_per_second())
    acc = g.acceptance_rate()
print(json.dumps({"tps": best, "acceptance": acc, "tokens": out}))
"""


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_child(model: Path, dtype: str, mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), dtype, mode, str(args.new), str(args.threads),
                          str(args.reps), str(args.prompt)], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_times(lm, prompt, n: int = 60) -> dict[str, float]:
    """Median ms of: a plain decode step (``next_tokens``, the whole-stack native step), the same
    1-token step through the modules (``hidden_and_logits``), the 2-token verify forward, and one
    MTP draft pass, each after the prompt (rolled back after every call)."""
    import time

    from quantplug.generate import new_cache, new_mtp_cache

    cache = new_cache(lm, 1, prompt.shape[1] + 4)
    hidden, _ = lm.hidden_and_logits(prompt, cache)
    base = cache.length
    mcache = new_mtp_cache(lm, 1, prompt.shape[1] + 4)
    lm.mtp_logits(prompt[:, 1:], hidden[:, :-1], mcache)
    mbase = mcache.length
    one, two = prompt[:, -1:], prompt[:, -2:]
    calls = {
        "step": lambda: lm.next_tokens(one, cache),
        "step_modules": lambda: lm.hidden_and_logits(one, cache),
        "verify": lambda: lm.hidden_and_logits(two, cache),
        "draft": lambda: lm.mtp_logits(one, hidden[:, -1:], mcache),
    }
    out = {}
    for name, fn in calls.items():
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            cache.truncate(base)
            mcache.truncate(mbase)
        out[name] = statistics.median(ts) * 1e3
    return out


def profile(model: Path, args: argparse.Namespace) -> None:
    import cProfile
    import pstats

    import quantplug
    import torch
    from quantplug.eval import text_tokens

    torch.set_num_threads(args.threads)
    tokens, _ = text_tokens(model, (model / "heldout.txt").read_text())
    prompt = torch.tensor([tokens[:args.prompt]])
    for dtype in args.dtypes.split(","):
        m = quantplug.load(model, dtype=getattr(torch, dtype), progress=False)
        m.generate(prompt, 8, eos_token_id=None)
        with torch.inference_mode():
            ms = step_times(m.text_lm(), prompt)
        print(f"{dtype}: plain decode step (native stack) {ms['step']:.2f} ms; 1-token step through the modules "
              f"{ms['step_modules']:.2f} ms; 2-token verify forward {ms['verify']:.2f} ms; MTP draft pass "
              f"{ms['draft']:.2f} ms (medians of 60; load {load_average()})")
        pr = cProfile.Profile()
        pr.enable()
        m.generate(prompt, args.new, eos_token_id=None, speculative="mtp")
        pr.disable()
        print(f"cProfile of generate(..., speculative='mtp'), {dtype}, {args.new} tokens (top 18 by own time):")
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.profile:
        profile(args.model, args)
        return
    print(f"load average before: {load_average()}", flush=True)
    dtypes = args.dtypes.split(",")
    res: dict[tuple[str, str], list[dict]] = {(d, m): [] for d in dtypes for m in ("plain", "mtp")}
    for r in range(args.rounds):
        for d in dtypes:
            for mode in (("plain", "mtp") if r % 2 == 0 else ("mtp", "plain")):
                res[(d, mode)].append(run_child(args.model, d, mode, args))
        print(f"round {r + 1}/{args.rounds} done (load {load_average()})", flush=True)
    for d in dtypes:
        plain, spec = res[(d, "plain")], res[(d, "mtp")]
        ref = plain[0]["tokens"]
        same = all(x["tokens"] == ref for x in plain + spec)
        p = statistics.median(x["tps"] for x in plain)
        s = statistics.median(x["tps"] for x in spec)
        acc = statistics.median(x["acceptance"] for x in spec)
        print(f"{d}: plain greedy {p:.1f} tokens/s, speculative mtp {s:.1f} tokens/s: {s / p:.2f}x "
              f"(acceptance {acc:.3f}; same tokens in every run: {same}; rounds {args.rounds}, best of "
              f"{args.reps}, {args.new} tokens, {args.threads} threads)")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
