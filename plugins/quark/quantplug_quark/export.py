"""Write a Quark-format MXFP4 checkpoint from a dense quantplug model.

Tensor names, dtypes, shapes, nibble order, scale encoding and config keys follow what
amd-quark 0.13 ``export_safetensors(custom_mode="quark")`` writes (see tests/data/vendor):
every nn.Linear but ``lm_head`` quantized, routed experts kept in the transformers 5 fused
layout in float (Quark does not quantize 3-D expert parameters).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from quantplug.api import ExportResult, LoadPlan, convert_expert_layout, dense_state, named_linears
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


#: the export option ``float_dtype``: the dtype unquantized tensors are written in (amd-quark keeps
#: the source model's); the router's correction bias stays float32, as DeepSeek-V3 stores it
#: DeepSeek-V4 linears its release keeps in BF16 (prefix-less names): the LM head, the compressors' wkv / wgate
V4_FLOAT = re.compile(r"^head$|(^|\.)layers\.\d+\.attn\.(indexer\.)?compressor\.(wkv|wgate)$")

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_quark(model: torch.nn.Module, plan: LoadPlan, destination: Path,
                 options: Mapping[str, Any]) -> ExportResult:
    dest = Path(destination)
    dest.mkdir(parents=True, exist_ok=True)
    prefix = f"{plan.prefix}." if plan.prefix else ""
    linears = {name for name, _ in named_linears(model)}
    # DeepSeek-V4 (release names): its LM head ``head`` and compressors' wkv / wgate, BF16 in the release
    # (amd-quark lists lm_head whether or not the model has one; DeepSeek-V4's is ``head``)
    exclude = [*([f"{prefix}lm_head"] if f"{prefix}head" not in linears else []),
               *sorted(n for n in linears if V4_FLOAT.search(n))]
    # routed experts stay float, in the transformers 5 fused layout (as amd-quark writes them)
    state = convert_expert_layout(dense_state(model), "fused")
    fdt = FLOAT_DTYPES[options.get("float_dtype", "float32")]
    tensors: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if module in linears and module not in exclude:
            tensors[name], tensors[f"{module}.weight_scale"] = quantize_mxfp4(w)
        elif w.is_floating_point() and not name.endswith("e_score_correction_bias"):
            tensors[name] = w.to(fdt)
        else:
            tensors[name] = w
    save_file(tensors, str(dest / "model.safetensors"))
    cfg = copy.deepcopy(plan.checkpoint.config)
    target = cfg["text_config"] if "text_config" in cfg and plan.model_config.is_wrapper else cfg
    target["quantization_config"] = quark_config(exclude)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return ExportResult(dest, "quark mxfp4 (safetensors)", (dest / "model.safetensors",))
