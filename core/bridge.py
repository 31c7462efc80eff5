"""quantplug's loaded layers under Hugging Face module names, for engines that run them inside
their own model (the vLLM plugin ``quantplug-vllm``, the transformers bridge
``quantplug-transformers``).

An engine builds its own DeepSeek-V3 (or Kimi-Linear) module tree; quantplug's plan has decided, for every
projection of the checkpoint, how it is stored and computed. :func:`planned_modules` hands the
engine those decisions as loaded, callable modules under the names the engine's tree uses
(``model.layers.3.self_attn.q_a_proj``, ``model.layers.3.mlp.experts``, ``lm_head``...), so the
engine's layer delegates its product to quantplug's planned module (its scheme's ``apply`` /
``apply_grouped``, fused where the scheme fuses) and never sees a quantized format.
:func:`float_state` gives the float tensors the engine keeps as its own parameters (norms, the
router). Nothing here is engine-specific, nor architecture-specific: what differs between
architectures (merged projections, the engines' names, float tensors held in another form, why no
engine takes a model) is what the model classes declare (:mod:`quantplug.models.declarations`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from .errors import QuantplugError
from .kernels import compute, native
from .kernels.compute import NATIVE_ROWS
from .layers.embedding import Embedding, TiedHead
from .layers.linear import DenseScheme, FloatParams, QuantLinear, StackedLinear
from .layers.rope import Rotary
from .models.declarations import (
    DeclarationError,
    EngineExperts,
    EngineFloats,
    EngineGroupedLinear,
    EngineLatentAttention,
    EngineMLP,
    EngineRename,
    LatentAttention,
    RoutedExperts,
    declared,
)

_V = TypeVar("_V")


class KVBFromSplit(nn.Module):
    """A dense-layout ``kv_b_proj`` (``x [..., kv_lora] -> [..., heads * (nope + v)]``, K rows then
    V rows per head, as the hub stores it) computed from the split per-head stacks GGUF stores
    (``attn_k_b`` [heads: kv_lora <- nope], ``attn_v_b`` [heads: v <- kv_lora]), for engines whose
    attention consumes a dense ``kv_b_proj``.

    The V half runs through ``attn_v_b``'s scheme as stored (``forward_all``). The K half is the
    transpose of what ``attn_k_b`` stores (the stack maps nope -> kv_lora, this maps kv_lora ->
    nope), which no ``apply`` computes: it is ``x @ dequantize(k_b, h)`` per head, dequantized
    for the call and dropped after it (no dense copy is kept). Equal to the ``kv_b_proj`` that
    :func:`quantplug.api.dense_state` folds back, up to float rounding.
    """

    #: the checkpoint name it stands for (``...self_attn.kv_b_proj``)
    qp_ckpt: str

    def __init__(self, attn: LatentAttention) -> None:
        super().__init__()
        k_b, v_b = getattr(attn, "k_b", None), getattr(attn, "v_b", None)
        if not isinstance(k_b, StackedLinear) or not isinstance(v_b, StackedLinear):
            raise QuantplugError(f"{attn.qp_ckpt}: split K/V needs k_b / v_b per-head stacks")
        self.k_b, self.v_b = k_b, v_b
        self.heads = attn.num_heads
        self.nope, self.v = attn.qk_nope_head_dim, attn.v_head_dim
        self.in_features = attn.kv_lora_rank
        self.out_features = self.heads * (self.nope + self.v)
        self.qp_ckpt = attn.qp_ckpt + ".kv_b_proj"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xs = x.reshape(1, -1, self.in_features).expand(self.heads, -1, -1)      # [h, T, kv_lora]
        wk = torch.stack([self.k_b.scheme.dequantize(self.k_b, h) for h in range(self.heads)])  # [h, kv_lora, nope]
        k = torch.bmm(xs.to(wk.dtype), wk)                                       # [h, T, nope]
        v = self.v_b.forward_all(xs)                                             # [h, T, v]
        out = torch.cat([k, v.to(k.dtype)], dim=-1).transpose(0, 1)              # [T, h, nope + v]
        return out.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, in={self.in_features}, out={self.out_features}, "
                f"k_b={self.k_b.scheme.describe()}, v_b={self.v_b.scheme.describe()}")


class AbsorbedMLA:
    """The per-head products an engine's absorbed MLA decode needs, computed from the planned K/V
    weights as loaded (no dense copy kept): ``uk(q)`` = q_nope through W_UK per head (into the
    latent), ``uv(x)`` = the attention output on the latent through W_UV per head, and
    ``latent(c)``: the cached latent rows as ``kv_b_proj``'s own product sees them.

    * split K/V (GGUF ``attn_k_b`` / ``attn_v_b``): the stacks' own products
      (``StackedLinear.forward_all``: the native kernels for up to :data:`NATIVE_ROWS` tokens), as
      quantplug's own decode computes them;
    * a dense ``kv_b_proj`` [heads * (nope + v), kv_lora] in float form in the compute dtype: views
      of its weight;
    * any other dense ``kv_b_proj``: the head rows needed decoded for the call (natively where the
      layer is bound to a form, else through ``scheme.dequantize``) and dropped after it, as the
      native MLA step decodes them (one layer's rows at a time: the memory of one layer's dense
      K or V half while it runs).

    ``latent(c)``: when ``kv_b_proj``'s form quantizes its input (DeepSeek FP8 ``act_quant``), the
    expanded form computes K and V from the quantized latent, so an absorbed decode must attend on
    the quantized rows (what quantplug's native step does); ``latent`` returns them (float rows
    rounded to ``c``'s dtype). ``quantizes_latent`` says whether it changes anything;
    ``latent_unknown`` is True when ``kv_b_proj`` quantizes its input but declares no form, so the
    quantized rows cannot be formed here (the engine then attends on the float latent).
    """

    def __init__(self, attn: LatentAttention) -> None:
        self.heads, self.nope, self.v, self.kv_lora = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
        self.split = attn.layout.kind != "dense"
        self.k_b: StackedLinear | None = getattr(attn, "k_b", None) if self.split else None
        self.v_b: StackedLinear | None = getattr(attn, "v_b", None) if self.split else None
        self.kv_b: QuantLinear | None = None if self.split else getattr(attn, "kv_b_proj", None)
        kv_b = self.kv_b
        self.where = attn.qp_ckpt
        bound = None if kv_b is None else compute.bound(kv_b)
        act = None if bound is None else bound.form.act
        self.quantizes_latent = act is not None
        self.latent_unknown = kv_b is not None and not kv_b.scheme.weight_only and bound is None

    def describe(self) -> str:
        if self.split:
            assert self.k_b is not None and self.v_b is not None
            return f"k_b {self.k_b.scheme.describe()} / v_b {self.v_b.scheme.describe()} (per-head stacks)"
        assert self.kv_b is not None
        how = "views" if self._float_weight(self.kv_b.model_dtype) is not None else "head rows decoded per call"
        return f"kv_b_proj {self.kv_b.scheme.describe()} ({how})"

    def _float_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        kv_b = self.kv_b
        if kv_b is None or not isinstance(kv_b.scheme, DenseScheme) or kv_b.weight.dtype != dtype:
            return None
        return kv_b.weight.view(self.heads, self.nope + self.v, self.kv_lora)

    def _rows(self, part: str, dtype: torch.dtype) -> torch.Tensor:
        """W_UK [heads, nope, kv_lora] (``part="k"``) or W_UV [heads, v, kv_lora] (``"v"``) rows
        of the dense ``kv_b_proj``, in ``dtype`` (float32 from a decode)."""
        kv_b = self.kv_b
        assert kv_b is not None
        lo, n = (0, self.nope) if part == "k" else (self.nope, self.v)
        w = self._float_weight(dtype)
        if w is not None:
            return w[:, lo:lo + n]
        b = compute.bound(kv_b)
        if b is not None and native.library() is not None:
            out = torch.empty(self.heads, n, self.kv_lora, dtype=torch.float32)
            step = self.nope + self.v
            for h in range(self.heads):
                native.dequant(b.ptr(), h * step + lo, h * step + lo + n, out[h], b.wround)
            return out
        full = kv_b.scheme.dequantize(kv_b).view(self.heads, self.nope + self.v, self.kv_lora)
        return full[:, lo:lo + n].float()

    def uk(self, q: torch.Tensor) -> torch.Tensor:
        """q_nope [heads, T, nope] -> [heads, T, kv_lora] (per head ``q_h @ W_UK_h``)."""
        if self.k_b is not None:
            return self.k_b.forward_all(q).to(q.dtype)
        w = self._rows("k", q.dtype)
        return torch.bmm(q.to(w.dtype), w).to(q.dtype)

    def uv(self, x: torch.Tensor) -> torch.Tensor:
        """The attention output on the latent [heads, T, kv_lora] -> [heads, T, v] (per head
        ``x_h @ W_UV_h^T``)."""
        if self.v_b is not None:
            return self.v_b.forward_all(x).to(x.dtype)
        w = self._rows("v", x.dtype)
        return torch.bmm(x.to(w.dtype), w.transpose(1, 2)).to(x.dtype)

    def latent(self, c: torch.Tensor) -> torch.Tensor:
        """Latent rows c [..., kv_lora] as ``kv_b_proj``'s product quantizes them (``c`` itself
        when it does not)."""
        kv_b = self.kv_b
        b = None if kv_b is None or not self.quantizes_latent else compute.bound(kv_b)
        if b is None or native.library() is None or c.numel() == 0:
            return c
        rows = native.act_rows(b.ptr(), native._as_f32_rows(c, self.kv_lora))
        return rows.view(c.shape).to(c.dtype)


class GroupedProduct(nn.Module):
    """A block-diagonal grouped linear as an engine calls it (:class:`EngineGroupedLinear`:
    DeepSeek-V4's ``wo_a``, transformers' ``DeepseekV4GroupedLinear``): x [..., groups, in / groups]
    -> [..., groups, out / groups], through the owning block's own grouped product (the planned
    ``wo_a``'s scheme, as quantplug's forward runs it)."""

    #: the checkpoint name it stands for (``layers.L.attn.wo_a``)
    qp_ckpt: str

    def __init__(self, owner: nn.Module, entry: EngineGroupedLinear) -> None:
        super().__init__()
        linear = getattr(owner, entry.member, None)
        product = getattr(owner, entry.product, None)
        if not isinstance(linear, QuantLinear) or not callable(product):
            raise QuantplugError(f"{getattr(owner, 'qp_ckpt', type(owner).__name__)}: EngineGroupedLinear names "
                                 f"{entry.member} / {entry.product}, which it does not hold as a planned linear and "
                                 "a method")
        self.linear = linear
        self._product = product
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.qp_ckpt = linear.qp_ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-2]
        y = self._product(x.reshape(-1, 1, *x.shape[-2:]))       # [N, 1, groups * out / groups]
        return y.reshape(*lead, x.shape[-2], -1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, grouped, {self.linear.scheme.describe()}"


@dataclass
class Projection:
    """One projection of the engine's tree: ``fn(x)`` computes it, ``modules`` are the planned
    modules holding its tensors (parts in order for a merged projection, e.g. q_a then kv_a),
    ``out_features`` the width of each part, ``schemes`` what each part's plan decided, and
    ``notes`` what the engine should say at load about how it runs (e.g. a transient dequantize)."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    modules: list[nn.Module]
    in_features: int
    out_features: list[int]
    schemes: list[str]
    notes: list[str] = field(default_factory=list)
    #: under an engine's tensor parallelism (``quantplug.parallel.EngineComm``): this rank's
    #: ``(start, length)`` of the output features split over the ranks (column-parallel rows, the
    #: vocabulary block of an embedding or lm_head); None: the whole output
    shard: tuple[int, int] | None = None


