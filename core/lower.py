"""The one lowering: which blocks run natively, and how.

A block's ``forward`` (:mod:`quantplug.blocks`) is its only definition of the math. This module alone
maps block types to native steps (:data:`LOWERINGS`: block type -> the function that binds its
step) and builds the whole-stack step from a model's declared layers:

* :func:`accelerate` (the loader calls it once the weights are in place and every scheme fused its
  sibling projections) walks the model, children first; for each block whose type it knows (and
  whose ``forward`` is that type's own) it builds the native step on the block's weight forms,
  records it on the block (``block.step``, or the deprecated scheme-fused ``block.one``) and binds
  the block's lowered entry point (an instance attribute over the class's method): the step where
  it runs, else the block's own forward. A block it does not know runs its forward.
* :func:`stack_step` composes a stack of :class:`~quantplug.blocks.residual.PreNormLayer` (MLA
  attention, MLP or MoE with DeepSeek-V3's router) and the final norm into one native call
  (:class:`~quantplug.kernels.compute.StackStep`); :func:`text_stack` builds it once per text model
  (``model.layers`` / ``model.norm``), on first use. A text model's decode entry points
  (:func:`decode_logits`, :func:`sequence_logits`, :func:`decode_hidden`, and the MTP drafter's
  :func:`mtp_logits` / :func:`speculative_step`) ask for it and return None where a piece runs
  another way: the model then runs its blocks' forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import MethodType
from typing import Any

import torch
from torch import nn

from .blocks.hyper import HyperConnection, HyperHead
from .blocks.kda import KDA
from .blocks.mla import MLA
from .blocks.mlp import MLP
from .blocks.moe import Experts, MoE
from .blocks.residual import PreNormLayer
from .blocks.v4_attention import V4Attention
from .blocks.v4_compressor import CompressorState, V4Compressor
from .contract.routing import RouterSpec
from .errors import QuantplugError
from .kernels import compute
from .kernels.compute import (
    NATIVE_ROWS,
    DraftStep,
    HyperStackLayer,
    HyperStackStep,
    HyperStep,
    MLAStep,
    MLPStep,
    PoolBuffers,
    StackLayer,
    StackStep,
    WindowAttnStep,
)
from .kernels.kda import kda_step
from .layers.embedding import TiedHead
from .layers.linear import LinearScheme, fuse_attention, fuse_mlp
from .layers.norm import RMSNorm


def step_reduce(columns: Sequence[nn.Module], rows: Sequence[nn.Module]) -> tuple[bool, Any]:
    """Whether a fused step may run on these layers as this rank holds them, and the all-reduce of
    its partial output: every layer unsplit (no reduce), or the ``columns`` split by output rows
    and the ``rows`` by input features, each holding only its slice (``quantplug.parallel``), with
    no scheme reducing its own integer accumulators (``apply_row_parallel``)."""
    # getattr: any module an architecture passes (a third party's need not be a PlannedModule)
    par = [getattr(m, "qp_parallel", None) for m in (*columns, *rows)]
    if all(p is None for p in par):
        return True, None
    if any(p is None or not getattr(p, "sharded", False) for p in par):
        return False, None
    if any(getattr(p, "kind", "") != "column" or getattr(p, "gather", False) for p in par[:len(columns)]):
        return False, None
    if any(getattr(p, "kind", "") != "row" for p in par[len(columns):]):
        return False, None
    if any(getattr(type(getattr(m, "scheme", None)), "apply_row_parallel", None) is not LinearScheme.apply_row_parallel
           for m in rows):
        return False, None
    last: Any = par[-1]
    return True, last.comm.all_reduce


def _hooked(m: nn.Module) -> bool:
    """Whether a module has forward hooks of its own (a fused step would skip them)."""
    return bool(m._forward_hooks or m._forward_pre_hooks)


# -- per block: MLA ------------------------------------------------------------------------------

def _lower_mla(m: MLA) -> None:
    cfg, q_lora = m.cfg, m.q_lora
    cols = [m.q_proj if q_lora is None else m.q_b_proj]
    split = m.layout.kind != "dense"
    if not split:
        cols.append(m.kv_b_proj)
    if cfg.mla_use_output_gate:
        cols.append(m.g_proj)
    ok, reduce = step_reduce(cols, [m.o_proj])
    m.step = m.one = None
    if ok and all(p.qp_parallel is None for p in [m.kv_a_proj_with_mqa] + ([m.q_a_proj] if q_lora is not None else [])):
        m.step = MLAStep.build(
            q_a=m.q_a_proj if q_lora is not None else None, kv_a=m.kv_a_proj_with_mqa, q_b=cols[0],
            kv_b=None if split else m.kv_b_proj, k_b=m.k_b if split else None,
            v_b=m.v_b if split else None, o=m.o_proj, g=m.g_proj if cfg.mla_use_output_gate else None,
            q_a_norm=m.q_a_layernorm if q_lora is not None else None, kv_a_norm=m.kv_a_layernorm,
            nh=m.num_heads, q_lora=q_lora, kv_lora=m.kv_lora_rank, rope=m.qk_rope_head_dim,
            nope=cfg.qk_nope_head_dim, v=cfg.v_head_dim, hidden=cfg.hidden_size,
            eps_q=m.q_a_layernorm.eps if q_lora is not None else 0.0, eps_kv=m.kv_a_layernorm.eps,
            scale=m.scale, reduce=reduce)
    if m.step is None:
        m.one = fuse_attention(m)
        if m.one is not None:
            compute.deprecated_fuse("fuse_attention", m.o_proj.scheme)
    m._attend = MethodType(_mla_attend, m)  # type: ignore[method-assign]


def _mla_attend(m: MLA, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                sparse: bool = False) -> torch.Tensor:
    """:meth:`MLA._attend` lowered: a decode step (one token, a cache, dense selection) natively for
    up to :data:`NATIVE_ROWS` sequences, or for one sequence in the 2-D absorbed form
    (:func:`_mla_decode_one`); anything else, or a step that declines, runs the block's own."""
    b, t, _ = x.shape
    if t == 1 and cache is not None and not sparse:
        st = m.step
        if st is not None and b <= NATIVE_ROWS:
            out = st(x, m.rotary[0]._rotation(cos, sin), cache)
            if out is not None:
                return out
        if b == 1 and cos.shape[0] == 1 and (m.layout.kind != "dense"
                                             or (cache.length > 0 and m.kv_b_proj.scheme.weight_only)):
            return _mla_decode_one(m, x, cos, sin, cache)
    return MLA._attend(m, x, cos, sin, cache, sparse)


