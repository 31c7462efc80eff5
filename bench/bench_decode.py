"""Decode speed of every bundled format on one model, against its F32 GGUF and llama.cpp.

    python bench/bench_decode.py [--reps 2] [--threads 2] [--root DIR] [--llama-python PY]
                                 [--dtype float32|bfloat16|both] [--rows ROW,...] [--before TREE]

The model (bench_kernels' ``config()``): 8 layers (1 dense + 7 MoE), hidden 512, 32 routed
experts of 256 (top-4) + 1 shared, MLA q_lora 256 / kv_lora 128, vocab 32000: ~136M
parameters, random weights (std 0.02), written once as a bf16 safetensors checkpoint, then
exported by each bundled backend's own ``quantplug_export`` (GGUF F32 / Q8_0 / Q4_0 through
quantplug's gguf-py writer, DeepSeek FP8 block, compressed-tensors W4A16 experts-only, ModelSlim
W4A8 experts + W8A8 attention (its FLOAT tensors written as bfloat16: `float_dtype`), Quark MXFP4 (routed experts float, as amd-quark writes them; bfloat16: `float_dtype`),
ModelOpt NVFP4 / FP8 (every decoder linear, experts per expert), GPTQ / AWQ int4 group 32 with zero
points). compressed-tensors has no FP4 exporter: its NVFP4 / MXFP4 rows are written here by
:func:`write_ct_fp4` with compressed-tensors' quantization rules (every decoder linear, experts
included). Q4_K_M, Q5_K_M and Q6_K are made from the F32 GGUF by llama.cpp's own
``llama_model_quantize`` (llama-cpp-python), the standard mixes most GGUF downloads use.

Every contender runs in a fresh process (``--child``), contenders alternate over ``--reps``
rounds, and the best round is reported. Per contender: load seconds; prefill of 64 tokens; decode
ms/token = the generation's own timer of its 31 one-token steps after the first (model and
greedy pick; ``Generation.decode_seconds``) / 31, through the latent cache; prefill 64 = its
timer of the prompt forward (logits of the last position, as llama.cpp computes them) and the
first token; prefill 512: a 512-token prompt's forward alone (``next_logits``; llama.cpp: ``eval``
with a 512-token batch); 64+32 generate = the whole ``stream`` call, wall clock; tensor ops per
decode step (a ``TorchDispatchMode`` count: what the native steps leave to torch); batch-4
decode tokens/s (4 sequences decoded together) against batch-1. llama.cpp (when its Python
binding is importable in ``--llama-python``): prefill 64, then 32 single-token evals with its
greedy sampler. Wall clock by default (2 threads, as the issue measures); ``--cpu`` for process
CPU time.

``--dtype``: the model dtype quantplug loads into (``float32``, the default; ``bfloat16``; or
``both``: each format's row twice, the bfloat16 one named ``<row> bf16``, alternating with its
float32 row in every round, and a table of bfloat16 against float32 decode per format).
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

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import VOCAB, config  # noqa: E402

PREFILL, GEN = 64, 32
#: a long prompt's prefill (the row kernels' limit per weight is 128 rows; past it, expert groups
#: and dense weights are decided per product)
LONG = 512
CLOCK = time.perf_counter

#: contender -> (directory name, load options); exact and fast where a format has a fast mode
ROWS = {
    "GGUF F32": ("gguf-F32", {}),
    "GGUF Q8_0 exact": ("gguf-Q8_0", {}), "GGUF Q8_0 fast": ("gguf-Q8_0", {"kernels": "fast"}),
    "GGUF Q4_0 exact": ("gguf-Q4_0", {}), "GGUF Q4_0 fast": ("gguf-Q4_0", {"kernels": "fast"}),
    "GGUF Q4_K_M exact": ("gguf-Q4_K_M", {}), "GGUF Q4_K_M fast": ("gguf-Q4_K_M", {"kernels": "fast"}),
    "GGUF Q5_K_M exact": ("gguf-Q5_K_M", {}), "GGUF Q5_K_M fast": ("gguf-Q5_K_M", {"kernels": "fast"}),
    "GGUF Q6_K exact": ("gguf-Q6_K", {}), "GGUF Q6_K fast": ("gguf-Q6_K", {"kernels": "fast"}),
    "FP8 block (act_quant)": ("fp8", {}), "FP8 block (activation_quant=none)": ("fp8", {"activation_quant": "none"}),
    "CT W4A16 experts exact": ("ct-w4a16", {}), "CT W4A16 experts fast": ("ct-w4a16", {"kernels": "fast"}),
    "ModelSlim W4A8 experts": ("modelslim-w4a8", {}),
    "Quark MXFP4": ("quark-mxfp4", {}),
    # issue 24's formats (closest existing forms: Quark MXFP4 for FP4, CT W4A16 for GPTQ / AWQ)
    "ModelOpt NVFP4 (weight-only)": ("modelopt-nvfp4", {}),
    "ModelOpt NVFP4 (nvfp4 activations)": ("modelopt-nvfp4-act", {}),
    "ModelOpt FP8 (fp8 static activations)": ("modelopt-fp8", {}),
    "CT NVFP4 (weight-only)": ("ct-nvfp4", {}), "CT MXFP4 (weight-only)": ("ct-mxfp4", {}),
    "CT MXFP4 (mxfp4 activations)": ("ct-mxfp4-act", {}),
    "GPTQ int4 g32": ("gptq", {}), "AWQ int4 g32": ("awq", {}),
}
LLAMA = {"llama.cpp F32": "gguf-F32", "llama.cpp Q8_0": "gguf-Q8_0", "llama.cpp Q4_0": "gguf-Q4_0",
         "llama.cpp Q4_K_M": "gguf-Q4_K_M", "llama.cpp Q5_K_M": "gguf-Q5_K_M", "llama.cpp Q6_K": "gguf-Q6_K"}
#: the files made from the F32 GGUF by llama.cpp's own quantizer (llama_model_quantize): mix -> ftype
LLAMA_MIXES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
               "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def _gguf_with_merges(src: Path, dst: Path) -> None:
    from quantplug_expert_pack.testing import rewrite_gguf

    rewrite_gguf(src, dst, lambda w: w.add_token_merges(["<tok1> <tok2>"]))


def write_ct_fp4(model, plan, dest: Path, fmt: str, act: bool) -> None:
    """compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` from the dense model,
    quantized as compressed-tensors does (NVFP4: global scale 448 * 6 / amax, e4m3 block scales
    per 16; MXFP4: e8m0 scales per 32 by its round_to_power_2); W4A4 (dynamic activation scales;
    NVFP4's input_global_scale 448 * 6 / 16) when ``act``."""
    import re

    import torch
    from quantplug.api import dense_state
    from quantplug_compressed_tensors import fp4
    from safetensors.torch import save_file

    linear = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|"
                        r"o_proj|gate_proj|up_proj|down_proj)\.weight$")
    nv = fmt.startswith("nvfp4")
    lay = fp4.NVFP4 if nv else fp4.MXFP4
    tensors = {}
    for name, w in dense_state(model).items():
        if not linear.search(name):
            tensors[name] = (w.float() if name.endswith("e_score_correction_bias") else w.to(torch.bfloat16)).contiguous()
            continue
        base = name[: -len(".weight")]
        g = w.float().unflatten(-1, (-1, lay.group))
        amax = g.abs().amax(-1)
        if nv:
            gs = (448.0 * 6 / w.float().abs().amax()).reshape(1)
            s = (gs * amax / 6).clamp(max=448).to(torch.float8_e4m3fn)
            b = s.float() / gs
            tensors[f"{base}.weight_scale"], tensors[f"{base}.weight_global_scale"] = s, gs
            if act:
                tensors[f"{base}.input_global_scale"] = torch.tensor([448.0 * 6 / 16.0])
        else:
            e = (127 + torch.floor(torch.log2(fp4._power_of_two(amax))) - 2).clamp(0, 255)
            b = torch.exp2(e - 127)
            tensors[f"{base}.weight_scale"] = e.to(torch.uint8)
        q = fp4.e2m1_round((g / b.unsqueeze(-1)).clamp(-6, 6)).flatten(-2)
        mag = (q.abs().unsqueeze(-1) == fp4.E2M1[:8]).to(torch.uint8).argmax(-1).to(torch.uint8)
        codes = mag | (((q < 0) & (mag != 0)).to(torch.uint8) << 3)
        tensors[f"{base}.weight_packed"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False, "group_size": lay.group,
               "strategy": "tensor_group" if nv else "group"}
    acts = None if not act else {"num_bits": 4, "type": "float", "symmetric": True, "group_size": lay.group,
                                 "dynamic": "local" if nv else True, "strategy": "tensor_group" if nv else "group"}
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                        "format": fmt}}}
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "model.safetensors"))
    (dest / "config.json").write_text(json.dumps(dict(plan.checkpoint.config, quantization_config=qc), indent=2))


def build(root: Path, llama_py: str | None, need: set[str] | None = None) -> dict[str, Path]:
    """Every format's directory under ``root`` (reused when present); with ``need``, only those
    directories (and the F32 GGUF the K-quant mixes are made from)."""
    import quantplug
    from quantplug.plugins import get_plugin_manager
    from quantplug.testing import random_state, write_checkpoint

    dirs = {name: root / name for name, _ in ROWS.values()}
    cfg = config()
    dense = root / "dense-bf16"
    if not (dense / "config.json").exists():
        state = {k: v.to(__import__("torch").bfloat16) for k, v in random_state(cfg).items()}
        write_checkpoint(dense, {**cfg, "architectures": ["DeepseekV3ForCausalLM"]}, state)
    model = None
    pm = get_plugin_manager()
    for t in ("F32", "Q8_0", "Q4_0"):   # the GGUF backend's writer, with a vocabulary llama.cpp can load
        d = root / f"gguf-{t}"
        if (d / "model.gguf").exists() or (need is not None and d.name not in need and t != "F32"):
            continue
        if model is None:
            model = quantplug.load(dense, progress=False)
        from quantplug_expert_pack.export import gguf_state, model_state, write_gguf

        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg))
        mc = model.quantplug_plan.model_config
        write_gguf(d / "model.tmp.gguf", gguf_state(model_state(model, model.quantplug_plan), mc), mc,
                   default_type=t, vocab=VOCAB)
        _gguf_with_merges(d / "model.tmp.gguf", d / "model.gguf")
        (d / "model.tmp.gguf").unlink()
    exports = {"fp8": ("fp8", {}), "ct-w4a16": ("compressed_tensors", {}),
               "modelslim-w4a8": ("modelslim", {"recipes": ["w4a8"], "float_dtype": "bfloat16"}), "quark-mxfp4": ("quark", {"float_dtype": "bfloat16"}),
               "modelopt-nvfp4": ("modelopt", {}), "modelopt-nvfp4-act": ("modelopt", {"algo": "NVFP4"}),
               "modelopt-fp8": ("modelopt", {"algo": "FP8"}), "gptq": ("gptq", {}), "awq": ("awq", {})}
    for name, (backend, opts) in exports.items():
        d = root / name
        if (d / "config.json").exists() or (need is not None and name not in need):
            continue
        if model is None:
            model = quantplug.load(dense, progress=False)
        tmp = root / f"{name}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        results = pm.export(backend, model=model, destination=tmp, plan=model.quantplug_plan, options=opts)
        os.replace(results[0].path, d)
        print(f"exported {name}: {results[0].format}", file=sys.stderr)
    for name, fmt, act in (("ct-nvfp4", "nvfp4-pack-quantized", False), ("ct-mxfp4", "mxfp4-pack-quantized", False),
                           ("ct-mxfp4-act", "mxfp4-pack-quantized", True)):
        d = root / name
        if (d / "config.json").exists() or (need is not None and name not in need):
            continue
        if model is None:
            model = quantplug.load(dense, progress=False)
        write_ct_fp4(model, model.quantplug_plan, d, fmt, act)
        print(f"wrote {name}: compressed-tensors {fmt}{' W4A4' if act else ''}", file=sys.stderr)
    for mix, ftype in LLAMA_MIXES.items():
        km = root / f"gguf-{mix}"
        if (km / "model.gguf").exists() or not llama_py or (need is not None and km.name not in need):
            continue
        km.mkdir(exist_ok=True)
        (km / "config.json").write_text((root / "gguf-F32" / "config.json").read_text())
        code = ("import llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); "
                f"p.ftype = llama_cpp.{ftype}; p.nthread = 2; "
                "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
        subprocess.run([llama_py, "-c", code, str(root / "gguf-F32" / "model.gguf"), str(km / "model.gguf")], check=True,
                       capture_output=True)
        if not (km / "model.gguf").exists():
            raise SystemExit(f"llama_model_quantize wrote no {mix} file")
    return {k: v for k, v in dirs.items() if (v / "config.json").exists() and any(v.iterdir())}


def _best(fn, n: int) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best


def child(path: str, options: dict, threads: int, dtype: str = "float32") -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.set_num_threads(threads)
    import quantplug
    from quantplug.generate import new_cache

    options = dict(options)
    before = options.pop("_kernels_tree", None)
    if before:  # another tree's kernel sources and fast forms (--before): its kernels, this tree's Python
        from quantplug.kernels import native

        src = Path(before) / "core" / "kernels"
        native.SOURCE = src / "qp_kernels.c"
        line = next(t for t in (src / "native.py").read_text().splitlines() if t.startswith("FAST_FORMS = "))
        native.FAST_FORMS = eval(line.split("=", 1)[1])  # noqa: S307 (a line of the other tree's source)

    t0 = CLOCK()
    m = quantplug.load(path, progress=False, dtype=getattr(torch, dtype), options=options)
    load_s = CLOCK() - t0
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, PREFILL), generator=g)
    prompt4 = torch.randint(0, VOCAB, (4, PREFILL), generator=g)

    steps: dict[int, list[tuple[float, float]]] = {1: [], 4: []}

    def gen(p: torch.Tensor) -> None:
        """One generation; its own timers (prompt forward + first token, then each later step,
        model and sampling only) recorded per batch size."""
        run = m.stream(p, max_new_tokens=GEN, min_new_tokens=GEN, eos_token_id=None)
        for _ in run:
            pass
        steps.setdefault(p.shape[0], []).append((run.prefill_seconds, run.decode_seconds / (GEN - 1)))

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode():
        m(prompt[:, :8])
        gen(prompt[:, :8])
        steps[1].clear()
        g1 = _best(lambda: gen(prompt), 2)
        _best(lambda: gen(prompt4), 2)  # batch-4 timings recorded by gen()
        cache = new_cache(m, 1, PREFILL + 8)
        m.next_logits(prompt, cache)
        with Count():
            m.next_logits(prompt[:, :1], cache)
        long = torch.randint(0, VOCAB, (1, LONG), generator=g)

        def prefill_long() -> None:
            m.next_logits(long, new_cache(m, 1, LONG + 1))

        prefill_long()
        long_s = _best(prefill_long, 2)
    prefill = min(p for p, _ in steps[1])
    decode = min(d for _, d in steps[1])
    decode4 = min(d for _, d in steps[4])
    return {"load_s": round(load_s, 3), "prefill64_ms": round(prefill * 1e3, 2), "decode_ms": round(decode * 1e3, 3),
            "gen64+32_ms": round(g1 * 1e3, 1), "ops_per_step": Count.n, "batch4_tok_s": round(4 / decode4, 1),
            "batch1_tok_s": round(1 / decode, 1), "prefill512_ms": round(long_s * 1e3, 1)}


def llama_child(path: str, threads: int) -> dict:
    import random

    from llama_cpp import Llama

    t0 = CLOCK()
    llm = Llama(model_path=path, n_ctx=LONG + 64, n_batch=LONG, n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = CLOCK() - t0
    rnd = random.Random(0)
    prompt = [rnd.randrange(VOCAB) for _ in range(PREFILL)]
    long = [rnd.randrange(VOCAB) for _ in range(LONG)]

    def prefill() -> None:
        llm.reset()
        llm.eval(prompt)

    def generate() -> None:
        llm.reset()
        llm.eval(prompt)
        for _ in range(GEN):
            llm.eval([llm.sample(temp=0.0)])

    def prefill_long() -> None:
        llm.reset()
        llm.eval(long)

    prefill()
    p = _best(prefill, 3)
    gtime = _best(generate, 2)
    prefill_long()
    return {"load_s": round(load_s, 3), "prefill64_ms": round(p * 1e3, 2), "decode_ms": round((gtime - p) / GEN * 1e3, 3),
            "gen64+32_ms": round(gtime * 1e3, 1), "prefill512_ms": round(_best(prefill_long, 2) * 1e3, 1)}


def main() -> None:
    global CLOCK
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--root", default=None)
    ap.add_argument("--rows", default=None, help="comma-separated subset of the rows")
    ap.add_argument("--llama-python", default=None)
    ap.add_argument("--cpu", action="store_true", help="process CPU time instead of wall clock")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "both"),
                    help="model dtype of the quantplug rows (both: a bfloat16 row beside each float32 one)")
    ap.add_argument("--before", default=None, metavar="TREE",
                    help="also run each selected fast row on another checkout's kernels (rows named '... (before)')")
    ap.add_argument("--child", nargs=3, metavar=("ENGINE", "PATH", "OPTIONS"))
    a = ap.parse_args()
    if a.cpu:
        CLOCK = time.process_time
    if a.child:
        engine, path, opts = a.child
        res = (llama_child(path, a.threads) if engine == "llama"
               else child(path, json.loads(opts), a.threads, "float32" if a.dtype == "both" else a.dtype))
        print(json.dumps(res))
        return
    llama_py = a.llama_python
    if llama_py is None:
        try:
            import llama_cpp  # noqa: F401
            llama_py = sys.executable
        except ImportError:
            print("llama-cpp-python not importable (--llama-python): llama.cpp rows and the K-quant mixes skipped", file=sys.stderr)
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="qp_decode_"))
    picked = None if a.rows is None else a.rows.split(",")
    need = None if picked is None else {ROWS[r][0] for r in picked if r in ROWS} | {LLAMA[r] for r in picked if r in LLAMA}
    dirs = build(root, llama_py, need)
    from quantplug.kernels import native

    print(f"native kernels: {native.status()}", file=sys.stderr)
    rows = [r for r in ROWS if a.rows is None or r in a.rows.split(",")]
    dtypes = ("float32", "bfloat16") if a.dtype == "both" else (a.dtype,)
    if a.before:
        for r in list(rows):
            if r.endswith(" fast"):
                ROWS[f"{r} (before)"] = (ROWS[r][0], {**ROWS[r][1], "_kernels_tree": a.before})
                rows.append(f"{r} (before)")
    contenders = [("quantplug", r, d) for r in rows if ROWS[r][0] in dirs for d in dtypes]
    if llama_py:
        contenders += [("llama", r, "-") for r in LLAMA if (a.rows is None or r in a.rows.split(",")) and LLAMA[r] in dirs]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    best: dict[str, dict] = {}
    for rnd in range(a.reps):
        for engine, row, dtype in contenders:
            if engine == "llama":
                cmd = [llama_py, __file__, "--threads", str(a.threads), "--child", "llama",
                       str(dirs[LLAMA[row]] / "model.gguf"), "{}"]
            else:
                name, opts = ROWS[row]
                cmd = [sys.executable, __file__, "--threads", str(a.threads), "--dtype", dtype, "--child", "quantplug",
                       str(dirs[name]), json.dumps(opts)]
                row = f"{row} bf16" if dtype == "bfloat16" and a.dtype == "both" else row
            if a.cpu:
                cmd.insert(2, "--cpu")
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode:
                print(f"{row}: failed\n{out.stderr[-1500:]}", file=sys.stderr)
                continue
            res = json.loads(out.stdout.strip().splitlines()[-1])
            prev = best.get(row)
            best[row] = res if prev is None else {
                k: (max(prev[k], v) if k.endswith("tok_s") else min(prev[k], v)) for k, v in res.items()}
            print(f"round {rnd}: {row} {res}", file=sys.stderr, flush=True)
    f32 = best.get("GGUF F32")
    print("| contender | decode ms/token | vs F32 GGUF | prefill 64 ms | prefill 512 ms | ops/step | batch-4 tok/s (x batch-1) |")
    print("|---|---|---|---|---|---|---|")
    for row, res in best.items():
        vs = f"{f32['decode_ms'] / res['decode_ms']:.2f}x faster" if f32 else "-"
        b4 = f"{res['batch4_tok_s']} ({res['batch4_tok_s'] / res['batch1_tok_s']:.2f}x)" if "batch4_tok_s" in res else "-"
        print(f"| {row} | {res['decode_ms']:.2f} | {vs} | {res['prefill64_ms']:.1f} | {res.get('prefill512_ms', '-')} "
              f"| {res.get('ops_per_step', '-')} | {b4} |")
    if a.dtype == "both":
        print()
        print("| format | float32 decode ms/token | bfloat16 decode ms/token | bfloat16 / float32 |")
        print("|---|---|---|---|")
        for row in rows:
            f, b = best.get(row), best.get(f"{row} bf16")
            if f and b:
                print(f"| {row} | {f['decode_ms']:.2f} | {b['decode_ms']:.2f} | {b['decode_ms'] / f['decode_ms']:.2f}x |")
        print()
    for q in ("Q4_0", "Q8_0", *LLAMA_MIXES):
        lc = best.get(f"llama.cpp {q}")
        if lc is None:
            continue
        for mode in ("exact", "fast", "fast (before)"):
            r = best.get(f"GGUF {q} {mode}")
            if r:
                ours = r["gen64+32_ms"]
                print(f"{q} {mode}: 64+32 generate {ours:.1f} ms vs llama.cpp {lc['gen64+32_ms']:.1f} ms: "
                      f"{lc['gen64+32_ms'] / ours:.2f}x llama.cpp's speed")
    print(json.dumps(best))


if __name__ == "__main__":
    main()
