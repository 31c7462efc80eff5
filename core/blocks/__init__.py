"""The block library: each block kind once, its ``forward`` being its math (torch).

MLA (q-LoRA or not, RoPE or none, output gate) and DSA's indexer, KDA, the gated MLP, the router,
routed experts / MoE / latent MoE, attention residuals and the generation caches. Architectures
(``quantplug.models``) are skeletons built from these; ``quantplug.lower`` maps the blocks it knows
to native steps.
"""

from .base import Decisions, PlanOracle, lin
from .cache import GenerationError, HybridCache, KDAState, LatentCache, MLACache, layer_cache
from .indexer import Indexer
from .kda import KDA, ShortConv, chunk_kda, l2norm, recurrent_kda
from .mla import MLA, NoRope
from .mlp import MLP
from .moe import Experts, MoE
from .residual import ResScore
from .router import Router

__all__ = ["KDA", "MLA", "MLP", "Decisions", "Experts", "GenerationError", "HybridCache", "Indexer", "KDAState",
           "LatentCache", "MLACache", "MoE", "NoRope", "PlanOracle", "ResScore", "Router", "ShortConv", "chunk_kda",
           "l2norm", "layer_cache", "lin", "recurrent_kda"]
