"""DeepSeek-V4's release quantization through the ``fp8`` backend: the tiny V4 of tests/v4_models.py
quantized by an independent writer (``write_v4_release``: FP8 dense linears with E8M0 / F32 block scales,
FP4 E2M1 routed experts with E8M0 scales per 32, or FP8 experts as V4-Flash-Base) and loaded natively,
against transformers 5.25's ``DeepseekV4ForCausalLM`` holding the dequantized weights (and transformers'
own FP8 / FP4 dequantizer on the stored bytes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import quantplug
import torch
from quantplug import experts
from quantplug.api import dense_state, stats_sources
from quantplug.errors import PlanError
from quantplug.kernels import compute, native
from quantplug.plan import build_plan
from quantplug.testing import write_checkpoint
from quantplug.testing.probes import forbid_data_reads
from safetensors.torch import load_file

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
sys.path.insert(0, str(Path(__file__).parents[1]))
from v4_models import (  # noqa: E402
    INTER,
    T,
    V,
    reference_model,
    release_config,
    release_tensors,
    set_release_weights,
    write_v4_release,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NONE = {"activation_quant": "none"}
#: the native kernels are built (a C compiler): the layers then compute on their bound forms
NATIVE = native.library() is not None
IDS = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def ref() -> Any:
    return reference_model()


@pytest.fixture(scope="module")
def release(ref: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], Any]:
    """The FP4 release (expert_dtype at the top level), its dequantized weights and transformers on them."""
    path = tmp_path_factory.mktemp("v4rel") / "fp4"
    values = write_v4_release(path, ref)
    return path, values, set_release_weights(ref, values)


def test_writer_agrees_with_transformers_dequantizer(release):
    """The writer's values are what transformers' own FP8 / FP4 dequantizer (``Fp8Dequantize``) reads
    from the stored bytes: the test's quantizer and the format agree, independently of quantplug."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    path, values, _ = release
    stored = load_file(str(path / "model.safetensors"))
    deq = Fp8Dequantize(None)
    checked = {torch.float8_e4m3fn: 0, torch.int8: 0}
    for name, t in stored.items():
        if t.dtype in checked:
            scale = stored[name.removesuffix("weight") + "scale"]
            assert scale.dtype == torch.float8_e8m0fnu
            got = deq._dequantize_one(t, scale, torch.float32)
            assert torch.equal(got, values[name]), name
            checked[t.dtype] += 1
    assert checked[torch.float8_e4m3fn] == 3 * 8 + 1 and checked[torch.int8] == 3 * 8 * 3  # + indexer.wq_b


def test_plan_schemes_and_packed_experts(release):
    path, _, _ = release
    with forbid_data_reads(path) as reads:
        plan = quantplug.plan(path)
    assert not reads.events  # headers only
    assert plan.backend == "fp8" and not plan.problems
    schemes = plan.schemes()
    assert schemes["layers.1.ffn.experts.gate_proj"].startswith("fp4 e2m1 packed")
    assert schemes["layers.1.attn.wo_a"] == schemes["layers.2.ffn.shared_experts.w2"]
    assert schemes["layers.1.attn.wo_a"].startswith("fp8 e4m3 block [128, 128], scale e8m0")
    assert schemes["layers.1.attn.compressor.wkv"] == schemes["head"] == "dense"
    model = quantplug.load(path, options=NONE)
    stored = load_file(str(path / "model.safetensors"))
    for m in (model.layers[2].ffn.experts.gate_proj, model.layers[0].ffn.experts.down_proj):
        # stacked as stored: I8 [E, N, K/2] + E8M0 [E, N, K/32], nothing else (no dense copy)
        assert {n: p.dtype for n, p in m.named_parameters()} == {"weight": torch.int8, "scale": torch.float8_e8m0fnu}
        assert list(m.named_buffers()) == []
        assert m.weight.shape[-1] * 2 == m.in_features and (compute.bound(m) is not None) == NATIVE
    gate = model.layers[2].ffn.experts.gate_proj
    assert torch.equal(gate.weight[5], stored["layers.2.ffn.experts.5.w1.weight"])
    assert torch.equal(gate.scale[5].view(torch.uint8), stored["layers.2.ffn.experts.5.w1.scale"].view(torch.uint8))
    wo_a = model.layers[1].attn.wo_a
    assert wo_a.weight.dtype == torch.float8_e4m3fn and wo_a.scale.dtype == torch.float8_e8m0fnu
    assert (compute.bound(wo_a) is not None) == NATIVE
    expert_bytes = sum(p.numel() * p.element_size() for layer in model.layers for p in layer.ffn.experts.parameters())
    assert expert_bytes == sum(t.numel() * t.element_size() for n, t in stored.items() if ".experts." in n)


