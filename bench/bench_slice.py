"""Load and generate on a DeepSeek-V3-dimension slice with its routed experts served from SSD.

    python bench/make_dsv3_slice.py --out /tmp/dsv3-slice4 --layers 4      # 38.8 GB FP8, > this machine's RAM
    python bench/bench_slice.py /tmp/dsv3-slice4 --cache-gb 4 --tokens 16
    python bench/bench_slice.py /tmp/dsv3-slice4 --cache-gb 4 --compare readers   # 1 vs 4 reader threads
    python bench/bench_slice.py /tmp/dsv3-slice4 --cache-gb 4 --compare prefetch  # expert_prefetch on / off
    python bench/make_dsv3_slice.py --out /tmp/dsv3-slice2 --layers 2      # 15.8 GB: fits in memory
    python bench/bench_slice.py /tmp/dsv3-slice2 --cache-gb 0 --tokens 8   # all in memory: vs memory bandwidth
    python bench/make_k3_slice.py --out /tmp/k3-slice                      # Kimi-K3: 1 KDA + 1 MLA/MoE layer, 23.6 GB
    python bench/bench_slice.py /tmp/k3-slice --cache-gb 2 --tokens 16     # 896 MXFP4 experts served from the files
    python bench/make_v4_slice.py --out /tmp/v4-slice                      # DeepSeek-V4-Flash: CSA + HCA layer, 9.28 GB
    python bench/bench_slice.py /tmp/v4-slice --cache-gb 1 --prompt 16 --tokens 16   # 512 FP4 experts from the files

Each run is a fresh process: plan (headers only), load with ``expert_cache_mb`` (bfloat16 model),
a forward of the prompt, then greedy decode of ``--tokens`` tokens through the latent cache. The
checkpoint's pages are dropped from the page cache first (``posix_fadvise(DONTNEED)`` on its files:
only this checkpoint's, no other process is touched), so reads come from the device. Reported:
plan / load seconds, RSS after load and peak (``VmHWM``), prefill seconds, decode tokens/s, the
cache's hit rate, bytes the cache requested per decode token, and bytes the process read from the
device per decode token (``/proc/self/io`` ``read_bytes``). The physical bound to compare with is
``device bytes per token / disk bandwidth``; the bandwidth is measured here too, reading the
checkpoint's expert tensors cold with positional reads of one expert tensor each (1 and N threads).
``--cache-gb 0`` loads every weight into memory instead (no page-cache drop needed: the weights are
read at load) and reports decode against the memory-bandwidth bound: weight bytes one token reads
(``token_bytes``) / the bandwidth of ``torch.dot`` over 2 GB in the same process (median of 9).
With the experts served, the memory-bandwidth bound is reported too: the bytes a decode step must
read (:func:`step_bytes`: weights in memory, the chosen experts, KDA's recurrent state) over
:func:`memory_bandwidth`; ``bound_tokens_per_s`` stays the device bound, and ``combined_bound_tokens_per_s``
adds the two: a step reads its bytes in memory at the memory rate and then the experts it missed from the
device at the disk rate (1 / (memory bytes / memory GB/s + device bytes / disk GB/s)).
Names follow the checkpoint: DeepSeek-V3 / Kimi (``embed_tokens``, ``lm_head``) or DeepSeek-V4's release
names (``embed``, ``head``).
``--compare`` runs two settings alternately (A B A B ...), each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

GB = 1e9


def drop_cache(root: Path) -> None:
    """Drop this checkpoint's pages from the page cache (only its files)."""
    for f in root.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def expert_ranges(root: Path) -> list[tuple[Path, int, int]]:
    """(file, offset, nbytes) of every routed-expert weight of the checkpoint (safetensors or GGUF)."""
    from quantplug.checkpoint import Checkpoint, storage_shape

    out = []
    for i in Checkpoint.open(root):
        if ".experts." in i.name and i.nbytes > 1 << 20:
            out.append((Path(i.file), i.offset, i.nbytes))
        elif "_exps" in i.name:  # GGUF: one stacked tensor per projection, one slab per expert
            n = storage_shape(i)[0] if i.format == "gguf" else i.shape[0]
            slab = i.nbytes // n
            out += [(Path(i.file), i.offset + k * slab, slab) for k in range(n)]
    return out


