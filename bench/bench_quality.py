"""Quality of every bundled exporter's output and of llama.cpp's K-quants / IQ types on the trained
tiny DeepSeek-V3 (``tests/data/trained/dsv3-tiny``), and the expert cache with and without prefetch
on its learned routing (run by hand; figures go into docs/trained-model.md with this command line).

    python bench/bench_quality.py --bin /tmp/lcpp-build/bin --work /tmp/quality-bench \\
        --json /tmp/quality-bench/quality.json

``--bin`` holds ``llama-quantize``, ``llama-imatrix`` and ``llama-perplexity`` built from the
llama.cpp tree vendored in the ``llama-cpp-python`` 0.3.36 source distribution (as for
``bench/compare_llama_perplexity.py``)::

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36   # then unpack it
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/lcpp-build -DGGML_NATIVE=ON \\
          -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build /tmp/lcpp-build --target llama-quantize llama-imatrix llama-perplexity -j2

Without ``--bin`` only the exporters' rows and the prefetch figures are measured.

Steps (deterministic: fixed text, fixed calibration, no sampling; ``--threads`` torch threads):

1. the reference: the bf16 checkpoint loaded by quantplug (float32 compute), scored over the
   held-out text (``heldout.txt``) in windows of ``--ctx`` tokens (all of them unless
   ``--max-chunks``) with its distributions saved, as
   ``quantplug eval MODEL --text heldout.txt --ctx 128 --save-logits ref.logits``;
2. every variant of every bundled exporter (:data:`EXPORTS`; the script refuses to run when a
   backend with an export hook is not covered), written from that model and evaluated against the
   reference as ``quantplug eval OUT --reference ref.logits`` (default load options and kernels);
   ModelSlim's W8A8 calibration is 4 windows of the training-side text (never the held-out text);
3. with ``--bin``: the model as an F32 GGUF (the GGUF exporter's ``write_gguf``, every tensor F32,
   the MTP layer included as ``blk.4.nextn.*``) with the checkpoint's byte-level BPE vocabulary
   (``tokenizer.ggml.pre`` ``gpt-2``: the tokenizer's ByteLevel regex), an importance matrix from
   ``llama-imatrix`` over the training-side text (:func:`calibration_text`: the training files, not
   the held-out ones), and ``llama-quantize --imatrix`` to each type of :data:`LLAMA_TYPES`; each file
   is loaded by quantplug and compared with the reference, the types its tensors actually got are
   read back from the file (llama-quantize falls back per tensor when a row is not a multiple of a
   K-quant's 256: this model's rows are 32 to 256 long), and ``llama-perplexity --kl-divergence``
   reads the same reference file for llama.cpp's own figures on the same tokens;
4. the expert cache: routed experts served from the bf16 safetensors with ``expert_cache_mb`` holding
   some of the routed experts (:data:`BUDGETS`), ``expert_prefetch`` on and off, over two decodes:
   the held-out text itself (a prefill of its first ``--prompt`` tokens, then its next ``--new``
   tokens fed one decode step each: the learned routing of real text) and a greedy generation of
   ``--new`` tokens after the same prompt (EOS disabled; this small model soon repeats itself, so
   its routing repeats too); the cache counters of the decode steps (for the generation as
   ``quantplug generate --json`` counts them: from the first generated token on) and of the
   prefill.

Parts 2 and 3 run side by side by default (``--jobs 2``: the exporters' part in a second process
reading the same reference file), each with ``--threads`` (1) threads: on 2 cores two one-thread
processes beat one two-thread process, whose every parallel region waits for its second thread
when the machine is busy. ``--skip`` leaves parts out; ``--tables`` prints the tables of saved
JSON files (parts run separately are merged).

Output: a JSON object (``--json``) and markdown tables on stdout. Never pickle: nothing here reads
or writes one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "data" / "trained" / "dsv3-tiny"
sys.path.insert(0, str(ROOT / "bench"))

#: (backend, export options): every variant each bundled exporter offers (its declared choices;
#: free-valued options at their defaults). quark and modelslim write unquantized tensors in bf16,
#: as the tools do for a bf16 model; the GGUF exporter's expert-pack copy (``pack``) holds the same
#: weights as the plain file, so it is not repeated. ``calibration`` is filled in at run time.
EXPORTS: list[tuple[str, dict[str, Any]]] = [
    ("fp8", {}),
    ("compressed_tensors", {}),
    ("quark", {"float_dtype": "bfloat16"}),
    ("modelopt", {"algo": "W4A16_NVFP4"}),
    ("modelopt", {"algo": "NVFP4"}),
    ("modelopt", {"algo": "FP8"}),
    ("gptq", {"sym": False}),
    ("gptq", {"sym": True}),
    ("awq", {"sym": False}),
    ("awq", {"sym": True}),
    ("modelslim", {"recipes": ["w8a8", "w4a8"], "float_dtype": "bfloat16"}),
    *[("expert_pack", {"type": t, "pack": False}) for t in ("F32", "BF16", "F16", "Q8_0", "Q5_1", "Q5_0", "Q4_1",
                                                             "Q4_0", "MXFP4")],
]
#: llama-quantize types, each made with the importance matrix
LLAMA_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ3_XXS",
               "IQ2_S", "IQ2_XXS", "IQ1_S")
#: expert cache budgets, in experts (of the 24 routed experts of the 3 MoE layers plain decoding uses;
#: 2 is the least a budget may hold: one layer's top-2)
BUDGETS = (2, 4, 6, 12, 18)


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def weight_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.suffix in (".safetensors", ".gguf", ".qpack"))


def calibration_text() -> str:
    """The training-side text: the corpus files ``bench/train_tiny.py`` trains on (the held-out
    files excluded), in its order, from this interpreter's standard library."""
    from train_tiny import FILES, HELD_OUT, read_corpus

    texts = read_corpus(any_corpus=True)
    return "".join(texts[n] for n in FILES if n not in HELD_OUT)


