"""DeepSeek-V3 / Kimi-K2 checkpoints at their real dimensions, for scale tests and benchmarks.

Two kinds of input, both written without building a model in memory:

* **Header-only checkpoints** (:func:`write_header_only`): the tensor inventory of the official
  FP8 releases (names, dtypes, shapes; DeepSeek-V3's multi-token-prediction layer 61 included)
  as safetensors shards whose headers are real and whose data is a hole: each file is extended
  to its full size with ``os.truncate``, so a 689 GB DeepSeek-V3 takes a few MB of disk.
  Planning reads headers only, so a plan of it behaves as on the real download; reading any
  tensor returns zeros (and reads nothing from disk).
* **Streamed checkpoints** (:class:`ShardWriter`, used by ``bench/make_dsv3_slice.py``): the
  same layout with real bytes, written tensor by tensor into shards whose headers are computed
  up front from the inventory, so peak memory is one chunk of one tensor.

Inventory of the DeepSeek FP8 releases (``deepseek-ai/DeepSeek-V3`` / R1, Kimi-K2: their
``model.safetensors.index.json`` and shard headers): every decoder-layer linear (``q_a_proj``, ``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``, dense / shared / per-expert
``gate_proj`` ``up_proj`` ``down_proj``) stores ``weight`` F8_E4M3 [out, in] and
``weight_scale_inv`` F32 [ceil(out/128), ceil(in/128)]; embeddings, ``lm_head``, norms and the
router ``mlp.gate.weight`` are BF16, the router's ``e_score_correction_bias`` F32 (DeepSeek's
``inference/model.py`` creates it as float32 when dim == 7168). DeepSeek-V3's MTP layer
(``model.layers.61``, ``num_nextn_predict_layers: 1``) is a full MoE decoder layer plus
``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` [7168, 14336] and ``shared_head.{norm,head}``,
all of these BF16 (engines build ``eh_proj`` as an unquantized linear). Kimi-K2 additionally
stores ``self_attn.rotary_emb.inv_freq`` per layer.

What is not the release's: the split of tensors over shards (DeepSeek-V3: filled in module order
to 163 shards of equal bytes; the release's own shards vary between ~4.1 and ~4.9 GB; Kimi-K2:
one decoder layer per shard, embeddings in the first, ``model.norm`` / ``lm_head`` in the last,
as its release names them).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from ..checkpoint.safetensors_index import write_header

__all__ = ["StoredTensor", "deepseek_v3_config", "kimi_k2_config", "slice_config", "release_tensors",
           "shard_layout", "safetensors_header", "write_header_only", "ShardWriter", "check_free_disk",
           "DiskSpaceError", "DEEPSEEK_V3_SHARDS", "KIMI_K2_SHARDS", "KIMI_K3_SHARDS",
           "kimi_k3_config", "kimi_k3_slice_config", "kimi_k3_tensors", "deepseek_v4_config",
           "deepseek_v4_tensors", "DEEPSEEK_V4_SHARDS"]

#: bytes per element of the safetensors dtypes used here
ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "I32": 4, "I64": 8}
#: DeepSeek's FP8 weight block (``weight_block_size``)
BLOCK = (128, 128)
DEEPSEEK_V3_SHARDS = 163
KIMI_K2_SHARDS = 61
KIMI_K3_SHARDS = 93
#: elements of Kimi-K2's stored ``rotary_emb.inv_freq`` (not qk_rope_head_dim / 2 = 32): the
#: release's published inventory (139,644 tensors, 1,026,470,731,056 parameters) adds up only with 56
KIMI_INV_FREQ_LEN = 56

# The released config.json files, verbatim (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct).
_FP8_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
_AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
             "AutoModel": "modeling_deepseek.DeepseekV3Model",
             "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": _AUTO_MAP, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "quantization_config": _FP8_QUANT, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
_KIMI_K2: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": _AUTO_MAP, "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 131072,
    "model_type": "kimi_k2", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1,
    "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "quantization_config": _FP8_QUANT, "rms_norm_eps": 1e-06, "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.48.3", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 163840,
}


def deepseek_v3_config() -> dict[str, Any]:
    """DeepSeek-V3's released config.json (61 layers, first 3 dense, 256 + 1 experts, FP8 [128, 128])."""
    return copy.deepcopy(_DEEPSEEK_V3)


def kimi_k2_config() -> dict[str, Any]:
    """Kimi-K2-Instruct's released config.json (61 layers, first 1 dense, 384 + 1 experts, 64 heads)."""
    return copy.deepcopy(_KIMI_K2)


