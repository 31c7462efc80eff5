"""``tensor_parallel_size=2`` in vLLM's CPU build with ``load_format="quantplug"``: each of vLLM's
two workers loads its share through quantplug's tensor-parallel plan (MLA heads, MLPs column / row
parallel, vocabulary blocks; routed experts expert-parallel, which the loader turns on in vLLM),
reading only its bytes, and the greedy tokens equal the single-process ``quantplug generate``'s.

vLLM's CPU workers each bind their OpenMP threads to CPUs of their own; its automatic binding wants
a NUMA node per worker ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers" on a
one-node machine), so the engine is started with one CPU per rank given by hand
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``): skipped where fewer than
two CPUs are allowed.

Each case is its own vLLM engine in a child process (vLLM starts two worker processes; 60-100 s per
case on a busy 2-core machine, most of it vLLM's start and its workers' shutdown), so the default
run holds one (GGUF Q8_0); the float32 dense checkpoint, compressed-tensors W4A16 and the refusal of
a split that cuts FP8 blocks run with ``-m slow``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (bash .ci/run makes one)")

import quantplug  # noqa: E402
import torch  # noqa: E402
from quantplug.testing.engines import export_formats  # noqa: E402

PROMPT = [1, 5, 9, 33, 100, 7]
NEW = 16
TP = 2
#: the engine's whole life in the child: start, 16 tokens, shutdown
LIMIT_S = 420
CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))

pytestmark = pytest.mark.skipif(
    len(CPUS) < TP, reason=f"vLLM's CPU tensor parallel binds each of its {TP} workers' threads to a CPU of its own; "
                           f"this process may use {len(CPUS)} CPU(s)")

CHILD = """\
import json, sys
from vllm import LLM, SamplingParams

path, tp = sys.argv[1], int(sys.argv[2])
llm = LLM(model=path, load_format="quantplug", skip_tokenizer_init=True, dtype="float32", max_model_len=128,
          max_num_seqs=2, enforce_eager=True, quantization="quantplug", tensor_parallel_size=tp)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[3])}],
                   SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), ignore_eos=True), use_tqdm=False)
print("QUANTPLUG_TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
# an explicit shutdown that waits for the workers: at interpreter exit vLLM force-kills them after
# 5 s, which on a busy machine leaves its shared-memory all-reduce segments in /dev/shm (2 x 4 MiB)
llm.llm_engine.engine_core.shutdown(timeout=120)
"""


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The tiny model's export in format ``label`` (written on first use; skipped where its backend
    is not installed)."""
    root = tmp_path_factory.mktemp("tp")

    def get(label: str) -> Path:
        out = export_formats(root / label, only=[label])
        if label not in out:
            pytest.skip(f"the backend writing {label} is not installed")
        return out[label]

    return get


def _engine(path: Path) -> tuple[int, str]:
    """vLLM with ``tensor_parallel_size=2`` in a child process: (exit code, its stdout + stderr)."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="|".join(str(c) for c in CPUS[:TP]),
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="60")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(TP), json.dumps(PROMPT), str(NEW)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"vLLM with tensor_parallel_size={TP} did not finish within {LIMIT_S} s:\n{out[-4000:]}")
    return proc.returncode, out


def _tokens(out: str) -> list[int]:
    m = re.search(r"^QUANTPLUG_TOKENS (\[.*\])$", out, re.M)
    assert m, f"no tokens from vLLM:\n{out[-6000:]}"
    tokens: list[int] = json.loads(m.group(1))
    return tokens


def _equal_tokens_and_rank_bytes(path: Path) -> None:
    model = quantplug.load(path, dtype=torch.float32, progress=False)
    want = model.generate(torch.tensor([PROMPT]), NEW)[0, len(PROMPT):].tolist()
    del model
    code, out = _engine(path)
    assert code == 0, out[-6000:]
    assert _tokens(out) == want
    # each rank read its share of the plan, from headers alone the same for every run
    planned = quantplug.plan(path, world_size=TP).parallel
    read = {int(r): int(n) for r, n in re.findall(rf"tensor-parallel rank (\d) of {TP} read (\d+) bytes", out)}
    assert read == dict(enumerate(planned.rank_bytes)), out[-6000:]
    whole = planned.replicated_bytes + planned.sharded_bytes
    print(f"{path.name}: tensor_parallel_size={TP}: bytes read per rank {planned.rank_bytes} of {whole}")
    assert all(n < whole for n in read.values())
    # quantplug's whole-stack decode step is declined under TP (vLLM's layers decode), said at load
    assert "whole-stack native step is declined" in out
    assert "expert parallel on" in out


def test_tensor_parallel_gguf_q8_0(export: Callable[[str], Path]) -> None:
    _equal_tokens_and_rank_bytes(export("gguf-q8_0"))


@pytest.mark.slow
@pytest.mark.parametrize("label", ["dense", "compressed-tensors-w4a16"])
def test_tensor_parallel_more_formats(export: Callable[[str], Path], label: str) -> None:
    _equal_tokens_and_rank_bytes(export(label))


@pytest.mark.slow
def test_tensor_parallel_split_cutting_blocks_is_refused(export: Callable[[str], Path]) -> None:
    """The tiny model's shared experts (intermediate 128) in 128-blocks of FP8: a 2-way split cuts
    the blocks, so quantplug's plan would keep them whole on each rank; vLLM splits them, so the
    load is refused, naming the layers and why."""
    code, out = _engine(export("fp8-block"))
    assert code != 0
    assert "model.layers.1.mlp.shared_experts" in out and "would cut its 128-feature blocks" in out, out[-6000:]
