"""Write a Quark-format MXFP4 checkpoint from a dense quantplug model.

Tensor names, dtypes, shapes, nibble order, scale encoding and config keys follow what
amd-quark 0.13 ``export_safetensors(custom_mode="quark")`` writes (see tests/data/vendor):
every nn.Linear but ``lm_head`` quantized, routed experts kept in the transformers 5 fused
layout in float (Quark does not quantize 3-D expert parameters).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from quantplug.layers.linear import QuantLinear
from quantplug.types import ExportResult
from safetensors.torch import save_file

from .scheme import quantize_mxfp4

WEIGHT_SPEC = {
    "block_size": None, "ch_axis": -1, "dtype": "fp4", "enable_buffer_reuse": False, "group_size": 32,
    "is_dynamic": False, "is_scale_quant": False, "max_input_numel": 4194304, "mx_element_dtype": None,
    "observer_cls": "PerBlockMXObserver", "qscheme": "per_group", "round_method": "half_even",
    "scale_calculation_mode": "even", "scale_format": "e8m0", "scale_type": "float", "symmetric": None,
    "zero_point_type": "int32",
}


def quark_config(exclude: list[str]) -> dict[str, Any]:
    return {
        "algo_config": None, "exclude": exclude,
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None},
        "global_quant_config": {"bias": None, "input_tensors": None, "output_tensors": None, "target_device": None,
                                "weight": dict(WEIGHT_SPEC)},
        "kv_cache_post_rope": False, "kv_cache_quant_config": {}, "layer_quant_config": {},
        "layer_type_quant_config": {}, "quant_method": "quark", "quant_mode": "eager_mode",
        "softmax_quant_spec": None, "version": "0.13",
    }


def export_quark(model: torch.nn.Module, model_config: Any, destination: Path,
                 options: Mapping[str, Any]) -> ExportResult:
    plan = model.quantplug_plan
    dest = Path(destination)
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    prefix = f"{plan.prefix}." if plan.prefix else ""
    exclude = [f"{prefix}lm_head"]
    linears = {m.qp_ckpt: m for m in model.modules() if isinstance(m, QuantLinear)}
    for ck, mod in linears.items():
        w = mod.scheme.dequantize(mod).float()
        if ck in exclude:
            tensors[f"{ck}.weight"] = w.contiguous()
        else:
            tensors[f"{ck}.weight"], tensors[f"{ck}.weight_scale"] = quantize_mxfp4(w)
    for pp in plan.params:
        mod = pp.module
        if isinstance(mod, QuantLinear) or ".experts." in pp.param:
            continue  # linears above; routed experts below, in the fused layout
        tensors[pp.sources[0][1].name] = getattr(mod, pp.local).detach().float().contiguous()
    for mod in model.modules():
        if type(mod).__name__ == "Experts":
            base = mod.gate_proj.qp_ckpt.rsplit(".", 1)[0]
            deq = {p: torch.stack([getattr(mod, p).scheme.dequantize(getattr(mod, p), e) for e in range(mod.n)])
                   for p in ("gate_proj", "up_proj", "down_proj")}
            tensors[f"{base}.gate_up_proj"] = torch.cat([deq["gate_proj"], deq["up_proj"]], dim=1).float().contiguous()
            tensors[f"{base}.down_proj"] = deq["down_proj"].float().contiguous()
    save_file(tensors, str(dest / "model.safetensors"))
    cfg = copy.deepcopy(plan.checkpoint.config)
    target = cfg["text_config"] if "text_config" in cfg and plan.model_config.is_wrapper else cfg
    target["quantization_config"] = quark_config(exclude)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return ExportResult(dest, "quark mxfp4 (safetensors)", (dest / "model.safetensors",))