def kld_row(r: Any) -> dict[str, Any]:
    k = r.kld
    return {"ppl": r.ppl, "ppl_err": r.ppl_err, "ppl_base": k.ppl_base, "delta_ppl": k.ppl_diff,
            "kld_mean": k.kld_mean, "kld_mean_err": k.kld_mean_unc, "kld_p99": k.kld_p99, "kld_max": k.kld_max,
            "same_top": k.same_top, "ppl_diff_unc": k.ppl_diff_unc}


def evaluate_path(path: Path, ref: Path, bos: int | None, backend: str | None = None) -> dict[str, Any]:
    from quantplug import load
    from quantplug.eval import evaluate

    t0 = time.perf_counter()
    try:
        model = load(path, backend=backend, progress=False)
    except Exception as exc:  # a finding: reported as is
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        with torch.no_grad():
            r = evaluate(model, None, bos=bos, reference=ref, progress=False)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        del model
        gc.collect()
    return {**kld_row(r), "eval_s": round(time.perf_counter() - t0, 1)}


# -- exporters -------------------------------------------------------------------------------------


def run_exports(work: Path, ref: Path, bos: int | None, calib: list[torch.Tensor]) -> list[dict[str, Any]]:
    from quantplug import load
    from quantplug.plugins import get_plugin_manager

    pm = get_plugin_manager()
    exporting = {r.name for r in pm.records() if pm.implements(r.name, "quantplug_export")}
    missing = exporting - {b for b, _ in EXPORTS}
    if missing:
        raise SystemExit(f"backends with an export hook not covered by EXPORTS: {sorted(missing)}")
    dense = load(MODEL, progress=False)
    plan = dense.quantplug_plan
    rows = []
    for i, (backend, opts) in enumerate(EXPORTS):
        opts = dict(opts)
        if backend == "modelslim":
            opts["calibration"] = calib
        out = work / "exports" / f"{i:02d}-{backend}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        t0 = time.perf_counter()
        results = pm.export(backend, model=dense, destination=out, plan=plan, options=opts)
        export_s = time.perf_counter() - t0
        for res in results:
            log(f"{res.format}: export {export_s:.1f} s; evaluating")
            row = {"source": "quantplug export", "backend": backend, "format": res.format,
                   "options": {k: v for k, v in opts.items() if k != "calibration"},
                   "bytes": weight_bytes(Path(res.path)), **evaluate_path(Path(res.path), ref, bos, backend)}
            log("  ", {k: row.get(k) for k in ("bytes", "ppl", "kld_mean", "same_top", "error")})
            rows.append(row)
    del dense
    gc.collect()
    return rows


