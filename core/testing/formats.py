"""Tiny checkpoints in the bundled backends' formats, written without those backends.

A backend must not claim another format's checkpoint (two claims are an
``AmbiguousBackendError`` for every user who has both installed). These fixtures carry what
each format is recognised by, with tensors of the right names, dtypes and shapes:

* ``quark``: config.json ``quantization_config.quant_method = "quark"``, MXFP4 ``weight`` U8
  [out, in/2] + ``weight_scale`` U8 [out, in/32];
* ``modelslim``: ``quant_model_description.json`` beside config.json, W8A8_DYNAMIC int8
  weights with ``weight_scale`` / ``weight_offset``;
* ``expert_pack``: a llama.cpp ``deepseek2`` GGUF (F32 tensors, legacy ``attn_kv_b``), or for a
  DeepSeek-V3.2 config a ``deepseek32`` GGUF as llama.cpp's converter writes it (split
  ``attn_k_b`` / ``attn_v_b``, ``blk.N.indexer.*``, the ``attention.indexer.*`` keys);
* ``compressed_tensors``: ``quant_method = "compressed-tensors"``, pack-quantized int4 group 32
  (``weight_packed`` I32, ``weight_scale``, ``weight_shape``);
* ``fp8``: DeepSeek's native ``quant_method = "fp8"``, ``weight`` F8_E4M3 + ``weight_scale_inv``
  F32 per [128, 128] block; for a DeepSeek-V4 config (``model_type: deepseek_v4``) its release
  layout: ``weight`` F8_E4M3 + ``scale`` F8_E8M0 on the attention projections, the indexer's
  ``wq_b`` and the shared expert, routed experts FP4 (``weight`` I8, two E2M1 codes per byte, low
  nibble first, + ``scale`` F8_E8M0 per 32 inputs), ``expert_dtype: "fp4"``.

Keys are the entry-point names of the bundled backends that read each format.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from . import write_checkpoint

#: linear projections of the text model (what the formats quantize), DeepSeek-V3.2's indexer wq_b / wk
#: and the MTP layers' ``eh_proj`` included; router, norms, embeddings stay float. The Kimi family's
#: too (module names, not DeepSeek's assumed): the MoE block ``block_sparse_moe`` with per-expert
#: ``w1`` / ``w3`` / ``w2`` and the latent ``routed_expert_down_proj`` / ``routed_expert_up_proj``;
#: KDA's ``k_proj`` / ``v_proj`` / ``f_a_proj`` / ``f_b_proj`` / ``b_proj`` / ``g_a_proj`` /
#: ``g_b_proj``. KDA's convolutions, ``dt_bias`` / ``A_log`` and the attention-residual
#: ``*_res_proj`` [1, hidden] are float parameters, never matched
LINEAR = re.compile(r"(^|\.)model\.layers\.\d+\.((self_attn|mlp|block_sparse_moe)\.(.+\.)?"
                    r"(q_a_proj|q_b_proj|q_proj|k_proj|v_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|g_proj|gate_proj|"
                    r"up_proj|down_proj|f_a_proj|f_b_proj|b_proj|g_a_proj|g_b_proj|routed_expert_down_proj|"
                    r"routed_expert_up_proj|w1|w2|w3|indexer\.wq_b|indexer\.wk)"
                    r"|eh_proj)\.weight$")


def _linears(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [n for n, t in state.items() if LINEAR.search(n) and t.dim() == 2]


def _with_qc(config: Mapping[str, Any], qc: dict[str, Any]) -> dict[str, Any]:
    cfg = copy.deepcopy(dict(config))
    target = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    target["quantization_config"] = qc
    return cfg


def quark(path: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> Path:
    out = dict(state)
    g = torch.Generator().manual_seed(1)
    for n in _linears(state):
        o, i = state[n].shape
        if i % 32:
            continue
        out[n] = torch.randint(0, 256, (o, i // 2), generator=g, dtype=torch.uint8)
        out[n.removesuffix("weight") + "weight_scale"] = torch.full((o, i // 32), 120, dtype=torch.uint8)
    weight = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "scale_format": "e8m0",
              "is_dynamic": False}
    qc = {"quant_method": "quark", "global_quant_config": {"weight": weight, "input_tensors": None,
                                                         "output_tensors": None, "bias": None},
          "layer_quant_config": {}, "layer_type_quant_config": {},
          # Quark exports leave lm_head unquantized (and this writer does not quantize it), under the
          # name the checkpoint stores it by (language_model.lm_head in a Kimi wrapper)
          "exclude": [n.removesuffix(".weight") for n in state if n.split(".")[-2:] == ["lm_head", "weight"]],
          "export": {"weight_format": "real_quantized", "pack_method": "reorder"}, "version": "0.13"}
    return write_checkpoint(path, _with_qc(config, qc), out)


def modelslim(path: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> Path:
    out: dict[str, torch.Tensor] = {}
    desc: dict[str, Any] = {"model_quant_type": "W8A8_DYNAMIC", "version": "1.0.0"}
    linears = set(_linears(state))
    for n, t in state.items():
        if n not in linears:
            out[n], desc[n] = t, "FLOAT"
            continue
        scale = (t.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8).float()
        base = n.removesuffix("weight")
        out[n] = torch.round(t / scale).clamp(-128, 127).to(torch.int8)
        out[base + "weight_scale"], out[base + "weight_offset"] = scale, torch.zeros_like(scale)
        for k in ("weight", "weight_scale", "weight_offset"):
            desc[base + k] = "W8A8_DYNAMIC"
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(dict(config), indent=2))
    (root / "quant_model_description.json").write_text(json.dumps(desc, indent=2))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in out.items()}, str(root / "quant_model_weight_w8a8.safetensors"))
    return root


_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.q_proj": "attn_q", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    # multi-token-prediction layers (gguf-py MODEL_TENSOR.NEXTN_*)
    "eh_proj": "nextn.eh_proj", "embed_tokens": "nextn.embed_tokens", "enorm": "nextn.enorm", "hnorm": "nextn.hnorm",
    "shared_head.head": "nextn.shared_head_head", "shared_head.norm": "nextn.shared_head_norm",
    # DeepSeek-V3.2's lightning indexer (arch deepseek32; gguf-py MODEL_TENSOR.INDEXER_*)
    "self_attn.indexer.wq_b": "indexer.attn_q_b", "self_attn.indexer.wk": "indexer.attn_k",
    "self_attn.indexer.k_norm": "indexer.k_norm", "self_attn.indexer.weights_proj": "indexer.proj",
}


def gguf(path: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> Path:
    """A llama.cpp deepseek2 GGUF (F32, one ``attn_kv_b`` per layer, stacked ``ffn_*_exps``); for a
    DeepSeek-V3.2 config (:func:`quantplug.testing.is_dsa`) a ``deepseek32`` GGUF as llama.cpp's
    converter writes it (``conversion/deepseek.py`` ``DeepseekV32Model``): ``kv_b`` split into
    ``attn_k_b`` [n_head, kv_lora, nope] / ``attn_v_b`` [n_head, v, kv_lora] (llama.cpp's deepseek32
    loader requires them), ``blk.N.indexer.{attn_q_b, attn_k, k_norm (weight, bias), proj}``, the
    MTP block kept, ``attention.indexer.{head_count, key_length, top_k}``."""
    from gguf import GGUFWriter

    from . import is_dsa

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    text = config.get("text_config", config)
    dsa = is_dsa(text)
    (root / "config.json").write_text(json.dumps(dict(config), indent=2))
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        n = name.removeprefix("language_model.")
        if n == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = t
        elif n == "model.norm.weight":
            tensors["output_norm.weight"] = t
        elif n == "lm_head.weight":
            tensors["output.weight"] = t
        elif m := re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", n):
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = t
        elif dsa and (m := re.match(r"^model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight$", n)):
            heads, nope, v = (int(text[k]) for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim"))
            kv = t.reshape(heads, nope + v, t.shape[-1])
            tensors[f"blk.{m.group(1)}.attn_k_b.weight"] = kv[:, :nope].transpose(1, 2)
            tensors[f"blk.{m.group(1)}.attn_v_b.weight"] = kv[:, nope:]
        elif m := re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias|e_score_correction_bias)$", n):
            if m.group(3) == "e_score_correction_bias":
                tensors[f"blk.{m.group(1)}.exp_probs_b.bias"] = t
            elif m.group(2) in _GGUF_LAYER:
                tensors[f"blk.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{m.group(3)}"] = t
    for (layer, proj), per in experts.items():
        tensors[f"blk.{layer}.ffn_{proj}_exps.weight"] = torch.stack([per[k] for k in sorted(per)])
    w = GGUFWriter(str(root / "model.gguf"), "deepseek32" if dsa else "deepseek2")
    nextn = int(text.get("num_nextn_predict_layers") or 0)
    mtp = nextn and any(n.startswith(f"blk.{int(text['num_hidden_layers'])}.") for n in tensors)
    # llama.cpp counts MTP blocks in block_count and says how many there are
    w.add_block_count(int(text["num_hidden_layers"]) + (nextn if mtp else 0))
    if mtp:
        w.add_nextn_predict_layers(nextn)
    w.add_embedding_length(int(text["hidden_size"]))
    w.add_head_count(int(text["num_attention_heads"]))
    # DeepSeek's config names, or Kimi-Linear's (whose KDA tensors have no deepseek2 name: left out,
    # so a reader of deepseek2 files refuses the checkpoint at plan time naming them)
    w.add_expert_count(int(text.get("n_routed_experts", text.get("num_experts", 0))))
    w.add_expert_used_count(int(text.get("num_experts_per_tok", text.get("num_experts_per_token", 0))))
    w.add_leading_dense_block_count(int(text.get("first_k_dense_replace", 0)))
    if dsa:  # transformers' DeepseekV32Config defaults where the config leaves them out
        w.add_indexer_head_count(int(text.get("index_n_heads", 64)))
        w.add_indexer_key_length(int(text.get("index_head_dim", 128)))
        w.add_indexer_top_k(int(text.get("index_topk", 2048)))
    for name, t in tensors.items():
        w.add_tensor(name, t.detach().float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return root


def compressed_tensors(path: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> Path:
    out = dict(state)
    g = torch.Generator().manual_seed(2)
    for n in _linears(state):
        o, i = state[n].shape
        if i % 32:
            continue
        base = n.removesuffix("weight")
        del out[n]
        out[base + "weight_packed"] = torch.randint(-(2 ** 31), 2 ** 31 - 1, (o, i // 8), generator=g,
                                                    dtype=torch.int32)
        out[base + "weight_scale"] = torch.full((o, i // 32), 0.002, dtype=torch.bfloat16)
        out[base + "weight_shape"] = torch.tensor([o, i], dtype=torch.int64)
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
               "dynamic": False, "actorder": None, "observer": "minmax"}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                        "output_activations": None, "format": "pack-quantized"}},
          "ignore": ["lm_head"], "kv_cache_scheme": None}
    return write_checkpoint(path, _with_qc(config, qc), out)


#: DeepSeek-V4's FP8 linears and routed experts (release names)
V4_FP8 = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$")
V4_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_E2M1_STEPS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # midpoints of 0, .5, 1, 1.5, 2, 3, 4, 6


def _pow2(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The exponent e (int64) of the smallest 2^e with amax / 2^e <= top (0 for amax 0)."""
    return torch.ceil(torch.log2(torch.where(amax > 0, amax / top, torch.ones_like(amax)))).long()


