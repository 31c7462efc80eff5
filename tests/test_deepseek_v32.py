"""DeepSeek-V3.2 (DSA: MLA + lightning indexer) against transformers' DeepseekV32ForCausalLM (fp32).

``index_topk`` (5) is smaller than the prompt (16), so the indexer's selection decides which keys
every query attends to: dense MLA, or an indexer with interleaved RoPE, gives other logits (checked
below, so the parity tests cannot pass with either mistake)."""

from __future__ import annotations

import json

import pytest
import quantplug
import torch
from conftest import rel_err
from quantplug.errors import ConfigError, PlanError
from quantplug.generate import new_cache
from quantplug.kernels import compute
from quantplug.models.deepseek import MLA
from quantplug.testing import random_state, tiny_config, write_checkpoint
from quantplug.testing.reference import hf_model

TOPK = 5
# widths in whole 32-blocks (q LoRA 64, rope 32) so that the native one-token MLA step is built;
# the indexer: 8 heads of 48 dims, rope part (32) first
CFG = tiny_config(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", q_lora_rank=64,
                  qk_nope_head_dim=32, qk_rope_head_dim=32, index_n_heads=8, index_head_dim=48, index_topk=TOPK)
IDS = torch.randint(0, CFG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
STEPS = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return random_state(CFG, seed=7)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, state):
    return write_checkpoint(tmp_path_factory.mktemp("v32") / "c", CFG, state)


@pytest.fixture(scope="module")
def model(ckpt):
    return quantplug.load(ckpt)


@pytest.fixture(scope="module")
def reference(state):
    return hf_model(CFG, state)


def _hf_greedy(hf, ids, steps):
    """transformers' logits of the prompt's last position and of each greedy decode step (its cache)."""
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        logits = [out.logits[:, -1]]
        for _ in range(steps):
            out = hf(logits[-1].argmax(-1, keepdim=True), cache=out.cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return logits


def _ours_greedy(model, ids, steps):
    """quantplug's logits of the same steps through its latent cache, the sequence, and the cache."""
    cache = new_cache(model, ids.shape[0], ids.shape[1] + steps)
    seq = ids
    with torch.no_grad():
        logits = [model.next_logits(ids, cache)]
        for _ in range(steps):
            tok = logits[-1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, tok], dim=1)
            logits.append(model.next_logits(tok, cache))
    return logits, seq, cache


def test_architecture_and_plan(model):
    plan = model.quantplug_plan
    assert plan.model_config.architecture == "DeepseekV32ForCausalLM"
    assert (plan.model_config.index_n_heads, plan.model_config.index_head_dim, plan.model_config.index_topk) == (8, 48, 5)
    assert plan.model_config.indexer_rope_interleave is False
    names = {p.param for p in plan.params}
    for t in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
        assert f"model.layers.2.self_attn.indexer.{t}" in names
    ix = model.model.layers[0].self_attn.indexer
    assert ix.weights_proj.weight.dtype == torch.float32 and ix.k_norm.bias.dtype == torch.float32


def test_prompt_logits_match_transformers(model, reference):
    with torch.no_grad():
        ours, ref = model(IDS), reference(IDS).logits
    assert ours.shape == (2, 16, CFG["vocab_size"])
    assert rel_err(ours, ref) <= 1e-5


def test_decode_steps_match_transformers_and_recompute(model, reference):
    ours, seq, cache = _ours_greedy(model, IDS, STEPS)
    ref = _hf_greedy(reference, IDS, STEPS)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert rel_err(a, b) <= 1e-5, step
        assert torch.equal(a.argmax(-1), b.argmax(-1)), step
    assert cache.length == 16 + STEPS
    for layer in cache.layers:  # the indexer keys ride on the same length as the latent
        assert layer.index_keys().shape == (2, 1, 16 + STEPS, 48)
    # cached = recompute: the last step's logits from the whole sequence, no cache
    with torch.no_grad():
        full = model(seq)[:, -1]
    assert rel_err(ours[-1], full) <= 1e-5


def test_decode_reads_only_the_selected_rows(model, monkeypatch):
    seen: list[int] = []
    orig = MLA._latent_attention

    def spy(self, q_lat, q_rot, latent, k_rot, past, keep=None):
        seen.append(latent.shape[-2])
        return orig(self, q_lat, q_rot, latent, k_rot, past, keep)

    cache = new_cache(model, 1, 20)
    with torch.no_grad():
        model.next_logits(IDS[:1], cache)
        monkeypatch.setattr(MLA, "_latent_attention", spy)
        model.next_logits(IDS[:1, :1], cache)
    assert seen == [TOPK] * CFG["num_hidden_layers"]  # not the 17 cached rows
    assert cache.bytes_per_token() == CFG["num_hidden_layers"] * (32 + 32 + 48) * 4


