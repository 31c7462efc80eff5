"""Core benchmarks (run by hand; figures go into README with this command line).

    python bench/bench_core.py [--gib 1.0]

1. Dense load throughput: quantplug.load of a generated bf16 checkpoint (converted to fp32, so
   every tensor is materialized) against safe_open + get_tensor + .float() of the same tensors,
   in the same run.
2. Plan time of a 351-shard index: a DeepSeek-V3-shaped config (61 layers, 256 routed experts,
   hub layout, tiny dimensions) spread over 351 shards, planned from headers.
3. Peak RSS of the load against the model's size (in a child process).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import quantplug
import torch
from quantplug.loader import model_bytes
from quantplug.plan import build_plan
from quantplug.testing import random_state, tiny_config, write_checkpoint
from safetensors import safe_open


def sized_config(gib: float) -> dict:
    # hidden 1024, 4 layers, 32 experts of 512: about gib GiB in bf16 after scaling the vocab
    cfg = tiny_config(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=4,
                      n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, q_lora_rank=512,
                      kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                      num_attention_heads=8, vocab_size=32000)
    per_layer_params = 3 * 32 * 512 * 1024
    layers = max(2, int(gib * 2**30 / 2 / (per_layer_params * 1.3)))
    cfg["num_hidden_layers"] = layers
    return cfg


def bench_load(root: Path, gib: float) -> dict:
    cfg = sized_config(gib)
    path = root / "dense"
    state = random_state(cfg, seed=0)
    write_checkpoint(path, cfg, state, shards=4, dtype=torch.bfloat16)
    del state
    nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    # warm the page cache for both contenders
    for f in path.glob("*.safetensors"):
        f.read_bytes()
    t0 = time.perf_counter()
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k).float()
    base = time.perf_counter() - t0
    del out
    t0 = time.perf_counter()
    model = quantplug.load(path, progress=False)
    ours = time.perf_counter() - t0
    mb = model_bytes(model)
    del model
    return {"checkpoint_bytes": nbytes, "model_bytes": mb, "safe_open_get_tensor_float_s": round(base, 3),
            "quantplug_load_s": round(ours, 3), "throughput_ratio_vs_safe_open": round(base / ours, 3),
            "quantplug_GBps": round(nbytes / ours / 1e9, 3), "path": str(path)}


def bench_plan_351(root: Path) -> dict:
    cfg = tiny_config(hidden_size=32, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=61,
                      n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, q_lora_rank=32,
                      kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, vocab_size=64,
                      num_attention_heads=1, first_k_dense_replace=3)
    path = write_checkpoint(root / "shards351", cfg, random_state(cfg), shards=351)
    n = len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        p = build_plan(path)
        times.append(time.perf_counter() - t0)
    assert not p.errors
    return {"shards": 351, "tensors": n, "plan_s_best_of_3": round(min(times), 3)}


HWM = "int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]) * 1024"
CHILD = f"""
import sys, torch, quantplug
from quantplug.loader import model_bytes
m = quantplug.load(sys.argv[1], progress=False)
print(model_bytes(m), {HWM})
"""
# ru_maxrss survives fork+exec on Linux (the child would report the parent's peak); VmHWM does not
BASE = f"import torch, quantplug; print({HWM})"


def bench_rss(path: Path) -> dict:
    base = int(subprocess.run([sys.executable, "-c", BASE], capture_output=True, text=True, check=True).stdout)
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, check=True).stdout
    mb, peak = (int(x) for x in out.split())
    largest = max(f.stat().st_size for f in path.glob("*.safetensors")) // 4  # crude bound, reported only
    return {"model_bytes": mb, "peak_rss_bytes": peak, "interpreter_baseline_rss": base,
            "peak_minus_baseline_over_model": round((peak - base) / mb, 3), "largest_shard_quarter": largest}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        load = bench_load(root, args.gib)
        print(json.dumps({"load": load}, indent=2), flush=True)
        print(json.dumps({"rss": bench_rss(Path(load["path"]))}, indent=2), flush=True)
        print(json.dumps({"plan": bench_plan_351(root)}, indent=2), flush=True)
    print("max rss of this process:", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MiB")


if __name__ == "__main__":
    main()
