"""Tiny Kimi-K3 / Kimi-Linear checkpoints from random weights, with the release's tensor names (the
generator of /work/ksmoke.py, made config-driven).

Until ``quantplug.testing.kimi`` (the canonical writers) lands on main, the tests of formats,
tensor parallelism and served experts for the Kimi family write their checkpoints with this.

Dimensions are chosen for the formats: every linear's input is a multiple of 32 (MXFP4 / int4
groups, ggml blocks), every output even (ModelSlim W4A8 packs two output rows per byte), and
KDA / MLA heads (4) divide over 2 and 4 ranks.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from quantplug.testing import write_checkpoint

H, HEADS, HD, E = 64, 4, 32, 8


def k3_config(**text: Any) -> dict[str, Any]:
    """A 4-layer Kimi-K3 config.json (``KimiK3ForConditionalGeneration`` wrapping a ``kimi_linear``
    text config): KDA layers 1-3, MLA layer 4 (q-LoRA, output gate, no RoPE), dense layer 0,
    latent MoE with its norm, SiTU, attention residuals of block 2, the bounded forget gate and
    the full-rank KDA output gate."""
    t: dict[str, Any] = dict(
        model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], vocab_size=128, hidden_size=H,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, mla_use_nope=True, num_experts=E, num_experts_per_token=2, num_shared_experts=2,
        moe_renormalize=True, routed_scaling_factor=2.0, first_k_dense_replace=1, rms_norm_eps=1e-5,
        hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0, mla_use_output_gate=True,
        attn_res_block_size=2, routed_expert_hidden_size=64, latent_moe_use_norm=True, tie_word_embeddings=False,
        linear_attn_config=dict(num_heads=HEADS, head_dim=HD, short_conv_kernel_size=4, kda_layers=[1, 2, 3],
                                full_attn_layers=[4], use_full_rank_gate=True, gate_lower_bound=-5.0))
    t.update(text)
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": t}


def kimi_linear_config(**over: Any) -> dict[str, Any]:
    """A 4-layer Kimi-Linear config.json (``KimiLinearForCausalLM``): KDA layers 1-3, MLA layer 4
    (plain q_proj, no gate, no RoPE), low-rank KDA output gate, softplus forget gate, SiLU, MoE at
    the hidden width."""
    t = copy.deepcopy(k3_config()["text_config"])
    for k in ("activation_situ_beta", "activation_situ_linear_beta", "attn_res_block_size",
              "routed_expert_hidden_size", "latent_moe_use_norm", "mla_use_output_gate"):
        t.pop(k)
    t.update(hidden_act="silu", q_lora_rank=None)
    t["linear_attn_config"] = dict(num_heads=HEADS, head_dim=HD, short_conv_kernel_size=4, kda_layers=[1, 2, 3],
                                   full_attn_layers=[4])
    t.update(over)
    return t


def _text(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    if "text_config" in cfg:
        return cfg["text_config"], "language_model."
    return cfg, ""


def kimi_state(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights of every tensor a checkpoint of ``cfg`` stores, release names
    (``language_model.`` for K3). Linear weights ~ N(0, 1/in); norms ~ 1 + N(0, 0.1²); the
    attention residuals' ``*_res_proj`` ~ N(0, 1/hidden), so depth scores are of order 1 as in a
    trained model (std 1 saturates the depth softmax and makes the logits ~30x more sensitive to
    rounding: tensor-parallel sums in another order then miss 1e-5)."""
    t, pre = _text(cfg)
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, std: float | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (std if std is not None else shape[-1] ** -0.5)

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * r(n, std=1.0)

    h, v, nh = t["hidden_size"], t["vocab_size"], t["num_attention_heads"]
    lin = t["linear_attn_config"]
    kh, kd, width = lin["num_heads"], lin["head_dim"], lin.get("short_conv_kernel_size", 4)
    d = kh * kd
    ql, kl = t.get("q_lora_rank"), t["kv_lora_rank"]
    nope, rope, vd = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    e, mi, inter = t["num_experts"], t["moe_intermediate_size"], t["intermediate_size"]
    latent = t.get("routed_expert_hidden_size")
    res = t.get("attn_res_block_size") is not None
    P = pre + "model."
    st: dict[str, torch.Tensor] = {P + "embed_tokens.weight": r(v, h, std=1.0), P + "norm.weight": norm(h),
                                   pre + "lm_head.weight": r(v, h)}
    if res:
        st[P + "output_attn_res_norm.weight"], st[P + "output_attn_res_proj.weight"] = norm(h), r(1, h)
    for i in range(t["num_hidden_layers"]):
        b = f"{P}layers.{i}."
        st[b + "input_layernorm.weight"], st[b + "post_attention_layernorm.weight"] = norm(h), norm(h)
        if res:
            for n in ("self_attention_res", "mlp_res"):
                st[b + n + "_norm.weight"], st[b + n + "_proj.weight"] = norm(h), r(1, h)
        a = b + "self_attn."
        if i + 1 in lin["kda_layers"]:
            for x in "qkv":
                st[a + f"{x}_proj.weight"] = r(d, h)
                st[a + f"{x}_conv1d.weight"] = r(d, 1, width, std=0.5)
            st[a + "f_a_proj.weight"], st[a + "f_b_proj.weight"] = r(kd, h), r(d, kd)
            st[a + "dt_bias"] = 0.1 * r(d, std=1.0)
            # K3: one per head ([H], llama.cpp's reading); Kimi-Linear: [1, 1, H, 1]
            st[a + "A_log"] = 0.1 * r(kh, std=1.0) if pre else 0.1 * r(1, 1, kh, 1, std=1.0)
            st[a + "b_proj.weight"] = r(kh, h)
            if lin.get("use_full_rank_gate"):
                st[a + "g_proj.weight"] = r(d, h)
            else:
                st[a + "g_a_proj.weight"], st[a + "g_b_proj.weight"] = r(kd, h), r(d, kd)
            st[a + "o_norm.weight"], st[a + "o_proj.weight"] = norm(kd), r(h, d)
        else:
            if ql:
                st[a + "q_a_proj.weight"], st[a + "q_a_layernorm.weight"] = r(ql, h), norm(ql)
                st[a + "q_b_proj.weight"] = r(nh * (nope + rope), ql)
            else:
                st[a + "q_proj.weight"] = r(nh * (nope + rope), h)
            st[a + "kv_a_proj_with_mqa.weight"], st[a + "kv_a_layernorm.weight"] = r(kl + rope, h), norm(kl)
            st[a + "kv_b_proj.weight"] = r(nh * (nope + vd), kl)
            if t.get("mla_use_output_gate"):
                st[a + "g_proj.weight"] = r(nh * vd, h)
            st[a + "o_proj.weight"] = r(h, nh * vd)
        if i < t.get("first_k_dense_replace", 1):
            m = b + "mlp."
            st[m + "gate_proj.weight"], st[m + "up_proj.weight"] = r(inter, h), r(inter, h)
            st[m + "down_proj.weight"] = r(h, inter)
            continue
        m = b + "block_sparse_moe."
        st[m + "gate.weight"], st[m + "gate.e_score_correction_bias"] = r(e, h), 0.01 * r(e, std=1.0)
        w = latent or h
        if latent:
            st[m + "routed_expert_down_proj.weight"], st[m + "routed_expert_up_proj.weight"] = r(w, h), r(h, w)
            if t.get("latent_moe_use_norm"):
                st[m + "routed_expert_norm.weight"] = norm(w)
        for k in range(e):
            st[m + f"experts.{k}.w1.weight"], st[m + f"experts.{k}.w3.weight"] = r(mi, w), r(mi, w)
            st[m + f"experts.{k}.w2.weight"] = r(w, mi)
        sh = mi * t.get("num_shared_experts", 0)
        if sh:
            st[m + "shared_experts.gate_proj.weight"], st[m + "shared_experts.up_proj.weight"] = r(sh, h), r(sh, h)
            st[m + "shared_experts.down_proj.weight"] = r(h, sh)
    return st


