"""Decode speed of vLLM with quantplug's plugin against vLLM's own CPU path on the same checkpoint
(and quantplug's own ``generate`` beside them), on the tiny checkpoints of
``quantplug.testing.engines`` (DeepSeek's MLA dims, 3 layers, 8 experts; ``topk_method:
"noaux_tc"`` in config.json, as DeepSeek-V3's release has it), each exported by its backend's own
exporter:

    python integrations/vllm/bench/bench_decode.py --rounds 3 dense compressed-tensors-w4a16 gguf-q4_0 fp8-block

Contenders, each in a fresh process per round, their order rotating from round to round:

* ``plugin``: ``vllm.LLM(path, load_format="quantplug", quantization="quantplug")``;
* ``vllm``: ``vllm.LLM(path)``, vLLM's own loader and quantization (where it refuses the
  checkpoint, the row says so with vLLM's error);
* ``quantplug``: ``quantplug.load(path).generate`` (no engine);
* ``plugin-layers`` (named in ``--contenders`` only): the plugin with its one-call decode step off.

In each process: load, one warm-up generation, then ``--reps`` times greedy generation of 1 and of
64 new tokens from one 6-token prompt. Decode tokens/s = 63 / (min t64 - min t1) over every
repetition of every round (the prefill and the first token cancel), in wall-clock and in the
process's CPU time (less sensitive to other processes on a shared machine, but it counts every
thread's time: it is a tokens-per-CPU-second figure). vLLM runs in the worker process itself (no
engine-core subprocess), ``enforce_eager=True`` unless ``--compile``, one sequence. Runs in the
environment with vLLM. Also printed: whether each contender's 64 tokens equal the plugin's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

PROMPT = [1, 5, 9, 33, 100, 7]
#: model sizes (config.json overrides of ``quantplug.testing.engines.mla_config``): ``tiny`` the test
#: checkpoints (3 layers, hidden 256, ~41 MB bf16: per-step engine overhead decides the speed), ``mid``
#: ~0.5 GB bf16 (4 layers, hidden 1536, 16 heads, 16 routed experts of 768, top-4: a decode step reads
#: ~220 MB of bf16 weights, so the weights, not the engine's per-step overhead, decide the speed)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "mid": {"hidden_size": 1536, "intermediate_size": 4096, "moe_intermediate_size": 768, "n_routed_experts": 16,
            "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "num_attention_heads": 16,
            "num_key_value_heads": 16, "q_lora_rank": 768, "num_hidden_layers": 4},
}
NEW = 64
CONTENDERS = ("plugin", "vllm", "quantplug")
#: also measurable: ``plugin-layers``, the plugin with its one-call decode step off (vLLM's layers
#: decode, each of quantplug's products inside them: the plugin before that step)


def worker(contender: str, path: str, dtype_name: str, reps: int, compile_: bool) -> dict[str, Any]:
    """One contender in this (fresh) process: timings of 1 and of NEW new tokens, and the tokens."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    t0 = time.perf_counter()
    run: Any
    if contender == "quantplug":
        import quantplug

        model = quantplug.load(path, dtype=getattr(torch, dtype_name), progress=False)

        def run(n: int) -> list[int]:
            out: list[int] = model.generate(torch.tensor([PROMPT]), n)[0, len(PROMPT):].tolist()
            return out
    else:
        from vllm import LLM, SamplingParams

        plugin = contender.startswith("plugin")
        kw: dict[str, Any] = {"load_format": "quantplug", "quantization": "quantplug"} if plugin else {}
        try:
            llm = LLM(model=path, skip_tokenizer_init=True, dtype=dtype_name, max_model_len=256, max_num_seqs=1,
                      enforce_eager=not compile_, **kw)
        except Exception as exc:  # vLLM's own path refusing the checkpoint is a result, not a crash
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            said = next((ln for ln in lines if "Value error" in ln), lines[-1] if lines else "")  # pydantic's
            return {"error": f"{type(exc).__name__}: {said}"[:300]}

        if contender == "plugin-layers":
            llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.model.quantplug_decode = None

        def run(n: int) -> list[int]:
            res = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=n,
                                                                              ignore_eos=True), use_tqdm=False)
            return list(res[0].outputs[0].token_ids)
    load_s = time.perf_counter() - t0
    run(4)  # warm-up
    times: dict[int, list[tuple[float, float]]] = {1: [], NEW: []}
    tokens: list[int] = []
    for _ in range(reps):
        for n in (1, NEW):
            t, c = time.perf_counter(), time.process_time()
            got = run(n)
            times[n].append((time.perf_counter() - t, time.process_time() - c))
            if n == NEW:
                tokens = got
    return {"load_s": load_s, "t1": times[1], "tnew": times[NEW], "tokens": tokens,
            "threads": torch.get_num_threads()}


