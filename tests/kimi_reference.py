"""An independent plain-torch float32 reference forward of Kimi-Linear and the released Kimi-K3.

Written from the formulas of ``ARCHITECTURES.md`` (B3 for Kimi-Linear, C3 for K3) alone: nothing here
comes from ``quantplug.models`` or from transformers. Everything is computed in float32 whatever the
checkpoint dtype, one formula per line, with the KDA recurrence run token by token (no chunking) and
MLA in its plain (non-absorbed) form, so that it is slow but easy to check against the document.

Entry points: :func:`kimi_linear_logits` (a ``kimi_linear`` config, names without prefix) and
:func:`k3_logits` (a wrapped ``kimi_k3`` config, names under ``language_model.``). Both take the
release tensor names (``block_sparse_moe.experts.E.w1/w2/w3``, ``{q,k,v}_conv1d``, ``A_log`` on
``self_attn``, ...). Which features apply is read from the config only:

- attention residuals iff ``attn_res_block_size`` is set (else the plain pre-norm residual);
- latent MoE iff ``routed_expert_hidden_size`` is set, its RMSNorm iff ``latent_moe_use_norm``;
- SiTU iff ``hidden_act == "situ"`` (every MLP: dense, shared, routed), else SiLU;
- the MLA output gate iff ``mla_use_output_gate``; q-LoRA iff ``q_lora_rank``;
- the KDA full-rank output gate iff ``linear_attn_config.use_full_rank_gate``, the bounded forget gate
  iff ``linear_attn_config.gate_lower_bound`` is set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["L2_EPS", "MLA_NORM_EPS", "Trace", "attn_res", "k3_logits", "kda", "kimi_linear_logits", "mla", "route", "situ",
           "text_logits"]

#: eps of the MLA ``q_a_layernorm`` / ``kv_a_layernorm`` (ARCHITECTURES B3 / F: transformers and the
#: official code build them with the default 1e-6, not ``rms_norm_eps``).
MLA_NORM_EPS = 1e-6
#: eps of the KDA q/k L2 norm ``x / sqrt(sum x^2 + eps)`` (FLA, transformers).
L2_EPS = 1e-6

Get = Callable[[str], torch.Tensor]
#: what a forward records when asked: ``"route"`` (the ``[N, E]`` combine weights of every MoE layer)
#: and ``"attn_res"`` (the ``[B, T, rows]`` depth softmax of every attention-residual aggregation)
Trace = dict[str, list[torch.Tensor]]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm ``w * x / sqrt(mean(x^2) + eps)`` over the last axis (no ``1 + w``)."""
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for an ``nn.Linear`` weight ``[out, in]``."""
    return x @ w.T


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU (C3): ``beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta) or up)``."""
    act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    return act * (linear_beta * torch.tanh(up / linear_beta) if linear_beta else up)


