"""DeepSeek-V4's FFN-side blocks against transformers 5.25's ``modeling_deepseek_v4`` (random float32
weights copied into both): the learned and the hash router (``quantplug.blocks.v4_router``), the
clamped SwiGLU (``swiglu_clamp``) of the shared and routed experts, a whole sparse MoE block, and
the mHC hyper-connections (``quantplug.blocks.hyper``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from quantplug.api import DenseScheme
from quantplug.blocks.hyper import HyperConnection, HyperHead
from quantplug.blocks.mlp import MLP
from quantplug.blocks.moe import MoE
from quantplug.blocks.router import Router
from quantplug.blocks.v4_router import HashRouter, V4Router
from quantplug.contract.routing import route
from quantplug.layers.activation import SILU, silu_clamp_mul, swiglu_clamp
from quantplug.models.config import parse_model_config
from quantplug.testing import tiny_config

tf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, K, H, INTER, V, LIM, SCALE = 8, 3, 64, 32, 160, 1.0, 1.5


def tf_config(**kw: Any) -> DeepseekV4Config:
    """A tiny DeepSeek-V4 config: layer 0 hash-routed (``num_hash_layers`` 1), layers 1-2 learned."""
    args: dict[str, Any] = dict(
        vocab_size=V, hidden_size=H, moe_intermediate_size=INTER, num_hidden_layers=3, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1,
        routed_scaling_factor=SCALE, num_hash_layers=1, swiglu_limit=LIM, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, rms_norm_eps=1e-6)
    args.update(kw)
    return DeepseekV4Config(**args)


def qp_config() -> Any:
    """Our ModelConfig with the same MoE fields (no expert groups)."""
    return parse_model_config(tiny_config(vocab_size=V, hidden_size=H, moe_intermediate_size=INTER, n_routed_experts=E,
                                          num_experts_per_tok=K, n_shared_experts=1, n_group=1, topk_group=1,
                                          norm_topk_prob=True, routed_scaling_factor=SCALE),
                              "DeepseekV3ForCausalLM", False)


class Oracle:
    """The plan oracle a block builds itself with: dense float32 linears, stacked experts."""

    prefix = ""
    model_dtype = torch.float32
    mtp_layers = 0

    def ck(self, rel: str) -> str:
        return rel

    def scheme(self, ckpt_name: str, kind: str = "linear", shards: Any = None) -> DenseScheme:
        return DenseScheme()

    def expert_layout(self, experts_ckpt_name: str) -> str:
        return "stacked"

    def layout(self, attn_ckpt_name: str) -> Any:
        raise AssertionError("no attention here")


def put(mod: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    """Registers ``t`` (a copy) as ``mod``'s parameter ``name``, as the loader does."""
    mod.register_parameter(name, torch.nn.Parameter(t.detach().clone(), requires_grad=False))


def randomize(mod: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Every float parameter of a transformers module: normal / sqrt(fan-in) (times ``scale``)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            fan = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) * scale / fan ** 0.5)


def by_id(idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (ids, weights) ordered by expert id (topk's order is unspecified)."""
    order = idx.argsort(dim=-1)
    return idx.gather(1, order), w.gather(1, order)


# -- routers -----------------------------------------------------------------------------------------

def learned_pair(seed: int) -> tuple[Any, V4Router]:
    ref = tf.DeepseekV4TopKRouter(tf_config())
    randomize(ref, seed)
    with torch.no_grad():
        ref.e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(seed + 1)) * 0.3)
    ours = V4Router(qp_config(), "layers.3.ffn.gate")
    put(ours, "weight", ref.weight)
    put(ours, "e_score_correction_bias", ref.e_score_correction_bias)
    return ref, ours


