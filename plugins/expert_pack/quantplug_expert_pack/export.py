"""Write llama.cpp deepseek2 GGUFs (deepseek32 for DeepSeek-V3.2) with gguf-py's GGUFWriter and quantizer.

:func:`write_gguf` takes dense weights under model (Hugging Face) names, splits each MLA
``kv_b_proj`` into ``attn_k_b`` / ``attn_v_b`` as llama.cpp's converter does (convert_hf_to_gguf.py: kv_b
viewed [n_head, nope+v, kv_lora], split on dim 1, k_b transposed to [n_head, kv_lora, nope]),
stacks routed experts into ``ffn_*_exps`` [E, out, in], quantizes each linear with
``gguf.quants.quantize`` in the type asked for, and writes the deepseek2 metadata llama.cpp's
converter writes. A config with DeepSeek-V3.2's lightning indexer gets arch ``deepseek32`` and
its ``attention.indexer.*`` keys (as ``DeepseekV32Model`` in llama.cpp's ``conversion/deepseek.py``;
``indexer.proj`` stays F32); MTP blocks, where written, are counted in ``block_count`` with
``nextn_predict_layers``. Used by the ``quantplug_export`` hook (demo), the tests and the benchmarks.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from quantplug.api import ExportResult, LoadPlan, ModelConfig, QuantplugError, dense_state, ggml

from .names import model_to_gguf

#: types gguf-py can quantize to (the K-quants are dequantize-only in Python)
QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")
#: tensors that stay F32 whatever the default type (norms, router, its bias, V3.2's indexer.proj
#: and k_norm bias: llama.cpp's converter forces INDEXER_PROJ and every bias to F32)
_F32 = re.compile(r"(_norm\.weight|ffn_gate_inp\.weight|\.bias|indexer\.proj\.weight)$")


def split_kv_b(kv_b: torch.Tensor, n_head: int, nope: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [n_head*(nope+v), kv_lora] -> k_b [n_head, kv_lora, nope], v_b [n_head, v, kv_lora]."""
    kv = kv_b.reshape(n_head, nope + v, -1)
    return kv[:, :nope, :].transpose(1, 2).contiguous(), kv[:, nope:, :].contiguous()


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`split_kv_b`: rebuild a dense kv_b from split K/V."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])


def gguf_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig, split_kv: bool = True) -> dict[str, torch.Tensor]:
    """Dense model-named weights (hub or stacked experts) -> GGUF-named float tensors."""
    names = model_to_gguf(cfg)
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
            continue
        if name.endswith(".self_attn.kv_b_proj.weight") and split_kv:
            base = name[: -len(".kv_b_proj.weight")]
            k_b, v_b = split_kv_b(t, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim)
            out[names[f"{base}.k_b_proj.weight"]] = k_b
            out[names[f"{base}.v_b_proj.weight"]] = v_b
            continue
        if name not in names:
            raise QuantplugError(f"export: tensor {name} has no llama.cpp {_arch(cfg)} name")
        out[names[name]] = t
    for (base, proj), per in experts.items():
        out[names[f"{base}.{proj}.weight"]] = torch.stack([per[k] for k in sorted(per)])
    return out


def _arch(cfg: ModelConfig) -> str:
    """llama.cpp's architecture name for this config."""
    return "deepseek32" if cfg.has_indexer else "deepseek2"


def _type_for(gguf_name: str, t: torch.Tensor, default: str, types: Mapping[str, str]) -> str:
    if _F32.search(gguf_name) or t.dim() == 1:
        return "F32"
    if gguf_name == "token_embd.weight":
        return types.get("token_embd", "F16")
    base = re.sub(r"^blk\.\d+\.", "", gguf_name).removesuffix(".weight")
    return types.get(base, default)


