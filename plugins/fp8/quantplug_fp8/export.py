"""Write a DeepSeek-native block-FP8 checkpoint from a loaded quantplug model.

Layout of the official release: every decoder-layer linear (``q_a_proj``, ``q_b_proj`` /
``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``, dense / shared / per-expert
``gate_proj`` ``up_proj`` ``down_proj``, DeepSeek-V3.2's indexer ``wq_b`` / ``wk``) as ``weight`` F8_E4M3 + ``weight_scale_inv`` F32
[ceil(out/128), ceil(in/128)]; embeddings, lm_head, norms, the router weight and the indexer's
``weights_proj`` / ``k_norm`` BF16 (as DeepSeek-V3.2's release stores them), the
router's ``e_score_correction_bias`` F32; config.json gains DeepSeek's ``quantization_config``
(at the top level and, for a Kimi wrapper, inside ``text_config`` too).
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


def quant_config(block: tuple[int, int] = BLOCK) -> dict[str, Any]:
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(block)}


def export_fp8(model: torch.nn.Module, plan: Any, destination: Path, options: Mapping[str, Any]) -> ExportResult:
    dest = Path(destination)
    dest.mkdir(parents=True, exist_ok=True)
    bn, bk = options.get("weight_block_size", BLOCK)
    block = (int(bn), int(bk))
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
