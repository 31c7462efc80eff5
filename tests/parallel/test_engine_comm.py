"""A load under an engine's tensor parallelism (``quantplug.parallel.EngineComm``, the vLLM plugin's
``tensor_parallel_size`` > 1): each rank's planned modules compute its partial products, the
engine runs the collectives. Both ranks' shares are loaded here in one process (a world-1 gloo
group carries the load's agreement; the shares are rank 0 and rank 1 of 2), and what an engine
would do with them (concatenate column outputs, sum row and expert partials, look up rank-local
ids) equals the unsplit model's projections."""

from __future__ import annotations

from pathlib import Path

import pytest
import quantplug
import torch
import torch.distributed as dist
from quantplug.bridge import planned_modules
from quantplug.errors import ParallelError, QuantplugError
from quantplug.parallel import Comm, EngineComm, resolve_group
from quantplug.testing import random_state, tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config()
    return write_checkpoint(tmp_path_factory.mktemp("engine-tp") / "c", cfg, random_state(cfg))


@pytest.fixture(scope="module")
def group():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def test_engine_comm_leaves_collectives_to_the_engine() -> None:
    comm = EngineComm(2, 1)
    t = torch.ones(3)
    assert comm.all_reduce(t) is t
    with pytest.raises(ParallelError, match="the engine gathers"):
        comm.all_gather(t, [3, 3])
    assert resolve_group(comm) is comm and resolve_group(EngineComm(1, 0)) is None


def test_ranks_shares_compose_to_the_unsplit_projections(ckpt: Path, group: None) -> None:
    torch.manual_seed(0)
    whole = planned_modules(quantplug.load(ckpt, progress=False))
    ranks = [quantplug.load(ckpt, progress=False, group=EngineComm(2, r)) for r in range(2)]
    shares = [planned_modules(m) for m in ranks]
    assert [m.load_report["bytes_read"] for m in ranks] == quantplug.plan(ckpt, world_size=2).parallel.rank_bytes
    x = torch.randn(5, 64)
    with torch.no_grad():
        # column-parallel (MLA heads' q_b_proj, the gate / up of an MLP): this rank's output rows
        name = "model.layers.0.self_attn.q_b_proj"
        xq = torch.randn(5, 48)
        q = whole[name].fn(xq)
        parts = [s[name].fn(xq) for s in shares]
        assert [s[name].shard for s in shares] == [(0, q.shape[-1] // 2), (q.shape[-1] // 2, q.shape[-1] // 2)]
        torch.testing.assert_close(torch.cat(parts, -1), q, rtol=1e-5, atol=1e-6)
        # row-parallel (o_proj, down_proj): partial sums of this rank's input slice
        for name in ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
            full_in = whole[name].in_features
            xi = torch.randn(5, full_in)
            half = full_in // 2
            got = sum(s[name].fn(xi[:, r * half:(r + 1) * half]) for r, s in enumerate(shares))
            torch.testing.assert_close(got, whole[name].fn(xi), rtol=1e-5, atol=1e-5)
        # routed experts: each rank its block of experts (global ids), the engine sums
        name = "model.layers.1.mlp.experts"
        ids = torch.tensor([[0, 5], [3, 7], [6, 1], [2, 4], [7, 0]])
        w = torch.rand(5, 2)
        got = sum(s[name].fn(x, ids, w) for s in shares)
        torch.testing.assert_close(got, whole[name].fn(x, ids, w), rtol=1e-5, atol=1e-5)
        # vocab-parallel embedding: the engine hands rank-local ids of the rank's rows
        emb = "model.embed_tokens"
        assert [s[emb].shard for s in shares] == [(0, 80), (80, 80)]
        ids1 = torch.tensor([3, 79, 80, 159])
        rows = [shares[0][emb].fn(ids1[:2]), shares[1][emb].fn(ids1[2:] - 80)]
        torch.testing.assert_close(torch.cat(rows), whole[emb].fn(ids1))
        # lm_head: this rank's block of the logits (the engine gathers)
        parts = [s["lm_head"].fn(x) for s in shares]
        assert [p.shape[-1] for p in parts] == [80, 80]
        torch.testing.assert_close(torch.cat(parts, -1), whole["lm_head"].fn(x), rtol=1e-5, atol=1e-5)


def test_quantplug_own_tensor_parallel_is_refused(ckpt: Path, group: None) -> None:
    """A model split with quantplug's own collectives is not an engine's (its forward reduces)."""
    model = quantplug.load(ckpt, progress=False, group=Comm(2, 0))
    with pytest.raises(QuantplugError, match="split by quantplug's own tensor parallelism"):
        planned_modules(model)