def _mla_decode_one(m: MLA, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any) -> torch.Tensor:
    """:meth:`MLA.forward` for one token of one sequence with a cache (a decode step) in the
    absorbed form, on 2-D tensors: every head reads the same latent, so the scores of all heads
    are one [heads, latent + rope] x [latent + rope, tokens] product and the output one
    [heads, tokens] x [tokens, latent] product (half the tensor ops of the general form; float
    rounding differs from it in the last bits: the scale is applied to both score terms
    separately); the scheme's deprecated fused attention (``m.one``) first where it has one."""
    r = m.rotary[0]._rotation(cos, sin)                                    # [rope, rope]
    if m.one is not None:
        fused = m.one(x, r, cache)
        if fused is not None:
            return fused
    cfg = m.cfg
    nh, nope, rope = m.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q, ckv = m._q_and_latent(x.view(1, -1))
    q_pass, q_rot = q.view(nh, nope + rope).split([nope, rope], dim=-1)
    kv_nope, k_rot = ckv.split([m.kv_lora_rank, rope], dim=-1)
    latent, k_all = cache.append(m.kv_a_layernorm(kv_nope).view(1, 1, 1, -1), (k_rot @ r).view(1, 1, 1, -1))
    lat, kr = latent[0, 0], k_all[0, 0]                                    # [n, kv_lora], [n, rope]
    if m.layout.kind != "dense":
        q_lat = m.k_b.forward_all(q_pass.unsqueeze(1))[:, 0]               # [nh, kv_lora]
    else:
        w_uk, w_uv_t = m._kv_b_per_head()
        q_lat = torch.bmm(q_pass.unsqueeze(1), w_uk)[:, 0]
    scores = torch.addmm(torch.mm(q_rot @ r, kr.t()), q_lat, lat.t(), beta=m.scale, alpha=m.scale)
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
    o_lat = torch.mm(p, lat).unsqueeze(1)                                   # [nh, 1, kv_lora]
    out = m.v_b.forward_all(o_lat) if m.layout.kind != "dense" else torch.bmm(o_lat, w_uv_t)
    out = out.reshape(1, 1, -1)
    if cfg.mla_use_output_gate:
        out = out * torch.sigmoid(m.g_proj(x))
    return m.o_proj(out)


# -- per block: gated MLP, routed experts, MoE ------------------------------------------------------

def _native_act(act: Any) -> bool:
    """Whether the native MLP step computes ``act`` (SiLU, SiTU, the clamped SwiGLU); a block with
    another activation is not lowered and runs its own forward."""
    try:
        compute.mlp_act(act.native)
    except QuantplugError:
        return False
    return True


def _scheme_fused(m: MLP | Experts) -> Any:
    """The scheme's deprecated fused MLP of a block without a native step (it computes SiLU
    only), or None."""
    if not m.act.is_silu:
        return None
    one = fuse_mlp(m.gate_proj, m.up_proj, m.down_proj)
    if one is not None:
        compute.deprecated_fuse("fuse_mlp", m.gate_proj.scheme)
    return one


def _lower_mlp(m: MLP) -> None:
    if not _native_act(m.act):
        return
    ok, reduce = step_reduce([m.gate_proj, m.up_proj], [m.down_proj])
    m.step = MLPStep.build(m.gate_proj, m.up_proj, m.down_proj, stacked=False, reduce=reduce,
                           act=m.act.native) if ok else None
    m.one = None if m.step is not None else _scheme_fused(m)
    m.forward = MethodType(_mlp_forward, m)  # type: ignore[method-assign]


def _mlp_forward(m: MLP, x: torch.Tensor) -> torch.Tensor:
    """:meth:`MLP.forward` lowered: few rows in one native call, one token through the scheme's
    fused MLP; else (or where the step declines) the block's own."""
    st = m.step
    if st is not None and x.numel() <= NATIVE_ROWS * x.shape[-1]:
        y = st(x)
        if y is not None:
            return y
    if m.one is not None and x.numel() == x.shape[-1]:
        return m.one(x.reshape(1, -1)).view(x.shape)
    return MLP.forward(m, x)


def _lower_experts(ex: Experts) -> None:
    if not _native_act(ex.act):
        return
    ex.step = MLPStep.build(ex.gate_proj, ex.up_proj, ex.down_proj, stacked=True, reduce=ex.qp_parallel,
                            act=ex.act.native)
    ex.one = None if ex.step is not None else _scheme_fused(ex)
    ex.forward = MethodType(_experts_forward, ex)  # type: ignore[method-assign]
    # the experts' step entry points engines call (``quantplug.bridge``, the conformance kit)
    ex.forward_step = MethodType(experts_step, ex)
    ex.forward_one = MethodType(experts_one, ex)


