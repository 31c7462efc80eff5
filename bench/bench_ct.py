"""compressed-tensors benchmarks (run by hand; figures go into README with this command line).

    python bench/bench_ct.py [--mib 64] [--rounds 3] [--reps 3]

1. Dequant throughput: quantplug-compressed-tensors' pure-torch kernels against
   compressed-tensors' own decompressors (``PackedQuantizationCompressor.decompress``,
   ``FloatQuantizationCompressor.decompress``) on the same ``--mib`` MiB of stored weight data:
   W4A16 pack-quantized int4 group 32 (Kimi-K2.5's experts) and FP8_BLOCK 128x128, each with
   bf16 scales (bf16 output: both multiply in bf16, i.e. the exact product rounded once: the
   same bits) and with float32 scales (float32 output). The outputs are compared bit for bit in
   this process first; then each contender runs in a fresh process (``--rounds`` alternating
   rounds, best of ``--reps`` calls inside each), and the ratio is of the best times; CPU
   seconds (user + system, all threads) are reported beside, since on a shared machine the wall
   ratio follows the load (both run their ops on all of torch's threads).
   A third figure writes into a reused buffer (``out=``: no fresh pages to fault in), which the
   library's API cannot do.
2. Import cost of the compressed-tensors library (fresh processes: ``import torch`` vs
   ``import torch, compressed_tensors``), the reason the plugin does not use it at run time.
3. In-memory vs file bytes of the vendor fixtures loaded in their own dtype (bf16).

fp8 weights are checked for NaN codes once per layer (the scheme caches it); that one-time scan
is outside the timed calls here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    # name: (kind, scale dtype)
    "int4_g32_bf16": ("int4", torch.bfloat16),
    "int4_g32_f32": ("int4", torch.float32),
    "fp8_block_bf16": ("fp8", torch.bfloat16),
    "fp8_block_f32": ("fp8", torch.float32),
}


def make(case: str, mib: int):
    """Deterministic stored tensors: (layout, stored weight, scale, ct scheme, ct state dict)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from quantplug_compressed_tensors.kernels import Layout

    kind, sdtype = CASES[case]
    g = torch.Generator().manual_seed(0)
    rows = 8192
    if kind == "int4":
        words = (mib << 20) // 4 // rows
        cols = words * 8
        q = torch.randint(-(2 ** 31), 2 ** 31 - 1, (rows, words), generator=g, dtype=torch.int32)
        scale = (torch.rand(rows, cols // 32, generator=g) * 0.01 + 1e-3).to(sdtype)
        lay = Layout("packed", 4, "group", 32, None, rows, cols)
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
        sd = {"weight_packed": q, "weight_scale": scale, "weight_shape": torch.tensor([rows, cols])}
    else:
        cols = (mib << 20) // rows
        raw = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0  # no NaN codes
        q = raw.view(torch.float8_e4m3fn)
        scale = (torch.rand(-(-rows // 128), -(-cols // 128), generator=g) * 0.01 + 1e-3).to(sdtype)
        lay = Layout("fp8", 8, "block", None, (128, 128), rows, cols)
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128])
        sd = {"weight": q, "weight_scale": scale}
    return lay, q, scale, QuantizationScheme(targets=["Linear"], weights=args), sd


def run_ours(case: str, mib: int):
    from quantplug_compressed_tensors import kernels

    lay, q, scale, _, _ = make(case, mib)
    # the scheme looks for fp8 NaN codes once per layer (cached on the layer), not per call
    nan = kernels.has_nan_codes(q) if lay.kind == "fp8" else None
    return lambda: kernels.dequantize(lay, q, scale, dtype=scale.dtype, nan_codes=nan)


def run_ours_reused(case: str, mib: int):
    from quantplug_compressed_tensors import kernels

    lay, q, scale, _, _ = make(case, mib)
    nan = kernels.has_nan_codes(q) if lay.kind == "fp8" else None
    buf = torch.empty(lay.out_features, lay.in_features, dtype=scale.dtype)
    return lambda: kernels.dequantize(lay, q, scale, dtype=scale.dtype, nan_codes=nan, out=buf)


def run_ct(case: str, mib: int):
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    _, _, _, scheme, sd = make(case, mib)
    comp = PackedQuantizationCompressor if CASES[case][0] == "int4" else FloatQuantizationCompressor
    return lambda: comp.decompress(sd, scheme)["weight"]


def child(contender: str, case: str, mib: int, reps: int) -> None:
    fn = {"quantplug": run_ours, "quantplug_out": run_ours_reused, "compressed_tensors": run_ct}[contender](case, mib)
    times, cpus = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        del out
    print(json.dumps({"best": min(times), "median": statistics.median(times), "cpu": min(cpus)}))


def spawn(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_dequant(mib: int, rounds: int, reps: int) -> list[dict]:
    rows = []
    for case in CASES:
        exact = torch.equal(run_ours(case, mib)(), run_ct(case, mib)())  # bit for bit (no NaNs in the data)
        res: dict[str, list[dict]] = {"quantplug": [], "compressed_tensors": [], "quantplug_out": []}
        for r in range(rounds):
            order = ["quantplug", "compressed_tensors", "quantplug_out"]
            order = order if r % 2 == 0 else order[::-1]
            for who in order:
                res[who].append(spawn(["--child", who, case, str(mib), str(reps)]))
        ours = min(x["best"] for x in res["quantplug"])
        ref = min(x["best"] for x in res["compressed_tensors"])
        ours_med = statistics.median(x["median"] for x in res["quantplug"])
        ref_med = statistics.median(x["median"] for x in res["compressed_tensors"])
        ours_cpu = min(x["cpu"] for x in res["quantplug"])
        ref_cpu = min(x["cpu"] for x in res["compressed_tensors"])
        rows.append({"case": case, "MiB_stored": mib, "bit_exact": exact, "quantplug_s": round(ours, 3),
                     "compressed_tensors_s": round(ref, 3), "speedup_best": round(ref / ours, 2),
                     "speedup_median": round(ref_med / ours_med, 2), "quantplug_cpu_s": round(ours_cpu, 3),
                     "compressed_tensors_cpu_s": round(ref_cpu, 3), "cpu_ratio": round(ref_cpu / ours_cpu, 2),
                     "speedup_reused_out": round(ref / min(x["best"] for x in res["quantplug_out"]), 2),
                     "load_avg": os.getloadavg()[0]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_import(rounds: int) -> dict:
    def t(code: str) -> float:
        best = float("inf")
        for _ in range(rounds):
            out = subprocess.run([sys.executable, "-c", f"import time; t=time.perf_counter(); {code}; "
                                  "print(time.perf_counter()-t)"], capture_output=True, text=True, check=True)
            best = min(best, float(out.stdout.strip()))
        return best

    torch_s = t("import torch")
    ct_s = t("import torch, compressed_tensors")
    row = {"import_torch_s": round(torch_s, 2), "import_torch_and_compressed_tensors_s": round(ct_s, 2),
           "compressed_tensors_extra_s": round(ct_s - torch_s, 2)}
    print(json.dumps(row), flush=True)
    return row


def bench_bytes() -> list[dict]:
    import quantplug
    from quantplug.loader import model_bytes

    rows = []
    for name in ("ct_w4a16_experts_dsv3", "ct_fp8_block_dsv3"):
        path = ROOT / "tests" / "data" / "vendor" / name
        model = quantplug.load(path, dtype=torch.bfloat16, progress=False)
        files = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        mem = model_bytes(model)
        rows.append({"fixture": name, "file_bytes": files, "in_memory_bytes_bf16": mem,
                     "ratio": round(mem / files, 3)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", nargs=4, metavar=("WHO", "CASE", "MIB", "REPS"))
    a = ap.parse_args()
    if a.child:
        who, case, mib, reps = a.child
        child(who, case, int(mib), int(reps))
        return
    bench_dequant(a.mib, a.rounds, a.reps)
    bench_import(a.rounds)
    bench_bytes()


if __name__ == "__main__":
    main()
