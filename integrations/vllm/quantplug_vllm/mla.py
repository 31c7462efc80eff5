"""vLLM's MLA on quantplug's planned K/V weights, with no dense copy of ``kv_b_proj``.

vLLM's MLA decode absorbs ``kv_b_proj``: after loading, ``MLAAttention.process_weights_after_loading``
derives ``W_UK_T`` [heads, nope, kv_lora] and ``W_UV`` [heads, kv_lora, v] (dense, in the model
dtype) and decode uses them in exactly two products, ``torch.bmm(q_nope, W_UK_T, out=...)`` in
``forward_impl`` and ``torch.bmm(x, W_UV, out=...)`` in ``_v_up_proj``. Here, right after vLLM
derives them (one layer at a time), both are replaced by :class:`AbsorbedWeight` tensors that hold
no data: ``torch.bmm`` with one of them computes the product through
:class:`quantplug.bridge.AbsorbedMLA` from the planned module vLLM's ``kv_b_proj`` already holds
(GGUF's per-head stacks natively; a dense ``kv_b_proj``'s head rows decoded for the call). Any
other use of them is an error naming the layer. vLLM's CPU platform runs attention as one opaque
custom op (``opaque_attention_op``), so these products run eagerly even under torch.compile.

When ``kv_b_proj``'s form quantizes its input (DeepSeek FP8 with ``activation_quant=dynamic``),
the latent vLLM caches is quantized the same way as it leaves ``kv_a_layernorm``
(``quantplug_vllm::latent``), so vLLM's absorbed decode attends on the rows quantplug's does; see
:func:`quantize_latent`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from quantplug.bridge import AbsorbedMLA
from torch import nn

from .method import _fn, _register_fn

_META = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.__repr__, torch.Tensor.__format__}
_META_GETS = {"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_meta", "is_cuda"}


class AbsorbedWeight(torch.Tensor):
    """Stands in for vLLM's ``W_UK_T`` / ``W_UV`` of one layer: the shape and dtype vLLM reads,
    no data; ``torch.bmm(a, self)`` (with ``out=``) is ``fn(a)``."""

    qp_fn: Callable[[torch.Tensor], torch.Tensor]
    qp_what: str

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, fn: Callable[[torch.Tensor], torch.Tensor],
                what: str) -> AbsorbedWeight:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device("cpu"))
        t.qp_fn, t.qp_what = fn, what
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.bmm and len(args) == 2 and isinstance(args[1], cls) and not isinstance(args[0], cls):
            y = args[1].qp_fn(args[0])
            out = kwargs.get("out")
            if out is None:
                return y
            out.copy_(y)
            return out
        if func in _META or getattr(func, "__name__", None) == "__get__" and \
                getattr(getattr(func, "__self__", None), "__name__", None) in _META_GETS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        what = next((a.qp_what for a in args if isinstance(a, cls)), "an absorbed MLA weight")
        raise RuntimeError(f"quantplug: {what} is computed from the planned kv_b_proj when vLLM's MLA multiplies by "
                           f"it (torch.bmm); {getattr(func, '__name__', func)} of it is not supported")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        what = next((a.qp_what for a in args if isinstance(a, cls)), "an absorbed MLA weight")
        raise RuntimeError(f"quantplug: {what} holds no data (computed from the planned kv_b_proj in torch.bmm); "
                           f"{func} of it is not supported")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        return f"AbsorbedWeight({self.qp_what}, shape={tuple(self.shape)}, dtype={self.dtype})"


def absorb_lazily(mla_attn: nn.Module, absorbed: AbsorbedMLA, name: str, notes: list[str]) -> None:
    """Make vLLM's ``MLAAttention`` ``mla_attn`` compute ``W_UK_T`` / ``W_UV`` from ``absorbed``:
    its ``process_weights_after_loading`` runs as vLLM wrote it, then the dense copies it made are
    replaced (so at most one layer's copy exists at any time during loading)."""
    original = mla_attn.process_weights_after_loading

    def process(act_dtype: torch.dtype) -> None:
        original(act_dtype)
        w_uk_t, w_uv = getattr(mla_attn, "W_UK_T", None), getattr(mla_attn, "W_UV", None)
        heads, nope, v, kv_lora = absorbed.heads, absorbed.nope, absorbed.v, absorbed.kv_lora
        if not (isinstance(w_uk_t, torch.Tensor) and isinstance(w_uv, torch.Tensor)
                and tuple(w_uk_t.shape) == (heads, nope, kv_lora) and tuple(w_uv.shape) == (heads, kv_lora, v)):
            notes.append("vLLM's MLA implementation here keeps its own form of kv_b_proj (no W_UK_T / W_UV of "
                         f"shapes {(heads, nope, kv_lora)} / {(heads, kv_lora, v)}): left as vLLM made it")
            return
        dtype = w_uk_t.dtype
        for attr in ("W_UK_T", "W_UV"):
            mla_attn._parameters.pop(attr, None)
            mla_attn._buffers.pop(attr, None)
            mla_attn.__dict__.pop(attr, None)

        def uk(q: torch.Tensor) -> torch.Tensor:           # q [heads, T, nope] -> [heads, T, kv_lora]
            return absorbed.uk(q)

        def uv(x: torch.Tensor) -> torch.Tensor:           # x [heads, T, kv_lora] -> [heads, T, v]
            return absorbed.uv(x)

        object.__setattr__(mla_attn, "W_UK_T", AbsorbedWeight((heads, nope, kv_lora), dtype, uk, f"{name} W_UK_T"))
        object.__setattr__(mla_attn, "W_UV", AbsorbedWeight((heads, kv_lora, v), dtype, uv, f"{name} W_UV"))
        notes.append(f"W_UK_T / W_UV computed on use from {absorbed.describe()} (vLLM's dense copies released)")

    mla_attn.process_weights_after_loading = process


@torch.library.custom_op("quantplug_vllm::latent", mutates_args=())
def latent_op(c: torch.Tensor, key: int) -> torch.Tensor:
    """Latent rows ``c`` as layer ``key``'s ``kv_b_proj`` quantizes its input."""
    return _fn(key)(c).to(c.dtype).contiguous()


@latent_op.register_fake
def _latent_fake(c: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(c)


def quantize_latent(wrapper: nn.Module, absorbed: AbsorbedMLA, notes: list[str]) -> None:
    """The latent vLLM caches for this layer, quantized as ``kv_b_proj``'s form quantizes its input.

    The expanded form (vLLM's prefill, DeepSeek's ``attn_impl="naive"``, quantplug's forward)
    computes K and V as ``kv_b_proj(latent)``: with DeepSeek's FP8 activation emulation that is
    kv_b applied to ``act_quant(latent)``, per token and per 128 latent values. The absorbed decode
    attends on the cached latent itself, so the two agree only if the cache holds the quantized
    rows: quantplug's native decode step quantizes them, and so does this (``kv_a_layernorm``'s
    output, before vLLM writes it to its cache and before prefill's ``kv_b_proj``, which quantizes
    the already quantized rows to the same values). A layer whose ``kv_b_proj`` does not quantize
    its input is left alone."""
    if absorbed.latent_unknown:
        notes.append("kv_b_proj quantizes its input but its scheme declares no form: vLLM's decode attends on "
                     "the float latent (DeepSeek's absorb arithmetic), quantplug's expands K/V through the scheme")
        return
    if not absorbed.quantizes_latent:
        return
    norm = getattr(wrapper, "kv_a_layernorm", None)
    if norm is None or getattr(wrapper, "fuse_qkv_rmsnorm", False):
        notes.append("kv_b_proj quantizes its input, but vLLM's attention here fuses kv_a_layernorm: the cached "
                     "latent is not quantized (decode tokens may part from quantplug's at near-ties)")
        return
    key = _register_fn(absorbed.latent)
    normed = norm.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # with a residual (not how MLA calls it): as vLLM's norm alone
            return normed(x, *args, **kwargs)
        return latent_op(normed(x), key)

    norm.forward = forward
    notes.append("the cached latent is quantized as kv_b_proj quantizes its input (the expanded form's "
                 "arithmetic, as quantplug's decode step attends)")
