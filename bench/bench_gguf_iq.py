"""GGUF IQ / TQ types: dequant throughput and one-token decode (run by hand; figures in docs/gguf-iq.md).

    python bench/bench_gguf_iq.py [--melem 8] [--threads 1] [--skip-decode]

1. Dequant throughput per IQ / TQ type: quantplug's torch kernels (``quantplug.kernels.ggml_iq``
   through the GGUF backend's ``ggml.dequantize``) against gguf-py's numpy
   ``gguf.quants.dequantize`` on the same random valid blocks (``--melem`` million output values),
   same run, gguf-py best of 3, quantplug best of 5, outputs compared bit for bit; and quantplug
   writing into a reused output buffer (the steady state of a serving loop).
2. One-token decode (forward of [1, 1] without cache, best of 20) of the llama.cpp-made per-type
   fixtures in tests/data/vendor (1 MoE layer, 4 experts, hidden 256; every tensor in the type
   where llama-quantize allows), against the same model written as Q4_0 and Q8_0 by gguf-py
   (native kernels) in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from quantplug_expert_pack import ggml
from quantplug_expert_pack.testing import random_blocks

ROOT = Path(__file__).parents[1]
VENDOR = ROOT / "tests" / "data" / "vendor"
TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0")


def _best(fn, n=3):
    best, out = float("inf"), None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_dequant(melem: float) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for t in TYPES:
        block, size = ggml.BLOCKS[t]
        blocks = random_blocks(t, int(melem * 2**20) // block, rng, scale=1e-2)
        ref_s, ref = _best(lambda b=blocks, t=t: gguf_dequantize(b, GGMLQuantizationType[t]))
        tb = torch.from_numpy(blocks)
        ours_s, got = _best(lambda tb=tb, t=t: ggml.dequantize(tb, t), n=5)
        exact = bool(np.array_equal(np.asarray(ref, np.float32).view(np.uint32), got.numpy().view(np.uint32)))
        buf = torch.empty_like(got)
        reuse_s, _ = _best(lambda tb=tb, t=t, buf=buf: ggml.dequantize(tb, t, out=buf), n=5)
        n = got.numel() / 1e6
        rows.append({"type": t, "Melem": round(n, 1), "gguf_py_ms_per_Melem": round(ref_s * 1e3 / n, 2),
                     "quantplug_ms_per_Melem": round(ours_s * 1e3 / n, 2), "speedup": round(ref_s / ours_s, 1),
                     "quantplug_reused_out_ms_per_Melem": round(reuse_s * 1e3 / n, 2),
                     "speedup_reused_out": round(ref_s / reuse_s, 1), "bit_exact": exact})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _decode_ms(path: Path) -> float:
    import quantplug

    model = quantplug.load(path, progress=False)
    ids = torch.tensor([[5]])
    with torch.inference_mode():
        model(ids)
        s, _ = _best(lambda: model(ids), n=20)
    return s * 1e3


def bench_decode() -> list[dict]:
    sys.path.insert(0, str(VENDOR))
    import make_gguf_iq as mk
    from quantplug.models.config import parse_model_config
    from quantplug.testing import random_state
    from quantplug_expert_pack.export import gguf_state, write_gguf

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = mk.config("per_type")
        mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
        state = gguf_state(random_state(cfg, seed=1), mc)
        for t in ("Q8_0", "Q4_0"):
            d = Path(tmp) / t
            d.mkdir()
            (d / "config.json").write_text(json.dumps(cfg))
            write_gguf(d / "model.gguf", state, mc, default_type=t, types={"token_embd": t})
            rows.append({"model": f"{t} (gguf-py, native kernels)", "decode_ms": round(_decode_ms(d), 3)})
            print(json.dumps(rows[-1]), flush=True)
        for t in TYPES:
            d = VENDOR / f"gguf_{t.lower()}_dsv3"
            rows.append({"model": f"{t} (llama-quantize --pure)", "decode_ms": round(_decode_ms(d), 3)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--melem", type=float, default=8.0, help="million output values per type")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("torch threads:", torch.get_num_threads(), flush=True)
    bench_dequant(args.melem)
    if not args.skip_decode:
        bench_decode()


if __name__ == "__main__":
    main()
