"""The MoE router as data (quantplug.contract.routing.RouterSpec): the native router (``qp_route``,
``blocks/router.c``) against the reference :func:`quantplug.contract.routing.route` for every scoring x
selection kind, with and without a bias, and routing by token id; and the DeepSeek-V2 example
(softmax router) decoding in one native whole-stack call per token."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import pytest
import quantplug
import torch
from quantplug.contract.routing import SCORES, SELECTS, RouterSpec, route
from quantplug.errors import QuantplugError
from quantplug.kernels import native
from quantplug.kernels.routers import native_route

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")

E, H = 16, 32


def _same(spec, ref, got) -> None:
    """Per row: the same expert ids (the reference's in the order chosen, the kernels' ascending),
    each weight within 1e-6 relative (at least 1e-6 absolute): scores of unnormalized, scaled
    routers reach 5-8, where a float32 dot product in another summation order is a few ulps
    (4.8e-7 each) away."""
    (rids, rws), (nids, nws) = ref, got
    assert len(rids) == len(nids)
    for r, (a, aw, b, bw) in enumerate(zip(rids, rws, nids, nws)):
        pairs = sorted(zip(a, aw))
        assert [e for e, _ in pairs] == b, f"row {r}: {spec}"
        assert all(abs(w - v) <= 1e-6 * max(1.0, abs(w)) for (_, w), v in zip(pairs, bw)), f"row {r}: {spec}"


def _inputs(seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, H, generator=g)
    w = torch.randn(E, H, generator=g) / H ** 0.5
    b = 0.1 * torch.randn(E, generator=g) if bias else None
    # logits on a grid of 1/4: many exact ties between experts and between groups
    tied = torch.randint(-6, 6, (64, E), generator=g).float() / 4
    return x, w, b, tied


@needs_native
@pytest.mark.parametrize("score", list(SCORES))
@pytest.mark.parametrize("select", list(SELECTS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_native_route_equals_the_reference(score, select, bias, norm):
    spec = RouterSpec(score=score, select=select, top_k=3, n_group=4, topk_group=2, norm_topk=norm, scaling=2.5,
                      has_bias=bias)
    # a seed per case, the same in every process (str hashes are salted per process)
    x, w, b, tied = _inputs(zlib.crc32(repr((score, select, bias, norm)).encode()) % 1000, bias)
    _same(spec, route(spec, x, w, b), native_route(spec, x, w, b))
    _same(spec, route(spec, tied, None, b), native_route(spec, tied, None, b))  # the logits given: ties exact


@needs_native
@pytest.mark.parametrize("score", list(SCORES))
def test_native_route_by_token_id(score):
    """Routing by token (DeepSeek-V4's hash layers): the experts from tid2eid [vocab, top_k], the
    weights the learned gate's scores of them; out-of-range ids are refused."""
    spec = RouterSpec(score=score, top_k=4, norm_topk=True, scaling=1.5, by_token=True)
    g = torch.Generator().manual_seed(3)
    x, w, _, _ = _inputs(7, False)
    table = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(50)]).to(torch.int32)
    ids = torch.randint(0, 50, (x.shape[0],), generator=g)
    ref = route(spec, x, w, ids=ids, tid2eid=table)
    assert ref[0] == [table[t].tolist() for t in ids.tolist()]
    _same(spec, ref, native_route(spec, x, w, ids=ids, tid2eid=table))
    with pytest.raises(QuantplugError, match="code -4"):
        native_route(spec, x[:1], w, ids=[50], tid2eid=table)


def test_spec_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="score"):
        RouterSpec(score="relu")
    with pytest.raises(ValueError, match="selection"):
        RouterSpec(select="noaux")


def test_core_router_declares_its_spec():
    """DeepSeek-V3's router: sigmoid, top-2 group sums, the correction bias; its route_one is the
    reference route of that spec."""
    from quantplug.models.config import parse_model_config
    from quantplug.models.deepseek import Router
    from quantplug.testing import tiny_config

    cfg = parse_model_config(tiny_config(n_group=4, topk_group=2), "DeepseekV3ForCausalLM", False, "config.json")
    r = Router(cfg, "model.layers.1.mlp.gate")
    g = torch.Generator().manual_seed(1)
    r.register_buffer("weight", torch.randn(cfg.n_routed_experts, cfg.hidden_size, generator=g))
    r.register_buffer("e_score_correction_bias", 0.1 * torch.randn(cfg.n_routed_experts, generator=g))
    spec = r.spec
    assert (spec.score, spec.select, spec.has_bias, spec.n_group) == ("sigmoid", "group_top2", True, 4)
    x = torch.randn(1, cfg.hidden_size, generator=g)
    ids, ws = r.route_one(x)
    (rids,), (rws,) = route(spec, x, r.weight, r.e_score_correction_bias)
    assert ids == rids and ws == pytest.approx(rws, abs=1e-12)

    class Own(Router):  # a subclass routing otherwise declares no spec unless it says so
        def route_one(self, x):
            return [0], [1.0]

    assert Own(cfg, "g").spec is None


# -- the DeepSeek-V2 example: one native call per decoded token ---------------------------------------

@needs_native
@pytest.mark.parametrize("method,norm", [("greedy", False), ("group_limited_greedy", False),
                                         ("group_limited_greedy", True)])
def test_deepseek_v2_decodes_in_one_native_call_per_token(tmp_path, monkeypatch, method, norm):
    pytest.importorskip("quantplug_deepseek_v2", reason="examples/deepseek_v2 is not installed")
    pytest.importorskip("transformers")
    from test_example_architecture import IDS, _config, _reference

    grouped = method != "greedy"
    cfg = _config(topk_method=method, n_group=4 if grouped else 1, topk_group=2 if grouped else 1,
                  norm_topk_prob=norm)
    ref, path = _reference(tmp_path, cfg, seed=4)
    lib = native.library()
    real, calls = lib.qp_decode_step, [0]

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(lib, "qp_decode_step", counted)
    model = quantplug.load(path)
    new = 8
    out = model.generate(IDS[:1, :6], new, eos_token_id=None)
    assert calls[0] == new - 1  # every token after the prompt's: one whole-stack call
    # the per-layer path (one native call per attention / MoE) gives the same tokens
    tm = model.model
    tm._stack, tm._stack_tried = None, True
    assert torch.equal(model.generate(IDS[:1, :6], new, eos_token_id=None), out)
    assert calls[0] == new - 1
    if not norm:  # transformers' DeepseekV2 never normalises
        want = ref.generate(IDS[:1, :6], max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(out, want)