def test_learned_router_matches_transformers():
    ref, ours = learned_pair(0)
    x = torch.randn(2, 37, H, generator=torch.Generator().manual_seed(5))
    _, rw, ri = ref(x)
    idx, w = ours(x.reshape(-1, H))
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    ri, rw = by_id(ri, rw)
    idx, w = by_id(idx, w)
    assert torch.equal(idx, ri)
    torch.testing.assert_close(w, rw, rtol=0, atol=1e-6)
    # the bias chooses: without it some rows pick other experts (the test sees a dropped bias)
    plain = by_id(torch.topk(ours.scores(x.reshape(-1, H)), K, dim=-1)[1], w)[0]
    assert not torch.equal(plain, idx)
    # the declared spec routes the same (the reference route(), as the native step does), and one token
    ids, ws = route(ours.spec, x.reshape(-1, H), ours.weight, ours.e_score_correction_bias)
    for r in range(idx.shape[0]):
        pairs = sorted(zip(ids[r], ws[r]))
        assert [e for e, _ in pairs] == idx[r].tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in pairs]), w[r], rtol=0, atol=1e-6)
    one = ours.route_one(x[0, :1])
    assert (one[0], one[1]) == (ids[0], ws[0])
    assert ours.spec.score == "sqrtsoftplus" and ours.spec.has_bias and not ours.spec.by_token
    assert ours.qp_sources["e_score_correction_bias"][0].tensor == "layers.3.ffn.gate.bias"  # the release name


def hash_pair(seed: int) -> tuple[Any, HashRouter]:
    ref = tf.DeepseekV4HashRouter(tf_config())
    randomize(ref, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        ref.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]))
    ours = HashRouter(qp_config(), "layers.0.ffn.gate")
    put(ours, "weight", ref.weight)
    ours.register_buffer("tid2eid", ref.tid2eid.to(torch.int32).clone())  # DS-V4 stores int32
    return ref, ours


def test_hash_router_matches_transformers():
    ref, ours = hash_pair(2)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 19, H, generator=g)
    tok = torch.randint(0, V, (2, 19), generator=g)
    _, rw, ri = ref(x, tok)
    idx, w = ours(x.reshape(-1, H), ids=tok)
    assert torch.equal(idx, ri)                                   # the table's order, exactly
    torch.testing.assert_close(w, rw, rtol=0, atol=1e-6)
    assert torch.equal(idx, ours.tid2eid[tok.reshape(-1)].long())
    rids, rws = ours.route_ids(x, tok)
    assert rids == idx.tolist()
    torch.testing.assert_close(torch.tensor(rws), w, rtol=0, atol=1e-6)
    assert ours.spec.by_token and not ours.spec.has_bias
    assert ours.qp_sources["tid2eid"][0].tensor == "layers.0.ffn.gate.tid2eid"
    with pytest.raises(ValueError, match="token ids"):
        ours(x.reshape(-1, H))
    with pytest.raises(ValueError, match="token ids"):
        ours.route_one(x[0, :1])


# -- the clamped SwiGLU --------------------------------------------------------------------------------

def test_clamped_swiglu_matches_transformers_and_hits_the_clamp():
    cfg = tf_config()
    ref = tf.DeepseekV4MLP(cfg)
    randomize(ref, 3)
    ours = MLP(Oracle(), "layers.0.ffn.shared_experts", H, INTER, swiglu_clamp(LIM))
    for n in ("gate_proj", "up_proj", "down_proj"):
        put(getattr(ours, n), "weight", getattr(ref, n).weight)
    x = torch.randn(3, 11, H, generator=torch.Generator().manual_seed(7)) * 2
    gate, up = ref.gate_proj(x), ref.up_proj(x)
    assert (gate > LIM).any() and (up > LIM).any() and (up < -LIM).any() and (gate < -LIM).any()
    want = ref(x)
    torch.testing.assert_close(ours(x), want, rtol=0, atol=1e-5)
    # the clamp matters: plain SiLU, or a gate clamped both ways, differ
    assert (ref.down_proj(SILU(gate, up)) - want).abs().max() > 1e-2
    both = ref.down_proj(torch.nn.functional.silu(gate.clamp(-LIM, LIM)) * up.clamp(-LIM, LIM))
    assert (both - want).abs().max() > 1e-3
    # the routed experts' gate (transformers' packed gate_up), the same function
    ex = tf.DeepseekV4Experts(cfg)
    gu = torch.cat([gate, up], dim=-1)
    torch.testing.assert_close(silu_clamp_mul(gate, up, LIM), ex._apply_gate(gu), rtol=0, atol=1e-6)
    assert silu_clamp_mul(gate.bfloat16(), up.bfloat16(), LIM).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        swiglu_clamp(0.0)
    # the native MLP step computes it as its own activation (never plain SiLU; tests/kernels/test_v4_native.py)
    from quantplug.kernels.compute import MLP_ACTS, mlp_act

    assert not swiglu_clamp(LIM).is_silu
    assert mlp_act(swiglu_clamp(LIM).native) == (MLP_ACTS["silu_clamp"], LIM, 0.0)


