"""Linear schemes of the ExpertPack backend.

* :class:`GGMLScheme`: one GGUF tensor in any supported ggml type, kept packed (a zero-copy view
  of the memory-mapped GGUF when the model dtype allows), dequantized per matmul by the torch
  kernels in :mod:`.ggml`. Used for linears, split MLA K/V stacks and routed experts, whether
  stacked in the GGUF (``*_exps``) or one tensor per expert in a version-1 expert pack (served,
  with ``expert_cache_mb``, by the core's expert cache like any other format's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from quantplug.api import (
    Form,
    Layer,
    LinearScheme,
    Problem,
    SplitRule,
    TensorInfo,
    TensorSpec,
    Weights,
    fuse_int4_packs,
    ggml,
)


class GGMLScheme(LinearScheme):
    """A GGUF tensor in ggml type ``ggml_type``; stacked when used for experts or MLA K/V.

    ``key`` is ``"ggml"`` for every type: llama.cpp files mix types tensor by tensor (llama-quantize
    picks per tensor and falls back to legacy types), and quantplug never fuses GGUF shards, so
    q_a / kv_a_mqa in different types are not a disagreement.
    """

    name = "ggml"

    def __init__(self, ggml_type: str, cache: bool = False, kernels: str = "exact") -> None:
        self.ggml_type = ggml_type
        self.cache = cache
        #: "exact" (dequantize bit-exactly, float matmul) or "fast" (the int4-pack kernel for
        #: ggml.FAST_TYPES, bfloat16 activations; other types stay exact)
        self.kernels = kernels
        #: exact kernels are dequantize then float matmul: MLA decode may absorb kv_b through them
        self.weight_only = kernels != "fast" or ggml_type not in ggml.FAST_TYPES

    def takes_fast(self) -> bool:
        """Under ``kernels="fast"``: the types with a fast kernel (native int8 activation blocks,
        or torch's int4-pack kernel)."""
        return self.kernels == "fast" and (self.ggml_type in ggml.FAST_TYPES or self.ggml_type in ggml.native.FAST_FORMS)

    @property
    def key(self) -> str:
        return "ggml"

    def describe(self) -> str:
        """The type; under ``kernels="fast"`` which kernel computes it (the native one, ``native.py``,
        where built; torch's int4 kernel), since fast results depend on it."""
        if self.cache:
            return f"ggml {self.ggml_type}; cached dense copy"
        if self.kernels == "fast" and self.ggml_type in ggml.native.FAST_FORMS:
            return f"ggml {self.ggml_type}; fast (int8 activation blocks, as llama.cpp)"
        return f"ggml {self.ggml_type}"  # exact: the same numbers whichever kernel runs (native or torch)

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        return [TensorSpec("weight", (self.ggml_type,), (out_features, in_features))]

    def split(self, direction: str, out_features: int, in_features: int) -> dict[str, SplitRule] | None:
        """Rows follow out; along in, a row is whole blocks of ``block`` values in ``size`` bytes
        (32 for Q4_0..Q8_0 / MXFP4, 256 for K-quants: llama.cpp ``ggml-common.h``), so a
        row-parallel part must hold whole blocks or the layer is replicated."""
        if direction == "out":
            return {"weight": SplitRule(0)}
        if self.ggml_type in ggml.FLOAT_TYPES:
            return {"weight": SplitRule(1)}
        if self.ggml_type not in ggml.BLOCKS:
            return None
        block, size = ggml.BLOCKS[self.ggml_type]
        return {"weight": SplitRule(1, block, size)}

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        if self.ggml_type not in ggml.SUPPORTED:
            w = tensors.get("weight")
            return [Problem(f"ggml type {self.ggml_type} has no kernel in quantplug-expert-pack; supported: "
                            f"{', '.join(ggml.SUPPORTED)}", tensor=w.label if w else None, layer=layer_name,
                            file=w.file.name if w else None)]
        return []

    def _dense(self, layer: Layer, w: torch.Tensor) -> torch.Tensor:
        if self.ggml_type in ggml.FLOAT_TYPES:
            return w
        return ggml.dequantize(w, self.ggml_type).to(layer.model_dtype)

    def dequantize(self, layer: Layer, index: int | None = None) -> torch.Tensor:
        cached = getattr(layer, "_dequantized", None)
        if cached is not None:
            return cached if index is None else cached[index]
        w: torch.Tensor = layer.weight
        return self._dense(layer, w if index is None else w[index])

    def form(self, layer: Layer) -> Weights | None:
        """The stored blocks as the core's ggml form (a cached dense copy, or float tensors, as
        their float form): the core then runs this layer's products natively."""
        dense = getattr(layer, "_dequantized", None)
        if dense is not None or self.ggml_type in ggml.FLOAT_TYPES:
            t = dense if dense is not None else layer.weight
            name = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}.get(t.dtype)
            return None if name is None else Weights(Form(name), t)
        if self.ggml_type not in ggml.NATIVE_TYPES:
            return None
        return Weights(Form(self.ggml_type), layer.weight)

    def apply(self, layer: Layer, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """The torch path (the core runs the native kernels first where they are built): torch's
        int4 kernel under ``kernels="fast"`` where the layer has that form, else exact."""
        pack = getattr(layer, "_int4", None)
        if pack is not None:
            if index is not None:
                slot_pack, slot_sz = layer._int4_slots[index]
                return ggml.int4_linear(x, slot_pack, slot_sz, self.ggml_type)
            return ggml.int4_linear(x, pack, layer._int4_sz, self.ggml_type)
        if getattr(layer, "_dequantized", None) is not None or self.ggml_type in ggml.FLOAT_TYPES:
            return F.linear(x, self.dequantize(layer, index).to(x.dtype))
        w: torch.Tensor = layer.weight
        return ggml.linear(x, w if index is None else w[index], self.ggml_type, layer.model_dtype)

    def fuse(self, layers: Sequence[Any]) -> Callable[..., torch.Tensor] | None:
        """Under ``kernels="fast"`` without the native kernels: siblings' int4 forms as one kernel
        weight (``fuse_int4_packs``: each layer's pack becomes a view of it; the fused
        scales-and-zeros, 1/4 of the packs, are the one new buffer)."""
        if self.kernels != "fast" or any(getattr(layer.scheme, "ggml_type", None) != self.ggml_type for layer in layers):
            return None
        fused = fuse_int4_packs(layers)
        return ggml.Int4Fused(fused[0], fused[1], self.ggml_type) if fused is not None else None

    def apply_grouped(self, layer: Layer, x: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
        pack = getattr(layer, "_int4", None)
        if pack is None or len(groups) == 1:
            return super().apply_grouped(layer, x, groups)
        return ggml.int4_grouped(x, layer._int4_slots, self.ggml_type, groups)

    def apply_all(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """MLA K/V per head as one batched matmul (the whole stack dequantized into the reused
        buffer, as :func:`ggml.linear` does per matrix); per head for very large stacks."""
        w: torch.Tensor = layer.weight
        if getattr(layer, "_int4", None) is not None or w.numel() > ggml.LINEAR_CHUNK_ELEMS * 16:
            return super().apply_all(layer, x)
        dense = self.dequantize(layer) if self.ggml_type in ggml.FLOAT_TYPES or self.cache \
            else ggml.dequantize_reused(w, self.ggml_type, layer.model_dtype)
        return torch.matmul(x, dense.to(x.dtype).transpose(-1, -2))

    def embed(self, layer: Layer, ids: torch.Tensor) -> torch.Tensor:
        """Token embedding: dequantize only the looked-up rows of the packed matrix."""
        if getattr(layer, "_dequantized", None) is not None or self.ggml_type in ggml.FLOAT_TYPES:
            return F.embedding(ids, self.dequantize(layer))
        w: torch.Tensor = layer.weight
        rows = ggml.dequantize(w.index_select(0, ids.reshape(-1)), self.ggml_type)
        return rows.to(layer.model_dtype).view(*ids.shape, -1)

    def process_after_loading(self, layer: Layer) -> None:
        if self.cache and self.ggml_type not in ggml.FLOAT_TYPES:
            layer.register_buffer("_dequantized", self._dense(layer, layer.weight), persistent=False)
            return
        # kernels="fast" computes on the blocks natively (int8 activations, as llama.cpp); only
        # without the native kernels are 4-bit-affine types repacked for torch's int4 kernel
        # (counted in load time and model bytes; the packed weight stays for dequantize / export)
        if self.kernels == "fast" and (ggml.native.library() is None or self.ggml_type not in ggml.NATIVE_TYPES):
            fast = ggml.int4_repack(layer.weight, self.ggml_type)
            if fast is not None:
                layer.register_buffer("_int4", fast[0], persistent=False)
                layer.register_buffer("_int4_sz", fast[1], persistent=False)
                if fast[0].dim() == 3:  # stacked experts: each slot's views, made once
                    layer._int4_slots = list(zip(fast[0].unbind(0), fast[1].unbind(0)))
