"""Expert packs of safetensors checkpoints (pack version 2): what building one costs, and what
serving routed experts from it changes against serving them from the checkpoint's own files.

    python bench/bench_pack.py build --size tiny --reps 5                 # build vs copying the same bytes
    python bench/bench_pack.py build --size moderate --reps 3
    python bench/bench_pack.py serve --size tiny --reps 3                 # original vs pack, warm page cache
    python bench/bench_pack.py serve --size moderate --reps 3 --cold      # cold before every decode step

The checkpoints are DeepSeek-V3-layout FP8 in the release's block format (``weight`` F8_E4M3 +
``weight_scale_inv`` F32 per [128, 128] block, one safetensors file), written by
``quantplug.testing.formats.fp8`` with random weights: *tiny* (``tiny_config()``: hidden 64, 8
experts of 32, 3 layers, 2 of them MoE; what the tests use) and *moderate* (hidden 1024, 32
routed experts of 512, top 4, 4 layers: one dense and three MoE; 151 MB of experts).

Every contender runs in a fresh process, contenders alternate (A B A B ...), and each is reported
as median and best over ``--reps`` with the ratio of its median to the baseline's median of the
same run. Timings on a shared machine are noisy: read the ratios, not the absolute figures.

``build``: baseline *copy* copies the source checkpoint file by file and fsyncs each file (the
least any tool producing a converted copy must do); contender *pack* is ``build_pack(SRC, DST)``
(``quantplug expert-pack build SRC -o DST``: copies, hashes every expert payload, writes pack,
shards and index, fsyncs). Both read a source that is in the page cache.

``serve``: baseline *original* loads the checkpoint with ``expert_cache_mb`` (experts served
from its own safetensors file), contender *pack* the packed copy; *pack-readahead* is the pack
again with the core's ``POSIX_FADV_RANDOM`` advice on the pack suppressed in that process (so the
kernel's readahead applies, as on the original's shard). Before each run the checkpoint's pages
are dropped from the page cache (``posix_fadvise(DONTNEED)`` on that checkpoint's files only).
The cache holds ``--cache-steps`` steps of one layer's routed experts (default 1.5: nearly every
expert a step uses is read). After a prompt of ``--prompt`` tokens, ``--tokens`` greedy tokens are
decoded through the latent cache. Reported per run: load seconds, decode tokens/s, process CPU time per decode token (all threads: less sensitive to other
processes than wall time), the cache's hit rate, bytes the cache requested per token (``bytes_read``) and bytes the process read from the
device per token (``/proc/self/io`` ``read_bytes``: what the kernel read, readahead included).
A checkpoint this small fits the page cache, so after the prompt most decode reads hit it;
``--cold`` drops the checkpoint's pages before every decode step too (outside the timed region),
which is what a model larger than RAM sees. The tokens of every run are checked to be equal.
Dropping pages does not drop those the process has mapped: the loader keeps the shards mapped
(non-expert weights), so on *tiny*, whose whole shard is mapped, the original's experts stay in
the page cache even with ``--cold`` (device reads 0) while the pack's are read again; use
*moderate* for device bytes, *tiny* as a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_slice import _io_read_bytes, drop_cache  # noqa: E402

MB = 1e6


def moderate_config() -> dict:
    from quantplug.testing import tiny_config

    return tiny_config(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, n_routed_experts=32,
                       num_experts_per_tok=4, n_group=4, topk_group=2, num_hidden_layers=4, first_k_dense_replace=1,
                       num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=128,
                       qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, vocab_size=8000)


def _dir_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.iterdir() if f.is_file())


def make(out: Path, size: str) -> Path:
    """The ``size`` FP8 checkpoint under ``out`` (written once)."""
    from quantplug.testing import formats, random_state, tiny_config

    src = out / size
    if not (src / "config.json").is_file():
        cfg = tiny_config() if size == "tiny" else moderate_config()
        formats.fp8(src, cfg, random_state(cfg, seed=0))
    return src


def _spawn(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"child {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summarise(runs: dict[str, list[dict]], baseline: str, keys: list[str]) -> dict:
    """Median and best of each key per contender, and each median's ratio to the baseline's."""
    out: dict = {}
    for name, rs in runs.items():
        row: dict = {}
        for k in keys:
            vals = [r[k] for r in rs]
            med = statistics.median(vals)
            row[k] = {"median": round(med, 4), "min": round(min(vals), 4), "max": round(max(vals), 4)}
            base = statistics.median(r[k] for r in runs[baseline])
            if name != baseline and base:
                row[k]["ratio_to_" + baseline] = round(med / base, 3)
        out[name] = row
    return out


# -- build ----------------------------------------------------------------------------------------

def child_build(args: argparse.Namespace) -> dict:
    from quantplug_expert_pack.build import build_pack  # imported before the clock starts (torch: ~2 s)

    src, dst = args.root, args.dst
    if dst.exists():
        shutil.rmtree(dst)
    t0 = time.perf_counter()
    if args.mode == "copy":
        dst.mkdir()
        for f in src.iterdir():
            if f.is_file():
                shutil.copyfile(f, dst / f.name)
                fd = os.open(dst / f.name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        extra: dict = {}
    else:
        r = build_pack(src, dst, progress=False)
        extra = {"experts_MB": r.moved_bytes / MB, "payloads": r.entries, "pack_MB": r.pack.stat().st_size / MB}
    seconds = time.perf_counter() - t0
    written = _dir_bytes(dst)
    shutil.rmtree(dst)
    return {"seconds": seconds, "output_MB": written / MB, "output_MB_per_s": written / MB / seconds, **extra}


def build(args: argparse.Namespace) -> dict:
    src = make(args.out, args.size)
    for f in src.iterdir():  # the source in the page cache for both contenders
        f.read_bytes()
    runs: dict[str, list[dict]] = {"copy": [], "pack": []}
    for _ in range(args.reps):
        for mode in runs:
            r = _spawn(["child-build", "--mode", mode, "--root", str(src), "--dst", str(args.out / f"{args.size}-{mode}")])
            print(json.dumps({"contender": mode, **r}), file=sys.stderr, flush=True)
            runs[mode].append(r)
    p = runs["pack"][0]
    return {"size": args.size, "source_MB": round(_dir_bytes(src) / MB, 3), "experts_MB": round(p["experts_MB"], 3),
            "payloads": p["payloads"], "pack_MB": round(p["pack_MB"], 3), "reps": args.reps,
            "contenders": _summarise(runs, "copy", ["seconds", "output_MB", "output_MB_per_s"])}


# -- serve ----------------------------------------------------------------------------------------

def child_serve(args: argparse.Namespace) -> dict:
    if args.readahead:  # the pack without the core's POSIX_FADV_RANDOM advice: the kernel's readahead applies
        real = os.posix_fadvise

        def advise(fd: int, offset: int, length: int, advice: int) -> None:
            if advice != os.POSIX_FADV_RANDOM:
                real(fd, offset, length, advice)

        os.posix_fadvise = advise  # type: ignore[assignment]
    import quantplug
    import torch
    from quantplug import experts
    from quantplug.api import stats_sources
    from quantplug.generate import new_cache

    torch.set_num_threads(args.threads)
    cache_mb = args.cache_steps * experts.step_bytes(quantplug.plan(args.root)) / (1 << 20)
    dev0 = _io_read_bytes()
    t0 = time.perf_counter()
    model = quantplug.load(args.root, options={"expert_cache_mb": cache_mb}, progress=False)
    load_s = time.perf_counter() - t0
    load_dev = _io_read_bytes() - dev0
    cache = stats_sources(model)["expert_cache"]
    lm = model.text_lm()
    ids = torch.randint(0, lm.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    kv = new_cache(lm, 1, args.prompt + args.tokens)
    with torch.inference_mode():
        logits = lm.next_logits(ids, kv)
        before = dict(cache.stats())
        dev0 = _io_read_bytes()
        toks = []
        decode_s = cpu_s = 0.0
        for _ in range(args.tokens):
            if args.cold:  # every step reads its misses from the device, as with experts larger than RAM
                drop_cache(args.root)
            t0, c0 = time.perf_counter(), time.process_time()
            t = int(logits.argmax())
            toks.append(t)
            logits = lm.next_logits(torch.tensor([[t]]), kv)
            decode_s += time.perf_counter() - t0
            cpu_s += time.process_time() - c0
        dev = _io_read_bytes() - dev0
    after = cache.stats()
    n = args.tokens
    req = after["requests"] - before["requests"]
    return {"cache_MB": cache_mb, "load_s": load_s, "load_device_MB": load_dev / MB, "tokens_per_s": n / decode_s,
            "cpu_ms_per_token": cpu_s / n * 1e3,
            "decode_hit_rate": (after["hits"] - before["hits"]) / req if req else 1.0,
            "requested_MB_per_token": (after["bytes_read"] - before["bytes_read"]) / n / MB,
            "device_MB_per_token": dev / n / MB, "tokens": toks}


def serve(args: argparse.Namespace) -> dict:
    from quantplug_expert_pack.build import build_pack

    src = make(args.out, args.size)
    dst = args.out / f"{args.size}-packed"
    if not (dst / "experts.qpack").is_file():
        build_pack(src, dst, progress=False)
    contenders = {"original": (src, []), "pack": (dst, []), "pack-readahead": (dst, ["--readahead"])}
    runs: dict[str, list[dict]] = {k: [] for k in contenders}
    for _ in range(args.reps):
        for name, (root, extra) in contenders.items():
            drop_cache(root)
            r = _spawn(["child-serve", "--root", str(root), "--cache-steps", str(args.cache_steps),
                        "--tokens", str(args.tokens), "--prompt", str(args.prompt), "--threads", str(args.threads),
                        *(["--cold"] if args.cold else []), *extra])
            print(json.dumps({"contender": name, **{k: v for k, v in r.items() if k != "tokens"}}), file=sys.stderr,
                  flush=True)
            runs[name].append(r)
    toks = {json.dumps(r["tokens"]) for rs in runs.values() for r in rs}
    if len(toks) != 1:
        raise SystemExit("the contenders decoded different tokens")
    keys = ["load_s", "tokens_per_s", "cpu_ms_per_token", "decode_hit_rate", "requested_MB_per_token", "device_MB_per_token"]
    return {"size": args.size, "cache_MB": round(runs["original"][0]["cache_MB"], 3), "tokens": args.tokens,
            "prompt": args.prompt, "reps": args.reps, "cold_steps": args.cold,
            "read_ahead_kb": _read_ahead_kb(src), "contenders": _summarise(runs, "original", keys)}


def _read_ahead_kb(path: Path) -> int | None:
    """The block device's read-ahead of the file system holding ``path`` (None if not found)."""
    dev = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for p in (sysfs / "queue" / "read_ahead_kb", sysfs / ".." / "queue" / "read_ahead_kb"):
        if p.is_file():
            return int(p.read_text())
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("what", choices=("build", "serve", "child-build", "child-serve"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/qp-bench-pack"))
    ap.add_argument("--size", choices=("tiny", "moderate"), default="tiny")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache-steps", type=float, default=1.5, help="cache budget in steps of one layer's experts")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the checkpoint's pages before every decode step too")
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("copy", "pack"), help=argparse.SUPPRESS)
    ap.add_argument("--readahead", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.what.startswith("child-"):
        print(json.dumps(child_build(args) if args.what == "child-build" else child_serve(args)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(build(args) if args.what == "build" else serve(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