def _fp8_v4(path: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> Path:
    out = dict(state)
    for n, t in state.items():
        t = t.float()
        if V4_FP8.search(n):  # one power-of-two scale per matrix, written per 128x128 block
            e = _pow2(t.abs().max(), 448.0)
            out[n] = (t / 2.0 ** e).to(torch.float8_e4m3fn)
            grid = (math.ceil(t.shape[0] / 128), math.ceil(t.shape[1] / 128))
            out[n.removesuffix("weight") + "scale"] = torch.full(grid, int(e) + 127, dtype=torch.uint8).view(
                torch.float8_e8m0fnu)
        elif V4_EXPERT.search(n):  # E2M1, one power-of-two scale per 32 inputs of a row
            g = t.view(t.shape[0], -1, 32)
            e = _pow2(g.abs().amax(-1), 6.0)
            v = g / torch.exp2(e.float())[..., None]
            code = torch.searchsorted(_E2M1_STEPS, v.abs()) | ((v < 0).long() << 3)
            code = code.flatten(1)
            out[n] = (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8).view(torch.int8)
            out[n.removesuffix("weight") + "scale"] = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
        elif n.endswith("tid2eid"):
            out[n] = t.long()
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
          "scale_fmt": "ue8m0"}
    return write_checkpoint(path, {**_with_qc(config, qc), "expert_dtype": "fp4"}, out)


