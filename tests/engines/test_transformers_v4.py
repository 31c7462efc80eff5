"""The transformers bridge on DeepSeek-V4: transformers 5.25's own ``DeepseekV4ForCausalLM`` running
quantplug's planned modules (the tiny release-named model of tests/v4_models.py: a sliding-window,
a CSA (indexer) and an HCA layer, hash and learned routers, mHC, a SwiGLU clamp that cuts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

qt = pytest.importorskip("quantplug_transformers", reason="quantplug-transformers is not installed "
                         "(pip install -e integrations/transformers)")
pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

import quantplug  # noqa: E402
from quantplug.api import QuantLinear  # noqa: E402
from quantplug.bridge import GroupedProduct  # noqa: E402
from quantplug.testing import write_checkpoint  # noqa: E402
from quantplug.testing.probes import forbid_data_reads  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as tf  # noqa: E402
from v4_models import CONFIG, T, V, float_tensors, reference_model, write_float_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    ref = reference_model()
    return ref, write_float_checkpoint(tmp_path_factory.mktemp("v4-bridge") / "ckpt", ref)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_bridged_model_is_transformers_v4_with_quantplugs_modules(v4):
    """Every projection transformers' model runs is the planned module: attention, compressor and
    indexer linears are QuantLinear, ``o_a_proj`` the grouped product of the planned ``wo_a``, the
    routed experts quantplug's; norms, mHC, sinks, router tensors are the loaded ones (no copy)."""
    _, path = v4
    model = qt.from_pretrained(path)
    assert type(model) is tf.DeepseekV4ForCausalLM
    layers = model.model.layers
    attn = layers[1].self_attn
    for m in (attn.q_a_proj, attn.q_b_proj, attn.kv_proj, attn.o_b_proj, attn.compressor.kv_proj,
              attn.compressor.gate_proj, attn.compressor.indexer.q_b_proj, attn.compressor.indexer.kv_proj,
              layers[2].self_attn.compressor.gate_proj, layers[0].mlp.shared_experts.down_proj, model.lm_head):
        assert isinstance(m, QuantLinear), type(m)
    assert isinstance(attn.o_a_proj, GroupedProduct)
    assert type(layers[0].mlp.experts).__module__ == "quantplug.blocks.moe"
    assert isinstance(layers[0].mlp.gate, tf.DeepseekV4HashRouter)
    assert isinstance(layers[1].mlp.gate, tf.DeepseekV4TopKRouter)
    assert [type(layer.self_attn.compressor).__name__ for layer in layers] == [
        "NoneType", "DeepseekV4CSACompressor", "DeepseekV4HCACompressor"]
    assert layers[2].self_attn.compressor.compress_rate == 8  # the release's ratio 8 (transformers reads only 128)
    qp_names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.attn_hc.fn" in qp_names and "model.layers.1.self_attn.sinks" in qp_names


def test_logits_and_generate_equal_quantplug(v4):
    """float32: the bridged model's logits = quantplug's within 1e-5 (40 tokens: past the window of 8,
    several CSA / HCA entries), and both = transformers' own model on the same weights; greedy
    ``generate`` (transformers' cache: window, compressor and indexer states) gives quantplug's
    tokens, 20 new tokens across windows and compressions."""
    ref, path = v4
    model = qt.from_pretrained(path)
    ours = quantplug.load(path, progress=False)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        bridged, own, want = model(ids).logits, ours(ids), ref(ids).logits
    assert _rel(bridged, own) < 1e-5
    assert _rel(bridged, want) < 1e-5
    prompt = ids[:1, :13]
    got = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, 13:].tolist()
    assert got == ours.generate(prompt, 20)[0, 13:].tolist()


def test_o_a_proj_as_a_plain_linear_fails_on_shapes(v4):
    """The grouped ``o_a_proj`` is what makes the bridge work: transformers calls it on the
    attention output split into groups ([..., groups, heads * head_dim / groups]); the planned
    ``wo_a`` placed there as a plain linear (every group through every block, input the whole
    width) cannot take that input, and the forward fails on shapes."""
    _, path = v4
    model = qt.from_pretrained(path)
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids)  # the grouped product runs
        attn = model.model.layers[0].self_attn
        grouped = attn.o_a_proj
        attn.o_a_proj = grouped.linear
        try:
            with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
                model(ids)
        finally:
            attn.o_a_proj = grouped


