"""Kimi-Linear (``KimiLinearForCausalLM``) and the released Kimi-K3 (``KimiK3ForConditionalGeneration``).

Both are hybrids of two attention kinds over the core's blocks (docs/architectures/kimi.md):

* **KDA** (Kimi Delta Attention, :class:`KDA`): a linear-attention recurrence with a fixed-size
  float32 state per head. q / k / v projections, a causal depthwise convolution of width
  ``short_conv_kernel_size`` with SiLU, L2-normed q and k, a per-channel forget gate from a
  low-rank projection (``f_a_proj`` / ``f_b_proj``, ``dt_bias``, ``A_log``: Kimi-Linear's
  ``-exp(A) * softplus``, or K3's bounded ``gate_lower_bound * sigmoid(exp(A) * .)``), beta, the
  delta rule, a per-head RMSNorm gated by ``sigmoid`` of a low-rank (``g_a_proj`` / ``g_b_proj``)
  or full-rank (``g_proj``, K3) output gate, and ``o_proj``. Prompts run the chunked form (chunks of
  :data:`CHUNK` tokens, the WY representation of transformers' / FLA's torch reference), decode
  steps the recurrent one.
* **MLA without RoPE** (the core's :class:`~quantplug.models.deepseek.MLA` with :class:`NoRope`):
  Kimi-Linear's has a plain ``q_proj``, K3's a q-LoRA and a sigmoid output gate ``g_proj``.

MLPs: a dense gated MLP at layer 0, then MoE under ``block_sparse_moe`` with per-expert ``w1``
(gate), ``w3`` (up), ``w2`` (down), the sigmoid router with ``e_score_correction_bias`` and shared
experts. K3 adds SiTU on every MLP, the latent MoE (``routed_expert_hidden_size``) and attention
residuals (``attn_res_block_size``: the residual stream mixed across depth, per token, by a softmax
over block sums; see :class:`KimiTextModel`).

Layer kinds come from ``linear_attn_config.kda_layers`` / ``full_attn_layers`` (1-based lists, as
the release and sglang read them; transformers' fallback when they are absent does not match the
release, so they are required here).

The generation cache (:class:`HybridCache`) holds one :class:`KDAState` (recurrent state and the
convolution's last inputs) per KDA layer beside one latent cache per MLA layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..generate import GenerationError, GenerationMixin, LatentCache, MLACache, layer_cache
from ..kernels.kda import kda_step
from ..layers.activation import SILU, GatedAct
from ..layers.embedding import Embedding, TiedHead
from ..layers.linear import FloatParams
from ..layers.norm import RMSNorm
from ..layers.rope import Rotary
from ..types import Problem, TensorInfo
from ..validation import Fields
from .config import (
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_POSITIONS,
    ModelConfig,
    RopeConfig,
    parse_model_config,
)
from .declarations import (
    ColumnParallel,
    DenseRule,
    EngineEntry,
    EngineExperts,
    EngineLatentAttention,
    EngineMLP,
    EngineRename,
    ExpertParallel,
    FeatureParallel,
    FoldHeads,
    HeadParallel,
    HeadPart,
    HeadSlice,
    TPStyle,
    Unstack,
    VocabParallel,
)
from .deepseek import MLA, MLP, Decisions, MoE, _lin

if TYPE_CHECKING:
    from ..contract.options import LoadOptions

#: tokens per chunk of the chunked KDA form (transformers' and FLA's default)
CHUNK = 64

#: Kimi-Linear's config keys and the DeepSeek-V3 names the core's parser reads them under
#: (transformers' ``KimiLinearConfig.attribute_map``)
_ALIASES = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "model_max_length": "max_position_embeddings",
}


@dataclass(frozen=True, eq=False)
class KimiConfig(ModelConfig):
    """:class:`ModelConfig` plus the Kimi-Linear / Kimi-K3 fields."""

    #: KDA heads H and head dim K (= V); the depthwise convolution's width
    kda_heads: int = 0
    kda_head_dim: int = 0
    conv_kernel: int = 4
    #: 0-based indices of the KDA layers (the others are MLA)
    kda_layers: frozenset[int] = frozenset()
    #: K3's bounded forget gate (``linear_attn_config.gate_lower_bound``), None: softplus gate
    gate_lower_bound: float | None = None
    #: KDA output gate: one full-rank ``g_proj`` (K3) instead of ``g_a_proj`` / ``g_b_proj``
    full_rank_gate: bool = False
    #: attention residuals' block size (K3), None: the plain pre-norm residual
    attn_res_block_size: int | None = None
    #: latent MoE width (``routed_expert_hidden_size``, K3), None: experts at the hidden width
    latent_size: int | None = None
    latent_norm: bool = False
    #: the activation of every MLP (SiLU, or K3's SiTU)
    act: GatedAct = SILU
    moe_layer_freq: int = 1

    __hash__ = ModelConfig.__hash__

    def is_kda(self, i: int) -> bool:
        return i in self.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def kda_dim(self) -> int:
        """H * K: the width of KDA's q, k, v."""
        return self.kda_heads * self.kda_head_dim


