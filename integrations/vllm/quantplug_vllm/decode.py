"""quantplug's one-call decode step inside vLLM's model.

vLLM runs its DeepSeek-V3 layer by layer: at batch 1 a decode step of the tiny test model is a few
hundred module calls per layer, each a Python round trip around a small native product, which
made the plugin 3-16x slower per token than ``quantplug generate`` (one native call per step,
``StackStep``). Where the whole stack has a native step (:func:`quantplug.bridge.paged_decode`),
:func:`install` wraps vLLM's ``DeepseekV2Model.forward``: a batch of decode tokens only (no
prefill, each sequence one new token, at most ``NATIVE_ROWS`` of them) runs as one native call on
vLLM's own paged MLA cache (each layer's ``[blocks, 16, kv_lora + rope]``, addressed through the
batch's block table), writing each token's latent and key into the slot vLLM assigned it; every
other batch (prompts, chunked prefill, a mix, more sequences) runs vLLM's own forward. Both fill
the same cache, so a sequence may move between them from one step to the next.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from quantplug.bridge import PagedDecode
from quantplug.kernels.compute import NATIVE_ROWS
from torch import nn
from vllm.forward_context import get_forward_context, is_forward_context_available


def _metadata(layer_name: str) -> Any:
    """The batch's attention metadata of one MLA layer (None outside a forward or in a profile run)."""
    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if isinstance(md, list):  # speculative decoding: [0] is the base model's
        md = md[0] if md else None
    if isinstance(md, dict):
        md = md.get(layer_name)
    return md


def _flat(kv: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
    """A layer's paged cache [blocks, block_size, width] as [slots, width] rows, with the rows per
    block of the flat view and the block size; None for another layout."""
    if kv.dim() != 3 or kv.numel() == 0 or kv.stride(2) != 1 or kv.stride(1) != kv.shape[2]:
        return None
    per, bs = kv.stride(0) // kv.stride(1), kv.shape[1]
    if kv.stride(0) % kv.stride(1) or per < bs:
        return None
    flat = kv.as_strided(((kv.shape[0] - 1) * per + bs, kv.shape[2]), (kv.stride(1), 1))
    return flat, per, bs


def native_decode(inner: nn.Module, paged: PagedDecode, attn: list[nn.Module], input_ids: torch.Tensor | None,
                  positions: torch.Tensor, intermediate_tensors: Any, inputs_embeds: torch.Tensor | None
                  ) -> torch.Tensor | None:
    """The final norm of a decode-only batch through ``paged`` on vLLM's caches; None when the batch
    is of another kind (then vLLM's forward runs it). The caches' flat views are made per call: held
    between calls they would keep a finished engine's cache memory alive."""
    if input_ids is None or inputs_embeds is not None or intermediate_tensors is not None or input_ids.dim() != 1:
        return None
    md = _metadata(attn[0].layer_name)
    b = input_ids.shape[0]
    dec = getattr(md, "decode", None)
    if (dec is None or getattr(md, "num_prefills", 1) != 0 or md.num_decodes != b or md.num_actual_tokens != b
            or not 0 < b <= NATIVE_ROWS or positions.shape != (b,)):
        return None
    views = [_flat(a.kv_cache) for a in attn]
    if any(v is None for v in views):
        return None
    per, bs = views[0][1], views[0][2]  # type: ignore[index]
    pos = positions.to(torch.int64)
    if not torch.equal(dec.seq_lens[:b].to(torch.int64), pos + 1):
        return None  # each sequence one new token after its cached ones
    nblk = int(pos.max()) // bs + 1
    table = dec.block_table[:b, :nblk].to(torch.int64)
    if table.shape[1] < nblk:
        return None
    rows = (table.unsqueeze(-1) * per + torch.arange(bs)).reshape(b, -1)
    x = inner.embed_input_ids(input_ids)  # type: ignore[operator]
    return paged(x, pos, [v[0] for v in views], rows)  # type: ignore[index]


def install(model: nn.Module, paged: PagedDecode | None) -> str:
    """Wrap vLLM's ``model.model.forward`` with :func:`native_decode` (vLLM's forward for every
    other batch); returns what to log."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_input_ids"):
        return "decode steps run vLLM's layers (vLLM's model has no DeepseekV2Model)"
    inner.quantplug_decode = None
    if paged is None:
        return "decode steps run vLLM's layers (no whole-stack native step for this model)"
    attn = [m for m in inner.modules() if isinstance(m, MLAAttention)]
    if len(attn) != paged.step.n:
        return (f"decode steps run vLLM's layers ({len(attn)} MLA layers in vLLM's model, {paged.step.n} in "
                "quantplug's step)")
    own = inner.forward

    @functools.wraps(own)
    def forward(input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> Any:
        step = inner.quantplug_decode  # None: vLLM's layers decode (set so to compare the two)
        out = None if step is None else native_decode(inner, step, attn, input_ids, positions, intermediate_tensors,
                                                      inputs_embeds)
        return own(input_ids, positions, intermediate_tensors, inputs_embeds) if out is None else out

    inner.forward = forward
    inner.quantplug_decode = paged
    note = ""
    if getattr(inner, "do_not_compile", True) is False:
        # vLLM would trace this forward with torch.compile (dynamo, whole graph), which cannot
        # pass through the native call; the model runs eagerly instead (its products are
        # quantplug's native ones either way)
        inner.do_not_compile = True
        note = "; vLLM's torch.compile of the model is off (the native step runs eagerly)"
    return (f"decode-only batches of up to {NATIVE_ROWS} sequences run as one native call per step "
            f"(quantplug's whole-stack step on vLLM's paged MLA cache){note}")
