"""What load option ``mmap=False`` costs: load time and memory of private copies vs zero-copy views.

``python bench/bench_mmap.py [--gib 0.5] [--reps 3]``: a dense checkpoint of about ``--gib`` GiB
stored in float32 (the load dtype, so every tensor is used as stored: the zero-copy case) with
bench_core's shapes; each contender (``mmap`` true / false) in a fresh process, alternating, the
page cache warm. Reported per contender (best and median): load seconds (plan included), the
first 16-token forward, and, after the load, the process's anonymous resident memory (RssAnon:
what the process owns) and file-backed resident memory (RssFile: page-cache pages it maps),
each minus a bare interpreter's with torch and quantplug imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from quantplug.testing import hub_rope_spelling, random_state, write_checkpoint

CHILD = """
import json, sys, time, torch, quantplug
from quantplug.plugins import get_plugin_manager

def status():
    out = {}
    for line in open('/proc/self/status'):
        k, _, v = line.partition(':')
        if k in ('RssAnon', 'RssFile', 'VmHWM'):
            out[k] = int(v.split()[0]) * 1024
    return out

get_plugin_manager()
base = status()
if sys.argv[2] != 'none':
    t0 = time.perf_counter()
    m = quantplug.load(sys.argv[1], options={'mmap': sys.argv[2] == 'true'}, progress=False)
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        m(torch.arange(16).unsqueeze(0))
    fwd = time.perf_counter() - t0
else:
    load = fwd = 0.0
after = status()
print(json.dumps({'load_s': load, 'forward_s': fwd, **{k: after[k] - base[k] for k in after}}))
"""


def _sized_config(gib: float) -> dict:
    spec = importlib.util.spec_from_file_location("bench_core", Path(__file__).with_name("bench_core.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.sized_config(gib / 2)  # its sizes are for bf16; float32 doubles them


def _child(path: Path, mmap: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), mmap], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"child failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _sized_config(args.gib)
        path = Path(tmp) / "dense"
        state = random_state(cfg, seed=0)
        write_checkpoint(path, hub_rope_spelling(cfg), state, shards=4, dtype=torch.float32)
        del state
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        for f in path.glob("*.safetensors"):
            f.read_bytes()  # page cache warm for both
        runs: dict[str, list[dict]] = {"true": [], "false": []}
        for _ in range(args.reps):
            for mode in runs:
                runs[mode].append(_child(path, mode))
        print(f"checkpoint {nbytes / 2**20:.1f} MiB (float32, loaded as float32: every tensor zero-copy by default), "
              f"{args.reps} alternating runs")
        for mode, rs in runs.items():
            def stat(key: str, scale: float = 1.0, rs: list[dict] = rs) -> str:
                vals = [r[key] / scale for r in rs]
                return f"{min(vals):.3f} / {statistics.median(vals):.3f}"
            print(f"  mmap={mode:5s}: load s {stat('load_s')} (best / median), first forward s {stat('forward_s')}, "
                  f"RssAnon MiB {stat('RssAnon', 2**20)}, RssFile MiB {stat('RssFile', 2**20)}, "
                  f"VmHWM growth MiB {stat('VmHWM', 2**20)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
