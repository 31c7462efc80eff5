"""The core's native kernels (``quantplug/kernels/qp_kernels.c``) on every weight form.

* the form table is the C file's (``qp_form_info``) and gguf-py's (ggml rows);
* decoding: ggml blocks bit for bit against gguf-py, the scaled forms (INT4 / INT8 / FP8 / FP4,
  every scale encoding and granularity, float and int8 zero points, global scales in each
  ``global_mode``) bit for bit against the form's torch definition, in float32 and rounded to
  bfloat16 / float16; the FP4 forms and the GPTQ / AWQ repack bit for bit against the backends'
  own torch dequantizers (ModelOpt NVFP4 / FP8, compressed-tensors NVFP4 / MXFP4, GPTQ / AWQ);
* activation quantization bit for bit against the backends' torch emulations (DeepSeek
  act_quant, compressed-tensors fp8 / int8 / NVFP4 / MXFP4, ModelOpt NVFP4 / FP8 static, ModelSlim
  per-token int8) and the integer W8A8 epilogues against ``torch._int_mm``;
* products in both modes against float64 references, every grouping the model uses, thread
  count invariance, refusals, non-finite inputs;
* the AVX2 and portable builds; the build cache's ownership, symlink, empty-file and lock rules;
  no compiler = torch paths and a reason.
Skipped with the build's reason where this machine has no C compiler.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from quantplug.errors import QuantplugError
from quantplug.kernels import ggml, native
from quantplug.kernels.forms import (
    ACT_KINDS,
    FORMS,
    GLOBAL_MODES,
    INTEGER,
    SCALE_ENCODINGS,
    ActQuant,
    Form,
    Weights,
    reference_act,
)
from quantplug.kernels.native import Bound
from quantplug.kernels.reference import reference_dequantize
from quantplug_expert_pack.testing import random_blocks, random_rows

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")
GGML = sorted(ggml.NATIVE_TYPES)


def bound(form: Form, w: torch.Tensor, n: int, k: int, dtype: torch.dtype = torch.float32, mode: str = "exact",
          slots: int | None = None, **tensors) -> Bound:
    return Bound(Weights(form, w, **tensors), n, k, slots, dtype, mode, "test")


def ggml_rows(ggml_type: str, n: int, k: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_rows(ggml_type, (n, k), np.random.default_rng(seed), scale=1e-2))


def model_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a product of a ``dtype`` model takes it: a bfloat16 model rounds its inputs to
    bfloat16 first (the value its torch module holds), float32 / float16 ones take x as given."""
    return x.to(torch.bfloat16).float() if dtype == torch.bfloat16 else x


def f64_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """float32 rounding allowance of x @ dense.T: a few ulps of the sum of |products|."""
    return 1e-6 * (x.double().abs() @ dense.double().abs().t()) + 1e-30


# -- the shared table ------------------------------------------------------------------------------

@needs_native
def test_form_table_is_the_c_files_and_gguf_pys():
    lib = native.library()
    for name, (fid, elems, size) in FORMS.items():
        e, b = ctypes.c_int64(), ctypes.c_int64()
        assert lib.qp_form_info(fid, ctypes.byref(e), ctypes.byref(b)) == 1, name
        assert (e.value, b.value) == (elems, size), name
        if fid < 100:  # ggml ids and sizes are gguf-py's
            t = GGMLQuantizationType[name]
            assert int(t) == fid and GGML_QUANT_SIZES[t] == (elems, size), name
    assert lib.qp_form_info(9999, None, None) == 0


def test_the_enums_are_the_c_files():
    """Scale encodings, activation kinds, integer epilogues and global modes: the C enums
    (QS_*, QA_*, QE_*, QG_*) hold the Python tables' numbers, name for name."""
    import re

    src = "\n".join(f.read_text() for f in native.sources())
    enums = {m.group(1): int(m.group(2)) for m in re.finditer(r"\b(Q[SAEG]_[A-Z0-9_]+) = (\d+)", src)}

    def c_names(prefix: str) -> dict[str, int]:
        return {k[len(prefix):]: v for k, v in enums.items() if k.startswith(prefix)}

    assert c_names("QS_") == SCALE_ENCODINGS
    assert c_names("QA_") == {"NONE": 0, **{k.upper(): v for k, v in ACT_KINDS.items()}}
    assert c_names("QE_") == {k.upper(): v for k, v in INTEGER.items()}
    assert c_names("QG_") == {"AFTER": GLOBAL_MODES["after"], "TIMES": GLOBAL_MODES["times_scale"],
                              "OVER": GLOBAL_MODES["over_scale"]}


# -- decoding ---------------------------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("ggml_type", GGML)
def test_ggml_blocks_decode_bit_exact_with_gguf_py(ggml_type):
    rng = np.random.default_rng(zlib.crc32(ggml_type.encode()))
    blocks = random_blocks(ggml_type, 4096, rng, 1.0).reshape(64, -1)
    ref = gguf_dequantize(blocks, GGMLQuantizationType[ggml_type])
    got = ggml.dequantize(torch.from_numpy(blocks), ggml_type)            # the native path
    np.testing.assert_array_equal(got.numpy().view(np.uint32), np.ascontiguousarray(ref).view(np.uint32))
    # every f16 scale bit pattern (subnormals, inf, nan) agrees with the torch kernel's
    size = FORMS[ggml_type][2]
    raw = np.random.default_rng(1).integers(0, 256, (1 << 16, size), dtype=np.uint8)
    if ggml_type != "MXFP4":
        off = {"Q2_K": 80, "Q3_K": 108, "Q6_K": 208}.get(ggml_type, 0)
        raw[:, off:off + 2] = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    t = torch.from_numpy(raw)
    fast = ggml.dequantize(t, ggml_type)
    with native.disabled():
        slow = ggml.dequantize(t, ggml_type)
    torch.testing.assert_close(fast, slow, rtol=0, atol=0, equal_nan=True)


