"""MXFP4 dequant throughput: quantplug-quark's vectorised kernel against a straightforward
per-element reference (Python loops over a lookup table, vectorised only per row), same run.

    python bench/bench_mxfp4.py
"""

from __future__ import annotations

import time

import torch
from quantplug_quark.scheme import E2M1, dequantize_mxfp4


def reference(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(weight.shape[0], weight.shape[1] * 2)
    lut = E2M1.tolist()
    for r in range(weight.shape[0]):
        row = weight[r].tolist()
        sc = [2.0 ** (s - 127) for s in scale[r].tolist()]
        vals = []
        for i, b in enumerate(row):
            s = sc[(2 * i) // 32]
            vals += [lut[b & 15] * s, lut[b >> 4] * s]
        out[r] = torch.tensor(vals)
    return out


def main() -> None:
    g = torch.Generator().manual_seed(0)
    rows, cols = 4096, 4096
    w = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(110, 135, (rows, cols // 32), dtype=torch.uint8, generator=g)
    t0 = time.perf_counter()
    ours = dequantize_mxfp4(w, s)
    t_ours = time.perf_counter() - t0
    n_ref = 64
    t0 = time.perf_counter()
    ref = reference(w[:n_ref], s[:n_ref])
    t_ref = (time.perf_counter() - t0) * rows / n_ref
    assert torch.equal(ours[:n_ref], ref)
    mib = (w.numel() + s.numel()) / 2**20
    print(f"packed input {mib:.1f} MiB ({rows}x{cols} weights)")
    print(f"quantplug-quark dequantize_mxfp4: {t_ours:.3f} s ({mib / t_ours:.0f} MiB/s)")
    print(f"per-element reference (extrapolated from {n_ref} rows): {t_ref:.1f} s ({mib / t_ref:.2f} MiB/s)")
    print(f"speed-up: {t_ref / t_ours:.0f}x; outputs identical on the rows compared")


if __name__ == "__main__":
    main()
