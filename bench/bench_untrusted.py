"""Cost of the expert cache's per-thread slot pins (issue 13), each contender in a fresh process,
alternating.

``pinned``: today's :class:`ExpertCache.get` (the calling thread's slot pinned until its next
get, eviction skips other threads' pins). ``unpinned``: the previous ``get`` (no pins: correct
with one thread only). Both run the same single-threaded forwards on one expert-pack model with a
small cache (every forward misses and evicts), so the pin bookkeeping is on the hot path.

    python bench/bench_untrusted.py [--reps 5] [--forwards 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time, threading, torch, quantplug, quantplug.api
from quantplug_expert_pack import pack as P
mode, root, forwards = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "unpinned":
    def get(self, layer, expert):  # the pre-issue-13 get(), verbatim in behaviour
        key = (layer, expert)
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return item[1]
            if self._buffer is None:
                self._buffer = torch.empty(self.n_slots * self.slot_bytes, dtype=torch.uint8)
            if self._free:
                slot = self._free.pop()
            else:
                _, (slot, _) = self._items.popitem(last=False)
                self.evictions += 1
            region = self._buffer[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]
            tensors = self.pack.read_expert(layer, expert, region)
            self._items[key] = (slot, tensors)
            self.misses += 1
            return tensors
    P.ExpertCache.get = get
torch.set_num_threads(1)
model = quantplug.load(root, progress=False, options={"expert_cache_mb": 0.05})
ids = [torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(i)) for i in range(forwards)]
with torch.no_grad():
    model(ids[0])
    t = time.perf_counter()
    for x in ids:
        model(x)
    dt = time.perf_counter() - t
cache = quantplug.api.stats_sources(model)["expert_cache"].stats()
print(json.dumps({"seconds": dt, "gets": cache["hits"] + cache["misses"], "misses": cache["misses"]}))
"""


def build(root: Path) -> Path:
    from quantplug.models.config import parse_model_config
    from quantplug.testing import random_state, tiny_config
    from quantplug_expert_pack.build import build_pack
    from quantplug_expert_pack.export import gguf_state, write_gguf

    cfg = tiny_config()
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    write_gguf(root / "model.gguf", gguf_state(random_state(cfg), mc), mc, default_type="Q8_0",
               types={"attn_k_b": "Q4_0"})
    build_pack(root, progress=False)
    return root


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--forwards", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = build(Path(tmp) / "ckpt")
        res: dict[str, list[float]] = {"pinned": [], "unpinned": []}
        info = {}
        for _ in range(args.reps):
            for mode in ("pinned", "unpinned"):
                out = subprocess.run([sys.executable, "-c", CHILD, mode, str(root), str(args.forwards)],
                                     capture_output=True, text=True, check=True)
                d = json.loads(out.stdout.strip().splitlines()[-1])
                res[mode].append(d["seconds"])
                info = d
    for mode, ts in res.items():
        print(f"{mode:9s} best {min(ts):.3f} s  median {statistics.median(ts):.3f} s  ({args.forwards} forwards)")
    print(f"gets per run {info['gets']}, misses {info['misses']}")
    print(f"pinned / unpinned: best {min(res['pinned']) / min(res['unpinned']):.3f}x, "
          f"median {statistics.median(res['pinned']) / statistics.median(res['unpinned']):.3f}x")


if __name__ == "__main__":
    main()
