"""``quantplug eval`` against llama.cpp's ``llama-perplexity`` on the same GGUF files and text (not run by the tests).

    python bench/compare_llama_perplexity.py --bin /tmp/lcpp-build/bin --work /tmp/q8kld-bench

``--bin`` holds ``llama-perplexity`` built from the llama.cpp tree vendored in the
``llama-cpp-python`` 0.3.36 source distribution::

    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B BUILD -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
          -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build BUILD --target llama-perplexity -j2

Steps:

1. one tiny DeepSeek-V3 model (``tests/data/vendor/make_gguf_iq.py``'s ``mixed`` config: 3 layers,
   the first dense, MLA, 8 routed experts top-2 with the sigmoid router, a shared expert; vocab 320,
   random weights) written by quantplug's gguf-py writer as F32, Q8_0 and Q4_0 GGUFs (norms and
   the router F32, as llama-quantize keeps them), each with the byte-level BPE vocabulary of
   ``make_gguf_iq`` (``add_bos_token`` true) so llama.cpp tokenizes the text itself;
2. the text: the source of the Python standard library's ``textwrap`` module (this interpreter's);
3. per file: ``llama-perplexity -c CTX -b CTX --chunks K -fa off`` (KV cache F32) and ``quantplug
   eval --ctx CTX --max-chunks K --json``; the F32 file with ``--kl-divergence-base`` /
   ``--save-logits``, the quantized files with ``--kl-divergence`` / ``--reference`` against each
   tool's own F32 file, and across tools (llama.cpp reading quantplug's file and the reverse) to
   show the format is one, and each quantized file's quantplug distributions against llama.cpp's
   own on the same file (how far the two engines' forwards are apart);
   ``-fa off`` (``--flash-attn``): llama.cpp's default on the CPU is flash attention, and its graph
   then casts an F32 KV cache to F16 before attending (``build_attn_mha``: ``ggml_cast(k, F16)``,
   the same for V), a rounding quantplug's float32 attention does not make; with ``-fa off`` the
   F32 file's perplexity is quantplug's to every printed digit. llama.cpp's default (flash
   attention on) is measured too and printed after the table;
   llama-perplexity of this release loses its last log lines at exit (its logger is an
   intentionally leaked singleton whose queue is not flushed: the ``--kl-divergence`` summary
   never reaches stdout), so it runs with a small ``LD_PRELOAD`` shim compiled here that calls
   llama.cpp's own ``common_log_flush`` inside ``llama_backend_free`` (no computation changes);
4. the table: PPL of each, mean / p99 KLD and same top p, and the relative differences
   (done when PPL is within 0.5% everywhere and mean KLD within 5% in fast mode). Quantized files
   run twice in quantplug: ``kernels=exact`` (dequantize-then-matmul: no activation rounding) and
   ``kernels=fast`` (llama.cpp's integer block dot, every Q4_0 / Q8_0 product's activations
   rounded to Q8_0 blocks as ggml's CPU backend rounds them: llama.cpp's arithmetic).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("F32", "Q8_0", "Q4_0")
SHIM_PATH = Path()


def write_models(work: Path, seed: int) -> dict[str, Path]:
    from quantplug.models.config import parse_model_config
    from quantplug.testing import random_state
    from quantplug_expert_pack.export import gguf_state, write_gguf
    from quantplug_expert_pack.testing import rewrite_gguf

    sys.path.insert(0, str(ROOT / "tests" / "data" / "vendor"))
    from make_gguf_iq import CALIBRATION, SPECIALS, VOCAB, byte_level_vocab, config

    cfg = config("mixed")
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    state = gguf_state(random_state(cfg, seed=seed), mc)
    tokens, merges = byte_level_vocab(CALIBRATION, VOCAB - 256 - len(SPECIALS))
    tokens = SPECIALS + tokens

    def tokenizer(w: Any) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("deepseek-v3")
        w.add_token_list(tokens)
        w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_add_bos_token(True)

    out = {}
    for t in TYPES:
        d = work / f"dsv3-{t.lower()}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        tmp = d / "tmp.gguf"
        write_gguf(tmp, state, mc, default_type=t, types={"token_embd": t} if t != "F32" else {"token_embd": "F32"})
        rewrite_gguf(tmp, d / "model.gguf", tokenizer)
        tmp.unlink()
        out[t] = d
    return out


#: llama_backend_free, interposed: flush llama.cpp's asynchronous log first (see the docstring)
SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
struct common_log;
void llama_backend_free(void) {
    struct common_log * (*main_log)(void) = (struct common_log * (*)(void)) dlsym(RTLD_DEFAULT, "_Z15common_log_mainv");
    void (*flush)(struct common_log *) = (void (*)(struct common_log *)) dlsym(RTLD_DEFAULT, "_Z16common_log_flushP10common_log");
    if (main_log && flush) flush(main_log());
    void (*real)(void) = (void (*)(void)) dlsym(RTLD_NEXT, "llama_backend_free");
    if (real) real();
}
"""