def _describe(m: nn.Module) -> str:
    scheme = getattr(m, "scheme", None)
    if scheme is not None:
        return scheme.describe()
    if isinstance(m, GroupedProduct):
        return f"grouped ({m.linear.scheme.describe()})"
    if isinstance(m, KVBFromSplit):
        return f"split K/V (k_b {m.k_b.scheme.describe()}, v_b {m.v_b.scheme.describe()})"
    if isinstance(m, TiedHead):
        return f"tied to the embedding ({m._embed[0].scheme.describe()})"
    return type(m).__name__


def _single(m: nn.Module, notes: Sequence[str] = ()) -> Projection:
    return Projection(m, [m], int(getattr(m, "in_features", 0)), [int(getattr(m, "out_features", 0))],
                      [_describe(m)], list(notes))


def _merged(parts: Sequence[QuantLinear], fused: Callable[[torch.Tensor], torch.Tensor] | None) -> Projection:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if fused is not None:
            return fused(x)
        return torch.cat([p(x) for p in parts], dim=-1)

    return Projection(fn, list(parts), parts[0].in_features, [p.out_features for p in parts],
                      [_describe(p) for p in parts])


def text_model(model: nn.Module) -> nn.Module:
    """The DeepSeek-V3 text model of a loaded model (``model`` itself, or the Kimi wrapper's
    ``language_model``)."""
    text_lm = getattr(model, "text_lm", None)
    if text_lm is None:
        raise QuantplugError(f"{type(model).__name__} is not a model loaded by quantplug (no text_lm)")
    lm: nn.Module = text_lm()
    return lm


