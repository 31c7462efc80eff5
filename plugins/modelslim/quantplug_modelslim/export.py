"""Write msModelSlim-format checkpoints from a dense quantplug model (min-max calibration).

Names, dtypes and description keys follow msmodelslim 26.1's ascendV1 save (see
tests/data/vendor/modelslim_w8a8_dsv3): ``quant_model_weight_<type>.safetensors`` plus
``quant_model_description.json``. Weights are symmetric per channel (weight_offset 0).
Recipes: "w8a8" (attention W8A8 static, MLPs W8A8_DYNAMIC, routed experts FLOAT, as the
fixture), "w4a8" (Kimi recipe: attention W8A8 static except kv_b_proj FLOAT, dense MLP
W8A8_DYNAMIC, routed experts W4A8_DYNAMIC).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from quantplug.api import ExportResult, LoadPlan, dense_state, named_linears
from safetensors.torch import save_file

from .schemes import pack_int4_rows


def _sym(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = 2 ** (bits - 1) - 1
    scale = (w.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-12)
    return torch.clamp(torch.round(w / scale), -qmax - 1, qmax).to(torch.int8), scale.float()


def _calibrate(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per-linear input (min, max) over the calibration batches."""
    ranges: dict[str, tuple[float, float]] = {}
    hooks = []
    for name, m in named_linears(model):
        def hook(mod, args, name=name):
            x = args[0]
            lo, hi = ranges.get(name, (0.0, 0.0))
            ranges[name] = (min(lo, float(x.min())), max(hi, float(x.max())))
        hooks.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    return ranges


#: the export option ``float_dtype``: the dtype FLOAT tensors are written in (msmodelslim keeps the
#: source model's: a release quantized from a bfloat16 model stores them as bfloat16); the router's
#: correction bias stays float32, as DeepSeek-V3 stores it
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_modelslim(model: torch.nn.Module, plan: LoadPlan, destination: Path,
                     options: Mapping[str, Any]) -> list[ExportResult]:
    recipes = options.get("recipes", ["w8a8", "w4a8"])
    vocab = plan.model_config.vocab_size
    batches = options.get("calibration") or [torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(7))]
    ranges = _calibrate(model, batches)
    state = dense_state(model)
    linears = {name for name, _ in named_linears(model)}
    fdt = FLOAT_DTYPES[options.get("float_dtype", "float32")]
    out = []
    for recipe in recipes:
        dest = Path(destination) / recipe
        out.append(_write(state, linears, plan, dest, recipe, ranges, fdt))
    return out


#: a routed expert's projection weight (DeepSeek's ``mlp.experts.{k}.*_proj``, the Kimi family's
#: ``block_sparse_moe.experts.{k}.w{1,2,3}``, DeepSeek-V4's ``layers.L.ffn.experts.{k}.w{1,2,3}``)
_EXPERT = re.compile(r"\.(mlp|block_sparse_moe|ffn)\.experts\.\d+\.[^.]+\.weight$")


#: DeepSeek-V4 linears its release keeps in BF16 (the LM head ``head``, the compressors' ``wkv`` / ``wgate``)
_V4_FLOAT = re.compile(r"^head$|(^|\.)layers\.\d+\.attn\.(indexer\.)?compressor\.(wkv|wgate)$")
#: DeepSeek-V4's attention projections (release names): W8A8 as DeepSeek-V3's self_attn
_V4_ATTN = re.compile(r"(^|\.)layers\.\d+\.attn\.")


def _linear_type(name: str, recipe: str) -> str:
    if name.endswith("lm_head") or _V4_FLOAT.search(name):
        return "FLOAT"
    if ".self_attn." in name or _V4_ATTN.search(name):
        return "FLOAT" if recipe == "w4a8" and name.endswith("kv_b_proj") else "W8A8"
    return "W8A8_DYNAMIC"


def _write(state: Mapping[str, torch.Tensor], linears: set[str], plan: LoadPlan, dest: Path, recipe: str,
           ranges: dict[str, tuple[float, float]], float_dtype: torch.dtype = torch.float32) -> ExportResult:
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    desc: dict[str, Any] = {"model_quant_type": "W8A8", "version": "1.0.0"}

    def put(name: str, t: torch.Tensor, typ: str) -> None:
        if typ == "FLOAT" and t.is_floating_point() and not name.endswith("e_score_correction_bias"):
            t = t.to(float_dtype)  # msmodelslim saves FLOAT tensors in the source model's dtype
        tensors[name] = t.contiguous()
        desc[name] = typ

    for name, w in state.items():
        ck = name.removesuffix(".weight")
        if ck in linears:
            typ = _linear_type(ck, recipe)
            if typ == "FLOAT":
                put(name, w, typ)
                continue
            wq, ws = _sym(w, 8)
            put(name, wq, typ)
            put(f"{ck}.weight_scale", ws, typ)
            put(f"{ck}.weight_offset", torch.zeros_like(ws), typ)
            if typ == "W8A8":
                lo, hi = ranges.get(ck, (-1.0, 1.0))
                lo, hi = min(lo, 0.0), max(hi, 0.0)
                s = max((hi - lo) / 255.0, 1e-8)
                o = round(-128 - lo / s)
                put(f"{ck}.input_scale", torch.tensor([s], dtype=torch.float32), typ)
                put(f"{ck}.input_offset", torch.tensor([float(o)], dtype=torch.float32), typ)
                put(f"{ck}.quant_bias", torch.round(-wq.float().sum(-1) * o).to(torch.int32), typ)
                deq = (torch.tensor(s, dtype=torch.float32) * ws[:, 0]).to(torch.float32)
                put(f"{ck}.deq_scale", deq.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, typ)
        elif _EXPERT.search(name) and recipe == "w4a8":
            wq, ws = _sym(w, 4)
            put(name, pack_int4_rows(wq), "W4A8_DYNAMIC")
            put(f"{ck}.weight_scale", ws, "W4A8_DYNAMIC")
            put(f"{ck}.weight_offset", torch.zeros_like(ws), "W4A8_DYNAMIC")
            put(f"{ck}.scale_bias", torch.zeros_like(ws), "W4A8_DYNAMIC")
        else:
            put(name, w, "FLOAT")
    wfile = dest / "quant_model_weight_w8a8.safetensors"
    save_file(tensors, str(wfile))
    (dest / "quant_model_description.json").write_text(json.dumps(desc, indent=2))
    (dest / "config.json").write_text(json.dumps(copy.deepcopy(plan.checkpoint.config), indent=2))
    label = {"w8a8": "modelslim W8A8 + W8A8_DYNAMIC", "w4a8": "modelslim W4A8_DYNAMIC experts, FLOAT kv_b"}[recipe]
    return ExportResult(dest, label, (wfile,))