# -- llama.cpp ---------------------------------------------------------------------------------------


def write_f32_gguf(dest: Path, mtp: bool = True) -> Path:
    """The trained model as an F32 GGUF with its own byte-level BPE vocabulary (``mtp`` false: without
    the MTP layer ``blk.4.*``, and config.json says ``num_nextn_predict_layers`` 0)."""
    from quantplug import load
    from quantplug_expert_pack.export import gguf_state, model_state, write_gguf
    from quantplug_expert_pack.testing import rewrite_gguf

    tok = json.loads((MODEL / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise SystemExit("tokenizer.json ids are not 0..n-1")
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    cfg = json.loads((MODEL / "config.json").read_text())

    def tokenizer(w: Any) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")  # tokenizers' ByteLevel(use_regex=True) is GPT-2's regex
        w.add_token_list(tokens)
        w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
        w.add_token_merges(merges)
        w.add_bos_token_id(cfg["bos_token_id"])
        w.add_eos_token_id(cfg["eos_token_id"])
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)

    model = load(MODEL, progress=False)
    plan = model.quantplug_plan
    state = gguf_state(model_state(model, plan), plan.model_config)
    del model
    d = dest / ("F32" if mtp else "F32-no-mtp")
    if not mtp:
        cut = f"blk.{cfg['num_hidden_layers']}."
        state = {n: t for n, t in state.items() if not n.startswith(cut)}
        cfg["num_nextn_predict_layers"] = 0
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp = d / "tmp.gguf"
    write_gguf(tmp, state, plan.model_config, default_type="F32", types={"token_embd": "F32"})
    rewrite_gguf(tmp, d / "model.gguf", tokenizer)
    tmp.unlink()
    return d


def gguf_types(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def gguf_tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def run_cmd(cmd: list[str], logf: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    log("$", " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True, env=None if env is None else {**os.environ, **env})
    with logf.open("a") as f:
        f.write("$ " + " ".join(cmd) + f"\n[exit {p.returncode}]\n" + p.stdout + p.stderr + "\n")
    return p.returncode, p.stdout + p.stderr


def llama_kld(bin_dir: Path, gguf: Path, ref: Path, threads: int, ctx: int, logf: Path, shim: Path) -> dict[str, Any]:
    """``llama-perplexity --kl-divergence`` against quantplug's reference file (its tokens)."""
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-c", str(ctx), "-b", str(ctx), "-t", str(threads),
           "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", str(ref), "--kl-divergence"]
    rc, out = run_cmd(cmd, logf, env={"LD_PRELOAD": str(shim)})
    if rc:
        return {"error": f"llama-perplexity exit {rc}: {out.strip().splitlines()[-1] if out.strip() else ''}"}

    def num(pat: str) -> float | None:
        m = re.search(pat, out)
        return float(m.group(1)) if m else None

    same = num(r"Same top p:\s+([\d.]+)")
    return {"ppl": num(r"Mean PPL\(Q\)\s+:\s+([\d.]+)"), "kld_mean": num(r"Mean\s+KLD:\s+(-?[\d.]+)"),
            "kld_p99": num(r"99\.0%\s+KLD:\s+(-?[\d.]+)"), "same_top": None if same is None else same / 100}


def run_llama(bin_dir: Path, work: Path, ref: Path, bos: int | None, threads: int, ctx: int,
              calib_text: str, imatrix_chunks: int, types: tuple[str, ...]) -> dict[str, Any]:
    from compare_llama_perplexity import build_shim

    lw = work / "llama"
    lw.mkdir(parents=True, exist_ok=True)
    logf = lw / "commands.log"
    logf.write_text("")
    shim = build_shim(lw)
    f32 = write_f32_gguf(lw)
    text = lw / "train-side.txt"
    text.write_text(calib_text, encoding="utf-8")
    imatrix = lw / "imatrix.gguf"
    rc, out = run_cmd([str(bin_dir / "llama-imatrix"), "-m", str(f32 / "model.gguf"), "-f", str(text), "-o",
                       str(imatrix), "-c", str(ctx), "-b", str(ctx), "--chunks", str(imatrix_chunks),
                       "-t", str(threads)], logf)
    if rc:
        raise SystemExit(f"llama-imatrix failed ({rc}):\n{out[-3000:]}")
    m = re.search(r"compute_imatrix: computing over (\d+) chunks", out)
    info: dict[str, Any] = {"imatrix_chunks": int(m.group(1)) if m else None, "imatrix_ctx": ctx,
                            "calibration_chars": len(calib_text)}
    rows = []
    base = {"source": "llama.cpp", "format": "F32 GGUF (converted)", "bytes": weight_bytes(f32),
            "types": gguf_types(f32 / "model.gguf"), **evaluate_path(f32, ref, bos),
            "llama": llama_kld(bin_dir, f32 / "model.gguf", ref, threads, ctx, logf, shim)}
    log("  ", {k: base.get(k) for k in ("ppl", "kld_mean", "same_top", "error")}, base["llama"])
    rows.append(base)
    n_layers = json.loads((MODEL / "config.json").read_text())["num_hidden_layers"]
    no_mtp: Path | None = None
    for t in types:
        d = lw / t
        d.mkdir(exist_ok=True)
        src = f32
        row: dict[str, Any] = {"source": "llama.cpp", "format": f"llama-quantize {t} (imatrix)", "type": t}
        rc, out = run_cmd([str(bin_dir / "llama-quantize"), "--imatrix", str(imatrix), str(src / "model.gguf"),
                           str(d / "model.gguf"), t, str(threads)], logf)
        refused = re.search(r"Missing importance matrix for tensor (\S+) in a very low-bit quantization", out)
        if rc and refused and refused.group(1).startswith(f"blk.{n_layers}."):
            # llama-imatrix runs the main model only, so the MTP layer has no importance data, which
            # the very-low-bit types require: quantize the file without the MTP layer instead
            row["refused_with_mtp"] = refused.group(0)
            row["format"] += ", MTP layer dropped"
            if no_mtp is None:
                no_mtp = write_f32_gguf(lw, mtp=False)
            src = no_mtp
            rc, out = run_cmd([str(bin_dir / "llama-quantize"), "--imatrix", str(imatrix), str(src / "model.gguf"),
                               str(d / "model.gguf"), t, str(threads)], logf)
        shutil.copy(src / "config.json", d / "config.json")
        if rc:
            tail = [ln for ln in out.strip().splitlines() if ln.strip()][-3:]
            row["error"] = f"llama-quantize exit {rc}: {' | '.join(tail)}"
            rows.append(row)
            log("  ", row["error"])
            continue
        fallbacks: dict[str, int] = {}
        for cols, want, got_t in re.findall(r"ncols\s+(\d+) not divisible by \d+ \(required for type\s+(\w+)\) "
                                            r"-> falling back to\s+(\w+)", out):
            key = f"{want} -> {got_t} ({cols} columns)"
            fallbacks[key] = fallbacks.get(key, 0) + 1
        m = re.search(r"(\d+) of (\d+) tensor\(s\) required fallback quantization", out)
        got = gguf_tensor_types(d / "model.gguf")
        row.update(bytes=weight_bytes(d), types=gguf_types(d / "model.gguf"),
                   fallback_summary=m.group(0) if m else None, fallbacks=fallbacks,
                   tensor_types=got, **evaluate_path(d, ref, bos))
        row["llama"] = llama_kld(bin_dir, d / "model.gguf", ref, threads, ctx, logf, shim)
        log("  ", {k: row.get(k) for k in ("bytes", "types", "ppl", "kld_mean", "same_top", "error")}, row["llama"])
        rows.append(row)
    return {"info": info, "rows": rows}


# -- expert prefetch ---------------------------------------------------------------------------------


def expert_sizes() -> tuple[int, int]:
    """(bytes of one routed expert as the cache holds it, routed experts of the decoder's MoE layers)."""
    from quantplug import load
    from quantplug.api import stats_sources

    model = load(MODEL, progress=False, options={"expert_cache_mb": 64})
    cfg = model.quantplug_plan.model_config
    n = (cfg.num_hidden_layers - cfg.first_k_dense_replace) * cfg.n_routed_experts
    ids = torch.arange(4, 4 + 64).view(1, -1)
    with torch.no_grad():  # a prompt this long routes to every expert of every layer
        model(ids)
    s = stats_sources(model)["expert_cache"].stats()
    per = int(s["resident_bytes"] // s["misses"]) if s["misses"] else 0
    del model
    gc.collect()
    return per, n


#: expert cache counters reported per run
COUNTERS = ("requests", "hits", "misses", "expert_reads", "bytes_read", "evictions", "prefetched", "prefetch_hits",
            "prefetch_dropped")


def _decode_steps(model: Any, cache: Any, prompt: list[int], new: int, forced: list[int] | None
                  ) -> tuple[list[int], dict[str, float], dict[str, float]]:
    """Greedy generation of ``new`` tokens (EOS disabled; counters from the first generated token on,
    as ``quantplug generate --json`` counts them), or with ``forced``: a prefill of ``prompt`` then one
    decode step per token of ``forced`` (the text's own next tokens fed back instead of the model's
    picks: the routing of real text through the decode path). Returns the tokens fed or generated,
    the counters after the prefill and at the end."""
    if forced is None:
        toks: list[int] = []
        before: dict[str, float] = {}
        for step, t in enumerate(model.stream(torch.tensor([prompt]), new, eos_token_id=None)):
            toks.append(int(t[0]))
            if step == 0:
                before = dict(cache.stats())
        return toks, before, dict(cache.stats())
    from quantplug.generate import new_cache

    lm = model.text_lm()
    kv = new_cache(lm, 1, len(prompt) + len(forced))
    with torch.inference_mode():
        lm.next_logits(torch.tensor([prompt]), kv)
        before = dict(cache.stats())
        for t in forced:
            lm.next_logits(torch.tensor([[t]]), kv)
    return list(forced), before, dict(cache.stats())


def run_prefetch(tokens: list[int], prompt_len: int, new: int, budgets: tuple[int, ...]) -> dict[str, Any]:
    from quantplug import load
    from quantplug.api import stats_sources

    per, n = expert_sizes()
    prompt = tokens[:prompt_len]
    out: dict[str, Any] = {"expert_bytes": per, "routed_experts": n, "prompt_tokens": prompt_len, "new_tokens": new}
    for mode in ("text", "greedy"):
        runs = []
        for slots in budgets:
            mb = slots * per / (1 << 20)
            for prefetch in (False, True):
                model = load(MODEL, progress=False, options={"expert_cache_mb": mb, "expert_prefetch": prefetch})
                cache = stats_sources(model)["expert_cache"]
                forced = tokens[prompt_len:prompt_len + new] if mode == "text" else None
                toks, before, end = _decode_steps(model, cache, prompt, new, forced)
                steps = len(toks) - (1 if mode == "greedy" else 0)
                decode = {k: end.get(k, 0) - before.get(k, 0) for k in COUNTERS}
                decode["hit_rate"] = round(decode["hits"] / decode["requests"], 4) if decode["requests"] else None
                decode["bytes_per_token"] = round(decode["bytes_read"] / max(steps, 1), 1)
                runs.append({"budget_experts": slots, "expert_cache_mb": round(mb, 4), "prefetch": prefetch,
                             "decode_steps": steps, "token_ids": toks,
                             "prefill": {k: before.get(k, 0) for k in COUNTERS}, "decode": decode,
                             "peak_bytes": end.get("peak_bytes")})
                log(f"  {mode}: budget {slots}/{n} experts ({mb:.3f} MiB), prefetch {prefetch}: {decode}")
                del model
                gc.collect()
        toks = runs[0]["token_ids"]
        out[mode] = {"runs": runs, "same_tokens_every_run": len({tuple(r["token_ids"]) for r in runs}) == 1,
                     "distinct_tokens": len(set(toks))}
    return out


# -- tables ------------------------------------------------------------------------------------------


def _kld_cells(r: dict[str, Any]) -> str:
    return (f"{r['ppl']:.2f} ± {r['ppl_err']:.2f} | {r['delta_ppl']:+.3f} ± {r['ppl_diff_unc']:.3f} | "
            f"{r['kld_mean']:.6f} | {r['kld_p99']:.5f} | {100 * r['same_top']:.2f}%")


def export_table(ref: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    head = ["format (backend)", "file bytes", "PPL", "ΔPPL", "mean KLD", "p99 KLD", "same top"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
           f"| bf16 safetensors (the reference) | {ref['bytes']:,} | {ref['ppl']:.2f} ± {ref['ppl_err']:.2f} | | | | |"]
    for r in rows:
        name = f"{r['format']} (`{r['backend']}`)"
        if "error" in r:
            out.append(f"| {name} | {r.get('bytes', 0):,} | not loaded: {r['error'][:300]} | | | | |")
            continue
        out.append(f"| {name} | {r['bytes']:,} | {_kld_cells(r)} |")
    return "\n".join(out)


def llama_table(rows: list[dict[str, Any]]) -> str:
    head = ["llama-quantize type", "file bytes", "tensor types (count)", "PPL", "ΔPPL", "mean KLD", "p99 KLD",
            "same top", "llama.cpp: PPL / mean KLD / same top"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        name = r.get("type", r["format"]) + (" (no MTP layer)" if r.get("refused_with_mtp") else "")
        types = ", ".join(f"{k} {v}" for k, v in r.get("types", {}).items())
        if "error" in r:
            out.append(f"| {name} | {r.get('bytes', 0):,} | {types} | {r['error'][:300]} | | | | | |")
            continue
        lc = r.get("llama") or {}
        lcs = (f"{lc['ppl']:.2f} / {lc['kld_mean']:.6f} / {100 * lc['same_top']:.2f}%"
               if lc and "error" not in lc and None not in (lc.get("ppl"), lc.get("kld_mean"), lc.get("same_top"))
               else lc.get("error", "-"))
        out.append(f"| {name} | {r['bytes']:,} | {types} | {_kld_cells(r)} | {lcs} |")
    return "\n".join(out)


def prefetch_table(runs: list[dict[str, Any]]) -> str:
    head = ["budget (experts / MiB)", "prefetch", "requests", "hits", "misses", "hit rate", "bytes read",
            "bytes/step", "prefetched", "prefetch hits", "dropped"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        d = r["decode"]
        out.append(f"| {r['budget_experts']} / {r['expert_cache_mb']:.3f} | {'on' if r['prefetch'] else 'off'} | "
                   f"{d['requests']} | {d['hits']} | {d['misses']} | {d['hit_rate']:.3f} | {d['bytes_read']:,} | "
                   f"{d['bytes_per_token']:,.0f} | {d['prefetched']} | {d['prefetch_hits']} | "
                   f"{d['prefetch_dropped']} |")
    return "\n".join(out)


def print_tables(result: dict[str, Any]) -> None:
    ref, check = result["reference"], result["reference_vs_itself"]
    print(f"reference: bf16 checkpoint, PPL {ref['ppl']:.3f} ± {ref['ppl_err']:.3f}, {ref['windows']} windows of "
          f"{result['ctx']} ({ref['tokens_scored']:,} tokens scored); against its own file: mean KLD "
          f"{check.get('kld_mean')}\n")
    if result.get("exports"):
        print(export_table(ref, result["exports"]) + "\n")
    if result.get("llama"):
        info = result["llama"]["info"]
        print(f"llama.cpp: importance matrix over {info['imatrix_chunks']} windows of {info['imatrix_ctx']} tokens of "
              "the training-side text\n")
        print(llama_table(result["llama"]["rows"]) + "\n")
        for r in result["llama"]["rows"]:
            if r.get("fallbacks"):
                print(f"- {r['type']}: {r.get('fallback_summary')}: " +
                      "; ".join(f"{k} x{v}" for k, v in r["fallbacks"].items()))
            if r.get("refused_with_mtp"):
                print(f"- {r['type']}: with the MTP layer: {r['refused_with_mtp']}")
        print()
    if "prefetch" in result:
        p = result["prefetch"]
        print(f"expert cache: one routed expert {p['expert_bytes']:,} bytes as the cache holds it; "
              f"{p['routed_experts']} routed experts in the MoE layers plain decoding runs\n")
        for mode, what in (("text", f"the held-out text: prefill of its first {p['prompt_tokens']} tokens, then "
                                    f"its next {p['new_tokens']} tokens one decode step each"),
                           ("greedy", f"greedy generation of {p['new_tokens']} tokens after the held-out text's "
                                      f"first {p['prompt_tokens']} (decode steps after the first token)")):
            m = p[mode]
            print(f"{what}; {m['distinct_tokens']} distinct tokens; same tokens in every run: "
                  f"{m['same_tokens_every_run']}\n")
            print(prefetch_table(m["runs"]) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", type=Path, help="directory holding llama-quantize, llama-imatrix, llama-perplexity")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--max-chunks", type=int, default=None, help="held-out windows (default: all)")
    ap.add_argument("--imatrix-chunks", type=int, default=128, help="windows of the training-side text for llama-imatrix")
    ap.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads (on a shared machine one "
                    "thread: every parallel region otherwise waits for its second thread)")
    ap.add_argument("--prompt", type=int, default=32, help="prefetch: prompt tokens (the held-out text's first)")
    ap.add_argument("--new", type=int, default=128, help="prefetch: tokens generated")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: exports, llama, prefetch")
    ap.add_argument("--jobs", type=int, default=2, choices=(1, 2), help="2: the exporters' part runs in a second "
                    "process (one more --threads) beside the llama.cpp part")
    ap.add_argument("--reference", type=Path, help=argparse.SUPPRESS)  # the --jobs child: reuse the parent's file
    ap.add_argument("--tables", type=Path, nargs="+", help="print the tables of JSON files this script wrote "
                    "(parts run with --skip are merged), and exit")
    args = ap.parse_args()
    if args.tables:
        merged: dict[str, Any] = {}
        for f in args.tables:  # parts of one configuration run separately (--skip), merged in order
            merged.update({k: v for k, v in json.loads(f.read_text()).items() if v is not None})
        print_tables(merged)
        return
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.work.mkdir(parents=True, exist_ok=True)
    from quantplug import load
    from quantplug.eval import evaluate, text_tokens

    t_start = time.perf_counter()
    if args.reference is not None:  # the exporters' part for a --jobs 2 parent: its reference, no tables
        _, bos = text_tokens(MODEL, "")
        calib_ids, _ = text_tokens(MODEL, calibration_text()[:20000])
        calib = [torch.tensor(calib_ids[i * args.ctx:(i + 1) * args.ctx]).view(1, -1) for i in range(4)]
        t0 = time.perf_counter()
        part = {"exports": run_exports(args.work, args.reference, bos, calib), "exports_s": 0.0}
        part["exports_s"] = round(time.perf_counter() - t0, 1)
        args.json.write_text(json.dumps(part, indent=1))
        return
    tokens, bos = text_tokens(MODEL, (MODEL / "heldout.txt").read_text(encoding="utf-8"))
    ref_path = args.work / "reference.logits"
    model = load(MODEL, progress=False)
    with torch.no_grad():
        r = evaluate(model, tokens, n_ctx=args.ctx, bos=bos, max_chunks=args.max_chunks, save_logits=ref_path,
                     progress=False)
    del model
    ref = {"ppl": r.ppl, "ppl_err": r.ppl_err, "tokens_scored": r.count, "windows": r.n_chunk,
           "bytes": weight_bytes(MODEL)}
    log(f"reference: PPL {r.ppl:.3f} +/- {r.ppl_err:.3f} over {ref['tokens_scored']} tokens, "
        f"{time.perf_counter() - t_start:.1f} s")
    child = None
    if args.jobs == 2 and "exports" not in skip and args.bin is not None and "llama" not in skip:
        part_json = args.work / "part-exports.json"
        part_json.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--work", str(args.work), "--json", str(part_json),
               "--reference", str(ref_path), "--ctx", str(args.ctx), "--threads", str(args.threads)]
        log("exporters' part in a second process:", " ".join(cmd))
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=(args.work / "part-exports.log").open("w"))
        skip.add("exports")
    self_check = evaluate_path(MODEL, ref_path, bos)
    calib_text = calibration_text()
    calib_ids, _ = text_tokens(MODEL, calib_text[:20000])  # 4 windows need far less
    calib = [torch.tensor(calib_ids[i * args.ctx:(i + 1) * args.ctx]).view(1, -1) for i in range(4)]
    result: dict[str, Any] = {"model": str(MODEL.relative_to(ROOT)), "ctx": args.ctx, "reference": ref,
                              "reference_vs_itself": self_check, "torch": torch.__version__,
                              "threads": args.threads, "jobs": args.jobs if child is not None else 1}

    def save() -> None:  # after each part, so that a late failure keeps the figures measured
        result["total_s"] = round(time.perf_counter() - t_start, 1)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))

    if "exports" not in skip:
        t0 = time.perf_counter()
        result["exports"] = run_exports(args.work, ref_path, bos, calib)
        result["exports_s"] = round(time.perf_counter() - t0, 1)
        save()
    if args.bin is not None and "llama" not in skip:
        t0 = time.perf_counter()
        result["llama"] = run_llama(args.bin, args.work, ref_path, bos, args.threads, args.ctx, calib_text,
                                    args.imatrix_chunks, LLAMA_TYPES)
        result["llama_s"] = round(time.perf_counter() - t0, 1)
        save()
    if child is not None:
        if child.wait():
            raise SystemExit(f"the exporters' part failed ({child.returncode}): see {args.work / 'part-exports.log'}")
        result.update(json.loads((args.work / "part-exports.json").read_text()))
        save()
    if "prefetch" not in skip:
        t0 = time.perf_counter()
        result["prefetch"] = run_prefetch(tokens, args.prompt, args.new, BUDGETS)
        result["prefetch_s"] = round(time.perf_counter() - t0, 1)
    save()
    print_tables(result)
    print(f"\ntotal {result['total_s']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