def _layer_list(f: Fields, key: str, layers: int) -> list[int]:
    value = f.data.get(key)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        f.fail(key, value, "a list of 1-based layer numbers")
    bad = [v for v in value if not 1 <= v <= layers]
    if bad:
        f.fail(key, bad[0], f"layer numbers from 1 to num_hidden_layers ({layers}), 1-based")
    return list(value)


def parse_kimi_config(config: dict[str, Any], architecture: str, wrapped: bool, file: str = "config.json") -> KimiConfig:
    """Kimi-Linear's config schema (``kimi_linear``; under ``text_config`` for K3): the keys the core
    reads under DeepSeek names (aliases of :data:`_ALIASES`), checked under their own names here,
    then the KDA, attention-residual, latent-MoE and SiTU fields. Every refusal is a
    :class:`~quantplug.errors.ConfigError` naming ``file`` and the key."""
    top = Fields(config, file)
    f = top
    if wrapped:
        text = top.get_obj("text_config")
        if text is None:
            raise ConfigError(f"{file}: {architecture} needs a 'text_config' object")
        f = text
    where = "text_config." if wrapped else ""
    lin = f.get_obj("linear_attn_config")
    if lin is None:
        tt = f.data.get("model_type")
        hint = (f" (text_config.model_type is {tt!r}: a DeepSeek-V3 layout with an MLA output gate loads as "
                "KimiK25ForConditionalGeneration with mla_use_output_gate: true)" if wrapped else "")
        raise ConfigError(f"{file}: {where}linear_attn_config: missing; {architecture} is a KDA + MLA hybrid whose "
                          f"layer kinds it lists (kda_layers / full_attn_layers){hint}")
    layers = f.get_int("num_hidden_layers", 1, MAX_LAYERS)
    f.get_str("moe_router_activation_func", "sigmoid", choices=("sigmoid",))
    act_name = f.get_str("hidden_act", "silu", choices=("silu", "situ"))
    if not f.get_bool("mla_use_nope", False):
        f.fail("mla_use_nope", f.data.get("mla_use_nope"), "true: quantplug runs Kimi's MLA without RoPE, as every "
                                                           "release is (Kimi-Linear, Kimi-K3)")
    n_routed = f.get_int("num_experts", 0, MAX_EXPERTS, 0) if f.has("num_experts") else None
    if n_routed is not None:
        f.get_int("num_experts_per_token", 1, max(n_routed, 1), 1)
    f.get_int("num_shared_experts", 0, 64, 0)
    f.get_int("num_expert_group", 1, MAX_EXPERTS, 1)
    f.get_bool("moe_renormalize", False)
    f.get_int("model_max_length", 1, MAX_POSITIONS, 4096)
    heads = lin.get_int("num_heads", 1, MAX_HEADS)
    head_dim = lin.get_int("head_dim", 1, MAX_HEAD_DIM)
    kernel = lin.get_int("short_conv_kernel_size", 1, 64, 4)
    kda = _layer_list(lin, "kda_layers", layers)
    full = _layer_list(lin, "full_attn_layers", layers)
    both = sorted(set(kda) & set(full))
    if both:
        lin.fail("kda_layers", both[0], f"layers apart from full_attn_layers (layer {both[0]} is in both)")
    missing = sorted(set(range(1, layers + 1)) - set(kda) - set(full))
    if missing:
        lin.fail("full_attn_layers", full, f"with kda_layers, every layer 1..{layers} (layer {missing[0]} is in "
                                           "neither list)")
    lower = lin.opt_float("gate_lower_bound", -1e4, 0.0)
    if lower is not None and lower >= 0:
        lin.fail("gate_lower_bound", lower, "a negative number (the forget gate's log-decay floor)")
    block = f.opt_int("attn_res_block_size", 1, MAX_LAYERS)
    latent = f.opt_int("routed_expert_hidden_size", 1, 1 << 20)
    act = SILU
    if act_name == "situ":
        # sglang: ``beta or 1.0``; linear_beta 0 / absent: no soft cap on the up projection
        beta = f.get_float("activation_situ_beta", 1e-6, 1e6, 1.0) if f.data.get("activation_situ_beta") else 1.0
        lbeta = f.opt_float("activation_situ_linear_beta", 0.0, 1e6)
        act = GatedAct("situ", beta, lbeta or None)
    # the core's parser on the DeepSeek names (aliases renamed; hidden_act and RoPE are not DeepSeek's here)
    deepseek: dict[str, Any] = {_ALIASES.get(k, k): v for k, v in f.data.items()
            if k not in ("hidden_act", "rope_scaling", "rope_parameters", "moe_router_activation_func")
            and not (k in _ALIASES and _ALIASES[k] in f.data)}
    deepseek.setdefault("n_routed_experts", 0)
    # the router has no groups in these models (1 / 1): the core's grouped router then keeps all
    deepseek.setdefault("n_group", 1)
    deepseek.setdefault("topk_group", 1)
    if not deepseek.get("qk_rope_head_dim"):
        f.fail("qk_rope_head_dim", f.data.get("qk_rope_head_dim"), "a positive even integer (MLA's k_pe width, "
                                                                   "stored even without RoPE)")
    inner = {**config, "text_config": deepseek} if wrapped else deepseek
    base = parse_model_config(inner, architecture, wrapped, file)
    cfg = KimiConfig(**{fld.name: getattr(base, fld.name) for fld in dataclasses.fields(ModelConfig)},
                     kda_heads=heads, kda_head_dim=head_dim, conv_kernel=kernel,
                     kda_layers=frozenset(v - 1 for v in kda), gate_lower_bound=lower,
                     full_rank_gate=lin.get_bool("use_full_rank_gate", False), attn_res_block_size=block,
                     latent_size=latent, latent_norm=f.get_bool("latent_moe_use_norm", False), act=act,
                     moe_layer_freq=f.get_int("moe_layer_freq", 1, MAX_LAYERS, 1))
    return dataclasses.replace(cfg, rope=RopeConfig(10000.0, "default"), raw=f.data)


