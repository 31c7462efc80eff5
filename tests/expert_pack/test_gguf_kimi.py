"""Kimi-Linear (``kimi-linear``) and Kimi-K3 (``kimi-k3``) GGUFs as llama.cpp writes them.

The fixtures ``tests/data/vendor/gguf_kimi_*`` were made by llama.cpp's own converter and
quantizer (``tests/data/vendor/make_gguf_kimi.py``; llama-cpp-python 0.3.36's tree) from tiny
release-layout checkpoints (``kimi_tiny.py``, seeds in the script): F32, Q8_0 and Q4_K_M
(K-quants where rows are 256 wide, legacy fallbacks elsewhere) for Kimi-Linear; F32 and
MXFP4_MOE (routed experts converted from compressed-tensors MXFP4 by the converter; MLA
``attn_k_b`` / ``attn_v_b`` MXFP4 too, the rest Q8_0) for K3.

The reference is quantplug's own safetensors load of the same weights under the release names:
the GGUF dequantized by gguf-py (no quantplug code), ``-exp(A_log)`` unfolded (``log(-A)``), the
fused residual scores as ``res_norm`` with ``res_proj`` = 1, kv_b rebuilt from k_b / v_b, the
stacked experts split into w1 / w3 / w2. For the F32 files also the source checkpoint itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import quantplug
import torch
from quantplug.api import ggml, stats_sources
from quantplug.errors import PlanError
from quantplug.models.kimi import parse_kimi_config
from quantplug.plan import build_plan
from quantplug.testing import write_checkpoint

pytest.importorskip("gguf")

from quantplug_expert_pack.build import build_pack  # noqa: E402
from quantplug_expert_pack.export import join_kv_b  # noqa: E402
from quantplug_expert_pack.names import model_to_gguf  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
import kimi_tiny  # noqa: E402
from conftest import rel_err  # noqa: E402

VENDOR = Path(__file__).parents[1] / "data" / "vendor"
SEEDS = {"kimi_linear": 11, "kimi_k3": 13}  # make_gguf_kimi.SEEDS
#: fixture -> (arch, bounds of the logits' distance ||q - f32|| / ||f32|| to the F32 file: the
#: quantization error; measured 0.11 (Q8_0: 0.016-0.028 per token, a few tokens routed to other
#: experts), 0.33 (Q4_K_M), 0.58 (K3: experts MXFP4 from the MXFP4 source, MLA stacks MXFP4, the
#: rest Q8_0) on these tiny random models)
FIXTURES = {
    "gguf_kimi_linear_f32": ("kimi_linear", None),
    "gguf_kimi_linear_q8_0": ("kimi_linear", (1e-3, 0.2)),
    "gguf_kimi_linear_q4_k_m": ("kimi_linear", (1e-2, 0.6)),
    "gguf_kimi_k3_f32": ("kimi_k3", None),
    "gguf_kimi_k3_mxfp4_moe": ("kimi_k3", (1e-2, 1.0)),
}
#: 70 tokens: the chunked KDA form crosses a chunk (64) boundary
IDS = torch.randint(2, kimi_tiny.VOCAB, (2, 70), generator=torch.Generator().manual_seed(3))
STEPS = 6

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config(root: Path) -> dict:
    return json.loads((root / "config.json").read_text())


def _arch(cfg: dict) -> str:
    return cfg["architectures"][0]


def release_state(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``root``'s GGUF dequantized by gguf-py, under the release's names."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    cfg = _config(root)
    mc = parse_kimi_config(cfg, _arch(cfg), "text_config" in cfg)
    inv = {v: k for k, v in model_to_gguf(mc).items()}
    st: dict[str, torch.Tensor] = {}
    for rt in GGUFReader(root / "model.gguf").tensors:
        shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
        st[inv[rt.name]] = torch.from_numpy(np.array(dequantize(rt.data, rt.tensor_type))).float().reshape(shape)
    out: dict[str, torch.Tensor] = {}
    for k, t in st.items():
        if k.endswith(".self_attn.A"):
            out[k + "_log"] = torch.log(-t)
        elif k.endswith("_res_score.weight"):
            base = k[: -len("_score.weight")]
            out[f"{base}_norm.weight"] = t
            out[f"{base}_proj.weight"] = torch.ones(1, t.numel())
        elif k.endswith("_conv1d.weight"):
            out[k] = t.reshape(-1, 1, t.shape[-1])  # [1, C, 1, W], or [C, 1, W] after llama-quantize
        elif k.endswith(".k_b_proj.weight"):
            out[k.replace("k_b_proj", "kv_b_proj")] = join_kv_b(t, st[k.replace("k_b_proj", "v_b_proj")])
        elif k.endswith(".v_b_proj.weight"):
            continue
        elif ".block_sparse_moe.experts." in k:
            base, proj, _ = k.rsplit(".", 2)
            w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
            for e in range(t.shape[0]):
                out[f"{base}.{e}.{w}.weight"] = t[e]
        else:
            out[k] = t
    if "text_config" in cfg:
        out = {f"language_model.{k}": v for k, v in out.items()}
    return out


@pytest.fixture(scope="module")
def loaded():
    """fixture name -> (its GGUF load's logits on IDS, the model)."""
    cache: dict[str, tuple[torch.Tensor, object]] = {}

    def get(name: str):
        if name not in cache:
            model = quantplug.load(VENDOR / name, progress=False)
            with torch.no_grad():
                cache[name] = (model(IDS), model)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(FIXTURES))
