"""Tensor / expert parallelism for the Kimi family (Kimi-K3 and Kimi-Linear): gloo on CPU, ranks
spawned as subprocesses by test_parallel.py's harness (worker.py).

At 2 and 4 ranks (4: with the slow tests) every rank's logits equal the single-process logits within rel 1e-5 (a prompt of
70 tokens: KDA's chunked form across a chunk boundary), greedy decoding with the cache gives the
single process's tokens, each rank reads only its planned bytes, and the split is the declared one:
KDA by head (q / k / v, f_b_proj, the output gate and b_proj column-parallel; the convolutions,
dt_bias and A_log by head; o_proj row-parallel), MLA by head, routed experts expert-parallel with
the latent partial sums reduced before routed_expert_norm, dense MLPs and shared experts by
feature.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import quantplug
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from kimi_models import k3_config, kimi_linear_config, kimi_state, release_dtypes, write_k3_release  # noqa: E402
from quantplug.testing import write_checkpoint  # noqa: E402
from test_parallel import TOL, WORKER, _free_port  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GEN = 5


def spawn(world: int, cases: list[dict], out: Path, timeout: float = 600) -> list[list[dict]]:
    """test_parallel.py's ``spawn``, every rank's output drained while they run (a rank blocked on
    a full pipe would hold the others in a collective) and every failing rank's log shown."""
    import json
    import os
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    out.mkdir(parents=True, exist_ok=True)
    (out / "cases.json").write_text(json.dumps(cases))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out / "cases.json"), str(out)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        with ThreadPoolExecutor(world) as pool:
            logs = list(pool.map(lambda p: p.communicate(timeout=timeout)[0], procs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [f"rank {r} exited {p.returncode}:\n{logs[r][-3000:]}" for r, p in enumerate(procs) if p.returncode]
    assert not bad, "\n".join(bad)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _cases(root: Path) -> list[dict]:
    made = {
        "k3": write_checkpoint(root / "k3", k3_config(), kimi_state(k3_config(), seed=31)),
        # the release's dtypes: bfloat16, float32 convolutions / dt_bias / A_log (read as slices too)
        "k3-release-dtypes": write_checkpoint(root / "k3-bf16", k3_config(),
                                              release_dtypes(kimi_state(k3_config(), seed=32))),
        "kimi-linear": write_checkpoint(root / "kl", kimi_linear_config(), kimi_state(kimi_linear_config(), seed=33)),
        # A_log as sglang reads K3's: [head_dim], of which the first H entries are the heads'
        "k3-a-log-head-dim": write_checkpoint(root / "k3-alog", k3_config(),
                                              kimi_state(k3_config(), seed=35, a_log="head_dim")),
        # the release's format: compressed-tensors mxfp4-pack-quantized experts, expert-parallel
        "k3-release-mxfp4": write_k3_release(root / "k3-mxfp4", k3_config(), kimi_state(k3_config(), seed=34))[0],
    }
    cases = []
    for name, path in made.items():
        model = quantplug.load(path, progress=False)
        ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            logits = model(ids)
        gen = model.generate(ids[:1, :6], GEN, eos_token_id=None)
        ref = root / f"{name}.ref.safetensors"
        save_file({"ids": ids, "logits": logits.contiguous()}, str(ref))
        cases.append({"name": name, "path": str(path), "options": {}, "ref": str(ref), "generate": GEN,
                      "want_generated": gen.tolist(), "weight_bytes": model.load_report["bytes_read"]})
    return cases


@pytest.fixture(scope="module")
def kimi_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-kimi")
    cases = _cases(root)
    runs: dict = {"cases": cases}

    def get(world: int) -> list[list[dict]]:
        if world not in runs:
            runs[world] = spawn(world, cases, root / f"run{world}")
        return runs[world]

    runs["get"] = get
    return runs


def _recs(kimi_runs, world: int, name: str) -> list[dict]:
    out = []
    for rank, results in enumerate(kimi_runs["get"](world)):
        rec = next(r for r in results if r["name"] == name)
        assert "crash" not in rec, rec["crash"]
        assert "error" not in rec, f"rank {rank}: {rec['error']}"
        out.append(rec)
    return out


NAMES = ["k3", "k3-release-dtypes", "kimi-linear", "k3-a-log-head-dim", "k3-release-mxfp4"]


#: 4 ranks only with the slow tests, as test_parallel.py's (four processes on a shared 2-core machine)
WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", NAMES)
def test_every_rank_matches_single_process(kimi_runs, world, name):
    case = next(c for c in kimi_runs["cases"] if c["name"] == name)
    for rank, rec in enumerate(_recs(kimi_runs, world, name)):
        assert rec["rel_err"] <= TOL, f"rank {rank}: rel err {rec['rel_err']:.2e}"
        assert rec["generated"] == case["want_generated"], rank
        par = rec["parallel"]
        assert par["world_size"] == world and par["rank"] == rank
        # each rank reads only its byte ranges: the plan's figure, about 1/world of the split bytes
        assert rec["report"]["bytes_read"] == par["rank_bytes"][rank]
        assert par["replicated_bytes"] + par["sharded_bytes"] == case["weight_bytes"]
        assert par["rank_bytes"][rank] <= 1.05 * (par["replicated_bytes"] + par["sharded_bytes"] / world)
        assert par["sharded_bytes"] > 0.7 * case["weight_bytes"]
        assert 0 < rec["rchar"] <= par["rank_bytes"][rank] + 128 * 1024


@pytest.mark.parametrize("name", ["k3", "kimi-linear"])
def test_split_is_the_declared_one(kimi_runs, name):
    pre = "language_model." if name == "k3" else ""
    recs = _recs(kimi_runs, 2, name)
    dec = {d["target"].removeprefix(pre): d for d in recs[1]["parallel"]["decisions"]}
    kda, mla = "model.layers.0.self_attn", "model.layers.3.self_attn"
    gate = ("g_proj",) if name == "k3" else ("g_b_proj",)
    for proj in ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", *gate):
        assert dec[f"{kda}.{proj}"]["value"] == "column-parallel", proj
    assert dec[f"{kda}.b_proj"]["reason"] == "out features split [2, 2]"  # one feature per head
    assert dec[f"{kda}.o_proj"]["value"] == "row-parallel"
    for param in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "dt_bias", "A_log"):
        assert dec[f"{kda}.{param}"]["value"] == "head-parallel", param
    for proj in ("f_a_proj", "g_a_proj", "q_a_proj", "kv_a_proj_with_mqa", "routed_expert_down_proj"):
        assert not any(t.endswith(f".{proj}") for t in dec), proj  # replicated: no decision, read whole
    assert dec[f"{mla}.kv_b_proj"]["value"] == "column-parallel" and dec[f"{mla}.o_proj"]["value"] == "row-parallel"
    assert dec["model.layers.1.block_sparse_moe.experts"]["value"] == "expert-parallel"
    assert dec["model.layers.1.block_sparse_moe.shared_experts.down_proj"]["value"] == "row-parallel"
    assert dec["model.layers.0.mlp.gate_proj"]["value"] == "column-parallel"


def test_kda_holds_this_ranks_heads(tmp_path):
    """Headers only (no ranks started): rank 1 of 2 plans KDA's 2 of 4 heads, every per-head
    tensor read as its slice: conv channels [64:128], dt_bias [64:128], A_log entries [2:4]."""
    path = write_checkpoint(tmp_path / "k3", k3_config(), kimi_state(k3_config()))
    p = quantplug.plan(path, world_size=2, rank=1)
    kda = p.model.language_model.model.layers[1].self_attn
    assert (kda.heads, kda.dim, kda.all_heads, kda.q_conv1d.channels) == (2, 64, 4, 64)
    src = {pp.param.removeprefix("language_model."): pp.sources[0][0].slices for pp in p.params}
    a = "model.layers.1.self_attn"
    assert src[f"{a}.q_conv1d.weight"] == ((0, 64, 64),)
    assert src[f"{a}.dt_bias"] == ((0, 64, 64),)
    assert src[f"{a}.A_log"] == ((0, 2, 2),)
    assert src[f"{a}.b_proj.weight"] == ((0, 2, 2),)
    assert src[f"{a}.o_proj.weight"] == ((1, 64, 64),)
    assert src[f"{a}.f_a_proj.weight"] is None


def test_k3_a_log_of_head_dim_entries_reads_the_heads_entries(tmp_path):
    """K3's A_log stored [head_dim] (sglang's reading: the first H entries are the heads'): rank 1
    of 2 reads entries [2, 4), none of the rest."""
    path = write_checkpoint(tmp_path / "k3", k3_config(), kimi_state(k3_config(), a_log="head_dim"))
    p = quantplug.plan(path, world_size=2, rank=1)
    pp = next(pp for pp in p.params if pp.param == "language_model.model.layers.0.self_attn.A_log")
    assert pp.sources[0][1].shape == (32,) and pp.sources[0][0].slices == ((0, 2, 2),) and pp.shape == (2,)


def test_kimi_linear_a_log_head_axis(tmp_path):
    """Kimi-Linear stores A_log [1, 1, H, 1]: the head axis is its third."""
    path = write_checkpoint(tmp_path / "kl", kimi_linear_config(), kimi_state(kimi_linear_config()))
    p = quantplug.plan(path, world_size=4, rank=3)
    pp = next(pp for pp in p.params if pp.param == "model.layers.0.self_attn.A_log")
    assert pp.sources[0][0].slices == ((2, 3, 1),) and pp.shape == (1, 1, 1, 1)
