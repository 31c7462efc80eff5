"""Core benchmarks (run by hand; figures go into README with this command line).

    python bench/bench_core.py [--gib 1.0]

1. Dense load throughput: quantplug.load of a generated bf16 checkpoint (converted to fp32, so
   every tensor is materialized) against safe_open + get_tensor + .float() of the same tensors;
   each in a fresh process (imports excluded), alternating, ``--reps`` times: best and median.
   Whole process (imports included), load + one forward: quantplug against transformers'
   AutoModelForCausalLM.from_pretrained on the same checkpoint, alternating likewise.
2. Plan time of a 351-shard index: a DeepSeek-V3-shaped config (61 layers, 256 routed experts,
   hub layout, tiny dimensions) spread over 351 shards, planned from headers.
3. Peak RSS of the load against the model's size (in a child process).
4. ``--release``: plan of the header-only DeepSeek-V3 release (163 shards, 91,991 tensors),
   Kimi-K2 (61 shards, 139,644 tensors) and Kimi-K3 (93 shards, 497,052 tensors, compressed-tensors
   MXFP4 experts) at their real names and shapes (sparse files, no data),
   CPU seconds best of ``--reps``, each contender in a fresh process, alternating with the
   baseline: reading and JSON-parsing every shard header (the least any safetensors loader does).
   Only this section runs with ``--release``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import quantplug
import torch
from quantplug.loader import model_bytes
from quantplug.plan import build_plan
from quantplug.testing import hub_rope_spelling, random_state, tiny_config, write_checkpoint
from safetensors import safe_open


def sized_config(gib: float) -> dict:
    # hidden 1024, 4 layers, 32 experts of 512: about gib GiB in bf16 after scaling the vocab
    cfg = tiny_config(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=4,
                      n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, q_lora_rank=512,
                      kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
    per_layer_params = 3 * 32 * 512 * 1024
    layers = max(2, int(gib * 2**30 / 2 / (per_layer_params * 1.3)))
    cfg["num_hidden_layers"] = layers
    return cfg


BASE_LOAD = """
import sys, time, torch
from pathlib import Path
from safetensors import safe_open
t0 = time.perf_counter(); out = {}
for f in sorted(Path(sys.argv[1]).glob('*.safetensors')):
    with safe_open(str(f), 'pt') as h:
        for k in h.keys():
            out[k] = h.get_tensor(k).float()
print(time.perf_counter() - t0)
"""
OURS_LOAD = """
import sys, time, torch, quantplug
from quantplug.plugins import get_plugin_manager
get_plugin_manager()  # plugins imported before the clock starts, as torch is for both
t0 = time.perf_counter(); m = quantplug.load(sys.argv[1], progress=False)
print(time.perf_counter() - t0)
"""
# whole process, imports included: load + one forward of 16 tokens
HF_PROCESS = """
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
with torch.no_grad():
    m(torch.arange(16).unsqueeze(0))
"""
OURS_PROCESS = """
import sys, torch, quantplug
m = quantplug.load(sys.argv[1], progress=False)
with torch.no_grad():
    m(torch.arange(16).unsqueeze(0))
"""


def _child(code: str, path: Path) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"child failed:\n{r.stderr[-2000:]}")
    out = r.stdout.strip()
    return float(out.splitlines()[-1]) if out else wall


def _alternate(a: str, b: str, path: Path, reps: int) -> tuple[list[float], list[float]]:
    ta, tb = [], []
    for _ in range(reps):  # alternate, each in a fresh process: no allocator or cache carry-over
        ta.append(_child(a, path))
        tb.append(_child(b, path))
    return ta, tb


def bench_load(root: Path, gib: float, reps: int) -> dict:
    cfg = sized_config(gib)
    path = root / "dense"
    state = random_state(cfg, seed=0)
    write_checkpoint(path, hub_rope_spelling(cfg), state, shards=4, dtype=torch.bfloat16)
    del state
    nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    for f in path.glob("*.safetensors"):  # page cache warm for every contender
        f.read_bytes()
    base, ours = _alternate(BASE_LOAD, OURS_LOAD, path, reps)
    hf, ours_p = _alternate(HF_PROCESS, OURS_PROCESS, path, reps)
    med = statistics.median
    return {"checkpoint_bytes": nbytes, "reps": reps,
            "safe_open_get_tensor_float_s": {"best": round(min(base), 3), "median": round(med(base), 3)},
            "quantplug_load_s": {"best": round(min(ours), 3), "median": round(med(ours), 3)},
            "throughput_ratio_vs_safe_open": {"best_vs_best": round(min(base) / min(ours), 3),
                                              "median_vs_median": round(med(base) / med(ours), 3)},
            "process_transformers_from_pretrained_forward_s": {"best": round(min(hf), 3), "median": round(med(hf), 3)},
            "process_quantplug_load_forward_s": {"best": round(min(ours_p), 3), "median": round(med(ours_p), 3)},
            "path": str(path)}


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


RELEASE_BASE = """
import json, struct, sys, time
from pathlib import Path
files = sorted(Path(sys.argv[1]).glob('*.safetensors'))
c = time.process_time()
for f in files:
    with open(f, 'rb') as fh:
        (n,) = struct.unpack('<Q', fh.read(8))
        json.loads(fh.read(n))
print(time.process_time() - c)
"""
RELEASE_PLAN = """
import sys, time, quantplug
from quantplug.plugins import get_plugin_manager
get_plugin_manager()
c = time.process_time()
p = quantplug.plan(sys.argv[1], options={'expert_cache_mb': 4096})
t = time.process_time() - c
assert not p.problems, p.problems
print(t)
"""


def bench_release_plans(root: Path, reps: int) -> dict:
    from quantplug.testing.scale import deepseek_v3_config, kimi_k2_config, kimi_k3_config, write_header_only

    out = {}
    for name, cfg in (("DeepSeek-V3", deepseek_v3_config()), ("Kimi-K2", kimi_k2_config()),
                      ("Kimi-K3", kimi_k3_config())):
        path = write_header_only(root / name, cfg)
        n = len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
        base, ours = _alternate(RELEASE_BASE, RELEASE_PLAN, path, reps)
        out[name] = {"shards": len(list(path.glob("*.safetensors"))), "tensors": n, "reps": reps,
                     "plan_cpu_s": {"best": round(min(ours), 3), "median": round(statistics.median(ours), 3)},
                     "json_headers_cpu_s": {"best": round(min(base), 3),
                                            "median": round(statistics.median(base), 3)},
                     "plan_over_headers_best": round(min(ours) / min(base), 2)}
    return out


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
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--release", action="store_true", help="only section 4: plans of the header-only releases")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.release:
            print(json.dumps({"release_plans": bench_release_plans(root, args.reps)}, indent=2))
            return
        load = bench_load(root, args.gib, args.reps)
        print(json.dumps({"load": load}, indent=2), flush=True)
        print(json.dumps({"rss": bench_rss(Path(load["path"]))}, indent=2), flush=True)
        print(json.dumps({"plan": bench_plan_351(root)}, indent=2), flush=True)
    print("max rss of this process:", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MiB")


if __name__ == "__main__":
    main()
