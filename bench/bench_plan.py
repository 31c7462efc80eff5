"""Plan time of the header-only releases (run by hand; figures go into docs/scale.md with this command).

    python bench/bench_plan.py [--reps 3] [--only DeepSeek-V3,Kimi-K3] [--root DIR] [--baseline DIR]

Each checkpoint is written header-only (``quantplug.testing.scale.write_header_only``: real
safetensors headers and index, data a hole) into ``--root`` (kept there and reused when given, else a
temporary directory): DeepSeek-V3 (163 shards, 91,991 tensors), Kimi-K2 (61, 139,644), Kimi-K3 (93,
497,052), DeepSeek-V4-Flash (46, 69,187) and V4-Pro (64, 145,116). For each, ``--reps`` rounds of two
fresh processes, alternating:

* ``headers``: read and JSON-parse every shard header and the index (the least any safetensors
  loader does: the baseline the plan is compared with in the same run);
* ``plan``: ``quantplug.plan.build_plan(path, options={"expert_cache_mb": 4096})`` (the routed
  experts served from the files, as the scale tests plan them), plugins imported before the clock.

* ``--baseline DIR``: a third contender, the same plan with ``DIR`` first on ``PYTHONPATH``, where
  ``DIR/quantplug`` is another tree's ``core/`` (``git archive main core | tar -x -C DIR && mv
  DIR/core DIR/quantplug``): before / after in the same run, the backends the installed ones.

CPU seconds of the measured call (``time.process_time``) and wall seconds, best and median; the
plan's problem count is printed too (a V4 layout that no backend plans yet reports its problems,
its time still measured). The load average is printed before and after: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HEADERS = """
import json, struct, sys, time
from pathlib import Path
root = Path(sys.argv[1]); files = sorted(root.glob('*.safetensors'))
c, w = time.process_time(), time.perf_counter()
for f in files:
    with open(f, 'rb') as fh:
        (n,) = struct.unpack('<Q', fh.read(8))
        json.loads(fh.read(n))
json.loads((root / 'model.safetensors.index.json').read_bytes())
print(json.dumps({"cpu": time.process_time() - c, "wall": time.perf_counter() - w}))
"""
PLAN = """
import json, sys, time
from quantplug.plan import build_plan
from quantplug.plugins import get_plugin_manager
get_plugin_manager()
c, w = time.process_time(), time.perf_counter()
p = build_plan(sys.argv[1], options={'expert_cache_mb': 4096})
cpu, wall = time.process_time() - c, time.perf_counter() - w
print(json.dumps({"cpu": cpu, "wall": wall, "problems": len(p.problems), "tensors": len(p.checkpoint.tensors)}))
"""


def configs() -> dict[str, dict]:
    from quantplug.testing.scale import (
        deepseek_v3_config,
        deepseek_v4_config,
        kimi_k2_config,
        kimi_k3_config,
    )

    return {"DeepSeek-V3": deepseek_v3_config(), "Kimi-K2": kimi_k2_config(), "Kimi-K3": kimi_k3_config(),
            "DeepSeek-V4-Flash": deepseek_v4_config("flash"), "DeepSeek-V4-Pro": deepseek_v4_config("pro")}


def child(code: str, path: Path, pythonpath: str = "") -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"child failed on {path}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def summary(runs: list[dict], key: str) -> dict:
    xs = [r[key] for r in runs]
    return {"best": round(min(xs), 3), "median": round(statistics.median(xs), 3)}


def bench(root: Path, names: list[str], reps: int, baseline: str = "") -> dict:
    from quantplug.testing.scale import write_header_only

    cfgs = configs()
    out: dict[str, dict] = {}
    for name in names:
        path = root / name
        if not (path / "model.safetensors.index.json").is_file():
            write_header_only(path, cfgs[name])
        base, plan, before = [], [], []
        for _ in range(reps):  # alternating, each in a fresh process
            base.append(child(HEADERS, path))
            plan.append(child(PLAN, path))
            if baseline:
                before.append(child(PLAN, path, baseline))
        out[name] = {"shards": len(list(path.glob("*.safetensors"))), "tensors": plan[0]["tensors"],
                     "problems": plan[0]["problems"], "reps": reps,
                     "plan_cpu_s": summary(plan, "cpu"), "plan_wall_s": summary(plan, "wall"),
                     "headers_cpu_s": summary(base, "cpu"), "headers_wall_s": summary(base, "wall"),
                     "plan_over_headers_cpu_best": round(min(r["cpu"] for r in plan) / min(r["cpu"] for r in base), 2)}
        if before:
            out[name].update(baseline_problems=before[0]["problems"], baseline_plan_cpu_s=summary(before, "cpu"),
                             baseline_plan_wall_s=summary(before, "wall"),
                             baseline_over_plan_cpu_best=round(min(r["cpu"] for r in before)
                                                               / min(r["cpu"] for r in plan), 2))
        print(json.dumps({name: out[name]}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated checkpoint names (default: all five)")
    ap.add_argument("--root", default="", help="keep the header-only checkpoints here (reused if present)")
    ap.add_argument("--baseline", default="", help="a directory holding another tree's core/ as quantplug/")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(configs())
    unknown = set(names) - set(configs())
    if unknown:
        raise SystemExit(f"unknown checkpoint(s) {sorted(unknown)}; expected some of {list(configs())}")
    print(json.dumps({"load_average_before": os.getloadavg()}), flush=True)
    if args.root:
        out = bench(Path(args.root), names, args.reps, args.baseline)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = bench(Path(tmp), names, args.reps, args.baseline)
    print(json.dumps({"load_average_after": os.getloadavg(), "plans": out}, indent=2))


if __name__ == "__main__":
    main()