def experts_step(ex: Experts, x: torch.Tensor, ids: Sequence[Sequence[int]],
                 weights: Sequence[Sequence[float]]) -> torch.Tensor:
    """Few tokens x [M, hidden] through their experts ``ids[r]`` (weights ``weights[r]``) in one
    native call (``ex.step``, or the expert store's), this rank's experts only, each token's experts
    summed in ascending id order as the other paths sum them (bound as ``ex.forward_step``)."""
    pairs = sorted((e - ex.slot_base, r, w) for r, (es, ws) in enumerate(zip(ids, weights))
                   for e, w in zip(es, ws) if ex.first <= e < ex.first + ex.count)
    if ex.qp_store is not None:  # served from the checkpoint's files
        out = ex.qp_store.forward_step(x, [(r, s, w) for s, r, w in pairs])
        return ex.qp_parallel(out) if ex.qp_parallel is not None else out
    y = ex.step(x, [(r, s, w) for s, r, w in pairs]) if ex.step is not None else None
    if y is None:  # the step cannot run now (library off, tensors moved): the grouped path
        idx = torch.tensor([list(es) for es in ids], dtype=torch.long, device=x.device)
        w = torch.tensor([list(ws) for ws in weights], dtype=torch.float32, device=x.device)
        return ex.forward(x, idx, w)
    return y


def experts_one(ex: Experts, x: torch.Tensor, ids: Sequence[int], weights: Sequence[float]) -> torch.Tensor:
    """One token [1, hidden] through its experts ``ids`` (weights as floats) in one call of the
    scheme's fused MLP (``ex.one``, :meth:`LinearScheme.fuse_mlp`), this rank's experts only, in
    ascending id order as the other paths sum them (bound as ``ex.forward_one``)."""
    hit = sorted((e, w) for e, w in zip(ids, weights) if ex.first <= e < ex.first + ex.count)
    out = torch.zeros_like(x) if not hit else ex.one(x, [e - ex.slot_base for e, _ in hit], [w for _, w in hit])
    return ex.qp_parallel(out) if ex.qp_parallel is not None else out


