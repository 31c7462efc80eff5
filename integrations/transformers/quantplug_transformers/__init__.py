"""quantplug-transformers: transformers' own ``DeepseekV3ForCausalLM`` (``DeepseekV32ForCausalLM``,
``KimiLinearForCausalLM``) running quantplug's planned modules, from one call, for every format an
installed quantplug backend claims.

    model = quantplug_transformers.from_pretrained(path)      # transformers.DeepseekV3ForCausalLM
    model.generate(ids, max_new_tokens=16)                    # transformers' generate
    pipeline("text-generation", model=model, tokenizer=quantplug_transformers.tokenizer(path))

quantplug plans and loads the checkpoint (its plan decides prefix, packed modules, layout,
schemes, skip rules; plan errors are raised before any weight is read); transformers' model is
built on the meta device and each of its projections is replaced by the planned module quantplug
loaded for it (:func:`quantplug.bridge.planned_modules`): linears by ``QuantLinear`` (the scheme's
``apply``), routed experts by quantplug's stacked experts (same call signature as transformers'
``DeepseekV3Experts``), GGUF's split K/V by a ``kv_b_proj`` computed from the stacks, a quantized
``token_embd`` by quantplug's embedding. Norms and the router are transformers' own modules with
quantplug's loaded tensors. Nothing is dequantized for the bridge. Kimi-Linear: the same, under the
names transformers' ``KimiLinearForCausalLM`` gives them (the architecture declares the renames;
its KDA layers' projections are planned linears, their convolutions / ``dt_bias`` / ``A_log``
quantplug's loaded tensors); the released Kimi-K3 has no transformers class and is refused.

Why a function and not ``AutoModelForCausalLM.from_pretrained(path, quantization_config=...)``
through a registered ``HfQuantizer``: see docs/transformers.md ("Why not a registered quantizer").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import quantplug
import torch
from quantplug.bridge import float_state, planned_modules
from quantplug.errors import QuantplugError
from torch import nn

__version__ = "0.1.0"

#: the merged projections vLLM builds; transformers keeps their parts as separate linears
_MERGED = (".fused_qkv_a_proj", ".gate_up_proj")
#: quantplug's text-model class -> transformers' (config class, model class) of the same module tree;
#: a DeepSeek-V3.2 checkpoint (an indexer) takes DeepSeek-V3.2's, other text models DeepSeek-V3's
_CLASSES = {
    "KimiLinearForCausalLM": ("KimiLinearConfig", "KimiLinearForCausalLM"),
    "DeepseekV4ForCausalLM": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
}
#: transformers' DeepseekV4Config layer types of quantplug's V4 attention kinds
_V4_LAYER_TYPES = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
                   "hca": "heavily_compressed_attention"}


class BridgeError(QuantplugError):
    """transformers' model and quantplug's plan do not line up (a module or tensor of one has no
    counterpart in the other); the message names it."""


def _text_config(plan: Any) -> dict[str, Any]:
    top = dict(plan.checkpoint.config)
    sub = top.get("text_config")
    text: dict[str, Any] = sub if isinstance(sub, dict) else top
    return {k: v for k, v in text.items() if k not in ("architectures", "quantization_config", "model_type",
                                                       "auto_map", "torch_dtype", "dtype")}


def _v4_config(path: str | Path, plan: Any, text: dict[str, Any]) -> dict[str, Any]:
    """The release config.json of a DeepSeek-V4 checkpoint as transformers' ``DeepseekV4Config``
    takes it, from what quantplug's parser read: ``compress_ratios`` (the ratio itself, any value)
    as ``layer_types`` + ``compress_rates`` (transformers holds one ratio per kind: CSA 4, one HCA
    ratio; its own reading of ``compress_ratios`` knows only 0 / 4 / 128), ``num_hash_layers`` as
    ``mlp_layer_types`` (transformers' default is 3 hash layers, quantplug's the config's or 0),
    ``rope_scaling`` as ``rope_parameters``. A model transformers' config cannot express (HCA layers
    of different ratios) is refused, naming the layers."""
    cfg = plan.model_config
    kinds = [a.kind for a in cfg.attention]
    hca: dict[int, list[int]] = {}
    for i, a in enumerate(cfg.attention):
        if a.kind == "hca":
            hca.setdefault(a.compress_ratio, []).append(i)
    if len(hca) > 1:
        where = "; ".join(f"ratio {r}: layers {', '.join(map(str, ls))}" for r, ls in sorted(hca.items()))
        raise BridgeError(f"{path}: DeepSeek-V4 compress_ratios holds HCA layers of {len(hca)} ratios ({where}); "
                          "transformers' DeepseekV4Config has one HCA ratio (compress_rates) for every HCA layer")
    out = {k: v for k, v in text.items() if k not in ("compress_ratios", "num_hash_layers", "rope_scaling",
                                                      "rope_parameters")}
    out["layer_types"] = [_V4_LAYER_TYPES[k] for k in kinds]
    out["compress_rates"] = {"compressed_sparse_attention": 4,
                             "heavily_compressed_attention": next(iter(hca), 128)}
    n_hash = int(cfg.num_hash_layers)
    out["mlp_layer_types"] = ["hash_moe"] * n_hash + ["moe"] * (len(kinds) - n_hash)
    scaling = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(scaling, dict):
        rope = {k: v for k, v in scaling.items() if k != "type"}
        rope["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
        out["rope_parameters"] = rope
    return out


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, local = name.rpartition(".")
    try:
        mod = model.get_submodule(owner)
    except AttributeError:
        mod = None
    old = None if mod is None else mod._parameters.get(local, mod._buffers.get(local))
    if mod is None or old is None:
        raise BridgeError(f"transformers' {type(model).__name__} has no tensor {name} for quantplug's {name}")
    if old.shape != value.shape:  # the same values in another shape ([H] vs [1, 1, H, 1]; GGUF's [1, C, 1, W])
        if old.numel() != value.numel():
            raise BridgeError(f"quantplug's {name} has shape {list(value.shape)}; transformers' "
                              f"{type(model).__name__} holds {list(old.shape)}")
        value = value.reshape(old.shape)
    if local in mod._parameters:
        mod._parameters[local] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[local] = value


def from_pretrained(path: str | Path, *, dtype: torch.dtype = torch.float32, options: dict[str, Any] | None = None,
                    backend: str | None = None, attn_implementation: str | None = None) -> Any:
    """transformers' ``DeepseekV3ForCausalLM`` for the checkpoint at ``path`` in any quantplug format
    (``DeepseekV32ForCausalLM`` for a DeepSeek-V3.2 checkpoint: its indexer's ``wq_b`` / ``wk`` are
    planned linears like the others, ``k_norm`` / ``weights_proj`` quantplug's loaded tensors;
    ``KimiLinearForCausalLM`` for a Kimi-Linear checkpoint). A model the engines cannot take (the
    released Kimi-K3) is refused naming why, before any tensor data is read.

    ``dtype``: the model dtype (activations, float tensors); ``options`` / ``backend``: as
    ``quantplug.load``; ``attn_implementation``: transformers' (default: its own choice).
    The returned model carries ``quantplug_plan``; its ``generation_config`` has the checkpoint's
    end-of-sequence ids as ``quantplug generate`` reads them (none: generation runs to
    ``max_new_tokens``)."""
    import transformers
    from quantplug.bridge import engine_refusal, text_model
    from quantplug.loader import execute
    from transformers import GenerationConfig

    plan = quantplug.plan(path, dtype=dtype, options=options, backend=backend)
    why = engine_refusal(plan.model) if not plan.errors else None
    if why:  # before any tensor data is read
        raise BridgeError(f"{path}: {why}")
    names = _CLASSES.get(type(text_model(plan.model)).__name__)
    if names is None:
        names = (("DeepseekV32Config", "DeepseekV32ForCausalLM") if plan.model_config.has_indexer
                 else ("DeepseekV3Config", "DeepseekV3ForCausalLM"))
    if not hasattr(transformers, names[1]):
        raise BridgeError(f"{path}: transformers {transformers.__version__} has no {names[1]} (the class this "
                          f"{plan.architecture} checkpoint bridges into)")
    text = _text_config(plan)
    if names[0] == "DeepseekV4Config":  # from the plan's config: a refusal comes before any tensor data is read
        text = _v4_config(path, plan, text)
    qp = execute(plan, progress=False)
    plan = qp.quantplug_plan
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        text.setdefault(key, None)  # not transformers' defaults (a real model's ids, maybe past a small vocabulary)
    config: Any = getattr(transformers, names[0])(**text)
    build: Any = getattr(transformers, names[1])
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = build(config)
    projections = planned_modules(qp)
    for name, proj in projections.items():
        if name.endswith(_MERGED):
            continue  # transformers applies the parts (q_a_proj, kv_a_proj_with_mqa; gate_proj, up_proj) itself
        try:
            model.get_submodule(name)
        except AttributeError:
            raise BridgeError(f"{path}: quantplug planned {name} ({', '.join(proj.schemes)}); transformers' "
                              f"{type(model).__name__} has no such module") from None
        model.set_submodule(name, proj.modules[0] if len(proj.modules) == 1 and name.endswith(
            ("experts", "embed_tokens")) else _module(proj))
    for name, t in float_state(qp).items():
        _set_tensor(model, name, t)
    # rotary embeddings (the model's; DeepSeek-V4's compressors and indexers hold their own; none in
    # Kimi-Linear): their inv_freq is computed from the config, not loaded
    for name, mod in list(model.named_modules()):
        if name.endswith("rotary_emb") and any(b.is_meta for b in mod.buffers(recurse=False)):
            model.set_submodule(name, type(mod)(config=config))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise BridgeError(f"{path}: transformers' tensors with no quantplug source: {', '.join(left[:8])}")
    from quantplug.generate import checkpoint_eos

    eos = list(checkpoint_eos(qp))
    gen = GenerationConfig(eos_token_id=(eos if len(eos) > 1 else eos[0]) if eos else None,
                           pad_token_id=eos[0] if eos else None, do_sample=False)
    model.generation_config = gen
    model.config.eos_token_id = gen.eos_token_id
    model.eval()
    model.quantplug_plan = plan
    return model


def _module(proj: Any) -> nn.Module:
    """The planned module for a single projection (QuantLinear, KVBFromSplit, TiedHead)."""
    if len(proj.modules) == 1 and isinstance(proj.fn, nn.Module):
        module: nn.Module = proj.fn
        return module
    raise BridgeError(f"cannot place {proj}: not a single module")


def lora_config(**kwargs: Any) -> Any:
    """A ``peft.LoraConfig(**kwargs)`` that also targets quantplug's planned linears: PEFT's own
    LoRA ``Linear`` wraps a ``QuantLinear`` (registered through PEFT's custom-module mapping; the
    adapter runs beside the planned module's forward, the quantized weight is never merged or
    touched). Use it with ``peft.get_peft_model(model, lora_config(r=8, target_modules=[...]))``."""
    from peft import LoraConfig
    from peft.tuners.lora import Linear as LoraLinear
    from quantplug.api import QuantLinear

    cfg = LoraConfig(**kwargs)
    cfg._register_custom_module({QuantLinear: LoraLinear})
    return cfg


def tokenizer(path: str | Path) -> Any:
    """A transformers fast tokenizer from the checkpoint's ``tokenizer.json`` (special tokens from
    ``tokenizer_config.json`` where present), for ``pipeline("text-generation", ...)``."""
    import json

    from transformers import PreTrainedTokenizerFast

    root = Path(path)
    if not (root / "tokenizer.json").is_file():
        raise BridgeError(f"{root}: no tokenizer.json (the bridge's tokenizer needs one)")
    kwargs: dict[str, Any] = {}
    cfg_file = root / "tokenizer_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        for key in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
            if isinstance(cfg.get(key), str):
                kwargs[key] = cfg[key]
    return PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"), **kwargs)


__all__ = ["BridgeError", "from_pretrained", "lora_config", "tokenizer"]