def _act(cfg: Mapping[str, Any], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation of every MLP: SiTU when ``hidden_act == "situ"``, else SiLU(gate) * up."""
    if cfg.get("hidden_act") == "situ":
        return situ(gate, up, float(cfg.get("activation_situ_beta") or 1.0), cfg.get("activation_situ_linear_beta"))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
    return F.silu(gate) * up


def _mlp(cfg: Mapping[str, Any], x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor,
         down_w: torch.Tensor) -> torch.Tensor:
    """``down(act(gate x, up x))``."""
    return linear(_act(cfg, linear(x, gate_w), linear(x, up_w)), down_w)


def route(cfg: Mapping[str, Any], x: torch.Tensor, get: Get, m: str) -> torch.Tensor:
    """The ``[N, E]`` combine weights of the sigmoid noaux_tc router (zero for unchosen experts).

    Scores ``s = sigmoid(x W^T)``; the top-k of ``s + e_score_correction_bias`` (within the best
    ``topk_group`` of ``num_expert_group`` groups, group score = sum of its top-2 biased scores; inert
    at 1/1); weights = the chosen ``s``, renormalized ``/ (sum + 1e-20)`` when ``moe_renormalize``,
    times ``routed_scaling_factor``."""
    n_exp, k = int(cfg["num_experts"]), int(cfg["num_experts_per_token"])
    s = torch.sigmoid(linear(x, get(f"{m}.gate.weight")))
    choice = s + get(f"{m}.gate.e_score_correction_bias")
    groups, topk_group = int(cfg.get("num_expert_group") or 1), int(cfg.get("topk_group") or 1)
    if groups > 1:
        gs = choice.view(-1, groups, n_exp // groups).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(keep.repeat_interleave(n_exp // groups, dim=1) == 0, float("-inf"))
    idx = choice.topk(k, dim=-1).indices
    w = s.gather(1, idx)
    if cfg.get("moe_renormalize", True):
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * float(cfg.get("routed_scaling_factor", 1.0))
    return torch.zeros_like(s).scatter_(1, idx, w)


def _moe(cfg: Mapping[str, Any], x: torch.Tensor, get: Get, m: str, trace: Trace | None = None) -> torch.Tensor:
    """MoE (B3) and K3's latent MoE (C3) on a normed ``x [B, T, hidden]``.

    Router on the full width; routed experts on ``z = routed_expert_down_proj(x)`` when latent (else on
    x); the weighted sum ``r``, then (latent) ``RMSNorm(r; routed_expert_norm)`` if
    ``latent_moe_use_norm`` and ``routed_expert_up_proj``; plus the shared experts on the ORIGINAL x."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    combine = route(cfg, x2, get, m)
    if trace is not None:
        trace.setdefault("route", []).append(combine)
    latent = cfg.get("routed_expert_hidden_size")
    z = linear(x2, get(f"{m}.routed_expert_down_proj.weight")) if latent else x2
    r = torch.zeros_like(z)
    for e in range(int(cfg["num_experts"])):
        if bool((combine[:, e] != 0).any()):
            pe = f"{m}.experts.{e}"
            r = r + combine[:, e:e + 1] * _mlp(cfg, z, get(f"{pe}.w1.weight"), get(f"{pe}.w3.weight"),
                                               get(f"{pe}.w2.weight"))
    if latent:
        if cfg.get("latent_moe_use_norm"):
            r = rms_norm(r, get(f"{m}.routed_expert_norm.weight"), float(cfg["rms_norm_eps"]))
        r = linear(r, get(f"{m}.routed_expert_up_proj.weight"))
    if int(cfg.get("num_shared_experts") or 0):
        sh = f"{m}.shared_experts"
        r = r + _mlp(cfg, x2, get(f"{sh}.gate_proj.weight"), get(f"{sh}.up_proj.weight"),
                     get(f"{sh}.down_proj.weight"))
    return r.reshape(shape)


def mla(cfg: Mapping[str, Any], x: torch.Tensor, get: Get, a: str) -> torch.Tensor:
    """MLA without RoPE (B3; K3: q-LoRA and the sigmoid output gate on the normed input, C3).

    ``score = (q_nope . k_nope + q_pe . k_pe) * (nope + rope)^-0.5``, k_pe shared by the heads and not
    rotated; causal softmax; ``o * sigmoid(g_proj(x))`` if ``mla_use_output_gate``; ``o_proj``."""
    b, t, _ = x.shape
    nh = int(cfg["num_attention_heads"])
    dn, dr, dv, kl = (int(cfg[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
    if cfg.get("q_lora_rank"):
        q = linear(rms_norm(linear(x, get(f"{a}.q_a_proj.weight")), get(f"{a}.q_a_layernorm.weight"), MLA_NORM_EPS),
                   get(f"{a}.q_b_proj.weight"))
    else:
        q = linear(x, get(f"{a}.q_proj.weight"))
    q = q.view(b, t, nh, dn + dr)
    ckv = linear(x, get(f"{a}.kv_a_proj_with_mqa.weight"))
    c, k_pe = ckv[..., :kl], ckv[..., kl:]
    c = rms_norm(c, get(f"{a}.kv_a_layernorm.weight"), MLA_NORM_EPS)
    kv = linear(c, get(f"{a}.kv_b_proj.weight")).view(b, t, nh, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    score = torch.einsum("bthd,bshd->bhts", q[..., :dn], k_nope) + torch.einsum("bthd,bsd->bhts", q[..., dn:], k_pe)
    score = score * (dn + dr) ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    p = torch.softmax(score.masked_fill(~causal, float("-inf")), dim=-1)
    o = torch.einsum("bhts,bshd->bthd", p, v).reshape(b, t, nh * dv)
    if cfg.get("mla_use_output_gate"):
        o = o * torch.sigmoid(linear(x, get(f"{a}.g_proj.weight")))
    return linear(o, get(f"{a}.o_proj.weight"))


def _per_head_a_log(a_log: torch.Tensor, heads: int) -> torch.Tensor:
    """``A_log`` as ``[H]``: a tensor of H entries (``[H]``, ``[1, 1, H, 1]``) as is, a longer 1-D one
    (sglang's ``[head_dim]`` reading) by its first H entries."""
    if a_log.numel() == heads:
        return a_log.reshape(heads)
    if a_log.dim() == 1 and a_log.numel() > heads:
        return a_log[:heads]
    raise ValueError(f"A_log of shape {tuple(a_log.shape)} for {heads} heads")


def _causal_conv_silu(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SiLU of the causal depthwise conv with zero history: ``out[t, c] = sum_j w[c, j] u[t-W+1+j, c]``
    (``w`` is ``[d, 1, W]`` or ``[d, W]``, no bias)."""
    t = u.shape[1]
    w = w.reshape(u.shape[-1], -1)
    width = w.shape[-1]
    out = torch.zeros_like(u)
    for j in range(width):
        shift = width - 1 - j
        if shift < t:
            out[:, shift:] = out[:, shift:] + w[:, j] * u[:, : t - shift]
    return F.silu(out)


def kda(cfg: Mapping[str, Any], x: torch.Tensor, get: Get, a: str) -> torch.Tensor:
    """Kimi Delta Attention (B3; K3's bounded forget gate and full-rank output gate, C3), token by token.

    q, k, v: projection, causal depthwise conv, SiLU; q and k L2-normed per head; ``beta =
    sigmoid(b_proj x)``; ``gpre = f_b(f_a x) + dt_bias``; the log-decay ``g = lb * sigmoid(exp(A) *
    gpre)`` with ``lb = gate_lower_bound`` if set, else ``g = -exp(A) * softplus(gpre)``; per token:
    ``S *= exp(g)`` along the key axis, ``S += beta k (v - k.S)^T``, ``o = (q K^-0.5) . S``; then the
    per-head RMSNorm ``o_norm`` (eps ``rms_norm_eps``) times ``sigmoid`` of the output gate, ``o_proj``."""
    lin = cfg["linear_attn_config"]
    nh, hd = int(lin["num_heads"]), int(lin["head_dim"])
    b, t, _ = x.shape
    q = _causal_conv_silu(linear(x, get(f"{a}.q_proj.weight")), get(f"{a}.q_conv1d.weight")).view(b, t, nh, hd)
    k = _causal_conv_silu(linear(x, get(f"{a}.k_proj.weight")), get(f"{a}.k_conv1d.weight")).view(b, t, nh, hd)
    v = _causal_conv_silu(linear(x, get(f"{a}.v_proj.weight")), get(f"{a}.v_conv1d.weight")).view(b, t, nh, hd)
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + L2_EPS)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + L2_EPS)
    beta = torch.sigmoid(linear(x, get(f"{a}.b_proj.weight")))  # [B, T, H]
    gpre = (linear(linear(x, get(f"{a}.f_a_proj.weight")), get(f"{a}.f_b_proj.weight"))
            + get(f"{a}.dt_bias")).view(b, t, nh, hd)
    decay_rate = torch.exp(_per_head_a_log(get(f"{a}.A_log"), nh)).view(1, 1, nh, 1)
    lower = lin.get("gate_lower_bound")
    if lower is not None:
        g = float(lower) * torch.sigmoid(decay_rate * gpre)
    else:
        g = -decay_rate * F.softplus(gpre)
    state = torch.zeros(b, nh, hd, hd)  # S[h] in R^{K x V}
    outs = []
    for i in range(t):
        state = state * torch.exp(g[:, i])[..., None]
        k_i, v_i = k[:, i], v[:, i]
        pred = (k_i[..., None] * state).sum(-2)
        state = state + beta[:, i, :, None, None] * k_i[..., None] * (v_i - pred)[..., None, :]
        outs.append(((q[:, i] * hd ** -0.5)[..., None] * state).sum(-2))
    o = torch.stack(outs, dim=1)  # [B, T, H, V]
    if lin.get("use_full_rank_gate"):
        gate = linear(x, get(f"{a}.g_proj.weight"))
    else:
        gate = linear(linear(x, get(f"{a}.g_a_proj.weight")), get(f"{a}.g_b_proj.weight"))
    o = rms_norm(o, get(f"{a}.o_norm.weight"), float(cfg["rms_norm_eps"])) * torch.sigmoid(gate.view(b, t, nh, hd))
    return linear(o.reshape(b, t, nh * hd), get(f"{a}.o_proj.weight"))


def attn_res(rows: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
             trace: Trace | None = None) -> torch.Tensor:
    """One attention-residual aggregation (C3): per token, ``score_j = sum_d rows_j[d] *
    rsqrt(mean(rows_j^2) + eps) * norm_w[d] * proj_w[d]``, ``alpha = softmax_j(score)``, and the mix
    ``sum_j alpha_j rows_j`` of the RAW rows."""
    stacked = torch.stack(rows, dim=-2)  # [B, T, R, H]
    normed = stacked * torch.rsqrt(stacked.pow(2).mean(-1, keepdim=True) + eps)
    score = (normed * (norm_w * proj_w.reshape(-1))).sum(-1)
    alpha = torch.softmax(score, dim=-1)
    if trace is not None:
        trace.setdefault("attn_res", []).append(alpha)
    return (alpha[..., None] * stacked).sum(-2)


def text_logits(cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor], ids: torch.Tensor,
                prefix: str = "", trace: Trace | None = None) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` of a Kimi-Linear-family text model (``cfg`` is the text config, tensor
    names are ``prefix + release name``), with the K3 features the config turns on. ``trace``: a dict
    that receives the router and depth-softmax weights (:data:`Trace`)."""

    def get(name: str) -> torch.Tensor:
        return state[prefix + name].to(torch.float32)

    eps = float(cfg["rms_norm_eps"])
    lin = cfg["linear_attn_config"]
    kda_layers, full_layers = set(lin["kda_layers"]), set(lin["full_attn_layers"])
    dense_below, freq = int(cfg.get("first_k_dense_replace", 1)), int(cfg.get("moe_layer_freq") or 1)
    block = cfg.get("attn_res_block_size")

    def attn(i: int, x: torch.Tensor) -> torch.Tensor:
        a = f"model.layers.{i}.self_attn"
        if i + 1 in kda_layers:
            return kda(cfg, x, get, a)
        if i + 1 in full_layers:
            return mla(cfg, x, get, a)
        raise ValueError(f"1-based layer {i + 1} is in neither kda_layers nor full_attn_layers")

    def mlp(i: int, x: torch.Tensor) -> torch.Tensor:
        if i < dense_below or i % freq:
            m = f"model.layers.{i}.mlp"
            return _mlp(cfg, x, get(f"{m}.gate_proj.weight"), get(f"{m}.up_proj.weight"), get(f"{m}.down_proj.weight"))
        return _moe(cfg, x, get, f"model.layers.{i}.block_sparse_moe", trace)

    h = get("model.embed_tokens.weight")[ids]
    bank: list[torch.Tensor] = []
    for i in range(int(cfg["num_hidden_layers"])):
        lp = f"model.layers.{i}"
        if block is None:  # plain pre-norm residual (Kimi-Linear)
            h = h + attn(i, rms_norm(h, get(f"{lp}.input_layernorm.weight"), eps))
            h = h + mlp(i, rms_norm(h, get(f"{lp}.post_attention_layernorm.weight"), eps))
            continue
        # attention residuals (K3): the bank holds the embedding and the snapshots of the write layers
        x = h if not bank else attn_res([*bank, h], get(f"{lp}.self_attention_res_norm.weight"),
                                        get(f"{lp}.self_attention_res_proj.weight"), eps, trace)
        if i % int(block) == 0:
            bank.append(h)
            partial = torch.zeros_like(h)
        else:
            partial = h
        partial = partial + attn(i, rms_norm(x, get(f"{lp}.input_layernorm.weight"), eps))
        y = attn_res([*bank, partial], get(f"{lp}.mlp_res_norm.weight"), get(f"{lp}.mlp_res_proj.weight"), eps,
                     trace)
        h = partial + mlp(i, rms_norm(y, get(f"{lp}.post_attention_layernorm.weight"), eps))
    if block is not None:
        h = attn_res([*bank, h], get("model.output_attn_res_norm.weight"), get("model.output_attn_res_proj.weight"),
                     eps, trace)
    h = rms_norm(h, get("model.norm.weight"), eps)
    head = get("model.embed_tokens.weight") if cfg.get("tie_word_embeddings") else get("lm_head.weight")
    return linear(h, head)


@torch.no_grad()
def kimi_linear_logits(config: Mapping[str, Any], state: Mapping[str, torch.Tensor], ids: torch.Tensor,
                       trace: Trace | None = None) -> torch.Tensor:
    """Logits of a Kimi-Linear checkpoint (a ``kimi_linear`` config, release names without prefix)."""
    if "text_config" in config:
        raise ValueError("kimi_linear_logits takes a Kimi-Linear config; use k3_logits for a wrapped one")
    return text_logits(config, state, ids, trace=trace)


@torch.no_grad()
def k3_logits(config: Mapping[str, Any], state: Mapping[str, torch.Tensor], ids: torch.Tensor,
              trace: Trace | None = None) -> torch.Tensor:
    """Logits of a released Kimi-K3 checkpoint (a ``kimi_k3`` config with ``text_config``; tensors under
    ``language_model.``; vision tensors are ignored)."""
    if "text_config" not in config:
        raise ValueError("k3_logits takes a wrapped K3 config (with text_config)")
    return text_logits(config["text_config"], state, ids, prefix="language_model.", trace=trace)
