"""DeepSeek-V4 decode tokens/s: the blocks' torch forwards, the per-block native steps and the whole
model in one native call per token (run by hand; figures go into docs with this command line).

    OMP_WAIT_POLICY=passive python bench/bench_v4_decode.py [--shape tiny|medium] [--reps 3] [--prompt 100] [--new 48] [--threads 2]

A float32 V4 checkpoint with random weights (transformers 5.25's ``DeepseekV4ForCausalLM`` initialized
as tests/v4_models.py does, written in the release's names): ``tiny`` is the test model (hidden 64,
3 layers SWA / CSA / HCA, q_lora 32); ``medium``: hidden 1024, 4 layers (SWA, CSA r 4, HCA r 128, CSA),
16 heads of 128 (rope 64), q_lora 256, 4 output groups of rank 256, window 128, indexer 8 heads of 64
with top-16, 16 routed experts (4 taken) of 512 + 1 shared, vocab 8192. The prompt and decode cross
the window and the compression windows. Contenders, each in a fresh process, alternating, ``--reps``
rounds: ``torch`` (every native step off), ``blocks`` (native per block: attention, MoE, mixes) and
``native`` (one call per token). Decode tokens/s = 1 / the median time of one decode step (streamed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, statistics, sys, time, torch
import quantplug
path, prompt_len, new, threads, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(threads)
m = quantplug.load(path, progress=False)
vocab = m.config.vocab_size
ids = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0))
if mode != "native":
    m._stack = None
if mode == "torch":
    for l in m.layers:
        l.attn.step = l.hc_attn.step = l.hc_ffn.step = l.ffn.experts.step = l.ffn.shared_experts.step = None
    m.hc_head.step = None
times = []
toks = None
with torch.no_grad():
    for rep in range(3):
        t = time.perf_counter()
        out = []
        for tok in m.stream(ids, new, eos_token_id=None):
            now = time.perf_counter(); times.append(now - t); t = now; out.append(int(tok))
        toks = out if toks is None else toks
step = statistics.median(times[len(times) // 4:])
print(json.dumps({"mode": mode, "step_ms": step * 1e3, "tok_s": 1 / step, "tokens": toks[:8]}))
"""

MEDIUM = {"vocab_size": 8192, "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
          "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 256, "o_groups": 4, "o_lora_rank": 256,
          "sliding_window": 128, "index_n_heads": 8, "index_head_dim": 64, "index_topk": 16,
          "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 512, "num_hash_layers": 1}


def write(shape: str, root: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import v4_models

    if shape == "tiny":
        over: dict = {"q_lora_rank": 32}
        ref = v4_models.reference_model(**over)
        cfg = over
    else:
        ratios = [0, 4, 128, 4]
        over = {k: v for k, v in MEDIUM.items() if k not in ("n_routed_experts", "num_experts_per_tok")}
        tf_over = {**over, "n_routed_experts": MEDIUM["n_routed_experts"],
                   "num_experts_per_tok": MEDIUM["num_experts_per_tok"], "compress_ratios": ratios,
                   "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}}
        # the module constants its writer and tid2eid table read
        v4_models.V, v4_models.E, v4_models.K, v4_models.INTER = 8192, 16, 4, 512
        ref = v4_models.reference_model(**tf_over)
        cfg = {**MEDIUM, "compress_ratios": ratios + [0]}
    return v4_models.write_float_checkpoint(root / shape, ref, config=cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=["tiny", "medium"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = write(a.shape, Path(d))
        res: dict[str, list[float]] = {"torch": [], "blocks": [], "native": []}
        for r in range(a.reps):
            for mode in res:
                out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(a.prompt), str(a.new), str(a.threads),
                                      mode], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
                got = json.loads(out)
                print(r, got, flush=True)
                res[mode].append(got["tok_s"])
        med = {k: statistics.median(v) for k, v in res.items()}
        for k, v in med.items():
            print(f"{a.shape} {k}: {v:.1f} tokens/s (median of {a.reps}; rounds {min(res[k]):.1f}-{max(res[k]):.1f}); "
                  f"{v / med['torch']:.2f}x torch")


if __name__ == "__main__":
    main()