def _two_hca_ratios(root: Path) -> Path:
    """The tiny model with layer 1 an HCA layer of ratio 16 (layer 2 keeps ratio 8)."""
    tensors = float_tensors(reference_model())
    tensors = {k: v for k, v in tensors.items() if not k.startswith("layers.1.attn.indexer.")
               and not k.startswith("layers.1.attn.compressor.")}
    g = torch.Generator().manual_seed(7)
    h, hd = CONFIG["hidden_size"], CONFIG["head_dim"]
    for w in ("wkv", "wgate"):
        tensors[f"layers.1.attn.compressor.{w}.weight"] = torch.randn(hd, h, generator=g) * h ** -0.5
    tensors["layers.1.attn.compressor.ape"] = torch.randn(16, hd, generator=g)  # the release stores no .weight
    tensors["layers.1.attn.compressor.norm.weight"] = torch.ones(hd)
    cfg = {**CONFIG, "compress_ratios": [0, 16, 8, 0]}
    return write_checkpoint(root, cfg, tensors)


def test_hca_layers_of_two_ratios_are_refused_before_any_data_is_read(tmp_path):
    """transformers' DeepseekV4Config holds one HCA ratio: a checkpoint with HCA layers of ratios 16
    and 8 (quantplug runs it, as DeepSeek's reference does) is refused naming both, from headers."""
    path = _two_hca_ratios(tmp_path / "two")
    assert not quantplug.plan(path).errors
    with forbid_data_reads(path) as reads, pytest.raises(qt.BridgeError, match=r"HCA layers of 2 ratios \(ratio 8: "
                                                                               r"layers 2; ratio 16: layers 1\)"):
        qt.from_pretrained(path)
    assert not reads


def test_config_keys_transformers_reads_differently(v4, tmp_path):
    """No ``num_hash_layers`` in config.json: quantplug (and DeepSeek's reference) route every layer
    by the learned gate; transformers' own default would make 3 hash layers. The bridge gives
    transformers the layer types quantplug planned (the checkpoint then has no tid2eid to route by)."""
    ref, path = v4
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("num_hash_layers")
    tensors = {k: v for k, v in float_tensors(ref).items() if not k.endswith("tid2eid")}
    tensors["layers.0.ffn.gate.bias"] = torch.zeros(CONFIG["n_routed_experts"])
    other = write_checkpoint(tmp_path / "nohash", cfg, tensors)
    model = qt.from_pretrained(other)
    assert model.config.mlp_layer_types == ["moe"] * 3
    ids = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert _rel(model(ids).logits, quantplug.load(other, progress=False)(ids)) < 1e-5


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_release_format_stays_packed_and_equals_quantplug(tmp_path, expert_dtype):
    """DeepSeek-V4's FP8 + FP4 release layout (the fp8 backend): the bridged model holds the FP8
    linears as float8 and the routed experts as stored; its logits equal quantplug's within 1e-5
    (both with the release's dynamic FP8 activations, the backend's default), its greedy tokens
    quantplug's; weight-only (``activation_quant=none``) it equals transformers' own model on the
    dequantized weights."""
    pytest.importorskip("quantplug_fp8")
    from v4_models import set_release_weights, write_v4_release

    ref = reference_model()
    path = tmp_path / "release"
    deq = write_v4_release(path, ref, expert_dtype=expert_dtype)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    model = qt.from_pretrained(path)
    ours = quantplug.load(path, progress=False)
    assert model.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert isinstance(model.model.layers[1].self_attn.o_a_proj, GroupedProduct)
    with torch.no_grad():
        assert _rel(model(ids).logits, ours(ids)) < 1e-5
    prompt = ids[:1, :13]
    assert model.generate(prompt, max_new_tokens=20, do_sample=False)[0, 13:].tolist() == \
        ours.generate(prompt, 20)[0, 13:].tolist()
    weight_only = qt.from_pretrained(path, options={"activation_quant": "none"})
    with torch.no_grad():
        assert _rel(weight_only(ids).logits, set_release_weights(ref, deq)(ids).logits) < 1e-5
