"""Tiny Kimi-Linear and Kimi-K3 checkpoints under their release names, for the GGUF tests, the
llama.cpp comparison bench and the fixture script (``tests/data/vendor/make_gguf_kimi.py``).

Kept beside ``quantplug.testing.kimi`` (the canonical tiny-checkpoint writers, on main since) because
the committed GGUF fixtures were converted from these exact seeded weights (the tests regenerate
the sources from their seeds), and because of what GGUF needs here. Dimensions are chosen for GGUF: every matrix's input width
is a multiple of 32 (Q4_0 / Q8_0 / MXFP4 blocks); the dense MLP's 256-wide rows (down_proj) take
K-quants in llama.cpp's quantizer, the others fall back to legacy types as llama.cpp decides. KDA heads = MLA heads (llama.cpp's K3 converter
keeps the first ``num_attention_heads`` entries of ``A_log``); K3's ``A_log`` is stored
[head_dim], sglang's reading of the release (the converter and quantplug take its first H).

K3's routed experts can be written as compressed-tensors MXFP4 (``weight_packed`` uint8 two
e2m1 codes per byte, low nibble first, ``weight_scale`` uint8 E8M0 per 32 inputs, config
``quantization_config.format = "mxfp4-pack-quantized"``), the release's own format, which
llama.cpp's converter repacks losslessly into ggml MXFP4.
"""

from __future__ import annotations

import torch

HIDDEN, LAYERS, HEADS, HEAD_DIM, EXPERTS, VOCAB = 128, 4, 2, 64, 4, 320
#: MLA dims
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 64, 64, 32, 32, 32
MOE_I, DENSE_I, LATENT = 32, 256, 64
#: the e2m1 code values (compressed-tensors / OCP MX order)
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def _common(full: list[int]) -> dict:
    return dict(model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], vocab_size=VOCAB,
                hidden_size=HIDDEN, intermediate_size=DENSE_I, moe_intermediate_size=MOE_I, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE,
                qk_rope_head_dim=ROPE, v_head_dim=V_DIM, mla_use_nope=True, num_experts=EXPERTS,
                num_experts_per_token=2, num_shared_experts=1, moe_renormalize=True, routed_scaling_factor=2.5,
                moe_router_activation_func="sigmoid", first_k_dense_replace=1, moe_layer_freq=1, rms_norm_eps=1e-5,
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, model_max_length=4096,
                num_expert_group=1, topk_group=1, use_grouped_topk=True,
                linear_attn_config=dict(num_heads=HEADS, head_dim=HEAD_DIM, short_conv_kernel_size=4,
                                        kda_layers=[i for i in range(1, LAYERS + 1) if i not in full],
                                        full_attn_layers=full))


def kimi_linear_config() -> dict:
    """Kimi-Linear: plain MLA q_proj, low-rank KDA output gate, softplus forget gate, SiLU."""
    cfg = _common([2, 4])
    cfg.update(q_lora_rank=None, hidden_act="silu")
    return cfg


def k3_config(block: int = 2, mxfp4: bool = False) -> dict:
    """Kimi-K3 (``text_config`` under ``KimiK3ForConditionalGeneration``): MLA q-LoRA with output
    gate, full-rank KDA gate, bounded forget gate, SiTU, latent MoE, attention residuals of block
    ``block`` (< 4 layers: two bank writes)."""
    text = _common([4])
    text.update(q_lora_rank=Q_LORA, hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
                mla_use_output_gate=True, attn_res_block_size=block, routed_expert_hidden_size=LATENT,
                latent_moe_use_norm=True)
    text["linear_attn_config"].update(use_full_rank_gate=True, gate_lower_bound=-5.0)
    if mxfp4:
        text["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                          "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                      "strategy": "group", "symmetric": True,
                                                      "scale_dtype": "torch.uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*", "re:.*gate$",
                       "re:.*routed_expert.*", "lm_head"]}
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
            "bos_token_id": 0, "eos_token_id": 1}


