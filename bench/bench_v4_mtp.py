"""DeepSeek-V4 speculative decoding with its MTP block vs plain greedy, and the cost of the cache's
roll-back log, on the tiny V4 of tests/v4_models.py with random ``mtp.0.*`` weights (float32; run
by hand, figures go into docs/architectures/deepseek-v4.md with this command line).

    python bench/bench_v4_mtp.py [--reps 5] [--new 64] [--threads 1] [--rates 0,0.5,1]

In one process, contenders alternating each rep: plain greedy and speculative decoding at each
acceptance rate of ``--rates``. Random MTP weights accept nothing, so for a rate the drafter's pick
is replaced by an oracle (the plain greedy continuation, wrong on purpose so that a fraction RATE
of the drafts is right: the k-th draft is right when floor(k * RATE) > floor((k - 1) * RATE)); the
MTP block still runs every step. Tokens must equal plain greedy's. Reported: the median over reps
of decode milliseconds per token (``Generation.decode_seconds`` over the tokens after the first),
the measured acceptance; the cost of the roll-back log: one-token decode steps (``next_tokens``)
on two caches of a 40-token prompt, ``rollback=0`` (no log) and ``rollback=16`` (generation's
default), interleaved step by step (300 each, medians); the time of ``truncate`` by one token;
the load average.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _checkpoint(root: Path) -> Path:
    from test_deepseek_v4_mtp import _mtp_layer, _mtp_tensors
    from v4_models import reference_model, write_float_checkpoint

    ref = reference_model()
    return write_float_checkpoint(root / "ckpt", ref, _mtp_tensors(_mtp_layer(ref)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rates", default="0,0.5,1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import quantplug
    from quantplug.generate import Generation
    from quantplug.models import deepseek_v4 as m4

    rates = [float(r) for r in args.rates.split(",")]
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = quantplug.load(_checkpoint(Path(tmp)), progress=False)
    ids = torch.tensor([[5, 17, 33, 2, 71, 9, 12, 40]])
    plain = model.generate(ids, args.new, eos_token_id=None)[0, ids.shape[1]:].tolist()
    vocab = model.config.vocab_size

    def run(rate: float | None = None) -> tuple[float, Generation]:
        old_pick = Generation._pick_draft
        if rate is not None and rate < 1.01:
            count = [0]

            def pick(self: Any, logits: torch.Tensor) -> torch.Tensor:
                count[0] += 1
                k = count[0]
                i = self.mtp_cache.length + 1 - ids.shape[1]
                right = math.floor(k * rate) > math.floor((k - 1) * rate)
                return torch.tensor([plain[i] if right else (plain[i] + 1) % vocab])

            Generation._pick_draft = pick  # type: ignore[method-assign]
        try:
            g = model.stream(ids, args.new, eos_token_id=None, speculative=None if rate is None else "mtp")
            toks = [int(t[0]) for t in g]
        finally:
            Generation._pick_draft = old_pick  # type: ignore[method-assign]
        assert toks == plain, "tokens differ from plain greedy"
        return g.decode_seconds / (len(toks) - 1) * 1e3, g

    names = ["plain"] + [f"speculative, acceptance {r}" for r in rates]
    times: dict[str, list[float]] = {n: [] for n in names}
    accepted: dict[str, float | None] = {}
    with torch.inference_mode():
        run()
        for _ in range(args.reps):
            for name, kw in zip(names, [{}] + [{"rate": r} for r in rates]):
                ms, g = run(**kw)  # type: ignore[arg-type]
                times[name].append(ms)
                accepted[name] = g.acceptance_rate()
        attn = [layer.attn for layer in model.layers]
        prompt = torch.arange(40).view(1, -1) % vocab
        caches = {rb: m4.DeepseekV4Cache(attn, rb) for rb in (0, m4.ROLLBACK)}
        steps: dict[int, list[float]] = {rb: [] for rb in caches}
        for c in caches.values():
            model(prompt, cache=c)
        for i in range(300):
            for rb in (sorted(caches) if i % 2 else sorted(caches, reverse=True)):
                t0 = time.perf_counter()
                model.next_tokens(torch.tensor([[i % vocab]]), caches[rb])
                steps[rb].append(time.perf_counter() - t0)
        cache = caches[m4.ROLLBACK]
        spent = []
        for i in range(50):
            model(torch.tensor([[i % vocab, (7 * i) % vocab]]), cache=cache)
            t0 = time.perf_counter()
            cache.truncate(cache.length - 1)
            spent.append(time.perf_counter() - t0)
    base = statistics.median(times[names[0]])
    for name in names:
        med = statistics.median(times[name])
        acc = accepted.get(name)
        print(f"{name:32s} {med:7.2f} ms/token  ({base / med:.2f}x plain)"
              + ("" if acc is None or "plain" in name else f"  measured acceptance {acc:.2f}"))
    off, on = (statistics.median(steps[rb]) * 1e3 for rb in sorted(steps))
    print(f"decode step without / with the roll-back log: {off:.2f} / {on:.2f} ms ({on / off:.3f}x)")
    print(f"truncate by one token ({len(model.layers)} layers): median {statistics.median(spent) * 1e6:.0f} us")
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}; tokens equal plain greedy's")


if __name__ == "__main__":
    main()
