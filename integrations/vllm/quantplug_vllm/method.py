"""The vLLM quantization method ``quantplug``: vLLM's layers hold quantplug's planned modules.

vLLM builds its DeepSeek-V3 tree and asks its quantization config for each layer's method. Here
every projection's method holds the planned module(s) quantplug loaded for it
(:func:`quantplug.bridge.planned_modules`) as a child of vLLM's layer, so the quantized tensors
stay as the plan loaded them (packed, FP8, int8, ggml blocks: the bytes vLLM holds are the
plan's), and ``apply`` runs the planned module's forward: its scheme's ``apply`` /
``apply_grouped``, fused where the scheme fused at load. Nothing here knows a format.

The products run inside torch custom ops (``quantplug_vllm::linear`` / ``embed`` / ``experts``)
keyed by layer: under vLLM's torch.compile they are opaque calls, so Dynamo never traces into a
scheme's Python (data-dependent expert dispatch, native kernels through ctypes).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from quantplug.bridge import Projection
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, so its handler prints it

NAME = "quantplug"

# -- the products, as custom ops keyed by layer ---------------------------------------------------

_FNS: dict[int, Callable[..., torch.Tensor]] = {}
_KEYS = itertools.count(1)


def _register_fn(fn: Callable[..., torch.Tensor]) -> int:
    key = next(_KEYS)
    _FNS[key] = fn
    return key


def _fn(key: int) -> Callable[..., torch.Tensor]:
    fn = _FNS.get(key)
    if fn is None:
        raise RuntimeError(f"quantplug_vllm: no layer registered under key {key} in this process "
                           "(the model was not loaded with load_format='quantplug')")
    return fn


@torch.library.custom_op("quantplug_vllm::linear", mutates_args=())
def linear_op(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """``x [..., in] -> [..., out_features]`` through the planned module(s) of layer ``key``."""
    return _fn(key)(x).to(x.dtype).contiguous()


@linear_op.register_fake
def _linear_fake(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("quantplug_vllm::embed", mutates_args=())
def embed_op(ids: torch.Tensor, key: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of layer ``key``'s embedding, through its scheme's ``embed``."""
    return _fn(key)(ids).to(dtype).contiguous()


@embed_op.register_fake
def _embed_fake(ids: torch.Tensor, key: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((*ids.shape, dim), dtype=dtype, device=ids.device)


@torch.library.custom_op("quantplug_vllm::experts", mutates_args=())
def experts_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, key: int) -> torch.Tensor:
    """The routed experts of layer ``key`` on the router's choice: per token the weighted sum of
    its experts' gated MLPs (quantplug's grouped expert forward)."""
    return _fn(key)(x, topk_ids, topk_weights).to(x.dtype).contiguous()


