"""Write a DeepSeek-V4-Flash slice with real dimensions and random weights in the release format, streamed.

    python bench/make_v4_slice.py --out DIR [--ratios 4,128] [--hash-layers 1] [--seed S] [--dry-run]

V4-Flash's real dimensions (its release config.json: hidden 4096, 64 heads of 512, q_lora 1024, o_groups 8 /
o_lora 1024, sliding window 128, 256 routed experts of 2048 with 6 active + 1 shared, indexer 64 x 128 top
512, mHC 4 streams, vocabulary 129280), two decoder layers by default: layer 0 CSA (ratio 4, with the
lightning indexer) routed by ``tid2eid`` (``num_hash_layers`` 1), layer 1 HCA (ratio 128) with the learned
router: Flash's layers 2 and 3 (its first CSA layer, still hash-routed, and its first HCA layer). No MTP
block. 9.28 GB: the 2 x 256 FP4 experts 6.85 GB, ``embed`` + ``head`` (BF16) 2.12 GB.

The release format exactly (its tensor names without ``model.`` and dtypes, docs/architectures/deepseek-v4.md): FP8 dense linears ``X.weight``
F8_E4M3 + ``X.scale`` F8_E8M0 per 128 x 128 block; routed experts FP4, ``X.weight`` I8 [N, K/2] + ``X.scale``
F8_E8M0 [N, K/32]; ``tid2eid`` I64; ``attn_sink``, ``ape``, ``hc_*`` and ``gate.bias`` F32; the rest BF16.
config.json is the Flash release's cut to these layers (``quantization_config`` fp8 / e4m3 / ue8m0 [128, 128],
top-level ``expert_dtype: "fp4"``). Shards: hub-style names (``model-00001-of-000003.safetensors``) of
~3.1 GB each and ``model.safetensors.index.json``. What the values are: ``V4WeightSource`` in
``quantplug/testing/slice.py`` (every linear std ~1 / sqrt(in), per-tensor random streams keyed by seed and
name).

Free disk is checked first (need + ``--reserve-gb``, default 10% of the filesystem, at least 2 GiB); an
existing non-empty directory is refused. No model is built in memory: tensors are generated in chunks of at
most 8 Mi elements on a second thread and written as they come (written pages flushed and dropped from the
page cache every GiB). Load it with ``expert_cache_mb`` set (``bench/bench_slice.py DIR --cache-gb 2``) or
whole (``--cache-gb 0``).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from pathlib import Path

from quantplug.testing.scale import DiskSpaceError, check_free_disk, safetensors_header
from quantplug.testing.slice import v4_flash_slice_config, v4_plan, write_v4_checkpoint

GB = 1e9
GIB = 1 << 30


def default_reserve(out: str) -> int:
    """10% of the filesystem holding ``out``, at least 2 GiB (a shared disk keeps free space)."""
    p = Path(out).resolve()
    while not p.exists():
        p = p.parent
    return max(2 * GIB, shutil.disk_usage(p).total // 10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="new directory to write (must not exist or be empty)")
    ap.add_argument("--ratios", default="4,128", help="compress_ratios of the layers (default 4,128: CSA, HCA)")
    ap.add_argument("--hash-layers", type=int, default=1, help="num_hash_layers (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=4.3, help="target GB per shard")
    ap.add_argument("--reserve-gb", type=float, default=None,
                    help="free space to leave on the disk, GiB (default: 10%% of the filesystem, at least 2)")
    ap.add_argument("--dry-run", action="store_true", help="print the size and the disk check, write nothing")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    cfg = v4_flash_slice_config([int(r) for r in args.ratios.split(",")], args.hash_layers)
    shard_bytes = int(args.shard_gb * GB)
    layout = v4_plan(cfg, shard_bytes)
    need = sum(len(safetensors_header(g)) + sum(t.nbytes for t in g) for g in layout.values())
    reserve = int(args.reserve_gb * GIB) if args.reserve_gb is not None else default_reserve(args.out)
    summary: dict = {"bytes": need, "tensors": sum(len(g) for g in layout.values()),
                     "shards": {k: sum(t.nbytes for t in g) for k, g in layout.items()},
                     "experts_bytes": sum(t.nbytes for g in layout.values() for t in g if ".experts." in t.name)}
    try:
        summary["free"] = check_free_disk(args.out, need, reserve)
        summary["fits"] = True
    except DiskSpaceError as exc:
        if not args.dry_run:
            print(f"refused: {exc}", file=sys.stderr)
            return 1
        summary["fits"] = False
    if args.dry_run:
        print(json.dumps(summary, indent=1))
        return 0 if summary["fits"] else 1
    last = [0.0]
    t0 = time.perf_counter()

    def progress(name: str, written: int) -> None:
        now = time.perf_counter()
        if not args.quiet and now - last[0] > 10:
            last[0] = now
            print(f"{written / GB:6.2f} GB {now - t0:6.0f} s {name}", file=sys.stderr, flush=True)

    res = write_v4_checkpoint(args.out, cfg, seed=args.seed, shard_bytes=shard_bytes, reserve=reserve,
                              progress=progress)
    summary.update(seconds=round(res.seconds, 1), GBps=round(res.gbps, 3),
                   peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
