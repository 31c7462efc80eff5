"""DeepSeek-V3.2's lightning indexer (DSA): the sparse attention's key selection, with its float
parameters (``weights_proj``, the LayerNorm ``k_norm``) and DeepSeek's FP8 reference helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import FloatParams
from ..layers.rope import rotate_pairs
from .base import Decisions, lin

if TYPE_CHECKING:
    from ..contract.config import ModelConfig
    from ..options import LoadOptions


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
        self.wq_b = lin(d, f"{base}.wq_b", cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = lin(d, f"{base}.wk", cfg.hidden_size, self.head_dim)
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
