"""Architectures added by plugins (``quantplug_architectures``), importable by the tests and by
the tensor-parallel ranks' worker processes (tests/parallel/worker.py).

* ``MyMLAForCausalLM``: a plugin's name for the DeepSeek-V3 skeleton (test_contract's test
  architecture): it inherits the DeepSeek declarations.
* ``TinyMoEForCausalLM``: no DeepSeek class at all, built from ``quantplug.api`` only: plain
  multi-head attention (q / k / v / o), a gated MLP, a softmax top-2 MoE, its own module names
  (``blocks.{i}.attn`` holding checkpoint module ``model.layers.{i}.attn``: the plan's patterns
  name modules, not tensors).
  It declares its tensor-parallel plan and dense-state mapping, so it loads tensor-parallel and
  exports through ``dense_state`` with no core change.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from quantplug import api
from quantplug.models.deepseek import DeepseekV3ForCausalLM
from torch import nn


class MyMLA(DeepseekV3ForCausalLM):
    """The DeepSeek-V3 skeleton under a plugin's architecture name."""


class MyMLAPlugin:
    @api.hookimpl
    def quantplug_architectures(self) -> dict[str, api.ArchSpec]:
        return {"MyMLAForCausalLM": api.ArchSpec("MyMLAForCausalLM", MyMLA, False, ())}


# -- a non-DeepSeek architecture --------------------------------------------------------------------

def _lin(d: Any, name: str, i: int, o: int) -> api.QuantLinear:
    ck = d.ck(name)
    return api.QuantLinear(i, o, d.scheme(ck), ck, d.model_dtype)


class Attention(nn.Module):
    """Causal multi-head attention, no positions (enough for logits to compare)."""

    def __init__(self, cfg: api.ModelConfig, d: Any, base: str) -> None:
        super().__init__()
        self.qp_ckpt = d.ck(base)
        h, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.head_dim = h // self.heads
        self.num_heads = self.heads  # heads computed here (this rank's share under tensor parallelism)
        for proj in ("q_proj", "k_proj", "v_proj"):
            setattr(self, proj, _lin(d, f"{base}.{proj}", h, h))
        self.o_proj = _lin(d, f"{base}.o_proj", h, h)

    def qp_heads(self) -> int:
        return self.heads

    def qp_hold_heads(self, start: int, count: int) -> None:
        self.num_heads = count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    def __init__(self, d: Any, base: str, hidden: int, inter: int) -> None:
        super().__init__()
        self.qp_ckpt = d.ck(base)
        self.gate_proj = _lin(d, f"{base}.gate_proj", hidden, inter)
        self.up_proj = _lin(d, f"{base}.up_proj", hidden, inter)
        self.down_proj = _lin(d, f"{base}.down_proj", inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(api.FloatParams):
    def __init__(self, experts: int, hidden: int, ckpt: str) -> None:
        super().__init__()
        self.qp_init(ckpt)
        self.add_float("weight", (experts, hidden), f"{ckpt}.weight")


class Experts(nn.Module):
    """Routed experts as three stacks, one stored module per expert (hub layout)."""

    def __init__(self, cfg: api.ModelConfig, d: Any, base: str) -> None:
        super().__init__()
        e, h, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        ckb = self.qp_ckpt = d.ck(base)
        for proj, (i, o) in (("gate_proj", (h, inter)), ("up_proj", (h, inter)), ("down_proj", (inter, h))):
            names = tuple(f"{ckb}.{k}.{proj}" for k in range(e))
            layout = api.PerIndexLayout(names)
            setattr(self, proj, api.StackedLinear(e, i, o, d.scheme(f"{ckb}.{proj}", "experts", list(names)),
                                                  f"{ckb}.{proj}", layout, d.model_dtype))
        self.first, self.count, self.slot_base = 0, e, 0
        self.reduce: Any = None

    def qp_hold_experts(self, start: int, count: int, slot_base: int, reduce: Any) -> None:
        self.first, self.count, self.slot_base, self.reduce = start, count, slot_base, reduce

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.first, self.first + self.count):
            rows, j = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                s, xe = e - self.slot_base, x[rows]
                y = self.down_proj(F.silu(self.gate_proj(xe, s)) * self.up_proj(xe, s), s)
                out.index_add_(0, rows, y * w[rows, j].unsqueeze(-1))
        return self.reduce(out) if self.reduce is not None else out


