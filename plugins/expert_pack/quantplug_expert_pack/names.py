"""llama.cpp deepseek2 / deepseek32 / kimi-linear / kimi-k3 tensor names <-> quantplug (Hugging
Face) model names.

Source: gguf-py ``gguf/constants.py`` (MODEL_TENSORS[DEEPSEEK2], [DEEPSEEK32], [KIMI_LINEAR],
[KIMI_K3]) and ``tensor_mapping.py``, and llama.cpp's converters (``conversion/deepseek.py``,
``conversion/kimi_linear.py``, ``conversion/kimi_k3.py``; llama-cpp-python 0.3.36's tree).
Stacked tensors use the core's stacked names: routed experts ``mlp.experts.{gate,up,down}_proj.weight``
(Kimi: ``block_sparse_moe.experts.*``) [E, out, in] and split MLA
``self_attn.{k_b_proj,v_b_proj}.weight`` [n_head, kv_lora, nope] / [n_head, v, kv_lora].

Kimi tensors the converter transforms beyond renaming map to the model's alternative forms:
``ssm_a`` holds ``-exp(A_log)`` (model name ``self_attn.A``, :class:`quantplug.models.kimi.KDA`
takes it folded), ``attn_res_score`` / ``ffn_res_score`` / ``output_res_score`` hold
``res_norm * res_proj`` (model names ``*_res_score.weight``, :class:`~quantplug.models.kimi.ResScore`),
``ssm_conv1d_*`` are reshaped to [1, channels, 1, width] (the same values), ``dt_bias`` is
``ssm_dt.bias``; K3's ``g_proj`` is ``ssm_g`` in a KDA layer and ``attn_gate`` in an MLA layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: global tensors: model name -> GGUF name
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

#: per-block tensors: model name under model.layers.{i}. -> GGUF name under blk.{i}.
ATTENTION = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",               # q_lora_rank null (V2-Lite)
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",         # legacy (pre-split) files
    "self_attn.k_b_proj.weight": "attn_k_b.weight",
    "self_attn.v_b_proj.weight": "attn_v_b.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    # Kimi-K3 MLA output gate (mla_use_output_gate): llama.cpp's generic gate name LLM_TENSOR_ATTN_GATE
    "self_attn.g_proj.weight": "attn_gate.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
DENSE_MLP = {
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
MOE = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


#: DeepSeek-V3.2's lightning indexer (arch ``deepseek32``; gguf-py MODEL_TENSOR.INDEXER_*), every layer
#: with an indexer, the MTP layers included. The converter keeps ``indexer.proj`` (weights_proj) and
#: the LayerNorm's weight and bias in F32; ``attn_q_b`` / ``attn_k`` take the file's linear type
INDEXER = {
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
}


#: the multi-token-prediction layers' own tensors (model.layers.{num_hidden_layers + k}.) -> GGUF name
#: under blk.{i}. (gguf-py MODEL_TENSOR.NEXTN_*; the block itself uses the decoder-layer names)
NEXTN = {
    "eh_proj.weight": "nextn.eh_proj.weight",
    "embed_tokens.weight": "nextn.embed_tokens.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "shared_head.head.weight": "nextn.shared_head_head.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}


#: Kimi-Linear / K3 KDA layers (``self_attn.``; conversion/kimi_linear.py, kimi_k3.py)
KDA = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_conv1d.weight": "ssm_conv1d_q.weight",
    "self_attn.k_conv1d.weight": "ssm_conv1d_k.weight",
    "self_attn.v_conv1d.weight": "ssm_conv1d_v.weight",
    "self_attn.f_a_proj.weight": "ssm_f_a.weight",
    "self_attn.f_b_proj.weight": "ssm_f_b.weight",
    "self_attn.dt_bias": "ssm_dt.bias",
    "self_attn.A": "ssm_a",                                   # -exp(A_log), folded by the converter
    "self_attn.b_proj.weight": "ssm_beta.weight",
    "self_attn.g_a_proj.weight": "ssm_g_a.weight",            # Kimi-Linear's low-rank output gate
    "self_attn.g_b_proj.weight": "ssm_g_b.weight",
    "self_attn.g_proj.weight": "ssm_g.weight",                # K3's full-rank output gate
    "self_attn.o_norm.weight": "ssm_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
}
#: Kimi MoE layers (``block_sparse_moe.``), K3's latent projections included
KIMI_MOE = {f"block_sparse_moe.{k[len('mlp.'):]}": v for k, v in MOE.items()} | {
    "block_sparse_moe.routed_expert_down_proj.weight": "ffn_routed_down.weight",
    "block_sparse_moe.routed_expert_norm.weight": "ffn_routed_norm.weight",
    "block_sparse_moe.routed_expert_up_proj.weight": "ffn_routed_up.weight",
}
#: K3's attention residuals, fused by the converter (norm * proj)
RES = {
    "self_attention_res_score.weight": "attn_res_score.weight",
    "mlp_res_score.weight": "ffn_res_score.weight",
}
KIMI_GLOBAL = {**GLOBAL, "model.output_attn_res_score.weight": "output_res_score.weight"}
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def _kimi(model_config: Any) -> dict[str, str]:
    out = dict(KIMI_GLOBAL)
    for i in range(model_config.num_hidden_layers):
        table = {k: ATTENTION[k] for k in _NORMS}
        table.update(KDA if model_config.is_kda(i) else ATTENTION)
        table.update(KIMI_MOE if model_config.is_moe_layer(i) else DENSE_MLP)
        table.update(RES)
        for model_name, gguf_name in table.items():
            out[f"model.layers.{i}.{model_name}"] = f"blk.{i}.{gguf_name}"
    return out


#: DeepSeek-V4 (arch ``deepseek4``; gguf-py MODEL_TENSORS[DEEPSEEK4], llama.cpp's converter
#: ``conversion/deepseek.py`` ``DeepseekV4Model._map_dsv4_tensor_name``): the release's names (no
#: ``model.`` prefix) -> GGUF names, every tensor renamed only. Global tensors:
V4_GLOBAL = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "head.weight": "output.weight",
    "hc_head_fn": "output_hc_fn.weight",
    "hc_head_base": "output_hc_base.weight",
    "hc_head_scale": "output_hc_scale.weight",
}
#: every V4 layer (``layers.L.`` -> ``blk.L.``); routed experts under the core's stacked names
#: (``ffn.experts.gate_proj.weight`` [E, out, in]), which the converter writes from the FP4
#: ``w1`` / ``w3`` / ``w2`` pairs as MXFP4 ``ffn_{gate,up,down}_exps``
V4_LAYER = {
    "hc_attn_fn": "hc_attn_fn.weight",
    "hc_attn_base": "hc_attn_base.weight",
    "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight",
    "hc_ffn_base": "hc_ffn_base.weight",
    "hc_ffn_scale": "hc_ffn_scale.weight",
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn.attn_sink": "attn_sinks.weight",
    "attn.wq_a.weight": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wq_b.weight": "attn_q_b.weight",
    "attn.wkv.weight": "attn_kv.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight",
    "ffn.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "ffn.experts.up_proj.weight": "ffn_up_exps.weight",
    "ffn.experts.down_proj.weight": "ffn_down_exps.weight",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
}
#: hash-routed layers (L < num_hash_layers: ``tid2eid``, I32 in the GGUF) / learned ones (``gate.bias``)
V4_HASH = {"ffn.gate.tid2eid": "ffn_gate_tid2eid.weight"}
V4_LEARNED = {"ffn.gate.bias": "exp_probs_b.bias"}
#: compressed layers (ratio > 0): the main compressor
V4_COMPRESSOR = {
    "attn.compressor.ape": "attn_compressor_ape.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.norm.weight": "attn_compressor_norm.weight",
}
#: CSA layers (ratio 4): the lightning indexer
V4_INDEXER = {
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
}


def _v4(model_config: Any) -> dict[str, str]:
    out = dict(V4_GLOBAL)
    for i, att in enumerate(model_config.attention):
        table = dict(V4_LAYER)
        table.update(V4_HASH if i < model_config.num_hash_layers else V4_LEARNED)
        if att.compress_ratio:
            table.update(V4_COMPRESSOR)
        if att.kind == "csa":
            table.update(V4_INDEXER)
        for model_name, gguf_name in table.items():
            out[f"layers.{i}.{model_name}"] = f"blk.{i}.{gguf_name}"
    return out


def model_to_gguf(model_config: Any) -> dict[str, str]:
    """Every model tensor name of this config (both MLA layouts; DeepSeek-V3.2's indexer where the
    config has one; the ``num_nextn_predict_layers`` MTP layers included; Kimi-Linear / K3: KDA or
    MLA per layer; DeepSeek-V4: its release names, per layer kind) -> its GGUF name."""
    if hasattr(model_config, "kda_layers"):
        return _kimi(model_config)
    if hasattr(model_config, "hc_mult"):
        return _v4(model_config)
    out = dict(GLOBAL)
    n = model_config.num_hidden_layers
    for i in range(n + int(getattr(model_config, "num_nextn_predict_layers", 0) or 0)):
        table = dict(ATTENTION)
        table.update(MOE if model_config.is_moe_layer(i) else DENSE_MLP)
        if model_config.has_indexer:
            table.update(INDEXER)
        if i >= n:
            table.update(NEXTN)
        for model_name, gguf_name in table.items():
            out[f"model.layers.{i}.{model_name}"] = f"blk.{i}.{gguf_name}"
    return out


#: the model's per-expert projection names under each MoE module (the core's ``Experts`` names:
#: DeepSeek's hub layout under ``mlp``; Kimi-Linear / K3 store ``w1`` / ``w3`` / ``w2`` under
#: ``block_sparse_moe``, DeepSeek-V4 under ``ffn``)
PER_EXPERT = {
    "mlp": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
    "block_sparse_moe": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    "ffn": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},  # DeepSeek-V4's release names
}
_STACKED = re.compile(r"^((?:model\.)?layers\.\d+\.(mlp|block_sparse_moe|ffn)\.experts)\."
                      r"(gate_proj|up_proj|down_proj)\.weight$")
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def pack_names(names: Mapping[str, str], pack: Any) -> dict[str, str]:
    """Model name -> stored name of every payload of version-1 expert pack ``pack``, for the MoE
    layers ``names`` (:func:`model_to_gguf`) maps a stacked ``blk.L.ffn_*_exps`` tensor to:
    ``model.layers.3.mlp.experts.17.down_proj.weight`` -> ``blk.3.ffn_down_exps.weight[17]``
    (:func:`~.pack.stored_name`), the names under which the model's ``Experts`` asks for one
    tensor per expert. A pack layer of no such MoE layer keeps its stored names (unexpected
    tensors in the plan, or skipped with the model's multi-token-prediction layers)."""
    from .pack import stored_name

    out: dict[str, str] = {}
    for model_name, stored in names.items():
        m, g = _STACKED.match(model_name), _EXPS.match(stored)
        if m is None or g is None or not pack.has_layer(int(g.group(1))):
            continue
        base, proj = m.group(1), m.group(3)
        own = PER_EXPERT[m.group(2)][proj]
        layer = int(g.group(1))
        for e in range(pack.n_experts):
            out[f"{base}.{e}.{own}.weight"] = stored_name(layer, proj, e)
    return out
