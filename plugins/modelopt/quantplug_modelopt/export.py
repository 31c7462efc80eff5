"""Write a ModelOpt-format checkpoint from a dense quantplug model (what ``export_hf_checkpoint``
of nvidia-modelopt 0.47 writes; see tests/data/vendor/modelopt_nvfp4_dsv3).

Every decoder-layer linear (attention, dense MLP, shared experts, routed experts per expert;
DeepSeek-V4's in the release's names, its compressors' ``wkv`` / ``wgate`` left float) is
quantized; ``lm_head``, the embedding and the routers stay float and are listed in
``exclude_modules`` by name, as ModelOpt lists them. ``weight_scale_2`` is shared as the max over
the pairs the deployed kernels fuse (gate / up, q_a / kv_a), as ModelOpt does. Options:

* ``algo``: ``W4A16_NVFP4`` (default: weight-only NVFP4, no activation scales), ``NVFP4`` or
  ``FP8`` (per tensor). The last two store an ``input_scale`` per layer, which ModelOpt
  calibrates: here it is ``input_amax / (6 * 448)`` (NVFP4) or ``input_amax / 448`` (FP8) with
  the option ``input_amax`` (default 16.0) standing in for a calibration.
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
                    r"o_proj|g_proj|gate_proj|up_proj|down_proj)\.weight$"
                    # DeepSeek-V4 in the release's names (attention, the indexer's wq_b, shared and routed
                    # experts); its compressors' wkv / wgate stay float, as the release stores them
                    r"|(^|\.)layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|"
                    r"ffn\.(shared_experts\.|experts\.\d+\.)?(w1|w2|w3))\.weight$")
#: float 2-D weights ModelOpt lists in exclude_modules: the router (DeepSeek-V4's ``ffn.gate``), and
#: DeepSeek-V4's compressor projections and indexer ``weights_proj`` (BF16 in its release)
ROUTER = re.compile(r"\.(mlp|ffn)\.gate\.weight$|(^|\.)layers\.\d+\.attn\.(indexer\.)?compressor\.(wkv|wgate)\.weight$"
                    r"|(^|\.)layers\.\d+\.attn\.indexer\.weights_proj\.weight$")
#: modules whose weight_scale_2 ModelOpt shares (the deployed kernels run each pair as one GEMM)
PAIRS = (("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))
ALGOS = ("W4A16_NVFP4", "NVFP4", "FP8")


def export_modelopt(model: torch.nn.Module, plan: Any, destination: Path, options: Mapping[str, Any]) -> ExportResult:
    algo, amax = options["algo"], options["input_amax"]  # declared in quantplug_options: checked, defaults filled
    dest = Path(destination)
    dest.mkdir(parents=True, exist_ok=True)
    state = dense_state(model)
    shared: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        for a, b in PAIRS:
            if LINEAR.search(name) and name.endswith(f".{a}.weight"):
                other = state.get(name[: -len(f"{a}.weight")] + f"{b}.weight")
                if other is not None:
                    s2 = torch.maximum(w.abs().amax(), other.abs().amax()).float() / (6 * 448)
                    shared[name] = shared[name[: -len(f"{a}.weight")] + f"{b}.weight"] = s2
    tensors: dict[str, torch.Tensor] = {}
    exclude: list[str] = []
    for name, w in state.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if LINEAR.search(name):
            if algo == "FP8":
                tensors[name], tensors[f"{module}.weight_scale"] = kernels.quantize_fp8(w)
                tensors[f"{module}.input_scale"] = torch.tensor(amax / 448, dtype=torch.float32)
                continue
            q, s, s2 = kernels.quantize_nvfp4(w, shared.get(name))
            tensors[name], tensors[f"{module}.weight_scale"], tensors[f"{module}.weight_scale_2"] = q, s, s2
            if algo == "NVFP4":
                tensors[f"{module}.input_scale"] = torch.tensor(amax / (6 * 448), dtype=torch.float32)
            continue
        if name.endswith("e_score_correction_bias"):
            tensors[name] = w.to(torch.float32).contiguous()
            continue
        tensors[name] = (w.to(torch.bfloat16) if w.is_floating_point() else w).contiguous()  # V4's tid2eid: ints
        if w.dim() == 2 and w.is_floating_point() and (
                ROUTER.search(name) or name.endswith(("lm_head.weight", "embed_tokens.weight"))
                or name in ("head.weight", "embed.weight")):  # DeepSeek-V4's head / embedding
            exclude.append(module)
    file = dest / "model.safetensors"
    save_file(tensors, str(file))
    quant: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": exclude}
    if algo != "FP8":
        quant["group_size"] = 16
    (dest / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}, indent=4))
    cfg = copy.deepcopy(plan.checkpoint.config)
    qc = {"quant_method": "modelopt", "quant_algo": algo, "ignore": exclude,
          "producer": {"name": "modelopt", "version": "0.47.0"}}
    target = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) and plan.model_config.is_wrapper else cfg
    target["quantization_config"] = qc
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return ExportResult(dest, f"modelopt {algo}", (file,))
