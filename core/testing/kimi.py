"""Tiny Kimi-Linear and released Kimi-K3 checkpoints (configs, random weights, writers).

Everything here follows docs/architectures/kimi.md (Kimi-Linear, Kimi-K3): the config
field names of the release (``num_experts``, ``linear_attn_config`` with **1-based** layer lists, ...),
the release tensor names and shapes (``block_sparse_moe.experts.E.w1/w2/w3``, separate
``{q,k,v}_conv1d``, ``f_a_proj`` / ``f_b_proj`` / ``dt_bias`` / ``A_log`` on ``self_attn``), and for
K3 the ``language_model.`` prefix, the attention-residual tensors, the MLA output gate, the
full-rank KDA output gate and the latent MoE.

The random weights are scaled so that activations stay O(1) through the stack (linears with std
``1/sqrt(fan_in)``, norms ``1 ± 0.1``, embeddings with std 1, decays close to but below 1): logits are
informative, routing differs between tokens, the depth softmax of the attention residuals is far from
uniform, and float32 comparisons at 1e-5 relative mean something.

Only torch and safetensors are imported at module level; :func:`kimi_linear_hf_checkpoint` imports
transformers (5.24 has ``KimiLinearForCausalLM``) when called.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import mla_shapes, write_checkpoint

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import KimiLinearForCausalLM

__all__ = [
    "RELEASE_FP32",
    "hf_to_release",
    "kimi_k3_config",
    "kimi_k3_state",
    "kimi_linear_config",
    "kimi_linear_hf_checkpoint",
    "kimi_linear_state",
    "kimi_text_shapes",
    "release_dtypes",
    "release_to_hf",
    "write_kimi_checkpoint",
]

#: Tensors the K3 release stores in float32 (ARCHITECTURES C2): the KDA short-conv weights, ``dt_bias``
#: and ``A_log``; every other tensor is bf16 (routed experts aside, which the release packs as MXFP4).
RELEASE_FP32 = re.compile(r"\.(?:[qkv]_conv1d\.weight|dt_bias|A_log)$")

_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _layer_lists(n_layers: int, every: int, last: bool) -> dict[str, list[int]]:
    """1-based ``full_attn_layers`` (every ``every``-th layer, plus the last one if ``last``) and
    ``kda_layers`` (the others)."""
    full = [i for i in range(1, n_layers + 1) if i % every == 0]
    if last and n_layers not in full:
        full.append(n_layers)
    return {"kda_layers": [i for i in range(1, n_layers + 1) if i not in full], "full_attn_layers": full}


def _finish(cfg: dict[str, Any], overrides: Mapping[str, Any], every: int, last: bool) -> dict[str, Any]:
    """Apply ``overrides`` (``linear_attn_config`` is merged key by key), derive the layer lists from
    ``num_hidden_layers`` unless given, and the special token ids from ``vocab_size`` unless given."""
    over = dict(overrides)
    lin_over = dict(over.pop("linear_attn_config", None) or {})
    cfg.update(over)
    lin = dict(cfg["linear_attn_config"])
    lin.update(_layer_lists(int(cfg["num_hidden_layers"]), every, last))
    lin.update(lin_over)
    cfg["linear_attn_config"] = lin
    v = int(cfg["vocab_size"])
    for k, default in zip(_TOKEN_IDS, (v - 1, v - 3, v - 2)):
        cfg.setdefault(k, default)
    return cfg


def kimi_linear_config(**overrides: Any) -> dict[str, Any]:
    """A tiny Kimi-Linear ``config.json`` (release / transformers 5.24 ``KimiLinearConfig`` spelling).

    4 layers: KDA at 1-based layers 1 and 3, MLA (NoPE, plain ``q_proj``) at 2 and 4; layer 0 is the
    dense MLP, layers 1..3 MoE with 8 experts, top-2, one shared expert. Widths that are a matmul inner
    dimension are multiples of 32 (hidden 64, KDA 2 heads x 32, kv_lora_rank 32, experts 32, dense 96).

    ``overrides`` replace top-level fields; ``linear_attn_config`` is merged into the default one. The
    layer lists follow ``num_hidden_layers`` (MLA at every second 1-based layer) unless given, and the
    special token ids follow ``vocab_size`` (transformers rejects ids outside the vocabulary).
    """
    cfg: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "mla_use_nope": True, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4},
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0, "model_max_length": 4096,
    }
    return _finish(cfg, overrides, every=2, last=False)


def kimi_k3_config(**text_overrides: Any) -> dict[str, Any]:
    """A tiny released-Kimi-K3 ``config.json``: ``KimiK3ForConditionalGeneration`` / ``kimi_k3`` at the
    top, the model under ``text_config`` (``kimi_linear`` / ``KimiLinearForCausalLM``) with the K3
    fields of ARCHITECTURES C1.

    5 layers, MLA at 1-based layers 4 and 5 (K3's "every 4th plus the last"), KDA at 1..3;
    ``attn_res_block_size`` 2, so layers 0, 2 and 4 are attention-residual write layers; latent MoE
    (latent 32 < hidden 64) with the latent RMSNorm; SiTU (4.0 / 25.0); MLA with q-LoRA and the output
    gate; KDA with the full-rank output gate and the bounded forget gate (``gate_lower_bound`` -5.0);
    2 shared experts. ``text_overrides`` apply to ``text_config`` as in :func:`kimi_linear_config`
    (the MLA lists follow ``num_hidden_layers``: every 4th 1-based layer plus the last).
    """
    text = kimi_linear_config()
    for k in (*_TOKEN_IDS, "linear_attn_config"):
        text.pop(k)
    text.update({
        "num_hidden_layers": 5, "q_lora_rank": 32, "num_shared_experts": 2, "routed_scaling_factor": 2.5,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 2, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    })
    text = _finish(text, text_overrides, every=4, last=True)
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "tie_word_embeddings": False, "text_config": text}


def _text(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """(text config, tensor prefix) of a Kimi-Linear config or of a wrapped (K3) one."""
    if "text_config" in cfg:
        return cfg["text_config"], "language_model."
    return cfg, ""


def kimi_text_shapes(cfg: Mapping[str, Any], a_log: str = "heads") -> dict[str, tuple[int, ...]]:
    """Every release tensor name and shape of a Kimi-Linear (B2) or Kimi-K3 (C2) text model.

    ``cfg`` is a Kimi-Linear config or a wrapped K3 one (then every name starts with
    ``language_model.``). Which tensors exist follows the config: attention-residual tensors iff
    ``attn_res_block_size`` is set, q-LoRA iff ``q_lora_rank``, the MLA ``g_proj`` iff
    ``mla_use_output_gate``, the KDA full-rank ``g_proj`` iff ``linear_attn_config.use_full_rank_gate``
    (else ``g_a_proj`` / ``g_b_proj``), the latent MoE projections iff ``routed_expert_hidden_size``.

    ``a_log``: the shape of ``A_log`` for a wrapped (K3) config: ``"heads"`` gives ``[H]`` (llama.cpp's
    reading), ``"head_dim"`` gives ``[head_dim]`` (sglang's; the model reads the first H entries).
    Kimi-Linear's is always ``[1, 1, H, 1]``.
    """
    text, prefix = _text(cfg)
    h, v, nh = text["hidden_size"], text["vocab_size"], text["num_attention_heads"]
    nope, rope, vd = text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]
    ql, kl = text.get("q_lora_rank"), text["kv_lora_rank"]
    lin = text["linear_attn_config"]
    kh, kd, kw = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    d = kh * kd
    e, mi, inter = text["num_experts"], text["moe_intermediate_size"], text["intermediate_size"]
    latent = text.get("routed_expert_hidden_size")
    ew = latent or h
    si = mi * int(text.get("num_shared_experts") or 0)
    attn_res = text.get("attn_res_block_size") is not None
    kda_layers = set(lin["kda_layers"])
    full_layers = set(lin["full_attn_layers"])
    dense_below = int(text.get("first_k_dense_replace", 1))
    freq = int(text.get("moe_layer_freq") or 1)
    if a_log not in ("heads", "head_dim"):
        raise ValueError(f"a_log must be 'heads' or 'head_dim', not {a_log!r}")
    a_shape: tuple[int, ...] = (kh,) if a_log == "heads" else (kd,)
    if not prefix:
        a_shape = (1, 1, kh, 1)

    p = f"{prefix}model"
    out: dict[str, tuple[int, ...]] = {f"{p}.embed_tokens.weight": (v, h), f"{p}.norm.weight": (h,)}
    if attn_res:
        out[f"{p}.output_attn_res_norm.weight"] = (h,)
        out[f"{p}.output_attn_res_proj.weight"] = (1, h)
    if not text.get("tie_word_embeddings"):
        out[f"{prefix}lm_head.weight"] = (v, h)
    for i in range(text["num_hidden_layers"]):
        b = f"{p}.layers.{i}"
        out[f"{b}.input_layernorm.weight"] = (h,)
        out[f"{b}.post_attention_layernorm.weight"] = (h,)
        if attn_res:
            for side in ("self_attention", "mlp"):
                out[f"{b}.{side}_res_norm.weight"] = (h,)
                out[f"{b}.{side}_res_proj.weight"] = (1, h)
        a = f"{b}.self_attn"
        if i + 1 in kda_layers:
            for x in "qkv":
                out[f"{a}.{x}_proj.weight"] = (d, h)
            for x in "qkv":
                out[f"{a}.{x}_conv1d.weight"] = (d, 1, kw)
            out[f"{a}.f_a_proj.weight"] = (kd, h)
            out[f"{a}.f_b_proj.weight"] = (d, kd)
            out[f"{a}.dt_bias"] = (d,)
            out[f"{a}.A_log"] = a_shape
            out[f"{a}.b_proj.weight"] = (kh, h)
            if lin.get("use_full_rank_gate"):
                out[f"{a}.g_proj.weight"] = (d, h)
            else:
                out[f"{a}.g_a_proj.weight"] = (kd, h)
                out[f"{a}.g_b_proj.weight"] = (d, kd)
            out[f"{a}.o_norm.weight"] = (kd,)
            out[f"{a}.o_proj.weight"] = (h, d)
        elif i + 1 in full_layers:
            out.update(mla_shapes(a, h, nh, ql, kl, nope, rope, vd, bool(text.get("mla_use_output_gate"))))
        else:
            raise ValueError(f"1-based layer {i + 1} is in neither kda_layers nor full_attn_layers")
        if i < dense_below or i % freq:
            m = f"{b}.mlp"
            for q, shp in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                out[f"{m}.{q}.weight"] = shp
            continue
        m = f"{b}.block_sparse_moe"
        out[f"{m}.gate.weight"] = (e, h)
        out[f"{m}.gate.e_score_correction_bias"] = (e,)
        for k in range(e):
            out[f"{m}.experts.{k}.w1.weight"] = (mi, ew)
            out[f"{m}.experts.{k}.w2.weight"] = (ew, mi)
            out[f"{m}.experts.{k}.w3.weight"] = (mi, ew)
        if si:
            for q, shp in (("gate_proj", (si, h)), ("up_proj", (si, h)), ("down_proj", (h, si))):
                out[f"{m}.shared_experts.{q}.weight"] = shp
        if latent:
            out[f"{m}.routed_expert_down_proj.weight"] = (latent, h)
            out[f"{m}.routed_expert_norm.weight"] = (latent,)
            out[f"{m}.routed_expert_up_proj.weight"] = (h, latent)
    return out


def _random_state(cfg: Mapping[str, Any], seed: int, a_log: str) -> dict[str, torch.Tensor]:
    """Random float32 weights for :func:`kimi_text_shapes` (scales: see the module docstring)."""
    text, _ = _text(cfg)
    lin = text["linear_attn_config"]
    kh, kd = lin["num_heads"], lin["head_dim"]
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in kimi_text_shapes(cfg, a_log).items():
        if name.endswith("A_log"):
            # one value per head in [log 0.5, log 2]; the same first H values whatever the layout
            # (so "heads" and "head_dim" checkpoints of one seed are the same model), the tail of a
            # [head_dim] tensor distinct values that a wrong reading would pick up
            vals = torch.empty(max(kh, kd)).uniform_(math.log(0.5), math.log(2.0), generator=g)
            out[name] = vals[:kh].reshape(shape) if math.prod(shape) == kh else vals[: shape[0]].clone()
        elif name.endswith("dt_bias"):
            # softplus(-3) ~ 0.05, sigmoid(-3) ~ 0.05: decays close to (not at) 1 in both gate kinds
            out[name] = -3.0 + 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("conv1d.weight"):
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        elif name.endswith("e_score_correction_bias"):
            out[name] = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("_res_proj.weight"):
            # scores of O(1) per bank row: a depth softmax that is far from uniform
            out[name] = 1.5 * torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        elif name.endswith("norm.weight") or "layernorm" in name:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("embed_tokens.weight"):
            out[name] = torch.randn(shape, generator=g)
        elif name.endswith("f_b_proj.weight"):
            out[name] = 0.5 * torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        else:  # nn.Linear [out, in]
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    return out


def kimi_linear_state(cfg: Mapping[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights of a Kimi-Linear config with the release names and shapes (B2)."""
    if "text_config" in cfg:
        raise ValueError("kimi_linear_state takes a Kimi-Linear config; use kimi_k3_state for K3")
    return _random_state(cfg, seed, "heads")


def kimi_k3_state(cfg: Mapping[str, Any], seed: int = 0, a_log: str = "heads",
                  vision: bool = False) -> dict[str, torch.Tensor]:
    """Random float32 weights of a K3 config with the release names and shapes (C2), all under
    ``language_model.``.

    ``a_log``: ``"heads"`` stores ``A_log`` as ``[H]``, ``"head_dim"`` as ``[head_dim]`` whose first H
    entries are the per-head values (the rest are decoys); one seed gives the same model either way.
    ``vision``: add two small ``vision_tower.*`` / ``mm_projector.*`` tensors that a text-only loader
    must skip.
    """
    if "text_config" not in cfg:
        raise ValueError("kimi_k3_state takes a wrapped K3 config (with text_config)")
    out = _random_state(cfg, seed, a_log)
    if vision:
        out["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
        out["mm_projector.proj.0.weight"] = torch.zeros(cfg["text_config"]["hidden_size"], 8)
    return out


def release_dtypes(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The dtypes of the K3 release (C2): float32 for the KDA conv weights, ``dt_bias`` and ``A_log``,
    bf16 for every other floating tensor. (Kimi-Linear's release dtypes were not seen in a header; this
    uses the same rule.)"""
    return {k: (v if not v.is_floating_point() else v.to(torch.float32 if RELEASE_FP32.search(k) else torch.bfloat16))
            for k, v in state.items()}


def write_kimi_checkpoint(path: str | Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                          dtype: torch.dtype | str | None = None, shards: int = 1) -> Path:
    """Write ``config.json`` and safetensors (``shards`` > 1: with ``model.safetensors.index.json``).

    ``dtype``: None writes the tensors as given (float32 from the state builders); ``"release"`` uses
    the release dtypes (:func:`release_dtypes`); a torch dtype converts every floating tensor.
    """
    if dtype == "release":
        tensors = release_dtypes(state)
    elif dtype is None or isinstance(dtype, torch.dtype):
        tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in state.items()}
    else:
        raise ValueError(f"dtype must be None, 'release' or a torch dtype, not {dtype!r}")
    return write_checkpoint(path, config, tensors, shards=shards)


# ---------------------------------------------------------------------------------------------
# transformers 5.24 KimiLinearForCausalLM <-> release names

_FORGET = re.compile(r"\.self_attn\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def release_to_hf(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kimi-Linear release names -> transformers 5.24 ``KimiLinearForCausalLM`` state dict.

    What transformers' own ``conversion_mapping["kimi_linear"]`` does on load: ``f_a_proj``,
    ``f_b_proj``, ``dt_bias`` and ``A_log`` move under ``self_attn.forget_gate.``; the three depthwise
    convs concatenate to ``conv1d.weight [3d, 1, W]`` (q, k, v); ``block_sparse_moe.`` becomes
    ``mlp.``; the experts fuse to ``experts.gate_up_proj [E, 2I, H]`` (w1 then w3) and
    ``experts.down_proj [E, H, I]`` (w2).
    """
    out: dict[str, torch.Tensor] = {}
    convs: dict[str, dict[str, torch.Tensor]] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        if (m := _EXPERT.match(name)) is not None:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            continue
        if (c := re.match(r"^(.*\.self_attn)\.([qkv])_conv1d\.weight$", name)) is not None:
            convs.setdefault(c.group(1), {})[c.group(2)] = t
            continue
        name = _FORGET.sub(r".self_attn.forget_gate.\1", name)
        out[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for base, qkv in convs.items():
        out[f"{base}.conv1d.weight"] = torch.cat([qkv["q"], qkv["k"], qkv["v"]], dim=0)
    for base, per in experts.items():
        ks = sorted(per)
        out[f"{base}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([per[k]["w1"], per[k]["w3"]]) for k in ks])
        out[f"{base}.mlp.experts.down_proj"] = torch.stack([per[k]["w2"] for k in ks])
    return out


def hf_to_release(state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """transformers 5.24 ``KimiLinearForCausalLM`` state dict -> release names (inverse of
    :func:`release_to_hf`).

    Written here rather than taken from ``save_pretrained``: transformers 5.24's reverse mapping also
    renames the **dense** layer-0 MLP to ``model.layers.0.block_sparse_moe.{gate,up,down}_proj``, which
    is not the release name (``mlp.``). ``cfg`` gives the MoE layers (``first_k_dense_replace``).
    """
    dense_below = int(cfg.get("first_k_dense_replace", 1))
    freq = int(cfg.get("moe_layer_freq") or 1)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        name = name.replace(".self_attn.forget_gate.", ".self_attn.")
        if (c := re.match(r"^(.*\.self_attn)\.conv1d\.weight$", name)) is not None:
            for x, part in zip("qkv", t.chunk(3, dim=0)):
                out[f"{c.group(1)}.{x}_conv1d.weight"] = part.clone()
            continue
        lm = re.match(r"^model\.layers\.(\d+)\.mlp\.(.*)$", name)
        if lm is not None and int(lm.group(1)) >= dense_below and int(lm.group(1)) % freq == 0:
            base, rest = f"model.layers.{lm.group(1)}.block_sparse_moe", lm.group(2)
            if rest == "experts.gate_up_proj":
                inter = t.shape[1] // 2
                for k in range(t.shape[0]):
                    out[f"{base}.experts.{k}.w1.weight"] = t[k, :inter].clone()
                    out[f"{base}.experts.{k}.w3.weight"] = t[k, inter:].clone()
                continue
            if rest == "experts.down_proj":
                for k in range(t.shape[0]):
                    out[f"{base}.experts.{k}.w2.weight"] = t[k].clone()
                continue
            name = f"{base}.{rest}"
        out[name] = t
    return out


def kimi_linear_hf_checkpoint(path: str | Path, cfg: Mapping[str, Any] | None = None, seed: int = 0,
                              dtype: torch.dtype | str | None = None,
                              shards: int = 1) -> tuple[Path, KimiLinearForCausalLM]:
    """A transformers 5.24 ``KimiLinearForCausalLM`` with the random weights of
    :func:`kimi_linear_state`, written as a release-named checkpoint at ``path``.

    Returns ``(path, model)``: the model is in eval mode, float32, eager attention, and holds exactly
    the weights written (its state dict mapped back by :func:`hf_to_release`). Loading ``path`` with
    ``KimiLinearForCausalLM.from_pretrained`` gives the same model (transformers maps the release names
    on load). ``dtype`` and ``shards`` as :func:`write_kimi_checkpoint` (the model stays float32).
    """
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = copy.deepcopy(dict(cfg)) if cfg is not None else kimi_linear_config()
    hf_cfg = KimiLinearConfig(**cfg)
    hf_cfg._attn_implementation = "eager"
    model = KimiLinearForCausalLM(hf_cfg).float().eval()
    model.load_state_dict(release_to_hf(kimi_linear_state(cfg, seed)), strict=True)
    root = write_kimi_checkpoint(path, cfg, hf_to_release(model.state_dict(), cfg), dtype=dtype, shards=shards)
    return root, model