def test_gguf_matches_safetensors_load_of_the_same_weights(name, loaded, tmp_path):
    root = VENDOR / name
    plan = build_plan(root)
    assert plan.backend == "expert_pack" and not plan.problems, plan.problems
    ours, model = loaded(name)
    ref_root = write_checkpoint(tmp_path / "ref", _config(root), release_state(root))
    ref = quantplug.load(ref_root, progress=False)
    with torch.no_grad():
        expected = ref(IDS)
    assert rel_err(ours, expected) <= 1e-5
    prompt = IDS[:, :12]
    assert torch.equal(model.generate(prompt, STEPS, eos_token_id=None), ref.generate(prompt, STEPS, eos_token_id=None))
    arch, bounds = FIXTURES[name]
    if bounds is not None:  # the quantization is real, and of the expected size
        f32, _ = loaded(f"gguf_{arch}_f32")
        lo, hi = bounds
        assert lo < float((ours - f32).norm() / f32.norm()) < hi


@pytest.mark.parametrize("arch", ["kimi_linear", "kimi_k3"])
def test_f32_gguf_matches_the_source_checkpoint(arch, loaded, tmp_path):
    """The F32 file against the release-layout checkpoint it was converted from (regenerated
    from its seed): ``-exp(A_log)`` taken folded, the fused residual scores, the conv reshape."""
    cfg = kimi_tiny.k3_config() if arch == "kimi_k3" else kimi_tiny.kimi_linear_config()
    src = write_checkpoint(tmp_path / "src", cfg, kimi_tiny.state(cfg, SEEDS[arch]))
    ours, model = loaded(f"gguf_{arch}_f32")
    with torch.no_grad():
        assert rel_err(ours, quantplug.load(src, progress=False)(IDS)) <= 1e-5
    kda = next(layer.self_attn for layer in model.text_lm().model.layers if layer.kda)
    assert "A" in kda._parameters and "A_log" not in kda._parameters
    if arch == "kimi_k3":
        res = model.text_lm().model.output_res
        assert set(res._parameters) == {"score"}


