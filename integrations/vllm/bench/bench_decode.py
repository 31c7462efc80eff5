"""Decode speed: vLLM (``load_format="quantplug"``) against quantplug's own ``generate`` on the same
tiny checkpoints (``quantplug.testing.engines``: DeepSeek's MLA dims, 3 layers, 8 experts).

    python integrations/vllm/bench/bench_decode.py --rounds 5 gguf-q4_0 fp8-block

Per round and side: greedy generation of 16 and of 64 new tokens from one 6-token prompt; decode
tokens/s = 48 / (t64 - t16) (the prefill and the first 16 steps cancel). Rounds alternate the
two sides; best and median are printed. vLLM runs in this process (no engine-core subprocess),
``enforce_eager=True`` unless ``--compile``, one sequence. Runs in the environment with vLLM.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import quantplug  # noqa: E402
import torch  # noqa: E402
from quantplug.testing.engines import export_formats  # noqa: E402

PROMPT = [1, 5, 9, 33, 100, 7]


def bench(label: str, path: str, dtype_name: str, rounds: int, compile_: bool) -> None:
    from vllm import LLM, SamplingParams

    dtype = getattr(torch, dtype_name)
    qp = quantplug.load(path, dtype=dtype, progress=False)
    llm = LLM(model=str(path), load_format="quantplug", quantization="quantplug", skip_tokenizer_init=True,
              dtype=dtype_name, max_model_len=256, max_num_seqs=1, enforce_eager=not compile_)

    def run_qp(n: int) -> float:
        t = time.perf_counter()
        qp.generate(torch.tensor([PROMPT]), n)
        return time.perf_counter() - t

    def run_vllm(n: int) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t

    rates: dict[str, list[float]] = {"quantplug": [], "vllm": []}
    run_qp(4), run_vllm(4)  # warm-up
    for _ in range(rounds):
        for side, run in (("quantplug", run_qp), ("vllm", run_vllm)):
            t16, t64 = run(16), run(64)
            rates[side].append(48 / max(t64 - t16, 1e-9))
    for side, r in rates.items():
        print(f"{label} {dtype_name} {side:9s}: decode {max(r):7.1f} tok/s best, {statistics.median(r):7.1f} median "
              f"({rounds} rounds)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("labels", nargs="+", help="checkpoint labels of quantplug.testing.engines.EXPORTS")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--compile", action="store_true", help="vLLM with torch.compile (slow warm-up)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        paths = export_formats(root, only=args.labels)
        for label in args.labels:
            bench(label, str(paths[label]), args.dtype, args.rounds, args.compile)


if __name__ == "__main__":
    main()
