"""GGUF / expert-pack benchmarks (run by hand; figures go into README with this command line).

    python bench/bench_gguf.py [--mib 64] [--skip-rss]

1. Dequant throughput per ggml type: quantplug's torch kernels against gguf-py's numpy
   ``gguf.quants.dequantize`` on the same ``--mib`` MiB of random valid blocks, same run
   (gguf-py best of 3, quantplug best of 5); outputs compared bit for bit. Both allocate a fresh
   output (for K-quants 12x the input: its page faults are a large share of both times); a
   second figure writes into a reused buffer (``out=``), the steady state of a serving loop.
2. Plan time of a GGUF carrying a 160k-token vocabulary (tokens, scores, token types and 160k
   merges, as real DeepSeek / Kimi files do), against gguf-py's GGUFReader opening the same file.
3. Peak RSS of a forward pass with an expert pack and a small cache (child process, VmHWM)
   against the experts' total size, the non-expert weights and the cache budget. The model:
   6 layers, 64 experts of 1024x512 in Q8_0 (535 MB of experts), ``--vocab`` 32000 (the
   embedding is F16 on disk, F32 in memory, as llama.cpp files and this loader do).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import quantplug
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from quantplug.models.config import parse_model_config
from quantplug.plan import build_plan
from quantplug.testing import random_state, tiny_config
from quantplug.kernels import ggml
from quantplug_expert_pack.build import build_pack
from quantplug_expert_pack.export import gguf_state, write_gguf
from quantplug_expert_pack.testing import random_blocks, rewrite_gguf


def _best(fn, n=3):
    best, out = float("inf"), None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_dequant(mib: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for t in ["Q4_0", "Q8_0", "Q2_K", "Q4_K", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q5_K", "Q6_K", "MXFP4"]:
        _, size = ggml.BLOCKS[t]
        blocks = random_blocks(t, (mib << 20) // size, rng, scale=1e-2)
        ref_s, ref = _best(lambda b=blocks, t=t: gguf_dequantize(b, GGMLQuantizationType[t]))
        tb = torch.from_numpy(blocks)
        ours_s, got = _best(lambda tb=tb, t=t: ggml.dequantize(tb, t), n=5)
        exact = bool(np.array_equal(np.asarray(ref, np.float32).view(np.uint32), got.numpy().view(np.uint32)))
        buf = torch.empty_like(got)  # steady state: the output buffer reused, as a serving loop would
        reuse_s, _ = _best(lambda tb=tb, t=t, buf=buf: ggml.dequantize(tb, t, out=buf), n=5)
        rows.append({"type": t, "MiB": mib, "gguf_py_s": round(ref_s, 3), "quantplug_s": round(ours_s, 3),
                     "speedup": round(ref_s / ours_s, 1), "quantplug_reused_out_s": round(reuse_s, 3),
                     "speedup_reused_out": round(ref_s / reuse_s, 1), "bit_exact": exact,
                     "quantplug_GiBps_out": round(got.numel() * 4 / ours_s / 2**30, 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_plan_vocab(root: Path, vocab: int = 160_000) -> dict:
    cfg = tiny_config(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                      q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32, num_hidden_layers=4)
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    d = root / "vocab"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    tmp = d / "plain.gguf.tmp"
    write_gguf(tmp, gguf_state(random_state(cfg), mc), mc, default_type="Q8_0")
    # re-write with a real-sized tokenizer: tokens, scores, types, merges
    def tokenizer(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"tok{i:06d}" for i in range(vocab)])
        w.add_token_scores([0.0] * vocab)
        w.add_token_types([1] * vocab)
        w.add_token_merges([f"t{i} o{i}" for i in range(vocab)])

    rewrite_gguf(tmp, d / "model.gguf", tokenizer)
    tmp.unlink()
    plan_s, p = _best(lambda: build_plan(d))
    assert not p.errors, p.errors
    reader_s, _ = _best(lambda: GGUFReader(d / "model.gguf"), n=1)
    return {"vocab_tokens": vocab, "merges": vocab, "file_MB": round((d / "model.gguf").stat().st_size / 1e6, 1),
            "quantplug_plan_s_best_of_3": round(plan_s, 3), "gguf_py_GGUFReader_open_s": round(reader_s, 3)}


HWM = "int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]) * 1024"
CHILD = f"""
import sys, json, torch, quantplug, gguf, quantplug_expert_pack
from quantplug.api import stats_sources
from quantplug.loader import model_bytes
from quantplug.plugins import get_plugin_manager
get_plugin_manager()
# warm the code: a tiny checkpoint of the same types runs the same kernels once, so library code
# pages touched on first use are not counted as model memory
w = quantplug.load(sys.argv[4], progress=False, options={{"expert_cache_mb": 1}})
with torch.no_grad():
    w(torch.tensor([[1, 2, 3]]))
