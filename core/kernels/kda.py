"""One decode token of Kimi Delta Attention (KDA), the linear attention of Kimi-Linear and Kimi-K3.

:func:`kda_step` runs it natively (``qp_kda_step`` in ``blocks/kda.c``) for B sequences in one
call, threads over the (sequence, head) pairs; :func:`quantplug.blocks.kda.kda_step_torch` is its
torch twin, the block's own definition of the math: ``kda_step`` returns None (never raises) where
the library is unavailable or the inputs are not as it takes them, and the block runs the twin
(:meth:`quantplug.blocks.kda.KDA.token` takes either; :mod:`quantplug.lower` binds this one).

Both take the projections of one token, before the short convolution, and the layer's per-sequence
state, which they update in place: ``conv_state`` (the last W - 1 pre-conv inputs) and ``state``
(the recurrent S, [B, H, K, V], K = V = head_dim, float32 or bfloat16). The math (docs/architectures/kimi.md), per token and head, in float32:

* conv: ``c[t] = sum_j w[c, j] * u[t - W + 1 + j, c]`` (history zero at sequence start), SiLU on
  q, k and v;
* q, k L2-normalised per head (``x / sqrt(sum x^2 + 1e-6)``), q scaled by ``K^-0.5``;
* ``beta = sigmoid(beta_logits)``; per key channel ``g = -exp(A_log[h]) * softplus(gpre + dt_bias)``,
  or with a lower bound lb (Kimi-K3) ``g = lb * sigmoid(exp(A_log[h]) * (gpre + dt_bias))``;
* ``S = S * exp(g)[:, None]`` (decay along the key axis), ``S += beta * k (v - k^T S)^T``,
  ``o = q^T S``;
* ``o = RMSNorm_head(o; o_norm_w, eps) * sigmoid(gate)`` (ready for ``o_proj``).

A bfloat16 state is read as float, updated in float, and written back rounded to bfloat16 (o comes
from the float update). The native step equals the twin up to the order of float32 sums.
"""

from __future__ import annotations

import torch

from . import native

#: the widest head the native step takes (its per-head buffers live on the stack)
MAX_HEAD_DIM = 512
#: the longest short convolution the native step takes
MAX_CONV = 64


def _ok(t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    return t.device.type == "cpu" and t.dtype in dtypes and tuple(t.shape) == shape and t.is_contiguous()


def kda_step(u: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, gpre: torch.Tensor,
             dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None, beta_logits: torch.Tensor,
             gate: torch.Tensor, o_norm_w: torch.Tensor, eps: float, state: torch.Tensor) -> torch.Tensor | None:
    """One KDA token for B sequences natively (``qp_kda_step``), or None (the torch twin runs).

    ``u`` [B, 3D] float32: the pre-conv projections q | k | v of this token (D = H * K);
    ``conv_w`` [3D, W] float32: the depthwise conv weights (q_conv1d | k_conv1d | v_conv1d);
    ``conv_state`` [B, 3D, W - 1] float32: the last W - 1 pre-conv inputs, oldest first (updated);
    ``gpre`` [B, D] float32: ``f_b_proj(f_a_proj(x))`` without dt_bias; ``dt_bias`` [D] float32;
    ``a_log`` [H] float32: raw A_log per head; ``lower_bound``: None for the softplus forget gate,
    else the bound of the sigmoid one; ``beta_logits`` [B, H] float32; ``gate`` [B, D] float32: the
    output gate before its sigmoid; ``o_norm_w`` [K] float32; ``eps``: o_norm's; ``state`` [B, H, K, K]
    float32 or bfloat16 (updated). Returns o [B, D] float32.

    None where the library is unavailable, or any tensor is not a contiguous CPU tensor of the
    shape and dtype above (a bfloat16 ``u``, a strided view, a [H, V, K]-transposed layout is the
    caller's to convert), K > :data:`MAX_HEAD_DIM`, W > :data:`MAX_CONV`, or autograd would have to
    record the in-place updates."""
    lib = native.library()
    if lib is None or u.dim() != 2 or state.dim() != 4 or conv_w.dim() != 2:
        return None
    b, h, k, v = state.shape
    d, w = h * k, conv_w.shape[1]
    if not (b > 0 and h > 0 and 0 < k == v <= MAX_HEAD_DIM and 0 < w <= MAX_CONV):
        return None
    if not (_ok(u, (b, 3 * d)) and _ok(conv_w, (3 * d, w)) and _ok(conv_state, (b, 3 * d, w - 1))
            and _ok(gpre, (b, d)) and _ok(dt_bias, (d,)) and _ok(a_log, (h,)) and _ok(beta_logits, (b, h))
            and _ok(gate, (b, d)) and _ok(o_norm_w, (k,)) and _ok(state, (b, h, k, k), (torch.float32, torch.bfloat16))):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (u, conv_w, conv_state, gpre, dt_bias, a_log,
                                                                  beta_logits, gate, o_norm_w, state)):
        return None
    out = torch.empty(b, d, dtype=torch.float32)
    bounded = lower_bound is not None
    rc = lib.qp_kda_step(b, h, k, w, u.data_ptr(), conv_w.data_ptr(), conv_state.data_ptr() if w > 1 else None,
                         gpre.data_ptr(), dt_bias.data_ptr(), a_log.data_ptr(), int(bounded),
                         float(lower_bound) if lower_bound is not None else 0.0, beta_logits.data_ptr(), gate.data_ptr(),
                         o_norm_w.data_ptr(), float(eps), state.data_ptr(), int(state.dtype == torch.bfloat16),
                         out.data_ptr())
    native.check(rc, "kda_step")  # every argument was checked above: a refusal is a bug
    return out
