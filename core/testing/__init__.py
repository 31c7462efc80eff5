"""Tiny DeepSeek-V3 / Kimi checkpoints, and the backend conformance kit.

The helpers here write real safetensors checkpoints (hub or transformers-5 expert layout,
optional Kimi wrapper, both rope spellings, optional shards with an index) from random weights,
with no dependency beyond torch and safetensors.

:class:`BackendConformance` (``quantplug.testing.conformance``) is the kit a backend's own test
suite subclasses; ``quantplug.testing.plugin`` is the pytest plugin (``pytest11`` entry point)
with the kit's fixtures; :func:`hf_logits` (``quantplug.testing.reference``) is the transformers
reference. Those three import pytest / transformers, so they load on first use only.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

_PLAIN_FLOATS = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
_LAZY = {"ArchitectureConformance": "arch_conformance", "BackendConformance": "conformance", "hf_logits": "reference",
         "rel_err": "reference"}


def __getattr__(name: str) -> Any:
    """``ArchitectureConformance``, ``BackendConformance``, ``hf_logits``, ``rel_err``: imported on first use
    (pytest, transformers)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A small DeepSeek-V3 config.json (transformers 5 spelling), yarn rope, 3 layers, 8 experts."""
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
        "rope_interleave": True, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "scoring_func": "sigmoid",
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                            "mscale": 1.0, "mscale_all_dim": 1.0},
    }
    cfg.update(overrides)
    return cfg


def hub_rope_spelling(cfg: dict[str, Any], key: str = "type") -> dict[str, Any]:
    """The same config with hub spelling: rope_theta + rope_scaling {type|rope_type: ...}."""
    out = copy.deepcopy(cfg)
    params = dict(out.pop("rope_parameters"))
    out["rope_theta"] = params.pop("rope_theta")
    rtype = params.pop("rope_type")
    if rtype != "default":
        out["rope_scaling"] = {key: rtype, **params}
    return out


def mla_shapes(a: str, h: int, nh: int, ql: int | None, kl: int, nope: int, rope: int, vd: int,
               gate: bool) -> dict[str, tuple[int, ...]]:
    """The tensors of one MLA layer ``a`` (``...self_attn``) and their shapes: q (LoRA or plain
    ``q_proj``), the compressed KV, dense ``kv_b_proj``, the optional output gate, ``o_proj``."""
    out: dict[str, tuple[int, ...]] = {}
    if ql is None:
        out[f"{a}.q_proj.weight"] = (nh * (nope + rope), h)
    else:
        out[f"{a}.q_a_proj.weight"] = (ql, h)
        out[f"{a}.q_a_layernorm.weight"] = (ql,)
        out[f"{a}.q_b_proj.weight"] = (nh * (nope + rope), ql)
    out[f"{a}.kv_a_proj_with_mqa.weight"] = (kl + rope, h)
    out[f"{a}.kv_a_layernorm.weight"] = (kl,)
    out[f"{a}.kv_b_proj.weight"] = (nh * (nope + vd), kl)
    if gate:
        out[f"{a}.g_proj.weight"] = (nh * vd, h)
    out[f"{a}.o_proj.weight"] = (h, nh * vd)
    return out


def text_names(cfg: Mapping[str, Any], layout: str = "hub", mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of a text model with this config (names relative to the root).

    ``mtp``: also the ``num_nextn_predict_layers`` multi-token-prediction layers as DeepSeek-V3's
    release stores them (``model.layers.{num_hidden_layers + k}``: a decoder layer plus ``enorm``,
    ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm`` and the copies ``embed_tokens`` /
    ``shared_head.head``)."""
    h, v, nh = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kl = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    e, mi, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (v, h)
    n = cfg["num_hidden_layers"]
    for i in range(n + (int(cfg.get("num_nextn_predict_layers") or 0) if mtp else 0)):
        b = f"model.layers.{i}"
        if i >= n:
            out[f"{b}.embed_tokens.weight"] = (v, h)
            out[f"{b}.enorm.weight"] = (h,)
            out[f"{b}.hnorm.weight"] = (h,)
            out[f"{b}.eh_proj.weight"] = (h, 2 * h)
            out[f"{b}.shared_head.norm.weight"] = (h,)
            out[f"{b}.shared_head.head.weight"] = (v, h)
        out[f"{b}.input_layernorm.weight"] = (h,)
        out[f"{b}.post_attention_layernorm.weight"] = (h,)
        a = f"{b}.self_attn"
        out.update(mla_shapes(a, h, nh, ql, kl, nope, rope, vd, bool(cfg.get("mla_use_output_gate"))))
        if is_dsa(cfg):  # DeepSeek-V3.2's lightning indexer
            ih, idim = int(cfg.get("index_n_heads", 64)), int(cfg.get("index_head_dim", 128))
            out[f"{a}.indexer.wq_b.weight"] = (ih * idim, int(ql or 0))
            out[f"{a}.indexer.wk.weight"] = (idim, h)
            out[f"{a}.indexer.k_norm.weight"] = (idim,)
            out[f"{a}.indexer.k_norm.bias"] = (idim,)
            out[f"{a}.indexer.weights_proj.weight"] = (ih, h)
        m = f"{b}.mlp"
        if i < cfg["first_k_dense_replace"] or not e:
            for p, shp in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                out[f"{m}.{p}.weight"] = shp
            continue
        out[f"{m}.gate.weight"] = (e, h)
        out[f"{m}.gate.e_score_correction_bias"] = (e,)
        si = mi * cfg.get("n_shared_experts", 0)
        if si:
            for p, shp in (("gate_proj", (si, h)), ("up_proj", (si, h)), ("down_proj", (h, si))):
                out[f"{m}.shared_experts.{p}.weight"] = shp
        if layout == "fused":
            out[f"{m}.experts.gate_up_proj"] = (e, 2 * mi, h)
            out[f"{m}.experts.down_proj"] = (e, h, mi)
        else:
            for k in range(e):
                for p, shp in (("gate_proj", (mi, h)), ("up_proj", (mi, h)), ("down_proj", (h, mi))):
                    out[f"{m}.experts.{k}.{p}.weight"] = shp
    return out