# Kimi-K3 (docs/architectures/kimi.md): no official config.json was read; the values are a third-party analysis's quotes of it,
# cross-checked against sglang where its code asserts them. Wrapped as the release is: the text model
# under text_config (kimi_linear), the quantization_config there too (only routed experts MXFP4).
K3_LAYERS = 93
K3_HIDDEN = 7168
K3_EXPERTS = 896
#: routed_scaling_factor of K3 is quoted by no source read; Kimi-K2's 2.827 stands
#: in. K3's latent RMSNorm follows the weighted expert sum, so the value barely matters (only eps).
K3_ROUTED_SCALING_FACTOR_PLACEHOLDER = 2.827
#: llm-compressor's mxfp4 preset (compressed-tensors ``MXFP4``): symmetric float4 weights in groups of
#: 32 with uint8 (E8M0) scales, no activation quantization in the weight-only "A16" form K3 ships
_MXFP4_WEIGHTS: dict[str, Any] = {
    "num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
    "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
    "scale_dtype": "torch.uint8", "zp_dtype": None,
}


def _k3_text_config() -> dict[str, Any]:
    full = [i for i in range(1, K3_LAYERS + 1) if i % 4 == 0] + [K3_LAYERS]  # 1-based: 4, 8, ..., 92, 93
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": 163840, "hidden_size": K3_HIDDEN, "intermediate_size": 33792, "moe_intermediate_size": 3072,
        "num_hidden_layers": K3_LAYERS, "num_attention_heads": 96, "num_key_value_heads": 96,
        "num_experts": K3_EXPERTS, "num_experts_per_token": 16, "num_shared_experts": 2,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": K3_ROUTED_SCALING_FACTOR_PLACEHOLDER,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "mla_use_nope": True, "mla_use_output_gate": True, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                               "kda_layers": [i for i in range(1, K3_LAYERS + 1) if i not in full],
                               "full_attn_layers": full},
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 12, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "model_max_length": 1048576, "bos_token_id": 163584, "eos_token_id": 163585,  # Kimi-K2's ids
        "torch_dtype": "bfloat16",
    }


def _k3_unquantized_linears(text: Mapping[str, Any]) -> list[str]:
    """Every ``nn.Linear`` of the K3 text model that the release leaves in bf16, by module name as
    llm-compressor lists them in ``ignore`` (targets ``Linear``: each module of that class it did not
    quantize): attention, KDA gates, dense / shared MLPs, the latent projections, the
    attention-residual score projections ([1, hidden]: ``nn.Linear(hidden, 1)``) and ``lm_head``.
    The vision tower's linears, which the release would list too, are left out: the header-only
    checkpoint stores no vision tensors, and an exact ignore entry must name a stored module."""
    lin = text["linear_attn_config"]
    kda = set(lin["kda_layers"])
    p = "language_model.model"
    out: list[str] = []
    for i in range(text["num_hidden_layers"]):
        b = f"{p}.layers.{i}"
        out += [f"{b}.self_attention_res_proj", f"{b}.mlp_res_proj"]
        a = f"{b}.self_attn"
        if i + 1 in kda:
            out += [f"{a}.{x}" for x in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj",
                                          "o_proj")]
        else:
            out += [f"{a}.{x}" for x in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj",
                                          "o_proj")]
        if i < text["first_k_dense_replace"]:
            out += [f"{b}.mlp.{x}" for x in ("gate_proj", "up_proj", "down_proj")]
        else:
            m = f"{b}.block_sparse_moe"
            out += [f"{m}.shared_experts.{x}" for x in ("gate_proj", "up_proj", "down_proj")]
            out += [f"{m}.routed_expert_down_proj", f"{m}.routed_expert_up_proj"]
    return [*out, f"{p}.output_attn_res_proj", "language_model.lm_head"]


def kimi_k3_config() -> dict[str, Any]:
    """Kimi-K3's release config.json as third-party copies quote it (93 layers: 69 KDA + 24 MLA, first
    dense, 896 routed experts top-16 + 2 shared, latent MoE 7168 -> 3584, attention residuals every 12
    layers, SiTU), wrapped: ``KimiK3ForConditionalGeneration`` / ``kimi_k3`` at the top, the text model
    under ``text_config``. The vision config is left out (no vision tensors are written).

    ``text_config.quantization_config``: compressed-tensors ``mxfp4-pack-quantized``, one config group
    targeting ``Linear`` with weights float4 group 32 (uint8 E8M0 scales), and an ``ignore`` list of
    every other linear by name (1,347 entries, :func:`_k3_unquantized_linears`), as llm-compressor
    writes a model whose only quantized linears are the routed experts.

    Not from any source: ``routed_scaling_factor`` (:data:`K3_ROUTED_SCALING_FACTOR_PLACEHOLDER`), the
    special token ids (Kimi-K2's), the exact llm-compressor bookkeeping fields (``observer`` etc.)."""
    text = _k3_text_config()
    text["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": copy.deepcopy(_MXFP4_WEIGHTS),
                                      "input_activations": None, "output_activations": None,
                                      "format": "mxfp4-pack-quantized"}},
        "ignore": _k3_unquantized_linears(text), "kv_cache_scheme": None, "sparsity_config": {},
        "transform_config": {}, "global_compression_ratio": None,
    }
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "media_placeholder_token_id": 163605, "tie_word_embeddings": False, "text_config": text}