#: tensors the K3 release stores in float32 (conv weights, dt_bias, A_log); the rest bfloat16
FP32_NAMES = ("_conv1d.weight", ".dt_bias", ".A_log")


def release_dtypes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` in the release's dtypes: bfloat16, except :data:`FP32_NAMES` in float32."""
    return {k: (v.float() if k.endswith(FP32_NAMES) else v.to(torch.bfloat16)) for k, v in state.items()}


def write_kimi(path: Path, cfg: dict[str, Any], seed: int = 0, *, release: bool = False) -> Path:
    """Write ``cfg`` with :func:`kimi_state` weights of ``seed`` (float32, or with ``release`` the
    release's dtypes) into ``path``."""
    st = kimi_state(cfg, seed)
    return write_checkpoint(path, cfg, release_dtypes(st) if release else st)


def transformers_kimi_linear(cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' ``KimiLinearForCausalLM`` (float32, eager, eval) on ``state`` in the
    release's names (a Kimi-Linear checkpoint, not K3: transformers has no K3 class), renamed to
    transformers' layout: q / k / v convolutions concatenated into ``conv1d``, the forget gate's
    tensors under ``forget_gate``, ``block_sparse_moe`` as ``mlp`` with fused experts."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")}
    hc = KimiLinearConfig(**kw, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    hc._attn_implementation = "eager"
    model = KimiLinearForCausalLM(hc).eval()
    sd: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        t = t.float()
        n = name.replace(".block_sparse_moe.", ".mlp.")
        parts = n.split(".")
        if ".self_attn." in n and parts[-1] in ("A_log", "dt_bias") or ".f_a_proj." in n or ".f_b_proj." in n:
            i = parts.index("self_attn")
            n = ".".join(parts[:i + 1] + ["forget_gate"] + parts[i + 1:])
        if n.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
            continue
        if ".mlp.experts." in n:
            base, k, proj = n.rsplit(".", 3)[0], int(parts[-3]), parts[-2]
            experts.setdefault(base, {}).setdefault(k, {})[proj] = t
            continue
        sd[n] = t
    for name in state:
        if name.endswith("q_conv1d.weight"):
            a = name.removesuffix("q_conv1d.weight")
            sd[a + "conv1d.weight"] = torch.cat([state[a + f"{x}_conv1d.weight"].float() for x in "qkv"])
    for base, per in experts.items():
        ks = sorted(per)
        sd[base + ".gate_up_proj"] = torch.stack([torch.cat([per[k]["w1"], per[k]["w3"]]) for k in ks])
        sd[base + ".down_proj"] = torch.stack([per[k]["w2"] for k in ks])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not missing, (sorted(missing)[:5], sorted(unexpected)[:5])
    return model


def _mxfp4_scale(w: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' MXFP4 weight scale per 32 along the input: the power of two
    ``2^(floor(log2(amax)) - 2)`` (its ``round_to_power_2`` rule, e8m0 exponent clamped to [0, 255])."""
    amax = w.float().unflatten(-1, (-1, 32)).abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny)
    e = (127 + torch.floor(torch.log2(amax)) - 2).clamp(0, 255)
    return torch.exp2(e - 127)


def write_k3_release(path: Path, cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[Path, Path]:
    """Kimi-K3 as released: compressed-tensors ``mxfp4-pack-quantized`` on the routed experts only,
    each packed by compressed-tensors' own ``MXFP4PackedCompressor`` (``weight_packed`` uint8
    [out, in/2], low nibble = even column; ``weight_scale`` uint8 E8M0 [out, in/32]), every other
    tensor in the release's dtypes (bfloat16; convolutions, dt_bias, A_log float32), the config's
    ``ignore`` listing every non-expert linear by name (the modules llm-compressor left out), the
    quantization_config inside ``text_config`` and again at the top level.

    Returns (the release, its dequantized twin): the same model with every tensor in float32, the
    experts decoded by the compressor's ``decompress`` (float32 scales: exact)."""
    import re

    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
               "dynamic": False, "scale_dtype": "torch.uint8"}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    expert = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
    linear = re.compile(r"(_proj|_proj_with_mqa|lm_head|\.w[123])\.weight$")
    rel = release_dtypes(state)
    packed: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in rel.items():
        if not expert.search(name):
            packed[name], deq[name] = t, t.float()
            continue
        base = name.removesuffix(".weight")
        w = t.float()
        sd = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": _mxfp4_scale(w)}, scheme)
        packed.update({f"{base}.{k}": v for k, v in sd.items()})
        back = MXFP4PackedCompressor.decompress({k: v.clone() for k, v in sd.items()}, scheme)
        deq[name] = back["weight"].float()
    ignore = sorted(n.removesuffix(".weight") for n, t in state.items()
                    if linear.search(n) and t.dim() == 2 and not expert.search(n) and "_res_proj" not in n)
    qc = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                        "output_activations": None, "format": "mxfp4-pack-quantized"}},
          "ignore": ignore, "kv_cache_scheme": None}
    qcfg = copy.deepcopy(cfg)
    qcfg["text_config"]["quantization_config"] = qc
    qcfg["quantization_config"] = qc
    release = write_checkpoint(Path(path), qcfg, packed)
    dense = write_checkpoint(Path(str(path) + "-dequantized"), cfg, deq)
    return release, dense
