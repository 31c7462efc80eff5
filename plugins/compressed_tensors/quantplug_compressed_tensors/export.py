"""Write a compressed-tensors W4A16 checkpoint (Kimi-K2.5's recipe) from a dense quantplug model.

What llmcompressor 0.14 ``model_free_ptq(scheme="W4A16")`` with Kimi's ignore list writes (see
tests/data/vendor/ct_w4a16_experts_dsv3): routed experts int4, symmetric, group 32, packed
``weight_packed`` int32 [out, in/8] + ``weight_scale`` [out, in/32] (the weight's dtype) +
``weight_shape`` int64 [2]; every other tensor as it was. Quantization follows
compressed-tensors: scale = max|w| / 7.5 per group (its int4 range 15 / 2), zero scales -> eps,
q = clamp(round(w / scale), -8, 7).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from quantplug.api import TORCH_DTYPES, ExportResult, QuantplugError, dense_state, named_linears
from safetensors.torch import save_file

from .kernels import pack_rows

GROUP = 32
#: a routed expert's projection: DeepSeek's ``mlp.experts.{k}.{gate,up,down}_proj``, the Kimi family's
#: ``block_sparse_moe.experts.{k}.w{1,3,2}``, DeepSeek-V4's ``layers.L.ffn.experts.{k}.w{1,3,2}``
EXPERT = re.compile(r"\.(mlp|block_sparse_moe|ffn)\.experts\.\d+\.((gate|up|down)_proj|w[123])\.weight$")
#: llmcompressor's Kimi-K2 ignore list as model_free_ptq writes it (prefix-less, verbatim)
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
          "re:.*mlp\\.gate$", "model.embed_tokens"]


def w4a16_config(ignore: list[str] | None = None) -> dict[str, Any]:
    weights: dict[str, Any] = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP, "num_bits": 4,
               "observer": None, "observer_kwargs": {}, "scale_dtype": None, "strategy": "group",
               "symmetric": True, "type": "int", "zp_dtype": None}
    return {"config_groups": {"group_0": {"format": "pack-quantized", "input_activations": None,
                                          "output_activations": None, "targets": ["Linear"], "weights": weights}},
            "format": "pack-quantized", "global_compression_ratio": None,
            "ignore": list(IGNORE if ignore is None else ignore), "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "transform_config": {},
            "version": "0.19.0"}


def quantize_int4_group(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [out, in] -> (weight_packed int32 [out, in/8], weight_scale [out, in/32] in ``dtype``)."""
    out_f, in_f = w.shape
    if in_f % GROUP:
        raise QuantplugError(f"W4A16 export: in_features {in_f} is not a multiple of the group size {GROUP}")
    g = w.to(torch.float32).view(out_f, in_f // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 7.5).to(dtype)
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(dtype).eps), scale)
    q = torch.clamp(torch.round(g / scale.float().unsqueeze(-1)), -8, 7).view(out_f, in_f).to(torch.int8)
    return pack_rows(q, 4), scale.contiguous()


def export_w4a16(model: torch.nn.Module, plan: Any, destination: Path, options: Mapping[str, Any]) -> ExportResult:
    dest = Path(destination)
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    state = dense_state(model)
    for name, w in state.items():
        if not w.is_floating_point():  # integer tensors as they are (DeepSeek-V4's tid2eid)
            tensors[name] = w.contiguous()
            continue
        stored = plan.checkpoint.get(name)
        dtype = TORCH_DTYPES[stored.dtype] if stored is not None and stored.is_float else torch.float32
        if EXPERT.search(name):
            base = name[: -len(".weight")]
            tensors[f"{base}.weight_packed"], tensors[f"{base}.weight_scale"] = quantize_int4_group(w, dtype)
            tensors[f"{base}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        else:
            tensors[name] = w.to(dtype).contiguous()
    file = dest / "model.safetensors"
    save_file(tensors, str(file))
    cfg = copy.deepcopy(plan.checkpoint.config)
    # Kimi's list, plus by name every other linear it misses (the Kimi family's KDA is under self_attn,
    # but its latent routed_expert_down_proj / routed_expert_up_proj are not): the export quantizes
    # routed experts only, and a linear the list leaves to "Linear" would be read as int4
    rules = [(e[3:], True) if e.startswith("re:") else (e, False) for e in IGNORE]
    leftover = [n for n, _ in named_linears(model) if not EXPERT.search(f"{n}.weight") and not any(
        re.match(r, n) or re.match(r, n.removeprefix("language_model.")) if rx else
        r in (n, n.removeprefix("language_model.")) for r, rx in rules)]
    # the list's exact names where the model has them (DeepSeek-V4's release names its head ``head``:
    # an entry naming no module is a plan problem, a misspelling to the reader)
    kept = [e for e in IGNORE if e.startswith("re:") or any(n.removeprefix("language_model.").startswith(f"{e}.")
                                                            for n in state)]
    qc = w4a16_config(kept + sorted(leftover))
    cfg["quantization_config"] = qc
    if isinstance(cfg.get("text_config"), dict):  # Kimi releases repeat it inside text_config
        cfg["text_config"]["quantization_config"] = copy.deepcopy(qc)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return ExportResult(dest, "compressed-tensors W4A16 (experts g32)", (file,))
