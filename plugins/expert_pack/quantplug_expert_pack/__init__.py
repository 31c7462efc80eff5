"""quantplug backend for GGUF checkpoints (llama.cpp deepseek2 layout, deepseek32 for
DeepSeek-V3.2, kimi-linear and kimi-k3 for the KDA + MLA hybrids, deepseek4 for DeepSeek-V4) and
expert packs (entry point ``expert_pack``).

Every GGUF-specific decision is one of this plugin's hook answers:

* ``quantplug_detect``: a directory with config.json and ``*.gguf`` files (and, after
  ``quantplug expert-pack build``, the ``experts.qpack`` its GGUF names);
* ``quantplug_tensor_names``: llama.cpp names (``blk.3.attn_q_a.weight``) -> model names
  (``blk.3.indexer.attn_k.weight`` -> ``model.layers.3.self_attn.indexer.wk.weight`` for V3.2);
  with a version-1 expert pack, its payloads become the checkpoint's per-expert GGUF tensors
  (``blk.3.ffn_down_exps.weight[17]`` -> ``model.layers.3.mlp.experts.17.down_proj.weight``,
  ``Checkpoint.add_pack``), loaded or served by the core like any other format's experts;
* ``quantplug_attention_layout``: split K/V for a layer whose GGUF has ``attn_k_b`` /
  ``attn_v_b``, dense for a legacy ``attn_kv_b``, decided per layer from the tensors present;
* ``quantplug_linear_scheme``: :class:`~.schemes.GGMLScheme` per tensor type (routed experts
  stacked in the GGUF or one tensor per expert in the pack alike);
* ``quantplug_validate_plan``: GGUF metadata vs config.json (deepseek32: the architecture against
  the config's indexer, ``attention.indexer.*`` against ``index_*``; kimi-linear / kimi-k3: the
  architecture against config.json's, the per-layer ``head_count_kv`` against the layer kinds, the
  KDA / SiTU / latent-MoE / attention-residual keys against their config fields; deepseek4: every
  key llama.cpp's loader reads against its config field, :func:`_check_v4`), the V3.2
  indexer's float tensors stored as floats, the pack against the model (experts per layer, MoE
  layers present, config.json unchanged);
* ``quantplug_export`` / ``quantplug_cli_commands``: GGUF writer, ``quantplug expert-pack build``
  (GGUF checkpoints: pack version 1, served by this backend; safetensors checkpoints of every
  format with per-expert tensors: version 2, read by the core for whichever backend claims them).

Options (``quantplug.load(..., options={...})`` / ``-o KEY=VALUE``), declared in
:func:`quantplug_options`: ``dequantize`` (keep a dense copy of every GGUF linear after loading:
faster forward, more memory; default false). It reads two of the core's options: ``kernels``
("exact", the default: bit-exact dequantization + float matmul; "fast": Q4_0 / Q4_1 / Q4_K /
Q8_0 linears repacked at load for torch's int4 CPU kernel, bfloat16 activations; error
documented in the README). The routed experts, in the GGUF or in a pack, follow the core's
``expert_cache_mb`` / ``expert_prefetch`` / ``expert_readers`` (``docs/experts.md``): 0, the
default, loads them into memory; a budget serves them from the files through the core's cache.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantplug.api import (
    GGUF_FLOATS,
    AttentionLayout,
    CheckpointError,
    Claim,
    Fields,
    OptionSpec,
    Problem,
    contained,
    ggml,
    hookimpl,
)

from .build import build_pack
from .export import QUANTIZABLE, export_gguf
from .names import model_to_gguf, pack_names
from .pack import KV_FILE, KV_INDEX_SHA, PACK_NAME, ExpertPack
from .schemes import GGMLScheme

#: the hook-contract version this plugin is written for (quantplug.api.CONTRACT_VERSION; 1.9:
#: ``Checkpoint.add_pack``)
QUANTPLUG_CONTRACT = "1.9"

__version__ = "0.1.0"


@dataclass(frozen=True)
class GGUFConfig:
    """What detection learned: the GGUF files, their architecture, and the expert pack (if any)."""

    files: tuple[Path, ...]
    architecture: str
    pack: ExpertPack | None = None


@hookimpl
def quantplug_options() -> list[OptionSpec]:
    return [
        OptionSpec("dequantize", bool, False, None,
                   "keep a dense copy of every GGUF linear after loading: faster forward, more memory"),
        OptionSpec("type", str, "Q8_0", QUANTIZABLE, "GGUF type of the exported linears", scope="export"),
        OptionSpec("split_kv", bool, True, None, "export MLA K/V split (attn_k_b / attn_v_b), else legacy attn_kv_b",
                   scope="export"),
        OptionSpec("pack", bool, True, None, "also export a copy with the routed experts in an expert pack",
                   scope="export"),
    ]


def _gguf_files(checkpoint: Any) -> list[Path]:
    return [f for f in checkpoint.files if f.suffix == ".gguf"]


@hookimpl
def quantplug_detect(checkpoint: Any) -> Claim | None:
    files = _gguf_files(checkpoint)
    if not files:
        return None
    meta = Fields(checkpoint.gguf_metadata, f"{files[0]} metadata")  # typed reads of this plugin's own keys
    arch = meta.get_str("general.architecture", "?")
    pack = None
    named = meta.opt_str(KV_FILE)
    if named is not None:
        path = contained(checkpoint.path, named, f"{files[0]}: metadata {KV_FILE}")
        if not path.is_file():
            raise CheckpointError(f"{files[0]}: its routed experts were moved to {named} by `quantplug expert-pack "
                                  f"build`, but {path} is missing")
        expected = meta.get_str(KV_INDEX_SHA)
        pack = ExpertPack(path)
        if pack.index_sha256.hex() != expected:
            raise CheckpointError(f"{path}: this expert pack does not belong to {files[0].name} (index sha256 "
                                  f"{pack.index_sha256.hex()[:16]}..., the GGUF expects {expected[:16]}...)")
    elif (checkpoint.path / PACK_NAME).exists():
        raise CheckpointError(f"{checkpoint.path / PACK_NAME}: an expert pack is present but no GGUF file refers "
                              "to it (an interrupted `quantplug expert-pack build`?); remove it or rebuild")
    reason = f"{len(files)} GGUF file(s), general.architecture = {arch}"
    if pack is not None:
        reason += f"; routed experts in {pack.path.name} ({len(pack.layers)} layers x {pack.n_experts} experts)"
    return Claim("expert_pack", GGUFConfig(tuple(files), arch, pack), reason)


_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@hookimpl
def quantplug_tensor_names(model_config: Any, quant_config: Any, checkpoint: Any) -> dict[str, str] | None:
    if not _gguf_files(checkpoint):
        return None
    names = model_to_gguf(model_config)
    pack = quant_config.pack if isinstance(quant_config, GGUFConfig) else None
    if pack is not None:  # its payloads: per-expert GGUF tensors of the checkpoint, read by the core
        checkpoint.add_pack(pack)
        names.update(pack_names(names, pack))
    # the num_nextn_predict_layers MTP blocks have model names above (blk.61.nextn.eh_proj, ...);
    # other blocks past num_hidden_layers get model.layers.N names, so the core's MTP skip rule
    # lists them as skipped
    known = set(names.values())
    for stored in checkpoint.tensors:
        m = _BLOCK.match(stored)
        if m and int(m.group(1)) >= model_config.num_hidden_layers and stored not in known:
            names[f"model.layers.{m.group(1)}.gguf.{m.group(2)}"] = stored
    return names


@hookimpl
def quantplug_resolve_prefix() -> str:
    return ""  # quantplug_tensor_names maps llama.cpp names to unprefixed model names


@hookimpl
def quantplug_attention_layout(layer_name: str, checkpoint: Any) -> AttentionLayout | None:
    k_b, v_b = f"{layer_name}.k_b_proj", f"{layer_name}.v_b_proj"
    if f"{k_b}.weight" in checkpoint or f"{v_b}.weight" in checkpoint:
        return AttentionLayout("split_kv", "GGUF has attn_k_b / attn_v_b (llama.cpp split MLA)", k_b=k_b, v_b=v_b)
    if f"{layer_name}.kv_b_proj.weight" in checkpoint:
        return AttentionLayout("dense", "legacy GGUF: one attn_kv_b")
    return None


@hookimpl
def quantplug_linear_scheme(layer_name: str, layer_kind: str, shard_names: Sequence[str],
                            quant_config: GGUFConfig, checkpoint: Any, options: Mapping[str, Any]) -> Any:
    if layer_kind not in ("linear", "experts", "attn_k_b", "attn_v_b", "embedding"):
        return None  # a kind added after this plugin was written: not ours to answer
    names = list(shard_names) or [layer_name]  # routed experts from a pack: expert 0's tensor
    info = checkpoint.get(f"{names[0]}.weight") or checkpoint.get(f"{layer_name}.weight")
    if info is None:
        return None  # the core's dense scheme answers; the plan reports the missing tensor
    # kernels="fast" repacks 4-bit-affine ggml types for torch's int4 kernel; never the embedding
    # (looked up row by row, not multiplied) nor the small per-head MLA K/V stacks: one batched
    # matmul per stack beats a 2-D int4 kernel call per head. Without the native kernels, "fast"
    # keeps the stacks dequantized (exactly) from load on, as the core keeps a quantized dense
    # kv_b_proj per head: re-dequantizing them every decode step cost more than all the layer's
    # int4 calls together (DeepSeek-V3: 16.8M values per layer, 0.15% of its weights, but 4 GiB
    # in float32). With them the stacks stay packed: the native step reads a head's blocks faster
    # than its float32 copy (DeepSeek-V3's attention dims, Q8_0: 3 decode steps of one layer in
    # 37 ms packed vs 49 ms with the float32 copy). There the Q4_0 / Q8_0 stacks take the native
    # fast products too: llama.cpp multiplies attn_k_b / attn_v_b as any quantized matmul, its
    # input (q_nope per head, the attention's latent output per head) rounded to Q8_0 blocks
    kernels = options["kernels"]  # the core's option, checked by the plan (quantplug.api.LoadOptions)
    kv_heads = layer_kind in ("attn_k_b", "attn_v_b")
    native_kv = info.dtype in ggml.NATIVE_TYPES and ggml.native.library() is not None
    cache_kv = kv_heads and kernels == "fast" and not native_kv
    kv_fast = native_kv and info.dtype in ggml.native.FAST_FORMS
    return GGMLScheme(info.dtype, cache=bool(options.get("dequantize")) or cache_kv,
                      kernels="exact" if layer_kind == "embedding" or (kv_heads and not kv_fast) else kernels)


#: integer metadata keys (after ``{arch}.``, as gguf-py's ``Keys`` name them) -> config.json field
_META_CHECKS = (
    ("attention.head_count", "num_attention_heads"),
    ("expert_count", "n_routed_experts"),
    ("expert_used_count", "num_experts_per_tok"),
    ("leading_dense_block_count", "first_k_dense_replace"),
    ("embedding_length", "hidden_size"),
)
#: llama.cpp architectures this plugin reads: deepseek2 (DeepSeek-V3 / Kimi-K2.x), deepseek32
#: (DeepSeek-V3.2: deepseek2 plus the lightning indexer, blk.N.indexer.*), kimi-linear and kimi-k3
#: (KDA + MLA hybrids), deepseek4 (DeepSeek-V4, its release names)
ARCHITECTURES = ("deepseek2", "deepseek32", "kimi-linear", "kimi-k3", "deepseek4")
#: the Kimi hybrids' llama.cpp architecture -> their config.json architecture
KIMI_ARCHS = {"kimi-linear": "KimiLinearForCausalLM", "kimi-k3": "KimiK3ForConditionalGeneration"}
#: the config.json architecture of llama.cpp's 'deepseek4' files
V4_ARCH = "DeepseekV4ForCausalLM"
#: deepseek32's indexer keys (gguf-py Keys.Attention.Indexer; llama.cpp requires all three) -> config field
_INDEXER_META = (
    ("attention.indexer.head_count", "index_n_heads"),
    ("attention.indexer.key_length", "index_head_dim"),
    ("attention.indexer.top_k", "index_topk"),
)
#: the indexer tensors quantplug holds as float parameters (GGUF name suffix), whatever the file's type
_INDEXER_FLOATS = ("indexer.proj.weight", "indexer.k_norm.weight", "indexer.k_norm.bias")


@hookimpl
def quantplug_validate_plan(plan: Any, quant_config: GGUFConfig) -> list[Problem]:
    problems: list[Problem] = []
    ckpt, cfg = plan.checkpoint, plan.model_config
    meta = ckpt.gguf_metadata
    arch = quant_config.architecture
    first = quant_config.files[0].name
    kimi = KIMI_ARCHS.get(arch)
    if arch not in ARCHITECTURES:
        problems.append(Problem(f"general.architecture is {arch!r}; quantplug-expert-pack reads llama.cpp "
                                "'deepseek2' files (DeepSeek-V3 / Kimi-K2.x), 'deepseek32' files (DeepSeek-V3.2), "
                                "'kimi-linear' / 'kimi-k3' files and 'deepseek4' files (DeepSeek-V4)", file=first))
    elif arch == "deepseek4" or plan.architecture == V4_ARCH:
        if plan.architecture != V4_ARCH or arch != "deepseek4":
            want = "'deepseek4'" if plan.architecture == V4_ARCH else f"{V4_ARCH} (llama.cpp's 'deepseek4')"
            problems.append(Problem(f"general.architecture is {arch!r} but config.json is {plan.architecture}; "
                                    f"expected {want}", file=first, kind="metadata"))
        else:
            problems += _check_v4(meta, cfg, first)
    elif kimi is not None or plan.architecture in KIMI_ARCHS.values():
        if kimi != plan.architecture:
            want = next((a for a, c in KIMI_ARCHS.items() if c == plan.architecture), "deepseek2 / deepseek32")
            problems.append(Problem(f"general.architecture is {arch!r} but config.json is {plan.architecture}, "
                                    f"which llama.cpp writes as {want!r}", file=first, kind="metadata"))
        else:
            problems += _check_kimi(meta, arch, cfg, first)
    elif (arch == "deepseek32") != cfg.has_indexer:
        what = (f"DeepSeek-V3.2 (lightning indexer, index_topk = {cfg.index_topk}); llama.cpp writes it as "
                "'deepseek32'" if cfg.has_indexer else
                "without a lightning indexer; 'deepseek32' files are DeepSeek-V3.2 (DeepseekV32ForCausalLM)")
        problems.append(Problem(f"general.architecture is {arch!r} but config.json is {plan.architecture}, {what}",
                                file=first, kind="metadata"))
    blocks = meta.get(f"{arch}.block_count")
    nextn = cfg.num_nextn_predict_layers  # validated by the core (an integer in [0, 1024])
    if blocks is not None and blocks not in (cfg.num_hidden_layers, cfg.num_hidden_layers + nextn):
        problems.append(Problem(f"GGUF {arch}.block_count = {blocks} contradicts config.json num_hidden_layers = "
                                f"{cfg.num_hidden_layers}", file=first, kind="metadata"))
    checks = _META_CHECKS + (_INDEXER_META if arch == "deepseek32" and cfg.has_indexer else ())
    if arch == "deepseek4":
        checks = tuple(c for c in _META_CHECKS if c[0] != "leading_dense_block_count")  # every V4 layer is MoE
    for key, attr in (*checks, ("nextn_predict_layers", "num_nextn_predict_layers")):
        value = meta.get(f"{arch}.{key}")
        if value is not None and (type(value) is not int or value < 0):  # keys the header reader does not type
            problems.append(Problem(f"GGUF {arch}.{key} = {value!r}: expected a non-negative integer", file=first,
                                    kind="metadata"))
        elif value is not None and value != int(getattr(cfg, attr)):
            problems.append(Problem(f"GGUF {arch}.{key} = {value} contradicts config.json {attr} = "
                                    f"{getattr(cfg, attr)}", file=first, kind="metadata"))
    problems += _check_norm(meta, arch, cfg, first)
    if arch == "deepseek32" and cfg.has_indexer:
        problems += _check_indexer(ckpt, cfg, first)
    pack = quant_config.pack
    if pack is not None:
        problems += _check_pack(plan, pack)
    return problems


def _kimi_expected(cfg: Any) -> dict[str, Any]:
    """The kimi-linear / kimi-k3 metadata llama.cpp's converter writes, as this config implies
    (None: the converter writes no key; llama.cpp then takes its default)."""
    act = cfg.act
    return {
        "kda.head_dim": ("linear_attn_config.head_dim", cfg.kda_head_dim),
        "ssm.conv_kernel": ("linear_attn_config.short_conv_kernel_size", cfg.conv_kernel),
        "kda.gate_lower_bound": ("linear_attn_config.gate_lower_bound", cfg.gate_lower_bound),
        "expert_latent_length": ("routed_expert_hidden_size", cfg.latent_size),
        "attn_res.block_size": ("attn_res_block_size", cfg.attn_res_block_size),
        "activation.situ_beta": ("activation_situ_beta", None if act.is_silu else act.beta),
        "activation.situ_linear_beta": ("activation_situ_linear_beta", None if act.is_silu else act.linear_beta or 0.0),
        "expert_weights_scale": ("routed_scaling_factor", cfg.routed_scaling_factor),
        "attention.kv_lora_rank": ("kv_lora_rank", cfg.kv_lora_rank),
        "attention.q_lora_rank": ("q_lora_rank", cfg.q_lora_rank),
        "attention.layer_norm_rms_epsilon": ("rms_norm_eps", cfg.rms_norm_eps),
        "expert_feed_forward_length": ("moe_intermediate_size", cfg.moe_intermediate_size),
        "expert_shared_count": ("num_shared_experts", cfg.n_shared_experts),
    }


#: keys llama.cpp requires or whose absence changes the model: absent from the file while the
#: config sets them is a contradiction too (kimi-k3: a missing gate_lower_bound runs the softplus
#: gate, a missing expert_latent_length no latent MoE)
_KIMI_PRESENCE = ("kda.gate_lower_bound", "expert_latent_length", "attn_res.block_size", "activation.situ_beta",
                  "kda.head_dim", "ssm.conv_kernel")


def _check_kimi(meta: Mapping[str, Any], arch: str, cfg: Any, first: str) -> list[Problem]:
    """kimi-linear / kimi-k3 metadata against config.json: the per-layer ``head_count_kv`` (0 for a
    KDA layer, positive for MLA; llama.cpp decides each layer's kind from it), then every key of
    :func:`_kimi_expected` (floats as the file's float32 holds them). Each disagreement is one
    problem naming both values."""
    problems = []
    key = f"{arch}.attention.head_count_kv"
    kv = meta.get(key)
    n = cfg.num_hidden_layers
    if kv is not None:
        if not isinstance(kv, list | tuple) or len(kv) != n:
            problems.append(Problem(f"GGUF {key} = {kv!r}: expected one entry per layer ({n}), 0 for a KDA layer",
                                    file=first, kind="metadata"))
        else:
            wrong = [i for i, v in enumerate(kv) if (v == 0) != cfg.is_kda(i)]
            if wrong:
                i = wrong[0]
                problems.append(Problem(
                    f"GGUF {key}[{i}] = {kv[i]} makes layer {i} {'KDA' if kv[i] == 0 else 'MLA'}, but config.json "
                    f"linear_attn_config lists layer {i + 1} (1-based) in "
                    f"{'kda_layers' if cfg.is_kda(i) else 'full_attn_layers'}", file=first, kind="metadata"))
    for k, (field_name, want) in _kimi_expected(cfg).items():
        value = meta.get(f"{arch}.{k}")
        if value is None:
            if want is not None and k in _KIMI_PRESENCE:
                problems.append(Problem(f"GGUF {arch}.{k} is absent but config.json {field_name} = {want}",
                                        file=first, kind="metadata"))
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(Problem(f"GGUF {arch}.{k} = {value!r}: expected a number", file=first, kind="metadata"))
        elif want is None or not _same(value, want):
            problems.append(Problem(f"GGUF {arch}.{k} = {value} contradicts config.json {field_name} = {want}",
                                    file=first, kind="metadata"))
    return problems


def _v4_expected(cfg: Any) -> dict[str, tuple[str, Any]]:
    """The deepseek4 metadata llama.cpp's converter writes (``DeepseekV4Model.set_gguf_parameters``),
    as this config implies: key (after ``deepseek4.``) -> (config.json field, value). llama.cpp's
    loader (``src/models/deepseek4.cpp``) requires every one of them."""
    att = cfg.attention[0]
    n = cfg.num_hidden_layers
    csa = any(a.kind == "csa" for a in cfg.attention)
    out: dict[str, tuple[str, Any]] = {
        "attention.head_count_kv": ("num_key_value_heads", 1),
        "attention.key_length": ("head_dim", att.head_dim),
        "attention.value_length": ("head_dim", att.head_dim),
        "rope.dimension_count": ("qk_rope_head_dim", att.rope_dim),
        "attention.q_lora_rank": ("q_lora_rank", att.q_lora_rank),
        "attention.sliding_window": ("sliding_window", att.sliding_window),
        "attention.output_group_count": ("o_groups", att.o_groups),
        "attention.output_lora_rank": ("o_lora_rank", att.o_lora_rank),
        "attention.compress_ratios": ("compress_ratios", [a.compress_ratio for a in cfg.attention]),
        "attention.compress_rope_freq_base": ("compress_rope_theta", att.compress_rope.theta),
        "attention.layer_norm_rms_epsilon": ("rms_norm_eps", cfg.rms_norm_eps),
        "rope.freq_base": ("rope_theta", att.rope.theta),
        "expert_feed_forward_length": ("moe_intermediate_size", cfg.moe_intermediate_size),
        "expert_shared_count": ("n_shared_experts", cfg.n_shared_experts),
        "expert_weights_scale": ("routed_scaling_factor", cfg.routed_scaling_factor),
        "expert_gating_func": ("scoring_func", 4),  # gguf-py ExpertGatingFuncType.SQRTSOFTPLUS
        "swiglu_clamp_exp": ("swiglu_limit", [cfg.swiglu_limit] * n),
        "hyper_connection.count": ("hc_mult", cfg.hc_mult),
        "hyper_connection.sinkhorn_iterations": ("hc_sinkhorn_iters", cfg.hc_sinkhorn_iters),
        "hyper_connection.epsilon": ("hc_eps", cfg.hc_eps),
        "hash_layer_count": ("num_hash_layers", cfg.num_hash_layers),
        "embedding_length_out": ("hidden_size * hc_mult", cfg.hidden_size * cfg.hc_mult),
    }
    if csa:
        out.update({
            "attention.indexer.head_count": ("index_n_heads", att.index_n_heads),
            "attention.indexer.key_length": ("index_head_dim", att.index_head_dim),
            "attention.indexer.top_k": ("index_topk", att.index_topk),
        })
    if att.compress_rope.type == "yarn" and any(a.compress_ratio for a in cfg.attention):
        r = att.compress_rope
        out.update({
            "rope.scaling.factor": ("rope_scaling.factor", r.factor),
            "rope.scaling.original_context_length": ("rope_scaling.original_max_position_embeddings",
                                                     r.original_max_position_embeddings),
            "rope.scaling.yarn_beta_fast": ("rope_scaling.beta_fast", r.beta_fast),
            "rope.scaling.yarn_beta_slow": ("rope_scaling.beta_slow", r.beta_slow),
        })
    return out


#: deepseek4 keys optional in llama.cpp's loader (absent: it takes the exp clamp / its default)
_V4_OPTIONAL = ("swiglu_clamp_shexp", "embedding_length_out", "rope.scaling.factor",
                "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow")


def _check_v4(meta: Mapping[str, Any], cfg: Any, first: str) -> list[Problem]:
    """deepseek4 metadata against config.json, key by key (:func:`_v4_expected`): each
    disagreement one problem naming the key, the config field and both values; a required key
    absent is one too (llama.cpp's loader refuses such a file). ``compress_ratios`` may hold the
    MTP block's entry after the layers' (the release's list is one longer); the per-layer
    ``swiglu_clamp_exp`` / ``_shexp`` arrays cover the converted blocks."""
    problems = []
    expected = _v4_expected(cfg)
    expected["swiglu_clamp_shexp"] = expected["swiglu_clamp_exp"]
    n = cfg.num_hidden_layers
    for k, (field_name, want) in expected.items():
        key = f"deepseek4.{k}"
        value = meta.get(key)
        if value is None:
            if k not in _V4_OPTIONAL:
                problems.append(Problem(f"GGUF {key} is absent (llama.cpp's deepseek4 loader requires it); "
                                        f"config.json {field_name} = {want}", file=first, kind="metadata"))
            continue
        if isinstance(want, list):
            ok = isinstance(value, list | tuple) and len(value) >= n and all(
                not isinstance(v, bool) and isinstance(v, int | float) and _same(v, w) for v, w in zip(value, want))
            if not ok:
                problems.append(Problem(f"GGUF {key} = {value!r} contradicts config.json {field_name} "
                                        f"(per layer: {want})", file=first, kind="metadata"))
        elif isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(Problem(f"GGUF {key} = {value!r}: expected a number", file=first, kind="metadata"))
        elif not _same(value, want):
            problems.append(Problem(f"GGUF {key} = {value} contradicts config.json {field_name} = {want}",
                                    file=first, kind="metadata"))
    return problems


def _check_norm(meta: Mapping[str, Any], arch: str, cfg: Any, first: str) -> list[Problem]:
    """``{arch}.expert_weights_norm`` (a GGUF bool; llama.cpp renormalizes the top-k weights when it
    is true) against config.json's ``norm_topk_prob`` (``moe_renormalize`` in the Kimi family's
    config), for every architecture this plugin reads. Any other type (a string 'false', an
    integer) is a problem of its own: ``bool('false')`` is true."""
    key = f"{arch}.expert_weights_norm"
    norm = meta.get(key)
    field_name = "moe_renormalize" if arch in KIMI_ARCHS else "norm_topk_prob"
    if norm is None:
        return []
    if type(norm) is not bool:
        return [Problem(f"GGUF {key} = {norm!r}: expected a boolean", file=first, kind="metadata")]
    if norm != bool(cfg.norm_topk_prob):
        return [Problem(f"GGUF {key} = {norm} contradicts config.json {field_name} = {cfg.norm_topk_prob}",
                        file=first, kind="metadata")]
    return []


def _same(value: float, want: float) -> bool:
    """Equal as GGUF stores them: integers exactly, floats after rounding to float32."""
    if isinstance(value, int) and isinstance(want, int):
        return value == want
    import struct

    f32 = struct.unpack("f", struct.pack("f", float(want)))[0]
    return float(value) == f32 or abs(float(value) - float(want)) <= 1e-7 * max(1.0, abs(float(want)))


def _check_indexer(ckpt: Any, cfg: Any, first: str) -> list[Problem]:
    """What a deepseek32 file may hold that quantplug's indexer cannot take: ``indexer.proj``
    (weights_proj) or ``k_norm`` in a quantized type (the converter writes them F32, llama-quantize
    may quantize a 2-D ``indexer.proj``; quantplug holds them as float32 parameters), and an
    interleaved indexer RoPE in config.json (llama.cpp's deepseek32 graph rotates the indexer's
    rope slice NEOX style, half-split pairs)."""
    problems = []
    for t in ckpt.tensors.values():
        stored = t.stored_name or t.name
        if stored.endswith(_INDEXER_FLOATS) and t.dtype not in GGUF_FLOATS:
            fix = "; llama-quantize keeps it so with --tensor-type indexer.proj=f32" if ".proj." in stored else ""
            problems.append(Problem(
                f"{t.dtype}: quantplug holds DeepSeek-V3.2's indexer {t.name.split('.indexer.')[1]} as a float "
                f"parameter and reads it only as F32 / F16 / BF16 (llama.cpp's converter writes it F32){fix}",
                tensor=t.label, file=t.file.name, kind="dtype"))
    if cfg.indexer_rope_interleave:
        problems.append(Problem("config.json indexer_rope_interleave = true, but a llama.cpp 'deepseek32' file is "
                                "DeepSeek-V3.2, whose indexer RoPE llama.cpp applies half-split (NEOX); "
                                "indexer_rope_interleave must be false or absent", file=first, kind="metadata"))
    return problems


def _check_pack(plan: Any, pack: ExpertPack) -> list[Problem]:
    """The pack against the model: experts per layer, a MoE layer whose experts are neither in the
    GGUF nor in the pack, config.json changed since the build. Its payloads are the checkpoint's
    tensors (:func:`quantplug_tensor_names`): the plan itself checks their types and shapes
    against the schemes, lists a pack layer the model has no MoE layer for as unexpected tensors,
    and sizes ``expert_cache_mb`` or the memory an in-memory load needs, as for any format."""
    cfg, name = plan.model_config, pack.path.name
    problems = []
    if pack.n_experts != cfg.n_routed_experts:
        problems.append(Problem(f"the expert pack holds {pack.n_experts} experts per layer; config.json "
                                f"n_routed_experts = {cfg.n_routed_experts}", file=name, kind="pack"))
    # the MTP layers the plan loads (core decision mtp_layers) are MoE layers of the model too
    mtp = sum(int(d.value) for d in plan.decisions if d.hook == "mtp_layers")
    planned = {int(m.group(1)) for pp in plan.params if (m := _EXPERT_PARAM.match(pp.param))}
    for i in range(cfg.num_hidden_layers + mtp):
        if cfg.is_moe_layer(i) and not pack.has_layer(i) and i not in planned:
            problems.append(Problem(f"MoE layer {i}: its routed experts are neither in the GGUF (blk.{i}.ffn_*_exps) "
                                    f"nor in the expert pack (it has layers {pack.layers})", file=name, kind="pack",
                                    layer=f"model.layers.{i}"))
    config = plan.checkpoint.path / "config.json"
    if hashlib.sha256(config.read_bytes()).digest() != pack.config_sha256:
        problems.append(Problem("config.json changed since the expert pack was built", file=name, kind="pack",
                                severity="warning"))
    return problems


#: a routed-expert parameter of the plan, its layer in group 1
_EXPERT_PARAM = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe|ffn)\.experts\.")


@hookimpl
def quantplug_export(model: Any, plan: Any, destination: Path, options: Mapping[str, Any]) -> Any:
    return export_gguf(model, plan, destination, options)


def _cmd_build(args: argparse.Namespace) -> int:
    if (args.output is None) == (not args.in_place):
        print("error: expert-pack build needs exactly one of -o DST (write a new directory, SRC untouched) or "
              "--in-place (rewrite SRC's weight files)", file=sys.stderr)
        return 2
    res = build_pack(args.path, None if args.in_place else args.output, alignment=args.alignment)
    if res.format == "gguf":
        print(f"{res.pack}: {res.layers} MoE layers x {res.experts} experts x 3 roles = {res.entries} entries, "
              f"{res.moved_bytes:,} bytes moved out of {', '.join(p.name for p in res.gguf_files)}")
        return 0
    rewritten = [p.name for p in res.shards] + [f"{d} (dropped)" for d in res.dropped]
    print(f"{res.pack}: {res.layers} MoE layers x {res.experts} experts, {res.entries} payloads (pack version 2), "
          f"{res.moved_bytes:,} bytes moved out of the shards; written: {', '.join(rewritten)}")
    return 0


@hookimpl
def quantplug_cli_commands(subparsers: Any) -> None:
    p = subparsers.add_parser("expert-pack", help="expert packs: routed experts in one SSD-resident file")
    sub = p.add_subparsers(dest="expert_pack_command", required=True)
    b = sub.add_parser("build", help="copy a checkpoint (GGUF, or safetensors of any format with per-expert "
                                     "tensors) with its routed experts moved into experts.qpack")
    b.add_argument("path", help="source checkpoint directory (config.json + .gguf or .safetensors files)")
    b.add_argument("-o", "--output", help="new directory to write (other files reflinked where the file system "
                                          "can, else copied: never hard-linked); SRC is left byte-identical, even "
                                          "if the build is killed or the disk fills")
    b.add_argument("--in-place", action="store_true", help="rewrite SRC's weight files instead (not atomic across "
                                                           "files: a build killed midway can leave SRC unloadable)")
    b.add_argument("--alignment", type=int, default=4096, help="payload alignment in bytes (default 4096)")
    b.set_defaults(fn=_cmd_build)
