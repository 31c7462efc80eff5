"""Per-call time of one decode row (x [1, in]) through one [2048, 7168] layer of each issue-24 format against
the closest existing torch paths (Quark MXFP4, compressed-tensors W4A16), exact mode, 1 thread, best of 30.
Run by hand: python bench/bench_issue24_formats.py"""
import time, types, torch
torch.set_num_threads(1)
torch.manual_seed(0)
OUT, IN = 2048, 7168
w = torch.randn(OUT, IN) * 0.02
x = torch.randn(1, IN)

def layer(**t):
    return types.SimpleNamespace(model_dtype=torch.float32, out_features=OUT, in_features=IN, full_features=(OUT, IN), **t)

def bench(name, fn, reps=30):
    fn()
    best = min((lambda t0: (fn(), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(reps))
    print(f"{name:32s} {best * 1e3:8.2f} ms")
    return best

res = {}
from quantplug_modelopt import kernels as mk
from quantplug_modelopt.schemes import NVFP4Scheme
q, s, s2 = mk.quantize_nvfp4(w)
L = layer(weight=q, weight_scale=s, weight_scale_2=s2)
res["modelopt nvfp4"] = bench("modelopt NVFP4 (weight-only)", lambda: NVFP4Scheme(16, False, "none", "").apply(L, x))
from quantplug_compressed_tensors import fp4
from quantplug_compressed_tensors.fp4 import CTFP4Scheme
Lc = layer(weight_packed=q, weight_scale=s, weight_global_scale=(1 / s2).reshape(1))
res["ct nvfp4"] = bench("compressed-tensors NVFP4", lambda: CTFP4Scheme("nvfp4-pack-quantized", fp4.NVFP4, False, "none", "").apply(Lc, x))
from quantplug_quark.scheme import MXFP4Scheme, quantize_mxfp4
qm, sm = quantize_mxfp4(w)
Lm = layer(weight_packed=qm, weight_scale=sm)
res["ct mxfp4"] = bench("compressed-tensors MXFP4", lambda: CTFP4Scheme("mxfp4-pack-quantized", fp4.MXFP4, False, "none", "").apply(Lm, x))
Lq = layer(weight=qm, weight_scale=sm)
res["quark mxfp4"] = bench("quark MXFP4 (existing, torch)", lambda: MXFP4Scheme().apply(Lq, x))
from quantplug_gptq_awq.export import quantize
from quantplug_gptq_awq import kernels as gk
from quantplug_gptq_awq.scheme import IntPackScheme
from quantplug_gptq_awq.config import LayerQuant
qi, z, sc = quantize(w, 128, False, 1)
lq = LayerQuant(4, 128, False, False, "")
for name, pack, qw, qz in (("gptq", gk.gptq(), gk.pack_gptq_weight(qi, 4), gk.pack_last(z - 1, 4)),
                           ("awq", gk.AWQ, gk.pack_last(qi, 4, gk.AWQ_ORDER), gk.pack_last(z, 4, gk.AWQ_ORDER))):
    sch = IntPackScheme(pack, lq, "")
    Li = layer(qweight=qw, qzeros=qz, scales=sc)
    Li._groups = torch.arange(IN) // 128
    res[name] = bench(f"{name} int4 g128", lambda: sch.apply(Li, x))
from quantplug_compressed_tensors.export import quantize_int4_group
from quantplug_compressed_tensors.schemes import CTScheme
from quantplug_compressed_tensors.config import QuantArgs
qa = QuantArgs(4, "int", True, "group", 32, None, False, None, ())
wp, ws = quantize_int4_group(w, torch.float32)
Lw = layer(weight_packed=wp, weight_scale=ws, weight_shape=torch.tensor([OUT, IN]))
res["ct w4a16"] = bench("compressed-tensors W4A16 (existing)", lambda: CTScheme("pack-quantized", "packed", qa, None, "none", "").apply(Lw, x))
try:
    from quantplug_expert_pack import native, ggml
    print("native:", native.status())
except Exception as e:
    print("no native", e)
