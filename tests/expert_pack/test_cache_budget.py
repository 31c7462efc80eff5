"""One expert cache (issue 33 item 2): the routed experts of a version-1 (GGUF) expert pack are the
checkpoint's per-expert tensors, loaded into memory or served by the core's expert cache
(``quantplug.experts``) like every other format's. ``expert_cache_mb`` = 0, the default, means the
same as everywhere: every expert in memory, read at load and checked against the machine's
available memory at plan time; a positive value is the core cache's budget (one step of a layer at
least), ``expert_prefetch`` and ``expert_readers`` act on it, and its counters appear once, under
``expert_cache``."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import quantplug
import torch
from quantplug import experts
from quantplug.api import stats_sources
from quantplug.errors import PlanError

sys.path.insert(0, str(Path(__file__).parents[1]))
from fuzz import kit  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("p")
    return kit.gguf(root / "plain"), kit.packed(root / "pack")


def _greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    return model.generate(ids, max_new_tokens=steps, eos_token_id=None)[0, ids.shape[1]:].tolist()


def _stores(model) -> list:
    return [m.qp_store for m in model.modules() if getattr(m, "qp_store", None) is not None]


def test_default_budget_loads_every_expert_into_memory(dirs):
    """expert_cache_mb = 0: the pack's experts are read at load into the stacked layers (as a GGUF's
    own ``*_exps`` or any format's experts are), no cache exists, and the logits are the plain
    GGUF's bit for bit."""
    plain, pack = dirs
    model = quantplug.load(pack, progress=False)
    plan = model.quantplug_plan
    assert plan.options["expert_cache_mb"] == 0.0 and not _stores(model)
    assert "expert_cache" not in stats_sources(model)  # nothing serves experts at run time
    routed = [pp for pp in plan.params if ".mlp.experts." in pp.param]
    assert routed and all(info.file.name == "experts.qpack" for pp in routed for _, info in pp.sources)
    assert model.load_report["experts_on_demand_bytes"] == 0
    assert all(lin.weight.dtype == torch.uint8 and lin.weight.shape[0] == 8
               for m in model.modules() if type(m).__name__ == "Experts"
               for lin in (m.gate_proj, m.up_proj, m.down_proj))
    same = quantplug.load(plain, progress=False)  # the GGUF before `expert-pack build`: the same meaning of 0
    assert not _stores(same) and "expert_cache" not in stats_sources(same)
    assert same.load_report["experts_on_demand_bytes"] == 0
    assert same.load_report["bytes_read"] == model.load_report["bytes_read"]  # every expert byte read at load
    with torch.no_grad():
        assert torch.equal(model(kit.IDS), same(kit.IDS))


def test_a_small_budget_serves_the_pack_through_the_core_cache(dirs):
    """A budget of 1.5 steps: every MoE layer is served by the core's store, the pack's payloads
    are read on demand (none at load), resident experts stay within the budget, and the logits and
    greedy tokens equal the all-in-memory load's."""
    plain, pack = dirs
    ref = quantplug.load(pack, progress=False)
    need = experts.step_bytes(ref.quantplug_plan)
    served = quantplug.load(pack, progress=False, options={"expert_cache_mb": 1.5 * need / (1 << 20)})
    stores = _stores(served)
    assert len(stores) == 2 and all(s.ckpt.packs for s in stores)
    assert served.load_report["experts_on_demand_bytes"] > 0
    cache = stats_sources(served)["expert_cache"]
    assert isinstance(cache, experts.ExpertCache) and cache.stats()["bytes_read"] == 0
    with torch.no_grad():
        assert torch.equal(served(kit.IDS), ref(kit.IDS))
    assert _greedy(served, kit.IDS, 6) == _greedy(ref, kit.IDS, 6) == _greedy(
        quantplug.load(plain, progress=False), kit.IDS, 6)
    st = cache.stats()
    assert st["expert_reads"] > 0 and st["evictions"] > 0
    assert st["resident_bytes"] <= st["budget_bytes"] and st["peak_bytes"] <= st["budget_bytes"]
    # the counters appear once: the core's cache, exposed by the loader (the backend exposes none)
    assert list(stats_sources(served)) == ["expert_cache"]


def test_expert_prefetch_is_honoured_on_a_pack(dirs):
    _, pack = dirs
    mb = 4 * experts.step_bytes(quantplug.plan(pack)) / (1 << 20)
    on = quantplug.load(pack, progress=False, options={"expert_cache_mb": mb})
    off = quantplug.load(pack, progress=False, options={"expert_cache_mb": mb, "expert_prefetch": False})
    assert _greedy(on, kit.IDS[:, :2], 8) == _greedy(off, kit.IDS[:, :2], 8)
    s_on, s_off = stats_sources(on)["expert_cache"].stats(), stats_sources(off)["expert_cache"].stats()
    assert s_off["prefetched"] == 0 and s_on["prefetched"] > 0
    assert s_on["requests"] == s_off["requests"]


@pytest.mark.parametrize("readers", [1, 3])
def test_expert_readers_is_honoured_on_a_pack(dirs, monkeypatch, readers):
    """The missing experts of a step are read by ``expert_readers`` threads: a prompt routed to
    many experts of a layer submits them together, and exactly that many reader threads read."""
    _, pack = dirs
    names: set[str] = set()
    real = experts.ExpertStore.build

    def build(self, slot):
        names.add(threading.current_thread().name)
        return real(self, slot)

    monkeypatch.setattr(experts.ExpertStore, "build", build)
    model = quantplug.load(pack, progress=False, options={"expert_cache_mb": 1, "expert_readers": readers,
                                                          "expert_prefetch": False})
    ids = torch.arange(0, 160, 5).unsqueeze(0)  # 32 tokens: most of a layer's 8 experts
    with torch.no_grad():
        model(ids)
    assert len(names) == readers and all(n.startswith("quantplug-experts") for n in names)


def test_a_budget_below_one_step_is_the_core_plan_error(dirs):
    _, pack = dirs
    need = experts.step_bytes(quantplug.plan(pack))
    with pytest.raises(PlanError, match=r"expert_cache_mb = .* MiB holds less than one step's routed experts of a "
                                        r"layer: 2 experts of .* MiB each"):
        quantplug.plan(pack, options={"expert_cache_mb": 0.9 * need / (1 << 20)})
    assert not quantplug.plan(pack, options={"expert_cache_mb": need / (1 << 20)}).problems


def test_experts_in_memory_larger_than_available_memory_is_the_core_plan_error(dirs, monkeypatch):
    from quantplug import memory

    _, pack = dirs
    monkeypatch.setattr(memory, "available_memory", lambda: 4096)
    with pytest.raises(PlanError, match=r"loading copies .* GiB into memory .* but this machine has .* GiB available: "
                                        r"set expert_cache_mb"):
        quantplug.plan(pack)
    assert quantplug.plan(pack, options={"expert_cache_mb": 1}).backend == "expert_pack"
