"""Write a Kimi-K3 slice with real dimensions and random weights in the release format, streamed.

    python bench/make_k3_slice.py --out DIR [--dense-width N] [--seed S] [--dry-run]

Two decoder layers of the released K3 (ARCHITECTURES.md C1/C2; :func:`quantplug.testing.scale.
kimi_k3_slice_config`): layer 0 KDA (96 heads x 128, full-rank output gate) with the dense SiTU
MLP 33792 wide, layer 1 MLA (q-LoRA, output gate) with the latent MoE (7168 -> 3584, 896 routed
experts of 3072, top 16, 2 shared), the real vocabulary (163840) and hidden size (7168), attention
residuals. ~23.5 GB: the 896 experts 15.7 GB of it, embedding + lm_head 4.7 GB, the dense MLP 1.45 GB.

The release format: routed experts compressed-tensors MXFP4 (``weight_packed`` U8 [out, in/2]
random E2M1 codes, ``weight_scale`` U8 [out, in/32] E8M0 exponents 119..121, so weights have
std ~ 2.9 * 2**-7 ~ 1/sqrt(in)), KDA conv weights / ``dt_bias`` / ``A_log`` F32, everything else
BF16 (linears std 1/sqrt(in), norms 1, embedding std 1, router bias 0; slices at random offsets of
one pool of 32 Mi normal values per std), one decoder layer per
shard (the embedding with the first, ``lm_head`` with the last), an index, config.json.

Free disk is checked first (need + ``--reserve-gb``, default 2); tensors are generated in chunks
of at most 16 Mi elements and written as they come (:class:`ShardWriter`: written pages flushed
and dropped from the page cache every GiB). Load it with ``expert_cache_mb`` set (the experts
are served from the files): ``bench/bench_slice.py DIR --cache-gb 2``.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from quantplug.testing.scale import (
    DiskSpaceError,
    ShardWriter,
    StoredTensor,
    check_free_disk,
    kimi_k3_slice_config,
    kimi_k3_tensors,
    shard_layout,
    write_index,
)

CHUNK = 1 << 24  # elements per generated piece


def values(t: StoredTensor, rng: np.random.Generator, gen: torch.Generator) -> Iterator[np.ndarray]:
    """The bytes of tensor ``t``, in pieces."""
    n = t.numel
    name = t.name
    if t.dtype == "U8":
        for i in range(0, n, CHUNK):
            k = min(CHUNK, n - i)
            if name.endswith("weight_scale"):
                yield rng.integers(119, 122, size=k, dtype=np.uint8)
            else:
                yield np.frombuffer(rng.bytes(k), dtype=np.uint8)
        return
    if t.dtype == "F32":
        if name.endswith("A_log"):
            yield np.log(rng.uniform(0.5, 2.0, size=n)).astype(np.float32)
        elif name.endswith("dt_bias"):
            yield (-3.0 + 0.5 * rng.standard_normal(n)).astype(np.float32)
        else:  # depthwise conv weights [d, 1, 4]
            yield (rng.standard_normal(n) / math.sqrt(t.shape[-1])).astype(np.float32)
        return
    if name.endswith("norm.weight") or "layernorm" in name:
        yield torch.ones(n, dtype=torch.bfloat16).view(torch.int16).numpy()
        return
    if name.endswith("e_score_correction_bias"):
        yield np.zeros(n, dtype=np.int16)
        return
    std = 1.0 if name.endswith("embed_tokens.weight") else 1.5 / math.sqrt(t.shape[-1]) \
        if name.endswith("_res_proj.weight") else 1.0 / math.sqrt(t.shape[-1])
    pool = _pool(std, gen)
    for i in range(0, n, CHUNK):
        k = min(CHUNK, n - i)
        at = int(rng.integers(0, POOL - k + 1))
        yield pool[at:at + k]


#: bf16 normal values per std, drawn once: each chunk of a tensor is a slice at a random offset
#: (4 G bf16 values drawn one by one took minutes on this 2-core machine; a slice takes nothing)
POOL = 2 * CHUNK
_POOLS: dict[float, np.ndarray] = {}


def _pool(std: float, gen: torch.Generator) -> np.ndarray:
    if std not in _POOLS:
        _POOLS[std] = torch.randn(POOL, generator=gen).mul_(std).to(torch.bfloat16).view(torch.int16).numpy()
    return _POOLS[std]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dense-width", type=int, default=None, help="layer 0's dense MLP width (default 33792)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reserve-gb", type=float, default=2.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    cfg = kimi_k3_slice_config(args.dense_width)
    tensors = kimi_k3_tensors(cfg)
    layout = shard_layout(tensors, 2, by="layer")
    need = sum(t.nbytes for t in tensors)
    try:
        free = check_free_disk(args.out, need, int(args.reserve_gb * (1 << 30)))
        fits = True
    except DiskSpaceError as exc:
        free, fits = shutil.disk_usage(Path(args.out).resolve().anchor).free, False
        if not args.dry_run:
            print(f"refused: {exc}", file=sys.stderr)
            return 1
    summary = {"bytes": need, "tensors": len(tensors), "shards": {k: sum(t.nbytes for t in v) for k, v in layout.items()},
               "free": free, "fits": fits}
    if args.dry_run:
        print(json.dumps(summary, indent=1))
        return 0 if fits else 1
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for fname, group in layout.items():
        with ShardWriter(root / fname, group) as w:
            for t in group:
                for piece in values(t, rng, gen):
                    w.write(t.name, piece)
        print(f"{fname}: {sum(t.nbytes for t in group) / 1e9:.2f} GB at {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    write_index(root, layout)
    dt = time.perf_counter() - t0
    summary.update(seconds=round(dt, 1), GBps=round(need / dt / 1e9, 3),
                   peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
