"""compressed-tensors ``kernels="fast"``: without the native kernels, pack-quantized int4 through
torch's int4 CPU kernel (with them, the core's exact native kernels run the stored words: fast
mode is then exact, no second copy).

* the repacked weight computes the exactly dequantized weight's matmul within bfloat16
  rounding, for symmetric / asymmetric group 32..512, channel and tensor scales, stacked;
* model logits fast vs exact within issue 14's bound (max-rel <= 3e-2, argmax >= 0.95) on the
  llm-compressor W4A16-experts fixture and on a tiny W4A16 export; exact mode unchanged;
* an unknown ``kernels`` value is a ConfigError naming the option.
"""

from __future__ import annotations

import pytest
import quantplug
import torch
import torch.nn.functional as F
from conftest import VENDOR, rel_err
from quantplug.api import ConfigError
from quantplug.kernels import native
from quantplug.testing import random_state, tiny_config, write_checkpoint
from safetensors.torch import load_file

pytest.importorskip("quantplug_compressed_tensors")
from quantplug_compressed_tensors import kernels  # noqa: E402
from quantplug_compressed_tensors.export import export_w4a16  # noqa: E402
from quantplug_compressed_tensors.kernels import Layout  # noqa: E402

W4 = VENDOR / "ct_w4a16_experts_dsv3"
REF_W4 = load_file(str(VENDOR / "ct_w4a16_experts_dsv3.reference.safetensors"))


def _run(path, ids, kernels_opt=None):
    model = quantplug.load(path, progress=False, options={} if kernels_opt is None else {"kernels": kernels_opt})
    with torch.inference_mode():
        return model, model(ids)


def _check_fast_against_exact(path, ids):
    if native.library() is not None:  # with native kernels: fast mode is the exact native path
        exact_model, exact = _run(path, ids)
        fast_model, fast = _run(path, ids, "fast")
        assert getattr(fast_model.model.layers[1].mlp.experts.gate_proj, "_int4", None) is None
        assert torch.equal(fast, exact)
    with native.disabled():
        return _check_int4_against_exact(path, ids)


