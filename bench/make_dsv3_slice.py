"""Write a DeepSeek-V3-dimension slice with random weights, streamed to disk.

    python bench/make_dsv3_slice.py --out DIR [--layers N] [--format fp8|gguf-q4_0] [--seed S] [--dry-run]

Real DeepSeek-V3 dimensions (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128,
v 128, dense intermediate 18432, 256 routed experts of 2048 with 8 active + 1 shared, n_group 8 /
topk_group 4, vocab 129280, yarn rope as released), ``--layers`` decoder layers: the first dense,
the rest MoE (default 2: one dense + one MoE, ~15.8 GB in FP8; each further MoE layer adds
~11.5 GB: 4 layers ~38.8 GB). Formats:

* ``fp8`` (default): the DeepSeek-V3 release's FP8 block layout (``weight`` F8_E4M3 +
  ``weight_scale_inv`` F32 per [128, 128] block; embeddings, lm_head, norms, router BF16; router
  bias F32), hub shard names (``model-00001-of-000004.safetensors``) and index, config.json =
  the released one cut to N layers.
* ``gguf-q4_0``: the same weights (same ``--seed``) as a llama.cpp deepseek2 GGUF, every matrix
  Q4_0 (gguf-py's quantizer on the exactly dequantized FP8 weights), MLA K/V split, experts
  stacked; config.json without quantization_config.

What the values are: ``quantplug/testing/slice.py`` (module docstring). Free disk space is
checked first (need + ``--reserve-gb``, default 10% of the filesystem); the command refuses, naming the numbers, when it does
not fit. No model is built in memory: tensors are generated in chunks of rows and written as
they come; written pages are flushed and dropped from the page cache every GiB so a 40 GB write
does not evict other processes' pages. The JSON summary on stdout gives bytes, seconds, GB/s
and peak RSS. Load it with ``quantplug.load(DIR, dtype=torch.bfloat16)``; there is no
tokenizer: feed token ids.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from pathlib import Path

from quantplug.testing.scale import DiskSpaceError, check_free_disk, slice_config
from quantplug.testing.slice import WeightSource, fp8_plan, gguf_plan, write_fp8_checkpoint, write_gguf_q4_0

GB = 1e9
GIB = 1 << 30


def default_reserve(out: str) -> int:
    """10% of the filesystem holding ``out`` (at least 2 GiB): on a disk shared with other people
    a slice must not take the last free space (a 62 GB write once left 6.5 GiB on a 252 GB disk)."""
    p = Path(out).resolve()
    while not p.exists():
        p = p.parent
    return max(2 * GIB, shutil.disk_usage(p).total // 10)


def rss_mb() -> float:
    """Current resident set size (MiB), from /proc."""
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * resource.getpagesize() / (1 << 20)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="new directory to write (must not exist or be empty)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers: first dense, then MoE (default 2)")
    ap.add_argument("--format", choices=("fp8", "gguf-q4_0"), default="fp8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of the weights (default 0.02)")
    ap.add_argument("--shard-gb", type=float, default=4.3, help="fp8: target GB per safetensors shard")
    ap.add_argument("--reserve-gb", type=float, default=None,
                    help="free space to leave on the disk, GiB (default: 10%% of the filesystem, at least 2)")
    ap.add_argument("--dry-run", action="store_true", help="print the size and the disk check, write nothing")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)

    cfg = slice_config(args.layers)
    source = WeightSource(seed=args.seed, std=args.std)
    if args.format == "fp8":
        layout = fp8_plan(cfg, int(args.shard_gb * GB))
        need = sum(t.nbytes for g in layout.values() for t in g)
        files = len(layout)
    else:
        need = sum(t.nbytes for t in gguf_plan(cfg, source))
        files = 1
    reserve = int(args.reserve_gb * GIB) if args.reserve_gb is not None else default_reserve(args.out)
    moe = args.layers - 1
    print(f"{args.format}: {args.layers} layers (1 dense + {moe} MoE), {need / GB:.2f} GB ({need / GIB:.2f} GiB) "
          f"in {files} file(s) -> {args.out}", file=sys.stderr)
    try:
        free = check_free_disk(args.out, need, reserve)
        refusal = ""
    except DiskSpaceError as exc:
        free, refusal = -1, str(exc)
        print(f"refused: {exc}", file=sys.stderr)
    if args.dry_run:
        print(json.dumps({"format": args.format, "layers": args.layers, "bytes": need, "files": files,
                          "reserve_bytes": reserve, "fits": not refusal, "dry_run": True}))
    if refusal:
        return 1
    print(f"disk: {free / GIB:.1f} GiB free, {need / GIB:.2f} GiB needed + {reserve / GIB:.1f} GiB reserve: ok",
          file=sys.stderr)
    if args.dry_run:
        return 0

    base_rss = rss_mb()
    t0 = time.perf_counter()
    state = {"next": 1.0, "peak_rss": base_rss}

    def progress(name: str, written: int) -> None:
        state["peak_rss"] = max(state["peak_rss"], rss_mb())
        if not args.quiet and written / GB >= state["next"]:
            dt = time.perf_counter() - t0
            print(f"  {written / GB:6.1f} GB  {written / GB / dt:5.2f} GB/s  rss {rss_mb():6.0f} MiB  {name}",
                  file=sys.stderr, flush=True)
            state["next"] = written / GB + 1.0

    writer = write_fp8_checkpoint if args.format == "fp8" else write_gguf_q4_0
    res = writer(args.out, cfg, source, reserve=reserve, progress=progress)
    summary = {
        "format": args.format, "layers": args.layers, "seed": args.seed, "path": str(res.path),
        "files": len(res.files), "bytes": res.bytes_written, "bytes_on_disk": sum(f.stat().st_size for f in res.files),
        "seconds": round(res.seconds, 1), "GB_per_s": round(res.gbps, 3),
        "rss_before_mb": round(base_rss), "rss_peak_sampled_mb": round(state["peak_rss"]),
        "ru_maxrss_mb": round(peak_rss_mb()),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
