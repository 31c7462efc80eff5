"""Decode-step time of one KDA layer: the native step (``kda_step``) against its torch twin
(``kda_step_torch``), and the memory-bandwidth bound of the step.

    python bench/bench_kda.py [--reps 3] [--steps 10] [--threads 2] [--mib 96]

Sizes: Kimi-K3's KDA layer (H = 96 heads of K = V = 128: 6 MiB of float32 state per sequence) and
Kimi-Linear-48B's (H = 32: 2 MiB), one sequence, W = 4, the K3 (lower-bounded) forget gate; the
state in float32 and in bfloat16. A decode step goes through every KDA layer once, so the states
are read from memory, not from cache: each child holds enough layers' states (``--mib`` MiB in
all, default 96 MiB, three times this machine's 32 MiB L3) and times passes over all of them; a
layer's time is a pass's over the number of layers.

Every contender runs in a fresh process, contenders alternate over ``--reps`` rounds; each child
times ``--steps`` passes after one warm-up pass. Reported per row: the best and the median layer
time over every pass of every round. The bound: the state's bytes read once and written once over
the copy bandwidth of this machine (a ``--mib`` MiB ``Tensor.copy_`` on the same threads, best of 5:
bytes read + written / seconds), what a step that reads and writes its state once can reach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SIZES = {"Kimi-K3 (H=96)": 96, "Kimi-Linear-48B (H=32)": 32}
K, W = 128, 4
CONTENDERS = ("native", "torch")


def child(h: int, state_dtype: str, contender: str, steps: int, threads: int, mib: int) -> dict:
    import torch
    from quantplug.blocks.kda import kda_step_torch
    from quantplug.kernels import native
    from quantplug.kernels.kda import kda_step

    torch.set_num_threads(threads)
    dt = getattr(torch, state_dtype)
    d = h * K
    per_layer = h * K * K * dt.itemsize
    layers = max(1, -(-mib * 2 ** 20 // per_layer))
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    params = [(r(3 * d, W) * 0.5, r(d), r(h) * 0.5, 1 + 0.1 * r(K)) for _ in range(layers)]
    states = [((r(1, h, K, K) * 0.3).to(dt), r(1, 3 * d, W - 1)) for _ in range(layers)]
    toks = [(r(1, 3 * d), r(1, d), r(1, h), r(1, d)) for _ in range(layers)]
    fn = kda_step if contender == "native" else kda_step_torch
    if contender == "native" and native.library() is None:
        return {"error": native.status()}

    def one_pass() -> None:
        for (cw, dtb, al, nw), (s, cs), (u, gp, bl, gt) in zip(params, states, toks):
            o = fn(u, cw, cs, gp, dtb, al, -5.0, bl, gt, nw, 1e-5, s)
            assert o is not None

    with torch.inference_mode():
        one_pass()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            one_pass()
            times.append((time.perf_counter() - t0) / layers)
    return {"times": times, "layers": layers, "state_bytes": per_layer}


def bandwidth(threads: int, mib: int) -> float:
    """Bytes read + written per second of a ``mib`` MiB copy on ``threads`` threads, best of 5."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(mib * 2 ** 18)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mib", type=int, default=96)
    ap.add_argument("--child", nargs=3, metavar=("H", "DTYPE", "CONTENDER"))
    ap.add_argument("--bandwidth", action="store_true")
    a = ap.parse_args()
    if a.child:
        h, dtype, who = a.child
        print(json.dumps(child(int(h), dtype, who, a.steps, a.threads, a.mib)))
        return
    if a.bandwidth:
        print(json.dumps({"bw": bandwidth(a.threads, a.mib)}))
        return
    common = ["--steps", str(a.steps), "--threads", str(a.threads), "--mib", str(a.mib)]
    bw = max(run_child(["--bandwidth", *common[2:]])["bw"] for _ in range(2))
    times: dict[tuple[str, str, str], list[float]] = {}
    info: dict[tuple[str, str], int] = {}
    for _ in range(a.reps):
        for name, h in SIZES.items():
            for dtype in ("float32", "bfloat16"):
                for who in CONTENDERS:  # alternating, each in a fresh process
                    got = run_child(["--child", str(h), dtype, who, *common])
                    if "error" in got:
                        sys.exit(f"native step unavailable: {got['error']}")
                    times.setdefault((name, dtype, who), []).extend(got["times"])
                    info[(name, dtype)] = got["state_bytes"]
    print(f"copy bandwidth (read + written): {bw / 1e9:.1f} GB/s, {a.threads} threads; "
          f"{a.reps} rounds x {a.steps} passes over {a.mib} MiB of states")
    print("| layer | state | state MiB | bound ms | native best / median ms | torch best / median ms | "
          "native vs bound | torch / native |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in SIZES:
        for dtype in ("float32", "bfloat16"):
            nb = info[(name, dtype)]
            bound = 2 * nb / bw * 1e3
            n, t = times[(name, dtype, "native")], times[(name, dtype, "torch")]
            nbest, tbest = min(n) * 1e3, min(t) * 1e3
            print(f"| {name} | {dtype} | {nb / 2 ** 20:.0f} | {bound:.3f} | {nbest:.3f} / {statistics.median(n) * 1e3:.3f} "
                  f"| {tbest:.3f} / {statistics.median(t) * 1e3:.3f} | {nbest / bound:.2f}x | {tbest / nbest:.1f}x |")


if __name__ == "__main__":
    main()