def engine_refusal(model: nn.Module) -> str | None:
    """Why an engine (vLLM, transformers) cannot take the modules of ``model`` (loaded, or a
    plan's skeleton): the model (a wrapper's class) or its text model (its class, or the instance
    for what its config enables) states it in ``qp_engine_refusal``, or the text model declares no
    ``qp_engine_plan`` at all; None when it can. Checked at plan time, before any data is read."""
    lm = text_model(model)
    for m in (model, lm) if lm is not model else (lm,):
        why = getattr(m, "qp_engine_refusal", None)
        if why:
            return f"{type(m).__name__}: {why}"
    if not any(getattr(type(m), "qp_engine_plan", None) for m in lm.modules()):
        return (f"{type(lm).__name__} declares no engine mapping (qp_engine_plan): an engine has no place for "
                "its modules")
    return None


def _engine_names(lm: nn.Module, named: Mapping[str, _V]) -> dict[str, _V]:
    """``named`` under the engines' names: the text model class's ``qp_engine_names``
    (:class:`~quantplug.models.declarations.EngineRename`, in order) applied to every key."""
    renames = getattr(type(lm), "qp_engine_names", ())
    if not renames:
        return dict(named)
    for r in renames:
        if not isinstance(r, EngineRename):
            raise DeclarationError(f"{type(lm).__name__}.qp_engine_names holds {type(r).__name__}; expected "
                                   "EngineRename entries")
    out: dict[str, _V] = {}
    for name, value in named.items():
        new = name
        for r in renames:
            new = re.sub(r.pattern, r.repl, new)
        if new in out:
            raise DeclarationError(f"{type(lm).__name__}.qp_engine_names: {name} and another name both become {new}")
        out[new] = value
    return out