# ---------------------------------------------------------------------------------------------
# blocks
# ---------------------------------------------------------------------------------------------

class NoRope(Rotary):
    """MLA without RoPE (``mla_use_nope``): rotations by angle 0 (cos 1, sin 0), exactly the
    identity, so every MLA path of the core (the native step included) runs unchanged."""

    def __init__(self, dim: int) -> None:
        super().__init__(RopeConfig(10000.0, "default"), dim, True)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*positions.shape, self.inv_freq.numel() * 2)
        return (torch.ones(shape, dtype=dtype, device=positions.device),
                torch.zeros(shape, dtype=dtype, device=positions.device))


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


class KDAState:
    """One KDA layer's generation state: the recurrent state ``state`` [B, H, K, V] (float32, or
    bfloat16 to halve it) and the convolution's last ``width - 1`` inputs ``conv`` [B, 3 * H * K,
    width - 1] (float32), after ``length`` tokens.

    A state cannot be cut back by moving a length as a latent cache can: :meth:`snapshot` keeps a
    copy at the current length (what a speculative decoder takes before a draft), and
    :meth:`truncate` restores the snapshot of the requested length."""

    def __init__(self, batch: int, channels: int, width: int, heads: int, head_dim: int, *,
                 device: torch.device, limit: int, state_dtype: torch.dtype = torch.float32) -> None:
        self.conv = torch.zeros(batch, channels, max(width - 1, 0), dtype=torch.float32, device=device)
        self.state = torch.zeros(batch, heads, head_dim, head_dim, dtype=state_dtype, device=device)
        self.length = 0
        self.limit = limit
        self._snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def advance(self, t: int) -> None:
        """Count ``t`` more tokens (the caller updated the state in place)."""
        if self.length + t > self.limit:
            raise GenerationError(f"sequence of {self.length + t} tokens exceeds the model's context of {self.limit}")
        self.length += t

    def snapshot(self) -> None:
        """Keep a copy of the state at the current length (a later :meth:`truncate` to it restores it)."""
        self._snapshots[self.length] = (self.conv.clone(), self.state.clone())

    def truncate(self, length: int) -> None:
        """Back to ``length`` tokens: the current state, or a :meth:`snapshot` taken at that length."""
        if length == self.length:
            return
        snap = self._snapshots.get(length)
        if snap is None:
            raise GenerationError(f"cannot roll a KDA layer's state back from {self.length} to {length} tokens: "
                                  f"no snapshot at {length} (held: {sorted(self._snapshots) or 'none'})")
        self.conv.copy_(snap[0])
        self.state.copy_(snap[1])
        self.length = length
        self._snapshots = {n: s for n, s in self._snapshots.items() if n <= length}

    def nbytes(self) -> int:
        return self.conv.nbytes + self.state.nbytes