def fp8(path: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> Path:
    if config.get("model_type") == "deepseek_v4":
        return _fp8_v4(path, config, state)
    out = dict(state)
    for n in _linears(state):
        t = state[n].float()
        o, i = t.shape
        scale = torch.full((math.ceil(o / 128), math.ceil(i / 128)), float(t.abs().max()) / 448 or 1.0)
        out[n] = (t / scale[0, 0]).to(torch.float8_e4m3fn)
        out[n.removesuffix("weight") + "weight_scale_inv"] = scale
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    return write_checkpoint(path, _with_qc(config, qc), out)


#: bundled backend (entry-point name) -> writer of a tiny checkpoint in its format
FORMATS: dict[str, Callable[[Path, Mapping[str, Any], Mapping[str, torch.Tensor]], Path]] = {
    "quark": quark, "modelslim": modelslim, "expert_pack": gguf, "compressed_tensors": compressed_tensors,
    "fp8": fp8,
}


def write_format_fixtures(root: str | Path, config: Mapping[str, Any],
                          state: Mapping[str, torch.Tensor]) -> dict[str, Path]:
    """One tiny checkpoint per bundled format under ``root`` (see :data:`FORMATS`), written from the
    dense ``config`` / ``state`` (names as stored)."""
    base = Path(root)
    return {name: write(base / name, config, state) for name, write in FORMATS.items()}