def _experts_forward(ex: Experts, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:meth:`Experts.forward` lowered for one token (a decode step): its top-k experts read back
    once, in ascending order as the grouped path takes them; through the scheme's fused MLP, or the
    same projections one group per expert with no sort, count or gather ops, rows summed in that
    order. More tokens, or experts served from files, run the block's own."""
    if x.shape[0] != 1 or ex.qp_store is not None:
        return Experts.forward(ex, x, idx, w)
    ids = idx[0].tolist()
    hit = sorted((e, j) for j, e in enumerate(ids) if ex.first <= e < ex.first + ex.count)
    if not hit:
        out = torch.zeros_like(x)
        return ex.qp_parallel(out) if ex.qp_parallel is not None else out
    if ex.one is not None:
        return experts_one(ex, x, ids, w[0].tolist())
    groups = [(e - ex.slot_base, 1) for e, _ in hit]
    xs = x.expand(len(hit), -1)
    if ex.gate_up is not None:
        gate, up = ex.gate_up(xs, groups).split(ex.gate_proj.out_features, dim=-1)
        hs = ex.act(gate, up)
    else:
        hs = ex.act(ex.gate_proj.forward_grouped(xs, groups), ex.up_proj.forward_grouped(xs, groups))
    hs = (ex.down_proj.forward_grouped(hs, groups) * w[0, [j for _, j in hit]].unsqueeze(-1)).to(x.dtype)
    out = hs[:1]
    for r in range(1, len(hit)):
        out = out + hs[r:r + 1]
    if ex.qp_parallel is not None:
        out = ex.qp_parallel(out)
    return out


def _lower_moe(m: MoE) -> None:
    if "forward_step" not in m.experts.__dict__:  # its experts are not lowered (an architecture's own)
        return
    spec = getattr(m.gate, "spec", None)
    if spec is None or not spec.by_token:  # the lowered routing without ids cannot route by token
        m._routed = MethodType(_moe_routed, m)  # type: ignore[method-assign]
    if type(m)._route_rows is MoE._route_rows:
        m._route_rows = MethodType(_moe_route_rows, m)  # type: ignore[method-assign]


def _moe_route_rows(m: MoE, route: torch.Tensor, flat: torch.Tensor, shape: Any, ids: torch.Tensor | None) -> torch.Tensor:
    """:meth:`MoE._route_rows` lowered: with token ids (DeepSeek-V4 passes them to every MoE), few
    tokens routed on Python numbers by the router's declared spec (``route_ids`` where it routes by
    token id, ``route_one`` otherwise) and every token's experts in one native call (or the expert
    store's, as :func:`_moe_routed` serves them: the same arithmetic either way); without ids,
    :meth:`MoE._routed` (lowered); else the block's own."""
    if ids is None:
        return m._routed(route, flat, shape)
    ex: Any = m.experts
    spec = getattr(m.gate, "spec", None)
    route = route.reshape(-1, route.shape[-1])
    n = flat.shape[0]
    if isinstance(spec, RouterSpec) and (ex.step is not None or ex.qp_store is not None) and n <= NATIVE_ROWS:
        if spec.by_token:
            rows_ids, rows_w = m.gate.route_ids(route, ids)
        elif n == 1:
            one_ids, one_w = m.gate.route_one(route)
            rows_ids, rows_w = [one_ids], [one_w]
        else:
            idx, w = m.gate(route, ids=ids)
            rows_ids, rows_w = idx.tolist(), w.tolist()
        _prefetch_next(m, route, ids)
        return ex.forward_step(flat, rows_ids, rows_w).view(shape)
    return MoE._route_rows(m, route, flat, shape, ids)


def _moe_routed(m: MoE, route: torch.Tensor, flat: torch.Tensor, shape: Any) -> torch.Tensor:
    """:meth:`MoE._routed` lowered: few tokens (a decode step, a small batch) routed on Python numbers
    (``gate.route_one`` for one token) and every token's experts in one native call; one token
    through the scheme's fused MLP (no routing tensors, and, as for every fused call, no forward
    hooks of the router or the expert linears); else the block's own."""
    ex: Any = m.experts
    route = route.reshape(-1, route.shape[-1])
    if (ex.step is not None or ex.qp_store is not None) and flat.shape[0] <= NATIVE_ROWS:
        if flat.shape[0] == 1:
            ids, ws = m.gate.route_one(route)
            rows_ids, rows_w = [ids], [ws]
        else:
            idx, w = m.gate(route)
            rows_ids, rows_w = idx.tolist(), w.tolist()
        _prefetch_next(m, route)
        return ex.forward_step(flat, rows_ids, rows_w).view(shape)
    if flat.shape[0] == 1 and ex.one is not None:
        return ex.forward_one(flat, *m.gate.route_one(route)).view(shape)
    return MoE._routed(m, route, flat, shape)


def _prefetch_next(m: MoE, flat: torch.Tensor, ids: torch.Tensor | None = None) -> None:
    """Experts served from files: start reading the next MoE layer's likely experts (its router on
    this layer's input, one row; a router that routes by token id: exactly the token's experts, from
    ``ids``) while this layer computes."""
    nxt = m.qp_next
    store = None if nxt is None else nxt.experts.qp_store
    if nxt is None or store is None or not m.qp_prefetch or flat.shape[0] != 1:
        return
    ex = nxt.experts
    spec = getattr(nxt.gate, "spec", None)
    if isinstance(spec, RouterSpec) and spec.by_token:
        if ids is None or ids.numel() != 1:
            return
        chosen = nxt.gate.route_ids(flat, ids)[0][0]
    else:
        chosen, _ = nxt.gate.route_one(flat)
    store.prefetch([e - ex.slot_base for e in chosen if ex.first <= e < ex.first + ex.count])


# -- per block: KDA ----------------------------------------------------------------------------------

def _lower_kda(m: KDA) -> None:
    m.step = kda_step
    m.forward = MethodType(_kda_forward, m)  # type: ignore[method-assign]


def _kda_forward(m: KDA, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                 cache: Any = None) -> torch.Tensor:
    """:meth:`KDA.forward` lowered: a decode token through :meth:`KDA.token` with the native kernel
    (:func:`quantplug.kernels.kda.kda_step`); where it declines, the block's own."""
    if x.shape[1] == 1 and cache is not None and m.step is not None and cache.length < cache.limit:
        out = m.token(x, cache, m.step)
        if out is not None:
            return out
    return KDA.forward(m, x, cos, sin, cache)


# -- per block: hyper-connections (mHC) --------------------------------------------------------------

def _lower_hyper(m: HyperConnection) -> None:
    m.step = HyperStep.build(m, m.hc_mult, m.sinkhorn_iters, m.hc_eps, m.norm_eps, head=False)
    m.forward = MethodType(_hyper_forward, m)  # type: ignore[method-assign]


def _hyper_forward(m: HyperConnection, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """:meth:`HyperConnection.forward` lowered: few float32 rows mixed natively (the weights, the
    Sinkhorn and the collapse in one call, the expansion in another) around ``sublayer``; else (or
    where the step declines) the block's own."""
    st = m.step
    if st is not None and x.numel() <= NATIVE_ROWS * x.shape[-1] * x.shape[-2]:
        got = st.pre(x)
        if got is not None:
            u, _, post, comb = got
            f = sublayer(u)
            y = st.post(f, x, post, comb) if f.dtype == torch.float32 else None
            return y if y is not None else HyperConnection.expand(f, x, post, comb)
    return HyperConnection.forward(m, x, sublayer)


def _lower_hyper_head(m: HyperHead) -> None:
    m.step = HyperStep.build(m, m.hc_mult, 1, m.hc_eps, m.norm_eps, head=True)
    m.forward = MethodType(_hyper_head_forward, m)  # type: ignore[method-assign]


def _hyper_head_forward(m: HyperHead, x: torch.Tensor) -> torch.Tensor:
    """:meth:`HyperHead.forward` lowered: few float32 rows collapsed natively; else the block's own."""
    st = m.step
    if st is not None and x.numel() <= NATIVE_ROWS * x.shape[-1] * x.shape[-2]:
        got = st.pre(x)
        if got is not None:
            return got[0]
    return HyperHead.forward(m, x)


# -- per block: DeepSeek-V4's attention (sliding window with sinks, compressor, indexer) --------------

def _lower_v4_attention(m: V4Attention) -> None:
    cfg = m.cfg
    mods: dict[str, Any] = {"wq_a": m.wq_a, "wq_b": m.wq_b, "wkv": m.wkv, "wo_a": m.wo_a, "wo_b": m.wo_b}
    floats = {"q_norm": m.q_norm.weight, "kv_norm": m.kv_norm.weight, "sink": m.attn_sink.weight}
    watch: list[tuple[Any, str]] = [(m.q_norm, "weight"), (m.kv_norm, "weight"), (m.attn_sink, "weight")]
    if any(getattr(x, "qp_parallel", None) is not None for x in mods.values()):
        return
    if m.compressor is not None:
        c = m.compressor
        mods |= {"c_wkv": c.wkv, "c_wgate": c.wgate}
        floats |= {"c_ape": c.ape.weight, "c_norm": c.norm.weight}
        watch += [(c.ape, "weight"), (c.norm, "weight")]
    if m.indexer is not None:
        i = m.indexer
        mods |= {"i_wq": i.wq_b, "ic_wkv": i.compressor.wkv, "ic_wgate": i.compressor.wgate}
        floats |= {"i_w": i.weights_proj.weight, "ic_ape": i.compressor.ape.weight, "ic_norm": i.compressor.norm.weight}
        watch += [(i.weights_proj, "weight"), (i.compressor.ape, "weight"), (i.compressor.norm, "weight")]
    m.step = WindowAttnStep.build(
        mods=mods, floats=floats, hidden=cfg.hidden_size, nh=cfg.num_heads, hd=cfg.head_dim, rope=cfg.rope_dim,
        q_lora=cfg.q_lora_rank, groups=cfg.o_groups, o_rank=cfg.o_lora_rank, window=cfg.sliding_window, eps=cfg.eps,
        ratio=cfg.compress_ratio, overlap=cfg.compress_ratio == 4,
        idx_heads=cfg.index_n_heads if m.indexer is not None else 0,
        idx_dim=cfg.index_head_dim if m.indexer is not None else 0,
        idx_topk=cfg.index_topk if m.indexer is not None else 0, watch=watch)
    m.forward = MethodType(_v4_attention_forward, m)  # type: ignore[method-assign]


def _pool_buffers(c: V4Compressor, st: CompressorState, b: int, rope: Any) -> PoolBuffers | None:
    """A compressor's state as one decode call's buffers (the cache's tensors copied in)."""
    r, dim = c.ratio, c.dim
    width = dim * (2 if c.overlap else 1)
    pending = 0 if st.kv is None else st.kv.shape[1]
    n = st.count
    if pending >= r or (st.kv is not None and (st.kv.dtype != torch.float32 or st.kv.shape[0] != b)):
        return None
    kv, gate = torch.empty(b, pending + 1, width), torch.empty(b, pending + 1, width)
    if pending:
        assert st.kv is not None and st.gate is not None
        kv[:, :pending], gate[:, :pending] = st.kv, st.gate
    done = pending + 1 == r
    ent = torch.empty(b, n + int(done), dim)
    if n:
        assert st.entries is not None
        ent[:, :n] = st.entries
    prev_kv = prev_gate = out_kv = out_gate = None
    if c.overlap:
        if st.prev_kv is not None and st.prev_gate is not None:
            prev_kv, prev_gate = st.prev_kv.float().contiguous(), st.prev_gate.float().contiguous()
        if done:
            out_kv, out_gate = torch.empty(b, r, dim), torch.empty(b, r, dim)
    cos, sin = rope.cos_sin(torch.tensor([r * n]))
    return PoolBuffers(kv, gate, pending, n, ent, prev_kv, prev_gate, out_kv, out_gate,
                       cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous())


def _pool_commit(st: CompressorState, buf: PoolBuffers, r: int) -> None:
    """The state after the call, as the compressor's forward leaves it."""
    if buf.pending + 1 == r:
        st.kv, st.gate = buf.kv[:, :0], buf.gate[:, :0]
        if buf.prev_kv_out is not None:
            st.prev_kv, st.prev_gate = buf.prev_kv_out, buf.prev_gate_out
    else:
        st.kv, st.gate = buf.kv, buf.gate
    st.entries = buf.ent


def _window_buffers(m: V4Attention, b: int, cache: Any) -> tuple[Any, ...] | None:
    """One decode call's buffers of the attention's cache (the window with room for this token's
    row, the rotation of the position, the compressors' :class:`PoolBuffers`), the cache's tensors
    copied in; None where the cache holds what the native step does not take."""
    win_old = cache.window
    if win_old is not None and (win_old.dtype != torch.float32 or win_old.shape[0] != b):
        return None
    have = 0 if win_old is None else win_old.shape[1]
    if have + 1 > m.cfg.sliding_window:
        return None
    win = torch.empty(b, have + 1, m.cfg.head_dim)
    if have:
        win[:, :have] = win_old
    comp = idx = None
    if m.compressor is not None:
        comp = _pool_buffers(m.compressor, cache.compressor, b, m.rope)
        if comp is None:
            return None
        if m.indexer is not None:
            idx = _pool_buffers(m.indexer.compressor, cache.indexer, b, m.rope)
            if idx is None:
                return None
    cos, sin = m.rope.cos_sin(torch.tensor([cache.length]))
    return win, cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous(), comp, idx


def _window_commit(m: V4Attention, cache: Any, bufs: tuple[Any, ...]) -> None:
    """The cache after one native token, as the block's forward leaves it (its roll-back log included)."""
    win, _, _, comp, idx = bufs
    w = m.cfg.sliding_window
    cache.window = win[:, max(win.shape[1] - (w - 1), 0):] if w > 1 else win[:, :0]
    if comp is not None:
        assert m.compressor is not None
        _pool_commit(cache.compressor, comp, m.compressor.ratio)
    if idx is not None:
        assert m.indexer is not None
        _pool_commit(cache.indexer, idx, m.indexer.ratio)
    cache.length += 1
    if cache.logging:  # the roll-back log the block's forward keeps (V4Attention.truncate_cache)
        row = win[:, -1:]
        cache.log = row if cache.log is None else torch.cat([cache.log, row], dim=1)
        for buf, st in ((comp, cache.compressor), (idx, cache.indexer)):
            if buf is not None and st.log:
                p = buf.pending
                kv, gate = buf.kv[:, p:p + 1], buf.gate[:, p:p + 1]
                st.log_kv = kv if st.log_kv is None else torch.cat([st.log_kv, kv], dim=1)
                st.log_gate = gate if st.log_gate is None else torch.cat([st.log_gate, gate], dim=1)
        m._forget(cache)


def _v4_attention_forward(m: V4Attention, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
    """:meth:`V4Attention.forward` lowered: one decode token (float32, a cache) in one native call
    (the window append, the compressors' rows and any entry they complete, the indexer's choice,
    the attention with its sinks, the grouped output projection), the cache's tensors updated as the
    block's forward updates them (the torch path continues on them); else the block's own."""
    st = m.step
    if st is None or cache is None or x.dim() != 3 or x.shape[1] != 1 or x.dtype != torch.float32 or not st.live():
        return V4Attention.forward(m, x, cache)
    b = x.shape[0]
    bufs = _window_buffers(m, b, cache)
    out = None if bufs is None else st(x.reshape(b, -1), bufs[1], bufs[2], bufs[0], bufs[3], bufs[4])
    if out is None or bufs is None:
        return V4Attention.forward(m, x, cache)
    _window_commit(m, cache, bufs)
    return out.view(b, 1, -1)


#: block type -> the function binding its native step (a subclass that keeps the type's forward
#: takes its lowering; one with its own forward is not lowered)
LOWERINGS: dict[type[nn.Module], Callable[[Any], None]] = {
    MLA: _lower_mla, MLP: _lower_mlp, Experts: _lower_experts, MoE: _lower_moe, KDA: _lower_kda,
    HyperConnection: _lower_hyper, HyperHead: _lower_hyper_head, V4Attention: _lower_v4_attention,
}
#: the method each lowering binds over (a subclass overriding it keeps its own)
_BINDS = {MLA: "_attend", MLP: "forward", Experts: "forward", MoE: "_routed", KDA: "forward",
          HyperConnection: "forward", HyperHead: "forward", V4Attention: "forward"}


def lowering(block: nn.Module) -> Callable[[Any], None] | None:
    """The lowering of ``block``'s type, or None (it runs its forward)."""
    for cls in type(block).__mro__:
        fn = LOWERINGS.get(cls)
        if fn is not None:
            name = _BINDS.get(cls)
            return fn if name is None or getattr(type(block), name) is getattr(cls, name) else None
    return None


def accelerate(model: nn.Module) -> None:
    """Bind the native steps of every block of ``model`` whose type has a lowering (children before
    their parents: an MoE sees its experts' steps), link each text model's MoE layers in order (a
    decode step prefetches the next one's experts where they are served from files) and forget any
    whole-stack step built before (the next decode step builds it on the lowered blocks)."""
    for mod in reversed(list(model.modules())):
        fn = lowering(mod)
        if fn is not None:
            fn(mod)
        layers = mod.__dict__.get("_modules", {}).get("layers")
        if isinstance(layers, nn.ModuleList):
            moes = [m for layer in layers for m in layer.modules() if isinstance(m, MoE)]
            for a, b in zip(moes, moes[1:]):
                object.__setattr__(a, "qp_next", b)  # a reference, not a submodule (no second name, no state)
            mod.__dict__.pop("_stack", None)  # the whole-stack step is built on first use


# -- the whole stack ---------------------------------------------------------------------------------

def stack_step(layers: Sequence[nn.Module], norm: RMSNorm, extra: Sequence[nn.Module]) -> StackStep | None:
    """The native step of decoder ``layers`` then the final ``norm`` in one call
    (:class:`quantplug.kernels.compute.StackStep`; ``extra``: other modules whose hooks it would
    skip); None when any layer runs another way: not a plain pre-norm layer of MLA and MLP / MoE,
    experts served from files or split over ranks, a piece without a native form, a router
    that declares no :class:`~quantplug.contract.routing.RouterSpec`, a DSA indexer, a float16 model."""
    parts: list[StackLayer] = []
    owners: list[tuple[nn.Module, Any]] = []
    for layer in layers:
        if not isinstance(layer, PreNormLayer) or type(layer).forward is not PreNormLayer.forward:
            return None
        attn, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        if (not isinstance(attn, MLA) or attn.step is None or attn.indexer is not None
                or not isinstance(n1, RMSNorm) or not isinstance(n2, RMSNorm) or n1.eps != n2.eps):
            return None
        owners.append((attn, attn.step))
        if isinstance(mlp, MLP):
            if mlp.step is None:
                return None
            parts.append(StackLayer(mla=attn.step, attn_norm=n1.weight, ffn_norm=n2.weight, eps=n1.eps, mlp=mlp.step))
            owners.append((mlp, mlp.step))
            continue
        if not isinstance(mlp, MoE):
            return None
        spec = getattr(mlp.gate, "spec", None)  # the native step routes by the router's declared spec
        if not isinstance(spec, RouterSpec):
            return None
        ex, shared = mlp.experts, mlp.shared_experts
        if (ex.step is None or ex.qp_store is not None or ex.qp_parallel is not None
                or (ex.first, ex.count, ex.slot_base) != (0, ex.n, 0) or len(ex.step.gate.mats) != ex.n
                or (shared is not None and shared.step is None)):
            return None
        owners += [(ex, ex.step)] + ([] if shared is None else [(shared, shared.step)])
        parts.append(StackLayer(mla=attn.step, attn_norm=n1.weight, ffn_norm=n2.weight, eps=n1.eps,
                                experts=ex.step, router=mlp.gate.weight, spec=spec,
                                bias=getattr(mlp.gate, "e_score_correction_bias", None) if spec.has_bias else None,
                                tid2eid=getattr(mlp.gate, "tid2eid", None) if spec.by_token else None,
                                shared=None if shared is None else shared.step))
    modules = [m for layer in layers for m in layer.modules()] + list(extra)
    return StackStep.build(parts, norm.weight, norm.eps, norm.weight.numel(), modules, owners)


def text_stack(tm: Any) -> StackStep | None:
    """The whole-stack native decode step of a text model (its declared ``layers`` and final
    ``norm``), built once on first use; None when any layer runs another way (:func:`stack_step`):
    always for a DSA model (DeepSeek-V3.2), whose MLA steps neither write the indexer's keys nor
    select keys, so it decodes layer by layer. An engine that keeps its own (paged) latent cache
    asks for it as ``decode_stack()`` (:func:`quantplug.bridge.paged_decode`)."""
    d = tm.__dict__
    if "_stack" in d:  # built, or declined (None)
        return d["_stack"]
    st = d["_stack"] = stack_step(list(tm.layers), tm.norm, [tm.norm])
    return st


def bindings(tm: Any, head: nn.Module) -> tuple[compute.Bound, compute.Bound] | None:
    """The native bindings of the text model's embedding and of ``head`` (any head module), or None
    when either runs another way (split over ranks, hooked, no native form)."""
    emb = tm.embed_tokens
    if emb.qp_parallel is not None or _hooked(emb) or _hooked(head) or getattr(head, "qp_parallel", None) is not None:
        return None
    embed = compute.bound(emb)
    hb = compute.bound(head.qp_tied_embedding() if isinstance(head, TiedHead) else head)
    return None if embed is None or hb is None else (embed, hb)


def decode_logits(tm: Any, ids: torch.Tensor, cache: Any, head: nn.Module,
                  pick: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One decode step (``ids`` [B, 1] after the ``cache``'s tokens) from token ids to float32
    logits [B, vocab] through ``head``, in one native call: the embedding lookup, the whole stack
    (:func:`text_stack`) and the head; what the text model's forward and then ``head`` compute.
    Returns (logits, with ``pick`` the greedy tokens [B] = ``logits.argmax(-1)``, else None); None
    (nothing appended) when a piece runs another way: then the caller runs the modules."""
    if ids.dim() != 2 or ids.shape[1] != 1 or ids.shape[0] > NATIVE_ROWS:
        return None
    d = tm.__dict__
    st = d["_stack"] if "_stack" in d else text_stack(tm)
    if st is None:
        return None
    bound = bindings(tm, head)
    if bound is None:
        return None
    rot = tm.rotary.step_rotation(cache.length, st.dtype)
    got = st.logits(ids, bound[0], rot, cache.layers, bound[1], pick)
    if got is None:
        return None
    assert got[1] is not None  # a head was given
    return got[1], got[2]


def sequence_logits(tm: Any, ids: torch.Tensor, cache: Any, head: nn.Module,
                    pick: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``ids`` [1, T] (T <= NATIVE_ROWS) after the ``cache``'s tokens (batch 1) in one native call:
    embedding, the whole stack with each token attending causally on the cache and the tokens
    before it, and ``head`` (:meth:`StackStep.sequence`), row by row as T one-token steps. Returns
    (the final norm [1, T, hidden], float32 logits [T, vocab], with ``pick`` the greedy picks [T]);
    None (nothing appended) when a piece runs another way. Speculative decoding verifies its
    draft this way."""
    if ids.dim() != 2 or ids.shape[0] != 1 or not 1 <= ids.shape[1] <= NATIVE_ROWS:
        return None
    st = text_stack(tm)
    bound = None if st is None else bindings(tm, head)
    if st is None or bound is None:
        return None
    rot = tm.rotary.step_rotations(cache.length, ids.shape[1], st.dtype)
    got = st.sequence(ids[0], None, bound[0], rot, cache.layers, bound[1], pick)
    if got is None:
        return None
    assert got[1] is not None  # a head was given
    return got[0], got[1], got[2]


def decode_hidden(tm: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any) -> torch.Tensor | None:
    """The text model's normed hidden states [B, 1, hidden] of embedded tokens ``x`` [B, 1, hidden]
    (one decode step after the ``cache``'s tokens) through the whole-stack step; None (nothing
    appended) when it does not run: then the layers' forwards run."""
    if x.shape[1] != 1 or x.shape[0] > NATIVE_ROWS:
        return None
    d = tm.__dict__
    st = d["_stack"] if "_stack" in d else text_stack(tm)
    return None if st is None else st(x, tm.rotary._rotation(cos, sin), cache.layers)


# -- multi-token prediction ----------------------------------------------------------------------------

def mtp_stack(mtp: Any) -> StackStep | None:
    """An MTP layer's block and ``shared_head.norm`` (``mtp.block`` / ``mtp.head_norm``) as one native
    step (:func:`stack_step`), built on first use; None where the block runs another way."""
    st = mtp.__dict__.get("_stack", False)
    if st is False:
        st = stack_step([mtp.block], mtp.head_norm, [mtp.head_norm])
        object.__setattr__(mtp, "_stack", st)  # not a submodule: a step over this layer's modules
    return st


def draft_step(mtp: Any) -> DraftStep | None:
    """The whole MTP layer as the drafter of a native speculative step (:class:`DraftStep`: its
    ``enorm`` / ``hnorm`` / ``eh_proj`` then :func:`mtp_stack`), built on first use; None where the
    block runs another way."""
    st = mtp.__dict__.get("_draft", False)
    if st is False:
        st = DraftStep.build(mtp_stack(mtp), mtp.enorm, mtp.hnorm, mtp.eh_proj)
        object.__setattr__(mtp, "_draft", st)
    return st


def mtp_logits(lm: Any, mtp: Any, next_ids: torch.Tensor, hidden: torch.Tensor, cache: Any,
               start: int) -> torch.Tensor | None:
    """The draft logits of ``lm``'s MTP layer ``mtp`` for one sequence (``next_ids`` [1, T], T <=
    NATIVE_ROWS, at positions from ``start``) with the MTP block, its head norm and the LM head in
    one native call (:func:`mtp_stack`; the norms and ``eh_proj`` before it as the modules run
    them); None when a piece runs another way (nothing appended)."""
    if next_ids.shape[0] != 1 or next_ids.shape[1] > NATIVE_ROWS:
        return None
    st = mtp_stack(mtp)
    bound = None if st is None else bindings(lm.model, lm.lm_head)
    if st is None or bound is None:
        return None
    embeds = lm.model.embed_tokens(next_ids)
    u = mtp.mix(embeds, hidden.to(embeds.dtype))[0]
    rot = lm.model.rotary.step_rotations(start, next_ids.shape[1], st.dtype)
    got = st.sequence(None, u, None, rot, cache.layers, bound[1])
    if got is None or got[1] is None:
        return None
    return got[1].unsqueeze(0)


def speculative_step(lm: Any, last: torch.Tensor, draft: torch.Tensor, cache: Any,
                     mtp_cache: Any) -> tuple[list[int], bool, torch.Tensor, torch.Tensor] | None:
    """One greedy speculative step of batch 1 in one native call (``qp_spec_step``): the main model
    on (``last``, ``draft``) [1] each after the ``cache``'s tokens, accepted when its pick after
    ``last`` is ``draft``; then the first MTP layer on the accepted pairs, appended to
    ``mtp_cache``, and the LM head on its last row. Returns (the picks after ``last`` and after
    ``draft``, accepted, the draft logits [1, vocab] as the MTP layer's modules give the last
    row's, float32 logits [2, vocab] of both positions); the main cache holds both tokens (the
    caller rolls ``draft`` back when rejected). None when a piece runs another way (nothing
    appended): then the caller runs the modules."""
    if not len(lm.mtp):
        return None
    mtp = lm.mtp[0]
    st, dr = text_stack(lm.model), draft_step(mtp)
    if st is None or dr is None or _hooked(mtp):
        return None
    bound = bindings(lm.model, lm.lm_head)
    proj = compute.bound(mtp.eh_proj)
    if bound is None or proj is None:
        return None
    rotary = lm.model.rotary
    rot = rotary.step_rotations(cache.length, 2, st.dtype)
    drot = rotary.step_rotations(mtp_cache.length + 1, 2, st.dtype)
    ids = torch.cat([last.reshape(1), draft.reshape(1)])
    got = st.speculate(ids, bound[0], rot, cache.layers, bound[1], dr, proj, mtp_cache.layers, drot)
    if got is None:
        return None
    _, logits, dlogits, (a, b, acc) = got
    return [a, b], acc, dlogits, logits


# -- a stack of hyper-connection blocks (DeepSeek-V4) in one call ------------------------------------

def hyper_stack(layers: Sequence[nn.Module], head_hc: HyperHead, norm: RMSNorm,
                extra: Sequence[nn.Module]) -> HyperStackStep | None:
    """The native step of ``layers`` (blocks holding ``hc_attn`` / ``attn_norm`` / ``attn`` (a
    :class:`V4Attention`) / ``hc_ffn`` / ``ffn_norm`` / ``ffn`` (a :class:`MoE` whose router
    declares a spec), run as ``x = hc_attn(x, attn(attn_norm(.)))`` then ``x = hc_ffn(x,
    ffn(ffn_norm(.), ids))``), the head's collapse ``head_hc`` and the final ``norm`` in one call
    (:class:`~quantplug.kernels.compute.HyperStackStep`); None when any piece runs another way (no
    native step, experts served from files or split, a float16 / bfloat16 model...)."""
    parts: list[HyperStackLayer] = []
    owners: list[tuple[nn.Module, Any]] = []
    watch: list[tuple[Any, str]] = [(norm, "weight")]
    for layer in layers:
        hca, hcf = getattr(layer, "hc_attn", None), getattr(layer, "hc_ffn", None)
        attn, ffn = getattr(layer, "attn", None), getattr(layer, "ffn", None)
        n1, n2 = getattr(layer, "attn_norm", None), getattr(layer, "ffn_norm", None)
        if (not isinstance(hca, HyperConnection) or not isinstance(hcf, HyperConnection) or hca.step is None
                or hcf.step is None or not isinstance(attn, V4Attention) or attn.step is None
                or not isinstance(ffn, MoE) or ffn.latent is not None or not isinstance(n1, RMSNorm)
                or not isinstance(n2, RMSNorm) or n1.eps != n2.eps):
            return None
        spec = getattr(ffn.gate, "spec", None)
        ex, shared = ffn.experts, ffn.shared_experts
        if (not isinstance(spec, RouterSpec) or ex.step is None or ex.qp_store is not None or ex.qp_parallel is not None
                or (ex.first, ex.count, ex.slot_base) != (0, ex.n, 0) or len(ex.step.gate.mats) != ex.n
                or (shared is not None and shared.step is None)):
            return None
        owners += [(hca, hca.step), (hcf, hcf.step), (attn, attn.step), (ex, ex.step)]
        watch += [(n1, "weight"), (n2, "weight"), (ffn.gate, "weight")]
        watch += [(ffn.gate, "e_score_correction_bias")] if spec.has_bias else []
        watch += [(ffn.gate, "tid2eid")] if spec.by_token else []
        if shared is not None:
            owners.append((shared, shared.step))
        parts.append(HyperStackLayer(
            hc_attn=hca.step, hc_ffn=hcf.step, attn_norm=n1.weight, ffn_norm=n2.weight, eps=n1.eps, attn=attn.step,
            experts=ex.step, router=ffn.gate.weight, spec=spec,
            bias=getattr(ffn.gate, "e_score_correction_bias", None) if spec.has_bias else None,
            tid2eid=getattr(ffn.gate, "tid2eid", None) if spec.by_token else None,
            shared=None if shared is None else shared.step))
    if head_hc.step is None:
        return None
    owners.append((head_hc, head_hc.step))
    modules = [m for layer in layers for m in layer.modules()] + [head_hc, norm, *extra]
    return HyperStackStep.build(parts, head_hc.step, norm.weight, norm.eps, norm.weight.numel(), modules, owners, watch)


def hyper_decode_logits(tm: Any, ids: torch.Tensor, cache: Any,
                        pick: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One decode step of a hyper-connection text model (``tm.embed``, ``tm.layers``, ``tm.hc_head``,
    ``tm.norm``, ``tm.head``; DeepSeek-V4) from token ids ``ids`` [B, 1] to float32 logits [B, vocab]
    in one native call (:func:`hyper_stack`, built once), the cache's tensors updated as the blocks'
    forwards update them. Returns (logits, with ``pick`` the greedy tokens [B]); None (the cache
    untouched) when a piece runs another way: then the caller runs the modules."""
    if ids.dim() != 2 or ids.shape[1] != 1 or ids.shape[0] > NATIVE_ROWS or ids.dtype != torch.int64:
        return None
    d = tm.__dict__
    if "_stack" not in d:
        d["_stack"] = hyper_stack(list(tm.layers), tm.hc_head, tm.norm, [tm.embed, tm.head])
    st = d["_stack"]
    if st is None or not st.live() or _hooked(tm) or _hooked(tm.embed) or _hooked(tm.head):
        return None
    if getattr(tm.embed, "qp_parallel", None) is not None or getattr(tm.head, "qp_parallel", None) is not None:
        return None
    emb, head = compute.bound(tm.embed), compute.bound(tm.head)
    if emb is None or head is None:
        return None
    b = ids.shape[0]
    bufs = []
    for layer, c in zip(tm.layers, cache.layers):
        one = _window_buffers(layer.attn, b, c)
        if one is None:
            return None
        bufs.append(one)
    got = st(ids[:, 0], emb, head, bufs, pick)
    if got is None:
        return None
    for layer, c, one in zip(tm.layers, cache.layers, bufs):
        _window_commit(layer.attn, c, one)
    assert got[1] is not None
    return got[1], got[2]