class HybridCache(MLACache):
    """The cache of a KDA + MLA model: per layer a :class:`KDAState` or a
    :class:`~quantplug.generate.LatentCache`, all of the same length."""

    def snapshot(self) -> None:
        for c in self.layers:
            if isinstance(c, KDAState):
                c.snapshot()

    def bytes_per_token(self) -> int:
        """Bytes the MLA layers' caches hold per token (the KDA states do not grow)."""
        return sum(sum(b.shape[3] * b.element_size() for b in (c.latent, c.k_rope)) for c in self.layers
                   if isinstance(c, LatentCache))

    def state_bytes(self) -> int:
        """Bytes of the KDA layers' fixed-size states (recurrent and convolution)."""
        return sum(c.nbytes() for c in self.layers if isinstance(c, KDAState))

    def nbytes(self) -> int:
        return self.state_bytes() + sum(c.latent.nbytes + c.k_rope.nbytes for c in self.layers
                                        if isinstance(c, LatentCache))


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
    # registered by the loader from the plan (A_log, or llama.cpp's folded A); declared for type checkers
    A: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor

    def __init__(self, cfg: KimiConfig, i: int, d: Decisions) -> None:
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
        self.q_proj = _lin(d, f"{base}.q_proj", h, dim)
        self.k_proj = _lin(d, f"{base}.k_proj", h, dim)
        self.v_proj = _lin(d, f"{base}.v_proj", h, dim)
        self.q_conv1d = ShortConv(dim, cfg.conv_kernel, d.ck(f"{base}.q_conv1d"))
        self.k_conv1d = ShortConv(dim, cfg.conv_kernel, d.ck(f"{base}.k_conv1d"))
        self.v_conv1d = ShortConv(dim, cfg.conv_kernel, d.ck(f"{base}.v_conv1d"))
        self.f_a_proj = _lin(d, f"{base}.f_a_proj", h, hd)
        self.f_b_proj = _lin(d, f"{base}.f_b_proj", hd, dim)
        self.add_float("dt_bias", (dim,), f"{self.qp_ckpt}.dt_bias")
        self.add_float("A_log", (), f"{self.qp_ckpt}.A_log", optional=True)
        self.add_float("A", (), f"{self.qp_ckpt}.A", optional=True)
        self.b_proj = _lin(d, f"{base}.b_proj", h, heads)
        self.full_rank_gate = cfg.full_rank_gate
        if cfg.full_rank_gate:
            self.g_proj = _lin(d, f"{base}.g_proj", h, dim)
        else:
            self.g_a_proj = _lin(d, f"{base}.g_a_proj", h, hd)
            self.g_b_proj = _lin(d, f"{base}.g_b_proj", hd, dim)
        self.o_norm = RMSNorm(hd, cfg.rms_norm_eps, d.ck(f"{base}.o_norm"))
        self.o_proj = _lin(d, f"{base}.o_proj", dim, h)
        self._conv: torch.Tensor | None = None
        #: decode steps through the native KDA step (false: the torch recurrence, e.g. to compare)
        self.native = True

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
        if t == 1 and cache is not None and self.native and cache.length < cache.limit:
            out = self._step(x, cache)
            if out is not None:
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


    def _step(self, x: torch.Tensor, cache: KDAState) -> torch.Tensor | None:
        """One decode token of B sequences with the native step (:func:`quantplug.kernels.kda.kda_step`:
        convolution, gates, the state update and the gated norm in one call; the projections are
        the layers' own products), or None (nothing changed) where it cannot run."""
        b = x.shape[0]
        xf = x.reshape(b, -1)
        u = torch.cat([self.q_proj(xf), self.k_proj(xf), self.v_proj(xf)], dim=-1).float().contiguous()
        o = kda_step(u, self.conv_weight(), cache.conv, self.f_b_proj(self.f_a_proj(xf)).float().contiguous(),
                     self.dt_bias.float().contiguous(), self.a_log().contiguous(), self.lower_bound,
                     self.b_proj(xf).float().contiguous(), self.output_gate(xf).float().contiguous(),
                     self.o_norm.weight.float().contiguous(), self.o_norm.eps, cache.state)
        if o is None:
            return None
        cache.advance(1)
        return self.o_proj(o.view(b, 1, -1).to(x.dtype))


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


