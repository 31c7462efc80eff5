"""Quantized forward speed: F32 / Q8_0 / Q4_0 GGUF of a ~136M-parameter DeepSeek-V3-shaped model,
exact and fast kernels (``kernels`` load option), and llama.cpp when llama-cpp-python is importable.

    python bench/bench_kernels.py [--reps 3] [--threads 1] [--wall] [--root DIR] [--profile TYPE:KERNELS]

Each contender runs in a fresh process (``python bench/bench_kernels.py --child ...``); contenders
alternate, and the best of ``--reps`` rounds is reported. Timed per contender, after one warm-up:
prefill of 64 tokens (one forward of [1, 64]), a 1-token forward without cache ("decode"), and
generating 32 greedy tokens after a 64-token prompt (quantplug: ``model.generate`` with the latent
KV cache; llama.cpp: eval of the prompt then 32 single-token evals). Ratios are taken within the
same run. The clock is this process's CPU time (``--wall`` for wall clock): on a machine shared
with other jobs a descheduled process would otherwise count their time.

The model (``config()``): 8 layers (1 dense + 7 MoE), hidden 512, 32 routed experts of 256 (top-4)
+ 1 shared, MLA q_lora 256 / kv_lora 128, vocab 32000: 136M parameters. Weights are random (std
0.02, the repo's ``random_state``), written with quantplug's gguf-py writer (split MLA K/V);
``token_embd`` / ``output`` are in the file's type as llama-quantize writes them for Q8_0
(for Q4_0 llama-quantize would use Q6_K for ``output``; gguf-py cannot write Q6_K, so it is Q4_0).

``--profile Q4_0:exact`` prints a cProfile of 20 one-token forwards in this process instead.

Bench-only dependency: ``pip install -r bench/requirements.txt`` (llama-cpp-python; compiles).
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

#: the model: quantplug.testing.tiny_config with these changes (kept apart so the llama.cpp child,
#: which runs in another environment without quantplug, needs only VOCAB)
OVERRIDES = {
    "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "moe_intermediate_size": 256,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
    "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
    "v_head_dim": 64, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    "max_position_embeddings": 4096,
}
VOCAB = OVERRIDES["vocab_size"]


def config() -> dict:
    from quantplug.testing import tiny_config

    cfg = tiny_config(**OVERRIDES)
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "original_max_position_embeddings": 1024}
    return cfg
TYPES = ("F32", "Q8_0", "Q4_0")
PREFILL = 64
GEN = 32


def build(root: Path) -> dict[str, Path]:
    """One directory per type (config.json + model.gguf); reused when present."""
    import torch
    from quantplug.models.config import parse_model_config
    from quantplug.testing import random_state
    from quantplug_expert_pack.export import gguf_state, write_gguf

    dirs = {t: root / t for t in TYPES}
    if all((d / "model.gguf").exists() for d in dirs.values()):
        return dirs
    cfg = config()
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    state = gguf_state(random_state(cfg), mc)
    print(f"model: {sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters", file=sys.stderr)
    for t, d in dirs.items():
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg))
        write_gguf(d / "model.gguf.tmp", state, mc, default_type=t, vocab=VOCAB)
        _with_merges(d / "model.gguf.tmp", d / "model.gguf")
        (d / "model.gguf.tmp").unlink()
    del torch
    return dirs


#: the clock: ``process_time`` (CPU seconds of this process) by default, as this machine is shared
#: and a descheduled process would count others' time; ``--wall`` for wall-clock seconds. With one
#: thread (the default) the two agree on an idle machine.
CLOCK = time.process_time


def _with_merges(src: Path, dst: Path) -> None:
    """Copy of ``src`` with a one-entry ``tokenizer.ggml.merges`` (llama.cpp refuses a gpt2 vocabulary
    without merges; token ids are fed directly here, so the tokenizer is never used)."""
    from quantplug_expert_pack.testing import rewrite_gguf

    rewrite_gguf(src, dst, lambda w: w.add_token_merges(["<tok1> <tok2>"]))


def _time(fn, n: int) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best


def child(path: str, kernels: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import quantplug

    t0 = CLOCK()
    m = quantplug.load(path, progress=False, options={"kernels": kernels})
    load_s = CLOCK() - t0
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, PREFILL), generator=g)
    one = prompt[:, :1]
    with torch.inference_mode():
        m(prompt)
        m(one)
        prefill = _time(lambda: m(prompt), 3)
        decode = _time(lambda: m(one), 10)
        # prompt + 32 greedy new tokens through the latent KV cache (quantplug.generate)
        gen = _time(lambda: m.generate(prompt, max_new_tokens=GEN, min_new_tokens=GEN, eos_token_id=None), 2)
    return {"load_s": round(load_s, 3), "prefill64_ms": round(prefill * 1e3, 2), "decode_ms": round(decode * 1e3, 2),
            "gen64+32_ms": round(gen * 1e3, 1)}


def llama_child(path: str, threads: int) -> dict:
    from llama_cpp import Llama

    t0 = CLOCK()
    llm = Llama(model_path=path, n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = CLOCK() - t0
    import random

    rnd = random.Random(0)
    prompt = [rnd.randrange(VOCAB) for _ in range(PREFILL)]

    def prefill() -> None:
        llm.reset()
        llm.eval(prompt)

    def decode() -> None:
        llm.eval([prompt[0]])  # one token on top of the prompt's cache

    def generate() -> None:  # prompt + 32 new tokens, greedy (llama.cpp's own sampler)
        llm.reset()
        llm.eval(prompt)
        for _ in range(GEN):
            llm.eval([llm.sample(temp=0.0)])

    prefill()
    p = _time(prefill, 3)
    prefill()
    d = _time(decode, 10)
    gen = _time(generate, 2)
    return {"load_s": round(load_s, 3), "prefill64_ms": round(p * 1e3, 2), "decode_ms": round(d * 1e3, 2),
            "gen64+32_ms": round(gen * 1e3, 1)}


def _old_dispatch(self, x, idx, w):  # type: ignore[no-untyped-def]
    """Experts.forward before issue 14 (the "before" of ``--profile ... --old-dispatch``): one
    torch.where over all pairs per hit expert, each expert's rows gathered and scattered alone."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros_like(x)
    for k in torch.unique(idx).tolist():
        pos, tok = torch.where(idx.t() == k)
        xs = x[tok]
        hs = F.silu(self.gate_proj(xs, k)) * self.up_proj(xs, k)
        hs = self.down_proj(hs, k) * w[tok, pos, None]
        out.index_add_(0, tok, hs.to(out.dtype))
    return out