# -- the whole sparse MoE block ------------------------------------------------------------------------

def moe_pair(layer: int, seed: int) -> tuple[Any, MoE]:
    """transformers' block of ``layer`` (0: hash routed) and ours, the same weights."""
    ref = tf.DeepseekV4SparseMoeBlock(tf_config(), layer)
    randomize(ref, seed)
    g = torch.Generator().manual_seed(seed + 1)
    cfg = qp_config()
    base = f"layers.{layer}.ffn"
    with torch.no_grad():
        if ref.is_hash:
            ref.gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]))
            gate: V4Router = HashRouter(cfg, f"{base}.gate")
            gate.register_buffer("tid2eid", ref.gate.tid2eid.clone())
        else:
            ref.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.3)
            gate = V4Router(cfg, f"{base}.gate")
            put(gate, "e_score_correction_bias", ref.gate.e_score_correction_bias)
    put(gate, "weight", ref.gate.weight)
    ours = MoE(cfg, Oracle(), base, names=("w1", "w3", "w2"), act=swiglu_clamp(LIM), gate=gate)
    put(ours.experts.gate_proj, "weight", ref.experts.gate_up_proj[:, :INTER])
    put(ours.experts.up_proj, "weight", ref.experts.gate_up_proj[:, INTER:])
    put(ours.experts.down_proj, "weight", ref.experts.down_proj)
    assert ours.shared_experts is not None
    for n in ("gate_proj", "up_proj", "down_proj"):
        put(getattr(ours.shared_experts, n), "weight", getattr(ref.shared_experts, n).weight)
    return ref, ours


@pytest.mark.parametrize("layer", [0, 1])
def test_sparse_moe_block_matches_transformers(layer):
    ref, ours = moe_pair(layer, 10 + layer)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 23, H, generator=g) * 2
    tok = torch.randint(0, V, (2, 23), generator=g)
    want = ref(x, input_ids=tok)
    got = ours(x, ids=tok)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if layer:  # a learned router needs no ids: the old call routes the same
        torch.testing.assert_close(ours(x), want, rtol=0, atol=1e-5)
    else:
        with pytest.raises(ValueError, match="token ids"):
            ours(x)
    # without the clamp the block differs (the clamp is hit)
    ours.experts.act = ours.shared_experts.act = SILU  # type: ignore[union-attr]
    assert (ours(x, ids=tok) - want).abs().max() > 1e-3


def test_moe_keeps_the_v3_router_by_default():
    moe = MoE(qp_config(), Oracle(), "model.layers.1.mlp")
    assert type(moe.gate) is Router and moe.gate.qp_ckpt == "model.layers.1.mlp.gate"


# -- mHC hyper-connections -------------------------------------------------------------------------------