class KimiDecoderLayer(nn.Module):
    """``model.layers.{i}``: input / post-attention norms, ``self_attn`` (:class:`KDA` or MLA
    without RoPE), ``mlp`` (dense, layer < ``first_k_dense_replace``) or ``block_sparse_moe``, and
    with attention residuals the two aggregation points ``self_attention_res_*`` / ``mlp_res_*``."""

    def __init__(self, cfg: KimiConfig, i: int, d: Decisions, rotary: Rotary) -> None:
        super().__init__()
        base = f"model.layers.{i}"
        self.index = i
        self.kda = cfg.is_kda(i)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck(f"{base}.input_layernorm"))
        self.self_attn: nn.Module = KDA(cfg, i, d) if self.kda else MLA(cfg, i, d, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                d.ck(f"{base}.post_attention_layernorm"))
        self.mlp: nn.Module
        self.block_sparse_moe: nn.Module
        if cfg.is_moe_layer(i):
            self.block_sparse_moe = MoE(cfg, d, f"{base}.block_sparse_moe", names=("w1", "w3", "w2"), act=cfg.act,
                                        latent=cfg.latent_size, latent_norm=cfg.latent_norm)
        else:
            self.mlp = MLP(d, f"{base}.mlp", cfg.hidden_size, cfg.intermediate_size, cfg.act)
        self.attn_res: ResScore | None = None
        self.mlp_res: ResScore | None = None
        if cfg.attn_res_block_size is not None:
            self.attn_res = ResScore(cfg.hidden_size, d.ck(f"{base}.self_attention"), cfg.rms_norm_eps)
            self.mlp_res = ResScore(cfg.hidden_size, d.ck(f"{base}.mlp"), cfg.rms_norm_eps)

    @property
    def ffn(self) -> nn.Module:
        """The layer's MLP: the dense ``mlp`` or the ``block_sparse_moe``."""
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x), cos, sin, cache)

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """The plain pre-norm residual (no attention residuals)."""
        x = x + self.attend(x, cos, sin, cache)
        return x + self.feed(x)


