"""Kimi-Linear and the released Kimi-K3 (core/models/kimi.py) against references nobody here wrote
into the model: transformers 5.24's ``KimiLinearForCausalLM`` (float32) for Kimi-Linear, and for K3
the independent plain-torch reference of ``tests/kimi_reference.py`` (written from the formulas,
itself checked against transformers' Kimi-Linear and GLM-5-Next KDA in test_kimi_reference.py).

Prompts are longer than one KDA chunk (64 tokens), so the chunked prompt form and the chunk carry
are exercised; decode steps run the recurrent form. Each K3 feature (attention residuals with a
block size below the depth, the latent norm, the bounded gate, the full-rank gate, the SiTU
constants) is shown to matter: the same weights loaded with that feature altered in config.json
miss the reference, so the parity test cannot pass with the feature removed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import kimi_reference as kr
import pytest
import quantplug
import torch
from conftest import rel_err
from quantplug.errors import ConfigError, PlanError
from quantplug.generate import GenerationError, new_cache
from quantplug.models.kimi import KDA, HybridCache, KDAState, chunk_kda, l2norm, recurrent_kda
from quantplug.testing.kimi import (
    kimi_k3_config,
    kimi_k3_state,
    kimi_linear_config,
    kimi_linear_hf_checkpoint,
    kimi_linear_state,
    release_dtypes,
    write_kimi_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

T_LONG = 70   # > one KDA chunk
STEPS = 6
TOL = 1e-5


def _ids(vocab: int, t: int, batch: int = 1, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    cfg = kimi_linear_config()
    path, hf = kimi_linear_hf_checkpoint(tmp_path_factory.mktemp("kl") / "kimi-linear", cfg)
    return path, hf, cfg


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    cfg = kimi_k3_config()
    state = kimi_k3_state(cfg, seed=1)
    path = write_kimi_checkpoint(tmp_path_factory.mktemp("k3") / "k3", cfg, state)
    return path, cfg, state


# ---------------------------------------------------------------------------------------------
# Kimi-Linear against transformers
# ---------------------------------------------------------------------------------------------

def test_kimi_linear_prompt_matches_transformers(kimi_linear):
    path, hf, cfg = kimi_linear
    plan = quantplug.plan(path)
    assert not plan.problems and plan.architecture == "KimiLinearForCausalLM"
    m = quantplug.load(path)
    ids = _ids(cfg["vocab_size"], T_LONG, batch=2)
    with torch.no_grad():
        ours, ref = m(ids), hf(ids).logits
    assert rel_err(ours, ref) <= TOL


def test_kimi_linear_decode_steps_and_greedy_match_transformers(kimi_linear):
    path, hf, cfg = kimi_linear
    m = quantplug.load(path)
    prompt = _ids(cfg["vocab_size"], T_LONG)
    with torch.no_grad():
        out = m.generate(prompt, max_new_tokens=STEPS, do_sample=False)
        seq = out if out.dim() == 2 else out.sequences
        ref_seq = hf.generate(prompt, max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS)
        assert torch.equal(seq, ref_seq[:, :seq.shape[1]])
        # every decode step's logits (cache, recurrent KDA) against transformers' full forward
        lm = m.text_lm()
        cache = new_cache(lm, 1, T_LONG + STEPS)
        lm.next_logits(prompt, cache)
        full = hf(seq).logits
        for j in range(STEPS):
            pos = T_LONG + j
            step = lm.next_logits(seq[:, pos:pos + 1], cache)
            assert rel_err(step, full[:, pos]) <= TOL, f"decode step {j}"


# ---------------------------------------------------------------------------------------------
# Kimi-K3 against the independent reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a_log", ["heads", "head_dim"])
def test_k3_matches_the_reference(tmp_path, a_log):
    cfg = kimi_k3_config()
    state = kimi_k3_state(cfg, seed=1, a_log=a_log, vision=True)
    path = write_kimi_checkpoint(tmp_path / "k3", cfg, state)
    plan = quantplug.plan(path)
    assert not plan.problems and plan.architecture == "KimiK3ForConditionalGeneration"
    assert {n for names in plan.skipped.values() for n in names} == {n for n in state if n.startswith(
        ("vision_tower.", "mm_projector."))}
    m = quantplug.load(path)
    ids = _ids(cfg["text_config"]["vocab_size"], T_LONG, batch=2)
    with torch.no_grad():
        assert rel_err(m(ids), kr.k3_logits(cfg, state, ids)) <= TOL


def test_k3_cache_equals_recompute_and_greedy_is_the_references(k3):
    path, cfg, state = k3
    m = quantplug.load(path)
    lm = m.text_lm()
    vocab = cfg["text_config"]["vocab_size"]
    prompt = _ids(vocab, T_LONG, seed=5)
    with torch.no_grad():
        seq = m.generate(prompt, max_new_tokens=STEPS, do_sample=False)
        seq = seq if seq.dim() == 2 else seq.sequences
        ref = kr.k3_logits(cfg, state, seq)
        assert torch.equal(seq[0, T_LONG:], ref[0, T_LONG - 1:-1].argmax(-1))
        cache = new_cache(lm, 1, T_LONG + STEPS)
        assert isinstance(cache, HybridCache)
        assert rel_err(lm.next_logits(seq[:, :40], cache), ref[:, 39]) <= TOL
        assert rel_err(lm(seq[:, 40:T_LONG], None, cache)[:, -1], ref[:, T_LONG - 1]) <= TOL  # chunk after cache
        for pos in range(T_LONG, seq.shape[1]):
            assert rel_err(lm.next_logits(seq[:, pos:pos + 1], cache), ref[:, pos]) <= TOL
        kda = [c for c in cache.layers if isinstance(c, KDAState)]
        assert kda and all(c.length == seq.shape[1] for c in cache.layers)
        assert cache.bytes_per_token() > 0 and cache.state_bytes() == sum(c.nbytes() for c in kda)


#: each K3 feature, altered in config.json: the same weights then miss the reference
ALTERED = {
    "residual block size": {"attn_res_block_size": 3},
    "no attention residuals": {"attn_res_block_size": None},
    "latent norm off": {"latent_moe_use_norm": False},
    "softplus gate instead of the bounded one": {"linear_attn_config.gate_lower_bound": None},
    "gate bound": {"linear_attn_config.gate_lower_bound": -3.0},
    "SiTU beta": {"activation_situ_beta": 8.0},
    "SiTU linear beta": {"activation_situ_linear_beta": None},
    "SiLU instead of SiTU": {"hidden_act": "silu"},
}


@pytest.mark.parametrize("what", sorted(ALTERED))
def test_each_k3_feature_decides_the_logits(tmp_path, k3, what):
    path, cfg, state = k3
    bad = copy.deepcopy(cfg)
    for key, value in ALTERED[what].items():
        target = bad["text_config"]
        if key.startswith("linear_attn_config."):
            target, key = target["linear_attn_config"], key.split(".", 1)[1]
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    # a feature switched off leaves its weights unexpected (a plan error): drop them too
    if what == "latent norm off":
        state = {k: v for k, v in state.items() if ".routed_expert_norm." not in k}
    if what == "no attention residuals":
        state = {k: v for k, v in state.items() if "_res_" not in k}
    alt = write_kimi_checkpoint(tmp_path / "alt", bad, state)
    ids = _ids(cfg["text_config"]["vocab_size"], 24)
    with torch.no_grad():
        good = quantplug.load(path)(ids)
        ref = kr.k3_logits(cfg, k3[2], ids)
        assert rel_err(good, ref) <= TOL
        assert rel_err(quantplug.load(alt)(ids), ref) > 1e-3, what


def test_k3_without_the_full_rank_gate_needs_the_low_rank_one(tmp_path, k3):
    path, cfg, state = k3
    bad = copy.deepcopy(cfg)
    bad["text_config"]["linear_attn_config"]["use_full_rank_gate"] = False
    alt = write_kimi_checkpoint(tmp_path / "alt", bad, state)
    with pytest.raises(PlanError, match=r"self_attn\.g_a_proj\.weight.*missing"):
        quantplug.plan(alt).raise_for_problems()


def test_release_dtypes_load_in_float32_and_bfloat16(tmp_path, k3):
    _, cfg, state = k3
    path = write_kimi_checkpoint(tmp_path / "rel", cfg, state, dtype="release")
    ids = _ids(cfg["text_config"]["vocab_size"], 20)
    m = quantplug.load(path)
    kda = next(mod for mod in m.modules() if isinstance(mod, KDA))
    assert kda.dt_bias.dtype == kda.A_log.dtype == kda.q_conv1d.weight.dtype == torch.float32
    bf = quantplug.load(path, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = kr.k3_logits(cfg, {k: v.float() for k, v in release_dtypes(state).items()}, ids)
        assert rel_err(m(ids), ref) <= TOL  # the stored (bf16-rounded) weights, computed in float32
        out = bf(ids)
        assert out.dtype == torch.bfloat16 and bool(out.isfinite().all())


# ---------------------------------------------------------------------------------------------
# KDA pieces and the cache
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bound", [None, -5.0])
def test_chunked_form_equals_the_recurrence(bound):
    g = torch.Generator().manual_seed(0)
    b, h, t, k = 2, 3, 150, 16
    q = l2norm(torch.randn(b, h, t, k, generator=g)) * k ** -0.5
    key = l2norm(torch.randn(b, h, t, k, generator=g))
    v = torch.randn(b, h, t, k, generator=g)
    pre = torch.randn(b, h, t, k, generator=g)
    decay = bound * torch.sigmoid(pre) if bound else -torch.nn.functional.softplus(pre)
    beta = torch.sigmoid(torch.randn(b, h, t, generator=g))
    s0 = torch.randn(b, h, k, k, generator=g) * 0.1
    o1, s1 = recurrent_kda(q, key, v, decay, beta, s0)
    o2, s2 = chunk_kda(q, key, v, decay, beta, s0)
    assert rel_err(o2, o1) <= 5e-6 and rel_err(s2, s1) <= 5e-6


def test_kda_state_rolls_back_only_to_a_snapshot():
    st = KDAState(1, 6, 4, 1, 2, device=torch.device("cpu"), limit=10)
    st.state.fill_(1.0)
    st.advance(3)
    st.snapshot()
    st.state.fill_(2.0)
    st.advance(2)
    with pytest.raises(GenerationError, match="no snapshot at 4"):
        st.truncate(4)
    st.truncate(3)
    assert st.length == 3 and bool((st.state == 1.0).all())
    with pytest.raises(GenerationError, match="exceeds the model's context of 10"):
        st.advance(8)


def test_batched_generation_equals_one_by_one(k3):
    path, cfg, _ = k3
    m = quantplug.load(path)
    prompts = _ids(cfg["text_config"]["vocab_size"], 12, batch=2, seed=9)
    with torch.no_grad():
        both = m.generate(prompts, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        for r in range(2):
            one = m.generate(prompts[r:r + 1], max_new_tokens=4, min_new_tokens=4, do_sample=False)
            assert torch.equal(both[r:r + 1], one)


# ---------------------------------------------------------------------------------------------
# config and header errors
# ---------------------------------------------------------------------------------------------

def _write(tmp_path: Path, cfg: dict, state: dict) -> Path:
    return write_kimi_checkpoint(tmp_path / "m", cfg, state)


def test_a_log_of_another_shape_is_a_plan_error(tmp_path):
    cfg = kimi_linear_config()
    state = kimi_linear_state(cfg)
    name = next(n for n in state if n.endswith("A_log"))
    heads = cfg["linear_attn_config"]["num_heads"]
    state[name] = torch.zeros(1, heads, 1, 1)
    with pytest.raises(PlanError, match=rf"{name}.*shape \[1, {heads}, 1, 1\], expected \[1, 1, {heads}, 1\]"):
        quantplug.plan(_write(tmp_path, cfg, state)).raise_for_problems()


def test_conv_weight_of_another_shape_is_a_plan_error(tmp_path):
    cfg = kimi_linear_config()
    state = kimi_linear_state(cfg)
    name = next(n for n in state if n.endswith("k_conv1d.weight"))
    d = state[name].shape[0]
    state[name] = torch.zeros(d, 1, 3)
    with pytest.raises(PlanError, match=rf"{name}.*expected \[{d}, 1, 4\] or \[{d}, 4\]"):
        quantplug.plan(_write(tmp_path, cfg, state)).raise_for_problems()


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: c.pop("linear_attn_config"), r"linear_attn_config: missing"),
    (lambda c: c["linear_attn_config"].update(kda_layers=[1, 2, 3]), r"kda_layers.*layer 2 is in both"),
    (lambda c: c["linear_attn_config"].update(full_attn_layers=[4]), r"full_attn_layers.*layer 2 is in neither"),
    (lambda c: c["linear_attn_config"].update(kda_layers=[0, 1, 3]), r"kda_layers.*1-based"),
    (lambda c: c.update(mla_use_nope=False), r"mla_use_nope.*without RoPE"),
    (lambda c: c.update(hidden_act="gelu"), r"hidden_act"),
    (lambda c: c.update(moe_router_activation_func="softmax"), r"moe_router_activation_func"),
    (lambda c: c["linear_attn_config"].update(gate_lower_bound=1.0), r"gate_lower_bound"),
])
def test_config_errors_name_the_key(tmp_path, edit, message):
    cfg = kimi_linear_config()
    state = kimi_linear_state(cfg)
    edit(cfg)
    path = _write(tmp_path, cfg, state)
    with pytest.raises(ConfigError, match=message):
        quantplug.plan(path)


def test_a_deepseek_layout_under_the_k3_name_is_pointed_to_k25(tmp_path):
    from quantplug.testing import random_state, tiny_config, wrap_kimi, write_checkpoint

    cfg = tiny_config(mla_use_output_gate=True)
    wrapped, tensors = wrap_kimi(cfg, random_state(cfg), "KimiK25ForConditionalGeneration")
    wrapped["architectures"] = ["KimiK3ForConditionalGeneration"]
    path = write_checkpoint(tmp_path / "old", wrapped, tensors)
    with pytest.raises(ConfigError, match=r"KimiK25ForConditionalGeneration with mla_use_output_gate"):
        quantplug.plan(path)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["KimiK3ForConditionalGeneration"]


def test_kda_state_option_bfloat16_halves_the_state_with_its_error_measured(k3):
    """Load option ``kda_state=bfloat16``: the cache holds each KDA state in bfloat16 (updated in
    float32, stored rounded). On this tiny random K3 over 64 decode steps the logits stay within
    a few percent of the float32 state's on average (measured: mean relative error 0.09 and 91%
    equal top-1 over 192 steps; random tiny models amplify rounding; see docs/architectures/kimi.md)."""
    path, cfg, _ = k3
    ids = _ids(cfg["text_config"]["vocab_size"], 72, seed=11)
    runs = []
    for state in ("float32", "bfloat16"):
        lm = quantplug.load(path, options={"kda_state": state}).text_lm()
        cache = new_cache(lm, 1, 80)
        kda = [c for c in cache.layers if isinstance(c, KDAState)]
        assert {c.state.dtype for c in kda} == {getattr(torch, state)}
        with torch.no_grad():
            out = [lm.next_logits(ids[:, :8], cache)] + [lm.next_logits(ids[:, t:t + 1], cache) for t in range(8, 72)]
        runs.append((torch.cat(out), sum(c.state.nbytes for c in kda)))
    (full, full_bytes), (half, half_bytes) = runs
    assert half_bytes * 2 == full_bytes
    errs = [rel_err(half[i], full[i]) for i in range(full.shape[0])]
    assert errs[0] == 0.0 and 0 < sum(errs) / len(errs) < 0.2
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() >= 0.75


def test_engine_bridges_refuse_the_released_k3_by_name_before_reading_data(k3, kimi_linear):
    """Issue: the released Kimi-K3 has no engine model class (attention residuals, latent MoE...):
    refused at plan time naming why (transformers' bridge), and planned_modules (vLLM's) refuses it
    too. Kimi-Linear is not refused (transformers' KimiLinearForCausalLM takes it)."""
    from quantplug.bridge import engine_refusal, planned_modules
    from quantplug.errors import QuantplugError
    from quantplug.testing.probes import forbid_data_reads

    path, _, _ = k3
    with forbid_data_reads(path) as reads:
        why = engine_refusal(quantplug.plan(path).model)
    assert not reads.events and why is not None and why.startswith("KimiK3ForConditionalGeneration: the released Kimi-K3")
    with pytest.raises(QuantplugError, match=r"planned_modules: KimiK3ForConditionalGeneration: the released Kimi-K3"):
        planned_modules(quantplug.load(path))
    assert engine_refusal(quantplug.plan(kimi_linear[0]).model) is None
    qt = pytest.importorskip("quantplug_transformers")
    with forbid_data_reads(path), pytest.raises(qt.BridgeError, match=r"has no model class in transformers or vLLM"):
        qt.from_pretrained(path)


def test_native_decode_steps_run_and_equal_the_torch_paths(k3, monkeypatch):
    """A K3 decode step runs the native KDA step (quantplug.kernels.kda) and the native SiTU MLP
    steps of the dense MLP, shared and routed experts; switching them off gives the same logits
    (to float32 rounding, through the 5 layers)."""
    from quantplug.kernels import kda, native
    from quantplug.models.deepseek import MLP, Experts

    if native.library() is None:
        pytest.skip("native kernels unavailable here")
    path, cfg, _ = k3
    ids = _ids(cfg["text_config"]["vocab_size"], 20, seed=4)
    runs: list[torch.Tensor] = []
    calls = {"kda": 0}
    real = kda.kda_step

    def counted(*a, **k):
        out = real(*a, **k)
        calls["kda"] += out is not None
        return out

    monkeypatch.setattr("quantplug.lower.kda_step", counted)  # the kernel the lowering binds
    for native_on in (True, False):
        m = quantplug.load(path)
        lm = m.text_lm()
        mlps = [mod for mod in m.modules() if isinstance(mod, MLP | Experts)]
        assert mlps and all(mod.step is not None for mod in mlps)  # SiTU steps built
        for mod in m.modules():
            if not native_on and isinstance(mod, MLP | Experts | KDA):
                mod.step = None  # the block's own forward (KDA: its torch kernel)
        cache = new_cache(lm, 1, 32)
        with torch.no_grad():
            out = [lm.next_logits(ids[:, :8], cache)] + [lm.next_logits(ids[:, t:t + 1], cache) for t in range(8, 20)]
        runs.append(torch.cat(out))
    assert calls["kda"] == 12 * len(cfg["text_config"]["linear_attn_config"]["kda_layers"])
    assert rel_err(runs[0], runs[1]) <= TOL  # 2.9e-6 measured: float32 sums in another order, 5 layers deep
