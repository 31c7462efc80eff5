"""Residual schemes: the plain pre-norm layer (:class:`PreNormLayer`, DeepSeek-V3's) and attention
residuals (Kimi-K3, ``attn_res_block_size``: the residual stream mixed across depth, per token, by
a softmax over block sums; :class:`ResScore` is one aggregation point)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..layers.linear import FloatParams
from ..types import Problem, TensorInfo


class ResScore(FloatParams):
    """One attention-residual aggregation point (K3), used only through the product of
    ``<name>_res_norm.weight`` [hidden] and ``<name>_res_proj.weight`` [1, hidden], stored either
    as those two (the release: parameters ``norm`` and ``proj``) or already multiplied as one
    ``<name>_res_score.weight`` [hidden] (llama.cpp's converter fuses them into
    ``attn_res_score`` / ``ffn_res_score`` / ``output_res_score``: parameter ``score``). Exactly
    one form must be complete (a plan error otherwise)."""

    qp_fp32 = frozenset({"norm", "proj", "score"})
    # registered by the loader from the plan (the stored form's); declared for type checkers
    norm: torch.Tensor
    proj: torch.Tensor
    score: torch.Tensor

    def __init__(self, hidden: int, base: str, eps: float) -> None:
        super().__init__()
        self.qp_init(base)
        self.add_float("norm", (hidden,), f"{base}_res_norm.weight", optional=True)
        self.add_float("proj", (1, hidden), f"{base}_res_proj.weight", optional=True)
        self.add_float("score", (hidden,), f"{base}_res_score.weight", optional=True)
        self.eps = eps

    def qp_check(self, found: Mapping[str, TensorInfo]) -> list[Problem]:
        have = sorted(found)
        if have in (["norm", "proj"], ["score"]):
            return []
        b = self.qp_ckpt
        if not have:
            what = "missing"
        elif "score" in have and len(have) > 1:
            what = f"both forms stored ({', '.join(found[k].label for k in have)})"
        else:
            what = f"only {found[have[0]].label} stored"
        some = next(iter(found.values()), None)
        return [Problem(f"{what}: the attention residual {b} needs {b}_res_norm.weight and {b}_res_proj.weight, "
                        f"or their product {b}_res_score.weight (llama.cpp's fused form)",
                        tensor=f"{b}_res_norm.weight", file=some.file.name if some is not None else None,
                        kind="missing")]

    def score_vector(self) -> torch.Tensor:
        """``norm.weight * proj.weight`` as one [hidden] float32 vector."""
        if "score" in self._parameters:
            return self.score.float()
        return self.norm.float() * self.proj.float().reshape(-1)

    def forward(self, rows: Sequence[torch.Tensor], last: torch.Tensor) -> torch.Tensor:
        """The per-token mix of ``rows`` and ``last`` (each [B, T, hidden]): weights softmax over the
        rows of ``sum_d rmsnormed(row)[d] * norm_w[d] * proj_w[d]`` (float32), applied to the raw rows."""
        v = torch.stack([*rows, last], dim=-2).float()                      # [B, T, n + 1, hidden]
        score = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps) * self.score_vector()).sum(-1)
        p = torch.softmax(score, dim=-1)
        return (p.unsqueeze(-1) * v).sum(dim=-2).to(last.dtype)


def attention_residuals(layers: Iterable[Any], h: torch.Tensor, caches: Sequence[Any], block: int,
                        output_res: ResScore, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The residual stream of ``layers`` under attention residuals (block size ``block``; sglang
    ``AttnResidual``, llama.cpp ``kimi-k3.cpp``) from the embedding ``h``: a per-forward bank of
    block sums, row 0 the embedding. Layer L's attention reads the mix of the bank and the current
    partial sum (none at L = 0); where L % block == 0 the partial sum so far becomes a bank row and
    restarts at 0; the MLP reads the mix of the bank and the partial sum after attention. Returns
    the mix of the bank and the last partial sum (``output_res``), the final norm's input. Each
    layer gives ``attn_res`` / ``mlp_res`` (:class:`ResScore`), ``attend(x, cos, sin, cache)``
    (its normed attention) and ``feed(x)`` (its normed MLP); no state crosses forwards."""
    bank: list[torch.Tensor] = []
    for i, (layer, c) in enumerate(zip(layers, caches)):
        x = layer.attn_res(bank, h) if bank else h
        if i % block == 0:
            bank.append(h)
            part = layer.attend(x, cos, sin, c)
        else:
            part = h + layer.attend(x, cos, sin, c)
        h = part + layer.feed(layer.mlp_res(bank, part))
    return output_res(bank, h)


class PreNormLayer(nn.Module):
    """The plain pre-norm residual layer: ``x + attn(input_layernorm(x))``, then
    ``x + mlp(post_attention_layernorm(x))``. The whole-stack native step
    (:func:`quantplug.lower.stack_step`) reads a stack of these (with an MLA ``self_attn`` and an
    MLP or MoE ``mlp``) as its declared layers."""

    def __init__(self, input_layernorm: nn.Module, self_attn: nn.Module, post_attention_layernorm: nn.Module,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))