class KimiTextModel(nn.Module):
    """``model.*``: the embedding, the layers, the final norm and, with attention residuals, the
    output aggregation ``output_attn_res_*``.

    Attention residuals (``attn_res_block_size`` = B; sglang ``AttnResidual``, llama.cpp
    ``kimi-k3.cpp``): a per-forward bank of block sums, row 0 the embedding. Layer L's attention
    reads the mix of the bank and the current partial sum (none at L = 0); where L % B == 0 the
    partial sum so far becomes a bank row and restarts at 0; the MLP reads the mix of the bank and
    the partial sum after attention; the final norm reads the mix of the bank and the last partial
    sum. No state crosses forwards."""

    def __init__(self, cfg: KimiConfig, d: Decisions) -> None:
        super().__init__()
        emb = d.ck("model.embed_tokens")
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, d.scheme(emb, "embedding"), emb, d.model_dtype)
        self.rotary = NoRope(cfg.qk_rope_head_dim)
        self.layers = nn.ModuleList(KimiDecoderLayer(cfg, i, d, self.rotary) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, d.ck("model.norm"))
        self.block = cfg.attn_res_block_size
        self.output_res: ResScore | None = None
        if self.block is not None:
            self.output_res = ResScore(cfg.hidden_size, d.ck("model.output_attn"), cfg.rms_norm_eps)

    def qp_fuse(self) -> None:
        """After loading: each MoE layer learns the next one (for expert prefetch)."""
        moes = [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoE)]
        for a, b in zip(moes, moes[1:]):
            object.__setattr__(a, "qp_next", b)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, cache: MLACache | None = None) -> torch.Tensor:
        """Normed hidden states [B, T, hidden] of ``ids`` [B, T] (no position input: ``positions``
        is accepted and unused); with ``cache`` the tokens continue it."""
        h = self.embed_tokens(ids)
        cos, sin = self.rotary.cos_sin(torch.zeros(ids.shape, dtype=torch.long, device=ids.device), h.dtype)
        caches: list[Any] = [None] * len(self.layers) if cache is None else cache.layers
        if self.block is None:
            for layer, c in zip(self.layers, caches):
                h = layer(h, cos, sin, c)
            return self.norm(h)
        assert self.output_res is not None
        bank: list[torch.Tensor] = []
        for i, (layer, c) in enumerate(zip(self.layers, caches)):
            assert isinstance(layer, KimiDecoderLayer) and layer.attn_res is not None and layer.mlp_res is not None
            x = layer.attn_res(bank, h) if bank else h
            if i % self.block == 0:
                bank.append(h)
                part = layer.attend(x, cos, sin, c)
            else:
                part = h + layer.attend(x, cos, sin, c)
            h = part + layer.feed(layer.mlp_res(bank, part))
        return self.norm(self.output_res(bank, h))