def kimi_k3_slice_config(dense_width: int | None = None) -> dict[str, Any]:
    """K3's release config cut to two decoder layers at its real widths: layer 0 KDA with the dense
    MLP (``intermediate_size``, 33792 unless ``dense_width``), layer 1 MLA with the latent MoE (896
    MXFP4 experts); the vocabulary, hidden size and every other value as released. The ignore list
    follows the two layers."""
    cfg = kimi_k3_config()
    text = cfg["text_config"]
    text["num_hidden_layers"] = 2
    text["linear_attn_config"].update(kda_layers=[1], full_attn_layers=[2])
    if dense_width is not None:
        text["intermediate_size"] = dense_width
    text["quantization_config"]["ignore"] = _k3_unquantized_linears(text)
    return cfg


def slice_config(layers: int, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A DeepSeek-V3-dimension config cut to ``layers`` decoder layers: the first dense, the rest
    MoE, no MTP layer (every other value as released)."""
    if layers < 1:
        raise ValueError(f"layers = {layers}: expected at least 1")
    cfg = copy.deepcopy(dict(base) if base is not None else _DEEPSEEK_V3)
    cfg.update(num_hidden_layers=layers, first_k_dense_replace=1, num_nextn_predict_layers=0)
    return cfg


# ---------------------------------------------------------------------------------------------
# the tensor inventory
# ---------------------------------------------------------------------------------------------

#: a decoder layer's tensor: ``model.layers.N.`` (DeepSeek, Kimi-K2) or ``language_model.model.layers.N.`` (K3)
_LAYER = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as the release stores it: name, safetensors dtype, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]

    @cached_property
    def layer(self) -> int | None:
        m = _LAYER.match(self.name)
        return int(m.group(1)) if m else None


def _scale_shape(out: int, inp: int) -> tuple[int, int]:
    return math.ceil(out / BLOCK[0]), math.ceil(inp / BLOCK[1])


def _linear(name: str, out: int, inp: int) -> list[StoredTensor]:
    return [StoredTensor(f"{name}.weight", "F8_E4M3", (out, inp)),
            StoredTensor(f"{name}.weight_scale_inv", "F32", _scale_shape(out, inp))]


def _layer(cfg: Mapping[str, Any], i: int, *, inv_freq: bool) -> Iterator[StoredTensor]:
    """Decoder layer ``i`` in module order (attention, MLP, norms), as a state dict lists it."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    b = f"model.layers.{i}"
    a = f"{b}.self_attn"
    if ql is None:
        yield from _linear(f"{a}.q_proj", nh * (nope + rope), h)
    else:
        yield from _linear(f"{a}.q_a_proj", ql, h)
        yield StoredTensor(f"{a}.q_a_layernorm.weight", "BF16", (ql,))
        yield from _linear(f"{a}.q_b_proj", nh * (nope + rope), ql)
    yield from _linear(f"{a}.kv_a_proj_with_mqa", kl + rope, h)
    yield StoredTensor(f"{a}.kv_a_layernorm.weight", "BF16", (kl,))
    yield from _linear(f"{a}.kv_b_proj", nh * (nope + vd), kl)
    yield from _linear(f"{a}.o_proj", h, nh * vd)
    if inv_freq:
        yield StoredTensor(f"{a}.rotary_emb.inv_freq", "BF16", (KIMI_INV_FREQ_LEN,))
    m = f"{b}.mlp"
    if i < cfg["first_k_dense_replace"]:
        inter = cfg["intermediate_size"]
        yield from _linear(f"{m}.gate_proj", inter, h)
        yield from _linear(f"{m}.up_proj", inter, h)
        yield from _linear(f"{m}.down_proj", h, inter)
    else:
        e, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        yield StoredTensor(f"{m}.gate.weight", "BF16", (e, h))
        yield StoredTensor(f"{m}.gate.e_score_correction_bias", "F32", (e,))
        for k in range(e):
            yield from _linear(f"{m}.experts.{k}.gate_proj", mi, h)
            yield from _linear(f"{m}.experts.{k}.up_proj", mi, h)
            yield from _linear(f"{m}.experts.{k}.down_proj", h, mi)
        si = mi * cfg.get("n_shared_experts", 0)
        if si:
            yield from _linear(f"{m}.shared_experts.gate_proj", si, h)
            yield from _linear(f"{m}.shared_experts.up_proj", si, h)
            yield from _linear(f"{m}.shared_experts.down_proj", h, si)
    yield StoredTensor(f"{b}.input_layernorm.weight", "BF16", (h,))
    yield StoredTensor(f"{b}.post_attention_layernorm.weight", "BF16", (h,))


#: MXFP4 (compressed-tensors): two E2M1 codes per byte, one E8M0 scale byte per 32 inputs
MXFP4_GROUP = 32


def kimi_k3_tensors(cfg: Mapping[str, Any], *, a_log: str = "heads") -> list[StoredTensor]:
    """Every tensor of the K3 release for a wrapped K3 config: embeddings first,
    then each decoder layer, then the final norm, the output attention-residual tensors and
    ``lm_head``, all under ``language_model.``. Routed experts (``block_sparse_moe.experts.E.w1/w2/w3``)
    are MXFP4: ``weight_packed`` U8 [out, in/2] + ``weight_scale`` U8 [out, in/32]; the KDA
    ``{q,k,v}_conv1d.weight``, ``dt_bias`` and ``A_log`` F32; everything else BF16.

    ``a_log``: ``"heads"`` stores ``A_log`` as [96] (llama.cpp's reading, the one chosen here),
    ``"head_dim"`` as [128] (sglang's); see :func:`quantplug.testing.kimi.kimi_text_shapes`."""
    from .kimi import RELEASE_FP32, kimi_text_shapes  # imports torch: only when a K3 inventory is built

    shapes = kimi_text_shapes(cfg, a_log)
    first: list[StoredTensor] = []
    layers: list[StoredTensor] = []
    last: list[StoredTensor] = []
    for name, shape in shapes.items():
        if ".experts." in name and name.endswith(".weight"):
            out, inp = shape
            base = name[: -len("weight")]
            layers += [StoredTensor(base + "weight_packed", "U8", (out, inp // 2)),
                       StoredTensor(base + "weight_scale", "U8", (out, inp // MXFP4_GROUP))]
            continue
        t = StoredTensor(name, "F32" if RELEASE_FP32.search(name) else "BF16", shape)
        (layers if t.layer is not None else first if "embed_tokens" in name else last).append(t)
    return first + layers + last


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4 (docs/architectures/deepseek-v4.md): the Flash and Pro release layouts
# ---------------------------------------------------------------------------------------------

#: shards of the V4 releases (Flash: the MTP block alone in the last, ``model-00046-of-00046``)
DEEPSEEK_V4_SHARDS = {"flash": 46, "pro": 64}
#: FP4 experts: two E2M1 codes per I8 byte, one F8_E8M0 scale per 32 inputs
V4_FP4_GROUP = 32
_V4_FP8_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                 "weight_block_size": [128, 128]}
_V4_DIMS: dict[str, dict[str, Any]] = {
    "flash": {"hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "q_lora_rank": 1024,
              "o_groups": 8, "index_topk": 512, "n_routed_experts": 256, "moe_intermediate_size": 2048,
              "routed_scaling_factor": 1.5},
    "pro": {"hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
            "o_groups": 16, "index_topk": 1024, "n_routed_experts": 384, "moe_intermediate_size": 3072,
            "routed_scaling_factor": 2.5},
}


def deepseek_v4_config(variant: str = "flash") -> dict[str, Any]:
    """DeepSeek-V4-Flash's (``variant="flash"``: 43 layers, hidden 4096, 256 FP4 experts of 2048) or
    V4-Pro's (``"pro"``: 61 layers, hidden 7168, 384 experts of 3072) release config.json as
    DeepSeek-V4-Flash's inference config and third-party copies of the release give it:
    ``compress_ratios`` per layer plus the MTP block's 0 (Flash: 0, 0, then 4 on even and 128 on
    odd layers; Pro: 128, 128, then the same), FP8 ``quantization_config``
    with ``scale_fmt: ue8m0``, ``expert_dtype: "fp4"`` at the top level, one MTP block."""
    if variant not in _V4_DIMS:
        raise ValueError(f"variant {variant!r}: expected 'flash' or 'pro'")
    dims = _V4_DIMS[variant]
    n = int(dims["num_hidden_layers"])
    head = [0, 0] if variant == "flash" else [128, 128]
    ratios = head + [4 if i % 2 == 0 else 128 for i in range(2, n)] + [0]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **dims,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "o_lora_rank": 1024,
        "sliding_window": 128, "compress_ratios": ratios, "compress_rope_theta": 160000, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "index_n_heads": 64, "index_head_dim": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "num_experts_per_tok": 6, "n_shared_experts": 1, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "swiglu_limit": 10.0, "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6, "vocab_size": 129280, "max_position_embeddings": 1048576, "bos_token_id": 0,
        "eos_token_id": 1, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "quantization_config": dict(_V4_FP8_QUANT), "expert_dtype": "fp4",
    }


def _v4_fp8(name: str, out: int, inp: int) -> list[StoredTensor]:
    """An FP8 linear of the V4 release: ``weight`` F8_E4M3 [out, in], ``scale`` F8_E8M0 [out/128, in/128]."""
    return [StoredTensor(f"{name}.weight", "F8_E4M3", (out, inp)),
            StoredTensor(f"{name}.scale", "F8_E8M0", _scale_shape(out, inp))]


def _v4_bf16(name: str, *shape: int) -> StoredTensor:
    return StoredTensor(name, "BF16", tuple(shape))


def _v4_block(cfg: Mapping[str, Any], b: str, ratio: int, hash_routed: bool) -> list[StoredTensor]:
    """One V4 block under ``b`` (``layers.L`` or ``mtp.0``) with compression ratio ``ratio``."""
    d, nh, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, g, r = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    hc = cfg["hc_mult"]
    mix = (2 + hc) * hc
    e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    out = [_v4_bf16(f"{b}.attn_norm.weight", d), _v4_bf16(f"{b}.ffn_norm.weight", d)]
    for side in ("attn", "ffn"):
        out += [StoredTensor(f"{b}.hc_{side}_fn", "F32", (mix, hc * d)),
                StoredTensor(f"{b}.hc_{side}_base", "F32", (mix,)),
                StoredTensor(f"{b}.hc_{side}_scale", "F32", (3,))]
    a = f"{b}.attn"
    out += [*_v4_fp8(f"{a}.wq_a", ql, d), _v4_bf16(f"{a}.q_norm.weight", ql), *_v4_fp8(f"{a}.wq_b", nh * hd, ql),
            *_v4_fp8(f"{a}.wkv", hd, d), _v4_bf16(f"{a}.kv_norm.weight", hd),
            *_v4_fp8(f"{a}.wo_a", g * r, nh * hd // g), *_v4_fp8(f"{a}.wo_b", d, g * r),
            StoredTensor(f"{a}.attn_sink", "F32", (nh,))]
    if ratio:
        width = 2 * hd if ratio == 4 else hd  # CSA's overlapping windows: two halves
        c = f"{a}.compressor"
        out += [_v4_bf16(f"{c}.wkv.weight", width, d), _v4_bf16(f"{c}.wgate.weight", width, d),
                StoredTensor(f"{c}.ape", "F32", (ratio, width)), _v4_bf16(f"{c}.norm.weight", hd)]
    if ratio == 4:
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        x = f"{a}.indexer"
        out += [*_v4_fp8(f"{x}.wq_b", ih * idim, ql), _v4_bf16(f"{x}.weights_proj.weight", ih, d),
                _v4_bf16(f"{x}.compressor.wkv.weight", 2 * idim, d),
                _v4_bf16(f"{x}.compressor.wgate.weight", 2 * idim, d),
                StoredTensor(f"{x}.compressor.ape", "F32", (4, 2 * idim)),
                _v4_bf16(f"{x}.compressor.norm.weight", idim)]
    f = f"{b}.ffn"
    out.append(_v4_bf16(f"{f}.gate.weight", e, d))
    out.append(StoredTensor(f"{f}.gate.tid2eid", "I64", (cfg["vocab_size"], cfg["num_experts_per_tok"]))
               if hash_routed else StoredTensor(f"{f}.gate.bias", "F32", (e,)))
    for k in range(e):
        for w, (n_out, n_in) in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
            out += [StoredTensor(f"{f}.experts.{k}.{w}.weight", "I8", (n_out, n_in // 2)),
                    StoredTensor(f"{f}.experts.{k}.{w}.scale", "F8_E8M0", (n_out, n_in // V4_FP4_GROUP))]
    si = inter * cfg.get("n_shared_experts", 1)
    out += [*_v4_fp8(f"{f}.shared_experts.w1", si, d), *_v4_fp8(f"{f}.shared_experts.w2", d, si),
            *_v4_fp8(f"{f}.shared_experts.w3", si, d)]
    return out


def deepseek_v4_tensors(cfg: Mapping[str, Any]) -> list[StoredTensor]:
    """Every tensor of a DeepSeek-V4 FP8 + FP4 release with this config (the release's names,
    no ``model.`` prefix; its dtypes): ``embed``, the ``num_hidden_layers`` blocks, ``norm``,
    ``head``, ``hc_head_*``, then the MTP blocks ``mtp.N.*`` (``e_proj`` / ``h_proj`` FP8 [D, D],
    ``enorm`` / ``hnorm`` / ``norm``, ``hc_head_*`` and a sliding-window block with a learned router;
    no embedding or head copy, as the Flash release's MTP shard holds none).

    FP8 linears (attention, indexer ``wq_b``, shared experts, MTP projections): ``weight`` F8_E4M3
    [N, K] + ``scale`` F8_E8M0 [ceil(N/128), ceil(K/128)]. Routed experts (``w1`` / ``w3`` [I, D],
    ``w2`` [D, I]): ``weight`` I8 [N, K/2] + ``scale`` F8_E8M0 [N, K/32]. ``gate.tid2eid`` I64
    [vocab, top-k] on the first ``num_hash_layers`` layers, ``gate.bias`` F32 after (and in the MTP
    block); a compressor on every layer of ratio > 0 (overlapping, twice as wide, with the indexer at
    ratio 4). Flash: 69,187 tensors, 159,609,485,896 bytes (148.6 GiB); Pro: 145,116 tensors,
    864,704,792,696 bytes (805.3 GiB): the counts and sizes of the
    release headers' third-party listings."""
    d, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hc = cfg["hc_mult"]
    ratios = list(cfg["compress_ratios"])
    out = [_v4_bf16("embed.weight", v, d)]
    for i in range(n):
        out += _v4_block(cfg, f"layers.{i}", ratios[i], i < cfg["num_hash_layers"])
    out += [_v4_bf16("norm.weight", d), _v4_bf16("head.weight", v, d),
            StoredTensor("hc_head_fn", "F32", (hc, hc * d)), StoredTensor("hc_head_base", "F32", (hc,)),
            StoredTensor("hc_head_scale", "F32", (1,))]
    for k in range(int(cfg.get("num_nextn_predict_layers", 0) or 0)):
        m = f"mtp.{k}"
        out += [*_v4_fp8(f"{m}.e_proj", d, d), *_v4_fp8(f"{m}.h_proj", d, d), _v4_bf16(f"{m}.enorm.weight", d),
                _v4_bf16(f"{m}.hnorm.weight", d), _v4_bf16(f"{m}.norm.weight", d),
                StoredTensor(f"{m}.hc_head_fn", "F32", (hc, hc * d)), StoredTensor(f"{m}.hc_head_base", "F32", (hc,)),
                StoredTensor(f"{m}.hc_head_scale", "F32", (1,))]
        out += _v4_block(cfg, m, ratios[n + k] if n + k < len(ratios) else 0, False)
    return out


def _v4_layout(tensors: Sequence[StoredTensor], shards: int) -> dict[str, list[StoredTensor]]:
    """V4's shards: the main model in equal byte shares over all but the last file, the MTP blocks
    alone in the last (as the Flash release's ``model-00046-of-00046`` holds its 1,575 ``mtp.0.*``
    tensors); file names ``model-00001-of-00046.safetensors``."""
    main = [t for t in tensors if not t.name.startswith("mtp.")]
    mtp = [t for t in tensors if t.name.startswith("mtp.")]
    groups = list(shard_layout(main, shards - 1 if mtp else shards).values())
    if mtp:
        groups.append(mtp)
    return {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": g for i, g in enumerate(groups)}


def release_tensors(cfg: Mapping[str, Any], *, inv_freq: bool | None = None) -> list[StoredTensor]:
    """Every tensor of the FP8 release with this config, in module order: embeddings, decoder
    layers, final norm, lm_head, then the ``num_nextn_predict_layers`` MTP layers.

    ``inv_freq``: also store ``self_attn.rotary_emb.inv_freq`` per layer (Kimi-K2's release does;
    default: when ``model_type`` is ``kimi_k2``). ``model_type`` kimi_k3: :func:`kimi_k3_tensors`."""
    if cfg.get("model_type") == "kimi_k3":
        return kimi_k3_tensors(cfg)
    if cfg.get("model_type") == "deepseek_v4":
        return deepseek_v4_tensors(cfg)
    if inv_freq is None:
        inv_freq = cfg.get("model_type") == "kimi_k2"
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    layers = cfg["num_hidden_layers"]
    out = [StoredTensor("model.embed_tokens.weight", "BF16", (v, h))]
    for i in range(layers):
        out += _layer(cfg, i, inv_freq=inv_freq)
    out.append(StoredTensor("model.norm.weight", "BF16", (h,)))
    if not cfg.get("tie_word_embeddings"):
        out.append(StoredTensor("lm_head.weight", "BF16", (v, h)))
    for i in range(layers, layers + int(cfg.get("num_nextn_predict_layers", 0) or 0)):
        b = f"model.layers.{i}"
        out += [StoredTensor(f"{b}.embed_tokens.weight", "BF16", (v, h)),
                StoredTensor(f"{b}.enorm.weight", "BF16", (h,)),
                StoredTensor(f"{b}.hnorm.weight", "BF16", (h,)),
                StoredTensor(f"{b}.eh_proj.weight", "BF16", (h, 2 * h))]
        out += _layer(cfg, i, inv_freq=inv_freq)
        out += [StoredTensor(f"{b}.shared_head.norm.weight", "BF16", (h,)),
                StoredTensor(f"{b}.shared_head.head.weight", "BF16", (v, h))]
    return out


# ---------------------------------------------------------------------------------------------
# shards
# ---------------------------------------------------------------------------------------------

def shard_name(i: int, n: int, style: str = "hub") -> str:
    """File name of shard ``i`` (1-based) of ``n``: ``hub`` = model-00001-of-000163.safetensors
    (DeepSeek's six-digit total), ``plain`` = model-1-of-61.safetensors (Kimi-K2)."""
    if style == "hub":
        return f"model-{i:05d}-of-{n:06d}.safetensors"
    if style == "plain":
        return f"model-{i}-of-{n}.safetensors"
    raise ValueError(f"shard name style {style!r}: expected 'hub' or 'plain'")


def shard_layout(tensors: Sequence[StoredTensor], shards: int, *, by: str = "bytes",
                 style: str = "hub") -> dict[str, list[StoredTensor]]:
    """Split ``tensors`` (in order) over ``shards`` files: ``by="bytes"`` in equal byte shares
    (a tensor goes where its middle byte falls), ``by="layer"`` one decoder layer per file
    (tensors before layer 0 go with it, those after the last layer with the last file)."""
    if shards < 1:
        raise ValueError(f"shards = {shards}: expected at least 1")
    groups: list[list[StoredTensor]] = [[] for _ in range(shards)]
    if by == "bytes":
        total = sum(t.nbytes for t in tensors) or 1
        start = 0
        for t in tensors:
            mid = start + t.nbytes // 2
            groups[min(shards - 1, mid * shards // total)].append(t)
            start += t.nbytes
    elif by == "layer":
        last = 0
        for t in tensors:
            layer = t.layer
            last = layer if layer is not None else last
            groups[min(shards - 1, last)].append(t)
    else:
        raise ValueError(f"by = {by!r}: expected 'bytes' or 'layer'")
    empty = [i + 1 for i, g in enumerate(groups) if not g]
    if empty:
        raise ValueError(f"{len(empty)} of {shards} shards would be empty (first: {empty[0]}); use fewer shards")
    return {shard_name(i + 1, shards, style): g for i, g in enumerate(groups)}


def safetensors_header(tensors: Iterable[StoredTensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes before the data of a safetensors file holding ``tensors`` in this order: the
    8-byte little-endian header length, then the JSON header padded with spaces to a multiple of
    8 (as the safetensors library pads it); ``__metadata__`` defaults to ``{"format": "pt"}``."""
    return write_header(tensors, metadata or {"format": "pt"})


def _write_index(root: Path, layout: Mapping[str, Sequence[StoredTensor]]) -> None:
    weight_map = {t.name: fname for fname, group in layout.items() for t in group}
    total = sum(t.nbytes for group in layout.values() for t in group)
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / "model.safetensors.index.json").write_text(json.dumps(doc, indent=2))


def write_header_only(path: str | Path, cfg: Mapping[str, Any] | None = None, *, shards: int | None = None,
                      by: str | None = None, style: str | None = None) -> Path:
    """Write a header-only (sparse) copy of an FP8 release into directory ``path``: config.json,
    model.safetensors.index.json and every shard, each a real safetensors header followed by a
    hole up to the file's full size (``os.truncate``). Uses a few MB of disk whatever the model.

    Defaults follow the model: DeepSeek-V3 (``cfg`` None) = 163 shards of equal bytes named
    ``model-00001-of-000163.safetensors``; ``model_type`` kimi_k2 = 61 shards, one layer each,
    named ``model-1-of-61.safetensors``; ``model_type`` kimi_k3 = 93 shards, one layer each (Moonshot's
    convention in Kimi-K2: a layer's experts are one ~16 GB file, and a shard never splits a layer),
    named in the hub's style ``model-00001-of-000093.safetensors`` (the K3 release's own file names
    and split were not seen)."""
    cfg = dict(cfg) if cfg is not None else deepseek_v3_config()
    model_type = cfg.get("model_type")
    by_layer = model_type in ("kimi_k2", "kimi_k3")
    default_shards = {"kimi_k2": KIMI_K2_SHARDS, "kimi_k3": KIMI_K3_SHARDS}.get(str(model_type), DEEPSEEK_V3_SHARDS)
    if model_type == "deepseek_v4":
        default_shards = DEEPSEEK_V4_SHARDS["pro" if cfg["hidden_size"] == 7168 else "flash"]
    shards = shards or default_shards
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    if model_type == "deepseek_v4" and by is None and style is None:
        layout = _v4_layout(release_tensors(cfg), shards)
    else:
        layout = shard_layout(release_tensors(cfg), shards, by=by or ("layer" if by_layer else "bytes"),
                              style=style or ("plain" if model_type == "kimi_k2" else "hub"))
    for fname, group in layout.items():
        header = safetensors_header(group)
        file = root / fname
        file.write_bytes(header)
        os.truncate(file, len(header) + sum(t.nbytes for t in group))
    _write_index(root, layout)
    return root


# ---------------------------------------------------------------------------------------------
# streaming writer
# ---------------------------------------------------------------------------------------------

class DiskSpaceError(OSError):
    """Not enough free disk space for what is about to be written."""


def check_free_disk(path: str | Path, need: int, reserve: int = 2 << 30) -> int:
    """Free bytes at ``path`` (its nearest existing parent); :class:`DiskSpaceError` naming the
    numbers unless ``need`` + ``reserve`` fit."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    free = shutil.disk_usage(p).free
    if need + reserve > free:
        gib = 1 << 30
        raise DiskSpaceError(f"{path}: need {need / gib:.2f} GiB ({need:,} bytes) + {reserve / gib:.1f} GiB "
                             f"reserve, but only {free / gib:.2f} GiB ({free:,} bytes) is free on that filesystem")
    return free


class ShardWriter:
    """Write one safetensors file tensor by tensor, in the order of ``tensors``.

    The header is computed from ``tensors`` and written first; :meth:`write` then appends each
    tensor's bytes (a tensor may come in several consecutive pieces). ``drop_cache_every``: after
    that many bytes, flush them to disk and drop them from the page cache (``fdatasync`` +
    ``posix_fadvise(DONTNEED)``), so writing tens of GB does not push other processes' pages out.
    :meth:`close` checks that every byte was written.
    """

    def __init__(self, file: str | Path, tensors: Sequence[StoredTensor], *,
                 drop_cache_every: int = 1 << 30) -> None:
        self.file = Path(file)
        self.tensors = list(tensors)
        header = safetensors_header(self.tensors)
        self.size = len(header) + sum(t.nbytes for t in self.tensors)
        self._fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pos = 0
        self._synced = 0
        self._drop_every = drop_cache_every
        self._next = 0  # index of the tensor being written
        self._left = self.tensors[0].nbytes if self.tensors else 0
        self._write(header)

    def _write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
            self._pos += n
        if self._drop_every and self._pos - self._synced >= self._drop_every:
            self._drop()

    def _drop(self) -> None:
        os.fdatasync(self._fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, self._synced, self._pos - self._synced, os.POSIX_FADV_DONTNEED)
        self._synced = self._pos

    @property
    def current(self) -> StoredTensor | None:
        """The tensor the next :meth:`write` continues (None when all are written)."""
        return self.tensors[self._next] if self._next < len(self.tensors) else None

    def write(self, name: str, data: Any) -> None:
        """Append bytes of tensor ``name`` (any buffer: bytes, numpy array, contiguous CPU tensor's
        ``.numpy()`` view); must be the tensor in progress and must not overrun it."""
        cur = self.current
        if cur is None or cur.name != name:
            raise ValueError(f"{self.file.name}: got {name}, expected {cur.name if cur else 'no more tensors'}")
        n = memoryview(data).nbytes
        if n > self._left:
            raise ValueError(f"{self.file.name}: {name}: {n} more bytes, but only {self._left} of "
                             f"{cur.nbytes} are left")
        self._write(data)
        self._left -= n
        while self._left == 0 and self._next < len(self.tensors):
            self._next += 1
            self._left = self.tensors[self._next].nbytes if self._next < len(self.tensors) else 0

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            if self.current is not None:
                raise ValueError(f"{self.file.name}: closed before {self.current.name} (and "
                                 f"{len(self.tensors) - self._next - 1} more) were written")
            self._drop()
        finally:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            os.close(self._fd)
            self._fd = -1
            return
        self.close()


def write_index(root: str | Path, layout: Mapping[str, Sequence[StoredTensor]]) -> None:
    """model.safetensors.index.json for ``layout`` (file name -> its tensors), with total_size."""
    _write_index(Path(root), layout)