def _variant(ref: Any, tmp: Path, **kw: Any) -> tuple[Path, Any]:
    values = write_v4_release(tmp, ref, **kw)
    return tmp, set_release_weights(ref, values)


@pytest.mark.parametrize("kw", [
    {},  # expert_dtype at the top level (V4)
    {"where": "quantization_config"},  # V4.1 / transformers
    {"where": None},  # no expert_dtype: the headers decide
    {"block": (16, 16)},  # several scale blocks per matrix, partial edge blocks (24, 96 rows)
    {"expert_dtype": "fp8", "scale_dtype": "F32"},  # V4-Flash-Base
    {"expert_dtype": "fp8", "where": None},  # FP8 experts with E8M0 scales (DeepSeek's convert --expert-dtype fp8)
], ids=["top", "in-qc", "absent", "block16", "flash-base", "fp8-e8m0"])
def test_weight_only_logits_match_transformers(ref, release, tmp_path, kw):
    """The issue's Done-when: activation_quant=none within 1e-5 relative of transformers on the
    dequantized weights."""
    path, want_model = (release[0], release[2]) if not kw else _variant(ref, tmp_path / "v", **kw)
    model = quantplug.load(path, options=NONE)
    with torch.no_grad():
        got, want = model(IDS), want_model(IDS).logits
    err = rel(got, want)
    assert err < 1e-5, err
    fp8_experts = kw.get("expert_dtype") == "fp8"
    e = model.layers[1].ffn.experts.up_proj
    assert e.weight.dtype == (torch.float8_e4m3fn if fp8_experts else torch.int8)
    scale_dtype = torch.float32 if kw.get("scale_dtype") == "F32" else torch.float8_e8m0fnu
    assert e.scale.dtype == scale_dtype and model.layers[0].attn.wq_b.scale.dtype == scale_dtype


def test_bfloat16_model(release):
    """A bfloat16 model keeps the stored FP8 / FP4 bytes; its logits stay near the float32 model's
    (2.8e-2 relative measured)."""
    path, _, _ = release
    bf16 = quantplug.load(path, dtype=torch.bfloat16, options=NONE)
    f32 = quantplug.load(path, options=NONE)
    assert bf16.layers[1].ffn.experts.gate_proj.weight.dtype == torch.int8
    assert bf16.layers[1].attn.wq_b.weight.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        assert rel(bf16(IDS), f32(IDS)) < 0.1
        assert torch.isfinite(quantplug.load(path, dtype=torch.bfloat16)(IDS)).all()  # dynamic activations


def _act_quant(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """DeepSeek's act_quant with ue8m0 scales, written here: per row, groups of ``group`` (one
    partial group when the row is shorter): s = 2^ceil(log2(max(amax, 1e-4) / 448))."""
    out = torch.empty_like(x)
    for c in range(0, x.shape[-1], group):
        p = x[..., c:c + group]
        s = torch.exp2(torch.ceil(torch.log2(p.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448)))
        out[..., c:c + group] = (p / s).to(torch.float8_e4m3fn).float() * s
    return out


#: transformers' modules that the release stores in FP8 (their inputs are quantized in dynamic mode)
_TF_FP8 = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_a_proj", "self_attn.o_b_proj",
           "indexer.q_b_proj", "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj")


