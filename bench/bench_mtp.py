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
native step), the 2-token verify forward (``hidden_and_logits``: one native call,
``StackStep.sequence``), one MTP draft pass (``mtp_logits``) and one whole speculative step
(``speculative_step``: verify and draft in one native call, ``qp_spec_step``), medians of many
calls; and a cProfile of a speculative generation (top functions by own time).

``--oracle RATE`` with ``--mid DIR``: the cost side on a model whose weights, not per-call
overhead, decide the speed. ``DIR`` gets (once) a random DeepSeek-V3 with an MTP layer of the vLLM
bench's ``mid`` dimensions (4 layers, hidden 1536, 16 heads, 16 routed experts of 768, top-4,
~0.6 GB bf16 with the MTP layer, vocabulary 2048). Random MTP weights accept nothing, so each
speculative child replaces the drafter's pick by an oracle: the plain greedy continuation (from a
plain run in the same child), wrong on purpose so that a fraction RATE of the drafts is accepted
(the k-th draft is right when floor(k * RATE) > floor((k - 1) * RATE)). Tokens must still equal
plain greedy's. It measures what the engine gives at a given acceptance, apart from the drafter's
quality.
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
try:
    tokens, _ = text_tokens(path, open(f"{path}/heldout.txt").read())
except FileNotFoundError:  # --mid: random weights, no text
    tokens = [1 + 37 * i % 2000 for i in range(n_prompt)]
prompt = torch.tensor([tokens[:n_prompt]])
m = quantplug.load(path, dtype=getattr(torch, dtype), progress=False)
spec = "mtp" if mode == "mtp" else None
oracle = float(sys.argv[8])
if spec and oracle >= 0:  # the drafter's pick replaced: right for a fraction `oracle` of the drafts
    from quantplug.generate import Generation
    plain = m.generate(prompt, new, eos_token_id=None)[0, n_prompt:].tolist()
    picks = [0]
    def pick(self, logits):
        picks[0] += 1
        k = picks[0]
        at = self.mtp_cache.length + 1 - n_prompt  # the new token this draft guesses
        right = int(k * oracle) > int((k - 1) * oracle)
        tok = plain[at] if at < len(plain) else 0
        return torch.tensor([tok if right else (tok + 1) % logits.shape[-1]])
    Generation._pick_draft = pick
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


def prompt_tokens(model: Path, n: int) -> list[int]:
    """The first ``n`` tokens of the model's held-out text; without one (``--mid``), fixed ids."""
    from quantplug.eval import text_tokens

    if not (model / "heldout.txt").exists():
        return [1 + 37 * i % 2000 for i in range(n)]
    return text_tokens(model, (model / "heldout.txt").read_text())[0][:n]


def write_mid(root: Path) -> Path:
    """The ``--mid`` model (random bf16 weights; the vLLM bench's ``mid`` dimensions, an MTP layer,
    vocabulary 2048), written once."""
    if (root / "config.json").exists():
        return root
    import torch
    from quantplug.testing import random_state, write_checkpoint
    from quantplug.testing.engines import mla_config

    cfg = mla_config(hidden_size=1536, intermediate_size=4096, moe_intermediate_size=768, n_routed_experts=16,
                     num_experts_per_tok=4, n_group=4, topk_group=2, num_attention_heads=16, num_key_value_heads=16,
                     q_lora_rank=768, num_hidden_layers=4, num_nextn_predict_layers=1, vocab_size=2048)
    state = {k: v.to(torch.bfloat16) for k, v in random_state(cfg, seed=3, mtp=True).items()}
    write_checkpoint(root, cfg, state)
    return root


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_child(model: Path, dtype: str, mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), dtype, mode, str(args.new), str(args.threads),
                          str(args.reps), str(args.prompt), str(args.oracle)], capture_output=True, text=True, env=env,
                         check=True)
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
        "spec": lambda: lm.speculative_step(prompt[:, -1], prompt[:, -2], cache, mcache),
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

    torch.set_num_threads(args.threads)
    prompt = torch.tensor([prompt_tokens(model, args.prompt)])
    for dtype in args.dtypes.split(","):
        m = quantplug.load(model, dtype=getattr(torch, dtype), progress=False)
        m.generate(prompt, 8, eos_token_id=None)
        with torch.inference_mode():
            ms = step_times(m.text_lm(), prompt)
        print(f"{dtype}: plain decode step (native stack) {ms['step']:.2f} ms; 1-token step through the modules "
              f"{ms['step_modules']:.2f} ms; 2-token verify forward {ms['verify']:.2f} ms; MTP draft pass "
              f"{ms['draft']:.2f} ms; whole speculative step (verify + draft, one call) {ms['spec']:.2f} ms "
              f"(medians of 60; load {load_average()})")
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
    ap.add_argument("--mid", type=Path, default=None,
                    help="write (once) and use the weight-bound random model with an MTP layer at this directory")
    ap.add_argument("--oracle", type=float, default=-1.0,
                    help="replace the drafter by the plain greedy continuation, right for this fraction of drafts")
    args = ap.parse_args()
    if args.mid is not None:
        args.model = write_mid(args.mid)
    if args.oracle >= 0 and not 0 <= args.oracle <= 1:
        ap.error("--oracle takes a fraction in [0, 1]")
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
