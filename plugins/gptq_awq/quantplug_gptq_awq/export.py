"""Write a GPTQ or AWQ checkpoint from a dense quantplug model (round-to-nearest, what auto-round's
``iters=0`` exports store; see tests/data/vendor/README.md for the vendor-made fixtures).

Every decoder-layer linear (attention, dense MLP, shared experts, routed experts per expert;
DeepSeek-V4's in the release's names, ``layers.L.attn.wq_a`` ... ``layers.L.ffn.experts.E.w1``, its
compressors' ``wkv`` / ``wgate`` left float as the release stores them) is quantized to int4 with group scales and zero points (``sym=False``, the default) or symmetric
(zero 8); ``lm_head``, embeddings and routers stay float. Options: ``group_size`` (default 32),
``sym``. GPTQ: ``qzeros`` stored as zero - 1 (checkpoint_format ``gptq``), ``g_idx`` = k // group;
AWQ: the interleaved word order and zeros as is.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from quantplug.api import ConfigError, ExportResult, dense_state
from safetensors.torch import save_file

from . import kernels

LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|"
                    r"o_proj|gate_proj|up_proj|down_proj)\.weight$"
                    # DeepSeek-V4 in the release's names: attention (the indexer's wq_b too), shared and
                    # routed experts; its compressors' wkv / wgate, the indexer's weights_proj and the
                    # router stay float (BF16 in the release)
                    r"|(^|\.)layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|"
                    r"ffn\.(shared_experts\.|experts\.\d+\.)?(w1|w2|w3))\.weight$")


def quantize(w: torch.Tensor, group: int, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense [out, in] -> (q int [in, out] in 0..15, zeros int [G, out], scales F16 [G, out]); GPTQ v1
    stores zero - 1 in 4 bits, so its zeros are kept >= 1 (``min_zero``)."""
    out_f, in_f = w.shape
    if in_f % group:
        raise ConfigError(f"GPTQ / AWQ export: in_features {in_f} is not a multiple of group_size {group}")
    g = w.float().t().reshape(in_f // group, group, out_f)  # [G, group, out]
    if sym:
        scale = (g.abs().amax(1) / 7.5).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(min_zero, 15)
    scale = scale.to(torch.float16)
    q = torch.clamp(torch.round(g / scale.float().unsqueeze(1)) + zero.unsqueeze(1), 0, 15)
    return q.reshape(in_f, out_f).to(torch.int32), zero.to(torch.int32), scale


def export_int(model: torch.nn.Module, plan: Any, destination: Path, options: Mapping[str, Any],
               packing: str) -> ExportResult:
    group, sym = options["group_size"], options["sym"]  # declared (hooks.EXPORT_OPTIONS): checked, defaults filled
    dest = Path(destination)
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in dense_state(model).items():
        if not LINEAR.search(name):
            keep = name.endswith("e_score_correction_bias") or not w.is_floating_point()  # V4's tid2eid: integers
            tensors[name] = (w if keep else w.to(torch.bfloat16)).contiguous()
            continue
        base = name[: -len(".weight")]
        q, z, s = quantize(w, group, sym, 1 if packing == "gptq" else 0)
        tensors[f"{base}.scales"] = s.contiguous()
        if packing == "gptq":
            tensors[f"{base}.qweight"] = kernels.pack_gptq_weight(q, 4)
            tensors[f"{base}.qzeros"] = kernels.pack_last(z - 1, 4)
            tensors[f"{base}.g_idx"] = (torch.arange(q.shape[0]) // group).to(torch.int32)
        else:
            tensors[f"{base}.qweight"] = kernels.pack_last(q, 4, kernels.AWQ_ORDER)
            tensors[f"{base}.qzeros"] = kernels.pack_last(z, 4, kernels.AWQ_ORDER)
    file = dest / "model.safetensors"
    save_file(tensors, str(file))
    if packing == "gptq":
        qc: dict[str, Any] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": False,
                              "checkpoint_format": "gptq", "lm_head": False}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": not sym, "version": "gemm",
              "modules_to_not_convert": None}
    cfg = copy.deepcopy(plan.checkpoint.config)
    cfg["quantization_config"] = qc
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"]["quantization_config"] = copy.deepcopy(qc)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return ExportResult(dest, f"{packing} int4 group {group}{' sym' if sym else ''}", (file,))
