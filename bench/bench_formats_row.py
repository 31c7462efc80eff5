"""One decode row (x [1, 7168]) through one [2048, 7168] layer of each weight-only int4 / FP4
format at DeepSeek-V3's hidden size, exact mode, 1 thread, best of 30: the native kernels (the path
a loaded model takes, through the form the scheme declares) against the scheme's own torch
``apply`` (the path without them). Both results are compared (relative error) so a wrong fast
path cannot pass unseen.

    python bench/bench_formats_row.py [--reps 30]
"""

from __future__ import annotations

import argparse
import time
import types
from collections.abc import Callable

import torch

OUT, IN = 2048, 7168


def layer(**tensors: torch.Tensor) -> types.SimpleNamespace:
    return types.SimpleNamespace(model_dtype=torch.float32, out_features=OUT, in_features=IN,
                                 full_features=(OUT, IN), **tensors)


def best_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def cases(w: torch.Tensor) -> list[tuple[str, object, types.SimpleNamespace]]:
    from quantplug_compressed_tensors import fp4
    from quantplug_compressed_tensors.config import QuantArgs
    from quantplug_compressed_tensors.export import quantize_int4_group
    from quantplug_compressed_tensors.fp4 import CTFP4Scheme
    from quantplug_compressed_tensors.schemes import CTScheme
    from quantplug_gptq_awq import kernels as gk
    from quantplug_gptq_awq.config import LayerQuant
    from quantplug_gptq_awq.export import quantize
    from quantplug_gptq_awq.scheme import IntPackScheme
    from quantplug_modelopt import kernels as mk
    from quantplug_modelopt.schemes import NVFP4Scheme
    from quantplug_quark.scheme import MXFP4Scheme, quantize_mxfp4

    out = []
    q, s, s2 = mk.quantize_nvfp4(w)
    out.append(("ModelOpt NVFP4", NVFP4Scheme(16, False, "none", ""), layer(weight=q, weight_scale=s, weight_scale_2=s2)))
    out.append(("compressed-tensors NVFP4", CTFP4Scheme("nvfp4-pack-quantized", fp4.NVFP4, False, "none", ""),
                layer(weight_packed=q, weight_scale=s, weight_global_scale=(1 / s2).reshape(1))))
    qm, sm = quantize_mxfp4(w)
    out.append(("compressed-tensors MXFP4", CTFP4Scheme("mxfp4-pack-quantized", fp4.MXFP4, False, "none", ""),
                layer(weight_packed=qm, weight_scale=sm)))
    out.append(("Quark MXFP4", MXFP4Scheme(), layer(weight=qm, weight_scale=sm)))
    qi, z, sc = quantize(w, 128, False, 1)
    lq = LayerQuant(4, 128, False, False, "")
    for name, pack, qw, qz in (("GPTQ int4 g128", gk.gptq(), gk.pack_gptq_weight(qi, 4), gk.pack_last(z - 1, 4)),
                               ("AWQ int4 g128", gk.AWQ, gk.pack_last(qi, 4, gk.AWQ_ORDER), gk.pack_last(z, 4, gk.AWQ_ORDER))):
        li = layer(qweight=qw, qzeros=qz, scales=sc)
        li._groups = torch.arange(IN) // 128
        li._codes, li._scales, li._zeros = gk.repack(pack, 4, qw, qz, sc, sc.shape[-1])  # as loading does
        out.append((name, IntPackScheme(pack, lq, ""), li))
    qa = QuantArgs(4, "int", True, "group", 32, None, False, None, ())
    wp, ws = quantize_int4_group(w, torch.float32)
    out.append(("compressed-tensors W4A16 g32", CTScheme("pack-quantized", "packed", qa, None, "none", ""),
                layer(weight_packed=wp, weight_scale=ws, weight_shape=torch.tensor([OUT, IN]))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from quantplug.kernels import native
    from quantplug.kernels.native import Bound

    w = torch.randn(OUT, IN) * 0.02
    x = torch.randn(1, IN)
    print(f"native kernels: {native.status()}")
    print("| format | native ms | torch apply ms | torch / native | rel err |")
    print("|---|---|---|---|---|")
    for name, scheme, lay in cases(w):
        t_torch = best_ms(lambda s=scheme, la=lay: s.apply(la, x), a.reps)
        weights = scheme.form(lay) if native.library() is not None else None
        if weights is None:
            print(f"| {name} | - | {t_torch:.2f} | - | - |")
            continue
        b = Bound(weights, OUT, IN, None, torch.float32, "exact", name)
        t_native = best_ms(lambda b=b: native.gemm(x, [b.ptr()]), a.reps)
        ref, got = scheme.apply(lay, x), native.gemm(x, [b.ptr()])
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"| {name} | {t_native:.3f} | {t_torch:.2f} | {t_torch / t_native:.0f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