def _engine_entries(lm: nn.Module) -> dict[str, tuple[nn.Module, object]]:
    """The modules the text model's ``qp_engine_plan`` names, by name, with their entries."""
    return {name: (mod, entry) for name, mod, entry in
            declared(lm, "qp_engine_plan", (EngineMLP, EngineExperts, EngineLatentAttention, EngineGroupedLinear))}


def planned_modules(model: nn.Module) -> dict[str, Projection]:
    """Every projection of the loaded text model, by the Hugging Face / vLLM module name an engine
    gives it:

    * each linear by its own name (``model.layers.{i}.self_attn.q_b_proj``, ``...mlp.down_proj``,
      ``lm_head``...), and the merged names engines fuse them under, as the architecture's
      ``qp_engine_plan`` declares them (:mod:`quantplug.models.declarations`; DeepSeek-V3:
      ``self_attn.fused_qkv_a_proj`` = q_a_proj + kv_a_proj_with_mqa and ``mlp.gate_up_proj`` /
      ``mlp.shared_experts.gate_up_proj`` = gate + up), computed in one call where the scheme
      fused them at load (:meth:`LinearScheme.fuse`);
    * ``self_attn.kv_b_proj`` also for split K/V layers (:class:`KVBFromSplit`);
    * ``mlp.experts``: the routed experts, ``fn(x, topk_ids, topk_weights)`` -> the weighted sum
      of each token's experts (quantplug's grouped expert forward);
    * ``model.embed_tokens``: the embedding, ``fn(ids)``.

    Names are quantplug's unless the text model's class renames them for the engines
    (``qp_engine_names``: Kimi-Linear's ``block_sparse_moe`` is the engines' ``mlp``).
    ``model`` is what ``quantplug.load`` returned: unsplit, or this rank's share of a load under an
    engine's tensor parallelism (``group=quantplug.parallel.EngineComm(...)``), where the engine's
    layers run the collectives: every projection computes this rank's part only (a column-parallel
    one its output rows, ``shard``; a row-parallel one its partial sum, which the engine
    all-reduces; the routed experts this rank's experts' partial sum; the embedding looks up the
    rank-local ids the engine hands it; ``lm_head`` returns this rank's vocabulary block of the
    logits, which the engine gathers). A module split with a process group of its own collectives
    (quantplug's tensor parallelism) is refused, and so is a row-parallel layer the plan left whole.
    A module holding a member its engine entry lists as ``unsupported`` is refused, naming it and why.
    """
    lm = text_model(model)
    why = engine_refusal(model)
    if why:
        raise QuantplugError(f"planned_modules: {why}")
    engine = _engine_entries(lm)
    out: dict[str, Projection] = {}
    for name, mod in lm.named_modules():
        par = getattr(mod, "qp_parallel", None)  # every module: most declare none
        if par is not None and not getattr(getattr(par, "comm", None), "engine", False):
            raise QuantplugError(f"planned_modules: {name} is split by quantplug's own tensor parallelism (its "
                                 "collectives run inside quantplug); an engine gets an unsplit model, or one loaded "
                                 "with group=quantplug.parallel.EngineComm(...)")
        if isinstance(mod, QuantLinear):
            if name in out:  # given in an engine's form by its owner's entry (a grouped linear)
                continue
            out[name] = _single(mod)
            if par is not None:
                _engine_local(name, mod, par, out[name])
        elif isinstance(mod, Embedding):
            out[name] = _single(mod)
            out[name].in_features, out[name].out_features = mod.dim, [mod.vocab]
            if par is not None:  # vocab-parallel: the engine masks the ids to this rank's rows and reduces
                out[name].fn = functools.partial(_embed_local, mod)
                out[name].shard = (par.start, par.length)
        elif isinstance(mod, TiedHead):
            emb = mod._embed[0]
            out[name] = Projection(mod, [emb], emb.dim, [emb.vocab], [_describe(mod)])
            if par is not None:  # the tied embedding's vocabulary block; the engine gathers the logits
                out[name].fn = emb.product
                out[name].out_features = [par.length]
                out[name].shard = (par.start, par.length)
        elif name in engine:
            _engine_projections(name, mod, engine[name][1], out)
    return _engine_names(lm, out)