class MoE(nn.Module):
    def __init__(self, cfg: api.ModelConfig, d: Any, base: str) -> None:
        super().__init__()
        self.router = Router(cfg.n_routed_experts, cfg.hidden_size, d.ck(f"{base}.router"))
        self.experts = Experts(cfg, d, f"{base}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        w, idx = torch.softmax(F.linear(flat, self.router.weight), dim=-1).topk(2, dim=-1)
        return self.experts(flat, idx, w).view(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: api.ModelConfig, d: Any, i: int) -> None:
        super().__init__()
        base = f"model.layers.{i}"  # checkpoint names (the core checks num_hidden_layers against them)
        self.norm1 = api.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck(f"{base}.norm1"))
        self.attn = Attention(cfg, d, f"{base}.attn")
        self.norm2 = api.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck(f"{base}.norm2"))
        self.ffn: nn.Module = (MoE(cfg, d, f"{base}.ffn") if i % 2 else
                               GatedMLP(d, f"{base}.ffn", cfg.hidden_size, cfg.intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TinyMoE(nn.Module):
    #: the split, declared: every name below is this architecture's own
    qp_tp_plan = {
        "embed": api.VocabParallel(),
        "blocks.*.attn": api.HeadParallel(column=("q_proj", "k_proj", "v_proj"), row=("o_proj",)),
        "blocks.*.ffn": api.FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",)),
        "blocks.*.ffn.experts": api.ExpertParallel(stacks=("gate_proj", "up_proj", "down_proj")),
        "head": api.ColumnParallel(gather=True),
    }
    qp_dense_state = {"blocks.*.ffn.experts": api.Unstack(stacks=("gate_proj", "up_proj", "down_proj"))}

    def __init__(self, cfg: api.ModelConfig, d: Any) -> None:
        super().__init__()
        self.config = cfg
        emb = d.ck("embed")
        self.embed = api.Embedding(cfg.vocab_size, cfg.hidden_size, d.scheme(emb, "embedding"), emb, d.model_dtype)
        self.blocks = nn.ModuleList(Block(cfg, d, i) for i in range(cfg.num_hidden_layers))
        self.norm = api.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck("norm"))
        self.head = _lin(d, "head", cfg.hidden_size, cfg.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TinyMoEPlugin:
    @api.hookimpl
    def quantplug_architectures(self) -> dict[str, api.ArchSpec]:
        return {"TinyMoEForCausalLM": api.ArchSpec("TinyMoEForCausalLM", TinyMoE, False, ())}


def tiny_moe_state(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of a TinyMoE for ``cfg`` (tiny_config keys), in its hub layout."""
    g = torch.Generator().manual_seed(seed)
    h, inter, e, mi = cfg["hidden_size"], cfg["intermediate_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    st = {"embed.weight": torch.randn(cfg["vocab_size"], h, generator=g), "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
          "head.weight": rnd(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}"
        st[f"{b}.norm1.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        st[f"{b}.norm2.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            st[f"{b}.attn.{p}.weight"] = rnd(h, h)
        if i % 2:
            st[f"{b}.ffn.router.weight"] = rnd(e, h)
            for k in range(e):
                st[f"{b}.ffn.experts.{k}.gate_proj.weight"] = rnd(mi, h)
                st[f"{b}.ffn.experts.{k}.up_proj.weight"] = rnd(mi, h)
                st[f"{b}.ffn.experts.{k}.down_proj.weight"] = rnd(h, mi)
        else:
            st[f"{b}.ffn.gate_proj.weight"] = rnd(inter, h)
            st[f"{b}.ffn.up_proj.weight"] = rnd(inter, h)
            st[f"{b}.ffn.down_proj.weight"] = rnd(h, inter)
    return st


#: plugin classes by the name a tensor-parallel case gives (worker.py registers them)
PLUGINS = {"MyMLAPlugin": MyMLAPlugin, "TinyMoEPlugin": TinyMoEPlugin}