def bandwidth(root: Path, gbytes: float, threads: int, seed: int = 0) -> float:
    """GB/s reading ``gbytes`` of randomly chosen expert tensors cold, ``threads`` at a time."""
    ranges = expert_ranges(root)
    rnd = random.Random(seed)
    rnd.shuffle(ranges)
    chosen, total = [], 0
    for r in ranges:
        if total >= gbytes * GB:
            break
        chosen.append(r)
        total += r[2]
    drop_cache(root)
    fds = {f: os.open(f, os.O_RDONLY) for f in {c[0] for c in chosen}}
    lock = threading.Lock()
    todo = list(chosen)

    def work() -> None:
        buf = bytearray(max(c[2] for c in chosen))
        view = memoryview(buf)
        while True:
            with lock:
                if not todo:
                    return
                f, off, n = todo.pop()
            got = 0
            while got < n:
                got += os.preadv(fds[f], [view[got:n]], off + got)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return total / GB / dt


def _io_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _rss_gib() -> float:
    return _status_kb("VmRSS") / (1 << 20)


def _is_embedding(name: str) -> bool:
    return "embed_tokens" in name or name.startswith("embed.")  # DeepSeek-V4: ``embed.weight``


def _is_head(name: str) -> bool:
    return "lm_head" in name or name.startswith("head.")  # DeepSeek-V4: ``head.weight``


def token_bytes(lm: Any) -> tuple[int, dict[str, int]]:
    """Weight bytes one decoded token reads from memory: every parameter and buffer once (shared
    storage once), the routed experts' stacks at ``top_k / n_routed_experts`` of their bytes (one
    token runs top_k experts per MoE layer), the embedding table not at all (one row). A hash
    router's ``tid2eid`` table is read one row per token: left out like the embedding."""
    cfg = lm.config
    frac = cfg.num_experts_per_tok / cfg.n_routed_experts
    seen: set[int] = set()
    parts = {"lm_head": 0, "routed experts": 0, "other": 0}
    for name, t in [*lm.named_parameters(), *lm.named_buffers()]:
        key = int(t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size())
        if key in seen or _is_embedding(name) or name.endswith("tid2eid"):
            continue
        seen.add(key)
        n = t.numel() * t.element_size()
        if ".experts." in name and "shared_experts" not in name:
            parts["routed experts"] += int(n * frac)
        elif _is_head(name):
            parts["lm_head"] += n
        else:
            parts["other"] += n
    return sum(parts.values()), parts


def step_bytes(lm: Any) -> dict[str, int]:
    """Bytes one decode step must read from memory with the routed experts served from the files:
    the weights held in memory (:func:`token_bytes`: all but the embedding; served experts are not
    parameters), the chosen experts (``num_experts_per_tok`` x an expert's bytes as stored, per
    MoE layer) and the recurrent state of KDA layers (Kimi: heads x head_dim^2 float32 each, read
    once; the convolution's state is negligible). The latent cache of a few tokens is left out."""
    nonexpert, _ = token_bytes(lm)
    cfg = lm.config
    stores = [m.qp_store for m in lm.modules() if getattr(m, "qp_store", None) is not None]
    experts = sum(cfg.num_experts_per_tok * st.slot_bytes for st in stores)
    kda_layers = len(getattr(cfg, "kda_layers", ()))
    state = kda_layers * getattr(cfg, "kda_heads", 0) * getattr(cfg, "kda_head_dim", 0) ** 2 * 4
    return {"nonexpert": nonexpert, "experts": experts, "kda_state": state}