#: how a Kimi layer's attention splits over tensor-parallel ranks: one entry for both kinds (members
#: a layer does not hold are skipped). MLA as DeepSeek-V3's; KDA by head as sglang's
#: ``KimiDeltaAttention``: q / k / v, ``f_b_proj``, the output gate (``g_proj`` or ``g_b_proj``)
#: and ``b_proj`` (one feature per head) column-parallel, the convolutions' channels, ``dt_bias``
#: and ``A_log`` by head, ``o_proj`` row-parallel; ``f_a_proj`` / ``g_a_proj`` (low rank) and
#: ``o_norm`` (per head dim) replicated
_ATTENTION_TP = HeadParallel(
    column=("q_proj", "q_b_proj", "kv_b_proj", "g_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "b_proj"),
    row=("o_proj",), stacks=("k_b", "v_b"),
    floats=(HeadSlice("q_conv1d.weight"), HeadSlice("k_conv1d.weight"), HeadSlice("v_conv1d.weight"),
            HeadSlice("dt_bias"), HeadSlice("A_log", per_head=1), HeadSlice("A", per_head=1)))
_MLP_TP = FeatureParallel(column=("gate_proj", "up_proj"), row=("down_proj",))
_EXPERTS = ("gate_proj", "up_proj", "down_proj")


class KimiLinearForCausalLM(GenerationMixin, nn.Module):
    """Kimi-Linear (``kimi_linear``): ``model.*`` and ``lm_head``; ``generate`` / ``stream`` from
    :class:`quantplug.generate.GenerationMixin` with a :class:`HybridCache`."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    #: how the model splits over tensor-parallel ranks (``quantplug.parallel`` reads it): attention by
    #: head (:data:`_ATTENTION_TP`), routed experts expert-parallel (their latent partial sums
    #: all-reduced inside :class:`~quantplug.models.deepseek.Experts`, before ``routed_expert_norm``:
    #: the norm of the sum, not the sum of norms), the dense MLP and shared experts by feature; the
    #: latent ``routed_expert_down_proj`` / ``routed_expert_up_proj``, the router and the attention
    #: residuals' float parameters replicated
    qp_tp_plan: ClassVar[Mapping[str, TPStyle]] = {
        "model.embed_tokens": VocabParallel(),
        "model.layers.*.self_attn": _ATTENTION_TP,
        "model.layers.*.mlp": _MLP_TP,
        "model.layers.*.block_sparse_moe.shared_experts": _MLP_TP,
        "model.layers.*.block_sparse_moe.experts": ExpertParallel(stacks=_EXPERTS),
        "lm_head": ColumnParallel(gather=True),
    }
    #: stacked layers back to the release's layout (``quantplug.api.dense_state`` reads it): routed
    #: experts one tensor per expert named ``w1`` / ``w3`` / ``w2``; split MLA ``k_b`` / ``v_b`` (a
    #: GGUF) folded into ``kv_b_proj``
    qp_dense_state: ClassVar[Mapping[str, DenseRule]] = {
        "model.layers.*.block_sparse_moe.experts": Unstack(stacks=_EXPERTS, stored=("w1", "w3", "w2")),
        "model.layers.*.self_attn": FoldHeads("kv_b_proj", (HeadPart("k_b", transpose=True), HeadPart("v_b"))),
    }
    #: how an engine's own Kimi-Linear module tree (transformers' ``KimiLinearForCausalLM``) takes the
    #: planned modules (``quantplug.bridge`` reads it): the MLA layers as DeepSeek-V3's (the entry
    #: applies to the layers holding ``kv_a_proj_with_mqa``; a KDA layer's projections are plain
    #: linears), the dense MLP and shared experts as gated MLPs, the routed experts called as
    #: ``fn(x, topk_ids, topk_weights)``
    qp_engine_plan: ClassVar[Mapping[str, EngineEntry]] = {
        "model.layers.*.self_attn": EngineLatentAttention(unsupported=(
            ("g_proj", "the MLA output gate (mla_use_output_gate) is not part of the engines' Kimi-Linear attention"),
        )),
        "model.layers.*.mlp": EngineMLP(),
        "model.layers.*.block_sparse_moe.shared_experts": EngineMLP(),
        "model.layers.*.block_sparse_moe.experts": EngineExperts(),
    }
    #: the engines' names for what quantplug names as the release does (transformers' conversion
    #: mapping for ``kimi_linear``): the MoE block is ``mlp``, the forget gate's members sit under
    #: ``self_attn.forget_gate`` (the q / k / v convolutions become one ``conv1d``: :meth:`KDA.qp_engine_floats`)
    qp_engine_names: ClassVar[tuple[EngineRename, ...]] = (
        EngineRename(r"\.block_sparse_moe(?=\.|$)", ".mlp"),
        EngineRename(r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)(?=\.|$)", r".self_attn.forget_gate.\1"),
    )
    #: the KDA state's dtype in a new cache (float32; bfloat16 halves it, as sglang's
    #: ``--mamba-ssm-dtype bfloat16``)
    qp_state_dtype: torch.dtype = torch.float32

    def qp_configure(self, options: LoadOptions) -> None:
        """Takes load option ``kda_state``."""
        self.qp_state_dtype = torch.bfloat16 if options.kda_state == "bfloat16" else torch.float32

    def __init__(self, cfg: KimiConfig, d: Decisions) -> None:
        super().__init__()
        self.config = cfg
        self.model = KimiTextModel(cfg, d)
        self.lm_head: nn.Module
        if cfg.tie_word_embeddings:
            self.lm_head = TiedHead(self.model.embed_tokens)
        else:
            self.lm_head = _lin(d, "lm_head", cfg.hidden_size, cfg.vocab_size)
        self.mtp = nn.ModuleList()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, positions, cache))

    def next_logits(self, input_ids: torch.Tensor, cache: MLACache) -> torch.Tensor:
        """float32 logits [B, vocab] of the last position (the LM head runs on one token)."""
        return self.lm_head(self.model(input_ids, None, cache)[:, -1]).float()

    def next_tokens(self, input_ids: torch.Tensor, cache: MLACache) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.next_logits(input_ids, cache)
        return logits, logits.argmax(dim=-1)

    def hidden_and_logits(self, input_ids: torch.Tensor, cache: MLACache,
                          last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(input_ids, None, cache)
        return hidden, self.lm_head(hidden[:, -1:] if last_only else hidden).float()

    def qp_new_cache(self, batch: int, capacity: int, limit: int) -> HybridCache:
        """A :class:`HybridCache`: a :class:`KDAState` per KDA layer (state dtype
        :attr:`qp_state_dtype`), a latent cache per MLA layer."""
        emb = self.model.embed_tokens
        device = next(iter(emb.parameters())).device
        layers: list[Any] = []
        for layer in self.model.layers:
            attn = layer.self_attn
            if isinstance(attn, KDA):
                layers.append(KDAState(batch, 3 * attn.dim, attn.width, attn.heads, attn.head_dim, device=device,
                                       limit=limit, state_dtype=self.qp_state_dtype))
            else:
                layers.append(layer_cache(attn, batch, capacity, limit, dtype=emb.model_dtype, device=device))
        return HybridCache(layers)

    def text_lm(self) -> KimiLinearForCausalLM:
        return self

    @property
    def qp_engine_refusal(self) -> str | None:
        """Why the engine bridges (``quantplug.bridge``) refuse this model: the Kimi-K3 features its
        config enables, which transformers' ``KimiLinearForCausalLM`` does not compute (its config
        would silently drop them); None for a Kimi-Linear model."""
        cfg = self.config
        lacks = [what for on, what in (
            (cfg.attn_res_block_size is not None, "attention residuals (attn_res_block_size)"),
            (cfg.latent_size is not None, "the latent MoE (routed_expert_hidden_size)"),
            (not cfg.act.is_silu, f"the {cfg.act.kind} activation (hidden_act)"),
            (cfg.full_rank_gate, "the full-rank KDA output gate (use_full_rank_gate)"),
            (cfg.gate_lower_bound is not None, "the bounded forget gate (gate_lower_bound)"),
            (cfg.mla_use_output_gate, "the MLA output gate (mla_use_output_gate)"),
            (cfg.moe_layer_freq != 1, "MoE layers every moe_layer_freq layers"),
        ) if on]
        if not lacks:
            return None
        return (f"transformers' KimiLinearForCausalLM has no {', '.join(lacks)} (Kimi-K3's features); run it with "
                "quantplug.load / generate")


class KimiK3ForConditionalGeneration(GenerationMixin, nn.Module):
    """The released Kimi-K3: Kimi-Linear's text model (with K3's features, see the module
    docstring) under ``language_model``; vision not loaded."""

    packed_modules_mapping = KimiLinearForCausalLM.packed_modules_mapping
    #: why the engine bridges (quantplug.bridge) refuse it
    qp_engine_refusal: ClassVar[str] = (
        "the released Kimi-K3 (attention residuals, latent MoE, SiTU, full-rank KDA output gate, bounded forget "
        "gate, MLA output gate) has no model class in transformers or vLLM to bridge into; run it with "
        "quantplug.load / generate")

    def __init__(self, cfg: KimiConfig, d: Decisions) -> None:
        super().__init__()
        self.config = cfg
        self.language_model = KimiLinearForCausalLM(cfg, d)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: MLACache | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, cache)

    def text_lm(self) -> KimiLinearForCausalLM:
        return self.language_model
