"""llama.cpp deepseek2 / deepseek32 tensor names <-> quantplug (Hugging Face) model names.

Source: gguf-py ``gguf/constants.py`` (MODEL_TENSORS[DEEPSEEK2], MODEL_TENSORS[DEEPSEEK32]) and
``tensor_mapping.py``, and llama.cpp's DeepSeek-V2/V3 and V3.2 converters (``conversion/deepseek.py``). Stacked tensors use the core's stacked names: routed
experts ``mlp.experts.{gate,up,down}_proj.weight`` [E, out, in] and split MLA
``self_attn.{k_b_proj,v_b_proj}.weight`` [n_head, kv_lora, nope] / [n_head, v, kv_lora].
"""

from __future__ import annotations

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


def model_to_gguf(model_config: Any) -> dict[str, str]:
    """Every model tensor name of this config (both MLA layouts; DeepSeek-V3.2's indexer where the
    config has one; the ``num_nextn_predict_layers`` MTP layers included) -> its GGUF name."""
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