def memory_bandwidth(gbytes: float = 2.0, reps: int = 9) -> float:
    """GB/s of this process streaming a float32 tensor of ``gbytes`` through ``torch.dot(x, x)``
    (BLAS, torch's threads; each element read once): the median of ``reps`` (single probes on
    this shared virtual machine range from 27 to 53 GB/s; the median is the representative
    figure). ``torch.dot`` is the fastest streaming read found in torch here (2 threads: ~33 GB/s
    typical, ``sum`` 14.5, ``max`` 11.8), so the bound it gives is the tightest."""
    import torch

    x = torch.ones(int(gbytes * GB) // 4)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.dot(x, x)
        times.append(time.perf_counter() - t0)
    del x
    times.sort()
    return gbytes / times[len(times) // 2]


def child_in_memory(args: argparse.Namespace) -> dict:
    """Every weight in memory (no ``expert_cache_mb``), warm: decode against the memory bound."""
    import quantplug
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = quantplug.load(args.root, dtype=torch.bfloat16, progress=False)
    load_s = time.perf_counter() - t0
    rss_load = _rss_gib()
    lm = model.text_lm()
    per_token, parts = token_bytes(lm)
    ids = torch.randint(0, lm.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed))
    from quantplug.generate import new_cache

    kv = new_cache(lm, 1, args.prompt + args.tokens)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = lm.next_logits(ids, kv)
        prefill_s = time.perf_counter() - t0
        toks, steps, finite = [], [], bool(torch.isfinite(logits).all())
        for _ in range(args.tokens):
            t = int(logits.argmax())
            toks.append(t)
            t0 = time.perf_counter()
            logits = lm.next_logits(torch.tensor([[t]]), kv)
            steps.append(time.perf_counter() - t0)
            finite = finite and bool(torch.isfinite(logits).all())
    peak = _status_kb("VmHWM") / (1 << 20)  # before the bandwidth probe's 2 GB
    bw = memory_bandwidth()
    steps.sort()
    median = steps[len(steps) // 2]
    bound = bw / (per_token / GB)
    return {
        "mode": "in-memory", "threads": args.threads, "prompt": args.prompt, "tokens": args.tokens,
        "load_s": round(load_s, 2), "rss_after_load_gib": round(rss_load, 2),
        "peak_rss_gib": round(peak, 2), "prefill_s": round(prefill_s, 2),
        "decode_ms_median": round(median * 1e3, 1), "tokens_per_s": round(1 / median, 3),
        "gb_per_token": round(per_token / GB, 3), **{f"gb_per_token_{k.replace(' ', '_')}": round(v / GB, 3)
                                                     for k, v in parts.items()},
        "memory_GBps": round(bw, 2), "bound_tokens_per_s": round(bound, 3),
        "fraction_of_bound": round(1 / median / bound, 3), "logits_finite": finite,
        "logits_std_last": round(float(logits.float().std()), 3), "tokens_out": toks,
    }


def child(args: argparse.Namespace) -> dict:
    import quantplug
    import torch

    if args.cache_gb <= 0:
        return child_in_memory(args)
    torch.set_num_threads(args.threads)
    opts = {"expert_cache_mb": args.cache_gb * 1024, "expert_readers": args.readers,
            "expert_prefetch": not args.no_prefetch}
    t0 = time.perf_counter()
    quantplug.plan(args.root, options=opts, dtype=torch.bfloat16)
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = quantplug.load(args.root, options=opts, dtype=torch.bfloat16, progress=False)
    load_s = time.perf_counter() - t0
    rss_load = _rss_gib()
    from quantplug.api import stats_sources

    cache = stats_sources(model)["expert_cache"]
    lm = model.text_lm()
    vocab = lm.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed))
    from quantplug.generate import new_cache

    kv = new_cache(lm, 1, args.prompt + args.tokens)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = lm.next_logits(ids, kv)
        prefill_s = time.perf_counter() - t0
        before = dict(cache.stats())
        dev0 = _io_read_bytes()
        toks, finite = [], bool(torch.isfinite(logits).all())
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            t = int(logits.argmax())
            toks.append(t)
            logits = lm.next_logits(torch.tensor([[t]]), kv)
            finite = finite and bool(torch.isfinite(logits).all())
        decode_s = time.perf_counter() - t0
        dev = _io_read_bytes() - dev0
    after = cache.stats()
    peak = _status_kb("VmHWM") / (1 << 20)  # before the bandwidth probe's 2 GB
    step = step_bytes(lm)
    bw = memory_bandwidth()
    n = args.tokens
    req = after["requests"] - before["requests"]
    hits = after["hits"] - before["hits"]
    return {
        "cache_gb": args.cache_gb, "readers": args.readers, "prefetch": not args.no_prefetch,
        "threads": args.threads, "prompt": args.prompt, "tokens": n,
        "plan_s": round(plan_s, 2), "load_s": round(load_s, 2), "rss_after_load_gib": round(rss_load, 2),
        "prefill_s": round(prefill_s, 2), "decode_s": round(decode_s, 2), "tokens_per_s": round(n / decode_s, 3),
        "peak_rss_gib": round(peak, 2),
        **{f"gb_per_token_{k}": round(v / GB, 3) for k, v in step.items()},
        "memory_GBps": round(bw, 2), "memory_bound_tokens_per_s": round(bw / (sum(step.values()) / GB), 3),
        "decode_hit_rate": round(hits / req, 3) if req else 0.0,
        "decode_prefetched": after["prefetched"] - before["prefetched"],
        "decode_prefetch_hits": after["prefetch_hits"] - before["prefetch_hits"],
        "requested_gb_per_token": round((after["bytes_read"] - before["bytes_read"]) / n / GB, 3),
        "device_gb_per_token": round(dev / n / GB, 3),
        "cache_peak_gib": round(after["peak_bytes"] / (1 << 30), 2),
        "experts_on_demand_gb": round(model.load_report["experts_on_demand_bytes"] / GB, 2),
        "loaded_gb": round(model.load_report["bytes_read"] / GB, 2),
        "logits_finite": finite, "logits_std_last": round(float(logits.float().std()), 3),
        "tokens_out": toks,
    }