def build_shim(work: Path) -> Path:
    src, out = work / "flush_log_shim.c", work / "flush_log_shim.so"
    src.write_text(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(out), str(src), "-ldl"], check=True)
    return out


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> str:
    print("$", " ".join(cmd), file=sys.stderr)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=None if env is None else {**os.environ, **env})
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n" + p.stdout + p.stderr + "\n")
    if p.returncode:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    print(f"  {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return p.stdout + p.stderr


def _num(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if not m:
        raise SystemExit(f"llama-perplexity output has no {pattern!r}")
    return float(m.group(1))


def llama(bin_dir: Path, model: Path, text: Path, ctx: int, chunks: int, threads: int, log: Path,
          base: Path | None = None, kld: Path | None = None, fa: str = "off") -> dict[str, float]:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model / "model.gguf"), "-f", str(text), "-c", str(ctx),
           "-b", str(ctx), "--chunks", str(chunks), "-t", str(threads), "-ctk", "f32", "-ctv", "f32", "-fa", fa]
    if base is not None:
        cmd += ["--kl-divergence-base", str(base)]
    if kld is not None:
        cmd = [c for c in cmd if c not in ("-f", str(text))] + ["--kl-divergence-base", str(kld), "--kl-divergence"]
    out = run(cmd, log, env={"LD_PRELOAD": str(SHIM_PATH)})
    if kld is None:
        return {"ppl": _num(r"Final estimate: PPL = ([\d.]+)", out), "ppl_err": _num(r"Final estimate: PPL = [\d.]+ \+/- ([\d.]+)", out)}
    return {"ppl": _num(r"Mean PPL\(Q\)\s+:\s+([\d.]+)", out),
            "ppl_base": _num(r"Mean PPL\(base\)\s+:\s+([\d.]+)", out),
            "kld_mean": _num(r"Mean\s+KLD:\s+(-?[\d.]+)", out),
            "kld_mean_unc": _num(r"Mean\s+KLD:\s+-?[\d.]+\s+±\s+([\d.]+)", out),
            "kld_p99": _num(r"99\.0%\s+KLD:\s+(-?[\d.]+)", out),
            "kld_max": _num(r"Maximum KLD:\s+(-?[\d.]+)", out),
            "same_top": _num(r"Same top p:\s+([\d.]+)", out) / 100}


