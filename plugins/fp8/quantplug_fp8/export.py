"""Write a DeepSeek-native block-FP8 checkpoint from a loaded quantplug model.

Layout of the official release: every decoder-layer linear (``q_a_proj``, ``q_b_proj`` /
``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``, dense / shared / per-expert
``gate_proj`` ``up_proj`` ``down_proj``, DeepSeek-V3.2's indexer ``wq_b`` / ``wk``) as ``weight`` F8_E4M3 + ``weight_scale_inv`` F32
[ceil(out/128), ceil(in/128)]; embeddings, lm_head, norms, the router weight and the indexer's
``weights_proj`` / ``k_norm`` BF16 (as DeepSeek-V3.2's release stores them), the
router's ``e_score_correction_bias`` F32; config.json gains DeepSeek's ``quantization_config``
(at the top level and, for a Kimi wrapper, inside ``text_config`` too).

DeepSeek-V4 (``model_type: deepseek_v4``) is written in its release's layout and names: the FP8
linears (``attn.wq_a / wq_b / wkv / wo_a / wo_b``, ``attn.indexer.wq_b``, ``ffn.shared_experts.w1-3``, and
the MTP block's ``e_proj`` / ``h_proj``; the MTP block ``mtp.K`` as a layer)
as ``weight`` F8_E4M3 + ``scale`` F8_E8M0 per [128, 128] block (``scale_fmt: ue8m0``); the routed
experts as FP4 (export option ``expert_dtype=fp4``, the default: ``weight`` I8 packed E2M1 +
``scale`` F8_E8M0 per 32) or the same FP8 blocks (``expert_dtype=fp8``), ``expert_dtype`` written at
config.json's top level as the release has it; ``attn_sink``, ``ape``, ``hc_*`` and ``gate.bias``
float32, ``tid2eid`` int64, everything else BF16. Power-of-two scales make the export of an
already-quantized model give back the same values.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from quantplug.api import ExportResult, dense_state
from safetensors.torch import save_file

from . import kernels

LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|"
                    r"o_proj|g_proj|gate_proj|up_proj|down_proj|indexer\.wq_b|indexer\.wk)\.weight$")
BLOCK = (128, 128)
#: DeepSeek-V4's FP8 linears, release names
#: the main layers' and the MTP blocks' (``mtp.K``: its block, ``e_proj`` and ``h_proj``) FP8 linears
V4_LINEAR = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                       r"|e_proj|h_proj)\.weight$")
V4_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
V4_F32 = re.compile(r"(^|\.)(attn_sink|ape|hc_[a-z]+_(fn|base|scale)|gate\.bias)$")


def quant_config(block: tuple[int, int] = BLOCK) -> dict[str, Any]:
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(block)}


def export_fp8(model: torch.nn.Module, plan: Any, destination: Path, options: Mapping[str, Any]) -> ExportResult:
    dest = Path(destination)
    dest.mkdir(parents=True, exist_ok=True)
    bn, bk = options.get("weight_block_size", BLOCK)
    block = (int(bn), int(bk))
    if plan.checkpoint.config.get("model_type") == "deepseek_v4":
        return _export_v4(model, plan, dest, block, str(options.get("expert_dtype", "fp4")))
    tensors: dict[str, torch.Tensor] = {}
    for name, w in dense_state(model).items():
        if LINEAR.search(name):
            q, s = kernels.quantize(w, block)
            tensors[name] = q
            tensors[name[: -len("weight")] + "weight_scale_inv"] = s
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = w.to(torch.float32).contiguous()
        else:
            tensors[name] = w.to(torch.bfloat16).contiguous()
    wfile = dest / "model.safetensors"
    save_file(tensors, str(wfile))
    cfg = copy.deepcopy(plan.checkpoint.config)
    qc = quant_config(block)
    cfg["quantization_config"] = qc
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"]["quantization_config"] = dict(qc)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return ExportResult(dest, f"fp8 block {list(block)} (DeepSeek native)", (wfile,))


def _export_v4(model: torch.nn.Module, plan: Any, dest: Path, block: tuple[int, int],
               expert_dtype: str) -> ExportResult:
    tensors: dict[str, torch.Tensor] = {}
    for name, w in dense_state(model).items():
        base = name[: -len(".weight")]
        if V4_LINEAR.search(name) or (V4_EXPERT.search(name) and expert_dtype == "fp8"):
            tensors[name], tensors[f"{base}.scale"] = kernels.quantize_e8m0(w, block)
        elif V4_EXPERT.search(name):
            tensors[name], tensors[f"{base}.scale"] = kernels.quantize_fp4(w)
        elif not w.is_floating_point() or name.endswith("gate.tid2eid"):  # dense_state gives it as floats
            tensors[name] = w.to(torch.int64).contiguous()
        elif V4_F32.search(name):
            tensors[name] = w.to(torch.float32).contiguous()
        else:
            tensors[name] = w.to(torch.bfloat16).contiguous()
    wfile = dest / "model.safetensors"
    save_file(tensors, str(wfile))
    cfg = copy.deepcopy(plan.checkpoint.config)
    cfg["quantization_config"] = {**quant_config(block), "scale_fmt": "ue8m0"}
    cfg["expert_dtype"] = expert_dtype
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return ExportResult(dest, f"DeepSeek-V4 release layout: fp8 block {list(block)} e8m0 scales, {expert_dtype} "
                              "routed experts", (wfile,))