def _emulated(want_model: Any) -> Any:
    """transformers' model with DeepSeek's FP8 activations (:func:`_act_quant`) before every FP8 linear and
    both products of every routed expert: what activation_quant=dynamic should compute."""
    import copy
    import types

    import torch.nn.functional as F

    m = copy.deepcopy(want_model)
    for name, mod in m.named_modules():
        if name.endswith(_TF_FP8):
            mod.register_forward_pre_hook(lambda _m, args: (_act_quant(args[0]), *args[1:]))
        if type(mod).__name__ == "DeepseekV4Experts":
            def forward(self: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                        ) -> torch.Tensor:
                final = torch.zeros_like(hidden)
                for e in range(self.num_experts):
                    tok, pos = torch.where(top_k_index == e)
                    if tok.numel():
                        cur = self._apply_gate(F.linear(_act_quant(hidden[tok]), self.gate_up_proj[e]))
                        cur = F.linear(_act_quant(cur), self.down_proj[e]) * top_k_weights[tok, pos, None]
                        final.index_add_(0, tok, cur)
                return final
            mod.forward = types.MethodType(forward, mod)
    return m


def test_dynamic_activations(release):
    """activation_quant=dynamic computes on DeepSeek's FP8 activations: each FP8 linear and FP4 expert
    against the act_quant written above (prompt rows and one-token native rows), and the whole model
    against transformers with those activations; the logits' deviation from the weight-only model is
    bounded (0.37 relative on this tiny random model with its 0.25 SwiGLU clamp; < 0.5, the conformance
    kit's sanity bound for activation-quantizing formats)."""
    path, values, want_model = release
    model = quantplug.load(path)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(5)) * 3
    wq_a = model.layers[1].attn.wq_a
    want = torch.nn.functional.linear(_act_quant(x), values["layers.1.attn.wq_a.weight"])
    assert rel(wq_a(x), want) < 1e-6 and rel(wq_a(x[:1]), want[:1]) < 1e-6
    up = model.layers[2].ffn.experts.up_proj
    want = torch.nn.functional.linear(_act_quant(x), values["layers.2.ffn.experts.3.w3.weight"])
    assert rel(up(x, 3), want) < 1e-6 and rel(up(x[:1], 3), want[:1]) < 1e-6
    # the schemes' own torch paths (no C compiler): dequantize is the writer's value, apply the same product
    assert torch.equal(up.scheme.dequantize(up, 3), values["layers.2.ffn.experts.3.w3.weight"])
    assert rel(up.scheme.apply(up, x, 3), want) < 1e-6
    assert torch.equal(wq_a.scheme.dequantize(wq_a), values["layers.1.attn.wq_a.weight"])
    assert rel(wq_a.scheme.apply(wq_a, x), torch.nn.functional.linear(_act_quant(x), values["layers.1.attn.wq_a.weight"])) < 1e-6
    with torch.no_grad():
        dyn, exact, emulated = model(IDS), want_model(IDS).logits, _emulated(want_model)(IDS).logits
    assert rel(dyn, emulated) < 1e-5, rel(dyn, emulated)
    err = rel(dyn, exact)
    assert 1e-3 < err < 0.5, err