def hc_pair(n: int, seed: int) -> tuple[Any, HyperConnection]:
    ref = tf.DeepseekV4HyperConnection(tf_config(hc_mult=n))
    randomize(ref, seed)
    ours = HyperConnection("layers.2.hc_attn", H, hc_mult=n, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    for mine, theirs in (("fn", ref.fn), ("base", ref.base), ("scale", ref.scale)):
        put(ours, mine, theirs)
    return ref, ours


@pytest.mark.parametrize("n", [2, 4])
def test_hyper_connection_weights_and_collapse_match_transformers(n):
    ref, ours = hc_pair(n, 20 + n)
    x = torch.randn(2, 9, n, H, generator=torch.Generator().manual_seed(n))
    post, comb, collapsed = ref(x)
    pre, mpost, mcomb = ours.weights(x)
    torch.testing.assert_close(mpost, post, rtol=0, atol=1e-6)
    torch.testing.assert_close(mcomb, comb, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.collapse(x, pre), collapsed, rtol=0, atol=1e-5)
    assert (mcomb - mcomb.transpose(-1, -2)).abs().max() > 1e-3          # not symmetric: direction matters
    # doubly stochastic: columns last normalized (exact), rows after 20 normalizations near 1
    torch.testing.assert_close(mcomb.sum(-2), torch.ones_like(mcomb.sum(-2)), rtol=0, atol=1e-4)
    torch.testing.assert_close(mcomb.sum(-1), torch.ones_like(mcomb.sum(-1)), rtol=0, atol=5e-2)
    assert {s.tensor for p in ours.qp_sources.values() for s in p} == {
        "layers.2.hc_attn_fn", "layers.2.hc_attn_base", "layers.2.hc_attn_scale"}
    assert ours.qp_sources["fn"][0].shape == ((2 + n) * n, n * H)


class _Attn(torch.nn.Module):
    """A stand-in sub-layer as transformers' decoder layer calls its attention: ``(out, weights)``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(H, H, bias=False)
        randomize(self, seed)

    def forward(self, x: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, None]:
        return torch.tanh(self.proj(x)) * 3, None


class _Mlp(_Attn):
    def forward(self, x: torch.Tensor, input_ids: Any = None, **kw: Any) -> torch.Tensor:  # type: ignore[override]
        return self.proj(x) ** 2


@pytest.mark.parametrize("n", [3, 4])
def test_hyper_connections_around_sublayers_match_the_transformers_decoder_layer(n):
    """Both mHC sites of a whole decoder layer (attention and MLP swapped for stand-ins, the norms
    random): transformers' pre / post mixing, comb consumed transposed."""
    cfg = tf_config(hc_mult=n)
    layer = tf.DeepseekV4DecoderLayer(cfg, 1)
    layer.self_attn, layer.mlp = _Attn(1), _Mlp(2)
    randomize(layer.attn_hc, 30 + n)
    randomize(layer.ffn_hc, 40 + n)
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    sites = []
    for name, ref in (("hc_attn", layer.attn_hc), ("hc_ffn", layer.ffn_hc)):
        hc = HyperConnection(f"layers.1.{name}", H, hc_mult=n, sinkhorn_iters=cfg.hc_sinkhorn_iters,
                             hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        for p in ("fn", "base", "scale"):
            put(hc, p, getattr(ref, p))
        sites.append(hc)
    x = torch.randn(2, 7, n, H, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = layer(x)
        h = sites[0](x, lambda u: layer.self_attn(layer.input_layernorm(u))[0])
        got = sites[1](h, lambda u: layer.mlp(layer.post_attention_layernorm(u)))
    assert got.shape == (2, 7, n, H)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_hyper_head_matches_transformers():
    ref = tf.DeepseekV4HyperHead(tf_config())
    randomize(ref, 50)
    ours = HyperHead("hc_head", H, hc_mult=4, hc_eps=1e-6, norm_eps=1e-6)
    put(ours, "fn", ref.hc_fn)
    put(ours, "base", ref.hc_base)
    put(ours, "scale", ref.hc_scale)
    x = torch.randn(3, 5, 4, H, generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-5)
    assert ours.qp_sources["fn"][0].tensor == "hc_head_fn" and ours.qp_sources["scale"][0].shape == (1,)
