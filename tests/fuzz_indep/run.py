"""Runner: ``cd tests && python -m fuzz_indep.run --cases N --seed S [--workers 2]``.

Builds the seed corpus into a scratch directory, starts worker processes (each imports quantplug
once and runs many cases; a worker that crashes, hangs or runs out of memory is replaced), and
prints a report: counts per outcome and per mutator, and every failing case with its reproducer
(``python -m fuzz_indep.run --seed S --case I``). Failing inputs are written under ``--out``.
A case is a pure function of (seed, case index) and the corpus.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from . import corpus, mutators, oracle

AS_HEADROOM = 4 << 30  # address space a worker may add to what importing quantplug took


def _vm_size() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _base_logits(seeds: list[tuple[str, Path]]) -> dict[str, Any]:
    import quantplug
    import torch

    out = {}
    for name, path in seeds:
        model = quantplug.load(path)
        with torch.no_grad():
            out[name] = model(torch.tensor(oracle.IDS)).float()
        del model
    return out


def _worker(conn: Connection, seeds: list[tuple[str, Path]], scratch: str, wid: int, out_dir: str,
            cli_every: int, sub_every: int) -> None:
    import gc

    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    base = _base_logits(seeds)
    limit = _vm_size() + AS_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", wid))
    root = Path(scratch)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        run_seed, index = msg
        case = root / "cases" / f"w{wid}" / f"c{index}"
        if case.exists():
            shutil.rmtree(case)
        t0 = time.perf_counter()
        try:
            seed_name, muts = mutators.make_case(run_seed, index, seeds, case, root / f"outside_w{wid}")
            res = oracle.run_case(case, muts, base.get(seed_name), cli=cli_every > 0 and index % cli_every == 0,
                                  subprocess_cli=sub_every > 0 and index % sub_every == 0)
        except Exception as exc:  # noqa: BLE001 (a bug of this harness, reported as such)
            seed_name, muts = "?", []
            res = {"outcome": "harness-error", "reason": f"{type(exc).__name__}: {exc} ({oracle._where(exc)})"}
        res.update(index=index, seed=seed_name, mutations=[asdict(m) for m in muts],
                   seconds=round(time.perf_counter() - t0, 3))
        if res["outcome"] in oracle.FAILURES and out_dir:
            _save(case, Path(out_dir) / f"case_{index}", res)
        shutil.rmtree(case, ignore_errors=True)
        if index % 50 == 0:
            gc.collect()
        res["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        conn.send(("result", res))


def _save(case: Path, dst: Path, res: dict[str, Any]) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for p in case.iterdir():
        try:
            if p.is_symlink():
                os.symlink(os.readlink(p), dst / p.name)
            elif p.is_dir():
                shutil.copytree(p, dst / p.name, symlinks=True)
            elif p.is_file():
                shutil.copyfile(p, dst / p.name)
            else:
                (dst / (p.name + ".SPECIAL")).write_text("a FIFO or device in the case\n")
        except OSError as exc:
            (dst / (p.name + ".UNSAVED")).write_text(f"{exc}\n")
    (dst / "OUTCOME.json").write_text(json.dumps(res, indent=1, default=str))


class Pool:
    def __init__(self, n: int, seeds: list[tuple[str, Path]], scratch: Path, out: Path, timeout: float,
                 cli_every: int, sub_every: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.seeds, self.scratch, self.out, self.timeout = seeds, scratch, out, timeout
        self.cli_every, self.sub_every = cli_every, sub_every
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Connection] = {}
        self.busy: dict[int, tuple[tuple[int, int], float]] = {}
        self.restarts = 0
        for w in range(n):
            self.start(w)

    def start(self, wid: int) -> None:
        a, b = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(b, self.seeds, str(self.scratch), wid, str(self.out),
                                                   self.cli_every, self.sub_every), daemon=True)
        p.start()
        b.close()
        if not a.poll(600):
            raise RuntimeError(f"worker {wid} did not start")
        msg = a.recv()
        if msg[0] != "ready":
            raise RuntimeError(f"worker {wid}: {msg}")
        self.procs[wid], self.conns[wid] = p, a

    def kill(self, wid: int) -> int | None:
        p = self.procs.pop(wid)
        if p.is_alive():
            p.kill()
        p.join(10)
        self.conns.pop(wid).close()
        return p.exitcode

    def close(self) -> None:
        for wid in list(self.procs):
            with contextlib.suppress(OSError):
                self.conns[wid].send(None)
            self.procs[wid].join(10)
            self.kill(wid)


def _lost(pool: Pool, wid: int, job: tuple[int, int], why: str, exitcode: int | None) -> dict[str, Any]:
    run_seed, index = job
    if why == "hang":
        outcome, reason = "hang", f"case ran past {pool.timeout:.0f} s"
    elif exitcode == -signal.SIGKILL:
        outcome, reason = "oom", "worker killed (SIGKILL: the kernel's OOM killer)"
    else:
        outcome, reason = "crash", f"worker died (exit code {exitcode})"
    case = Path(tempfile.mkdtemp(prefix="lost_", dir=pool.scratch)) / "case"
    try:
        seed_name, muts = mutators.make_case(run_seed, index, pool.seeds, case, pool.scratch / "outside_parent")
    except Exception as exc:  # noqa: BLE001
        seed_name, muts = "?", []
        reason += f"; rebuilding the case failed: {exc}"
    res = {"outcome": outcome, "reason": reason, "index": index, "seed": seed_name,
           "mutations": [asdict(m) for m in muts], "meaning": max((m.meaning for m in muts), default="none",
                                                                   key=mutators.RANK.__getitem__)}
    _save(case, pool.out / f"case_{index}", res)
    shutil.rmtree(case.parent, ignore_errors=True)
    return res


def run(cases: int, seed: int, workers: int, out: Path, *, start: int = 0, timeout: float = 30.0,
        cli_every: int = 8, sub_every: int = 250, budget_s: float | None = None,
        scratch: Path | None = None, quiet: bool = False) -> dict[str, Any]:
    t0 = time.time()
    own = scratch is None
    scratch = Path(tempfile.mkdtemp(prefix="qp_indep_fuzz_")) if scratch is None else scratch
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    try:
        seeds = [(s.name, s.path) for s in corpus.build(scratch / "seeds")]
        build_s = time.time() - t0
        pool = Pool(workers, seeds, scratch, out, timeout, cli_every, sub_every)
        todo = list(range(start, start + cases))[::-1]
        maxrss = 0
        while todo or pool.busy:
            if budget_s is not None and time.time() - t0 > budget_s:
                todo.clear()
            for wid in list(pool.procs):
                if wid not in pool.busy and todo:
                    job = (seed, todo.pop())
                    pool.conns[wid].send(job)
                    pool.busy[wid] = (job, time.time())
            if not pool.busy:
                break
            ready = wait([pool.conns[w] for w in pool.busy], timeout=1.0)
            for wid in list(pool.busy):
                conn = pool.conns[wid]
                job, since = pool.busy[wid]
                if conn in ready:
                    try:
                        kind, res = conn.recv()
                    except (EOFError, OSError):
                        code = pool.kill(wid)
                        results.append(_lost(pool, wid, job, "died", code))
                        del pool.busy[wid]
                        pool.restarts += 1
                        pool.start(wid)
                        continue
                    maxrss = max(maxrss, res.get("maxrss_kb", 0))
                    results.append(res)
                    del pool.busy[wid]
                elif time.time() - since > timeout:
                    pool.kill(wid)
                    results.append(_lost(pool, wid, job, "hang", None))
                    del pool.busy[wid]
                    pool.restarts += 1
                    pool.start(wid)
            if not quiet and len(results) % 1000 == 0 and results and ready:
                done = len(results)
                print(f"  {done} cases, {time.time() - t0:.0f} s, failures so far "
                      f"{sum(r['outcome'] in oracle.FAILURES for r in results)}", file=sys.stderr, flush=True)
        pool.close()
    finally:
        if own:
            shutil.rmtree(scratch, ignore_errors=True)
    wall = time.time() - t0
    report = summarize(results, seed, wall, build_s, maxrss, pool.restarts)
    (out / "report.json").write_text(json.dumps({"summary": report, "results": results}, default=str))
    return report


def summarize(results: list[dict[str, Any]], seed: int, wall: float, build_s: float, maxrss_kb: int,
              restarts: int) -> dict[str, Any]:
    outcomes = Counter(r["outcome"] for r in results)
    per_mut: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        for m in r["mutations"]:
            per_mut[m["mutator"].split(".")[0]][r["outcome"]] += 1
    failures = sorted((r for r in results if r["outcome"] in (*oracle.FAILURES, "harness-error")),
                      key=lambda r: r["index"])
    return {"seed": seed, "cases": len(results), "wall_s": round(wall, 1), "corpus_build_s": round(build_s, 1),
            "worker_peak_rss_mb": round(maxrss_kb / 1024, 1), "worker_restarts": restarts,
            "outcomes": dict(outcomes), "per_mutator": {k: dict(v) for k, v in sorted(per_mut.items())},
            "failures": [{"index": r["index"], "outcome": r["outcome"], "seed": r["seed"],
                          "mutations": [f"{m['mutator']} {m['file']}: {m['detail']}" for m in r["mutations"]],
                          "reason": r.get("reason", "")[:600]} for r in failures]}


def print_report(rep: dict[str, Any], out: Path) -> None:
    print(f"independent fuzz: seed {rep['seed']}, {rep['cases']} cases, {rep['wall_s']} s wall "
          f"(corpus {rep['corpus_build_s']} s), worker peak RSS {rep['worker_peak_rss_mb']} MB, "
          f"{rep['worker_restarts']} worker restarts")
    print("outcomes:")
    for k in oracle.OUTCOMES:
        print(f"  {k:18s} {rep['outcomes'].get(k, 0)}")
    cols = [k for k in oracle.OUTCOMES if any(v.get(k) for v in rep["per_mutator"].values())]
    print("per mutator: " + " ".join(f"{c[:9]:>9s}" for c in cols))
    for mut, counts in rep["per_mutator"].items():
        print(f"  {mut:10s} " + " ".join(f"{counts.get(c, 0):9d}" for c in cols))
    if rep["failures"]:
        print(f"failures ({len(rep['failures'])}; inputs under {out}):")
        for f in rep["failures"]:
            print(f"  [{f['outcome']}] case {f['index']} (seed dir {f['seed']}): {' + '.join(f['mutations'])}")
            print(f"      {f['reason'][:400]}")
            print(f"      reproduce: cd tests && python -m fuzz_indep.run --seed {rep['seed']} --case {f['index']}")


def replay(seed: int, index: int, out: Path) -> dict[str, Any]:
    """One case in this process (a debugger-friendly reproducer); the case is left under ``out``."""
    scratch = Path(tempfile.mkdtemp(prefix="qp_indep_replay_"))
    try:
        seeds = [(s.name, s.path) for s in corpus.build(scratch / "seeds")]
        case = out / f"replay_{seed}_{index}"
        if case.exists():
            shutil.rmtree(case)
        seed_name, muts = mutators.make_case(seed, index, seeds, case, scratch / "outside")
        base = _base_logits([s for s in seeds if s[0] == seed_name])[seed_name]
        res = oracle.run_case(case, muts, base, cli=True)
        res.update(index=index, seed=seed_name, mutations=[asdict(m) for m in muts])
        return res
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz_indep.run", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=4242001)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case")
    ap.add_argument("--out", type=Path, default=None, help="failing inputs and report.json (default /tmp/...)")
    ap.add_argument("--case", type=int, default=None, help="replay this one case in process and print it")
    ap.add_argument("--cli-every", type=int, default=8, help="run `quantplug plan` in process every N cases")
    ap.add_argument("--subprocess-every", type=int, default=250, help="... and as a subprocess every N cases")
    a = ap.parse_args(argv)
    out = a.out or Path(tempfile.gettempdir()) / f"qp_indep_fuzz_out_{a.seed}"
    if a.case is not None:
        res = replay(a.seed, a.case, out)
        print(json.dumps(res, indent=1, default=str))
        print(f"case directory: {out / f'replay_{a.seed}_{a.case}'}")
        return 1 if res["outcome"] in oracle.FAILURES else 0
    rep = run(a.cases, a.seed, a.workers, out, start=a.start, timeout=a.timeout, cli_every=a.cli_every,
              sub_every=a.subprocess_every)
    print_report(rep, out)
    return 1 if rep["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