def _embed_local(emb: Embedding, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (rank-local: the engine subtracted this rank's first row) of this rank's block."""
    return emb.scheme.embed(emb, ids)


def _engine_local(name: str, mod: QuantLinear, par: Any, proj: Projection) -> None:
    """A linear split under an engine's tensor parallelism: what this rank computes of it."""
    kind, sharded = par.kind, bool(par.sharded)
    if kind == "row" and not sharded:
        raise QuantplugError(f"planned_modules: {name} ({mod.qp_ckpt}) is row-parallel in the engine but the plan "
                             "keeps it whole on every rank (see its tensor_parallel decision); load with "
                             "strict_split so the plan refuses it")
    if kind == "column":
        start, length = par.start, par.length
        proj.shard = (start, length)
        proj.out_features = [length]
        if par.gather:  # lm_head: the engine gathers the logits
            proj.fn = mod.product if sharded else (lambda x: mod.product(x)[..., start:start + length])


def _engine_projections(name: str, mod: nn.Module, entry: object, out: dict[str, Projection]) -> None:
    """The projections one ``qp_engine_plan`` entry adds (see :func:`planned_modules`)."""
    if isinstance(entry, EngineExperts):
        # a model with no native lowering binds no forward_step (DeepSeek-V4): its forward serves every call
        if not isinstance(mod, RoutedExperts) and getattr(mod, "step", None) is not None:
            raise QuantplugError(f"{name} ({type(mod).__name__}) is declared EngineExperts but has no "
                                 "step / forward_step (quantplug.models.declarations.RoutedExperts)")
        gate, up, down = (getattr(mod, s) for s in entry.stacks)
        p = _single(mod)
        p.fn = _routed(mod)  # type: ignore[arg-type]
        p.in_features, p.out_features = gate.in_features, [down.out_features]
        p.schemes = [f"{x.scheme.describe()}" for x in (gate, up, down)]
        out[name] = p
    elif isinstance(entry, EngineLatentAttention):
        for member, why in entry.unsupported:
            if isinstance(getattr(mod, member, None), nn.Module):
                raise QuantplugError(f"{name}.{member}: {why}")
        if not isinstance(mod, LatentAttention):
            raise QuantplugError(f"{name} ({type(mod).__name__}) is declared EngineLatentAttention but lacks the "
                                 "fields of quantplug.models.declarations.LatentAttention")
        q_a, kv_a = getattr(mod, entry.q_a, None), getattr(mod, entry.kv_a, None)
        if isinstance(q_a, QuantLinear) and isinstance(kv_a, QuantLinear):
            out[f"{name}.{entry.merged}"] = _merged([q_a, kv_a], getattr(mod, entry.fused, None))
        if mod.layout.kind != "dense":
            split = KVBFromSplit(mod)
            out[f"{name}.kv_b_proj"] = _single(split, [
                f"K half dequantized per call from {mod.layout.k_b} (the engine needs its transpose); "
                f"V half through {mod.layout.v_b}'s scheme"])
    elif isinstance(entry, EngineGroupedLinear):
        if getattr(getattr(mod, entry.member, None), "qp_parallel", None) is not None:
            raise QuantplugError(f"planned_modules: {name}.{entry.member} is split over ranks; an engine's grouped "
                                 "linear takes it whole")
        out[f"{name}.{entry.member}"] = _single(GroupedProduct(mod, entry))
    elif isinstance(entry, EngineMLP):
        out[f"{name}.{entry.merged}"] = _merged([getattr(mod, entry.gate), getattr(mod, entry.up)],
                                               getattr(mod, entry.fused, None))


def _routed(experts: RoutedExperts) -> Callable[..., torch.Tensor]:
    """``fn(x, topk_ids, topk_weights)`` of the routed experts, as quantplug's own model runs them:
    up to :data:`NATIVE_ROWS` tokens in one native call of the experts' step (``MLPStep``: gate,
    up, silu, down and the weighted sum of every token's experts), more through the grouped
    forward (tokens sorted by expert once, each projection over the hit experts' row groups)."""

    def fn(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if experts.step is not None and 0 < x.shape[0] <= NATIVE_ROWS:
            return experts.forward_step(x, idx.tolist(), w.float().tolist())
        return experts(x, idx, w)

    return fn


def planned_mlps(model: nn.Module) -> dict[str, nn.Module]:
    """quantplug's gated MLPs of the loaded text model (dense MLP layers, shared experts) by Hugging
    Face module name (``model.layers.0.mlp``, ``model.layers.3.mlp.shared_experts``): ``m(x)`` runs
    ``down(silu(gate(x)) * up(x))`` as quantplug's model does (one native call for up to
    :data:`NATIVE_ROWS` rows where the three are bound to forms), for an engine whose MLP module
    holds exactly these three planned linears."""
    lm = text_model(model)
    return _engine_names(lm, {name: mod for name, (mod, entry) in _engine_entries(lm).items()
                              if isinstance(entry, EngineMLP)})


def absorbed_attention(model: nn.Module) -> dict[str, AbsorbedMLA]:
    """:class:`AbsorbedMLA` of every MLA layer of the loaded text model, by Hugging Face module
    name (``model.layers.{i}.self_attn``)."""
    lm = text_model(model)
    return _engine_names(lm, {name: AbsorbedMLA(mod) for name, (mod, entry) in _engine_entries(lm).items()
                              if isinstance(entry, EngineLatentAttention) and isinstance(mod, LatentAttention)})


class PagedDecode:
    """The loaded model's whole decoder stack as one native call per decode step, on an engine's
    paged latent cache (:meth:`quantplug.kernels.compute.StackStep.paged`): the engine hands the
    embeddings of B <= :data:`NATIVE_ROWS` sequences (each at its own position), every layer's
    cache as [slots, kv_lora + rope] (latent, then the roped key) and each sequence's slots, and
    gets the final norm back; what its own layer-by-layer forward computes, with one Python to C
    crossing instead of a few hundred module calls per layer.

    The engine's cached keys are taken as rotated in the checkpoint's own pair layout (vLLM's
    DeepSeek rotary: interleaved pairs for a DeepSeek checkpoint); quantplug's rotation yields
    halves, so its rotation matrices are permuted to the engine's layout (scores are unchanged:
    queries and keys take the same permutation)."""

    def __init__(self, step: compute.StackStep, rotary: Rotary) -> None:
        self.step, self.rotary = step, rotary
        rope = step.rope
        half = rope // 2
        perm = None
        if rotary.interleave:  # halves (quantplug) -> interleaved pairs (the checkpoint's)
            perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
        self.perm = perm
        self.calls = 0

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv: Sequence[torch.Tensor],
                 rows: torch.Tensor) -> torch.Tensor | None:
        """``x`` [B, hidden] (model dtype), ``positions`` [B] int64, ``kv`` every layer's cache
        [slots, kv_lora + rope], ``rows`` [B, R] int64 the slots of each sequence's positions:
        the final norm [B, hidden], every layer's latent and key written at slot
        ``rows[b, positions[b]]``; None (nothing written) when the step cannot run now."""
        dtype = self.step.dtype
        rot = torch.stack([self.rotary.step_rotation(p, dtype) for p in positions.tolist()])
        if self.perm is not None:
            rot = rot.index_select(2, self.perm)
        out = self.step.paged(x, rot, kv, rows, positions)
        if out is not None:
            self.calls += 1
        return out


def paged_decode(model: nn.Module) -> PagedDecode | None:
    """:class:`PagedDecode` of the loaded model; None where its text model decodes layer by layer
    (a piece without a native form, experts served from files or split over ranks, a DSA model,
    no native library: the text model's ``decode_stack()`` says so) or declares no such step."""
    inner = getattr(text_model(model), "model", None)
    build = getattr(inner, "decode_stack", None)
    step = build() if callable(build) else None
    rotary = getattr(inner, "rotary", None)
    if step is None or not isinstance(rotary, Rotary):
        return None
    return PagedDecode(step, rotary)


def float_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The float tensors of the loaded text model that are not part of a projection (norms, the
    router's weight and ``e_score_correction_bias``, KDA's convolutions and decay), by the engines'
    name (as :func:`planned_modules`), as loaded (no copy), except where a module gives them in the
    engines' form (:class:`~quantplug.models.declarations.EngineFloats`: Kimi's KDA convolutions
    as one tensor)."""
    lm = text_model(model)
    out: dict[str, torch.Tensor] = {}
    given: list[str] = []  # modules whose float tensors came from their qp_engine_floats
    for name, mod in lm.named_modules():
        if any(name.startswith(g + ".") for g in given):
            continue
        if isinstance(mod, EngineFloats):
            given.append(name)
            for local, t in mod.qp_engine_floats().items():
                out[f"{name}.{local}" if name else local] = t.detach()
        elif isinstance(mod, FloatParams):
            for local, t in mod.named_parameters(recurse=False):
                out[f"{name}.{local}" if name else local] = t.detach()
    return _engine_names(lm, out)


__all__ = ["AbsorbedMLA", "GroupedProduct", "KVBFromSplit", "PagedDecode", "Projection", "absorbed_attention", "float_state",
           "paged_decode", "planned_mlps", "planned_modules", "text_model"]