def test_mxfp4_experts_decode_as_gguf_py_and_attn_k_b_needs_no_q4_0():
    """K3's MXFP4_MOE file: routed experts and (llama.cpp's choice for 3-D tensors) the MLA
    attn_k_b / attn_v_b stacks in ggml MXFP4 (type 39); quantplug's decoder equals gguf-py's.
    The plugin once required attn_k_b = Q4_0 for "Kimi-K3" (no reader needs it: llama.cpp's
    kimi-k3 multiplies attn_k_b of any type); this file plans clean."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    root = VENDOR / "gguf_kimi_k3_mxfp4_moe"
    types = {}
    for rt in GGUFReader(root / "model.gguf").tensors:
        types[rt.name] = rt.tensor_type.name
        if rt.tensor_type.name == "MXFP4":
            ref = np.array(dequantize(rt.data, rt.tensor_type))
            ours = ggml.dequantize(torch.from_numpy(np.array(rt.data)), "MXFP4").reshape(ref.shape)
            assert torch.equal(ours.float(), torch.from_numpy(ref).float()), rt.name
    assert types["blk.1.ffn_gate_exps.weight"] == "MXFP4" and types["blk.3.attn_k_b.weight"] == "MXFP4"
    plan = build_plan(root)
    assert not plan.problems
    assert plan.to_dict()["attention_layouts"]["model.layers.3.self_attn"] == "split_kv"


def _with_config(tmp_path: Path, name: str, edit) -> Path:
    root = tmp_path / name
    shutil.copytree(VENDOR / name, root)
    cfg = _config(root)
    edit(cfg.get("text_config", cfg))
    (root / "config.json").write_text(json.dumps(cfg))
    return root


@pytest.mark.parametrize("name,edit,want", [
    ("gguf_kimi_k3_f32", lambda t: t["linear_attn_config"].update(gate_lower_bound=-4.0),
     "kimi-k3.kda.gate_lower_bound = -5.0 contradicts config.json linear_attn_config.gate_lower_bound = -4.0"),
    ("gguf_kimi_k3_f32", lambda t: t.update(attn_res_block_size=3),
     "kimi-k3.attn_res.block_size = 2 contradicts config.json attn_res_block_size = 3"),
    ("gguf_kimi_k3_f32", lambda t: t.update(activation_situ_beta=2.0),
     "kimi-k3.activation.situ_beta = 4.0 contradicts config.json activation_situ_beta = 2.0"),
    ("gguf_kimi_linear_f32", lambda t: t["linear_attn_config"].update(short_conv_kernel_size=3),
     "kimi-linear.ssm.conv_kernel = 4 contradicts config.json linear_attn_config.short_conv_kernel_size = 3"),
    ("gguf_kimi_linear_f32", lambda t: t.update(routed_scaling_factor=2.0),
     "kimi-linear.expert_weights_scale = 2.5 contradicts config.json routed_scaling_factor = 2.0"),
    ("gguf_kimi_linear_f32", lambda t: t.update(num_attention_heads=10),
     "kimi-linear.attention.head_count = 2 contradicts config.json num_attention_heads = 10"),
    ("gguf_kimi_k3_f32", lambda t: t.update(num_attention_heads=10),
     "kimi-k3.attention.head_count = 2 contradicts config.json num_attention_heads = 10"),
    ("gguf_kimi_k3_f32", lambda t: t.update(moe_renormalize=False),
     "kimi-k3.expert_weights_norm = True contradicts config.json moe_renormalize = False"),
    ("gguf_kimi_linear_f32", lambda t: t["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4]),
     "kimi-linear.attention.head_count_kv[1] = 1 makes layer 1 MLA, but config.json linear_attn_config lists "
     "layer 2 (1-based) in kda_layers"),
])
def test_metadata_contradicting_config_is_a_plan_problem(tmp_path, name, edit, want):
    root = _with_config(tmp_path, name, edit)
    msgs = [p.message for p in build_plan(root).problems]
    assert any(want in m for m in msgs), msgs
    with pytest.raises(PlanError):
        quantplug.plan(root)


def test_absent_key_and_wrong_architecture_are_plan_problems(tmp_path):
    # a K3 file read with a config that has a latent MoE llama.cpp would not know of: latent size
    # differs; and a Kimi-Linear file under a K3 config
    root = _with_config(tmp_path, "gguf_kimi_linear_f32", lambda t: None)
    k3 = kimi_tiny.k3_config()
    (root / "config.json").write_text(json.dumps(k3))
    msgs = [p.message for p in build_plan(root).problems]
    assert any("'kimi-linear' but config.json is KimiK3ForConditionalGeneration, which llama.cpp writes as "
               "'kimi-k3'" in m for m in msgs), msgs


def test_missing_folded_a_and_res_score_are_named_at_plan_time(tmp_path):
    cfg = kimi_tiny.k3_config()
    st = kimi_tiny.state(cfg, 1)
    del st["language_model.model.layers.0.self_attn.A_log"]
    del st["language_model.model.layers.1.mlp_res_proj.weight"]
    msgs = [p.message for p in build_plan(write_checkpoint(tmp_path / "c", cfg, st)).problems]
    assert any("needs language_model.model.layers.0.self_attn.A_log (or its folded form" in m for m in msgs), msgs
    assert any("only language_model.model.layers.1.mlp_res_norm.weight stored" in m for m in msgs), msgs


def test_expert_pack_of_k3_gguf_with_split_kv(tmp_path, loaded):
    """``quantplug expert-pack build`` on K3's MXFP4_MOE file (split K/V, MXFP4 experts under
    block_sparse_moe): the pack loads with a small expert cache and gives the same logits."""
    src = VENDOR / "gguf_kimi_k3_mxfp4_moe"
    dst = tmp_path / "packed"
    res = build_pack(src, dst, progress=False)
    assert res.layers == 3 and res.experts == kimi_tiny.EXPERTS
    one = build_plan(dst).checkpoint  # the GGUF no longer holds the routed experts: the pack does, per expert
    assert not any("_exps" in (t.stored_name or t.name) for t in one.tensors.values() if t.file.suffix == ".gguf")
    w1 = one.tensors["model.layers.3.block_sparse_moe.experts.0.w1.weight"]
    assert (w1.stored_name, w1.file.name) == ("blk.3.ffn_gate_exps.weight[0]", "experts.qpack")
    model = quantplug.load(dst, progress=False, options={"expert_cache_mb": 0.02})
    assert model.quantplug_plan.to_dict()["attention_layouts"]["model.layers.3.self_attn"] == "split_kv"
    with torch.no_grad():
        out = model(IDS)
    assert torch.equal(out, loaded("gguf_kimi_k3_mxfp4_moe")[0])
    stats = stats_sources(model)["expert_cache"].stats()
    assert stats["evictions"] > 0  # the budget (0.02 MiB) holds fewer experts than the model has


LLAMA_CPP = os.environ.get("QUANTPLUG_LLAMA_CPP")


@pytest.mark.skipif(not LLAMA_CPP, reason="QUANTPLUG_LLAMA_CPP (a llama.cpp tree with its converter) not set")
@pytest.mark.parametrize("arch", ["kimi_linear", "kimi_k3"])
def test_fixture_is_the_converters_output(arch, tmp_path):
    """llama.cpp's converter on the regenerated source writes the F32 fixture's tensors exactly."""
    from gguf import GGUFReader

    sys.path.insert(0, str(VENDOR))
    import make_gguf_kimi

    cfg = kimi_tiny.k3_config() if arch == "kimi_k3" else kimi_tiny.kimi_linear_config()
    src = write_checkpoint(tmp_path / "src", cfg, kimi_tiny.state(cfg, SEEDS[arch]))
    out = tmp_path / "out.gguf"
    try:
        make_gguf_kimi.convert(Path(LLAMA_CPP), src, out, "f32")
    except subprocess.CalledProcessError as e:  # pragma: no cover - environment
        pytest.fail(f"converter failed: {e}")
    fresh = {t.name: np.array(t.data) for t in GGUFReader(out).tensors}
    fixed = {t.name: np.array(t.data) for t in GGUFReader(VENDOR / f"gguf_{arch}_f32" / "model.gguf").tensors}
    assert fresh.keys() == fixed.keys()
    assert all(np.array_equal(fresh[k], fixed[k]) for k in fixed)
