"""DeepSeek block-FP8 dequant throughput (quantplug-fp8's torch kernel) against a naive
reference and, when the ``compressed-tensors`` package is installed, its own block decompressor
(``compressed_tensors.quantization.lifecycle.forward.dequantize``), on the same 64 MiB of F8_E4M3
weights; then in-memory vs file bytes of a loaded FP8 checkpoint.

Two weight sets, 64 MiB each: one [8192, 8192] matrix (whole 128x128 blocks) and 16 matrices of
DeepSeek-V3's kv_a_proj_with_mqa shape [576, 7168] (scale [5, 56]: a partial last block row).
Every contender's output is checked bit-exact against quantplug's in this process first; each
timing then runs in a fresh process (one warm-up call, best of ``--calls``), contenders
alternating, ``--reps`` rounds; best and median over rounds are reported.

    python bench/bench_fp8.py [--reps 5] [--calls 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from quantplug_fp8 import kernels

BLOCK = (128, 128)
SETS = {"8192x8192": [(8192, 8192)], "16x kv_a [576, 7168]": [(576, 7168)] * 16}


def make(shapes: list[tuple[int, int]], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows, cols in shapes:
        b = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
        b[(b & 0x7F) == 0x7F] = 0  # no NaN codes
        s = torch.rand(*kernels.scale_shape(rows, cols, BLOCK), generator=g) * 1e-3 + 1e-4
        out.append((b.view(torch.float8_e4m3fn), s))
    return out


def naive(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    return q.float() * s.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]


def contenders() -> dict:
    fns = {"quantplug": lambda q, s, o: kernels.dequantize(q, s, BLOCK),
           "quantplug (out=)": lambda q, s, o: kernels.dequantize(q, s, BLOCK, out=o),
           "naive repeat_interleave": lambda q, s, o: naive(q, s)}
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
    except ImportError:
        print("compressed-tensors not importable (pip install -r requirements-dev.txt): its row is skipped",
              file=sys.stderr)
        return fns
    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=list(BLOCK),
                            symmetric=True, dynamic=False)
    fns["compressed-tensors"] = lambda q, s, o: ct_dequantize(q, s, None, args=args, dtype=torch.float32)
    return fns


def run_child(name: str, set_name: str, calls: int) -> None:
    data = make(SETS[set_name])
    fn = contenders()[name]
    outs = [torch.empty(q.shape) for q, _ in data]
    for (q, s), o in zip(data, outs):  # warm-up
        fn(q, s, o)
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        for (q, s), o in zip(data, outs):
            fn(q, s, o)
        best = min(best, time.perf_counter() - t0)
    print(json.dumps({"seconds": best}))


def check_exact(set_name: str) -> None:
    data = make(SETS[set_name])
    for name, fn in contenders().items():
        for q, s in data:
            ours = kernels.dequantize(q, s, BLOCK)
            theirs = fn(q, s, torch.empty(q.shape))
            assert theirs.dtype == torch.float32 and torch.equal(ours, theirs), f"{name} differs on {set_name}"
            del theirs
    print(f"{set_name}: every contender bit-exact with quantplug ({', '.join(contenders())})")


def bench(reps: int, calls: int) -> None:
    names = list(contenders())
    for set_name, shapes in SETS.items():
        check_exact(set_name)
        mib = sum(r * c for r, c in shapes) / 2**20
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(reps):
            for n in names:
                res = subprocess.run([sys.executable, __file__, "--child", n, "--set", set_name, "--calls", str(calls)],
                                     check=True, capture_output=True, text=True)
                times[n].append(json.loads(res.stdout.strip().splitlines()[-1])["seconds"])
        base, base_med = min(times["quantplug"]), statistics.median(times["quantplug"])
        print(f"  {mib:.0f} MiB of F8_E4M3 weights -> float32; best / median of {reps} fresh processes")
        for n in names:
            b, m = min(times[n]), statistics.median(times[n])
            ratio = "" if n == "quantplug" else f"  time / quantplug's: {b / base:.2f}x best, {m / base_med:.2f}x median"
            print(f"  {n:<24} {b:.3f} s / {m:.3f} s  ({mib / b:,.0f} MiB/s){ratio}")


def memory() -> None:
    import quantplug
    from quantplug.loader import model_bytes
    from quantplug.testing import random_state, tiny_config, write_checkpoint
    from quantplug_fp8.export import LINEAR

    cfg = tiny_config(vocab_size=4096, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704,
                      q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                      num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4,
                      n_group=4, topk_group=2)
    stored = {}
    for name, w in random_state(cfg).items():
        if LINEAR.search(name):
            stored[name], stored[name[:-6] + "weight_scale_inv"] = kernels.quantize(w, BLOCK)
        else:
            stored[name] = w.float() if name.endswith("bias") else w.to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "fp8", {**cfg, "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}},
            stored)
        file_bytes = (path / "model.safetensors").stat().st_size
        fp8_file = sum(t.numel() for t in stored.values() if t.dtype == torch.float8_e4m3fn)
        print(f"memory: DeepSeek-shaped FP8 checkpoint (hidden 1024, 3 layers, 16 experts), file {file_bytes:,} B, "
              f"of which F8_E4M3 {fp8_file:,} B")
        for dtype in (torch.bfloat16, torch.float32):
            model = quantplug.load(path, dtype=dtype, progress=False)
            held = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
            mb = model_bytes(model)
            print(f"  dtype {str(dtype).removeprefix('torch.'):<9} in-memory {mb:,} B = {mb / file_bytes:.3f}x the file; "
                  f"F8_E4M3 parameters {held:,} B ({held / fp8_file:.3f}x the stored FP8)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--child")
    ap.add_argument("--set")
    a = ap.parse_args()
    if a.child:
        run_child(a.child, a.set, a.calls)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench(a.reps, a.calls)
    memory()


if __name__ == "__main__":
    main()