def test_dense_until_topk_then_sparse(model, reference, monkeypatch):
    """A prompt of 3 tokens, then steps past index_topk: the first steps run dense MLA paths (the
    native one-token MLA step where the kernels are built) while the indexer caches its keys; later
    steps select from those keys, so a key written on a dense step must be right."""
    calls = [0]
    orig = compute.MLAStep.__call__

    def count(self, x, rot, cache):
        out = orig(self, x, rot, cache)
        calls[0] += out is not None
        return out

    monkeypatch.setattr(compute.MLAStep, "__call__", count)
    ids = IDS[:, :3]
    ours, _, cache = _ours_greedy(model, ids, 7)
    ref = _hf_greedy(reference, ids, 7)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert rel_err(a, b) <= 1e-5, step
    assert cache.length == 10
    if compute.native.library() is not None:
        assert calls[0] == 2 * CFG["num_hidden_layers"]  # cache length 3 -> 4 and 4 -> 5 are dense
    assert model.model._stack_step() is None  # never the whole-stack step for a DSA model


def test_bfloat16_loads_and_generates(ckpt, model, state, tmp_path):
    bf = quantplug.load(ckpt, dtype=torch.bfloat16)
    assert bf.model.layers[1].self_attn.indexer.wq_b.weight.dtype == torch.bfloat16
    assert bf.model.layers[1].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    with torch.no_grad():
        out = bf(IDS)
        ref = model(IDS)
    # bfloat16 rounding flips near-ties of the top-5 choice on these random weights: transformers'
    # own bfloat16 model is 0.13 off its float32 logits here, quantplug's 0.10
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and rel_err(out.float(), ref) < 0.2
    gen = bf.stream(IDS, max_new_tokens=6, eos_token_id=None)
    seq = torch.stack(list(gen), dim=1)
    assert seq.shape == (2, 6) and gen.cache.layers[0].index_keys().dtype == torch.bfloat16
    assert gen.cache.length == 16 + 5
    # with every key selected (index_topk >= the prompt) bfloat16 stays as close as for V3 (0.007)
    wide = write_checkpoint(tmp_path / "w", {**CFG, "index_topk": 16}, state)
    with torch.no_grad():
        assert rel_err(quantplug.load(wide, dtype=torch.bfloat16)(IDS).float(), quantplug.load(wide)(IDS)) < 2e-2


def _dequantized(path):
    from safetensors.torch import load_file

    stored = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in stored.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = stored[name[:-len("weight")] + "weight_scale_inv"]
            rows, cols = t.shape
            full = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            out[name] = t.float() * full.float()
        else:
            out[name] = t.float()
    return stored, out