def is_dsa(cfg: Mapping[str, Any]) -> bool:
    """Whether a text config is DeepSeek-V3.2's (DSA: attention layers carry a lightning indexer)."""
    return "DeepseekV32ForCausalLM" in (cfg.get("architectures") or ()) or cfg.get("model_type") == "deepseek_v32"


def random_state(cfg: Mapping[str, Any], seed: int = 0, layout: str = "hub", mtp: bool = False) -> dict[str, torch.Tensor]:
    """Random weights (std 0.02 like transformers' init; norms near 1; router bias random).
    ``mtp``: with the config's MTP layers (:func:`text_names`), drawn after every other tensor
    (the other weights are those of ``mtp=False``)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    names = text_names(cfg, layout)
    if mtp:
        names.update((k, s) for k, s in text_names(cfg, layout, mtp=True).items() if k not in names)
    for name, shape in names.items():
        if name.endswith("norm.weight") or "layernorm" in name:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            out[name] = 0.05 * torch.randn(shape, generator=g)
        else:
            out[name] = 0.02 * torch.randn(shape, generator=g) * (3.0 if "embed" in name else 1.0)
    return out


def to_layout(state: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Convert routed experts between the hub (per-expert) and fused (transformers 5) layouts
    (:func:`quantplug.api.convert_expert_layout`)."""
    from ..api import convert_expert_layout

    return convert_expert_layout(state, layout)


def wrap_kimi(cfg: dict[str, Any], state: Mapping[str, torch.Tensor], arch: str = "KimiK25ForConditionalGeneration",
              vision: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Kimi-K2.5-style wrapper: text config under text_config, weights under language_model."""
    model_type = {"KimiK25ForConditionalGeneration": "kimi_k25", "KimiK3ForConditionalGeneration": "kimi_k3"}[arch]
    text = {k: v for k, v in cfg.items() if k != "architectures"}
    text["model_type"] = "kimi_k2"
    wrapped = {"architectures": [arch], "model_type": model_type, "text_config": text}
    tensors = {f"language_model.{k}": v for k, v in state.items()}
    if vision:
        tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
        tensors["mm_projector.proj.0.weight"] = torch.zeros(cfg["hidden_size"], 8)
    return wrapped, tensors


def write_checkpoint(path: str | Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                     shards: int = 1, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and safetensors weights (``shards`` > 1: with model.safetensors.index.json)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    # dtype= converts plain floats only: FP8 payloads, e8m0 scales and integer tensors are data
    # in their own encoding and are written exactly as given
    items = {k: (v.to(dtype) if dtype is not None and v.dtype in _PLAIN_FLOATS else v).contiguous()
             for k, v in tensors.items()}
    if shards <= 1:
        save_file(items, str(root / "model.safetensors"))
        return root
    names = sorted(items)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: items[n] for n in part}, str(root / fname))
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root