def profile(path: str, kernels: str, threads: int, old_dispatch: bool, tokens: int = 1) -> None:
    import cProfile
    import pstats

    import torch

    torch.set_num_threads(threads)
    import quantplug
    from quantplug.models.deepseek import Experts

    if old_dispatch:
        Experts.forward = _old_dispatch  # type: ignore[method-assign]
    m = quantplug.load(path, progress=False, options={"kernels": kernels})
    one = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    n = 20 if tokens == 1 else 3
    with torch.inference_mode():
        for _ in range(3):
            m(one)
        t0 = CLOCK()
        for _ in range(n):
            m(one)
        wall = (CLOCK() - t0) / n
        pr = cProfile.Profile(CLOCK)
        pr.enable()
        for _ in range(n):
            m(one)
        pr.disable()
    st = pstats.Stats(pr)
    calls = sum(v[1] for v in st.stats.values())  # type: ignore[attr-defined]
    code = Experts.forward.__code__
    moe = sum(v[3] for k, v in st.stats.items()  # type: ignore[attr-defined]
              if (k[0], k[1], k[2]) == (code.co_filename, code.co_firstlineno, code.co_name))
    print(f"{tokens}-token forward: {wall * 1e3:.2f} ms CPU unprofiled; {calls / n:.0f} Python function calls per forward; "
          f"Experts.forward cumulative {moe / n * 1e3:.2f} ms of {st.total_tt / n * 1e3:.2f} ms profiled")  # type: ignore[attr-defined]
    st.sort_stats("tottime").print_stats(12)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--root", default=None, help="where the GGUF files are built (default: a temp dir)")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--kernels", default="exact,fast")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--llama-python", default=None,
                    help="interpreter with llama-cpp-python for the llama.cpp rows (default: this one, if it has it)")
    ap.add_argument("--profile", default=None, help="TYPE:KERNELS, e.g. Q4_0:exact")
    ap.add_argument("--old-dispatch", action="store_true", help="with --profile: the pre-issue-14 MoE loop")
    ap.add_argument("--tokens", type=int, default=1, help="with --profile: tokens per forward")
    ap.add_argument("--wall", action="store_true", help="wall-clock instead of process CPU time")
    ap.add_argument("--child", nargs=3, metavar=("ENGINE", "PATH", "KERNELS"))
    a = ap.parse_args()
    if a.wall:
        global CLOCK
        CLOCK = time.perf_counter
    if a.child:
        engine, path, kernels = a.child
        res = llama_child(path, a.threads) if engine == "llama" else child(path, kernels, a.threads)
        print(json.dumps(res))
        return
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="qp_kernels_"))
    dirs = build(root)
    if a.profile:
        t, k = a.profile.split(":")
        profile(str(dirs[t]), k, a.threads, a.old_dispatch, a.tokens)
        return
    # F32 has no fast kernel: one F32 row, the baseline of every ratio
    contenders = [("quantplug", t, k) for t in a.types.split(",") for k in a.kernels.split(",")
                  if t != "F32" or k == a.kernels.split(",")[0]]
    llama_py = a.llama_python
    if not a.no_llama and llama_py is None:
        try:
            import llama_cpp  # noqa: F401

            llama_py = sys.executable
        except ImportError:
            print("llama-cpp-python not importable (pip install -r bench/requirements.txt, or --llama-python): "
                  "llama.cpp rows skipped", file=sys.stderr)
    if not a.no_llama and llama_py:
        contenders += [("llama", t, "-") for t in a.types.split(",")]
    from quantplug.kernels import native

    # built here once, before any timed child (each child then loads the cached library)
    print(f"quantplug native kernels: {native.status()}", file=sys.stderr)
    best: dict[tuple[str, str, str], dict] = {}
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    for r in range(a.reps):
        for c in contenders:
            engine, t, k = c
            path = str(dirs[t] / "model.gguf") if engine == "llama" else str(dirs[t])
            python = llama_py if engine == "llama" else sys.executable
            out = subprocess.run([python, __file__, "--threads", str(a.threads), *(["--wall"] if a.wall else []),
                                  "--child", engine, path, k],
                                 capture_output=True, text=True, env=env)
            if out.returncode:
                print(f"{c}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            res = json.loads(out.stdout.strip().splitlines()[-1])
            prev = best.get(c)
            best[c] = res if prev is None else {key: min(prev[key], res[key]) for key in res}
            print(f"round {r}: {c} {res}", file=sys.stderr, flush=True)
    base = best.get(("quantplug", "F32", a.kernels.split(",")[0]))
    for c, res in best.items():
        ratio = (f" ({res['prefill64_ms'] / base['prefill64_ms']:.2f}x / {res['decode_ms'] / base['decode_ms']:.2f}x / "
                 f"{res['gen64+32_ms'] / base['gen64+32_ms']:.2f}x quantplug F32)") if base else ""
        lc = best.get(("llama", c[1], "-"))
        if lc and c[0] == "quantplug":
            ratio += f" (generate {res['gen64+32_ms'] / lc['gen64+32_ms']:.2f}x llama.cpp {c[1]})"
        print(f"{c[0]:9s} {c[1]:5s} {c[2]:5s} prefill64 {res['prefill64_ms']:8.2f} ms  decode {res['decode_ms']:7.2f} ms"
              f"  64+32 generate {res['gen64+32_ms']:8.1f} ms  load {res['load_s']:.3f} s{ratio}")
    print(json.dumps({"|".join(c): v for c, v in best.items()}))


if __name__ == "__main__":
    main()