del w
import gc; gc.collect()
ids = torch.randint(0, 1000, (1, int(sys.argv[3])), generator=torch.Generator().manual_seed(0))  # ids < vocab
before = {HWM}
m = quantplug.load(sys.argv[1], progress=False, options={{"expert_cache_mb": float(sys.argv[2])}})
with torch.no_grad():
    m(ids)
print(json.dumps({{"model_bytes": model_bytes(m), "hwm_before_load": before, "hwm_after_forward": {HWM},
                   "cache": stats_sources(m)["expert_cache"].stats()}}))
"""


def _pack_checkpoint(d: Path, cfg: dict) -> tuple[int, object]:
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    write_gguf(d / "model.gguf", gguf_state(random_state(cfg), mc), mc, default_type="Q8_0",
               types={"attn_k_b": "Q4_0"})
    before = (d / "model.gguf").stat().st_size
    return before, build_pack(d, progress=False)


def bench_pack_rss(root: Path, cache_mb: float, tokens: int, vocab: int) -> dict:
    cfg = tiny_config(vocab_size=vocab, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                      num_hidden_layers=6, n_routed_experts=64, num_experts_per_tok=4, n_group=4, topk_group=2,
                      q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                      num_attention_heads=8)
    before, res = _pack_checkpoint(root / "pack", cfg)
    _pack_checkpoint(root / "warm", tiny_config(hidden_size=64, moe_intermediate_size=64, q_lora_rank=64))
    d = root / "pack"
    out: dict = {"gguf_before_build_MB": round(before / 1e6, 1), "experts_total_MB": round(res.moved_bytes / 1e6, 1),  # type: ignore[attr-defined]
                 "tokens": tokens}
    # glibc's dynamic mmap threshold keeps freed multi-MB dequant buffers in the heap; the second
    # run fixes the threshold (an allocator setting a deployment makes, like MALLOC_ARENA_MAX)
    for label, env in (("glibc_default", {}), ("MALLOC_MMAP_THRESHOLD_=262144", {"MALLOC_MMAP_THRESHOLD_": "262144"})):
        proc = subprocess.run([sys.executable, "-c", CHILD, str(d), str(cache_mb), str(tokens), str(root / "warm")], capture_output=True,
                              text=True, env={**os.environ, **env})
        if proc.returncode:
            raise SystemExit(f"child failed:\n{proc.stderr}")
        r = json.loads(proc.stdout)
        non_expert, budget = r["model_bytes"], r["cache"]["budget_bytes"]
        grown = r["hwm_after_forward"] - r["hwm_before_load"]
        out["non_expert_weights_MB"] = round(non_expert / 1e6, 1)
        out["cache_budget_MB"] = round(budget / 1e6, 1)
        out["bound_non_expert_plus_cache_plus_10pct_MB"] = round((non_expert + budget) * 1.1 / 1e6, 1)
        out[label] = {"rss_growth_plan_load_forward_MB": round(grown / 1e6, 1),
                      "within_bound": grown <= (non_expert + budget) * 1.1}
        out["cache"] = r["cache"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--cache-mb", type=float, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary of the expert-pack model (real: 129k-160k)")
    ap.add_argument("--skip-dequant", action="store_true")
    ap.add_argument("--skip-rss", action="store_true")
    args = ap.parse_args()
    print("torch threads:", torch.get_num_threads(), flush=True)
    if not args.skip_dequant:
        bench_dequant(args.mib)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(json.dumps({"plan_160k_vocab": bench_plan_vocab(root)}, indent=2), flush=True)
        if not args.skip_rss:
            print(json.dumps({"pack_rss": bench_pack_rss(root, args.cache_mb, args.tokens, args.vocab)}, indent=2),
                  flush=True)
    _ = quantplug


if __name__ == "__main__":
    main()
