"""The Kimi-Linear / Kimi-K3 test assets: the plain-torch reference (``tests/kimi_reference.py``) and
the tiny checkpoints (``quantplug.testing.kimi``).

(a) the Kimi-Linear reference equals transformers 5.24's ``KimiLinearForCausalLM`` on a prompt longer
than its KDA chunk (64), and the release-named checkpoint round-trips through ``from_pretrained``;
(b) the K3 reference is sane: every K3 constant and K3-only weight moves the logits, routing and the
depth softmax are not degenerate, both ``A_log`` layouts are the same model;
(c) the writers keep the release names, shapes and dtypes (ARCHITECTURES B2 / C2).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kimi_reference as kr
import pytest
import torch
from conftest import rel_err
from quantplug.testing.kimi import (
    hf_to_release,
    kimi_k3_config,
    kimi_k3_state,
    kimi_linear_config,
    kimi_linear_hf_checkpoint,
    kimi_linear_state,
    kimi_text_shapes,
    release_dtypes,
    release_to_hf,
    write_kimi_checkpoint,
)
from safetensors import safe_open

pytestmark = pytest.mark.usefixtures("one_torch_thread")

T_LONG = 70  # > transformers' KDA chunk of 64


def _ids(b: int, t: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _read(root: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and every tensor of a written checkpoint (one or more shards)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[k] = sf.get_tensor(k)
    return json.loads((root / "config.json").read_text()), out


# ---------------------------------------------------------------------------------------------
# (a) Kimi-Linear: reference vs transformers

@pytest.fixture(scope="module")
def kl_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, Any]:
    cfg = kimi_linear_config()
    root, model = kimi_linear_hf_checkpoint(tmp_path_factory.mktemp("kl") / "ckpt", cfg)
    return cfg, root, model


def test_kimi_linear_reference_matches_transformers(kl_hf: tuple[dict[str, Any], Path, Any]) -> None:
    cfg, root, model = kl_hf
    ids = _ids(2, T_LONG, cfg["vocab_size"])
    with torch.no_grad():
        want = model(ids).logits
    _, state = _read(root)
    got = kr.kimi_linear_logits(cfg, state, ids)
    assert got.shape == (2, T_LONG, cfg["vocab_size"])
    assert want.std() > 0.5  # informative logits, not a near-uniform distribution
    assert rel_err(got, want) < 1e-5


def test_kimi_linear_checkpoint_round_trips_through_transformers(kl_hf: tuple[dict[str, Any], Path, Any]) -> None:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg, root, model = kl_hf
    # transformers reads the 1-based lists as the release does (its fallback without them differs)
    lin = cfg["linear_attn_config"]
    assert KimiLinearConfig(**cfg).layer_types == [
        "linear_attention" if i + 1 in lin["kda_layers"] else "full_attention" for i in range(cfg["num_hidden_layers"])]
    loaded = KimiLinearForCausalLM.from_pretrained(root, dtype=torch.float32, attn_implementation="eager").eval()
    ids = _ids(1, 20, cfg["vocab_size"], seed=3)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    # the written names are the release names, and the conversions are inverse
    _, state = _read(root)
    assert set(state) == set(kimi_text_shapes(cfg))
    expected = kimi_linear_state(cfg)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    back = hf_to_release(release_to_hf(expected), cfg)
    assert set(back) == set(expected) and all(torch.equal(back[k], expected[k]) for k in expected)


def test_transformers_save_pretrained_names(kl_hf: tuple[dict[str, Any], Path, Any], tmp_path: Path) -> None:
    """What transformers 5.24 writes: the release names, except that its reverse of
    ``block_sparse_moe -> mlp`` also renames the dense layer 0 (``layers.0.block_sparse_moe.gate_proj``),
    which is why :func:`hf_to_release` exists. Stays true if transformers fixes that."""
    cfg, _, model = kl_hf
    model.save_pretrained(tmp_path)
    _, saved = _read(tmp_path)
    names = {k.replace("model.layers.0.block_sparse_moe.", "model.layers.0.mlp.") for k in saved}
    assert names == set(kimi_text_shapes(cfg))


def test_bounded_gate_kda_matches_transformers_glm5_next() -> None:
    """K3's bounded forget gate (``gate_lower_bound * sigmoid(exp(A_log) * gpre)``, A_log ``[H]``) has
    a transformers oracle: GLM-5-Next's linear attention is Kimi-Linear's KDA with exactly that gate
    (and the low-rank output gate). One K3 KDA layer against it, past the 64-token chunk."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    cfg = kimi_k3_config(linear_attn_config={"use_full_rank_gate": False})
    text, lin = cfg["text_config"], cfg["text_config"]["linear_attn_config"]
    pre = "language_model.model.layers.0.self_attn."
    own = {k[len(pre):]: v for k, v in kimi_k3_state(cfg).items() if k.startswith(pre)}
    hf_cfg = SimpleNamespace(hidden_size=text["hidden_size"], linear_num_heads=lin["num_heads"],
                             linear_head_dim=lin["head_dim"], linear_conv_kernel_dim=lin["short_conv_kernel_size"],
                             hidden_act="silu", rms_norm_eps=text["rms_norm_eps"],
                             linear_lower_bound=lin["gate_lower_bound"], layer_types=["linear_attention"])
    layer = Glm5NextTextLinearAttention(hf_cfg, 0).eval()
    gate = {"f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"}
    hf_state = {("forget_gate." + k if k in gate else k): v for k, v in own.items() if "conv1d" not in k}
    hf_state["conv1d.weight"] = torch.cat([own[f"{x}_conv1d.weight"] for x in "qkv"])
    layer.load_state_dict(hf_state, strict=True)
    x = torch.randn(2, T_LONG, text["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = layer(x)
    got = kr.kda(text, x, lambda n: own[n.removeprefix("attn.")], "attn")
    assert rel_err(got, want) < 1e-5


# ---------------------------------------------------------------------------------------------
# (b) Kimi-K3: sanity and feature sensitivity

T_K3 = 24


@pytest.fixture(scope="module")
def k3() -> tuple[dict[str, Any], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    cfg = kimi_k3_config()
    state = kimi_k3_state(cfg)
    ids = _ids(2, T_K3, cfg["text_config"]["vocab_size"], seed=5)
    return cfg, state, ids, kr.k3_logits(cfg, state, ids)


def test_k3_config_shape() -> None:
    cfg = kimi_k3_config()
    text = cfg["text_config"]
    assert (cfg["model_type"], cfg["architectures"]) == ("kimi_k3", ["KimiK3ForConditionalGeneration"])
    assert (text["model_type"], text["architectures"]) == ("kimi_linear", ["KimiLinearForCausalLM"])
    n, block = text["num_hidden_layers"], text["attn_res_block_size"]
    lin = text["linear_attn_config"]
    assert n in lin["full_attn_layers"] and lin["kda_layers"]  # MLA on the last layer, as K3
    assert sorted(lin["full_attn_layers"] + lin["kda_layers"]) == list(range(1, n + 1))
    assert len([i for i in range(n) if i % block == 0]) >= 2  # at least two write layers
    assert text["routed_expert_hidden_size"] < text["hidden_size"]
    assert kimi_k3_config(num_hidden_layers=9)["text_config"]["linear_attn_config"]["full_attn_layers"] == [4, 8, 9]


def test_k3_reference_is_informative(k3: tuple[dict[str, Any], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]) -> None:
    cfg, state, ids, logits = k3
    assert torch.isfinite(logits).all() and 0.5 < logits.std() < 5.0
    trace: kr.Trace = {}
    assert torch.equal(kr.k3_logits(cfg, state, ids, trace=trace), logits)
    # routing: different tokens pick different expert pairs, and most experts are used somewhere
    for combine in trace["route"]:
        picks = {tuple(row.nonzero().flatten().tolist()) for row in combine}
        assert len(picks) >= 8
        assert int((combine != 0).any(0).sum()) >= 6
    # depth softmax: far from uniform at every aggregation with more than one row
    spread = [float((a.max(-1).values - a.min(-1).values).mean()) for a in trace["attn_res"] if a.shape[-1] > 1]
    assert spread and min(spread) > 0.05 and max(spread) > 0.3
    # 5 layers x 2 sides + output, the first attention side skips aggregation
    assert len(trace["attn_res"]) == 2 * cfg["text_config"]["num_hidden_layers"]
    assert max(a.shape[-1] for a in trace["attn_res"]) == 4  # embedding + 2 snapshots + partial sum


def test_k3_a_log_layouts_are_one_model(k3: tuple[dict[str, Any], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]) -> None:
    cfg, state, ids, logits = k3
    sg = kimi_k3_state(cfg, a_log="head_dim")
    name = "language_model.model.layers.0.self_attn.A_log"
    heads, head_dim = (cfg["text_config"]["linear_attn_config"][k] for k in ("num_heads", "head_dim"))
    assert state[name].shape == (heads,) and sg[name].shape == (head_dim,)
    assert torch.equal(kr.k3_logits(cfg, sg, ids), logits)
    decoy = dict(sg)
    decoy[name] = sg[name].clone()
    decoy[name][heads:] += 1.0  # entries past the first H are not read
    assert torch.equal(kr.k3_logits(cfg, decoy, ids), logits)
    decoy[name][0] += 1.0
    assert rel_err(kr.k3_logits(cfg, decoy, ids), logits) > 1e-3


def _text_edit(**fields: Any) -> Callable[[dict[str, Any], dict[str, torch.Tensor]], None]:
    def edit(cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        for k, v in fields.items():
            if k in ("gate_lower_bound", "use_full_rank_gate"):
                cfg["text_config"]["linear_attn_config"][k] = v
            else:
                cfg["text_config"][k] = v
    return edit


def _scale(name: str, factor: float) -> Callable[[dict[str, Any], dict[str, torch.Tensor]], None]:
    def edit(cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        state[f"language_model.model.{name}"] = state[f"language_model.model.{name}"] * factor
    return edit


K3_EDITS = {
    "block_size_3": _text_edit(attn_res_block_size=3),
    "block_size_ge_layers": _text_edit(attn_res_block_size=8),
    "no_attn_res": _text_edit(attn_res_block_size=None),
    "latent_norm_off": _text_edit(latent_moe_use_norm=False),
    "gate_lower_bound": _text_edit(gate_lower_bound=-3.0),
    "softplus_gate": _text_edit(gate_lower_bound=None),
    "situ_beta": _text_edit(activation_situ_beta=2.0),
    "situ_linear_beta": _text_edit(activation_situ_linear_beta=2.0),
    "silu": _text_edit(hidden_act="silu"),
    "mla_output_gate_off": _text_edit(mla_use_output_gate=False),
    "kda_full_rank_gate_weight": _scale("layers.1.self_attn.g_proj.weight", 0.5),
    "mla_gate_weight": _scale("layers.3.self_attn.g_proj.weight", 0.5),
    "mla_q_a_layernorm": _scale("layers.4.self_attn.q_a_layernorm.weight", 0.5),
    "attn_res_proj": _scale("layers.2.mlp_res_proj.weight", 0.0),
    "output_attn_res_proj": _scale("output_attn_res_proj.weight", 0.0),
    "routed_expert_norm": _scale("layers.2.block_sparse_moe.routed_expert_norm.weight", 0.5),
    "routed_expert_down_proj": _scale("layers.2.block_sparse_moe.routed_expert_down_proj.weight", 0.5),
    "shared_experts": _scale("layers.2.block_sparse_moe.shared_experts.down_proj.weight", 0.5),
    "conv": _scale("layers.0.self_attn.k_conv1d.weight", 0.5),
    "dt_bias": _scale("layers.0.self_attn.dt_bias", 0.5),
}


@pytest.mark.parametrize("edit", list(K3_EDITS))
def test_k3_feature_moves_logits(edit: str,
                                 k3: tuple[dict[str, Any], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]) -> None:
    cfg, state, ids, logits = k3
    cfg, state = copy.deepcopy(cfg), dict(state)
    K3_EDITS[edit](cfg, state)
    assert rel_err(kr.k3_logits(cfg, state, ids), logits) > 1e-3


def test_k3_routed_scaling_is_almost_cancelled_by_the_latent_norm(
        k3: tuple[dict[str, Any], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]) -> None:
    """C3: with the latent RMSNorm after the routed sum, ``routed_scaling_factor`` only moves eps."""
    cfg, state, ids, logits = k3
    cfg = copy.deepcopy(cfg)
    cfg["text_config"]["routed_scaling_factor"] = 1.0
    assert 0 < rel_err(kr.k3_logits(cfg, state, ids), logits) < 1e-3
    cfg["text_config"]["latent_moe_use_norm"] = False
    assert rel_err(kr.k3_logits(cfg, state, ids), kr.k3_logits(
        {**cfg, "text_config": {**cfg["text_config"], "routed_scaling_factor": 2.5}}, state, ids)) > 1e-3


def test_k3_is_causal(k3: tuple[dict[str, Any], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]) -> None:
    """A later token does not change earlier logits (KDA recurrence, conv, MLA mask, per-token depth mix)."""
    cfg, state, ids, logits = k3
    other = ids.clone()
    other[:, -1] = (other[:, -1] + 1) % cfg["text_config"]["vocab_size"]
    got = kr.k3_logits(cfg, state, other)
    assert torch.allclose(got[:, :-1], logits[:, :-1], rtol=0, atol=1e-5)
    assert not torch.allclose(got[:, -1], logits[:, -1])


# ---------------------------------------------------------------------------------------------
# (c) checkpoint writers

K3_KDA = {"q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj", "dt_bias",
          "A_log", "b_proj", "g_proj", "o_norm", "o_proj"}
K3_MLA = {"q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
          "o_proj"}
K3_LAYER = {"input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "self_attention_res_proj",
            "mlp_res_norm", "mlp_res_proj"}
K3_MOE = {"gate", "gate.e_score_correction_bias", "shared_experts.gate_proj", "shared_experts.up_proj",
          "shared_experts.down_proj", "routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj"}


def _module(name: str) -> str:
    return name.removesuffix(".weight")


def test_k3_release_checkpoint_names_shapes_dtypes(tmp_path: Path) -> None:
    cfg = kimi_k3_config()
    text = cfg["text_config"]
    state = kimi_k3_state(cfg, a_log="head_dim", vision=True)
    root = write_kimi_checkpoint(tmp_path / "k3", cfg, state, dtype="release", shards=2)
    assert (root / "model.safetensors.index.json").exists()
    config, got = _read(root)
    assert config == cfg
    assert set(got) == set(state)
    assert all(got[k].shape == state[k].shape for k in state)
    for k, t in got.items():
        fp32 = k.endswith(("conv1d.weight", ".dt_bias", ".A_log"))
        assert t.dtype == (torch.float32 if fp32 else torch.bfloat16), k
    # the C2 table, layer by layer
    lin = text["linear_attn_config"]
    p = "language_model.model.layers"
    for i in range(text["num_hidden_layers"]):
        own = {_module(k[len(f"{p}.{i}."):]) for k in got if k.startswith(f"{p}.{i}.")}
        attn = {n.removeprefix("self_attn.") for n in own if n.startswith("self_attn.")}
        assert attn == (K3_KDA if i + 1 in lin["kda_layers"] else K3_MLA), i
        assert {n for n in own if "." not in n} == K3_LAYER
        mlp = {n.split(".", 1)[1] for n in own if n.startswith(("mlp.", "block_sparse_moe."))}
        if i == 0:
            assert mlp == {"gate_proj", "up_proj", "down_proj"}
        else:
            experts = {n for n in mlp if n.startswith("experts.")}
            assert mlp - experts == K3_MOE
            assert experts == {f"experts.{e}.{w}" for e in range(text["num_experts"]) for w in ("w1", "w2", "w3")}
            latent, mi = text["routed_expert_hidden_size"], text["moe_intermediate_size"]
            assert got[f"{p}.{i}.block_sparse_moe.experts.0.w1.weight"].shape == (mi, latent)
            assert got[f"{p}.{i}.block_sparse_moe.experts.0.w2.weight"].shape == (latent, mi)
    top = {k for k in got if not k.startswith(p)}
    assert top == {"language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
                   "language_model.model.output_attn_res_norm.weight", "language_model.model.output_attn_res_proj.weight",
                   "language_model.lm_head.weight", "vision_tower.patch_embed.proj.weight", "mm_projector.proj.0.weight"}
    assert got["language_model.model.layers.0.self_attention_res_proj.weight"].shape == (1, text["hidden_size"])
    # the values are the state's, rounded to the release dtypes (and the reference reads bf16 as is)
    rounded = release_dtypes(state)
    assert all(torch.equal(got[k], rounded[k]) for k in state)
    ids = _ids(1, 12, text["vocab_size"])
    assert torch.equal(kr.k3_logits(cfg, got, ids), kr.k3_logits(cfg, {k: v.float() for k, v in rounded.items()}, ids))


def test_kimi_linear_checkpoint_dtypes(tmp_path: Path) -> None:
    cfg = kimi_linear_config()
    state = kimi_linear_state(cfg)
    heads = cfg["linear_attn_config"]["num_heads"]
    assert state["model.layers.0.self_attn.A_log"].shape == (1, 1, heads, 1)
    assert state["model.layers.0.self_attn.q_conv1d.weight"].shape == (64, 1, 4)
    _, f32 = _read(write_kimi_checkpoint(tmp_path / "f32", cfg, state))
    assert all(f32[k].dtype == torch.float32 and torch.equal(f32[k], state[k]) for k in state)
    _, bf = _read(write_kimi_checkpoint(tmp_path / "bf16", cfg, state, dtype=torch.bfloat16))
    assert {t.dtype for t in bf.values()} == {torch.bfloat16}
    _, rel = _read(write_kimi_checkpoint(tmp_path / "rel", cfg, state, dtype="release"))
    assert rel["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert rel["model.layers.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        write_kimi_checkpoint(tmp_path / "bad", cfg, state, dtype="fp8")