def run_child(args: argparse.Namespace, extra: list[str]) -> dict:
    drop_cache(Path(args.root))
    cmd = [sys.executable, __file__, str(args.root), "--child", "--cache-gb", str(args.cache_gb), "--tokens",
           str(args.tokens), "--prompt", str(args.prompt), "--threads", str(args.threads), "--seed", str(args.seed),
           *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"child failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--cache-gb", type=float, default=4.0,
                    help="expert cache budget, GB; 0: every weight in memory, warm, against the memory-bandwidth bound")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="torch / kernel threads")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", choices=("readers", "prefetch"), default=None)
    ap.add_argument("--reps", type=int, default=1, help="--compare: runs of each setting, alternating")
    ap.add_argument("--bandwidth-gb", type=float, default=4.0, help="GB of expert tensors read to measure the disk")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    res: dict = {"root": str(args.root)}
    if args.bandwidth_gb > 0 and args.cache_gb > 0:
        res["disk_GBps_1_thread"] = round(bandwidth(args.root, args.bandwidth_gb, 1), 3)
        res["disk_GBps_4_threads"] = round(bandwidth(args.root, args.bandwidth_gb, 4, seed=1), 3)
    settings = {"readers": [["--readers", "1"], ["--readers", "4"]],
                "prefetch": [["--no-prefetch"], []]}.get(args.compare or "", [[
                    "--readers", str(args.readers), *(["--no-prefetch"] if args.no_prefetch else [])]])
    runs: list[dict] = []
    for _ in range(args.reps):
        for extra in settings:
            r = run_child(args, extra)
            print(json.dumps({k: v for k, v in r.items() if k != "tokens_out"}), file=sys.stderr, flush=True)
            runs.append(r)
    res["runs"] = runs
    bw = max(res.get("disk_GBps_1_thread", 0), res.get("disk_GBps_4_threads", 0))  # the better of the two
    if bw and args.cache_gb > 0:
        for r in runs:  # the physical bound: the bytes each token had to read at the disk's bandwidth
            r["bound_tokens_per_s"] = round(bw / r["device_gb_per_token"], 3) if r["device_gb_per_token"] else None
            mem_gb = sum(v for k, v in r.items() if k.startswith("gb_per_token_"))
            step_s = mem_gb / r["memory_GBps"] + r["device_gb_per_token"] / bw
            r["combined_bound_tokens_per_s"] = round(1 / step_s, 3)
            r["fraction_of_combined_bound"] = round(r["tokens_per_s"] * step_s, 3)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
