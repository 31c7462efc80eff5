"""The token embedding and a head tied to it: planned layers any architecture builds from."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..kernels import compute
from .linear import LinearScheme, PlannedModule, Source, kernels_mode

if TYPE_CHECKING:
    from ..contract.options import LoadOptions


class Embedding(PlannedModule):
    """Token embedding [vocab, dim], stored as its scheme says (layer kind ``"embedding"``):
    float for most formats; GGUF files often store ``token_embd`` block-quantized, and the
    scheme's ``embed`` then dequantizes only the rows looked up."""

    def __init__(self, vocab: int, dim: int, scheme: LinearScheme, ckpt: str, model_dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab, self.dim, self.scheme, self.model_dtype = vocab, dim, scheme, model_dtype
        self.qp_init(ckpt)
        self.specs = {s.suffix: s for s in scheme.tensor_specs(vocab, dim)}
        for s in self.specs.values():
            self.qp_sources[s.suffix] = [Source(f"{ckpt}.{s.suffix}", s.shape or (), s.dtypes, optional=s.optional)]

    def qp_target_dtype(self, name: str, stored: str, model_dtype: torch.dtype) -> torch.dtype:
        return self.scheme.target_dtype(self.specs[name], model_dtype, stored)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qp_parallel is not None:
            return self.qp_parallel(self, ids)  # vocab-parallel: masked lookup + all-reduce
        return self.scheme.embed(self, ids)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x E^T`` (a tied lm_head): natively on the embedding's form where bound."""
        y = compute.linear(self, x)
        return self.scheme.apply(self, x) if y is None else y

    def qp_configure(self, options: LoadOptions) -> None:
        self.qp_kernel_mode = kernels_mode(self.scheme, options)

    def qp_finish(self) -> None:
        self.scheme.process_after_loading(self)
        self.qp_native = compute.bind(self)


class TiedHead(nn.Module):
    """lm_head sharing the embedding matrix (tie_word_embeddings)."""

    #: tensor-parallel forward (``qp_parallel(embedding, x)``, ``quantplug.parallel``), None: unsplit
    qp_parallel: Any = None

    def __init__(self, embed: Embedding) -> None:
        super().__init__()
        self._embed = [embed]  # a list, so the embedding is not registered twice

    def qp_tied_embedding(self) -> Embedding:
        """The embedding whose rows this head multiplies by (``quantplug.models.declarations.TiedModule``)."""
        return self._embed[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self._embed[0]
        if self.qp_parallel is not None:
            return self.qp_parallel(e, x)  # this rank's vocab rows, logits all-gathered
        return e.product(x)