def ours(model: Path, text: Path, ctx: int, chunks: int, log: Path, kernels: str = "exact",
         save: Path | None = None, ref: Path | None = None) -> dict[str, float]:
    cmd = [sys.executable, "-m", "quantplug", "eval", str(model), "--ctx", str(ctx), "--max-chunks", str(chunks),
           "--json", "-o", f"kernels={kernels}"]
    cmd += ["--text", str(text)] if ref is None else ["--reference", str(ref)]
    if save is not None:
        cmd += ["--save-logits", str(save)]
    d = json.loads(run(cmd, log).strip().splitlines()[-1])
    r = {"ppl": d["ppl"], "ppl_err": d["ppl_err"]}
    if d["kld"]:
        k = d["kld"]
        r.update(ppl_base=k["ppl_base"], kld_mean=k["kld_mean"], kld_mean_unc=k["kld_mean_unc"], kld_p99=k["kld_p99"],
                 kld_max=k["kld_max"], same_top=k["same_top"])
    return r


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", type=Path, required=True, help="directory holding llama-perplexity")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--flash-attn", choices=("off", "on"), default="off",
                    help="llama-perplexity's -fa for the table (off: float32 attention, as quantplug's; "
                         "llama.cpp's own default is measured after the table either way)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "commands.log"
    log.write_text("")
    global SHIM_PATH
    SHIM_PATH = build_shim(args.work)
    models = write_models(args.work, args.seed)
    text = args.work / "textwrap.py.txt"
    text.write_text(Path(textwrap.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    c, k = args.ctx, args.chunks
    lbase, qbase = args.work / "llama-f32.logits", args.work / "quantplug-f32.logits"
    rows: list[dict[str, Any]] = []
    lf = llama(args.bin, models["F32"], text, c, k, args.threads, log, base=lbase, fa=args.flash_attn)
    qf = ours(models["F32"], text, c, k, log, save=qbase)
    same_tokens = lbase.read_bytes()[:20 + 4 * k * c] == qbase.read_bytes()[:20 + 4 * k * c]
    rows.append({"file": "F32", "llama": lf, "quantplug": qf, "ppl_rel": rel(qf["ppl"], lf["ppl"])})
    # the format is one: each tool reads the other's base file
    cross = {"llama.cpp F32 vs quantplug's F32 file": llama(args.bin, models["F32"], text, c, k, args.threads, log,
                                                             kld=qbase, fa=args.flash_attn),
             "quantplug F32 vs llama.cpp's F32 file": ours(models["F32"], text, c, k, log, ref=lbase)}
    for t in TYPES[1:]:
        lq = llama(args.bin, models[t], text, c, k, args.threads, log, kld=lbase, fa=args.flash_attn)
        for kernels in ("exact", "fast"):
            qq = ours(models[t], text, c, k, log, kernels=kernels, ref=qbase)
            rows.append({"file": t, "kernels": kernels, "llama": lq, "quantplug": qq,
                         "ppl_rel": rel(qq["ppl"], lq["ppl"]), "kld_rel": rel(qq["kld_mean"], lq["kld_mean"])})
        cross[f"quantplug {t} (exact) vs llama.cpp's F32 file"] = ours(models[t], text, c, k, log, ref=lbase)
        # engine against engine on the same quantized file: how far the two forwards are apart
        lt = args.work / f"llama-{t.lower()}.logits"
        llama(args.bin, models[t], text, c, k, args.threads, log, base=lt, fa=args.flash_attn)
        for kernels in ("exact", "fast"):
            cross[f"quantplug {t} ({kernels}) vs llama.cpp's {t} file"] = ours(models[t], text, c, k, log,
                                                                               kernels=kernels, ref=lt)
    # llama.cpp with the other -fa (with "on", its default: the F32 KV cache cast to F16 before
    # attending), each file against llama.cpp's F32 file run the same way
    other = "on" if args.flash_attn == "off" else "off"
    lbase_other = args.work / f"llama-f32-fa-{other}.logits"
    fa_other = {"F32": llama(args.bin, models["F32"], text, c, k, args.threads, log, base=lbase_other, fa=other)}
    for t in TYPES[1:]:
        fa_other[t] = llama(args.bin, models[t], text, c, k, args.threads, log, kld=lbase_other, fa=other)
    result = {"ctx": c, "chunks": k, "flash_attn": args.flash_attn, f"llama_fa_{other}": fa_other,
              "scored_tokens": k * (c - 1 - c // 2), "text": str(text),
              "python": sys.version.split()[0], "same_tokens": same_tokens,
              "file_bytes": {"F32 logits": qbase.stat().st_size, "equal to llama.cpp's size": lbase.stat().st_size == qbase.stat().st_size},
              "rows": rows, "cross": cross}
    (args.work / "result.json").write_text(json.dumps(result, indent=2))
    print(f"text {text.name}: {k} windows of {c} tokens ({result['scored_tokens']} scored); token streams "
          f"identical in both tools' base files: {same_tokens}")
    print("| file | quantplug kernels | PPL llama.cpp | PPL quantplug | PPL diff | mean KLD llama.cpp | mean KLD quantplug "
          "| KLD diff | p99 KLD llama.cpp / quantplug | same top p llama.cpp / quantplug |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lq, qq = r["llama"], r["quantplug"]
        if "kld_mean" in lq:
            print(f"| {r['file']} | {r['kernels']} | {lq['ppl']:.4f} | {qq['ppl']:.4f} | {100 * r['ppl_rel']:.3f}% | "
                  f"{lq['kld_mean']:.6f} ± {lq['kld_mean_unc']:.6f} | {qq['kld_mean']:.6f} ± {qq['kld_mean_unc']:.6f} | "
                  f"{100 * r['kld_rel']:.2f}% | "
                  f"{lq['kld_p99']:.6f} / {qq['kld_p99']:.6f} | {lq['same_top']:.4f} / {qq['same_top']:.4f} |")
        else:
            print(f"| {r['file']} | - | {lq['ppl']:.4f} ± {lq['ppl_err']:.4f} | {qq['ppl']:.4f} ± {qq['ppl_err']:.4f} | "
                  f"{100 * r['ppl_rel']:.3f}% | - | - | - | - | - |")
    for name, d in cross.items():
        print(f"{name}: PPL {d['ppl']:.4f}, mean KLD {d.get('kld_mean', float('nan')):.6f}, same top p "
              f"{d.get('same_top', float('nan')):.4f}")
    print(f"llama.cpp with -fa {other}: F32 PPL {fa_other['F32']['ppl']:.4f}; " + "; ".join(
        f"{t} PPL {fa_other[t]['ppl']:.4f}, mean KLD {fa_other[t]['kld_mean']:.6f} ± {fa_other[t]['kld_mean_unc']:.6f}, "
        f"same top p {fa_other[t]['same_top']:.4f}" for t in TYPES[1:]))
    # mean KLD is compared in fast mode, llama.cpp's arithmetic (every quantized product's input
    # rounded to Q8_0 blocks); exact mode rounds no activation, so its Q8_0 loss is the weights' only
    ok = all(r["ppl_rel"] < 0.005 for r in rows) and all(r["kld_rel"] < 0.05 for r in rows if r.get("kernels") == "fast")
    print(f"PPL within 0.5% (every row) and mean KLD within 5% (kernels=fast): {ok}")


if __name__ == "__main__":
    main()