def test_forms_over_several_blocks_and_activation_groups():
    """Wider than the tiny model: an FP8 linear [200, 384] (E8M0 scales over 2 x 3 blocks, the last block
    row partial, rows of different magnitudes) and a stack of 3 FP4 experts [200, 384] (12 scales per
    row), with dynamic activations over 3 groups of 128 of different magnitudes: the native row kernels
    (1 and 5 rows), the many-row path (40 rows) and the schemes' torch ``apply`` all equal
    F.linear(act_quant(x), the writer's dequantized weight) within float32 summation order."""
    from quantplug.contract.scheme import StackedLayout
    from quantplug.layers.linear import QuantLinear, StackedLinear
    from quantplug_fp8.scheme import FP4ExpertScheme, FP8BlockScheme
    from v4_models import quantize_fp4_experts, quantize_fp8_blocks

    g = torch.Generator().manual_seed(0)
    n, k = 200, 384
    x = torch.randn(40, k, generator=g) * torch.exp2(torch.randint(-4, 4, (1, k), generator=g).float())
    q, s, deq = quantize_fp8_blocks(torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-3, 3, (n, 1),
                                                                                                generator=g).float()))
    fp8 = FP8BlockScheme((128, 128), "dynamic", "ue8m0", scale_suffix="scale", scale_dtype="E8M0")
    lin = QuantLinear(k, n, fp8, "t", torch.float32)
    lin.weight, lin.scale = (torch.nn.Parameter(t, requires_grad=False) for t in (q, s))
    lin.qp_kernel_mode = "exact"
    lin.qp_finish()
    want = torch.nn.functional.linear(_act_quant(x), deq)
    assert (compute.bound(lin) is not None) == NATIVE and rel(fp8.apply(lin, x), want) < 1e-6
    assert all(rel(lin(x[:r]), want[:r]) < 1e-6 for r in (1, 5, 40))
    q4, s4, d4 = zip(*(quantize_fp4_experts(torch.randn(n, k, generator=g)) for _ in range(3)))
    fp4 = FP4ExpertScheme("dynamic", 128, "ue8m0")
    st = StackedLinear(3, k, n, fp4, "e", StackedLayout("e"), torch.float32)
    st.weight, st.scale = (torch.nn.Parameter(torch.stack(t), requires_grad=False) for t in (q4, s4))
    st.qp_kernel_mode = "exact"
    st.qp_finish()
    want = torch.nn.functional.linear(_act_quant(x), d4[2])
    assert (compute.bound(st) is not None) == NATIVE and rel(fp4.apply(st, x, 2), want) < 1e-6
    assert all(rel(st(x[:r], 2), want[:r]) < 1e-6 for r in (1, 5, 40))


def test_cached_greedy_equals_recompute(release):
    path, _, _ = release
    for options in (NONE, {}):
        model = quantplug.load(path, options=options)
        ids = IDS[:1, :13]
        n = 12  # past the sliding window (8) and several compression windows
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n)
            seq = ids
            for _ in range(n):
                seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(out, seq), options


def test_experts_from_ssd_equal_in_memory(release):
    """expert_cache_mb: the FP4 experts stay in the file, served packed through the bounded cache;
    same logits and greedy tokens as the in-memory load, the budget held."""
    path, _, _ = release
    mem = quantplug.load(path, progress=False, options=NONE)
    need = experts.step_bytes(mem.quantplug_plan)
    assert need == 2 * 3 * (INTER * 64 // 2 + INTER * 64 // 32)  # top-2 experts x (w1, w3, w2) packed + scales
    served = quantplug.load(path, progress=False, options={**NONE, "expert_cache_mb": 1.5 * need / (1 << 20)})
    cache = stats_sources(served)["expert_cache"]
    assert served.load_report["experts_on_demand_bytes"] > 0
    with torch.no_grad():
        assert torch.equal(served(IDS), mem(IDS))
    assert torch.equal(served.generate(IDS[:1, :9], max_new_tokens=8), mem.generate(IDS[:1, :9], max_new_tokens=8))
    st = cache.stats()
    assert st["misses"] > 0 and st["evictions"] > 0 and st["peak_bytes"] <= cache.budget


# -- refusals at plan time ---------------------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, config: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
             replace: dict[str, torch.Tensor] | None = None) -> Path:
    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k not in drop}
    tensors.update(replace or {})
    return write_checkpoint(dst, config or json.loads((src / "config.json").read_text()), tensors)


def _problems(path: Path) -> str:
    with pytest.raises(PlanError) as exc:
        quantplug.load(path)
    return str(exc.value)