def _scaled_cases(n: int, k: int) -> dict[str, tuple[Form, torch.Tensor, dict]]:
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, generator=g)
    i8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    f8 = (torch.randn(n, k, generator=g) * 3).to(torch.float8_e4m3fn)
    f8.view(torch.uint8)[0, :4] = torch.tensor([0x7F, 0xFF, 0x00, 0x80], dtype=torch.uint8)  # NaN, -NaN, 0, -0
    f8.view(torch.uint8)[1, :2] = torch.tensor([0x01, 0x87], dtype=torch.uint8)                # subnormals
    fp4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    r = lambda *s: torch.rand(*s, generator=g) * 1e-2 + 1e-3  # noqa: E731
    return {
        "int4 g32 bf16": (Form("INT4", scale="BF16", group=32), words, {"scale": r(n, k // 32).to(torch.bfloat16)}),
        "int4 g64 zero": (Form("INT4", group=64, zero=True), words,
                          {"scale": r(n, k // 64), "zero": torch.randn(n, k // 64, generator=g)}),
        "int4 channel f16": (Form("INT4", scale="F16"), words, {"scale": r(n, 1).half()}),
        "int4 tensor": (Form("INT4", rows=0), words, {"scale": r(1)}),
        "int8 channel": (Form("INT8"), i8, {"scale": r(n, 1)}),
        "int8 g128 zero": (Form("INT8", group=128, zero=True), i8,
                           {"scale": r(n, k // 128), "zero": torch.randn(n, k // 128, generator=g)}),
        "fp8 block": (Form("FP8", group=128, rows=128), f8, {"scale": r(-(-n // 128), k // 128)}),
        "fp8 block bf16": (Form("FP8", scale="BF16", group=128, rows=128), f8,
                           {"scale": r(-(-n // 128), k // 128).to(torch.bfloat16)}),
        "fp8 channel": (Form("FP8"), f8, {"scale": r(n, 1)}),
        "fp8 tensor": (Form("FP8", rows=0), f8, {"scale": r(1)}),
        "fp4 e8m0 g32": (Form("FP4", scale="E8M0", group=32), fp4,
                         {"scale": torch.randint(110, 135, (n, k // 32), dtype=torch.uint8, generator=g)}),
        "fp4 e4m3 g16 global": (Form("FP4", scale="E4M3", group=16, global_scale=True), fp4,
                                {"scale": (torch.rand(n, k // 16, generator=g) * 400).to(torch.float8_e4m3fn),
                                 "global_scale": torch.tensor([3e-4])}),
        "fp4 e4m3 g16 scale x global": (Form("FP4", scale="E4M3", group=16, global_scale=True,
                                             global_mode="times_scale"), fp4,
                                        {"scale": (torch.rand(n, k // 16, generator=g) * 400).to(torch.float8_e4m3fn),
                                         "global_scale": torch.tensor(3.3e-4)}),
        "fp4 e4m3 g16 scale / global": (Form("FP4", scale="E4M3", group=16, global_scale=True,
                                             global_mode="over_scale"), fp4,
                                        {"scale": (torch.rand(n, k // 16, generator=g) * 400).to(torch.float8_e4m3fn),
                                         "global_scale": torch.tensor([2987.3])}),
        "fp8 tensor scale x global": (Form("FP8", rows=0, global_scale=True, global_mode="times_scale"), f8,
                                      {"scale": r(1), "global_scale": torch.tensor([0.37])}),
        "int4 g32 int8 zero": (Form("INT4", scale="F16", group=32, zero=True), words,
                               {"scale": r(n, k // 32).half(),
                                "zero": torch.randint(-8, 9, (n, k // 32), dtype=torch.int8, generator=g)}),
        "int8 g64 int8 zero": (Form("INT8", group=64, zero=True), i8,
                               {"scale": r(n, k // 64), "zero": torch.randint(-128, 128, (n, k // 64), dtype=torch.int8,
                                                                                generator=g)}),
    }


SCALED = list(_scaled_cases(4, 256))


@needs_native
@pytest.mark.parametrize("case", SCALED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_forms_decode_to_their_definition_bit_for_bit(case, dtype):
    n, k = 136, 512  # a partial last 128-row block
    form, w, tensors = _scaled_cases(n, k)[case]
    b = bound(form, w, n, k, dtype, **tensors)
    ref = reference_dequantize(b.weights, n, k, dtype=dtype).float()
    got = native.dequant(b.ptr(), 0, n, torch.empty(n, k), b.wround)
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int32), ref[~ref.isnan()].view(torch.int32))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 5, 17])
def test_bfloat16_rows_multiply_within_float32_rounding(dtype, m):
    """Float weights kept as bfloat16 (a bfloat16 lm_head): the widened-in-registers path for
    float32 / bfloat16 models, the generic one for float16 (which rounds the weights to float16);
    row counts not a multiple of the 4-row tile, inputs over several passes."""
    n, k = 70, 288
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(7)) * 0.05).to(torch.bfloat16)
    b = bound(Form("BF16"), w, n, k, dtype=dtype)
    dense = w.to(dtype).float()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = native.gemm(x, [b.ptr()], wround=native.WROUND[dtype])
    x = model_input(x, dtype)
    assert ((y.double() - x.double() @ dense.double().t()).abs() <= f64_bound(x, dense)).all()


@needs_native
def test_bfloat16_rows_sum_in_the_portable_lane_order():
    """bfloat16 weights in a float32 model: the AVX2 build's register kernel and the portable loop
    give the bits of one float32 order: products w * x, lane j % 8 summed in ascending j, then the
    8 lanes in order (emulated here step by step in float32). The AVX512 builds take their 32-wide
    exact tile (another order, within float32 rounding: test_bfloat16_rows_multiply_within_float32_rounding);
    on such a machine the AVX2 and portable builds are checked by
    test_avx2_and_portable_builds_compute_the_same."""
    lib = native.library()
    assert lib is not None
    if lib.qp_isa() not in (0, 2):
        pytest.skip("AVX512 build: bfloat16 rows take the 32-wide exact tile (this order is the AVX2 and portable "
                    "builds', checked on those builds by test_avx2_and_portable_builds_compute_the_same)")
    n, k = 12, 288
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    b = bound(Form("BF16"), w, n, k, dtype=torch.float32)
    for m in (1, 3, 6):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(10 + m))
        y = native.gemm(x, [b.ptr()], wround=native.WROUND[torch.float32])
        prod = (x.unsqueeze(1) * w.float().unsqueeze(0)).view(m, n, k // 8, 8)   # float32 products
        acc = torch.zeros(m, n, 8)
        for j in range(k // 8):
            acc = acc + prod[:, :, j]
        want = torch.zeros(m, n)
        for lane in range(8):
            want = want + acc[:, :, lane]
        assert torch.equal(y, want), m


@needs_native
@pytest.mark.parametrize("case", SCALED)
@pytest.mark.parametrize("m", [1, 3, 5, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_forms_multiply_within_float32_rounding(case, m, dtype):
    """Every scaled form, with and without NaN codes (the general and the plain kernels), in a
    float32 model and a bfloat16 one (weights rounded to bfloat16 first, as dequantize(...).to
    (bfloat16) rounds them)."""
    n, k = 70, 256
    form, w, tensors = _scaled_cases(n, k)[case]
    b = bound(form, w, n, k, dtype=dtype, **tensors)
    dense = reference_dequantize(b.weights, n, k).nan_to_num()
    if form.dtype == "FP8":
        w.view(torch.uint8)[:1, :2] = 0  # no NaN codes for this check
        b = bound(form, w, n, k, dtype=dtype, **tensors)
        dense = reference_dequantize(b.weights, n, k)
    dense = dense.to(dtype).float()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    t0 = native.pair_tasks()
    y = native.gemm(x, [b.ptr()], wround=b.wround)
    # a bfloat16 model multiplies bfloat16 pairs where the build has them and the groups allow
    gk = b.mats[0].gk
    pairs = dtype == torch.bfloat16 and native.pair_products() and not b.mats[0].tiny and (gk % 32 == 0 or gk == 16)
    assert (native.pair_tasks() > t0) == pairs
    x = model_input(x, dtype)
    assert ((y.double() - x.double() @ dense.double().t()).abs() <= f64_bound(x, dense)).all()


@needs_native
@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "BF16"])
@pytest.mark.parametrize("m", [1, 3, 5])
def test_a_bfloat16_model_rounds_each_product_input_to_bfloat16(kind, m):
    """A bfloat16 model's product takes its input as the model's torch module holds it: rounded to
    bfloat16 (the native steps' own intermediates, silu(g) * u, an attention output, are float32
    sums until a product reads them): x and bfloat16(x) give the same bits."""
    n, k = 70, 288
    w = ((torch.randn(n, k, generator=torch.Generator().manual_seed(m)) * 0.05).to(torch.bfloat16) if kind == "BF16"
         else ggml_rows(kind, n, k, m))
    b = bound(Form(kind), w, n, k, dtype=torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1))
    assert torch.equal(native.gemm(x, [b.ptr()], wround=b.wround),
                       native.gemm(model_input(x, torch.bfloat16), [b.ptr()], wround=b.wround))


@needs_native
@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "BF16"])
@pytest.mark.parametrize("m", [1, 3, 5, 17])
def test_bfloat16_pair_products_sum_the_same_products(kind, m):
    """AVX512-BF16 builds: a bfloat16 model's Q4_0 / Q8_0 / bfloat16-row products multiply pairs of
    bfloat16 values in one instruction (vdpbf16ps) where the float32 tile makes two FMAs. The same
    weights and inputs, the sums in another order: both within float32 rounding of the float64
    product; the pair path taken when on (counted), never when off."""
    if not native.pair_products():
        pytest.skip("this build has no bfloat16 pair products (AVX512-BF16)")
    n, k = 70, 288
    if kind == "BF16":
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(m)) * 0.05).to(torch.bfloat16)
        dense = w.float()
    else:
        w = ggml_rows(kind, n, k, m)
        dense = ggml.dequantize(w, kind).to(torch.bfloat16).float()
    b = bound(Form(kind), w, n, k, dtype=torch.bfloat16)
    x = model_input(torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1)), torch.bfloat16)
    ref = x.double() @ dense.double().t()
    t0 = native.pair_tasks()
    on = native.gemm(x, [b.ptr()], wround=b.wround)
    t1 = native.pair_tasks()
    native.pair_products(False)
    try:
        off = native.gemm(x, [b.ptr()], wround=b.wround)
        t2 = native.pair_tasks()
    finally:
        native.pair_products(True)
    assert t1 > t0 and t2 == t1
    for y in (on, off):
        assert ((y.double() - ref).abs() <= f64_bound(x, dense)).all()
    # a float32 model's products never take them (its inputs are not rounded)
    b32 = bound(Form(kind), w, n, k, dtype=torch.float32)
    native.gemm(x, [b32.ptr()], wround=b32.wround)
    assert native.pair_tasks() == t2


@needs_native
def test_subnormal_values_keep_the_bfloat16_pair_products_off():
    """The pair instruction reads a subnormal value as zero: bfloat16 rows holding one are marked
    ``tiny`` at binding and take the FMA tile (the product 2^-130 * 2^120 kept), and so does an input
    row holding one."""
    n, k = 8, 64
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    w[0, 5] = 2.0 ** -130                                   # subnormal in bfloat16
    b = bound(Form("BF16"), w, n, k, dtype=torch.bfloat16)
    assert b.mats[0].tiny == 1
    assert bound(Form("BF16"), w, n, k, dtype=torch.float32).mats[0].tiny == 0   # no pair products there
    # an embedding table is not scanned (it would be read whole at load): marked, it keeps the FMA tile
    assert Bound(Weights(Form("BF16"), w.abs() + 1), n, k, None, torch.bfloat16, "exact", "t", lookups=True).mats[0].tiny == 1
    x = torch.zeros(1, k)
    x[0, 5] = 2.0 ** 120
    t0 = native.pair_tasks()
    y = native.gemm(x, [b.ptr()], wround=b.wround)
    assert y[0, 0].item() == 2.0 ** -10 and native.pair_tasks() == t0
    w[0, 5] = 1.0
    b = bound(Form("BF16"), w, n, k, dtype=torch.bfloat16)
    assert b.mats[0].tiny == 0
    x = model_input(torch.randn(2, k, generator=g), torch.bfloat16)
    x[1, 3] = 2.0 ** -130
    y = native.gemm(x, [b.ptr()], wround=b.wround)
    assert native.pair_tasks() == t0
    dense = w.float()
    assert ((y.double() - x.double() @ dense.double().t()).abs() <= f64_bound(x, dense)).all()


@needs_native
def test_subnormal_weights_in_a_bfloat16_model_are_kept_not_flushed():
    """FP8 codes times a scale of 2^-136: every weight is subnormal. The binding marks the matrix
    ``tiny``, so the bfloat16 rounding that keeps subnormals runs (the AVX512-BF16 conversion
    instruction would flush them to zero); with x ~ 2^130 the products are O(1) and must match
    ``dequantize(...).to(bfloat16)``. A scale of 2^-7 leaves the matrix unmarked."""
    n, k = 64, 256
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(n, k, generator=g) * 50).clamp(-440, 440).to(torch.float8_e4m3fn)
    form = Form("FP8", scale="F32", group=128, rows=128)
    for exp, tiny in ((-136, 1), (-7, 0)):
        scale = torch.full((1, 2), 2.0 ** exp)
        b = bound(form, w, n, k, dtype=torch.bfloat16, scale=scale)
        assert b.mats[0].tiny == tiny
        dense = (w.float() * 2.0 ** exp).to(torch.bfloat16).float()
        x = torch.randn(3, k, generator=g) * 2.0 ** (-exp - 10)  # products below 1
        y = native.gemm(x, [b.ptr()], wround=b.wround)
        ref = model_input(x, torch.bfloat16).double() @ dense.double().t()
        assert ref.abs().max() > 1e-3
        assert ((y.double() - ref).abs() <= f64_bound(x, dense)).all()


def _g16_cases(n: int, k: int) -> dict[str, tuple[Form, torch.Tensor, dict]]:
    g = torch.Generator().manual_seed(k)
    cases = {c: v for c, v in _scaled_cases(n, k).items() if "g16" in c}
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, generator=g)
    r = torch.rand(n, k // 16, generator=g) * 1e-2 + 1e-3
    cases["int4 g16 zero"] = (Form("INT4", group=16, zero=True), words,
                              {"scale": r, "zero": torch.randn(n, k // 16, generator=g)})
    cases["int4 g16 int8 zero"] = (Form("INT4", scale="BF16", group=16, zero=True), words,
                                   {"scale": r.to(torch.bfloat16),
                                    "zero": torch.randint(-8, 9, (n, k // 16), dtype=torch.int8, generator=g)})
    if k % 48 == 0:  # groups of 48: every other one starts mid 32-column step
        cases["int4 g48 zero"] = (Form("INT4", group=48, zero=True), words,
                                  {"scale": r[:, ::3].contiguous(), "zero": torch.randn(n, k // 48, generator=g)})
    return cases


@needs_native
@pytest.mark.parametrize("k", [288, 65536, 65568])
def test_groups_of_16_multiply_at_every_length(k):
    """Groups of 16 (NVFP4, INT4 g16: two groups a step, K being a multiple of 32) and of 48 (16
    columns a step), and the widest rows whose scales the fused kernel decodes at once (4096 groups;
    4098 go through the generic path): within float32 rounding of the definition."""
    n = 3
    for case, (form, w, tensors) in _g16_cases(n, k).items():
        b = bound(form, w, n, k, **tensors)
        dense = reference_dequantize(b.weights, n, k)
        x = torch.randn(2, k, generator=torch.Generator().manual_seed(k))
        y = native.gemm(x, [b.ptr()])
        assert ((y.double() - x.double() @ dense.double().t()).abs() <= f64_bound(x, dense)).all(), case


@needs_native
@pytest.mark.parametrize("ggml_type", GGML)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
def test_ggml_products_both_modes_against_float64_references(ggml_type, m):
    n = 70                                           # rows not a multiple of the 4-row tile
    k = 160 if FORMS[ggml_type][1] == 32 else 512    # 5 blocks / 2 super-blocks
    w = ggml_rows(ggml_type, n, k, m)
    dense = ggml.dequantize(w, ggml_type).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ dense.t()
    exact = native.gemm(x, [bound(Form(ggml_type), w, n, k).ptr()])
    assert ((exact.double() - ref).abs() <= f64_bound(x, dense)).all()
    fast = native.gemm(x, [bound(Form(ggml_type), w, n, k, mode="fast").ptr()])
    if ggml_type not in native.FAST_FORMS:              # no int8-block form: the exact path
        assert torch.equal(fast, exact)
        return
    # fast: per block the integer dot of the codes times d_w * d_x (ggml's CPU-backend Q8_0
    # activation blocks, _ggml_q8_0_blocks; K-quants: q8_K blocks of 256, _ggml_q8_k_blocks):
    # the exact weights against those values
    if ggml_type in ("Q4_K", "Q5_K", "Q6_K"):
        q, d, _ = _ggml_q8_k_blocks(x.numpy().reshape(m, -1, 256))
    else:
        q, d = _ggml_q8_0_blocks(x.numpy().reshape(m, -1, 32))
    xq = torch.from_numpy(q.astype(np.float32) * d[..., None]).reshape(m, k)
    assert ((fast.double() - xq.double() @ dense.t()).abs() <= f64_bound(xq, dense)).all()
    assert 0 < (fast.double() - ref).norm() / ref.norm() < 2e-2


# -- activations ------------------------------------------------------------------------------------

def _acts(act: ActQuant, x: torch.Tensor, int8: bool = False, **kw) -> torch.Tensor:
    n, k = 8, x.shape[-1]
    if int8:
        b = bound(Form("INT8", act=act), torch.zeros(n, k, dtype=torch.int8), n, k,
                  scale=torch.ones(n, 1), **kw)
    else:
        b = bound(Form("FP8", group=128, rows=128, act=act), torch.zeros(n, k, dtype=torch.float8_e4m3fn), n, k,
                  scale=torch.ones(1, k // 128), **kw)
    return native.act_rows(b.ptr(), x)


def _activations() -> torch.Tensor:
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 2, 6).unsqueeze(1)
    x[2, 128:256] = 0                                   # an all-zero group
    x[3, :128] = torch.linspace(-1, 1, 128) * 1e-6      # a group below DeepSeek's amax floor
    return x


@needs_native
def test_fp8_activation_quantization_equals_the_backends_torch_emulations():
    from quantplug_compressed_tensors.kernels import fp8_quant
    from quantplug_fp8.kernels import act_quant

    x = _activations()
    for ue8m0 in (False, True):
        got = _acts(ActQuant("fp8", group=128, ue8m0=ue8m0, floor=1e-4), x)
        assert torch.equal(got, act_quant(x, 128, "ue8m0" if ue8m0 else None)), ue8m0
    assert torch.equal(_acts(ActQuant("fp8"), x), fp8_quant(x, None))
    assert torch.equal(_acts(ActQuant("fp8", group=128), x), fp8_quant(x, 128))
    s = torch.tensor([0.05])
    assert torch.equal(_acts(ActQuant("fp8_static"), x, input_scale=s), fp8_quant(x, None, s))


@needs_native
def test_int8_activation_quantization_equals_the_backends_torch_emulations():
    from quantplug_compressed_tensors.kernels import int8_quant
    from quantplug_modelslim.schemes import dynamic_quant

    x = _activations()
    got = _acts(ActQuant("int8_sym"), x, int8=True)
    assert torch.equal(got, int8_quant(x))
    q, s, o = dynamic_quant(x, "ascend")
    assert torch.equal(got, (q - o) * s)
    q, s, o = dynamic_quant(x, "msmodelslim")
    assert torch.equal(_acts(ActQuant("int8_asym"), x, int8=True), (q - o) * s)
    si, oi = torch.tensor([0.02]), torch.tensor([3.0])
    q = torch.clamp(torch.round(x / si + oi), -128, 127)
    got = _acts(ActQuant("int8_static"), x, int8=True, input_scale=si, input_offset=oi)
    assert torch.equal(got, (q - oi) * si)


def _fp4_activations() -> torch.Tensor:
    """Rows for FP4 activation quantization: magnitudes over 30 octaves, an all-zero group, every
    E2M1 midpoint (ties) at a power-of-two block scale of 1/8 for each kind (see the scales used
    below), subnormal and huge groups."""
    x = _activations()
    x[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * 2.0 ** -3
    x[1, 16:32] = 0
    x[1, 32:48] = -x[1, :16]
    x[4, 64:96] = torch.linspace(-1, 1, 32) * 1e-40                 # subnormal amax
    x[5, 96:128] = torch.linspace(-1, 1, 32) * 3e37                 # near float32's top
    return x


@needs_native
def test_fp4_activation_quantization_equals_the_backends_torch_emulations():
    """ModelOpt's NVFP4 (static input_scale, a multiplier), compressed-tensors' NVFP4
    (input_global_scale, a divisor) and MXFP4: the C code and reference_act, bit for bit, against
    the backends' own torch functions, ties included (e2m1 round half to even)."""
    from quantplug_compressed_tensors import fp4
    from quantplug_modelopt import kernels as mo

    x = _fp4_activations()
    n, k = 8, x.shape[-1]
    w = torch.zeros(n, k // 2, dtype=torch.uint8)

    def act(kind: str, group: int, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b = bound(Form("FP4", scale="E8M0", group=32, act=ActQuant(kind, group=group)), w, n, k,
                  scale=torch.full((n, k // 32), 127, dtype=torch.uint8), input_scale=scale)
        return native.act_rows(b.ptr(), x), reference_act(b.weights, x)

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    for s in (torch.tensor(1 / 64), torch.tensor(20.0 / 2688), torch.tensor(1e-30), torch.tensor(3e36)):
        got, ref = act("nvfp4", 16, s)
        want = mo.nvfp4_act(x, s, 16)
        same(got, want), same(ref, want)
    for gs in (torch.tensor([8.0]), torch.tensor([448.0 * 6 / 20.0]), torch.tensor([1e-20]), torch.tensor([1e30])):
        got, ref = act("nvfp4_inv", 16, gs)
        want = fp4.act_quant(fp4.NVFP4, x, gs)
        same(got, want), same(ref, want)
    got, ref = act("mxfp4", 32, None)
    want = fp4.act_quant(fp4.MXFP4, x, None)
    same(got, want), same(ref, want)
    # non-finite groups: NaN / inf propagate as the torch steps make them
    y = x[:2].clone()
    y[0, 3], y[1, 40] = float("nan"), float("inf")
    for kind, group, scale, fn in (("nvfp4", 16, torch.tensor(0.01), lambda v: mo.nvfp4_act(v, torch.tensor(0.01), 16)),
                                   ("nvfp4_inv", 16, torch.tensor([100.0]), lambda v: fp4.act_quant(fp4.NVFP4, v, torch.tensor([100.0]))),
                                   ("mxfp4", 32, None, lambda v: fp4.act_quant(fp4.MXFP4, v, None))):
        b = bound(Form("FP4", scale="E8M0", group=32, act=ActQuant(kind, group=group)), w, n, k,
                  scale=torch.full((n, k // 32), 127, dtype=torch.uint8), input_scale=scale)
        same(native.act_rows(b.ptr(), y), fn(y)), same(reference_act(b.weights, y), fn(y))
    # ModelOpt's static FP8 activations are fp8_static (clamped to +-448 before the cast)
    s8 = torch.tensor(0.003)
    fp8 = bound(Form("FP8", rows=0, act=ActQuant("fp8_static")), torch.zeros(n, k, dtype=torch.float8_e4m3fn), n, k,
                scale=torch.ones(1), input_scale=s8)
    same(native.act_rows(fp8.ptr(), x * 10), mo.fp8_act(x * 10, s8))


@needs_native
@pytest.mark.parametrize("kind", ["fp8", "fp8_static", "nvfp4"])
def test_a_bfloat16_model_quantizes_activations_as_the_backends_torch_emulations_return_them(kind):
    """In a bfloat16 model the backends' torch emulations take x in bfloat16 and return x' in
    bfloat16 (quantplug_fp8.kernels.act_quant, quantplug_modelopt's fp8_act / nvfp4_act): the native
    product multiplies those values (the pair products where the build has them)."""
    from quantplug_fp8 import kernels as dsfp8
    from quantplug_modelopt import kernels as mo

    n, k, bf = 40, 256, torch.bfloat16
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, k, generator=g) * 3
    s_in = torch.tensor(0.02)
    if kind == "nvfp4":
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        tensors = {"scale": (torch.rand(n, k // 16, generator=g) * 400).to(torch.float8_e4m3fn),
                   "global_scale": torch.tensor(3e-4), "input_scale": s_in}
        form = Form("FP4", scale="E4M3", group=16, global_scale=True, global_mode="times_scale",
                    act=ActQuant("nvfp4", group=16))
        xq = mo.nvfp4_act(x.to(bf), s_in, 16)
    else:
        w = (torch.randn(n, k, generator=g) * 50).clamp(-440, 440).to(torch.float8_e4m3fn)
        if kind == "fp8":
            tensors = {"scale": torch.rand(1, k // 128, generator=g) * 1e-3}
            form = Form("FP8", group=128, rows=128, act=ActQuant("fp8", group=128, floor=1e-4))
            xq = dsfp8.act_quant(x.to(bf), 128)
        else:
            tensors = {"scale": torch.tensor([1e-3]), "input_scale": s_in}
            form = Form("FP8", rows=0, act=ActQuant("fp8_static"))
            xq = mo.fp8_act(x.to(bf), s_in)
    assert xq.dtype == bf
    b = bound(form, w, n, k, dtype=bf, **tensors)
    dense = reference_dequantize(b.weights, n, k).to(bf).float()
    t0 = native.pair_tasks()
    y = native.gemm(x, [b.ptr()], wround=b.wround)
    assert (native.pair_tasks() > t0) == native.pair_products()
    xq = xq.float()
    assert ((y.double() - xq.double() @ dense.double().t()).abs() <= f64_bound(xq, dense)).all()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp4_weights_decode_bit_exact_with_the_backends(dtype):
    """ModelOpt NVFP4 (scale x weight_scale_2 first), compressed-tensors NVFP4 (scale /
    weight_global_scale) and MXFP4 (E8M0): the forms the schemes declare, decoded natively, equal
    the backends' own dequantizers bit for bit, on every byte and every e4m3 / e8m0 scale code."""
    from quantplug_compressed_tensors import fp4
    from quantplug_modelopt import kernels as mo

    g = torch.Generator().manual_seed(11)
    n, k = 256, 512
    packed = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, k // 2)
    packed = packed[torch.randperm(n, generator=g)].contiguous()
    s16 = torch.arange(n * k // 16).remainder(256).to(torch.uint8).view(n, k // 16).view(torch.float8_e4m3fn)
    s32 = torch.arange(n * k // 32).remainder(256).to(torch.uint8).view(n, k // 32)

    def same(weights: Weights, want: torch.Tensor) -> None:
        b = Bound(weights, n, k, None, dtype, "exact", "test")
        got = native.dequant(b.ptr(), 0, n, torch.empty(n, k), b.wround)
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(reference_dequantize(weights, n, k, dtype=dtype).float(), want.float(), rtol=0,
                                   atol=0, equal_nan=True)

    for s2 in (torch.tensor(1.7e-4), torch.tensor(3.1e-2), torch.tensor(7e-3)):
        same(Weights(Form("FP4", scale="E4M3", group=16, global_scale=True, global_mode="times_scale"), packed,
                     scale=s16, global_scale=s2), mo.dequantize_nvfp4(packed, s16, s2, dtype))
    for gs in (torch.tensor([5883.1]), torch.tensor([37.25]), torch.tensor([1.3e5])):
        same(Weights(Form("FP4", scale="E4M3", group=16, global_scale=True, global_mode="over_scale"), packed,
                     scale=s16, global_scale=gs), fp4.dequantize(fp4.NVFP4, packed, s16, gs, dtype))
    same(Weights(Form("FP4", scale="E8M0", group=32), packed, scale=s32), fp4.dequantize(fp4.MXFP4, packed, s32, None,
                                                                                          dtype))
    f8 = packed.view(n, k // 2).repeat(1, 2).view(torch.float8_e4m3fn)
    ws = torch.tensor(0.0123)
    same(Weights(Form("FP8", rows=0), f8, scale=ws), mo.dequantize_fp8(f8, ws, dtype))


def _int_packs(bits: int, group: int, out_f: int, in_f: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (in_f, out_f), generator=g)
    groups = -(-in_f // group)
    z = torch.randint(0, 1 << bits, (groups, out_f), generator=g)
    s = (torch.rand(groups, out_f, generator=g) * 1e-2 + 1e-4).half()
    return q, z, s


@needs_native
@pytest.mark.parametrize(("packing", "bits", "group"), [("gptq", 4, 32), ("gptq", 4, 128), ("gptq", 4, -1),
                                                        ("gptq_v2", 4, 64), ("gptq", 8, 32), ("awq", 4, 64)])
def test_gptq_awq_repack_is_bit_exact_with_their_dequantizer(packing, bits, group, monkeypatch):
    """GPTQ (v1 zeros - 1, v2), 8-bit GPTQ, AWQ's interleaved words, per channel and a partial last
    group: repacked once into the INT4 / INT8 form with integer zero points, every weight decodes
    (native and torch, f32 / bf16) to the backend's own dequantizer's value, bit for bit, and the
    repacked bytes are no more than the stored words."""
    from quantplug_gptq_awq import kernels as ik

    out_f, in_f = 96, 320                                   # 320 = 2.5 groups of 128: a partial group
    q, z, s = _int_packs(bits, in_f if group < 0 else group, out_f, in_f, bits + abs(group))
    pack = ik.AWQ if packing == "awq" else ik.gptq(packing)
    if packing == "awq":
        qweight, qzeros = ik.pack_last(q, bits, ik.AWQ_ORDER), ik.pack_last(z, bits, ik.AWQ_ORDER)
    else:
        qweight, qzeros = ik.pack_gptq_weight(q, bits), ik.pack_last((z - pack.zero_offset) % (1 << bits), bits)
    g = in_f if group < 0 else group
    want = ik.dequantize_rows_f32(pack, bits, qweight, ik.zeros_f32(pack, qzeros, bits, out_f), s, g, None, 0, out_f)
    codes, scales, zero = ik.repack(pack, bits, qweight, qzeros, s, out_f)
    assert codes.numel() * codes.element_size() == qweight.numel() * 4
    # int8 zero points where they fit (GPTQ v1's stored 255 is a zero of 256: float32 for INT8)
    z_eff = ik.zeros_f32(pack, qzeros, bits, out_f) - (8 if bits == 4 else 128)
    assert zero is not None and zero.dtype == (torch.int8 if bool((z_eff <= 127).all()) else torch.float32)
    form = Form("INT4" if bits == 4 else "INT8", scale="F16", group=max(group, 0), zero=True)
    weights = Weights(form, codes, scale=scales, zero=zero)
    for dtype in (torch.float32, torch.bfloat16):
        b = Bound(weights, out_f, in_f, None, dtype, "exact", "test")
        got = native.dequant(b.ptr(), 0, out_f, torch.empty(out_f, in_f), b.wround)
        assert torch.equal(got, want.to(dtype).float()), dtype
        assert torch.equal(reference_dequantize(weights, out_f, in_f, dtype=dtype).float(), want.to(dtype).float())
    assert torch.equal(ik.dequantize_codes_f32(bits, codes, zero, scales, g, 0, out_f), want)
    # stacked (routed experts): slot by slot the same
    st_codes, st_scales, st_zero = ik.repack(pack, bits, torch.stack([qweight, qweight]), torch.stack([qzeros, qzeros]),
                                              torch.stack([s, s * 2]), out_f)
    assert torch.equal(st_codes[1], codes) and torch.equal(st_zero[0], zero) and torch.equal(st_scales[1], scales * 2)
    # GPTQ's transpose shortcut reads the words as little-endian bytes: the unpacking path (other
    # byte orders, and AWQ's) gives the same codes, a chunk of slots at a time
    monkeypatch.setattr(ik, "sys", types.SimpleNamespace(byteorder="big"))  # ik's own view of sys only
    monkeypatch.setattr(ik, "REPACK_CHUNK", out_f * in_f)
    again = ik.repack(pack, bits, torch.stack([qweight, qweight, qweight]), torch.stack([qzeros] * 3),
                      torch.stack([s] * 3), out_f)
    assert all(torch.equal(again[0][i], codes) for i in range(3))
    monkeypatch.undo()
    # words stored column-major (transposing them gives a contiguous view of the same storage):
    # the repack does not write into them (the INT8 shift works on a fresh copy)
    cm = qweight.t().contiguous().t()
    before = cm.clone()
    assert torch.equal(ik.repack(pack, bits, cm, qzeros, s, out_f)[0], codes) and torch.equal(cm, before)


def _no_nan_bytes(n: int, seed: int) -> torch.Tensor:
    """n random e4m3 bytes without a NaN code, holding its neighbours 0x7E, 0xFE and 0x80."""
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    b[(b & 0x7F) == 0x7F] = 0x7E
    b[: min(n, 3)] = torch.tensor([0x7E, 0xFE, 0x80], dtype=torch.uint8)[: min(n, 3)]
    return b


@pytest.mark.parametrize("use_native", [True, False])
def test_fp8_nan_code_scan_finds_every_placement(use_native):
    """has_nan_codes (the C scan: 256-byte AVX512 blocks or 4 KiB blocks of 8-byte lanes, single
    lanes, a byte tail; or its torch fallback) against the plain torch expression: a NaN code (0x7F,
    0xFF) first, last, in the tail, in the lanes after the blocks, in an unaligned view (and one just
    outside it), none at all; then every length to 300 at every start offset to 8."""
    if use_native and native.library() is None:
        pytest.skip(f"native kernels: {native.status()}")
    n = 3 * 4096 + 256 + 3 * 8 + 5

    def scan(t: torch.Tensor) -> bool:
        if use_native:
            return native.has_nan_codes(t)
        with native.disabled():
            return native.has_nan_codes(t)

    base = _no_nan_bytes(n, 0)
    assert not scan(base) and not scan(base.view(torch.float8_e4m3fn)) and not scan(base[:0])
    for code in (0x7F, 0xFF):
        for at in (0, n - 1, n - 3, n - 5 - 8, 3 * 4096 + 100, 4096 - 1, 4096, 12345):
            b = base.clone()
            b[at] = code
            assert scan(b) and scan(b.view(torch.float8_e4m3fn)), (hex(code), at)
        for off in (1, 3, 5):
            b = base.clone()
            b[off - 1] = code                       # just before the view
            b[n - 1] = code                         # just after it
            view = b[off:n - 1]
            assert view.storage_offset() == off and not scan(view), (hex(code), off)
            for at in (0, view.numel() - 1, view.numel() // 2):
                c = base.clone()
                c[off + at] = code
                assert scan(c[off:n - 1]), (hex(code), off, at)
    g = torch.Generator().manual_seed(1)
    for length in range(301):
        for off in range(9):
            b = _no_nan_bytes(length + off, length * 9 + off)
            if length and int(torch.randint(0, 2, (1,), generator=g)):
                b[off + int(torch.randint(0, length, (1,), generator=g))] = int(torch.randint(0, 2, (1,), generator=g)) * 0x80 + 0x7F
            view = b[off:]
            assert scan(view) == bool(((view & 0x7F) == 0x7F).any()), (length, off)


@needs_native
def test_integer_w8a8_epilogues_equal_int_mm():
    g = torch.Generator().manual_seed(2)
    n, k = 40, 320                                      # k: five 64-byte VNNI steps
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    w[0] = -128                                         # the extremes of both operands
    x = _activations()[:, :k] * 3
    x[0, :] = 1e3
    ws = torch.rand(n, 1, generator=g) * 1e-2
    # static (ModelSlim W8A8): q = clamp(round(x / s + o)); (q . w + bias) * deq
    si, oi = torch.tensor([0.01]), torch.tensor([-5.0])
    bias = torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=g)
    deq = torch.rand(n, generator=g) * 1e-4
    b = bound(Form("INT8", act=ActQuant("int8_static", integer="static")), w, n, k, scale=ws, bias=bias,
              output_scale=deq, input_scale=si, input_offset=oi)
    q = torch.clamp(torch.round(x / si + oi), -128, 127).to(torch.int8)
    want = (torch._int_mm(q, w.t()) + bias).to(torch.float32) * deq
    assert torch.equal(native.gemm(x, [b.ptr()]), want)
    # dynamic (W8A8_DYNAMIC per channel): ((q . w - o * rowsum) * s) * ws, both activation modes
    from quantplug_modelslim.schemes import dynamic_quant

    for kind, mode in (("int8_sym", "ascend"), ("int8_asym", "msmodelslim")):
        b = bound(Form("INT8", act=ActQuant(kind, integer="dynamic")), w, n, k, scale=ws)
        q, s, o = dynamic_quant(x, mode)
        acc = torch._int_mm(q.to(torch.int8), w.t()) - o.to(torch.int32) * w.to(torch.int32).sum(-1)
        assert torch.equal(native.gemm(x, [b.ptr()]), acc.to(torch.float32) * s * ws.view(-1)), kind


# -- products: grouping, threads, refusals ------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_groups_place_each_weights_rows_and_columns(mode):
    k = 64
    a, b = bound(Form("Q4_0"), ggml_rows("Q4_0", 20, k, 1), 20, k, mode=mode), \
        bound(Form("Q4_0"), ggml_rows("Q4_0", 12, k, 2), 12, k, mode=mode)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    one = lambda m, xs: native.gemm(xs, [m.ptr()])  # noqa: E731
    side = native.gemm(x, [a.ptr(), b.ptr()])                                   # gate + up
    assert torch.equal(side[:, :20], one(a, x)) and torch.equal(side[:, 20:], one(b, x))
    # a: rows 1..3 of x into y rows 1..3; b: row 4 into y row 0, columns 20.. (rest zero)
    y = native.gemm(x, [a.ptr(), b.ptr()], [(1, 3, 1, 0), (4, 1, 0, 20)], out_rows=4)
    assert y.shape == (4, 32)
    assert torch.equal(y[1:4, :20], one(a, x[1:4])) and torch.equal(y[0:1, 20:], one(b, x[4:5]))
    assert not y[0, :20].any() and not y[1:, 20:].any()
    # mixed forms in one call (a GGUF mixes types tensor by tensor)
    c = bound(Form("Q8_0"), ggml_rows("Q8_0", 8, k, 3), 8, k)
    mixed = native.gemm(x, [a.ptr(), c.ptr()])
    assert torch.equal(mixed[:, 20:], one(c, x))


@needs_native
def test_threads_split_big_weights_without_changing_results():
    w = ggml_rows("Q4_0", 4096, 512, 4)                                     # 1.2 MB: many parallel tasks
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    mats = [bound(Form("Q4_0"), w, 4096, 512, mode=m) for m in ("exact", "fast")]
    try:
        torch.set_num_threads(1)
        one = [native.gemm(x, [m.ptr()]) for m in mats]
        torch.set_num_threads(2)
        two = [native.gemm(x, [m.ptr()]) for m in mats]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))   # each output row is one task's work


@needs_native
def test_what_the_c_code_cannot_take_is_refused_before_it_reads():
    b = bound(Form("Q8_0"), ggml_rows("Q8_0", 4, 64, 0), 4, 64)
    x = torch.randn(3, 64)
    for bad in ([(2, 2, 0, 0)], [(0, 1, 3, 0)], [(-1, 1, 0, 0)], [(0, 0, 0, 0)]):
        with pytest.raises(QuantplugError, match="do not fit"):
            native.gemm(x, [b.ptr()], bad, out_rows=3)
    with pytest.raises(QuantplugError, match="refused"):
        native.gemm(torch.randn(1, 32), [b.ptr()])                 # K disagrees with the weight
    # a form whose tensors contradict the layer is named before anything runs
    with pytest.raises(QuantplugError, match="scale"):
        bound(Form("INT4", group=32), torch.zeros(4, 32, dtype=torch.uint8), 4, 64, scale=torch.ones(4, 3))
    with pytest.raises(QuantplugError, match="bytes"):
        bound(Form("Q4_0"), torch.zeros(4, 35, dtype=torch.uint8), 4, 64)
    with pytest.raises(QuantplugError, match="bias and output_scale"):
        bound(Form("INT8", act=ActQuant("int8_static", integer="static")), torch.zeros(4, 64, dtype=torch.int8), 4, 64,
              scale=torch.ones(4, 1), input_scale=torch.ones(1))
    with pytest.raises(QuantplugError, match="INT8"):
        Form("INT4", act=ActQuant("int8_sym", integer="dynamic"))


@needs_native
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_non_finite_activations_give_nan_not_finite_garbage(mode):
    b = bound(Form("Q4_0"), ggml_rows("Q4_0", 8, 64, 0), 8, 64, mode=mode)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    y = native.gemm(x, [b.ptr()])
    assert not torch.isfinite(y).any()          # the torch path: NaN (and inf * 0 = NaN) in every row
    fp8 = bound(Form("FP8", act=ActQuant("fp8", group=32, floor=1e-4)), torch.ones(8, 64, dtype=torch.float8_e4m3fn),
                8, 64, scale=torch.ones(8, 1))
    y = native.gemm(x, [fp8.ptr()])
    assert y[0].isnan().all() and not torch.isfinite(y[1]).any()


# -- builds -------------------------------------------------------------------------------------------

@needs_native
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -march levels")
@pytest.mark.parametrize(("march", "isa"), [("x86-64-v3", 2), ("x86-64", 0)])
def test_avx2_and_portable_builds_compute_the_same(monkeypatch, march_build, march, isa):
    """The C file's other SIMD paths (AVX2 without AVX512, portable C), built for older x86 levels
    and run here, pass the same checks."""
    lib = march_build(march)
    assert lib.qp_isa() == isa
    monkeypatch.setattr(native, "_lib", lib)
    monkeypatch.setattr(native, "_tried", True)
    for ggml_type in GGML:
        test_ggml_products_both_modes_against_float64_references(ggml_type, 5)
    test_ggml_blocks_decode_bit_exact_with_gguf_py("Q4_K")
    test_bfloat16_rows_sum_in_the_portable_lane_order()
    for case in SCALED:
        test_scaled_forms_decode_to_their_definition_bit_for_bit(case, torch.bfloat16)
        test_scaled_forms_multiply_within_float32_rounding(case, 3, torch.bfloat16)
    for mode in ("exact", "fast"):
        test_groups_place_each_weights_rows_and_columns(mode)
    test_fp8_activation_quantization_equals_the_backends_torch_emulations()
    test_fp4_activation_quantization_equals_the_backends_torch_emulations()
    test_fp4_weights_decode_bit_exact_with_the_backends(torch.bfloat16)
    test_integer_w8a8_epilogues_equal_int_mm()
    test_fp8_nan_code_scan_finds_every_placement(True)
    test_groups_of_16_multiply_at_every_length(288)
    for ggml_type in ("Q4_0", "Q8_0"):
        test_fast_products_quantize_activations_as_documented(ggml_type, 5, 288)
    for ggml_type in ("Q4_K", "Q5_K", "Q6_K"):
        test_fast_k_quants_compute_ggmls_q8_k_arithmetic(ggml_type, 5, 9)
        test_fast_k_quants_give_each_row_what_it_gets_alone(ggml_type)


def test_no_compiler_means_torch_paths_and_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.delenv("QUANTPLUG_NATIVE", raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("QUANTPLUG_CACHE", str(tmp_path))
    assert native.library() is None and "no C compiler" in native.status() and "torch paths" in native.status()
    w = ggml_rows("Q4_0", 8, 64, 0)
    x = torch.randn(1, 64)
    torch.testing.assert_close(ggml.linear(x, w, "Q4_0", torch.float32), x @ ggml.dequantize(w, "Q4_0").t())
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("QUANTPLUG_NATIVE", "0")
    assert native.library() is None and "disabled" in native.status()


def _fresh(monkeypatch, cache: Path) -> None:
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.delenv("QUANTPLUG_NATIVE", raising=False)
    monkeypatch.setenv("QUANTPLUG_CACHE", str(cache))


@needs_native
def test_a_failed_build_is_reported_not_raised(monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    _fresh(monkeypatch, tmp_path / "cache")
    assert native.library() is None and "failed" in native.status()
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))   # no half-written library left


def _fake_cc(tmp_path: Path, delay_s: float = 0.0) -> tuple[Path, Path]:
    """A stand-in C compiler for the cache tests (``CC=`` it): answers ``--version`` and "compiles"
    by copying the library this process built (a full compile is ~10 s of CPU; what these tests
    check is when the cache compiles, not the compiler), after ``delay_s``. Returns the script and
    the file it appends a line to per compile."""
    lib = native.library()
    assert lib is not None
    runs = tmp_path / "cc-runs"
    script = tmp_path / "fake-cc"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake-cc 1"; exit 0; fi
out=""; while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done
sleep {delay_s}
echo "$out" >> "{runs}"
cp "{lib._name}" "$out"
""")
    script.chmod(0o700)
    return script, runs


def _compiles(runs: Path) -> int:
    return len(runs.read_text().splitlines()) if runs.exists() else 0


@needs_native
def test_the_kernel_cache_is_private_and_checked_before_loading(monkeypatch, tmp_path):
    cc, runs = _fake_cc(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    _fresh(monkeypatch, tmp_path / "a")
    assert native.library() is not None and _compiles(runs) == 1
    d = tmp_path / "a" / "kernels"
    assert (os.stat(d).st_mode & 0o777) == 0o700
    (built,) = d.glob("qp_kernels-*.so")
    assert built.stat().st_uid == os.getuid() and not built.stat().st_mode & 0o022
    key = built.name  # each case below plants a file at this key in a cache of its own (the file
    # this process has loaded is never touched: truncating a mapped library would crash it)

    def planted(name: str) -> Path:
        p = tmp_path / name / "kernels"
        p.mkdir(parents=True, mode=0o700)
        return p / key

    # an empty cached file (a crash mid-write elsewhere, a full disk) is rebuilt, not a dead end
    planted("empty").write_bytes(b"")
    _fresh(monkeypatch, tmp_path / "empty")
    assert native.library() is not None and (tmp_path / "empty" / "kernels" / key).stat().st_size > 0
    assert _compiles(runs) == 2
    # a library missing a symbol (a stale or foreign build at the key) is rebuilt
    other = tmp_path / "other.c"
    other.write_text("int qp_isa(void) { return 0; }\n")
    foreign = planted("foreign")
    subprocess.run(["cc", "-shared", "-fPIC", str(other), "-o", str(foreign)], check=True)
    os.chmod(foreign, 0o700)
    _fresh(monkeypatch, tmp_path / "foreign")
    assert native.library() is not None and hasattr(native.library(), "qp_latent_post") and _compiles(runs) == 3
    # a symlink planted at the key is never loaded
    target = tmp_path / "target.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(other), "-o", str(target)], check=True)
    planted("link").symlink_to(target)
    _fresh(monkeypatch, tmp_path / "link")
    assert native.library() is None and "symlink" in native.status()
    # a library others can write is refused, and so is a cache directory others can write
    group = planted("group")
    subprocess.run(["cc", "-shared", "-fPIC", str(other), "-o", str(group)], check=True)
    os.chmod(group, 0o777)
    _fresh(monkeypatch, tmp_path / "group")
    assert native.library() is None and "private" in native.status()
    (tmp_path / "open" / "kernels").mkdir(parents=True)
    os.chmod(tmp_path / "open" / "kernels", 0o777)
    _fresh(monkeypatch, tmp_path / "open")
    assert native.library() is None and "writable by group or others" in native.status()
    assert _compiles(runs) == 3  # refused files are never rebuilt over


@needs_native
def test_concurrent_first_builds_compile_once(tmp_path):
    """Two processes building into an empty cache at once: the lock makes the second wait and load
    the first one's library (one compiler run: one .so, no stray temporaries). The compiler is the
    stand-in (``_fake_cc``), slowed to 2 s so that the second process arrives mid-build."""
    cc, runs = _fake_cc(tmp_path, delay_s=2.0)
    code = ("import time, quantplug.kernels.native as n; t = time.time(); assert n.library() is not None, n.status(); "
            "print(n.status())")
    env = dict(os.environ, QUANTPLUG_CACHE=str(tmp_path / "cache"), CC=str(cc))
    env.pop("QUANTPLUG_NATIVE", None)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    files = sorted(x.name for x in (tmp_path / "cache" / "kernels").iterdir())
    assert len([f for f in files if f.endswith(".so")]) == 1 and _compiles(runs) == 1, files


def _ggml_q8_0_blocks(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activation blocks xb [..., 32] as ggml's CPU backend quantizes a Q8_0 / Q4_0 matmul's input
    (``quantize_row_q8_0``, ggml-cpu/arch/x86/quants.c): amax = max |x|, codes rint(x * (127 /
    amax)) (round half to even), the scale amax / 127 stored as float16 (``block_q8_0.d``);
    quantplug's extra rule: a block holding a NaN or an infinity gets scale NaN. Returns the codes
    (int32, 0 for such blocks) and the scales as float32."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.abs(xb).max(-1)
        inv = np.where(np.isfinite(amax) & (amax != 0), np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.nan_to_num(np.rint(xb * inv[..., None]), nan=0.0).astype(np.int32)
        d = (amax / np.float32(127)).astype(np.float32).astype(np.float16).astype(np.float32)
        return q, np.where(np.isfinite(amax), d, np.float32(np.nan)).astype(np.float32)


@needs_native
@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q8_0"])
def test_fast_activation_blocks_are_ggml_q8_0_bit_for_bit(ggml_type):
    """The activations a fast product multiplies, read back exactly: a weight whose row 32 b + j
    holds one code 1 at input 32 b + j (scale 1, every other code 0; Q4_0: code 9 against 8
    elsewhere) gives y[i, 32 b + j] = d_b * q_j with one nonzero term, an exact float32 product.
    Those equal ggml's CPU-backend Q8_0 blocks of x (:func:`_ggml_q8_0_blocks`) bit for bit,
    float16 scales included (a float32 scale, quantplug's fast mode before, is ~1e-4 off in some
    block), and gguf-py's reference quantization (``quantize_row_q8_0_ref``: 1 / d, half away
    from zero) wherever neither rule sits on a rounding tie. Values over float16 scales' whole
    range: a tiny block (subnormal scale), a zero block, a block whose scale rounds to zero."""
    from gguf.quants import quantize as gguf_quantize

    k = 256
    n = k
    size = 18 if ggml_type == "Q4_0" else 34
    raw = np.zeros((n, k // 32, size), dtype=np.uint8)
    raw[:, :, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    if ggml_type == "Q4_0":
        raw[:, :, 2:] = 0x88  # code 8 - 8 = 0 in both nibbles
    for r in range(n):
        b, j = divmod(r, 32)
        if ggml_type == "Q8_0":
            raw[r, b, 2 + j] = 1
        else:  # nibble j < 16: low nibble of byte j, else the high nibble of byte j - 16
            byte = raw[r, b, 2 + j % 16]
            raw[r, b, 2 + j % 16] = (byte & 0xF0) | 9 if j < 16 else (byte & 0x0F) | (9 << 4)
    b_ = Bound(Weights(Form(ggml_type), torch.from_numpy(raw.reshape(n, -1))), n, k, None, torch.float32, "fast", "w")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, k, generator=gen) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[0, :32] *= 1e-4        # a scale in float16's subnormal range
    x[1, 32:64] = 0.0        # a zero block
    x[2, 64:96] *= 1e-7      # amax / 127 below float16's smallest subnormal: scale 0
    got = native.gemm(x, [b_.ptr()]).numpy()
    q, d = _ggml_q8_0_blocks(x.numpy().reshape(6, -1, 32))
    want = (q.astype(np.float32) * d[..., None]).reshape(6, k)
    np.testing.assert_array_equal(got, want)  # exact (a sum 0 + -0 may give 0 where want is -0)
    # gguf-py's reference Q8_0 of the same rows: the same scales (float16 of amax / 127) and
    # codes, but at the rare values where x / d and x * (127 / amax) round apart
    ref = gguf_quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(6, k // 32, 34)
    assert np.array_equal(ref[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32), d)
    ref_q = ref[:, :, 2:].view(np.int8).astype(np.int32)
    assert (ref_q != q).sum() <= 2 and np.abs(ref_q - q).max() <= 1


@needs_native
@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 4, 5])
@pytest.mark.parametrize("k", [256, 288])
def test_fast_products_quantize_activations_as_documented(ggml_type, rows, k):
    """Fast Q4_0 / Q8_0: each 32 activations as ggml's CPU backend makes its Q8_0 blocks
    (:func:`_ggml_q8_0_blocks`: codes rint(x * 127 / amax), scale amax / 127 as float16; a zero
    block: codes 0; a block with an infinity: scale NaN), integer block dot products with the
    weight codes, times the two scales: a numpy model of that arithmetic, within float32
    summation order (a code off by one would be ~1e-3 off). An odd number of blocks per row (the
    AVX512 tile takes two at a time) and the extreme codes (Q8_0 -128 and 127, Q4_0 0 and 15)."""
    n = 40
    raw = np.ascontiguousarray(random_rows(ggml_type, (n, k), np.random.default_rng(1), scale=1e-2))
    size = 18 if ggml_type == "Q4_0" else 34
    ext = raw.reshape(n, k // 32, size)
    ext[::3, -1, 2:6] = (0x80, 0x7F, 0x80, 0x7F) if ggml_type == "Q8_0" else (0x0F, 0xF0, 0xFF, 0x00)
    b = Bound(Weights(Form(ggml_type), torch.from_numpy(raw)), n, k, None, torch.float32, "fast", "w")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, 32:64] = 0.0  # a zero block
    if rows > 1:
        x[1, 100] = float("inf")  # row 1: block 3 holds an infinity
    got = native.gemm(x, [b.ptr()]).numpy()
    blocks = raw.reshape(n, k // 32, size)
    dw = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if ggml_type == "Q4_0":
        qs = blocks[:, :, 2:]
        codes = np.concatenate([(qs & 15).astype(np.int32) - 8, (qs >> 4).astype(np.int32) - 8], axis=-1)
    else:
        codes = blocks[:, :, 2:].view(np.int8).astype(np.int32)
    xb = x.numpy().reshape(rows, k // 32, 32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        q, d = _ggml_q8_0_blocks(xb)
        dots = np.einsum("rbj,nbj->rnb", q, codes).astype(np.float64)
        want = (dots * dw[None].astype(np.float64) * d[:, None, :].astype(np.float64)).sum(-1)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    assert fin.sum() >= n * (rows - (rows > 1))
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-5, atol=1e-6)


def _ggml_q8_k_blocks(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activation blocks xb [..., 256] as ggml's CPU backend quantizes a K-quant matmul's input
    (``quantize_row_q8_K_ref``, ggml-quants.c): max = the first value of largest |x|, iscale =
    -127 / max (float32), codes rint(iscale * x) (round half to even), at most 127, the scale
    1 / iscale; bsums = each 16 codes' sum; a zero block: codes 0, scale 0; quantplug's extra rule:
    a block holding a NaN or an infinity gets scale NaN. Returns codes (int32), scales (float32),
    bsums (int32)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        bad = ~np.isfinite(xb).all(-1)
        clean = np.where(bad[..., None], np.float32(0), xb).astype(np.float32)
        idx = np.abs(clean).argmax(-1)                       # the first of the largest
        mx = np.take_along_axis(clean, idx[..., None], -1)[..., 0]
        ok = mx != 0
        iscale = np.where(ok, np.float32(-127) / np.where(ok, mx, np.float32(1)), np.float32(0)).astype(np.float32)
        q = np.minimum(np.rint((iscale[..., None] * clean).astype(np.float32)), 127).astype(np.int32)
        d = np.where(ok, np.float32(1) / np.where(ok, iscale, np.float32(1)), np.float32(0)).astype(np.float32)
        d = np.where(bad, np.float32(np.nan), d).astype(np.float32)
        q = np.where(bad[..., None], 0, q)
        return q, d, q.reshape(*q.shape[:-1], 16, 16).sum(-1)


def _k_codes(ggml_type: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A K-quant's super-blocks [n, nsb, bytes] as integers: codes [n, nsb, 256] (Q6_K's signed,
    q - 32), scales per sub-block [n, nsb, 8 or 16], mins [n, nsb, 8] (Q6_K: zeros), d, dmin."""
    n, nsb, _ = blocks.shape
    if ggml_type == "Q6_K":
        ql, qh = blocks[..., :128].astype(np.int32), blocks[..., 128:192].astype(np.int32)
        sc = blocks[..., 192:208].view(np.int8).astype(np.int32)
        d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = np.empty((n, nsb, 256), np.int32)
        for h in range(2):
            lq, hq = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
            o = 128 * h
            codes[..., o:o + 32] = (lq[..., :32] & 15) | ((hq & 3) << 4)
            codes[..., o + 32:o + 64] = (lq[..., 32:] & 15) | (((hq >> 2) & 3) << 4)
            codes[..., o + 64:o + 96] = (lq[..., :32] >> 4) | (((hq >> 4) & 3) << 4)
            codes[..., o + 96:o + 128] = (lq[..., 32:] >> 4) | (((hq >> 6) & 3) << 4)
        return codes - 32, sc, np.zeros((n, nsb, 8), np.int32), d, np.zeros_like(d)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 4:16].astype(np.int32)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    five = ggml_type == "Q5_K"
    qs = blocks[..., 48:176] if five else blocks[..., 16:144]
    qs = qs.astype(np.int32)
    codes = np.empty((n, nsb, 256), np.int32)
    for j in range(4):
        lo, hi = qs[..., 32 * j:32 * j + 32] & 15, qs[..., 32 * j:32 * j + 32] >> 4
        if five:
            qh = blocks[..., 16:48].astype(np.int32)
            lo = lo | (((qh >> (2 * j)) & 1) << 4)
            hi = hi | (((qh >> (2 * j + 1)) & 1) << 4)
        codes[..., 64 * j:64 * j + 32], codes[..., 64 * j + 32:64 * j + 64] = lo, hi
    return codes, sc, mn, d, dmin


K_FAST = ["Q4_K", "Q5_K", "Q6_K"]


@needs_native
@pytest.mark.parametrize("ggml_type", K_FAST)
@pytest.mark.parametrize("rows", [1, 4, 5, 17])
@pytest.mark.parametrize("nsb", [1, 9])
def test_fast_k_quants_compute_ggmls_q8_k_arithmetic(ggml_type, rows, nsb):
    """Fast Q4_K / Q5_K / Q6_K: activations as ggml's q8_K blocks (:func:`_ggml_q8_k_blocks`), per
    super-block the integer sum over sub-blocks of scale * (codes . x codes) (Q4_K / Q5_K: and the
    mins times the x blocks' sums), times d * dx (dmin * dx): a numpy model of ggml's
    ``vec_dot_q*_K_q8_K`` arithmetic, in float64, within float32 summation order (one code off
    would be ~1e-3 off). Rows not a multiple of the 4-row tile, one and many x rows, one super-block
    and more than the kernel decodes at a time (9 > 8), the extreme codes and scales (Q6_K: codes 0
    and 63, scales -128 and 127; Q4_K / Q5_K: scale and min 63), a zero block and an infinity."""
    n, k = 39, 256 * nsb
    bsize = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][1]
    raw = np.ascontiguousarray(random_rows(ggml_type, (n, k), np.random.default_rng(nsb + rows), scale=1e-2))
    ext = raw.reshape(n, nsb, bsize)
    if ggml_type == "Q6_K":
        ext[::3, -1, 0:4] = (0x00, 0xFF, 0x0F, 0xF0)       # ql
        ext[::3, -1, 128:130] = (0xFF, 0x00)                # qh: codes 63 and 0 there
        ext[::3, -1, 192:194] = (0x80, 0x7F)                # scales -128, 127
    else:
        ext[::3, -1, 4:16] = 0xFF                           # every scale and min 63
    b = Bound(Weights(Form(ggml_type), torch.from_numpy(raw)), n, k, None, torch.float32, "fast", "w")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :256] = 0.0                                          # a zero block
    if rows > 1:
        x[1, k - 3] = float("inf")                            # row 1: its last block holds an infinity
    got = native.gemm(x, [b.ptr()]).numpy()
    codes, sc, mn, d, dmin = _k_codes(ggml_type, raw.reshape(n, nsb, bsize))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        q, dx, bs = _ggml_q8_k_blocks(x.numpy().reshape(rows, nsb, 256))
        sub = 16 if ggml_type == "Q6_K" else 32
        dots = np.einsum("rbsj,nbsj->rnbs", q.reshape(rows, nsb, -1, sub), codes.reshape(n, nsb, -1, sub))
        sumi = (dots * sc[None]).sum(-1).astype(np.float64)
        bs32 = bs.reshape(rows, nsb, 8, 2).sum(-1)
        summ = np.einsum("rbs,nbs->rnb", bs32, mn).astype(np.float64)
        want = (sumi * d[None] * dx[:, None, :] - summ * dmin[None] * dx[:, None, :]).sum(-1)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    assert fin.sum() >= n * (rows - (rows > 1))
    scale = np.abs(want[fin]).max()
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-5, atol=2e-6 * scale)


@needs_native
@pytest.mark.parametrize("ggml_type", K_FAST)
def test_fast_k_quants_give_each_row_what_it_gets_alone(ggml_type):
    """The many-row kernel (each weight block decoded once for every x row) gives every x row the
    result a one-row product gives it, bit for bit: a prompt's rows and a decode step's agree."""
    n, k = 37, 256 * 10
    w = ggml_rows(ggml_type, n, k, 3)
    b = bound(Form(ggml_type), w, n, k, mode="fast")
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(3))
    many = native.gemm(x, [b.ptr()])
    for i in range(11):
        assert torch.equal(native.gemm(x[i:i + 1], [b.ptr()]), many[i:i + 1])
    assert torch.equal(native.gemm(x[:4], [b.ptr()]), many[:4])
