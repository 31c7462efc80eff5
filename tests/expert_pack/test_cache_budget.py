"""expert_cache_mb is a core option (issue 22): 0, the default, keeps every expert of a pack in
memory once read (the pack's whole size as the budget); a positive value is the LRU budget in MiB."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import quantplug
import torch
from quantplug.api import stats_sources
from quantplug.errors import PlanError

sys.path.insert(0, str(Path(__file__).parents[1]))
from fuzz import kit  # noqa: E402


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return kit.packed(tmp_path_factory.mktemp("p") / "pack")


def test_default_budget_holds_every_expert(pack_dir):
    model = quantplug.load(pack_dir, progress=False)
    pack = model.quantplug_plan.quant_config.pack
    stats = stats_sources(model)["expert_cache"].stats()
    assert model.quantplug_plan.options["expert_cache_mb"] == 0.0
    assert stats["slots"] == len(pack.layers) * pack.n_experts  # one slot per expert: nothing evicted
    with torch.no_grad():
        model(kit.IDS)
        model(kit.IDS)
    assert stats_sources(model)["expert_cache"].stats()["evictions"] == 0


def test_a_positive_budget_is_an_lru_of_that_size(pack_dir):
    model = quantplug.load(pack_dir, progress=False, options={"expert_cache_mb": 0.05})
    stats = stats_sources(model)["expert_cache"].stats()
    assert stats["budget_bytes"] == int(0.05 * 2**20) and stats["slots"] < 24


def test_experts_in_memory_larger_than_the_machine_is_a_plan_problem(pack_dir, monkeypatch):
    import quantplug_expert_pack as ep

    monkeypatch.setattr(ep, "_memory_bytes", lambda: 1 << 10)
    with pytest.raises(PlanError, match=r"expert_cache_mb = 0 \(experts in memory\) needs .* GiB for the pack's "
                                        r"experts, more than this machine's"):
        quantplug.plan(pack_dir)
    assert quantplug.plan(pack_dir, options={"expert_cache_mb": 1}).backend == "expert_pack"
