"""Kimi-K3's routed experts served from the checkpoint's files (load option ``expert_cache_mb``,
docs/experts.md): the latent experts (they read ``routed_expert_down_proj``'s output, and their
weighted sum goes through ``routed_expert_norm``) give the in-memory load's logits and greedy
tokens, float32 and in the release's format (compressed-tensors MXFP4 experts); and the process
grows by the non-expert weights plus the cache (+10%, + 24 MiB of allocator / reader-thread
arenas), the bound docs/experts.md states and tests/test_expert_store.py checks for DeepSeek."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import quantplug
import torch
from kimi_models import k3_config, kimi_state, release_dtypes, write_k3_release
from quantplug import experts
from quantplug.api import stats_sources
from quantplug.testing import write_checkpoint
from quantplug.testing.reference import rel_err

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fmt", ["float32", "release-mxfp4"])
def test_served_latent_experts_equal_in_memory(tmp_path, fmt):
    cfg, state = k3_config(), kimi_state(k3_config(), seed=61)
    if fmt == "float32":
        path = write_checkpoint(tmp_path / "k3", cfg, state)
    else:
        pytest.importorskip("compressed_tensors")
        path = write_k3_release(tmp_path / "k3", cfg, state)[0]
    mem = quantplug.load(path, progress=False)
    budget = 0.05  # MiB: under the 4 layers' experts (0.4 MiB)
    served = quantplug.load(path, progress=False, options={"expert_cache_mb": budget})
    stores = [m for m in served.modules() if getattr(m, "qp_store", None) is not None]
    text = cfg["text_config"]
    assert len(stores) == text["num_hidden_layers"] - 1  # every MoE layer
    assert all(s.gate_proj.in_features == text["routed_expert_hidden_size"] for s in stores)  # the latent width
    assert served.load_report["experts_on_demand_bytes"] > 0
    with torch.no_grad():  # 1.3e-6 seen: the served experts run the native SiTU MLP step
        assert rel_err(served(IDS), mem(IDS)) <= 1e-5
    want = mem.generate(IDS[:1, :5], 6, eos_token_id=None)
    assert torch.equal(served.generate(IDS[:1, :5], 6, eos_token_id=None), want)
    st = stats_sources(served)["expert_cache"].stats()
    assert st["misses"] > 0 and st["peak_bytes"] <= st["budget_bytes"]


RSS_CHILD = textwrap.dedent("""
    import json, sys, torch, quantplug
    from quantplug.api import stats_sources

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    path, mb, warm = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    quantplug.load(warm, progress=False)(torch.tensor([[1, 2, 3]]))  # libraries and arenas warmed elsewhere
    base = rss()
    model = quantplug.load(path, progress=False, options={"expert_cache_mb": mb} if mb else {})
    after_load = rss()
    ids = torch.tensor([[3, 17, 42, 99, 5, 7, 11, 13]])
    with torch.no_grad():
        for _ in range(2):
            model(ids)
    model.generate(ids, max_new_tokens=6, eos_token_id=None)
    peak = rss()
    cache = stats_sources(model).get("expert_cache")
    print(json.dumps({"base": base, "after_load": after_load, "peak": peak,
                      "cache_used": cache.used if mb else 0}))
""")


# a benchmark of two child processes (~14 s): the DeepSeek-V3 GGUF case in tests/test_expert_store.py
# measures the same store's memory bound by default; served = in-memory is checked above
@pytest.mark.slow
def test_rss_is_the_non_expert_weights_plus_the_cache(tmp_path):
    """A K3 whose latent experts are ~150 MB (bfloat16, the release's dtypes otherwise): served
    with a cache of 1.5 steps, the process grows by at most the non-expert weights + the cache
    (+10%, + 24 MiB); the in-memory load grows past that bound by the experts."""
    cfg = k3_config(hidden_size=256, intermediate_size=512, moe_intermediate_size=512, num_experts=32,
                    routed_expert_hidden_size=512, vocab_size=256, q_lora_rank=64, kv_lora_rank=64)
    cfg["text_config"]["linear_attn_config"]["head_dim"] = 64
    path = write_checkpoint(tmp_path / "big", cfg, release_dtypes(kimi_state(cfg, seed=62)))
    warm = write_checkpoint(tmp_path / "warm", k3_config(), release_dtypes(kimi_state(k3_config(), seed=63)))
    plan = quantplug.plan(path)
    expert_bytes = sum(pp.nbytes for pp in plan.params if ".experts." in pp.param and getattr(
        pp.module, "qp_stacked", False))
    other = sum(pp.nbytes for pp in plan.params) - expert_bytes
    mb = max(8.0, 1.5 * experts.step_bytes(plan) / (1 << 20))
    bound = 1.1 * (other + mb * (1 << 20)) + (24 << 20)
    assert expert_bytes > 2 * bound, (expert_bytes, other)

    def child(mb: float) -> dict:
        out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(path), str(mb), str(warm)], capture_output=True,
                             text=True, timeout=600, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    served = child(mb)
    assert served["cache_used"] <= mb * (1 << 20)
    assert served["after_load"] - served["base"] <= bound, (served, bound)
    assert served["peak"] - served["base"] <= bound, (served, bound)
    in_memory = child(0)
    assert in_memory["peak"] - in_memory["base"] > expert_bytes, in_memory  # the bound is one that can fail