def test_refusals(ref, release, tmp_path):
    path, _, _ = release
    fp8_stored, _ = release_tensors(ref, "fp8")
    # expert_dtype fp4, experts stored F8_E4M3
    bad = write_checkpoint(tmp_path / "a", release_config("fp4"), fp8_stored)
    msg = _problems(bad)
    assert "layers.0.ffn.experts.0.w1.weight is F8_E4M3 but expert_dtype is 'fp4'" in msg and "I8 [N, K/2]" in msg
    # the same in quantization_config
    msg = _problems(write_checkpoint(tmp_path / "b", release_config("fp4", "quantization_config"), fp8_stored))
    assert "quantization_config.expert_dtype is 'fp4'" in msg
    # expert_dtype fp8, experts stored as FP4
    msg = _problems(_rewrite(path, tmp_path / "c", release_config("fp8")))
    assert "layers.0.ffn.experts.0.w1.weight is I8 (packed FP4) but expert_dtype is 'fp8'" in msg
    # a scale of the wrong shape (per 16 instead of 32) and a missing .scale
    stored = load_file(str(path / "model.safetensors"))
    s = stored["layers.1.ffn.experts.2.w3.scale"]
    msg = _problems(_rewrite(path, tmp_path / "d", replace={"layers.1.ffn.experts.2.w3.scale": s.repeat(1, 2)},
                             drop=("layers.2.attn.wo_b.scale",)))
    assert "layers.1.ffn.experts.2.w3.scale" in msg and "[32, 2]" in msg
    assert "layers.2.attn.wo_b.scale" in msg
    # a dense linear stored as I8
    msg = _problems(_rewrite(path, tmp_path / "e", replace={
        "layers.0.attn.wkv.weight": torch.zeros(32, 32, dtype=torch.int8)}))
    assert "layers.0.attn.wkv.weight is I8 (packed FP4)" in msg
    # an E8M0 scale where the format expects them to agree across an expert stack
    msg = _problems(_rewrite(path, tmp_path / "f", replace={
        "layers.1.ffn.experts.4.w1.scale": stored["layers.1.ffn.experts.4.w1.scale"].float()}))
    assert "layers.1.ffn.experts.4.w1.scale" in msg and "F32" in msg
    # an expert_dtype the format does not know: the config key is named
    from quantplug.errors import ConfigError
    with pytest.raises(ConfigError, match="expert_dtype"):
        quantplug.plan(_rewrite(path, tmp_path / "g", {**release_config("fp4"), "expert_dtype": "int4"}))


def test_claims_only_when_its_tensors_are_there(ref, tmp_path):
    """A dequantized copy that kept the release's config.json holds no FP8 / FP4 tensor: not the fp8
    backend's (it plans dense)."""
    from v4_models import float_tensors

    path = write_checkpoint(tmp_path / "deq", release_config("fp4"), float_tensors(ref))
    assert build_plan(path).backend is None


# -- export ------------------------------------------------------------------------------------------------


def test_export_writes_the_release_layout_and_loads_back_equal(ref, release, tmp_path):
    from quantplug.plugins import get_plugin_manager

    path, _, _ = release
    pm = get_plugin_manager()
    # a model loaded from the release: its already-quantized weights come back exactly
    model = quantplug.load(path, options=NONE)
    [res] = pm.export("fp8", model=model, destination=tmp_path / "out", plan=model.quantplug_plan)
    a, b = dense_state(model), dense_state(quantplug.load(res.path, options=NONE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    want = load_file(str(path / "model.safetensors"))
    got = load_file(str(res.path / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in want.items()}
    cfg = json.loads((res.path / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4" and cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    # a float model: the export is the writer's independent quantization, value for value
    from v4_models import write_float_checkpoint

    dense = quantplug.load(write_float_checkpoint(tmp_path / "float", ref))
    for expert_dtype in ("fp4", "fp8"):
        [res] = pm.export("fp8", model=dense, destination=tmp_path / expert_dtype, plan=dense.quantplug_plan,
                          options={"expert_dtype": expert_dtype})
        back = quantplug.load(res.path, options=NONE)
        _, values = release_tensors(ref, expert_dtype)
        got = dense_state(back)
        assert all(torch.equal(got[k], values[k]) for k in values), expert_dtype
        e = back.layers[0].ffn.experts.gate_proj.weight
        assert e.dtype == (torch.int8 if expert_dtype == "fp4" else torch.float8_e4m3fn)
