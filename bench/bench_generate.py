"""Generation benchmark (run by hand; figures go into README with this command line).

    python bench/bench_generate.py [--reps 3] [--new 32] [--prompt 32] [--threads 1]

A DeepSeek-V3-shaped fp32 checkpoint (DeepSeek-V3's MLA head dims: kv_lora 512, rope 64, nope
128, v 128; 16 heads, hidden 1024, q_lora 512, 8 of 16 routed experts + 1 shared, 3 layers (the
first dense), vocab 16000: 341 MB) is written once. Each contender runs in a fresh process,
alternating, ``--reps`` times, batch 1, a ``--prompt``-token prompt, greedy, EOS disabled (every
run makes ``--new`` tokens):

* quantplug: ``quantplug.load`` + ``model.generate`` (MLA latent cache, absorbed decode);
* transformers: ``AutoModelForCausalLM.from_pretrained(dtype=float32)`` + ``generate`` (its
  DeepseekV3 with a DynamicCache).

Both are timed the same way, after one warm-up generate in the same process, best of two:
prefill = a generate of 1 new token; decode tokens/s = (new - 1) / (time of a generate of
``new`` tokens - time of the 1-token generate). With ``--threads 1`` (default) the clock is the
process's CPU time: on a shared machine other processes' load does not enter it. Cache bytes
per token: quantplug's ``MLACache.bytes_per_token()`` against the DynamicCache's key + value
bytes after a run divided by its length, and against an expanded per-head cache (heads x
(qk_head_dim + v_head_dim) per layer, what older transformers' DeepseekV3 kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from quantplug.testing import hub_rope_spelling, random_state, tiny_config, write_checkpoint

COMMON = """
import json, sys, time, torch
path, prompt_len, new, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
ids = torch.randint(0, 16000, (1, prompt_len), generator=torch.Generator().manual_seed(0))
clock = time.process_time if threads == 1 else time.perf_counter
def timed(n, reps=2):
    best = None
    for _ in range(reps):
        t0 = clock()
        out = gen(n)
        t = clock() - t0
        best = t if best is None else min(best, t)
    return best, out
"""
OURS = COMMON + """
import quantplug
m = quantplug.load(path, progress=False)
def gen(n):
    return m.generate(ids, n, min_new_tokens=n, eos_token_id=None)
gen(4)
t1, _ = timed(1)
tn, out = timed(new)
g = m.stream(ids, 1, eos_token_id=None)
list(g)
print(json.dumps({"prefill": t1, "decode_tps": (new - 1) / (tn - t1), "tokens": out[0].tolist(),
                  "cache_bytes_per_token": g.cache.bytes_per_token()}))
"""
HF = COMMON + """
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
def gen(n):
    with torch.no_grad():
        return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
gen(4)
t1, _ = timed(1)
tn, out = timed(new)
with torch.no_grad():
    r = m.generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0,
                   return_dict_in_generate=True)
cache = r.past_key_values
total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
print(json.dumps({"prefill": t1, "decode_tps": (new - 1) / (tn - t1), "tokens": out[0].tolist(),
                  "cache_bytes_per_token": total / cache.get_seq_length()}))
