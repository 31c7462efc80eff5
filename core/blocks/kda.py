"""Kimi Delta Attention (KDA), the linear attention of Kimi-Linear and Kimi-K3, with its short
convolution (:class:`ShortConv`) and the chunked / recurrent forms of the delta rule
(docs/architectures/kimi.md). Its generation state is :class:`~quantplug.blocks.cache.KDAState`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..layers.linear import FloatParams
from ..layers.norm import RMSNorm
from ..types import Problem, TensorInfo
from .base import Decisions, lin
from .cache import KDAState

#: tokens per chunk of the chunked KDA form (transformers' and FLA's default)
CHUNK = 64


def kda_step_torch(u: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, gpre: torch.Tensor,
                   dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None, beta_logits: torch.Tensor,
                   gate: torch.Tensor, o_norm_w: torch.Tensor, eps: float, state: torch.Tensor) -> torch.Tensor:
    """One KDA decode token of B sequences in plain torch, the math :meth:`KDA.token` runs and the
    native twin :func:`quantplug.kernels.kda.kda_step` equals (its arguments and the math in
    ``quantplug.kernels.kda``'s docstring): ``conv_state`` and ``state`` are updated in place;
    returns o [B, D] float32."""
    b = u.shape[0]
    h, k = state.shape[1], state.shape[2]
    d = h * k
    f32 = torch.float32
    # the short convolution over [history | this token], then the history shifted by one
    x = torch.cat([conv_state.to(f32), u.to(f32).unsqueeze(-1)], dim=-1)           # [B, 3D, W]
    c = F.silu((x * conv_w.to(f32)).sum(-1))
    conv_state.copy_(x[..., 1:])
    q, kk, v = (c[:, i * d:(i + 1) * d].reshape(b, h, k) for i in range(3))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    q = q * (1.0 / k ** 0.5)
    kk = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(beta_logits.to(f32))                                        # [B, H]
    p = (gpre.to(f32) + dt_bias.to(f32)).reshape(b, h, k)
    a = torch.exp(a_log.to(f32).reshape(h, 1))
    g = lower_bound * torch.sigmoid(a * p) if lower_bound is not None else -a * F.softplus(p)
    s = state.to(f32) * torch.exp(g).unsqueeze(-1)                                   # [B, H, K, V]
    ks = (kk.unsqueeze(-1) * s).sum(-2)                                              # [B, H, V]
    s = s + (beta[..., None] * kk).unsqueeze(-1) * (v - ks).unsqueeze(-2)
    o = (q.unsqueeze(-1) * s).sum(-2)                                                # [B, H, V]
    state.copy_(s)  # rounded to nearest even for a bfloat16 state
    o = o * (1.0 / torch.sqrt((o * o).sum(-1, keepdim=True) / k + eps)) * o_norm_w.to(f32)
    o = o * torch.sigmoid(gate.to(f32).reshape(b, h, k))
    return o.reshape(b, d)


class ShortConv(FloatParams):
    """A depthwise causal convolution's weight ``<ckpt>.weight``, stored [channels, 1, width] (the
    release), [channels, width] (vLLM's and llama.cpp's converters accept both) or [1, channels,
    1, width] (llama.cpp's GGUF: ggml ne [width, 1, channels, 1], the same values in the same
    order), kept in float32 (the release stores it so)."""

    qp_fp32 = frozenset({"weight"})

    def __init__(self, channels: int, width: int, ckpt: str) -> None:
        super().__init__()
        self.qp_init(ckpt)
        self.channels, self.width = channels, width
        self.add_float("weight", (), f"{ckpt}.weight")

    def qp_check(self, found: Mapping[str, TensorInfo]) -> list[Problem]:
        info = found.get("weight")
        c, w = self.channels, self.width
        if info is None or info.shape in ((c, 1, w), (c, w), (1, c, 1, w)):
            return []
        return [Problem(f"shape {list(info.shape)}, expected [{c}, 1, {w}] or [{c}, {w}] (or llama.cpp's "
                        f"[1, {c}, 1, {w}]; depthwise convolution of {self.qp_ckpt})",
                        tensor=info.label, file=info.file.name, kind="shape")]

    def kernel(self) -> torch.Tensor:
        """The weight as [channels, width] float32."""
        return self.weight.reshape(self.channels, self.width).float()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and transformers' form, not F.normalize's)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token (FLA ``naive_recurrent_kda``), float32:
    q, k [B, H, T, K] (L2-normed, q scaled), v [B, H, T, V], g [B, H, T, K] log-decays, beta
    [B, H, T], state [B, H, K, V]. Returns (o [B, H, T, V], the final state)."""
    out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    s = state
    for t in range(q.shape[2]):
        s = s * g[:, :, t].exp().unsqueeze(-1)                               # decay along the key axis
        kv = (s * k[:, :, t].unsqueeze(-1)).sum(dim=-2)                      # k . S  [B, H, V]
        s = s + k[:, :, t].unsqueeze(-1) * ((v[:, :, t] - kv) * beta[:, :, t, None]).unsqueeze(-2)
        out[:, :, t] = (s * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return out, s


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`recurrent_kda` in chunks of ``chunk`` tokens (the same result up to rounding): within
    a chunk the delta rule's triangular system is solved by forward substitution (the WY form of
    transformers' ``chunk_kimi_delta_attention`` torch fallback and FLA's ``naive_chunk_kda``),
    across chunks the state carries. One chunk's pairwise decays [B, H, C, C, K] are the largest
    temporary; the last chunk is just shorter (no padding)."""
    b, h, t, kd = k.shape
    out = torch.empty(b, h, t, v.shape[-1], dtype=torch.float32, device=v.device)
    s = state
    for lo in range(0, t, chunk):
        hi = min(t, lo + chunk)
        c = hi - lo
        qc, kc, vc, bc = q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], beta[:, :, lo:hi]
        gc = g[:, :, lo:hi].cumsum(dim=-2)                                   # [B, H, C, K]
        upper = torch.triu(torch.ones(c, c, dtype=torch.bool, device=q.device), diagonal=1)
        decay = (gc.unsqueeze(-2) - gc.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()
        k_beta, v_beta = kc * bc.unsqueeze(-1), vc * bc.unsqueeze(-1)
        a = -(k_beta.unsqueeze(-2) * kc.unsqueeze(-3) * decay).sum(dim=-1)
        a = a.masked_fill(torch.triu(torch.ones(c, c, dtype=torch.bool, device=q.device)), 0.0)
        for i in range(1, c):
            row = a[..., i, :i].clone()
            a[..., i, :i] = row + (row.unsqueeze(-1) * a[..., :i, :i]).sum(dim=-2)
        a = a + torch.eye(c, dtype=a.dtype, device=a.device)
        u = a @ v_beta
        w = a @ (k_beta * gc.exp())
        inter = (qc * gc.exp()) @ s
        intra = (qc.unsqueeze(-2) * kc.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(upper, 0.0)
        v_new = u - w @ s
        out[:, :, lo:hi] = inter + intra @ v_new
        last = gc[:, :, -1:]                                                 # [B, H, 1, K]
        s = s * last.transpose(-1, -2).exp() + (kc * (last - gc).exp()).transpose(-1, -2) @ v_new
    return out, s


class KDA(FloatParams):
    """Kimi Delta Attention, ``model.layers.{i}.self_attn`` of a KDA layer (see the module
    docstring). Parameters of its own: ``dt_bias`` [H * K] and the heads' decay rate (float32), as
    one of two checkpoint tensors:

    * ``A_log`` (the release): stored [1, 1, H, 1] (Kimi-Linear), [H] (llama.cpp's reading of K3),
      [H, 1] (a llama-quantize rewrite of llama.cpp's [1, 1, H, 1]) or as a longer 1-D tensor of which the first H entries are the heads' (sglang's and
      llama.cpp's converter's rule for K3's [head_dim] tensor);
    * ``A`` = ``-exp(A_log)``, folded (llama.cpp's converter stores it so, ``blk.N.ssm_a``): the
      same shapes. The gate needs only ``exp(A_log)`` = ``-A`` (:meth:`a_exp`), so the folded form
      is used as stored, with no logarithm taken.

    Exactly one of the two must be present; any other shape is a plan error."""

    qp_fp32 = frozenset({"dt_bias", "A_log", "A"})
    #: the native one-token kernel the lowering bound (:func:`quantplug.kernels.kda.kda_step`, run by
    #: :meth:`token`), None: none
    step: Any = None
    # registered by the loader from the plan (A_log, or llama.cpp's folded A); declared for type checkers
    A: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor

    def __init__(self, cfg: Any, i: int, d: Decisions) -> None:
        super().__init__()
        base = f"model.layers.{i}.self_attn"
        self.qp_init(d.ck(base))
        h, heads, hd = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim
        dim = heads * hd
        #: heads (and H * K) computed here: all of them, or this rank's share under tensor
        #: parallelism (:meth:`qp_hold_heads`); ``all_heads`` never changes
        self.heads, self.head_dim, self.dim, self.width = heads, hd, dim, cfg.conv_kernel
        self.all_heads = heads
        self.lower_bound = cfg.gate_lower_bound
        self.q_proj = lin(d, f"{base}.q_proj", h, dim)
        self.k_proj = lin(d, f"{base}.k_proj", h, dim)
        self.v_proj = lin(d, f"{base}.v_proj", h, dim)
        self.q_conv1d = ShortConv(dim, cfg.conv_kernel, d.ck(f"{base}.q_conv1d"))
        self.k_conv1d = ShortConv(dim, cfg.conv_kernel, d.ck(f"{base}.k_conv1d"))
        self.v_conv1d = ShortConv(dim, cfg.conv_kernel, d.ck(f"{base}.v_conv1d"))
        self.f_a_proj = lin(d, f"{base}.f_a_proj", h, hd)
        self.f_b_proj = lin(d, f"{base}.f_b_proj", hd, dim)
        self.add_float("dt_bias", (dim,), f"{self.qp_ckpt}.dt_bias")
        self.add_float("A_log", (), f"{self.qp_ckpt}.A_log", optional=True)
        self.add_float("A", (), f"{self.qp_ckpt}.A", optional=True)
        self.b_proj = lin(d, f"{base}.b_proj", h, heads)
        self.full_rank_gate = cfg.full_rank_gate
        if cfg.full_rank_gate:
            self.g_proj = lin(d, f"{base}.g_proj", h, dim)
        else:
            self.g_a_proj = lin(d, f"{base}.g_a_proj", h, hd)
            self.g_b_proj = lin(d, f"{base}.g_b_proj", hd, dim)
        self.o_norm = RMSNorm(hd, cfg.rms_norm_eps, d.ck(f"{base}.o_norm"))
        self.o_proj = lin(d, f"{base}.o_proj", dim, h)
        self._conv: torch.Tensor | None = None

    def qp_heads(self) -> int:
        """All KDA heads of the layer (``HeadParallel``: the tensor-parallel plan splits them)."""
        return self.all_heads

    def qp_hold_heads(self, start: int, count: int) -> None:
        """This rank computes KDA heads ``[start, start + count)``: its q / k / v, ``f_b_proj``, the
        output gate and ``b_proj`` hold their features, the convolutions / ``dt_bias`` / ``A_log``
        their entries (:class:`~quantplug.models.declarations.HeadSlice`), ``o_proj`` its input
        columns (all-reduced); the forward and a new cache's state follow these counts."""
        self.heads, self.dim = count, count * self.head_dim
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.channels = self.dim
        self._conv = None

    def qp_check(self, found: Mapping[str, TensorInfo]) -> list[Problem]:
        log, folded = found.get("A_log"), found.get("A")
        if log is None and folded is None:
            dt = found.get("dt_bias")
            return [Problem(f"missing: the model needs {self.qp_ckpt}.A_log (or its folded form {self.qp_ckpt}.A "
                            "= -exp(A_log), as llama.cpp's converter stores it)",
                            tensor=f"{self.qp_ckpt}.A_log", file=dt.file.name if dt is not None else None,
                            kind="missing")]
        if log is not None and folded is not None:
            return [Problem(f"both {log.label} and {folded.label} are stored: one KDA decay rate, in one form",
                            tensor=folded.label, file=folded.file.name, kind="shape")]
        info = log or folded
        assert info is not None
        shape, n = info.shape, self.all_heads
        # [1, 1, H, 1] (Kimi-Linear; llama.cpp's ssm_a ne [1, H, 1, 1]), [H], or [H, 1]: llama-quantize
        # writes that ne without its trailing ones ([1, H])
        if shape in ((1, 1, n, 1), (n,), (n, 1)) or (len(shape) == 1 and shape[0] > n):
            return []
        return [Problem(f"shape {list(shape)}, expected [1, 1, {n}, 1] (Kimi-Linear; [{n}, 1] after llama-quantize), "
                        f"[{n}] (one per KDA head) or a "
                        f"1-D tensor of more than {n} entries whose first {n} are the heads' (Kimi-K3's "
                        f"[head_dim] as sglang and llama.cpp read it)", tensor=info.label, file=info.file.name,
                        kind="shape")]

    def a_exp(self) -> torch.Tensor:
        """The heads' ``exp(A_log)``, [H] float32: from ``A_log``, or exactly ``-A`` where the
        folded form was loaded."""
        if "A" in self._parameters:
            return -self.A.reshape(-1)[:self.heads].float()
        return self.A_log.reshape(-1)[:self.heads].float().exp()

    def a_log(self) -> torch.Tensor:
        """The heads' A_log, [H] float32 (``log(-A)`` where the folded form was loaded)."""
        if "A" in self._parameters:
            return torch.log(-self.A.reshape(-1)[:self.heads].float())
        return self.A_log.reshape(-1)[:self.heads].float()

    def conv_weight(self) -> torch.Tensor:
        """q | k | v convolution weights as one [3 * H * K, width] float32 tensor (made once)."""
        if self._conv is None or self._conv.device != self.q_conv1d.weight.device:
            self._conv = torch.cat([c.kernel() for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
        return self._conv

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g [..., H, K] (float32, <= 0) of the layer input ``x``."""
        pre = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).unflatten(-1, (self.heads, self.head_dim))
        a = self.a_exp()[:, None]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(a * pre)
        # softplus with transformers' threshold: x above 20 stays x
        return -a * torch.where(pre > 20.0, pre, torch.log(1.0 + torch.exp(pre)))

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))

    def qp_engine_floats(self) -> dict[str, torch.Tensor]:
        """The float tensors as engines hold a KDA layer
        (:class:`~quantplug.models.declarations.EngineFloats`; transformers' conversion of the
        release): ``conv1d.weight`` [3 * H * K, 1, W] float32 (the q, k, v convolutions in order,
        whichever shape they were stored in), ``dt_bias``, ``A_log`` [H] float32 (computed as
        ``log(-A)`` where llama.cpp's folded ``A`` was loaded) and ``o_norm.weight`` as loaded."""
        return {"conv1d.weight": self.conv_weight().unsqueeze(1), "dt_bias": self.dt_bias, "A_log": self.a_log(),
                "o_norm.weight": self.o_norm.weight}

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                cache: KDAState | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; with ``cache`` the tokens continue its state (updated
        in place: convolution inputs, recurrent state, length). ``cos`` / ``sin`` are ignored
        (no position input), accepted for the decoder layer's common call."""
        b, t, _ = x.shape
        if t == 1 and cache is not None:
            out = self.token(x, cache, kda_step_torch)
            assert out is not None  # the torch kernel always runs
            return out
        heads, hd, dim = self.heads, self.head_dim, self.dim
        u = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).float().transpose(1, 2)  # [B, 3D, T]
        w = self.conv_weight()
        hist = (cache.conv if cache is not None else
                torch.zeros(b, 3 * dim, self.width - 1, dtype=torch.float32, device=x.device))
        full = torch.cat([hist, u], dim=-1)                                  # [B, 3D, W - 1 + T]
        conv = F.silu(F.conv1d(full, w.unsqueeze(1), groups=3 * dim))        # [B, 3D, T]
        q, k, v = conv.transpose(1, 2).split(dim, dim=-1)                    # [B, T, D] each
        q = l2norm(q.unflatten(-1, (heads, hd))).transpose(1, 2) * hd ** -0.5  # [B, H, T, K]
        k = l2norm(k.unflatten(-1, (heads, hd))).transpose(1, 2)
        v = v.unflatten(-1, (heads, hd)).transpose(1, 2)
        g = self.gate(x).transpose(1, 2)                                     # [B, H, T, K]
        beta = torch.sigmoid(self.b_proj(x).float()).transpose(1, 2)         # [B, H, T]
        s0 = (cache.state.float() if cache is not None else
              torch.zeros(b, heads, hd, hd, dtype=torch.float32, device=x.device))
        if t == 1:
            o, s = recurrent_kda(q, k, v, g, beta, s0)
        else:
            o, s = chunk_kda(q, k, v, g, beta, s0)
        if cache is not None:
            cache.advance(t)
            cache.conv.copy_(full[..., full.shape[-1] - cache.conv.shape[-1]:])
            cache.state.copy_(s.to(cache.state.dtype))
        o = o.transpose(1, 2)                                                # [B, T, H, V]
        gate = self.output_gate(x).float().unflatten(-1, (heads, hd))
        o = self.o_norm(o) * torch.sigmoid(gate)
        return self.o_proj(o.flatten(-2).to(x.dtype))


    def token(self, x: torch.Tensor, cache: KDAState, kernel: Any) -> torch.Tensor | None:
        """One decode token x [B, 1, hidden] of B sequences continuing ``cache``: the projections are
        the layer's own products, then ``kernel`` (:func:`kda_step_torch`, or its native twin
        :func:`quantplug.kernels.kda.kda_step` as the lowering binds it) runs the convolution, the
        gates, the state update and the gated norm, updating ``cache`` in place. None (nothing
        changed) where ``kernel`` declines."""
        if cache.length >= cache.limit:
            cache.advance(1)  # raises: the sequence would exceed the model's context
        b = x.shape[0]
        xf = x.reshape(b, -1)
        u = torch.cat([self.q_proj(xf), self.k_proj(xf), self.v_proj(xf)], dim=-1).float().contiguous()
        o = kernel(u, self.conv_weight(), cache.conv, self.f_b_proj(self.f_a_proj(xf)).float().contiguous(),
                   self.dt_bias.float().contiguous(), self.a_log().contiguous(), self.lower_bound,
                   self.b_proj(xf).float().contiguous(), self.output_gate(xf).float().contiguous(),
                   self.o_norm.weight.float().contiguous(), self.o_norm.eps, cache.state)
        if o is None:
            return None
        cache.advance(1)
        return self.o_proj(o.view(b, 1, -1).to(x.dtype))
