"""compressed-tensors W4A16: forward time with ``kernels="exact"`` vs ``kernels="fast"`` (run by hand).

    python bench/bench_ct_kernels.py [--rounds 3] [--reps 3] [--threads 1]

A DeepSeek-V3-shaped model (4 layers: 1 dense + 3 MoE, hidden 1024, 32 routed experts of 512 with
top-4, vocab 8000) is written dense, exported by the plugin's own W4A16 exporter (routed experts
int4 group 32, everything else bf16, as the Kimi-K2.5 release stores it) and loaded in bfloat16
(the fast kernel's activation dtype; exact mode computes in the same dtype). Each mode runs in a
fresh process, the modes alternating over ``--rounds`` rounds; each child times a 64-token prefill
and a 1-token forward, best of ``--reps`` calls, by process CPU time (this machine is shared).
The logits of both modes are compared with the float32 exact model's (max-rel, argmax agreement):
bf16 exact mode runs every op in bf16, the fast kernel accumulates in float32.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CFG = dict(vocab_size=8000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
           num_hidden_layers=4, num_attention_heads=8, q_lora_rank=512, kv_lora_rank=256,
           qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32,
           num_experts_per_tok=4, n_group=4, topk_group=2)


def build(root: Path) -> Path:
    import quantplug
    from quantplug.testing import random_state, tiny_config, write_checkpoint

    cfg = tiny_config(**CFG)
    dense = write_checkpoint(root / "dense", cfg, random_state(cfg), dtype=None)
    model = quantplug.load(dense, progress=False)
    from quantplug_compressed_tensors.export import export_w4a16

    res = export_w4a16(model, model.quantplug_plan, root / "w4a16", {})
    return Path(res.path)


def child(path: str, kernels: str, reps: int, threads: int) -> None:
    import quantplug
    import torch

    torch.set_num_threads(threads)
    dtype = torch.float32 if kernels == "reference" else torch.bfloat16
    model = quantplug.load(path, dtype=dtype, options={"kernels": "exact" if kernels == "reference" else kernels},
                           progress=False)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, CFG["vocab_size"], (1, 64), generator=g)
    one = prompt[:, :1]
    out = {}
    with torch.no_grad():
        for name, ids in (("prefill64", prompt), ("forward1", one)):
            model(ids)  # warm-up
            best = float("inf")
            for _ in range(reps):
                t0 = time.process_time()
                model(ids)
                best = min(best, time.process_time() - t0)
            out[name] = best
        logits = model(prompt).float()
    out["logits"] = logits[0, -8:].tolist()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", nargs=2, metavar=("PATH", "KERNELS"))
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.reps, args.threads)
        return
    import torch

    with tempfile.TemporaryDirectory(prefix="qp-ct-kernels-") as tmp:
        path = build(Path(tmp))
        best: dict[str, dict[str, float]] = {"exact": {}, "fast": {}}
        logits: dict[str, torch.Tensor] = {}
        for r in range(args.rounds):
            for mode in (("exact", "fast") if r % 2 == 0 else ("fast", "exact")):
                cmd = [sys.executable, __file__, "--child", str(path), mode, "--reps", str(args.reps),
                       "--threads", str(args.threads)]
                res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                for k in ("prefill64", "forward1"):
                    best[mode][k] = min(best[mode].get(k, float("inf")), res[k])
                logits[mode] = torch.tensor(res["logits"])
        cmd = [sys.executable, __file__, "--child", str(path), "reference", "--reps", "1"]
        ref = torch.tensor(json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                     text=True).stdout.splitlines()[-1])["logits"])
        for k in ("prefill64", "forward1"):
            e, f = best["exact"][k] * 1000, best["fast"][k] * 1000
            print(f"{k}: exact {e:.1f} ms, fast {f:.1f} ms, fast/exact speed-up {e / f:.2f}x")
        for mode in ("exact", "fast"):
            a = logits[mode]
            rel = float((a - ref).abs().max() / ref.abs().max())
            agree = float((a.argmax(-1) == ref.argmax(-1)).float().mean())
            print(f"bf16 {mode} vs the float32 exact model (last 8 positions): max-rel {rel:.2e}, "
                  f"argmax agreement {agree:.2f}")


if __name__ == "__main__":
    main()