def _spawn(contender: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", contender, path, "--dtype", args.dtype, "--reps", str(args.reps)]
    if args.compile:
        cmd.append("--compile")
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    last = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not last:
        tail = (res.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"worker exited {res.returncode}: {tail}"[:300]}
    out: dict[str, Any] = json.loads(last[-1])
    return out


def _rate(t1: list[list[float]], tnew: list[list[float]], i: int) -> float:
    d = min(t[i] for t in tnew) - min(t[i] for t in t1)
    return (NEW - 1) / d if d > 0 else float("nan")


def _same(tokens: list[int], ref: list[int]) -> str:
    if tokens == ref:
        return "same tokens as plugin"
    i = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
    return f"tokens part from plugin's at step {i}"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("labels", nargs="*", help="checkpoint labels of quantplug.testing.engines.EXPORTS")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per contender")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per process")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--compile", action="store_true", help="vLLM with torch.compile (slow warm-up)")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model size (see SIZES)")
    ap.add_argument("--keep", metavar="DIR", help="export into DIR (kept; reused when already there)")
    ap.add_argument("--worker", nargs=2, metavar=("CONTENDER", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.dtype, args.reps, args.compile)), flush=True)
        return
    if not args.labels:
        ap.error("name at least one checkpoint label")
    from quantplug.testing.engines import export_formats, mla_config

    contenders = [c for c in args.contenders.split(",") if c]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        # topk_method "noaux_tc", as DeepSeek-V3's release config says: vLLM's own path needs it
        # (without it vLLM has no e_score_correction_bias parameter: KeyError); quantplug ignores it
        have = {lb: os.path.join(root, lb) for lb in args.labels if os.path.exists(os.path.join(root, lb, "config.json"))}
        todo = [lb for lb in args.labels if lb not in have]
        paths = dict(have)
        if todo:
            paths.update(export_formats(root, mla_config(topk_method="noaux_tc", **SIZES[args.size]), only=todo))
        for label in args.labels:
            if label not in paths:
                print(f"{label}: not exported (its backend is not installed)", flush=True)
                continue
            runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
            for r in range(args.rounds):
                order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
                for c in order:
                    if runs[c] and "error" in runs[c][-1]:
                        continue  # refused once: refused every time
                    runs[c].append(_spawn(c, str(paths[label]), args))
            ref = next((x["tokens"] for x in runs.get("plugin", []) if "tokens" in x), None)
            for c, rs in runs.items():
                ok = [x for x in rs if "error" not in x]
                if not ok:
                    print(f"{label} {args.dtype} {c:9s}: {rs[0]['error'] if rs else 'not run'}", flush=True)
                    continue
                t1 = [t for x in ok for t in x["t1"]]
                tnew = [t for x in ok for t in x["tnew"]]
                per_round = sorted(_rate(x["t1"], x["tnew"], 0) for x in ok)
                same = "-" if ref is None else _same(ok[-1]["tokens"], ref)
                print(f"{label} {args.dtype} {c:9s}: decode {_rate(t1, tnew, 0):6.1f} tok/s wall best "
                      f"(per-process {per_round[0]:.1f}-{per_round[-1]:.1f}), {_rate(t1, tnew, 1):6.1f} tok/CPU-s; "
                      f"load {min(x['load_s'] for x in ok):.1f} s; threads {ok[0]['threads']}; "
                      f"{len(ok)} processes x {args.reps}; {same}", flush=True)


if __name__ == "__main__":
    main()