def test_fp8_release_format(ckpt, model, tmp_path):
    pytest.importorskip("quantplug_fp8")
    from quantplug.plugins import get_plugin_manager

    [res] = get_plugin_manager().export("fp8", model=model, destination=tmp_path / "fp8", plan=model.quantplug_plan)
    stored, deq = _dequantized(res.path)
    ix = "model.layers.1.self_attn.indexer"
    assert stored[f"{ix}.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert stored[f"{ix}.wk.weight"].dtype == torch.float8_e4m3fn
    assert stored[f"{ix}.wq_b.weight_scale_inv"].shape == (3, 1)   # [ceil(384 / 128), ceil(64 / 128)]
    assert stored[f"{ix}.weights_proj.weight"].dtype == torch.bfloat16  # as the release stores it
    assert stored[f"{ix}.k_norm.bias"].dtype == torch.bfloat16
    assert json.loads((res.path / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    fp8 = quantplug.load(res.path, options={"activation_quant": "none"})
    schemes = fp8.quantplug_plan.schemes()
    assert schemes[f"{ix}.wq_b"].startswith("fp8") and schemes[f"{ix}.wk"].startswith("fp8")
    with torch.no_grad():
        ours, ref = fp8(IDS), hf_model(CFG, deq)(IDS).logits
    assert rel_err(ours, ref) <= 1e-5
    ours_steps, _, _ = _ours_greedy(fp8, IDS, 3)
    for a, b in zip(ours_steps, _hf_greedy(hf_model(CFG, deq), IDS, 3)):
        assert rel_err(a, b) <= 1e-5
    # activation emulation on (kv_b_proj no longer weight-only: the expanded K/V paths): cached = recompute
    dyn = quantplug.load(res.path)
    steps, seq, _ = _ours_greedy(dyn, IDS, 2)
    with torch.no_grad():
        assert rel_err(steps[-1], dyn(seq)[:, -1]) <= 1e-5


def test_missing_indexer_tensor_is_a_plan_error(tmp_path, state):
    name = "model.layers.1.self_attn.indexer.wk.weight"
    path = write_checkpoint(tmp_path / "c", CFG, {k: v for k, v in state.items() if k != name})
    with pytest.raises(PlanError) as e:
        quantplug.plan(path)
    assert name in str(e.value) and "missing" in str(e.value)


def test_selection_and_indexer_rope_change_the_logits(tmp_path, state, reference):
    """The parity tests above would fail with selection ignored (dense V3 MLA) or an interleaved
    indexer RoPE: both give logits far outside their 1e-5."""
    with torch.no_grad():
        ref = reference(IDS).logits
        dense_cfg = {**CFG, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
        dense = hf_model(dense_cfg, {k: v for k, v in state.items() if ".indexer." not in k})(IDS).logits
        assert rel_err(dense, ref) > 1e-3
        inter = quantplug.load(write_checkpoint(tmp_path / "i", {**CFG, "indexer_rope_interleave": True}, state))
        assert inter.config.indexer_rope_interleave
        assert rel_err(inter(IDS), ref) > 1e-3
        # with index_topk >= the prompt every key is kept: DSA is dense V3 MLA
        wide = quantplug.load(write_checkpoint(tmp_path / "w", {**CFG, "index_topk": 16}, state))
        assert rel_err(wide(IDS), dense) <= 1e-5


@pytest.mark.parametrize("change, message", [
    ({"index_head_dim": 16}, "index_head_dim = 16: expected at least qk_rope_head_dim (32)"),
    ({"index_topk": 0}, "index_topk = 0"),
    ({"index_n_heads": "8"}, "index_n_heads"),
    ({"indexer_rope_interleave": 1}, "indexer_rope_interleave = 1: expected true or false"),
    ({"q_lora_rank": None}, "q_lora_rank"),
])
def test_config_errors(tmp_path, state, change, message):
    path = write_checkpoint(tmp_path / "c", {**CFG, **change}, state)
    with pytest.raises(ConfigError) as e:
        quantplug.plan(path)
    assert message in str(e.value)


# -- the load option indexer=fp8: DeepSeek's reference FP8 indexer -----------------------------------

CFG64 = {**CFG, "index_head_dim": 64}  # the reference's Hadamard needs a power of two


def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _act_quant_formula(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's act_quant, ue8m0, one block per row, a row at a time: s = 2^ceil(log2(amax / 448))."""
    import math

    rows = x.reshape(-1, x.shape[-1]).float()
    q, s = torch.empty_like(rows), torch.empty(rows.shape[0], 1)
    for i, v in enumerate(rows):
        r = float(torch.tensor(max(float(v.abs().max()), 1e-4), dtype=torch.float32) * torch.tensor(1 / 448))
        mant, exp = math.frexp(r)
        s[i] = 2.0 ** (exp if mant > 0.5 else exp - 1)
        q[i] = (v / s[i]).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return q.view(x.shape), s.view(*x.shape[:-1], 1)


def test_hadamard_and_act_quant_match_their_formulas():
    from quantplug.models.deepseek import act_quant_ue8m0, hadamard

    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)) * 3
    assert rel_err(hadamard(x), x @ _sylvester(64) / 8) <= 1e-6
    x[0, 0] = 448 * 2.0 ** -3  # amax / 448 exactly a power of two: the scale is that power
    x[0, 1] = 1e-6             # amax clamped to 1e-4
    q8, s = act_quant_ue8m0(x)
    q_ref, s_ref = _act_quant_formula(x)
    assert q8.dtype == torch.float8_e4m3fn and torch.equal(s, s_ref) and torch.equal(q8.float(), q_ref)
    assert float(s[0, 0]) == 2.0 ** -3 and float(s[0, 1]) == 2.0 ** -22


@pytest.fixture(scope="module")
def fp8_indexer(tmp_path_factory):
    st = random_state(CFG64, seed=9)
    path = write_checkpoint(tmp_path_factory.mktemp("v32i") / "c", CFG64, st)
    return path, quantplug.load(path, options={"indexer": "fp8"})


def test_fp8_indexer_scores_match_the_reference_formula(fp8_indexer):
    _, model = fp8_indexer
    ix = model.model.layers[1].self_attn.indexer
    assert ix.qp_indexer == "fp8"
    g = torch.Generator().manual_seed(4)
    t, h, d, rope = 12, 8, 64, 32
    x, qr = torch.randn(1, t, 64, generator=g), torch.randn(1, t, 64, generator=g)
    cos, sin = model.model.rotary.cos_sin(torch.arange(t).unsqueeze(0), torch.float32)
    keys, scales = ix.keys(x, cos, sin)
    assert keys.dtype == torch.float8_e4m3fn and scales.shape == (1, 1, t, 1)
    with torch.no_grad():
        ours = ix.scores(x, qr, cos, sin, keys[:, 0], scales[:, 0], past=0)
        # the reference, from the weights: half-split RoPE on the first 32 dims, Hadamard, act_quant, fp8_index

        def rope_first(v):  # v [t, ..., d]
            c, s = cos[0].view(t, *([1] * (v.dim() - 2)), rope), sin[0].view(t, *([1] * (v.dim() - 2)), rope)
            r = v[..., :rope]
            half = torch.cat([-r[..., rope // 2:], r[..., :rope // 2]], -1)
            return torch.cat([r * c + half * s, v[..., rope:]], -1)

        q = rope_first((qr[0] @ ix.wq_b.weight.t()).view(t, h, d))
        k = rope_first(torch.nn.functional.layer_norm(x[0] @ ix.wk.weight.t(), (d,), ix.k_norm.weight,
                                                      ix.k_norm.bias, 1e-6))
        q8, qs = _act_quant_formula(q @ _sylvester(d) / 8)
        k8, ks = _act_quant_formula(k @ _sylvester(d) / 8)
        w = (x[0] @ ix.weights_proj.weight.t()) * h ** -0.5
        ref = torch.zeros(t, t)
        for hh in range(h):
            ref += torch.relu(q8[:, hh] @ k8.t()) * (w[:, hh] * qs[:, hh, 0] * d ** -0.5).unsqueeze(1)
        ref = ref * ks[:, 0].unsqueeze(0)
        ref = ref.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.equal(torch.isinf(ours[0]), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert rel_err(ours[0][fin], ref[fin]) <= 1e-5
    assert torch.equal(ours[0].topk(TOPK).indices.sort().values, ref.topk(TOPK).indices.sort().values)
    # and close to the exact float32 scores (the quantization's error, not another computation)
    ix.qp_indexer = "exact"
    try:
        k32, _ = ix.keys(x, cos, sin)
        exact = ix.scores(x, qr, cos, sin, k32[:, 0], None, past=0)
    finally:
        ix.qp_indexer = "fp8"
    assert 0 < rel_err(ours[0][fin], exact[0][fin]) < 0.1


def test_fp8_indexer_caches_fp8_keys_and_decodes_consistently(fp8_indexer):
    _, model = fp8_indexer
    steps, seq, cache = _ours_greedy(model, IDS, 4)
    layer = cache.layers[0]
    assert layer.index_keys().dtype == torch.float8_e4m3fn and layer.index_scales().shape == (2, 1, 20, 1)
    assert cache.bytes_per_token() == CFG["num_hidden_layers"] * ((32 + 32) * 4 + 64 + 4)
    with torch.no_grad():
        assert rel_err(steps[-1], model(seq)[:, -1]) <= 1e-5


def test_fp8_indexer_needs_a_power_of_two_head(ckpt):
    with pytest.raises(PlanError, match="option indexer='fp8': index_head_dim = 48 must be a power of two"):
        quantplug.plan(ckpt, options={"indexer": "fp8"})


def test_chunked_prompt_equals_the_whole_prompt(model):
    """A prompt in two chunks through the cache: the second chunk's queries select among cached
    and new keys (the sparse prompt path with a cached prefix)."""
    cache = new_cache(model, 2, 16)
    with torch.no_grad():
        model(IDS[:, :7], cache=cache)
        chunked = model(IDS[:, 7:], cache=cache)
        whole = model(IDS)[:, 7:]
    assert cache.length == 16 and rel_err(chunked, whole) <= 1e-5


def test_transformers_bridge_builds_deepseek_v32(ckpt, reference):
    bridge = pytest.importorskip("quantplug_transformers")
    from transformers import DeepseekV32ForCausalLM

    hf = bridge.from_pretrained(ckpt, attn_implementation="eager")
    assert isinstance(hf, DeepseekV32ForCausalLM)
    assert type(hf.model.layers[1].self_attn.indexer.wq_b).__name__ == "QuantLinear"
    with torch.no_grad():
        assert rel_err(hf(IDS).logits, reference(IDS).logits) <= 1e-5


@pytest.mark.parametrize("per_block", [1, 3])
def test_a_long_prompt_is_scored_a_block_of_queries_at_a_time(model, monkeypatch, per_block):
    from quantplug.blocks import indexer

    with torch.no_grad():
        whole = model(IDS)
        # per_block queries at once: [2 rows, 8 heads, 16 keys] float32 = 1 KiB per query
        monkeypatch.setattr(indexer, "INDEX_SCORE_BYTES", per_block * 2 * 8 * 16 * 4)
        blocks = model(IDS)
    assert rel_err(blocks, whole) <= 1e-6