@experts_op.register_fake
def _experts_fake(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("quantplug_vllm::mlp", mutates_args=())
def mlp_op(x: torch.Tensor, key: int) -> torch.Tensor:
    """A gated MLP ``down(silu(gate(x)) * up(x))`` of layer ``key``: quantplug's MLP module (one
    native call for a decode step's rows)."""
    return _fn(key)(x).to(x.dtype).contiguous()


@mlp_op.register_fake
def _mlp_fake(x: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(x)


# -- methods -----------------------------------------------------------------------------------------


def _attach(layer: nn.Module, proj: Projection) -> None:
    """The planned modules become children of vLLM's layer (``layer.quantplug``): vLLM's model
    holds their tensors, and counts them among its parameters and buffers."""
    layer.quantplug = nn.ModuleList(proj.modules)


class QuantplugLoadError(ValueError):
    """A quantplug plan or load failure, as vLLM reports load errors (a ValueError); the message
    is quantplug's, naming the file, the tensor or layer and what was expected."""


def _check_width(prefix: str, what: str, vllm_value: Any, planned: Any) -> None:
    if vllm_value != planned:
        why = ("the checkpoint's config.json and its tensors disagree with vLLM's reading of the config"
               if _tp_size() == 1 else
               f"this rank's share in quantplug's tensor-parallel plan (rank {_tp_rank()} of {_tp_size()}) is not the "
               "one vLLM's layer holds")
        raise QuantplugLoadError(f"quantplug: vLLM's layer {prefix} has {what} {vllm_value}, the quantplug plan's "
                                 f"modules for it have {planned}: {why}")


def _tp_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    try:
        return int(get_tensor_model_parallel_world_size())
    except AssertionError:  # no TP group (a layer built outside vLLM's engine)
        return 1


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _check_vocab_shard(prefix: str, layer: nn.Module, proj: Projection) -> None:
    """Under tensor parallelism: this rank's vocabulary rows in quantplug's plan are the ones vLLM's
    ``VocabParallelEmbedding`` / ``ParallelLMHead`` holds on this rank."""
    idx = layer.shard_indices
    want = (int(idx.org_vocab_start_index), int(idx.org_vocab_end_index - idx.org_vocab_start_index))
    if proj.shard != want:
        raise QuantplugLoadError(
            f"quantplug: vLLM's layer {prefix} holds vocabulary rows [{want[0]}, {want[0] + want[1]}) on rank "
            f"{_tp_rank()} of {_tp_size()} (the vocabulary padded to vLLM's multiple, then split evenly); quantplug's "
            f"tensor-parallel plan gives this rank rows {_rows(proj.shard)} (contiguous blocks of the vocabulary)")


def _rows(shard: tuple[int, int] | None) -> str:
    return "all of them" if shard is None else f"[{shard[0]}, {shard[0] + shard[1]})"


class QuantplugLinearMethod(LinearMethodBase):
    """A linear (or a merged one, e.g. ``fused_qkv_a_proj``, ``gate_up_proj``) computed by
    quantplug's planned module(s); also the ``lm_head`` (``ParallelLMHead``)."""

    def __init__(self, prefix: str, proj: Projection) -> None:
        self.prefix, self.proj = prefix, proj
        self.key = _register_fn(proj.fn)
        self.out_features = sum(proj.out_features)
        #: zero columns after this rank's logits (a tensor-parallel lm_head: vLLM's per-rank width)
        self.pad = 0
        #: what the loader says about this layer at load (a fallback, a transient dequantize)
        self.notes: list[str] = list(proj.notes)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra: Any) -> None:
        _check_width(self.prefix, "input width", input_size_per_partition, self.proj.in_features)
        if isinstance(layer, ParallelLMHead):
            # the vocabulary padded to vLLM's multiple; logits beyond the vocabulary are cut by vLLM
            if getattr(layer, "tp_size", 1) > 1:
                # this rank's block of the logits, padded to vLLM's per-rank width (vLLM gathers the
                # ranks' blocks, then cuts the padding after the vocabulary)
                _check_vocab_shard(self.prefix, layer, self.proj)
                self.pad = int(layer.num_embeddings_per_partition) - self.out_features
            else:
                _check_width(self.prefix, "vocabulary", layer.org_vocab_size, self.out_features)
        else:
            _check_width(self.prefix, "output widths", list(output_partition_sizes), self.proj.out_features)
        _attach(layer, self.proj)
        # vLLM's MLA reads kv_b_proj.weight's device and dtype (and dequantizes kv_b_proj by applying
        # it to an identity matrix, which goes through apply below); an empty tensor in the compute
        # dtype says "compute in params_dtype" without holding a second copy of anything
        layer.register_buffer("weight", torch.empty(0, dtype=params_dtype), persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = linear_op(x, self.key, self.out_features)
        if self.pad:
            out = torch.nn.functional.pad(out, (0, self.pad))
        return out if bias is None else out + bias

    def tie_weights(self, layer: nn.Module, embed_tokens: nn.Module) -> nn.Module:
        return layer  # a tied lm_head's planned module already reads the embedding (TiedHead)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise RuntimeError(f"quantplug: {self.prefix} is a linear, not an embedding")


class QuantplugEmbeddingMethod(QuantizeMethodBase):
    """The token embedding through its planned module (GGUF ``token_embd`` stays block-quantized:
    the scheme's ``embed`` dequantizes only the rows looked up)."""

    def __init__(self, prefix: str, proj: Projection) -> None:
        self.prefix, self.proj = prefix, proj
        self.key = _register_fn(proj.fn)
        self.dim = proj.in_features
        self.dtype = torch.float32

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra: Any) -> None:
        _check_width(self.prefix, "embedding width", input_size_per_partition, self.dim)
        if getattr(layer, "tp_size", 1) > 1:  # vLLM hands this rank's ids minus its first row, then reduces
            _check_vocab_shard(self.prefix, layer, self.proj)
        else:
            _check_width(self.prefix, "vocabulary", layer.org_vocab_size, self.proj.out_features[0])
        self.dtype = params_dtype
        _attach(layer, self.proj)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return embed_op(ids, self.key, self.dim, self.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError(f"quantplug: {self.prefix} is an embedding, not a linear")


class QuantplugMoEMethod(FusedMoEMethodBase):
    """Routed experts: vLLM's router picks each token's experts (grouped top-k with
    ``e_score_correction_bias``, as DeepSeek-V3 routes); quantplug's stacked expert projections
    compute them (sorted by expert once, each projection over the hit experts' row groups through
    the scheme's ``apply_grouped``; one token through the scheme's fused MLP where it has one)."""

    def __init__(self, moe: Any, prefix: str, proj: Projection) -> None:
        super().__init__(moe)
        self.prefix, self.proj = prefix, proj
        self.key = _register_fn(proj.fn)

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra: Any) -> None:
        experts = self.proj.modules[0]
        _check_width(self.prefix, "experts", num_experts, experts.count)
        _check_width(self.prefix, "hidden size", hidden_size, self.proj.in_features)
        _check_width(self.prefix, "expert intermediate size", intermediate_size_per_partition,
                     experts.gate_proj.out_features)
        # expert parallel (the loader enables vLLM's under tensor parallelism): the experts vLLM's
        # map places on this rank are quantplug's contiguous block; the router hands global ids
        emap = getattr(layer, "_expert_map", None)
        if emap is not None:
            local = [int(e) for e in torch.nonzero(emap >= 0).flatten().tolist()]
            mine = list(range(int(experts.first), int(experts.first) + int(experts.count)))
            if local != mine or [int(emap[e]) for e in local] != list(range(len(local))):
                raise QuantplugLoadError(
                    f"quantplug: vLLM's layer {self.prefix} places experts {_span(local)} on rank {_tp_rank()} "
                    f"of {_tp_size()} (expert placement {getattr(layer, 'expert_placement_strategy', '?')!r}); "
                    f"quantplug's expert-parallel plan gives this rank experts {_span(mine)} (contiguous blocks: "
                    "vLLM's 'linear' placement)")
        _attach(layer, self.proj)

    def get_fused_moe_quant_config(self, layer: nn.Module) -> Any:
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any = None, shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        return experts_op(x, topk_ids.to(torch.long), topk_weights, self.key)


def _span(ids: list[int]) -> str:
    if ids and ids == list(range(ids[0], ids[-1] + 1)):
        return f"[{ids[0]}, {ids[-1] + 1})"
    return str(ids)


class QuantplugConfig(QuantizationConfig):
    """The ``quantplug`` quantization: every layer's method holds the planned module(s) that
    :class:`~quantplug_vllm.loader.QuantplugModelLoader` loaded for it (``projections``, by vLLM
    module name). Built by that loader; a config vLLM parses from a checkpoint alone has no
    projections and refuses every layer with a message naming the loader."""

    def __init__(self, projections: Mapping[str, Projection] | None = None, backend: str | None = None) -> None:
        super().__init__()
        self.projections = dict(projections or {})
        self.backend = backend
        self.used: set[str] = set()

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantplugConfig:
        return cls()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        # asked for by name; or a checkpoint whose quant_method vLLM does not know (a third-party
        # backend's: vLLM would refuse it before any loader runs). A checkpoint vLLM reads itself
        # stays vLLM's unless the user says otherwise.
        if user_quant == NAME:
            return NAME
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

        method = hf_quant_cfg.get("quant_method") if isinstance(hf_quant_cfg, dict) else None
        if user_quant is None and isinstance(method, str) and method and method not in QUANTIZATION_METHODS:
            return NAME
        return None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not self.projections:
            raise ValueError(f"quantplug: layer {prefix}: the 'quantplug' quantization runs only with "
                             "load_format='quantplug' (the quantplug model loader plans and loads the checkpoint)")
        if isinstance(layer, RoutedExperts):
            proj = self._take(prefix)
            return QuantplugMoEMethod(layer.moe_config, prefix, proj)
        if isinstance(layer, ParallelLMHead):
            return QuantplugLinearMethod(prefix, self._take(prefix))
        if isinstance(layer, VocabParallelEmbedding):
            return QuantplugEmbeddingMethod(prefix, self._take(prefix))
        if isinstance(layer, LinearBase):
            if prefix not in self.projections and prefix.endswith(".gate"):
                return UnquantizedLinearMethod()  # the router: float, loaded as vLLM's own parameter
            return QuantplugLinearMethod(prefix, self._take(prefix))
        return None

    def _take(self, prefix: str) -> Projection:
        proj = self.projections.get(prefix)
        if proj is None:
            raise ValueError(f"quantplug: vLLM's model has a layer {prefix} that the quantplug plan has no module for "
                             f"(planned: {', '.join(sorted(self.projections)[:6])}, ...)")
        self.used.add(prefix)
        return proj
