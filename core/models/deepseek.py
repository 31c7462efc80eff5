"""DeepSeek-V3 (MLA + MoE) and the Kimi wrappers, built with full qualified names from the root.

Modules are built from a :class:`Decisions` object (prefix, attention layout and linear
scheme per module, answered by the plugins), on no device: the plan reads each planned
module's ``qp_sources`` and the loader registers the parameters.

DeepSeek-V3.2 sparse attention (DSA, ``index_topk`` in the config): each MLA layer also holds
``self_attn.indexer`` (:class:`Indexer`), which scores every cached key for each query and keeps
the top ``index_topk``; attention then reads only those keys (see :meth:`MLA.forward`).

MLA output gate (``mla_use_output_gate``, as Kimi-K3's MLA has one; here on DeepSeek-V3's
layout): each MLA layer has ``self_attn.g_proj``
(Linear hidden_size -> num_heads * v_head_dim, no bias); the attention output, before
``o_proj``, is multiplied elementwise by ``sigmoid(g_proj(hidden_states))`` where
``hidden_states`` is the attention block's (normed) input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..generate import GenerationMixin, LatentCache, MLACache
from ..kernels import compute
from ..kernels.compute import NATIVE_ROWS, DraftStep, MLAStep, MLPStep, StackLayer, StackStep
from ..layers.activation import SILU, GatedAct
from ..layers.embedding import Embedding, TiedHead
from ..layers.linear import (
    FloatParams,
    FusedLayout,
    LinearScheme,
    PerIndexLayout,
    QuantLinear,
    StackedLayout,
    StackedLinear,
    StackLayout,
    fuse_attention,
    fuse_mlp,
    fuse_projections,
)
from ..layers.norm import RMSNorm
from ..layers.rope import Rotary, rotate_pairs, softmax_scale
from ..routing import RouterSpec
from ..types import AttentionLayout
from .config import ModelConfig

if TYPE_CHECKING:
    from ..experts import ExpertStore
    from ..options import LoadOptions
from .declarations import (
    ColumnParallel,
    DenseRule,
    EngineEntry,
    EngineExperts,
    EngineLatentAttention,
    EngineMLP,
    ExpertParallel,
    FeatureParallel,
    FoldHeads,
    HeadParallel,
    HeadPart,
    TPStyle,
    Unstack,
    VocabParallel,
)


class PlanOracle(Protocol):
    """What the model asks the plan while it builds itself: the prefix, and every decision
    (scheme, attention layout, expert layout), each answered through the backend's hooks and
    recorded by the plan as a :class:`~quantplug.types.Decision`. An architecture added through
    ``quantplug_architectures`` builds itself with this, as :class:`DeepseekV3ForCausalLM` does."""

    prefix: str
    model_dtype: torch.dtype

    def ck(self, rel: str) -> str:
        """Checkpoint name of a text-model-relative name (prefix applied)."""
        ...

    def scheme(self, ckpt_name: str, kind: str = "linear", shards: Sequence[str] | None = None) -> LinearScheme:
        """Scheme for one linear (``kind`` "linear"), expert projection ("experts"), MLA K/V
        stack ("attn_k_b" / "attn_v_b") or the token embedding ("embedding"); ``shards``:
        checkpoint modules feeding it."""
        ...

    def layout(self, attn_ckpt_name: str) -> AttentionLayout: ...

    #: how many multi-token-prediction layers to build (``num_nextn_predict_layers``, or 0 when the
    #: load option ``mtp`` is false or the checkpoint stores none); an oracle without it builds none
    mtp_layers: int

    def expert_layout(self, experts_ckpt_name: str) -> str:
        """``"hub"`` (per-expert tensors), ``"fused"`` (transformers 5 gate_up_proj / down_proj),
        ``"stacked"`` (one [E, out, in] tensor per projection, GGUF ``ffn_*_exps``) or ``"none"``
        (no expert tensors: the scheme serves them, e.g. from an expert pack)."""
        ...


#: the name before contract 1.1 (it read like the :class:`Decision` record it produces)
Decisions = PlanOracle


def _lin(d: Decisions, rel: str, i: int, o: int) -> QuantLinear:
    name = d.ck(rel)
    return QuantLinear(i, o, d.scheme(name), name, d.model_dtype)


def _step_reduce(columns: Sequence[nn.Module], rows: Sequence[nn.Module]) -> tuple[bool, Any]:
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


class IndexerWeights(FloatParams):
    """The indexer's per-head weights ``weights_proj`` [H_I, hidden]: a float parameter (bf16 in
    DeepSeek-V3.2's FP8 release), kept and applied in float32 as transformers keeps it
    (``_keep_in_fp32_modules``) and DeepSeek's fixed reference computes it (``weights_proj(x.float())``)."""

    qp_fp32 = frozenset({"weight"})
    weight: torch.Tensor

    def __init__(self, hidden: int, heads: int, ckpt: str) -> None:
        super().__init__()
        self.qp_init(ckpt)
        self.add_float("weight", (heads, hidden), f"{ckpt}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [..., H_I]."""
        return F.linear(x.float(), self.weight.float())


class LayerNorm(FloatParams):
    """LayerNorm with weight and bias (the indexer's ``k_norm``), statistics and parameters in
    float32; the result in the input's dtype."""

    qp_fp32 = frozenset({"weight", "bias"})
    weight: torch.Tensor
    bias: torch.Tensor

    def __init__(self, dim: int, eps: float, ckpt: str) -> None:
        super().__init__()
        self.qp_init(ckpt)
        self.eps = eps
        self.add_float("weight", (dim,), f"{ckpt}.weight")
        self.add_float("bias", (dim,), f"{ckpt}.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


#: e4m3's largest finite value
_E4M3_MAX = 448.0
#: bytes of float32 per-head scores ([queries, H_I, keys]) the indexer makes at once: a long prompt
#: is scored a block of queries at a time (each query's top-k is its own)
INDEX_SCORE_BYTES = 1 << 28


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The Walsh-Hadamard transform over the last dim (a power of two, d), Sylvester order, times
    d^-0.5 (DeepSeek's ``rotate_activation``): the butterfly, log2(d) steps of sums and differences."""
    d = x.shape[-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        pairs = y.view(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).view(-1, d)
        h *= 2
    return (y * d ** -0.5).view(x.shape)


def act_quant_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's ``act_quant`` with ``scale_fmt="ue8m0"``, one block over the last dim (the
    indexer's head, at most 128 values): ``s = 2^ceil(log2(max(amax, 1e-4) * (1/448)))`` (the
    exponent taken from the float32 bits, as the kernel's ``fast_log2_ceil``), ``x / s`` clamped
    to +-448 and rounded to e4m3. Returns (float8_e4m3fn payload, float32 scales [..., 1])."""
    xf = x.float()
    r = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4) * (1.0 / _E4M3_MAX)
    mant, exp = torch.frexp(r)                                 # r = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant > 0.5, exp, exp - 1)                # ceil(log2 r), exact on the bits
    s = torch.ldexp(torch.ones_like(r), exp)
    return (xf / s).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn), s


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer (DSA), ``self_attn.indexer``, as transformers'
    ``DeepseekV32Indexer`` computes it (no Hadamard rotation, no FP8 scoring: see
    docs/architectures/deepseek-v32.md for how DeepSeek's reference differs); with the load option
    ``indexer=fp8`` (:attr:`qp_indexer`) as DeepSeek's reference does instead (see :meth:`scores`).

    * query ``q = wq_b(qr)`` [T, H_I, D_I] from MLA's compressed query ``qr = q_a_layernorm(q_a_proj(x))``;
    * one key per token ``k = LayerNorm(wk(x))`` [T, D_I] (eps 1e-6, weight and bias);
    * RoPE on the FIRST ``qk_rope_head_dim`` dims of q and k (MLA puts its rope part last), same
      frequencies as MLA but half-split pairs (``indexer_rope_interleave`` false, the default) where
      MLA's are interleaved;
    * scores in float32: ``I[s, t] = sum_h w[s, h] H_I^-0.5 * ReLU(D_I^-0.5 q[s, h] . k[t])`` with
      ``w = weights_proj(x)`` (float32), future keys of a prompt at -inf; the top
      ``min(index_topk, keys)`` keys per query are the ones attention reads.

    ``wq_b`` and ``wk`` are planned linears (any backend's scheme: FP8 block-scaled in the
    release); ``weights_proj`` and ``k_norm`` are float parameters.
    """

    #: its checkpoint name
    qp_ckpt: str
    #: load option ``indexer``: "exact" (transformers) or "fp8" (DeepSeek's reference FP8 indexer)
    qp_indexer: str = "exact"

    def __init__(self, cfg: ModelConfig, base: str, d: Decisions) -> None:
        super().__init__()
        assert cfg.q_lora_rank is not None  # the config parser requires it for an indexer
        self.qp_ckpt = d.ck(base)
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope, self.interleave = cfg.qk_rope_head_dim, cfg.indexer_rope_interleave
        self.wq_b = _lin(d, f"{base}.wq_b", cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = _lin(d, f"{base}.wk", cfg.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, 1e-6, d.ck(f"{base}.k_norm"))
        self.weights_proj = IndexerWeights(cfg.hidden_size, self.n_heads, d.ck(f"{base}.weights_proj"))
        self.softmax_scale = self.head_dim ** -0.5

    def qp_configure(self, options: LoadOptions) -> None:
        """Takes load option ``indexer`` (the plan checked the head size for ``fp8``)."""
        self.qp_indexer = options.indexer

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, heads, t, D_I] with its rope part (the first ``rope`` dims) rotated."""
        x_rot, x_pass = x.split([self.rope, self.head_dim - self.rope], dim=-1)
        return torch.cat([rotate_pairs(x_rot, cos, sin, self.interleave), x_pass], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The indexer keys of ``x`` [b, t, hidden] as the cache holds them: [b, 1, t, D_I] in x's
        dtype and no scales; with ``indexer=fp8`` Hadamard-rotated and quantized, e4m3 payload
        [b, 1, t, D_I] and float32 scales [b, 1, t, 1]."""
        k = self._rotate(self.k_norm(self.wk(x)).unsqueeze(1), cos, sin)   # [b, 1, t, D_I]
        if self.qp_indexer == "fp8":
            return act_quant_ue8m0(hadamard(k))
        return k, None

    def scores(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, scales: torch.Tensor | None, past: int) -> torch.Tensor:
        """float32 index scores [b, t, n] of every cached key for each query: ``x`` [b, t, hidden],
        ``qr`` [b, t, q_lora_rank], ``keys`` [b, n, D_I] and ``scales`` ([b, n, 1] with ``fp8``)
        as :meth:`keys` made them (n = past + t); query i sits at position ``past + i`` (later keys
        score -inf).

        ``exact`` (transformers): ``sum_h w[s, h] H_I^-0.5 ReLU(D_I^-0.5 q[s, h] . k[t])``.
        ``fp8`` (DeepSeek's ``Indexer.forward`` and ``fp8_index``): q and k Hadamard-rotated and
        quantized per head to e4m3 with power-of-two scales (:func:`act_quant_ue8m0`), then
        ``s_k[t] sum_h ReLU(q8[s, h] . k8[t]) (w[s, h] H_I^-0.5 s_q[s, h] D_I^-0.5)``."""
        b, t, _ = x.shape
        n = keys.shape[1]
        q = self.wq_b(qr).view(b, t, self.n_heads, self.head_dim)
        q = self._rotate(q.transpose(1, 2), cos, sin).transpose(1, 2)  # [b, t, H_I, D_I]
        w = self.weights_proj(x) * (self.n_heads ** -0.5)              # [b, t, H_I] float32
        if self.qp_indexer == "fp8":
            assert scales is not None
            q8, qs = act_quant_ue8m0(hadamard(q))                      # [b, t, H_I, D_I], [b, t, H_I, 1]
            dots = torch.matmul(q8.float(), keys.float().transpose(-1, -2).unsqueeze(1))   # [b, t, H_I, n]
            weights = w.unsqueeze(-1) * qs * self.softmax_scale        # [b, t, H_I, 1]
            index = (F.relu(dots) * weights).sum(dim=-2) * scales[..., 0].unsqueeze(1)
        else:
            # transformers' order of operations (same float32 rounding): scale, ReLU, weighted head sum
            scores = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * self.softmax_scale
            scores = F.relu(scores)                                    # [b, t, H_I, n]
            index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # [b, t, n]
        if n > past + 1:  # keys after some query (a prompt, or a block of one)
            future = torch.ones(t, n, dtype=torch.bool, device=x.device).triu(past + 1)
            index = index.masked_fill(future, float("-inf"))
        return index

    def select(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, scales: torch.Tensor | None, past: int) -> torch.Tensor:
        """Indices [b, t, min(index_topk, n)] of the keys each query keeps (the best :meth:`scores`),
        a block of queries at a time (at most :data:`INDEX_SCORE_BYTES` of per-head scores)."""
        b, t, _ = x.shape
        n = keys.shape[1]
        k = min(self.topk, n)
        rows = max(1, INDEX_SCORE_BYTES // (4 * b * self.n_heads * n))
        if t <= rows:
            return self.scores(x, qr, cos, sin, keys, scales, past).topk(k, dim=-1).indices
        return torch.cat([self.scores(x[:, i:i + rows], qr[:, i:i + rows], cos[:, i:i + rows], sin[:, i:i + rows],
                                      keys, scales, past + i).topk(k, dim=-1).indices
                          for i in range(0, t, rows)], dim=1)


class MLA(nn.Module):
    """Multi-head latent attention; ``kv_b_proj`` dense, or split per head into k_b / v_b; with
    DSA (DeepSeek-V3.2) a lightning :class:`Indexer` choosing the keys each query attends to."""

    #: its checkpoint name
    qp_ckpt: str

    def __init__(self, cfg: ModelConfig, i: int, d: Decisions, rotary: Rotary) -> None:
        super().__init__()
        base = f"model.layers.{i}.self_attn"
        self.qp_ckpt = d.ck(base)
        self.cfg = cfg
        self.rotary = [rotary]
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.q_lora = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = _lin(d, f"{base}.q_proj", h, nh * cfg.qk_head_dim)
        else:
            self.q_a_proj = _lin(d, f"{base}.q_a_proj", h, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, d.ck(f"{base}.q_a_layernorm"))
            self.q_b_proj = _lin(d, f"{base}.q_b_proj", cfg.q_lora_rank, nh * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = _lin(d, f"{base}.kv_a_proj_with_mqa", h, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, d.ck(f"{base}.kv_a_layernorm"))
        self.layout = d.layout(d.ck(base))
        if self.layout.kind == "dense":
            self.kv_b_proj = _lin(d, f"{base}.kv_b_proj", cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        else:
            assert self.layout.k_b and self.layout.v_b
            self.k_b = StackedLinear(nh, cfg.qk_nope_head_dim, cfg.kv_lora_rank, d.scheme(self.layout.k_b, "attn_k_b"),
                                     self.layout.k_b, StackedLayout(self.layout.k_b), d.model_dtype)
            self.v_b = StackedLinear(nh, cfg.kv_lora_rank, cfg.v_head_dim, d.scheme(self.layout.v_b, "attn_v_b"),
                                     self.layout.v_b, StackedLayout(self.layout.v_b), d.model_dtype)
        if cfg.mla_use_output_gate:
            self.g_proj = _lin(d, f"{base}.g_proj", h, nh * cfg.v_head_dim)
        self.o_proj = _lin(d, f"{base}.o_proj", nh * cfg.v_head_dim, h)
        #: DSA's lightning indexer (DeepSeek-V3.2), None for dense MLA
        self.indexer: Indexer | None = Indexer(cfg, f"{base}.indexer", d) if cfg.has_indexer else None
        self.scale = softmax_scale(cfg.rope, cfg.qk_head_dim)
        #: heads computed here: all of them, or this rank's share under tensor parallelism
        #: (:meth:`qp_hold_heads`: q/kv_b/g_proj/k_b/v_b hold these heads, o_proj all-reduces)
        self.num_heads = nh
        #: latent dims the cache holds per token (not split over ranks)
        self.kv_lora_rank, self.qk_rope_head_dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        #: per-head widths of the K / V up-projections (:class:`~quantplug.models.declarations.LatentAttention`)
        self.qk_nope_head_dim, self.v_head_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        self._kv_b_heads: tuple[torch.Tensor, torch.Tensor] | None = None
        #: q_a_proj and kv_a_proj_with_mqa (same input) in one call when their scheme fuses them
        self.qkv_a: Any = None
        #: a decode step natively on the layers' forms (:class:`quantplug.kernels.compute.MLAStep`)
        self.step: MLAStep | None = None
        #: a decode step in one call from o_proj's scheme (deprecated :meth:`LinearScheme.fuse_attention`)
        self.one: Any = None

    def qp_heads(self) -> int:
        """All heads of the layer (``HeadParallel``: the tensor-parallel plan splits them)."""
        return self.cfg.num_attention_heads

    def qp_hold_heads(self, start: int, count: int) -> None:
        """This rank computes heads ``[start, start + count)`` (its linears and stacks hold them)."""
        self.num_heads = count

    def qp_fuse(self) -> None:
        if self.q_lora is not None:
            self.qkv_a = fuse_projections([self.q_a_proj, self.kv_a_proj_with_mqa])
        cfg = self.cfg
        cols = [self.q_proj if self.q_lora is None else self.q_b_proj]
        if self.layout.kind == "dense":
            cols.append(self.kv_b_proj)
        if cfg.mla_use_output_gate:
            cols.append(self.g_proj)
        ok, reduce = _step_reduce(cols, [self.o_proj])
        split = self.layout.kind != "dense"
        if ok and all(m.qp_parallel is None for m in
                      ([self.kv_a_proj_with_mqa] + ([self.q_a_proj] if self.q_lora is not None else []))):
            self.step = MLAStep.build(
                q_a=self.q_a_proj if self.q_lora is not None else None, kv_a=self.kv_a_proj_with_mqa, q_b=cols[0],
                kv_b=None if split else self.kv_b_proj, k_b=self.k_b if split else None,
                v_b=self.v_b if split else None, o=self.o_proj, g=self.g_proj if cfg.mla_use_output_gate else None,
                q_a_norm=self.q_a_layernorm if self.q_lora is not None else None, kv_a_norm=self.kv_a_layernorm,
                nh=self.num_heads, q_lora=self.q_lora, kv_lora=self.kv_lora_rank, rope=self.qk_rope_head_dim,
                nope=cfg.qk_nope_head_dim, v=cfg.v_head_dim, hidden=cfg.hidden_size,
                eps_q=self.q_a_layernorm.eps if self.q_lora is not None else 0.0, eps_kv=self.kv_a_layernorm.eps,
                scale=self.scale, reduce=reduce)
        if self.step is None:
            self.one = fuse_attention(self)
            if self.one is not None:
                compute.deprecated_fuse("fuse_attention", self.o_proj.scheme)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None) -> torch.Tensor:
        """x [b, t, hidden]; with ``cache`` the t tokens follow the ``cache.length`` cached ones
        (their latent is appended) and attend to all of them (with DSA: to those the indexer keeps).

        DSA (an :class:`Indexer`): while every query has at most ``index_topk`` causal keys
        (``cache.length + t <= index_topk``) the indexer keeps all of them and DSA is dense MLA, so
        every path below runs unchanged, the native decode step included; the indexer only caches
        its keys (written after the step, at the rows it appended). Past that, :meth:`_attend`
        runs with ``sparse``: a prompt masks each query's unselected keys; a decode step gathers
        its selected latent rows and attends on those only (cost follows ``index_topk``, not the
        context), in torch (no native step).
        """
        ix = self.indexer
        if ix is None:
            return self._attend(x, cos, sin, cache)
        past = cache.length if cache is not None else 0
        if past + x.shape[1] > ix.topk:
            return self._attend(x, cos, sin, cache, sparse=True)
        if cache is None:
            return self._attend(x, cos, sin, None)
        keys, scales = ix.keys(x, cos, sin)
        out = self._attend(x, cos, sin, cache)
        cache.put_index(past, keys, scales)
        return out

    def _attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None,
                sparse: bool = False) -> torch.Tensor:
        """Attention of ``x`` (see :meth:`forward`); ``sparse``: DSA with the indexer's selection
        (the indexer's keys are appended with the latent).

        Without a cache, or for the first chunk into an empty one, the dense layout runs the
        expanded form (K/V per head from ``kv_b_proj``), exactly as a forward without cache.
        Later chunks attend on the cached latent: the split K/V layout and a dense ``kv_b_proj``
        whose scheme is ``weight_only`` use the absorbed form (q_nope through W_UK, attention on
        the latent, W_UV after); any other dense scheme (one that quantizes activations) expands
        K/V from the cached latent through its own ``apply`` (exact, O(cached tokens) per step).
        """
        cfg = self.cfg
        b, t, _ = x.shape
        if t == 1 and cache is not None and self.step is not None and b <= NATIVE_ROWS and not sparse:
            out = self.step(x, self.rotary[0]._rotation(cos, sin), cache)
            if out is not None:
                return out
        if b == 1 and t == 1 and cache is not None and cos.shape[0] == 1 and not sparse and (
                self.layout.kind != "dense" or (cache.length > 0 and self.kv_b_proj.scheme.weight_only)):
            return self._decode_one(x, cos, sin, cache)
        nh, nope, rope, v = self.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qr, q, ckv = self._qr_q_latent(x)
        q = q.view(b, t, nh, nope + rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
        kv_nope, k_rot = torch.split(ckv, [self.kv_lora_rank, rope], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(b, 1, t, self.kv_lora_rank)
        k_rot = k_rot.reshape(b, 1, t, rope)
        rot = self.rotary[0]
        q_rot, k_rot = rot.rotate(q_rot, cos, sin), rot.rotate(k_rot, cos, sin)
        past = 0
        ikeys = iscales = None
        if sparse:
            assert self.indexer is not None
            ikeys, iscales = self.indexer.keys(x, cos, sin)          # [b, 1, t, index_head_dim]
        if cache is not None:
            past = cache.length
            kv_nope, k_rot = cache.append(kv_nope, k_rot, ikeys, iscales)   # [b, 1, past + t, ...]
            if sparse:
                ikeys, iscales = cache.index_keys(), cache.index_scales()
        keep = None  # DSA prompt: [b, 1, t, n], True where a query attends (causal and selected)
        if sparse:
            assert self.indexer is not None and ikeys is not None and qr is not None
            idx = self.indexer.select(x, qr, cos, sin, ikeys[:, 0], None if iscales is None else iscales[:, 0],
                                      past)                                  # [b, t, k]
            if t == 1:
                # a decode step reads its selected rows only (all are <= its position)
                kv_nope, k_rot = _rows(kv_nope, idx), _rows(k_rot, idx)
            else:
                n = kv_nope.shape[-2]
                causal = ~torch.ones(t, n, dtype=torch.bool, device=x.device).triu(past + 1)
                chosen = torch.zeros(b, t, n, dtype=torch.bool, device=x.device).scatter_(-1, idx, True)
                keep = (chosen & causal).unsqueeze(1)
        if self.layout.kind != "dense":
            # Absorbed form (llama.cpp): scores = (q_nope k_b) . c + q_rot . k_rot; out = (p c) v_b^T.
            q_lat = self.k_b.forward_all(q_pass)                      # [b, nh, t, kv_lora]
            out = self.v_b.forward_all(self._latent_attention(q_lat, q_rot, kv_nope, k_rot, past, keep))
        elif past == 0 and kv_nope.shape[-2] == t:
            kv = self.kv_b_proj(kv_nope).view(b, t, nh, nope + v).transpose(1, 2)
            k_nope, val = torch.split(kv, [nope, v], dim=-1)
            k = torch.cat([k_nope, k_rot.expand(-1, nh, -1, -1)], dim=-1)
            qs = torch.cat([q_pass, q_rot], dim=-1)
            if keep is None:
                out = F.scaled_dot_product_attention(qs, k, val, is_causal=True, scale=self.scale)
            else:
                out = F.scaled_dot_product_attention(qs, k, val, attn_mask=keep, scale=self.scale)
        elif self.kv_b_proj.scheme.weight_only:
            w_uk, w_uv_t = self._kv_b_per_head()
            out = self._latent_attention(q_pass @ w_uk, q_rot, kv_nope, k_rot, past, keep) @ w_uv_t
        else:
            n = kv_nope.shape[-2]
            kv = self.kv_b_proj(kv_nope).view(b, n, nh, nope + v).transpose(1, 2)
            k_nope, val = torch.split(kv, [nope, v], dim=-1)
            k = torch.cat([k_nope, k_rot.expand(-1, nh, -1, -1)], dim=-1)
            qs = torch.cat([q_pass, q_rot], dim=-1)
            mask = keep
            if mask is None and t > 1:
                mask = ~torch.ones(t, n, dtype=torch.bool, device=x.device).triu(past + 1)
            out = F.scaled_dot_product_attention(qs, k, val, attn_mask=mask, scale=self.scale)
        out = out.transpose(1, 2).reshape(b, t, nh * v)
        if cfg.mla_use_output_gate:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)

    def _q_and_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries (all heads, nope + rope each) and the compressed KV (latent + rope key,
        before its norm) of ``x``; q_a and kv_a in one call when their scheme fused them."""
        _, q, ckv = self._qr_q_latent(x)
        return q, ckv

    def _qr_q_latent(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """:meth:`_q_and_latent` with the compressed query ``qr = q_a_layernorm(q_a_proj(x))`` first
        (None without q LoRA); DSA's indexer reads it."""
        if self.qkv_a is not None:
            q_lat, ckv = self.qkv_a(x).split([self.q_a_proj.out_features, self.kv_a_proj_with_mqa.out_features], dim=-1)
            qr = self.q_a_layernorm(q_lat)
            return qr, self.q_b_proj(qr), ckv
        if self.q_lora is None:
            return None, self.q_proj(x), self.kv_a_proj_with_mqa(x)
        qr = self.q_a_layernorm(self.q_a_proj(x))
        return qr, self.q_b_proj(qr), self.kv_a_proj_with_mqa(x)

    def _decode_one(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache) -> torch.Tensor:
        """:meth:`forward` for one token of one sequence with a cache (a decode step) in the
        absorbed form, on 2-D tensors: every head reads the same latent, so the scores of all
        heads are one [heads, latent + rope] x [latent + rope, tokens] product and the output
        one [heads, tokens] x [tokens, latent] product (half the tensor ops of the general form;
        float rounding differs from it in the last bits: the scale is applied to both score terms
        separately)."""
        r = self.rotary[0]._rotation(cos, sin)                             # [rope, rope]
        if self.one is not None:
            fused = self.one(x, r, cache)
            if fused is not None:
                return fused
        cfg = self.cfg
        nh, nope, rope = self.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q, ckv = self._q_and_latent(x.view(1, -1))
        q_pass, q_rot = q.view(nh, nope + rope).split([nope, rope], dim=-1)
        kv_nope, k_rot = ckv.split([self.kv_lora_rank, rope], dim=-1)
        latent, k_all = cache.append(self.kv_a_layernorm(kv_nope).view(1, 1, 1, -1), (k_rot @ r).view(1, 1, 1, -1))
        lat, kr = latent[0, 0], k_all[0, 0]                                # [n, kv_lora], [n, rope]
        if self.layout.kind != "dense":
            q_lat = self.k_b.forward_all(q_pass.unsqueeze(1))[:, 0]        # [nh, kv_lora]
        else:
            w_uk, w_uv_t = self._kv_b_per_head()
            q_lat = torch.bmm(q_pass.unsqueeze(1), w_uk)[:, 0]
        scores = torch.addmm(torch.mm(q_rot @ r, kr.t()), q_lat, lat.t(), beta=self.scale, alpha=self.scale)
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
        o_lat = torch.mm(p, lat).unsqueeze(1)                               # [nh, 1, kv_lora]
        out = self.v_b.forward_all(o_lat) if self.layout.kind != "dense" else torch.bmm(o_lat, w_uv_t)
        out = out.reshape(1, 1, -1)
        if cfg.mla_use_output_gate:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)

    def _latent_attention(self, q_lat: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor,
                          k_rot: torch.Tensor, past: int, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Attention on the latent: q_lat [b, nh, t, kv_lora], q_rot [b, nh, t, rope] against the
        latent [b, 1, n, kv_lora] and k_rot [b, 1, n, rope] of n = past + t tokens; query i sees
        keys <= past + i, or with ``keep`` [b, 1, t, n] the keys where it is True (DSA).
        Returns p @ latent [b, nh, t, kv_lora]."""
        t, n = q_lat.shape[-2], latent.shape[-2]
        scores = (q_lat @ latent.transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * self.scale
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        elif t > 1:
            mask = torch.ones(t, n, dtype=torch.bool, device=q_lat.device).triu(past + 1)
            scores = scores.masked_fill(mask, float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
        return p @ latent

    def _kv_b_per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``kv_b_proj`` [nh * (nope + v), kv_lora] per head for the absorbed decode: W_UK
        [nh, nope, kv_lora] and W_UV^T [nh, kv_lora, v]. Made once, on the first decode step,
        through the scheme's ``dequantize``: views of the weight for the core's dense scheme (no
        memory), otherwise one dense copy of this layer's kv_b_proj kept on the module."""
        if self._kv_b_heads is None:
            nope, v = self.cfg.qk_nope_head_dim, self.cfg.v_head_dim
            w = self.kv_b_proj.scheme.dequantize(self.kv_b_proj).view(self.num_heads, nope + v, self.kv_lora_rank)
            self._kv_b_heads = (w[:, :nope], w[:, nope:].transpose(1, 2))
        return self._kv_b_heads


def _rows(cached: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The rows ``idx`` [b, 1, k] of ``cached`` [b, 1, n, dim]: [b, 1, k, dim]."""
    dim = cached.shape[-1]
    return torch.gather(cached, 2, idx.unsqueeze(-1).expand(-1, -1, -1, dim))


class MLP(nn.Module):
    """Gated MLP ``down(silu(gate(x)) * up(x))`` (dense layers and shared experts); one native
    call for a few rows where the three are bound to weight forms."""

    #: its checkpoint name
    qp_ckpt: str

    def __init__(self, d: Decisions, base: str, hidden: int, inter: int, act: GatedAct = SILU) -> None:
        super().__init__()
        self.qp_ckpt = d.ck(base)
        #: the gated activation (SiLU, or Kimi-K3's SiTU; the native step computes either)
        self.act = act
        self.gate_proj = _lin(d, f"{base}.gate_proj", hidden, inter)
        self.up_proj = _lin(d, f"{base}.up_proj", hidden, inter)
        self.down_proj = _lin(d, f"{base}.down_proj", inter, hidden)
        #: gate and up in one call when their scheme fuses them (:meth:`LinearScheme.fuse`)
        self.gate_up: Any = None
        #: the whole MLP natively for few rows (:class:`quantplug.kernels.compute.MLPStep`)
        self.step: MLPStep | None = None
        #: the whole MLP for one token from the scheme (deprecated :meth:`LinearScheme.fuse_mlp`)
        self.one: Any = None

    def qp_fuse(self) -> None:
        self.gate_up = fuse_projections([self.gate_proj, self.up_proj])
        ok, reduce = _step_reduce([self.gate_proj, self.up_proj], [self.down_proj])
        if ok:
            self.step = MLPStep.build(self.gate_proj, self.up_proj, self.down_proj, stacked=False, reduce=reduce,
                                      act=self.act.native)
        if self.step is None and self.act.is_silu:  # a scheme's fused MLP computes SiLU
            self.one = fuse_mlp(self.gate_proj, self.up_proj, self.down_proj)
            if self.one is not None:
                compute.deprecated_fuse("fuse_mlp", self.gate_proj.scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step is not None and x.numel() <= NATIVE_ROWS * x.shape[-1]:
            y = self.step(x)
            if y is not None:
                return y
        if self.one is not None and x.numel() == x.shape[-1]:
            return self.one(x.reshape(1, -1)).view(x.shape)
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split(self.gate_proj.out_features, dim=-1)
            return self.down_proj(self.act(gate, up))
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class Router(FloatParams):
    """Sigmoid router; ``e_score_correction_bias`` shifts the choice only, not the weights."""

    qp_fp32 = frozenset({"weight", "e_score_correction_bias"})
    e_score_correction_bias: torch.Tensor

    def __init__(self, cfg: ModelConfig, ckpt: str) -> None:
        super().__init__()
        self.qp_init(ckpt)
        self.cfg = cfg
        self.add_float("weight", (cfg.n_routed_experts, cfg.hidden_size), f"{ckpt}.weight")
        self.add_float("e_score_correction_bias", (cfg.n_routed_experts,), f"{ckpt}.e_score_correction_bias")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        e = cfg.n_routed_experts
        xf = x if x.dtype == torch.float32 else x.float()
        wf = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        scores = F.linear(xf, wf).sigmoid()
        choice = (scores + self.e_score_correction_bias).view(-1, cfg.n_group, e // cfg.n_group)
        group_scores = choice.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        # experts of the groups not chosen are out of the running
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, False)
        choice = choice.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, e)
        idx = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * cfg.routed_scaling_factor

    def route_one(self, x: torch.Tensor) -> tuple[list[int], list[float]]:
        """:meth:`forward` for one token [1, hidden], the choice made on Python floats: the token's
        top-k expert ids and weights (for a decode step a dozen list operations cost less than
        the tensor ops' dispatch). The scores are :meth:`forward`'s float32 sigmoids; sums and the
        normalization run in double precision (the weights may differ from :meth:`forward`'s in
        the last float32 bit, and an exact tie between two experts' biased scores is broken
        toward the lower id, where ``torch.topk`` leaves it unspecified)."""
        cfg = self.cfg
        xf = x if x.dtype == torch.float32 else x.float()
        wf = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        scores = F.linear(xf, wf).sigmoid_()[0].tolist()
        bias = self.e_score_correction_bias
        if getattr(self, "_bias_list", (None,))[0] is not bias:  # the parameter's values, read once
            self._bias_list = (bias, bias.tolist())
        choice = [s + b for s, b in zip(scores, self._bias_list[1])]
        per = cfg.n_routed_experts // cfg.n_group
        group_scores = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(cfg.n_group)]
        groups = sorted(range(cfg.n_group), key=lambda g: (-group_scores[g], g))[:cfg.topk_group]
        cand = [e for g in groups for e in range(g * per, (g + 1) * per)]
        idx = sorted(cand, key=lambda e: (-choice[e], e))[:cfg.num_experts_per_tok]
        w = [scores[e] for e in idx]
        if cfg.norm_topk_prob:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        return idx, [v * cfg.routed_scaling_factor for v in w]

    @property
    def spec(self) -> RouterSpec | None:
        """How this router routes, as data (:mod:`quantplug.routing`; the native stack step routes
        by it); None for a subclass with a routing of its own (it declares its own spec)."""
        if type(self).forward is not Router.forward or type(self).route_one is not Router.route_one:
            return None
        cfg = self.cfg
        return RouterSpec(score="sigmoid", select="group_top2", top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                          topk_group=cfg.topk_group, norm_topk=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor,
                          has_bias=True)


class Experts(nn.Module):
    """Routed experts as three stacked linears (gate, up: [E, I, H]; down: [E, H, I]).

    ``hidden``: the experts' input / output width (default ``hidden_size``; Kimi-K3's latent MoE
    gives its latent width); ``names``: the stored names of the gate, up and down projections
    per expert (hub layout: ``{base}.{k}.{name}``; Kimi-Linear stores ``w1``, ``w3``, ``w2``);
    ``act``: the gated activation (the native step computes SiLU or SiTU; a scheme's fused MLP
    only SiLU)."""

    #: the stored per-expert names of (gate_proj, up_proj, down_proj) in DeepSeek's hub layout
    HUB_NAMES = ("gate_proj", "up_proj", "down_proj")
    #: its checkpoint name
    qp_ckpt: str
    #: expert-parallel all-reduce of the routed output (``quantplug.parallel``), None: unsplit
    qp_parallel: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: the experts served from the checkpoint's files (``quantplug.experts``, load option
    #: ``expert_cache_mb``), None: held in memory
    qp_store: ExpertStore | None = None

    def __init__(self, cfg: ModelConfig, d: Decisions, base: str, *, hidden: int | None = None,
                 names: tuple[str, str, str] = HUB_NAMES, act: GatedAct = SILU) -> None:
        super().__init__()
        e, h, inter = cfg.n_routed_experts, hidden or cfg.hidden_size, cfg.moe_intermediate_size
        self.act = act
        self.n = e
        #: routed experts [first, first + count) are computed here (expert parallelism:
        #: :meth:`qp_hold_experts` gives each rank a contiguous block); stacked slot = k - slot_base
        #: (0 for schemes that address experts themselves, e.g. an expert pack)
        self.first, self.count, self.slot_base = 0, e, 0
        self.gate_proj: StackedLinear
        self.up_proj: StackedLinear
        self.down_proj: StackedLinear
        ckb = self.qp_ckpt = d.ck(base)
        layout = d.expert_layout(ckb)
        for proj, stored, (i, o) in zip(self.HUB_NAMES, names, ((h, inter), (h, inter), (inter, h))):
            name = f"{ckb}.{proj}"
            src: StackLayout
            if layout in ("hub", "none"):
                src = PerIndexLayout(tuple(f"{ckb}.{k}.{stored}" for k in range(e)))
            elif layout == "stacked":
                src = StackedLayout(name)
            elif proj == "down_proj":
                src = FusedLayout(f"{ckb}.down_proj")
            else:
                src = FusedLayout(f"{ckb}.gate_up_proj", 0 if proj == "gate_proj" else 1, 2)
            shards = [] if layout == "none" else list(src.stored)
            setattr(self, proj, StackedLinear(e, i, o, d.scheme(name, "experts", shards), name, src, d.model_dtype))
        #: gate and up in one grouped call when their scheme fuses them (:meth:`LinearScheme.fuse`)
        self.gate_up: Any = None
        #: a step's experts (few tokens) natively in one call (:class:`quantplug.kernels.compute.MLPStep`)
        self.step: MLPStep | None = None
        #: a token's experts in one call from the scheme (deprecated :meth:`LinearScheme.fuse_mlp`)
        self.one: Any = None

    def qp_hold_experts(self, start: int, count: int, slot_base: int,
                        reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """This rank computes routed experts ``[start, start + count)``, expert k in stacked slot
        ``k - slot_base``, its output summed over the ranks by ``reduce`` (``ExpertParallel``: the
        tensor-parallel plan splits them)."""
        self.first, self.count, self.slot_base = start, count, slot_base
        self.qp_parallel = reduce

    def qp_fuse(self) -> None:
        self.gate_up = fuse_projections([self.gate_proj, self.up_proj])
        self.step = MLPStep.build(self.gate_proj, self.up_proj, self.down_proj, stacked=True, reduce=self.qp_parallel,
                                  act=self.act.native)
        if self.step is None and self.act.is_silu:  # a scheme's fused MLP computes SiLU
            self.one = fuse_mlp(self.gate_proj, self.up_proj, self.down_proj)
            if self.one is not None:
                compute.deprecated_fuse("fuse_mlp", self.gate_proj.scheme)

    def forward_step(self, x: torch.Tensor, ids: Sequence[Sequence[int]], weights: Sequence[Sequence[float]]) -> torch.Tensor:
        """Few tokens x [M, hidden] through their experts ``ids[r]`` (weights ``weights[r]``) in one
        native call (``self.step``), this rank's experts only, each token's experts summed in
        ascending id order as the other paths sum them."""
        pairs = sorted((e - self.slot_base, r, w) for r, (es, ws) in enumerate(zip(ids, weights))
                       for e, w in zip(es, ws) if self.first <= e < self.first + self.count)
        if self.qp_store is not None:  # served from the checkpoint's files
            out = self.qp_store.forward_step(x, [(r, s, w) for s, r, w in pairs])
            return self.qp_parallel(out) if self.qp_parallel is not None else out
        y = self.step(x, [(r, s, w) for s, r, w in pairs]) if self.step is not None else None
        if y is None:  # the step cannot run now (library off, tensors moved): the grouped path
            idx = torch.tensor([list(es) for es in ids], dtype=torch.long, device=x.device)
            w = torch.tensor([list(ws) for ws in weights], dtype=torch.float32, device=x.device)
            return self.forward(x, idx, w)
        return y

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, H], idx / w [T, top_k]. Token-expert pairs are sorted by expert once (one
        bincount read back: the only host sync), each projection runs over the hit experts'
        consecutive row groups (``StackedLinear.forward_grouped``), and one ``index_add_`` sums
        the weighted rows back per token, in ascending expert order as a per-expert loop would."""
        if self.qp_store is not None:  # served from the checkpoint's files
            out = self.qp_store.forward(x, idx, w, self.first, self.count, self.slot_base)
            return self.qp_parallel(out) if self.qp_parallel is not None else out
        if x.shape[0] == 1:
            return self._one_token(x, idx, w)
        out = torch.zeros_like(x)
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)                 # by expert, then by token
        counts = torch.bincount(flat, minlength=self.n).tolist()
        lo = sum(counts[:self.first])
        groups = [(e - self.slot_base, counts[e]) for e in range(self.first, self.first + self.count) if counts[e]]
        if not groups:
            return self.qp_parallel(out) if self.qp_parallel is not None else out
        order = order[lo:lo + sum(n for _, n in groups)]
        tok = order // k
        xs = x.index_select(0, tok)
        if self.gate_up is not None:
            gate, up = self.gate_up(xs, groups).split(self.gate_proj.out_features, dim=-1)
            hs = self.act(gate, up)
        else:
            hs = self.act(self.gate_proj.forward_grouped(xs, groups), self.up_proj.forward_grouped(xs, groups))
        hs = self.down_proj.forward_grouped(hs, groups) * w.reshape(-1).index_select(0, order).unsqueeze(-1)
        out.index_add_(0, tok, hs.to(out.dtype))
        if self.qp_parallel is not None:
            out = self.qp_parallel(out)  # sum of every rank's experts: one all-reduce
        return out

    def _one_token(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for one token (a decode step): its top-k experts read back once, in
        ascending order as the grouped path takes them; the same projections, one group per
        expert, with no sort, count or gather ops; rows summed in that order."""
        ids = idx[0].tolist()
        hit = sorted((e, j) for j, e in enumerate(ids) if self.first <= e < self.first + self.count)
        if not hit:
            out = torch.zeros_like(x)
            return self.qp_parallel(out) if self.qp_parallel is not None else out
        if self.one is not None:
            ws = w[0].tolist()
            return self.forward_one(x, ids, ws)
        groups = [(e - self.slot_base, 1) for e, _ in hit]
        xs = x.expand(len(hit), -1)
        if self.gate_up is not None:
            gate, up = self.gate_up(xs, groups).split(self.gate_proj.out_features, dim=-1)
            hs = self.act(gate, up)
        else:
            hs = self.act(self.gate_proj.forward_grouped(xs, groups), self.up_proj.forward_grouped(xs, groups))
        hs = (self.down_proj.forward_grouped(hs, groups) * w[0, [j for _, j in hit]].unsqueeze(-1)).to(x.dtype)
        out = hs[:1]
        for r in range(1, len(hit)):
            out = out + hs[r:r + 1]
        if self.qp_parallel is not None:
            out = self.qp_parallel(out)
        return out


    def forward_one(self, x: torch.Tensor, ids: Sequence[int], weights: Sequence[float]) -> torch.Tensor:
        """One token [1, hidden] through its experts ``ids`` (weights as floats) in one call of the
        scheme's fused MLP (``self.one``, :meth:`LinearScheme.fuse_mlp`), this rank's experts only,
        in ascending id order as the other paths sum them."""
        hit = sorted((e, w) for e, w in zip(ids, weights) if self.first <= e < self.first + self.count)
        if not hit:
            out = torch.zeros_like(x)
        else:
            out = self.one(x, [e - self.slot_base for e, _ in hit], [w for _, w in hit])
        return self.qp_parallel(out) if self.qp_parallel is not None else out


class MoE(nn.Module):
    """Mixture of experts: ``gate`` (the router: ``gate(x)`` -> expert ids and weights per row,
    ``gate.route_one`` for one token), the routed :class:`Experts` and optional shared experts
    (an :class:`MLP`). An architecture may put its own router in ``gate``.

    ``latent`` (Kimi-K3's latent MoE, ``routed_expert_hidden_size``): the routed experts work in a
    narrower space: ``z = routed_expert_down_proj(x)``, the weighted sum of the chosen experts of
    ``z`` (an RMSNorm ``routed_expert_norm`` of that sum when ``latent_norm``: the sum of every
    rank's experts, before the norm), then ``routed_expert_up_proj`` back to the hidden width; the
    router and the shared experts read ``x`` at full width. ``names`` / ``act``: the experts' stored
    projection names and the activation of every MLP here (see :class:`Experts`)."""

    #: the next MoE layer, whose likely experts a decode step prefetches when experts are served
    #: from the checkpoint's files (set by the text model after loading)
    qp_next: MoE | None = None
    #: load option ``expert_prefetch``
    qp_prefetch: bool = True

    def qp_configure(self, options: LoadOptions) -> None:
        """Takes load option ``expert_prefetch`` (it acts only where experts are served)."""
        self.qp_prefetch = options.expert_prefetch

    def __init__(self, cfg: ModelConfig, d: Decisions, base: str, *, names: tuple[str, str, str] = Experts.HUB_NAMES,
                 act: GatedAct = SILU, latent: int | None = None, latent_norm: bool = False) -> None:
        super().__init__()
        self.gate = Router(cfg, d.ck(f"{base}.gate"))
        #: the latent width of the routed experts (None: they read the hidden states themselves)
        self.latent = latent
        if latent is not None:
            self.routed_expert_down_proj = _lin(d, f"{base}.routed_expert_down_proj", cfg.hidden_size, latent)
            self.routed_expert_up_proj = _lin(d, f"{base}.routed_expert_up_proj", latent, cfg.hidden_size)
        self.routed_expert_norm = (RMSNorm(latent, cfg.rms_norm_eps, d.ck(f"{base}.routed_expert_norm"))
                                   if latent is not None and latent_norm else None)
        self.experts = Experts(cfg, d, f"{base}.experts", hidden=latent, names=names, act=act)
        self.shared_experts = (MLP(d, f"{base}.shared_experts", cfg.hidden_size,
                                   cfg.moe_intermediate_size * cfg.n_shared_experts, act)
                               if cfg.n_shared_experts else None)

    def _prefetch_next(self, flat: torch.Tensor) -> None:
        """Experts served from files: start reading the next MoE layer's likely experts (its router
        on this layer's input, one row) while this layer computes."""
        nxt = self.qp_next
        store = None if nxt is None else nxt.experts.qp_store
        if nxt is None or store is None or not self.qp_prefetch or flat.shape[0] != 1:
            return
        ex = nxt.experts
        ids, _ = nxt.gate.route_one(flat)
        store.prefetch([e - ex.slot_base for e in ids if ex.first <= e < ex.first + ex.count])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.latent is None:
            out = self._routed(x, x.reshape(-1, x.shape[-1]), x.shape)
        else:
            flat = x.reshape(-1, x.shape[-1])
            z = self._routed(flat, self.routed_expert_down_proj(flat), (flat.shape[0], self.latent))
            if self.routed_expert_norm is not None:
                z = self.routed_expert_norm(z)
            out = self.routed_expert_up_proj(z).view(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(self, route: torch.Tensor, flat: torch.Tensor, shape: Any) -> torch.Tensor:
        """The routed experts' weighted sum for the rows of ``flat`` [N, width] (the hidden states,
        or their latent), chosen by the router on ``route`` [N, hidden]; shaped ``shape``."""
        route = route.reshape(-1, route.shape[-1])
        if (self.experts.step is not None or self.experts.qp_store is not None) and flat.shape[0] <= NATIVE_ROWS:
            # few tokens (a decode step, a small batch): routed on Python numbers, every token's
            # experts in one native call
            if flat.shape[0] == 1:
                ids, ws = self.gate.route_one(route)
                rows_ids, rows_w = [ids], [ws]
            else:
                idx, w = self.gate(route)
                rows_ids, rows_w = idx.tolist(), w.tolist()
            self._prefetch_next(route)
            return self.experts.forward_step(flat, rows_ids, rows_w).view(shape)
        if flat.shape[0] == 1 and self.experts.one is not None:
            # a decode step through the scheme's fused MLP: no routing tensors, and (as for every
            # fused call) no forward hooks of the router or the expert linears
            return self.experts.forward_one(flat, *self.gate.route_one(route)).view(shape)
        idx, w = self.gate(route)
        return self.experts(flat, idx, w).view(shape)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer ``model.layers.{i}``: ``x + attn(norm(x))``, then
    ``x + mlp(norm(x))``; the MLP is a :class:`MoE` from ``first_k_dense_replace`` on, else a
    dense :class:`MLP`."""

    def __init__(self, cfg: ModelConfig, i: int, d: Decisions, rotary: Rotary) -> None:
        super().__init__()
        base = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck(f"{base}.input_layernorm"))
        self.self_attn = MLA(cfg, i, d, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                d.ck(f"{base}.post_attention_layernorm"))
        self.mlp: nn.Module = (MoE(cfg, d, f"{base}.mlp") if cfg.is_moe_layer(i)
                               else MLP(d, f"{base}.mlp", cfg.hidden_size, cfg.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(nn.Module):
    """One multi-token-prediction module (``num_nextn_predict_layers``; DeepSeek-V3 ``model.layers.61``):
    ``enorm`` / ``hnorm`` (RMSNorm of the next token's embedding and of the main model's final
    hidden state), ``eh_proj`` [H, 2H] on ``cat([enorm(e), hnorm(h)])``, a full decoder block (the
    same :class:`DecoderLayer` as the main layers, built with its index so MoE / dense follows
    ``first_k_dense_replace``) and ``shared_head.norm``. The checkpoint's copies of the embedding
    and the LM head (``embed_tokens``, ``shared_head.head``) are not loaded: the main model's serve
    (the plan's skip rule ``mtp-shared-copies``). :meth:`DeepseekV3ForCausalLM.mtp_logits` runs it."""

    def __init__(self, cfg: ModelConfig, i: int, d: Decisions, rotary: Rotary) -> None:
        super().__init__()
        base = f"model.layers.{i}"
        h = cfg.hidden_size
        self.index = i
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, d.ck(f"{base}.enorm"))
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, d.ck(f"{base}.hnorm"))
        self.eh_proj = _lin(d, f"{base}.eh_proj", 2 * h, h)
        self.block = DecoderLayer(cfg, i, d, rotary)
        self.head_norm = RMSNorm(h, cfg.rms_norm_eps, d.ck(f"{base}.shared_head.norm"))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None) -> torch.Tensor:
        """``embeds`` [B, T, H] of tokens t_{j+1}, ``hidden`` [B, T, H] the main model's normed final
        hidden states at j: the normed output [B, T, H] whose LM head gives the draft for t_{j+2}
        (ARCHITECTURES D3: embedding first, hidden state second)."""
        return self.head_norm(self.block(self.mix(embeds, hidden), cos, sin, cache))

    def mix(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The block's input: ``eh_proj(cat([enorm(embeds), hnorm(hidden)]))``."""
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))

    def stack_step(self) -> StackStep | None:
        """The block and ``shared_head.norm`` as one native step (:func:`stack_step`), built on
        first use; None where the block runs another way."""
        st = self.__dict__.get("_stack", False)
        if st is False:
            st = stack_step([self.block], self.head_norm, [self.head_norm])
            object.__setattr__(self, "_stack", st)  # not a submodule: a step over this layer's modules
        return st

    def draft_step(self) -> DraftStep | None:
        """The whole layer as the drafter of a native speculative step (:class:`DraftStep`), built
        on first use; None where the block runs another way."""
        st = self.__dict__.get("_draft", False)
        if st is False:
            st = DraftStep.build(self.stack_step(), self.enorm, self.hnorm, self.eh_proj)
            object.__setattr__(self, "_draft", st)
        return st


def stack_step(layers: Sequence[nn.Module], norm: RMSNorm, extra: Sequence[nn.Module]) -> StackStep | None:
    """The native step of decoder ``layers`` then the final ``norm`` in one call
    (:class:`quantplug.kernels.compute.StackStep`; ``extra``: other modules whose hooks it would
    skip); None when any layer runs another way: experts served from files or split over ranks, a
    piece without a native form, an architecture's own router, a DSA indexer, a float16 model."""
    parts: list[StackLayer] = []
    owners: list[tuple[nn.Module, Any]] = []
    for layer in layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        if attn.step is None or attn.indexer is not None or n1.eps != n2.eps:
            return None
        owners.append((attn, attn.step))
        if isinstance(mlp, MLP):
            if mlp.step is None:
                return None
            parts.append(StackLayer(mla=attn.step, attn_norm=n1.weight, ffn_norm=n2.weight, eps=n1.eps, mlp=mlp.step))
            owners.append((mlp, mlp.step))
            continue
        assert isinstance(mlp, MoE)
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


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, d: Decisions) -> None:
        super().__init__()
        emb = d.ck("model.embed_tokens")
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, d.scheme(emb, "embedding"), emb, d.model_dtype)
        self.rotary = Rotary(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, d, self.rotary) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck("model.norm"))
        #: the whole stack's decode step (:meth:`_stack_step`)
        self._stack: StackStep | None = None
        self._stack_tried = False

    def qp_fuse(self) -> None:
        """After loading: each MoE layer learns the next one (for expert prefetch)."""
        moes = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]
        for a, b in zip(moes, moes[1:]):
            object.__setattr__(a, "qp_next", b)  # a reference, not a submodule (no second name, no state)
        self._stack, self._stack_tried = None, False  # built on the first decode step, after every layer's fuse

    def _stack_step(self) -> StackStep | None:
        """The whole stack's native decode step (:class:`quantplug.kernels.compute.StackStep`),
        built once on first use; None when any layer runs another way (:func:`stack_step`), and
        always for a DSA model (DeepSeek-V3.2): the stack step composes the layers' MLA steps,
        which neither write the indexer's keys nor select keys, so a DSA model decodes layer by
        layer (each layer's own native MLA step still runs while every key is selected, see
        :meth:`MLA.forward`)."""
        if self._stack is not None or self._stack_tried:
            return self._stack
        self._stack_tried = True
        self._stack = stack_step(list(self.layers), self.norm, [self.norm])
        return self._stack

    def decode_stack(self) -> StackStep | None:
        """The whole stack's one-call decode step (:class:`quantplug.kernels.compute.StackStep`) for
        an engine that keeps its own (paged) latent cache (:func:`quantplug.bridge.paged_decode`);
        None where this model decodes layer by layer (see :meth:`_stack_step`)."""
        return self._stack_step()

    def decode_logits(self, ids: torch.Tensor, cache: MLACache, head: nn.Module,
                      pick: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """One decode step (``ids`` [B, 1] after the ``cache``'s tokens) from token ids to float32
        logits [B, vocab] through ``head``, in one native call: the embedding lookup, the whole
        stack (:meth:`_stack_step`) and the head; what :meth:`forward` and then ``head`` compute.
        Returns (logits, with ``pick`` the greedy tokens [B] = ``logits.argmax(-1)``, else None);
        None (nothing appended) when a piece runs another way: then the caller runs the modules."""
        if ids.dim() != 2 or ids.shape[1] != 1 or ids.shape[0] > NATIVE_ROWS:
            return None
        st = self._stack_step()
        if st is None:
            return None
        bound = self._bindings(head)
        if bound is None:
            return None
        rot = self.rotary.step_rotation(cache.length, st.dtype)
        got = st.logits(ids, bound[0], rot, cache.layers, bound[1], pick)
        if got is None:
            return None
        assert got[1] is not None  # a head was given
        return got[1], got[2]

    def sequence_logits(self, ids: torch.Tensor, cache: MLACache, head: nn.Module,
                        pick: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``ids`` [1, T] (T <= NATIVE_ROWS) after the ``cache``'s tokens (batch 1) in one native
        call: embedding, the whole stack with each token attending causally on the cache and the
        tokens before it, and ``head`` (:meth:`StackStep.sequence`): what :meth:`forward` and then
        ``head`` compute, row by row as T one-token steps. Returns (the final norm [1, T, hidden],
        float32 logits [T, vocab], with ``pick`` the greedy picks [T]); None (nothing appended) when
        a piece runs another way: then the caller runs the modules. Speculative decoding verifies
        its draft this way."""
        if ids.dim() != 2 or ids.shape[0] != 1 or not 1 <= ids.shape[1] <= NATIVE_ROWS:
            return None
        st = self._stack_step()
        bound = None if st is None else self._bindings(head)
        if st is None or bound is None:
            return None
        rot = self.rotary.step_rotations(cache.length, ids.shape[1], st.dtype)
        got = st.sequence(ids[0], None, bound[0], rot, cache.layers, bound[1], pick)
        if got is None:
            return None
        assert got[1] is not None  # a head was given
        return got[0], got[1], got[2]

    def _bindings(self, head: nn.Module) -> tuple[compute.Bound, compute.Bound] | None:
        """The native bindings of the embedding and of ``head`` (any head module), or None when
        either runs another way (split over ranks, hooked, no native form)."""
        emb = self.embed_tokens
        if emb.qp_parallel is not None or _hooked(emb) or _hooked(head) or getattr(head, "qp_parallel", None) is not None:
            return None
        embed = compute.bound(emb)
        hb = compute.bound(head.qp_tied_embedding() if isinstance(head, TiedHead) else head)
        return None if embed is None or hb is None else (embed, hb)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        """Hidden states [B, T, hidden] of ``ids`` [B, T]; ``positions`` [B, T] default to the
        tokens after the ``cache``'s (0.. without one); with ``cache`` the tokens' latents are
        appended to it (see ``quantplug.generate``)."""
        x = self.embed_tokens(ids)
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if cache is not None and ids.shape[1] == 1 and ids.shape[0] <= NATIVE_ROWS:
            st = self._stack_step()
            if st is not None:
                out = st(x, self.rotary._rotation(cos, sin), cache.layers)
                if out is not None:
                    return out
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if cache is None else cache.layers[i])
        return self.norm(x)


def _hooked(m: nn.Module) -> bool:
    """Whether a module has forward hooks of its own (a fused step would skip them)."""
    return bool(m._forward_hooks or m._forward_pre_hooks)


class DeepseekV3ForCausalLM(GenerationMixin, nn.Module):
    """DeepSeek-V3 / Kimi-K2 text model: ``model.*`` and ``lm_head``; ``generate`` / ``stream``
    from :class:`quantplug.generate.GenerationMixin`."""

    packed_modules_mapping = {
        "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    #: how the model splits over tensor-parallel ranks (``quantplug.parallel`` reads it); the
    #: split serving engines use (vLLM ``models/deepseek_v2.py``, DeepSeek-V3 ``inference/model.py``)
    qp_tp_plan: ClassVar[Mapping[str, TPStyle]] = {
        "model.embed_tokens": VocabParallel(),
        "model.layers.*.self_attn": HeadParallel(column=("q_proj", "q_b_proj", "kv_b_proj", "g_proj"),
                                                 row=("o_proj",), stacks=("k_b", "v_b")),
        "model.layers.*.mlp": FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",)),
        "model.layers.*.mlp.shared_experts": FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",)),
        "model.layers.*.mlp.experts": ExpertParallel(stacks=("gate_proj", "up_proj", "down_proj")),
        "lm_head": ColumnParallel(gather=True),
        # the MTP layers' decoder blocks split as the main layers (eh_proj and the norms replicate)
        "mtp.*.block.self_attn": HeadParallel(column=("q_proj", "q_b_proj", "kv_b_proj", "g_proj"),
                                              row=("o_proj",), stacks=("k_b", "v_b")),
        "mtp.*.block.mlp": FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",)),
        "mtp.*.block.mlp.shared_experts": FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",)),
        "mtp.*.block.mlp.experts": ExpertParallel(stacks=("gate_proj", "up_proj", "down_proj")),
    }
    #: how an engine's own DeepSeek-V3 module tree (vLLM, transformers) takes the planned
    #: modules (``quantplug.bridge`` reads it)
    qp_engine_plan: ClassVar[Mapping[str, EngineEntry]] = {
        "model.layers.*.self_attn": EngineLatentAttention(unsupported=(
            ("g_proj", "the MLA output gate (mla_use_output_gate) is not part of the engines' DeepSeek-V3 attention"),
        )),
        "model.layers.*.mlp": EngineMLP(),
        "model.layers.*.mlp.shared_experts": EngineMLP(),
        "model.layers.*.mlp.experts": EngineExperts(),
    }
    #: stacked layers back to the hub layout (``quantplug.api.dense_state`` reads it)
    qp_dense_state: ClassVar[Mapping[str, DenseRule]] = {
        "model.layers.*.mlp.experts": Unstack(stacks=("gate_proj", "up_proj", "down_proj")),
        "model.layers.*.self_attn": FoldHeads("kv_b_proj", (HeadPart("k_b", transpose=True), HeadPart("v_b"))),
        "mtp.*.block.mlp.experts": Unstack(stacks=("gate_proj", "up_proj", "down_proj")),
        "mtp.*.block.self_attn": FoldHeads("kv_b_proj", (HeadPart("k_b", transpose=True), HeadPart("v_b"))),
    }

    def __init__(self, cfg: ModelConfig, d: Decisions) -> None:
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg, d)
        self.lm_head: nn.Module
        if cfg.tie_word_embeddings:
            self.lm_head = TiedHead(self.model.embed_tokens)
        else:
            self.lm_head = _lin(d, "lm_head", cfg.hidden_size, cfg.vocab_size)
        #: the multi-token-prediction layers the plan loads (``PlanOracle.mtp_layers``: the config's
        #: ``num_nextn_predict_layers`` unless the load option ``mtp`` is false or the checkpoint
        #: stores none), indices ``num_hidden_layers + k``
        n = cfg.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(cfg, n + k, d, self.model.rotary)
                                 for k in range(int(getattr(d, "mtp_layers", 0) or 0)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; ``positions`` / ``cache`` as :meth:`TextModel.forward`."""
        return self.lm_head(self.model(input_ids, positions, cache))

    def next_logits(self, input_ids: torch.Tensor, cache: MLACache) -> torch.Tensor:
        """float32 logits [B, vocab] of the last position only (the LM head runs on one token)."""
        return self._next(input_ids, cache, False)[0]

    def next_tokens(self, input_ids: torch.Tensor, cache: MLACache) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`next_logits` and the greedy pick from them (``argmax(-1)``, [B] int64); a decode
        step picks in the same native call as it computes the logits."""
        logits, picks = self._next(input_ids, cache, True)
        assert picks is not None
        return logits, picks

    def _next(self, input_ids: torch.Tensor, cache: MLACache, pick: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode step in one native call where :meth:`TextModel.decode_logits` runs it, else
        the modules; (logits, the greedy picks when ``pick``)."""
        if input_ids.shape[1] == 1:
            y = self.model.decode_logits(input_ids, cache, self.lm_head, pick)
            if y is not None:
                return y
        logits = self.lm_head(self.model(input_ids, None, cache)[:, -1]).float()
        return logits, (logits.argmax(dim=-1) if pick else None)

    def hidden_and_logits(self, input_ids: torch.Tensor, cache: MLACache,
                          last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model on ``input_ids`` [B, T] after the ``cache``'s tokens (appended to it): its
        normed final hidden states [B, T, H] (the LM head's input, what the MTP layer reads) and
        float32 logits [B, T, vocab], or with ``last_only`` [B, 1, vocab] of the last position (a
        prompt). Speculative decoding prefills and verifies T = 2 tokens this way."""
        if not last_only and input_ids.shape[1] > 1:
            got = self.model.sequence_logits(input_ids, cache, self.lm_head)
            if got is not None:  # one native call (a speculative verify)
                return got[0], got[1].unsqueeze(0)
        hidden = self.model(input_ids, None, cache)
        return hidden, self.lm_head(hidden[:, -1:] if last_only else hidden).float()

    def mtp_logits(self, next_ids: torch.Tensor, hidden: torch.Tensor, cache: MLACache,
                   layer: int = 0) -> torch.Tensor:
        """Draft logits (float32 [B, T, vocab]) of MTP layer ``layer`` (ARCHITECTURES D3):
        ``next_ids`` [B, T] are tokens t_{j+1}, ``hidden`` [B, T, H] the main model's normed final
        hidden states at positions j (:meth:`hidden_and_logits`); row j's logits predict t_{j+2}.
        ``cache`` is the MTP layer's own one-layer cache (:func:`quantplug.generate.new_mtp_cache`),
        whose entry j holds the pair (h_j, t_{j+1}); the T new pairs are appended. Positions: the
        shifted token's own, j + 1 (transformers' MtpModel; vLLM gives j: RoPE logits depend on
        relative positions only, so both agree as long as one is used throughout).
        The lookup and head are the main model's ``embed_tokens`` and ``lm_head``."""
        mtp = self.mtp[layer]
        assert isinstance(mtp, MTPLayer)
        start = cache.length + 1
        if next_ids.shape[0] == 1 and next_ids.shape[1] <= NATIVE_ROWS:
            got = self._mtp_native(mtp, next_ids, hidden, cache, start)
            if got is not None:
                return got
        positions = torch.arange(start, start + next_ids.shape[1], device=next_ids.device)
        positions = positions.unsqueeze(0).expand(next_ids.shape[0], -1)
        embeds = self.model.embed_tokens(next_ids)
        cos, sin = self.model.rotary.cos_sin(positions, embeds.dtype)
        out = mtp(embeds, hidden.to(embeds.dtype), cos, sin, cache.layers[0])
        return self.lm_head(out).float()

    def speculative_step(self, last: torch.Tensor, draft: torch.Tensor, cache: MLACache,
                         mtp_cache: MLACache) -> tuple[list[int], bool, torch.Tensor, torch.Tensor] | None:
        """One greedy speculative step of batch 1 in one native call (``qp_spec_step``): the main
        model on (``last``, ``draft``) [1] each after the ``cache``'s tokens, accepted when its pick
        after ``last`` is ``draft``; then the first MTP layer on the accepted pairs, appended to
        ``mtp_cache``, and the LM head on its last row. Returns (the picks after ``last`` and after
        ``draft``, accepted, the draft logits [1, vocab] as :meth:`mtp_logits` gives the last row's,
        float32 logits [2, vocab] of both positions); the
        main cache holds both tokens (the caller rolls ``draft`` back when rejected). None when a
        piece runs another way (nothing appended): then the caller runs the modules
        (:meth:`hidden_and_logits`, :meth:`mtp_logits`)."""
        if not len(self.mtp):
            return None
        mtp = self.mtp[0]
        assert isinstance(mtp, MTPLayer)
        st, dr = self.model._stack_step(), mtp.draft_step()
        if st is None or dr is None or _hooked(mtp):
            return None
        bound = self.model._bindings(self.lm_head)
        proj = compute.bound(mtp.eh_proj)
        if bound is None or proj is None:
            return None
        rotary = self.model.rotary
        rot = rotary.step_rotations(cache.length, 2, st.dtype)
        drot = rotary.step_rotations(mtp_cache.length + 1, 2, st.dtype)
        ids = torch.cat([last.reshape(1), draft.reshape(1)])
        got = st.speculate(ids, bound[0], rot, cache.layers, bound[1], dr, proj, mtp_cache.layers, drot)
        if got is None:
            return None
        _, logits, dlogits, (a, b, acc) = got
        return [a, b], acc, dlogits, logits

    def _mtp_native(self, mtp: MTPLayer, next_ids: torch.Tensor, hidden: torch.Tensor, cache: MLACache,
                    start: int) -> torch.Tensor | None:
        """:meth:`mtp_logits` of one sequence with the MTP block, its head norm and the LM head in
        one native call (:meth:`MTPLayer.stack_step`; the norms and ``eh_proj`` before it as the
        modules run them); None when a piece runs another way (nothing appended)."""
        st = mtp.stack_step()
        bound = None if st is None else self.model._bindings(self.lm_head)
        if st is None or bound is None:
            return None
        embeds = self.model.embed_tokens(next_ids)
        u = mtp.mix(embeds, hidden.to(embeds.dtype))[0]
        rot = self.model.rotary.step_rotations(start, next_ids.shape[1], st.dtype)
        got = st.sequence(None, u, None, rot, cache.layers, bound[1])
        if got is None or got[1] is None:
            return None
        return got[1].unsqueeze(0)

    def text_lm(self) -> DeepseekV3ForCausalLM:
        return self


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 with DSA, a lightning :class:`Indexer` in
    every attention layer (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``) whose top
    ``index_topk`` keys are the ones each query attends to. Decodes layer by layer (no whole-stack
    native step: :meth:`TextModel._stack_step`)."""


class KimiK25ForConditionalGeneration(GenerationMixin, nn.Module):
    """Kimi-K2.5 / K2.6: the DeepSeek-V3 text model under ``language_model``; vision not loaded."""

    packed_modules_mapping = DeepseekV3ForCausalLM.packed_modules_mapping

    def __init__(self, cfg: ModelConfig, d: Decisions) -> None:
        super().__init__()
        self.config = cfg
        self.language_model = DeepseekV3ForCausalLM(cfg, d)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, cache)

    def text_lm(self) -> DeepseekV3ForCausalLM:
        return self.language_model

