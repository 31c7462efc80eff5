"""What ``expert-pack build -o`` pays for never hard-linking SRC's files into DST.

``python bench/bench_mirror.py [--mib 512] [--dir DIR] [--reps 3]``: one file of random bytes in
DIR (default: a temporary directory; pick one on the file system you care about), then per rep
``os.link`` (the old behaviour), ``clone_file`` (reflink where the file system has it, else
``copy_file_range``: the new behaviour; the method used is printed) and a plain read/write copy
(``shutil.copyfile``), each into a fresh name; wall seconds, best of the reps. The page cache is
warm after the first write, so the copies measure memory bandwidth and the kernel's copy path,
not the disk: a cold-cache copy of a large file costs its read time on top.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from quantplug_expert_pack.build import clone_file


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        src = root / "src.bin"
        with open(src, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        times: dict[str, list[float]] = {"link": [], "clone_file": [], "copyfile": []}
        method = "?"
        for rep in range(args.reps):
            for what in times:
                dst = root / f"{what}-{rep}"
                t0 = time.perf_counter()
                if what == "link":
                    os.link(src, dst)
                elif what == "clone_file":
                    method = clone_file(src, dst)
                else:
                    shutil.copyfile(src, dst)
                times[what].append(time.perf_counter() - t0)
                dst.unlink()
        fs = os.statvfs(root)
        print(f"{args.mib} MiB file in {root} (block size {fs.f_bsize}); clone_file used: {method}")
        for what, ts in times.items():
            print(f"  {what:10s} best {min(ts) * 1000:9.2f} ms   ({', '.join(f'{t * 1000:.1f}' for t in ts)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
