"""DeepSeek-V2 (examples/deepseek_v2, softmax router) against DeepSeek-V3 (sigmoid router) decode
tokens/s at the same dimensions (run by hand; figures go into docs with this command line).

    python bench/bench_router_kinds.py [--reps 4] [--new 32] [--prompt 32] [--threads 2] [--shape bench|small]

One float32 DeepSeek-V3-shaped checkpoint (bench_generate.py's: hidden 1024, 16 heads, 3 layers,
8 of 16 routed experts in 4 groups (2 taken) + 1 shared) is written twice: as DeepSeek-V3, and as
DeepSeek-V2 (``scoring_func`` softmax, ``topk_method`` group_limited_greedy, no correction bias; the
other weights the same). ``--shape small``: hidden 256, 8 heads, kv_lora 128, 6 layers, the same
experts (a step where the Python around each layer's native calls weighs more). Contenders, each in a fresh process, alternating, ``--reps`` rounds:
``v3``, ``v2`` (the whole-stack native step, one call per token) and ``v2-layers`` (the same model
with the stack step off: a decode step layer by layer, as DeepSeek-V2 decoded before its router was
data). Decode tokens/s = 1 / the median wall time of one decode step (the time between two
streamed tokens, three streamed generations of ``new`` tokens after a warm-up: a median, not a
difference of totals, so that other processes on a shared machine move it little). Prints each run, then per contender the median and the
ratio of medians to v3 and the per-round (paired) ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import bench_config  # noqa: E402
from quantplug.testing import random_state, write_checkpoint  # noqa: E402

CHILD = """
import json, sys, time, torch
import quantplug
path, prompt_len, new, threads, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
torch.set_num_threads(threads)
ids = torch.randint(0, 16000, (1, prompt_len), generator=torch.Generator().manual_seed(0))
m = quantplug.load(path, progress=False)
if layers:
    m.model._stack, m.model._stack_tried = None, True
def steps(n):
    # the wall time of each decode step of a streamed generation of n tokens
    ts = [time.perf_counter()]
    for _ in m.stream(ids, n, min_new_tokens=n, eos_token_id=None):
        ts.append(time.perf_counter())
    return [b - a for a, b in zip(ts[2:], ts[3:])]  # from the second token on: one decode step each
steps(4)
dt = sorted(t for _ in range(3) for t in steps(new))
out = m.generate(ids, new, min_new_tokens=new, eos_token_id=None)
tn, t1 = dt[len(dt) // 2] * (new - 1), 0.0
print(json.dumps({"decode_tps": (new - 1) / (tn - t1), "stack": m.model._stack is not None, "tokens": out[0].tolist()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="bench", choices=("bench", "small"))
    args = ap.parse_args()
    cfg = bench_config()
    if args.shape == "small":
        cfg.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=128,
                   qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
    state = random_state(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        v3 = write_checkpoint(Path(tmp) / "v3", cfg, state)
        cfg2 = dict(cfg, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", scoring_func="softmax",
                    topk_method="group_limited_greedy")
        v2 = write_checkpoint(Path(tmp) / "v2", cfg2,
                              {k: v for k, v in state.items() if not k.endswith("e_score_correction_bias")})
        runs: dict[str, list[float]] = {"v3": [], "v2": [], "v2-layers": []}
        for _ in range(args.reps):
            for name, path, layers in (("v3", v3, "0"), ("v2", v2, "0"), ("v2-layers", v2, "1")):
                r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(args.prompt), str(args.new),
                                    str(args.threads), layers], capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"child failed:\n{r.stderr[-3000:]}")
                out = json.loads(r.stdout.strip().splitlines()[-1])
                runs[name].append(out["decode_tps"])
                print(json.dumps({"contender": name, "decode_tps": round(out["decode_tps"], 2),
                                  "stack_step": out["stack"]}), flush=True)
        base = statistics.median(runs["v3"])
        for name, tps in runs.items():
            paired = [round(a / b, 3) for a, b in zip(tps, runs["v3"])]
            print(json.dumps({"contender": name, "median_tps": round(statistics.median(tps), 2),
                              "vs_v3": round(statistics.median(tps) / base, 3), "paired_vs_v3": paired}))


if __name__ == "__main__":
    main()