def write_gguf(path: str | Path, tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, *,
               default_type: str = "Q8_0", types: Mapping[str, str] | None = None,
               vocab: int | None = None, raw: Mapping[str, tuple[np.ndarray, str]] | None = None) -> dict[str, str]:
    """Write a deepseek2 (V3.2: deepseek32) GGUF; returns {gguf tensor name: ggml type written}.

    ``tensors`` are GGUF-named float tensors (:func:`gguf_state`); ``types`` overrides the type by
    GGUF base name (``attn_k_b``, ``ffn_down_exps``, ``output``, ``token_embd``). A row length
    that is not a multiple of the type's block falls back to F16, as llama-quantize falls back.
    ``raw`` adds pre-quantized tensors (bytes [.., row_bytes], ggml type) as they are, e.g. K-quant
    blocks that gguf-py cannot produce. ``vocab`` writes a ``tokenizer.ggml.tokens`` array of
    that many entries (real files carry 129k-160k).
    """
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    types = dict(types or {})
    for t in [default_type, *types.values()]:
        if t not in QUANTIZABLE:
            raise QuantplugError(f"export: gguf-py cannot quantize to {t}; choose one of {', '.join(QUANTIZABLE)} "
                                 "(K-quants are dequantize-only in gguf-py; pass them through raw=)")
    arch = _arch(cfg)
    w = GGUFWriter(str(path), arch)
    w.add_name("quantplug export")
    mtp = [i for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
           if f"blk.{i}.nextn.eh_proj.weight" in tensors]
    w.add_block_count(cfg.num_hidden_layers + len(mtp))
    if mtp:
        w.add_nextn_predict_layers(len(mtp))
    if arch == "deepseek32":
        w.add_indexer_head_count(cfg.index_n_heads)
        w.add_indexer_key_length(cfg.index_head_dim)
        w.add_indexer_top_k(cfg.index_topk)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)  # MLA convention in llama.cpp's converter
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    from gguf.constants import ExpertGatingFuncType

    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)  # = 2
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    if cfg.rope.type == "yarn":
        from gguf.constants import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope.factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position_embeddings)
        if cfg.rope.mscale_all_dim:  # the converter's 0.1 * mscale_all_dim ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX])
            w.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope.mscale_all_dim)
    if vocab:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"<tok{i}>" for i in range(vocab)])
        w.add_token_types([1] * vocab)
    written: dict[str, str] = {}
    for name, tensor in tensors.items():
        ttype = _type_for(name, tensor, default_type, types)
        arr = tensor.detach().to(torch.float32).contiguous().numpy()
        if ttype in ggml.BLOCKS and arr.shape[-1] % ggml.BLOCKS[ttype][0]:
            ttype = "F16"
        if ttype == "F32":
            data = arr
        elif ttype == "F16":
            data = arr.astype(np.float16)
        else:
            data = quantize(arr, GGMLQuantizationType[ttype])
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType[ttype])
        written[name] = ttype
    for name, (blocks, ttype) in (raw or {}).items():
        w.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType[ttype])
        written[name] = ttype
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def model_state(model: torch.nn.Module, plan: LoadPlan) -> dict[str, torch.Tensor]:
    """Dense float weights of a loaded quantplug model under model names (wrapper prefix removed)."""
    cut = len(plan.prefix) + 1 if plan.prefix else 0
    return {name[cut:]: t for name, t in dense_state(model).items()}


def export_gguf(model: torch.nn.Module, plan: LoadPlan, destination: Path,
                options: Mapping[str, Any]) -> list[ExportResult]:
    """The export hook: a split-K/V GGUF, and (``pack``, default true) a copy with an expert pack."""
    from .build import build_pack

    model_config = plan.model_config
    dtype = str(options.get("type", "Q8_0"))
    dest = Path(destination)
    plain = dest / "gguf"
    plain.mkdir(parents=True, exist_ok=True)
    cfg = dict(plan.checkpoint.config)
    cfg.pop("quantization_config", None)
    (plain / "config.json").write_text(json.dumps(cfg, indent=2))
    if hasattr(model_config, "hc_mult"):  # DeepSeek-V4: llama.cpp's deepseek4 layout (export_v4)
        from .export_v4 import gguf_state_v4, write_gguf_v4

        write_gguf_v4(plain / "model.gguf", gguf_state_v4(model_state(model, plan), model_config), model_config,
                      linear_type=dtype)
        what = "experts MXFP4, FP8-class linears" if dtype != "F32" else "all"
        results = [ExportResult(plain, f"gguf deepseek4 ({what} {dtype})", (plain / "model.gguf",))]
    else:
        results = _export_deepseek2(model, plan, plain, dtype, options)
    if options.get("pack", True):
        packed = dest / "gguf-pack"
        shutil.copytree(plain, packed)
        build_pack(packed, progress=False)
        results.append(ExportResult(packed, f"gguf {dtype} + expert pack (SSD experts)",
                                    tuple(sorted(packed.iterdir()))))
    return results


def _export_deepseek2(model: torch.nn.Module, plan: LoadPlan, plain: Path, dtype: str,
                      options: Mapping[str, Any]) -> list[ExportResult]:
    """deepseek2 / deepseek32: split K/V (``split_kv``, default) with attn_k_b Q4_0, or a legacy attn_kv_b."""
    split = bool(options.get("split_kv", True))
    tensors = gguf_state(model_state(model, plan), plan.model_config, split_kv=split)
    write_gguf(plain / "model.gguf", tensors, plan.model_config, default_type=dtype,
               types={"attn_k_b": "Q4_0"} if dtype != "F32" else {})
    # the label says what was written: attn_k_b exists only split, and stays F32 in an F32 export
    layout = ("split K/V, attn_k_b Q4_0" if dtype != "F32" else "split K/V") if split else "attn_kv_b"
    return [ExportResult(plain, f"gguf {dtype} ({layout})", (plain / "model.gguf",))]
