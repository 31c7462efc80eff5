"""Write DeepSeek-V4 GGUFs in llama.cpp's ``deepseek4`` layout with gguf-py's GGUFWriter and quantizer.

What llama.cpp's converter writes (``conversion/deepseek.py`` ``DeepseekV4Model``; llama-cpp-python
0.3.36's tree) and its loader reads (``src/models/deepseek4.cpp``): the release's tensors renamed
one to one (:data:`~.names.V4_LAYER` and neighbours), the routed experts stacked into
``blk.L.ffn_{gate,up,down}_exps`` [E, out, in] as ggml MXFP4, the release's FP8 linears (``wq_a``,
``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, ``indexer.wq_b``, the shared expert) as Q8_0, the release's
BF16 matrices (embedding, head, router, compressors, ``indexer.weights_proj``) as BF16, the F32
ones (``hc_*``, ``ape``) and every 1-D tensor as F32, ``tid2eid`` as I32; ``gate.bias`` of the
hash-routed layers is not written (llama.cpp routes them by ``tid2eid`` alone), nor is the MTP block
``mtp.K`` (the converter writes it only into a separate MTP file, which quantplug does not map). The metadata are
the converter's keys (``set_gguf_parameters``), written by name so that a gguf-py without the
``deepseek4`` helpers writes them too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from quantplug.api import QuantplugError, ggml

from .names import model_to_gguf

ARCH = "deepseek4"
#: GGUF base names (``blk.L.`` removed) written in the export's linear type (the release's FP8 linears)
_LINEAR = re.compile(r"^(attn_q_a|attn_q_b|attn_kv|attn_output_a|attn_output_b|indexer\.attn_q_b|"
                     r"ffn_(gate|up|down)_shexp)\.weight$")
_EXPERTS = re.compile(r"^ffn_(gate|up|down)_exps\.weight$")
#: 2-D tensors the release stores F32 (the converter keeps them F32)
_F32 = re.compile(r"(hc_(attn|ffn)_fn|output_hc_fn|_ape)\.weight$")
_PER_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w1|w3|w2)\.weight$")
_STACK = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def gguf_state_v4(state: Mapping[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """Dense release-named weights (per-expert ``w1`` / ``w3`` / ``w2``) -> GGUF-named tensors."""
    names = model_to_gguf(cfg)
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        m = _PER_EXPERT.match(name)
        if m:
            experts.setdefault((m.group(1), _STACK[m.group(3)]), {})[int(m.group(2))] = t
            continue
        if name not in names:
            if re.match(r"^layers\.(\d+)\.ffn\.gate\.bias$", name):
                continue  # a hash-routed layer's unused bias
            if name.startswith("mtp."):
                continue  # the MTP block: llama.cpp's converter leaves it out of the model's file too
            raise QuantplugError(f"export: tensor {name} has no llama.cpp {ARCH} name")
        out[names[name]] = t
    for (base, proj), per in experts.items():
        out[names[f"{base}.{proj}.weight"]] = torch.stack([per[k] for k in sorted(per)])
    return out


def _type_for(name: str, t: torch.Tensor, linear: str) -> str:
    base = re.sub(r"^blk\.\d+\.", "", name)
    if base == "ffn_gate_tid2eid.weight":
        return "I32"
    if linear == "F32" or t.dim() == 1 or _F32.search(name):
        return "F32"
    if _EXPERTS.match(base):
        return "MXFP4"
    if _LINEAR.match(base):
        return linear
    return "BF16"


def write_gguf_v4(path: str | Path, tensors: Mapping[str, torch.Tensor], cfg: Any, *,
                  linear_type: str = "Q8_0") -> dict[str, str]:
    """Write a deepseek4 GGUF from GGUF-named tensors (:func:`gguf_state_v4`); returns {name: type}.

    ``linear_type``: the type of the release's FP8 linears (Q8_0 as the converter writes them, or
    any gguf-py type); ``"F32"`` writes every float tensor F32 (an all-F32 reference file)."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    att = cfg.attention[0]
    raw = cfg.raw
    n = cfg.num_hidden_layers
    w = GGUFWriter(str(path), ARCH)
    w.add_name("quantplug export")
    u32 = {
        "block_count": n, "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": 1,
        "attention.key_length": att.head_dim, "attention.value_length": att.head_dim,
        "rope.dimension_count": att.rope_dim, "attention.q_lora_rank": att.q_lora_rank,
        "attention.sliding_window": att.sliding_window, "expert_count": cfg.n_routed_experts,
        "expert_used_count": cfg.num_experts_per_tok, "expert_gating_func": 4,  # SQRTSOFTPLUS
        "expert_feed_forward_length": cfg.moe_intermediate_size, "expert_shared_count": cfg.n_shared_experts,
        "attention.indexer.head_count": att.index_n_heads, "attention.indexer.key_length": att.index_head_dim,
        "attention.indexer.top_k": att.index_topk, "attention.output_group_count": att.o_groups,
        "attention.output_lora_rank": att.o_lora_rank, "hyper_connection.count": cfg.hc_mult,
        "hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters, "hash_layer_count": cfg.num_hash_layers,
        "embedding_length_out": cfg.hidden_size * cfg.hc_mult, "vocab_size": cfg.vocab_size,
    }
    for k, v in u32.items():
        w.add_uint32(f"{ARCH}.{k}", int(v))
    f32 = {
        "rope.freq_base": att.rope.theta, "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "expert_weights_scale": cfg.routed_scaling_factor,
        "attention.compress_rope_freq_base": att.compress_rope.theta, "hyper_connection.epsilon": cfg.hc_eps,
    }
    for k, v in f32.items():
        w.add_float32(f"{ARCH}.{k}", float(v))
    w.add_bool(f"{ARCH}.expert_weights_norm", bool(cfg.norm_topk_prob))
    # the release's list (the MTP block's entry included), as the converter copies it
    ratios = [int(r) for r in raw.get("compress_ratios", [a.compress_ratio for a in cfg.attention])]
    w.add_array(f"{ARCH}.attention.compress_ratios", ratios)
    for k in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
        w.add_key_value(f"{ARCH}.{k}", [float(cfg.swiglu_limit)] * n, GGUFValueType.ARRAY,
                        sub_type=GGUFValueType.FLOAT32)
    r = att.compress_rope
    if r.type == "yarn":
        w.add_string(f"{ARCH}.rope.scaling.type", "yarn")
        w.add_float32(f"{ARCH}.rope.scaling.factor", float(r.factor))
        w.add_uint32(f"{ARCH}.rope.scaling.original_context_length", int(r.original_max_position_embeddings))
        w.add_float32(f"{ARCH}.rope.scaling.yarn_beta_fast", float(r.beta_fast))
        w.add_float32(f"{ARCH}.rope.scaling.yarn_beta_slow", float(r.beta_slow))
    written: dict[str, str] = {}
    for name, tensor in tensors.items():
        ttype = _type_for(name, tensor, linear_type)
        if ttype == "I32":
            w.add_tensor(name, tensor.detach().to(torch.int32).contiguous().numpy())
            written[name] = ttype
            continue
        arr = tensor.detach().to(torch.float32).contiguous().numpy()
        if ttype in ggml.BLOCKS and arr.shape[-1] % ggml.BLOCKS[ttype][0]:
            raise QuantplugError(f"export: {name} rows of {arr.shape[-1]} values are not whole {ttype} blocks "
                                 f"of {ggml.BLOCKS[ttype][0]}; llama.cpp's deepseek4 converter writes it {ttype}")
        data = arr if ttype == "F32" else quantize(arr, GGMLQuantizationType[ttype])
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType[ttype])
        written[name] = ttype
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written