def _check_int4_against_exact(path, ids):
    exact_model, exact = _run(path, ids)
    fast_model, fast = _run(path, ids, "fast")
    fast_experts = fast_model.model.layers[1].mlp.experts.gate_proj
    exact_experts = exact_model.model.layers[1].mlp.experts.gate_proj
    assert "fast int4 kernel" in fast_experts.scheme.describe()
    assert getattr(fast_experts, "_int4", None) is not None and fast_experts._int4.shape[0] == fast_experts.weight_packed.shape[0]
    assert not fast_experts.scheme.weight_only
    assert getattr(exact_experts, "_int4", None) is None and exact_experts.scheme.weight_only
    assert "fast" not in exact_experts.scheme.describe()
    err = rel_err(fast, exact)
    agree = (fast.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert 0 < err <= 3e-2, err  # > 0: the fast path really ran (bfloat16 activations)
    assert agree >= 0.95, agree
    return exact, err, agree


def test_vendor_fixture_fast_vs_exact():
    exact, err, agree = _check_fast_against_exact(W4, REF_W4["input_ids"])
    # exact mode is what it was: the vendor's own logits (test_compressed_tensors checks 1e-4)
    assert rel_err(exact, REF_W4["vendor_logits"]) <= 1e-4


def test_tiny_export_fast_vs_exact(tmp_path):
    cfg = {**tiny_config(moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                         topk_group=2, vocab_size=256), "architectures": ["DeepseekV3ForCausalLM"]}
    dense = write_checkpoint(tmp_path / "dense", cfg, random_state(cfg))
    model = quantplug.load(dense, progress=False)
    res = export_w4a16(model, model.quantplug_plan, tmp_path / "w4", {})
    ids = torch.randint(0, cfg["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(1))
    _check_fast_against_exact(res.path, ids)


def test_unknown_kernels_value_names_the_option():
    with pytest.raises(ConfigError, match="kernels"):
        quantplug.plan(W4, options={"kernels": "turbo"})


@pytest.mark.parametrize("strategy, group, symmetric", [
    ("group", 32, True), ("group", 64, True), ("group", 128, False), ("group", 256, True), ("group", 512, True),
    ("channel", None, True), ("channel", None, False), ("tensor", None, True)])
def test_repacked_matmul_equals_exact_dequant(strategy, group, symmetric):
    g = torch.Generator().manual_seed(0)
    n, o, i = 3, 48, 512
    lay = Layout("packed", 4, strategy, group, None, o, i)
    q = torch.randint(-8, 8, (n, o, i), generator=g, dtype=torch.int8)
    packed = torch.stack([kernels.pack_rows(t, 4) for t in q])
    cols = 1 if strategy == "channel" else i // group if strategy == "group" else None
    scale = torch.rand((n, o, cols) if cols else (n, 1), generator=g) * 1e-2 + 1e-3
    zp = None if symmetric else torch.randint(-8, 8, (n, o, cols), generator=g).float()  # type: ignore[arg-type]
    fast = kernels.int4_repack(lay, packed, scale, zp)
    assert fast is not None
    pack, sz, kg = fast
    assert kg == min(group or i, 256)
    x = torch.randn(5, i, generator=g)
    for e in range(n):
        w = kernels.dequantize(lay, packed[e], scale[e], None if zp is None else zp[e], torch.float32)
        ref = F.linear(x, w)
        got = kernels.int4_linear(x, pack[e], sz[e], kg)
        assert got.dtype == x.dtype and got.shape == ref.shape
        # bfloat16 activations / scales / output: ~3 significant digits
        assert float((got - ref).norm() / ref.norm()) <= 1e-2
    # routed experts at once (the MoE path): bit for bit what one call per expert computes
    groups = [(2, 2), (0, 3)]
    want = torch.cat([kernels.int4_linear(x[:2], pack[2], sz[2], kg), kernels.int4_linear(x[2:], pack[0], sz[0], kg)])
    assert torch.equal(kernels.int4_grouped(x, list(zip(pack.unbind(0), sz.unbind(0))), kg, groups), want)


def test_rows_not_a_multiple_of_16_stay_exact():
    assert kernels.int4_kernel_group(Layout("packed", 4, "group", 32, None, 40, 64)) is None
    assert kernels.int4_kernel_group(Layout("packed", 8, "group", 32, None, 48, 64)) is None
    assert kernels.int4_kernel_group(Layout("packed", 4, "group", 32, None, 48, 64)) == 32


def test_fast_routed_experts_fuse_gate_and_up_bit_for_bit(tmp_path):
    """kernels="fast" runs the routed experts' gate and up as one int4 call (LinearScheme.fuse);
    the logits equal the one-call-per-projection model's bit for bit."""
    from quantplug.api import int4pack_rows_separable

    cfg = {**tiny_config(moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                         topk_group=2, vocab_size=256), "architectures": ["DeepseekV3ForCausalLM"]}
    dense = write_checkpoint(tmp_path / "dense", cfg, random_state(cfg))
    model = quantplug.load(dense, progress=False)
    res = export_w4a16(model, model.quantplug_plan, tmp_path / "w4", {})
    ctx = native.disabled()  # the int4 path is what runs without the native kernels
    ctx.__enter__()
    try:
        fast = quantplug.load(res.path, progress=False, options={"kernels": "fast"})
        _check_fused_experts(fast, cfg)
    finally:
        ctx.__exit__(None, None, None)


def _check_fused_experts(fast, cfg):
    from quantplug.api import int4pack_rows_separable

    experts = fast.model.layers[1].mlp.experts
    if not int4pack_rows_separable((64, 64)):
        assert experts.gate_up is None
        pytest.skip("this CPU's int4 layout does not split at 64 rows")
    assert isinstance(experts.gate_up.fn, kernels.Int4Fused)
    assert experts.gate_proj._int4.data_ptr() == experts.gate_up.fn.pack.data_ptr()  # a view, not a copy
    ids = torch.randint(0, cfg["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = fast(ids)
        experts.gate_up = None
        for layer in fast.model.layers[1:]:
            layer.mlp.experts.gate_up = None
        assert torch.equal(fast(ids), got)