def _text(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under the release names (``language_model.`` prefix for K3); with
    a compressed-tensors config the routed experts as MXFP4 ``weight_packed`` / ``weight_scale``."""
    g = torch.Generator().manual_seed(seed)
    t = _text(cfg)
    k3 = "text_config" in cfg
    d = HEADS * HEAD_DIM

    def r(*s: int, std: float | None = None) -> torch.Tensor:
        return torch.randn(*s, generator=g) * (std if std is not None else s[-1] ** -0.5)

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * r(n, std=1.0)

    p = "language_model.model." if k3 else "model."
    st = {p + "embed_tokens.weight": r(VOCAB, HIDDEN, std=1.0), p + "norm.weight": norm(HIDDEN),
          ("language_model." if k3 else "") + "lm_head.weight": r(VOCAB, HIDDEN)}
    if k3:
        st[p + "output_attn_res_norm.weight"] = norm(HIDDEN)
        st[p + "output_attn_res_proj.weight"] = r(1, HIDDEN, std=1.0)
    kda = t["linear_attn_config"]["kda_layers"]
    latent = t.get("routed_expert_hidden_size")
    for i in range(LAYERS):
        b = f"{p}layers.{i}."
        st[b + "input_layernorm.weight"] = norm(HIDDEN)
        st[b + "post_attention_layernorm.weight"] = norm(HIDDEN)
        if k3:
            for n in ("self_attention_res", "mlp_res"):
                st[b + n + "_norm.weight"] = norm(HIDDEN)
                st[b + n + "_proj.weight"] = r(1, HIDDEN, std=1.0)
        a = b + "self_attn."
        if i + 1 in kda:
            for x in "qkv":
                st[a + f"{x}_proj.weight"] = r(d, HIDDEN)
                st[a + f"{x}_conv1d.weight"] = r(d, 1, 4, std=0.5)
            st[a + "f_a_proj.weight"] = r(HEAD_DIM, HIDDEN)
            st[a + "f_b_proj.weight"] = r(d, HEAD_DIM)
            st[a + "dt_bias"] = 0.1 * r(d, std=1.0)
            st[a + "A_log"] = 0.3 * r(HEAD_DIM, std=1.0) if k3 else 0.3 * r(1, 1, HEADS, 1, std=1.0)
            st[a + "b_proj.weight"] = r(HEADS, HIDDEN)
            if k3:
                st[a + "g_proj.weight"] = r(d, HIDDEN)
            else:
                st[a + "g_a_proj.weight"] = r(HEAD_DIM, HIDDEN)
                st[a + "g_b_proj.weight"] = r(d, HEAD_DIM)
            st[a + "o_norm.weight"] = norm(HEAD_DIM)
            st[a + "o_proj.weight"] = r(HIDDEN, d)
        else:
            if k3:
                st[a + "q_a_proj.weight"] = r(Q_LORA, HIDDEN)
                st[a + "q_a_layernorm.weight"] = norm(Q_LORA)
                st[a + "q_b_proj.weight"] = r(HEADS * (NOPE + ROPE), Q_LORA)
                st[a + "g_proj.weight"] = r(HEADS * V_DIM, HIDDEN)
            else:
                st[a + "q_proj.weight"] = r(HEADS * (NOPE + ROPE), HIDDEN)
            st[a + "kv_a_proj_with_mqa.weight"] = r(KV_LORA + ROPE, HIDDEN)
            st[a + "kv_a_layernorm.weight"] = norm(KV_LORA)
            st[a + "kv_b_proj.weight"] = r(HEADS * (NOPE + V_DIM), KV_LORA)
            st[a + "o_proj.weight"] = r(HIDDEN, HEADS * V_DIM)
        if i == 0:
            st[b + "mlp.gate_proj.weight"] = r(DENSE_I, HIDDEN)
            st[b + "mlp.up_proj.weight"] = r(DENSE_I, HIDDEN)
            st[b + "mlp.down_proj.weight"] = r(HIDDEN, DENSE_I)
            continue
        m = b + "block_sparse_moe."
        st[m + "gate.weight"] = r(EXPERTS, HIDDEN)
        st[m + "gate.e_score_correction_bias"] = 0.01 * r(EXPERTS, std=1.0)
        width = latent or HIDDEN
        if latent:
            st[m + "routed_expert_down_proj.weight"] = r(latent, HIDDEN)
            st[m + "routed_expert_norm.weight"] = norm(latent)
            st[m + "routed_expert_up_proj.weight"] = r(HIDDEN, latent)
        for e in range(EXPERTS):
            for w, shape in (("w1", (MOE_I, width)), ("w3", (MOE_I, width)), ("w2", (width, MOE_I))):
                st[m + f"experts.{e}.{w}.weight"] = r(*shape)
        st[m + "shared_experts.gate_proj.weight"] = r(MOE_I, HIDDEN)
        st[m + "shared_experts.up_proj.weight"] = r(MOE_I, HIDDEN)
        st[m + "shared_experts.down_proj.weight"] = r(HIDDEN, MOE_I)
    if "quantization_config" in t:
        for k in [k for k in st if ".experts." in k and ".shared_experts." not in k]:
            packed, scale = mxfp4_pack(st.pop(k))
            st[k + "_packed"], st[k + "_scale"] = packed, scale
    return st


def mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors MXFP4 of a float [rows, cols]: nearest e2m1 code per value after a
    power-of-two scale per 32 inputs (the group's max at most 6); returns (packed uint8 [rows,
    cols / 2], scale uint8 E8M0 [rows, cols / 32])."""
    rows, cols = w.shape
    grp = w.reshape(rows, cols // 32, 32)
    amax = grp.abs().amax(-1).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    vals = grp / torch.exp2(e)[..., None]
    codes = (vals[..., None] - E2M1).abs().argmin(-1).to(torch.uint8).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (e + 127).to(torch.uint8)


def mxfp4_unpack(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`mxfp4_pack` (exact): float32 [rows, cols]."""
    rows = packed.shape[0]
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(rows, -1).long()
    vals = E2M1[codes].reshape(rows, -1, 32)
    return (vals * torch.exp2(scale.float() - 127)[..., None]).reshape(rows, -1)


def dense_state(cfg: dict, st: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The same model as plain float32 (MXFP4 experts decoded, the quantization config dropped)."""
    out = dict(st)
    for k in [k for k in out if k.endswith(".weight_packed")]:
        out[k[: -len("_packed")]] = mxfp4_unpack(out.pop(k), out.pop(k[: -len("_packed")] + "_scale"))
    cfg = {**cfg, "text_config": {k: v for k, v in _text(cfg).items() if k != "quantization_config"}} \
        if "text_config" in cfg else cfg
    return cfg, out