"""


def bench_config() -> dict:
    cfg = tiny_config(vocab_size=16000, hidden_size=1024, intermediate_size=1536, moe_intermediate_size=256,
                      num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=512,
                      kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      n_routed_experts=16, num_experts_per_tok=8, n_group=4, topk_group=2,
                      first_k_dense_replace=1, max_position_embeddings=4096)
    cfg["rope_parameters"]["original_max_position_embeddings"] = 1024  # yarn factor 4 x 1024 = 4096
    return cfg


def _child(code: str, path: Path, prompt: int, new: int, threads: int) -> dict:
    r = subprocess.run([sys.executable, "-c", code, str(path), str(prompt), str(new), str(threads)],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_expert_pack(cfg: dict, state: dict, root: Path, cache_mbs: list[float], prompt: int, new: int) -> list:
    """The same weights as a Q8_0 GGUF whose routed experts moved to an expert pack: ``quantplug
    generate --json`` in a fresh process (one torch thread) per expert-cache budget in
    ``cache_mbs``; its hit rate and bytes read from the pack per generated token (decode steps)."""
    from quantplug.models.config import parse_model_config
    from quantplug_expert_pack.build import build_pack
    from quantplug_expert_pack.export import gguf_state, write_gguf

    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    d = root / "gguf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    write_gguf(d / "model.gguf", gguf_state(state, mc, split_kv=True), mc, default_type="Q8_0", types={},
               vocab=cfg["vocab_size"])
    built = build_pack(d, progress=False)
    tokens = ",".join(str(i) for i in range(1, prompt + 1))
    code = "import sys; from quantplug.cli import main; sys.exit(main(sys.argv[1:]))"
    rows = []
    for mb in cache_mbs:
        r = subprocess.run([sys.executable, "-c", code, "generate", str(d), "--tokens", tokens, "--max-new-tokens",
                            str(new), "--json", "-o", f"expert_cache_mb={mb}"], capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode:
            raise SystemExit(f"expert-pack child failed:\n{r.stderr[-3000:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append({"pack_bytes": built.moved_bytes, "cache_mb": mb,
                     "expert_cache_hit_rate": out["expert_cache_hit_rate"],
                     "pack_reads_per_expert_use": out["pack_reads_per_expert_use"],
                     "ssd_bytes_per_token": out["ssd_bytes_per_token"],
                     "tokens_per_second_wall": out["tokens_per_second"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per contender; 1 (default) times with process CPU time, which other "
                         "processes on a shared machine do not inflate; more threads use wall time")
    ap.add_argument("--pack-cache-mb", type=float, nargs="+", default=[8.0, 16.0, 32.0],
                    help="expert cache budgets of the expert-pack runs (the pack holds 27 MB of Q8_0 experts)")
    ap.add_argument("--pack-only", action="store_true", help="only the expert-pack runs")
    args = ap.parse_args()
    cfg = bench_config()
    with tempfile.TemporaryDirectory(prefix="qp-bench-gen-") as tmp:
        state = random_state(cfg, seed=0)
        path = write_checkpoint(Path(tmp) / "ckpt", hub_rope_spelling(cfg), state)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"checkpoint: {size / 1e6:.0f} MB fp32, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} "
              f"heads, kv_lora {cfg['kv_lora_rank']} + rope {cfg['qk_rope_head_dim']}; prompt {args.prompt}, "
              f"{args.new} new tokens, batch 1", flush=True)
        if args.pack_only:
            bench_expert_pack(cfg, state, Path(tmp), args.pack_cache_mb, args.prompt, args.new)
            return
        ours, hf = [], []
        for rep in range(args.reps):  # alternate, each in a fresh process
            ours.append(_child(OURS, path, args.prompt, args.new, args.threads))
            hf.append(_child(HF, path, args.prompt, args.new, args.threads))
            print(f"rep {rep}: quantplug {ours[-1]['decode_tps']:.2f} tok/s, prefill {ours[-1]['prefill']:.3f} s | "
                  f"transformers {hf[-1]['decode_tps']:.2f} tok/s, prefill {hf[-1]['prefill']:.3f} s", flush=True)
        same = all(o["tokens"] == h["tokens"] for o, h in zip(ours, hf))
        o_tps, h_tps = [r["decode_tps"] for r in ours], [r["decode_tps"] for r in hf]
        o_pre, h_pre = [r["prefill"] for r in ours], [r["prefill"] for r in hf]
        result = {
            "checkpoint_mb": round(size / 1e6), "greedy_tokens_identical": same,
            "decode_tps": {"quantplug_best": max(o_tps), "quantplug_median": statistics.median(o_tps),
                           "transformers_best": max(h_tps), "transformers_median": statistics.median(h_tps)},
            "decode_speedup_best": max(o_tps) / max(h_tps),
            "decode_speedup_median": statistics.median(o_tps) / statistics.median(h_tps),
            "prefill_s": {"quantplug_best": min(o_pre), "transformers_best": min(h_pre)},
            "cache_bytes_per_token": {"quantplug": ours[0]["cache_bytes_per_token"],
                                      "transformers_dynamic_cache": hf[0]["cache_bytes_per_token"]},
        }
        expanded = cfg["num_hidden_layers"] * cfg["num_attention_heads"] * (
            cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) * 4
        result["cache_bytes_per_token"]["expanded_per_head"] = expanded
        result["cache_ratio_vs_dynamic_cache"] = (result["cache_bytes_per_token"]["transformers_dynamic_cache"]
                                                  / result["cache_bytes_per_token"]["quantplug"])
        result["cache_ratio_vs_expanded"] = expanded / result["cache_bytes_per_token"]["quantplug"]
        result["expert_pack"] = bench_expert_pack(cfg, state, Path(tmp), args.pack_cache_mb, args.prompt, args.new)
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
