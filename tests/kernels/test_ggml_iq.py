"""GGUF IQ / TQ block decoders against gguf-py, bit for bit: the torch kernels
(``quantplug.kernels.ggml_iq``) and the C header (``core/kernels/iq_blocks.h``, compiled here into
a temporary shared library), on random valid blocks; their tables against gguf-py's own."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq
from quantplug.api import ggml_types
from quantplug.kernels import ggml_iq

HEADER = Path(ggml_iq.__file__).with_name("iq_blocks.h")
TYPES = sorted(ggml_iq.IQ_TYPES)
GRIDS = {  # gguf-py class -> (our float grid, our packed grid words, C table name)
    "IQ2_XXS": (gq.IQ2_XXS, ggml_iq.IQ2XXS_GRID_F, ggml_iq.IQ2XXS_GRID, "qp_iq2xxs_grid"),
    "IQ2_XS": (gq.IQ2_XS, ggml_iq.IQ2XS_GRID_F, ggml_iq.IQ2XS_GRID, "qp_iq2xs_grid"),
    "IQ2_S": (gq.IQ2_S, ggml_iq.IQ2S_GRID_F, ggml_iq.IQ2S_GRID, "qp_iq2s_grid"),
    "IQ3_XXS": (gq.IQ3_XXS, ggml_iq.IQ3XXS_GRID_F, ggml_iq.IQ3XXS_GRID, "qp_iq3xxs_grid"),
    "IQ3_S": (gq.IQ3_S, ggml_iq.IQ3S_GRID_F, ggml_iq.IQ3S_GRID, "qp_iq3s_grid"),
    "IQ1_S": (gq.IQ1_S, ggml_iq.IQ1S_GRID_F, None, "qp_iq1s_grid"),
}


def random_iq_blocks(ggml_type: str, n: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """``n`` random valid blocks: every byte random, then a finite f16 ``d`` of about ``scale``
    (IQ1_M: its 16 bits written into the top nibbles of the four u16 scales)."""
    _, _, size = ggml_iq.IQ_TYPES[ggml_type]
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    d = (scale * rng.standard_normal(n)).astype(np.float16)
    for off in ggml_iq.F16_OFFSETS[ggml_type]:
        b[:, off:off + 2] = d.view(np.uint8).reshape(n, 2)
    if ggml_type == "IQ1_M":
        sc = b[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((d.view(np.uint16) >> (4 * k)) & 0xF) << 12)
        b[:, 48:56] = sc.view(np.uint8)
    return b


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _reference(blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    ref = gq.dequantize(blocks, GGMLQuantizationType[ggml_type])
    assert np.isfinite(ref).all()
    return ref


# --- the type table -------------------------------------------------------------------------

def test_type_ids_and_sizes_are_gguf_pys():
    for name, (tid, elems, size) in ggml_iq.IQ_TYPES.items():
        t = GGMLQuantizationType[name]
        assert int(t) == tid
        assert GGML_QUANT_SIZES[t] == (elems, size)
        assert ggml_types()[tid] == (name, elems, size)  # the core's type table has it
    assert set(ggml_iq.IQ_KERNELS) == set(ggml_iq.IQ_TYPES) == set(ggml_iq.F16_OFFSETS)
    assert len(ggml_iq.IQ_TYPES) == 11


# --- tables -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(GRIDS))
def test_grid_tables_equal_gguf_pys(name):
    cls, grid_f, packed, _ = GRIDS[name]
    cls.init_grid()
    theirs = torch.from_numpy(np.array(cls.grid, dtype=np.float32).reshape(cls.grid_shape))
    assert grid_f.dtype == torch.float32 and tuple(grid_f.shape) == cls.grid_shape
    assert torch.equal(grid_f, theirs)
    if packed is not None:  # the kernels' packed words hold the same values, byte j = value j
        k = cls.grid_shape[1]
        unpacked = packed.view(torch.uint8).view(-1, k).to(torch.float32)
        assert torch.equal(unpacked, theirs)
    else:  # IQ1: grid + delta and grid - delta, both halves
        assert torch.equal(ggml_iq.IQ1_GRID_DELTA[:2048], theirs + np.float32(cls.delta))
        assert torch.equal(ggml_iq.IQ1_GRID_DELTA[2048:], theirs - np.float32(cls.delta))


def test_sign_and_value_tables_equal_gguf_pys():
    assert gq.IQ2_XXS.ksigns == ggml_iq.KSIGNS_BYTES
    ks = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)
    want = np.where((ks[:, None] >> np.arange(8)) & 1, -1.0, 1.0).astype(np.float32)
    assert np.array_equal(ggml_iq.KSIGNS.numpy(), want)
    assert np.array_equal(ggml_iq.KSIGN_MASKS.view(torch.uint8).view(128, 8).numpy(), np.where(want < 0, 255, 0))
    assert gq.IQ4_NL.kvalues == ggml_iq.IQ4NL_KVALUES
    kv = gq.IQ4_NL.kvalues
    assert ggml_iq.IQ4NL_PAIRS.view(torch.int8).view(256, 2).tolist() == [[kv[b & 15], kv[b >> 4]] for b in range(256)]
    assert np.float32(ggml_iq.IQ1S_DELTA) == gq.IQ1_S.delta == gq.IQ1_M.delta
    assert gq.IQ1_M.grid_hex == gq.IQ1_S.grid_hex  # IQ1_M shares IQ1_S's grid, as here


# --- torch kernels ------------------------------------------------------------------------------

@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("scale", [1e-3, 1.0])
def test_torch_kernel_bit_exact_on_random_blocks(ggml_type, scale):
    rng = np.random.default_rng(zlib.crc32(f"{ggml_type}/{scale}".encode()))
    blocks = random_iq_blocks(ggml_type, 2500, rng, scale)
    got = ggml_iq.dequantize_blocks(torch.from_numpy(blocks), ggml_type, chunk_blocks=1000)  # 3 chunks
    np.testing.assert_array_equal(_bits(got.numpy()), _bits(_reference(blocks, ggml_type).reshape(got.shape)))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_torch_kernel_reuses_a_dirty_workspace(ggml_type):
    """Buffers left by another type's kernel (other shapes, other values) change nothing."""
    rng = np.random.default_rng(7)
    ws = ggml_iq.Scratch()
    for other in TYPES:
        ggml_iq.dequantize_blocks(torch.from_numpy(random_iq_blocks(other, 300, rng)), other, ws=ws)
    blocks = random_iq_blocks(ggml_type, 200, rng)
    got = ggml_iq.dequantize_blocks(torch.from_numpy(blocks), ggml_type, ws=ws)
    np.testing.assert_array_equal(_bits(got.numpy()), _bits(_reference(blocks, ggml_type).reshape(got.shape)))


def test_dequantize_blocks_rejects_wrong_input():
    with pytest.raises(ValueError, match="need uint8 blocks"):
        ggml_iq.dequantize_blocks(torch.zeros(2, 65, dtype=torch.uint8), "IQ2_XXS")
    with pytest.raises(ValueError, match="not an IQ / TQ type"):
        ggml_iq.dequantize_blocks(torch.zeros(2, 18, dtype=torch.uint8), "Q4_0")


# --- the C header ---------------------------------------------------------------------------------

_HARNESS = r"""
#include "iq_blocks.h"
int qp_test_deq(int id, const uint8_t *blocks, long nb, float *out) {
    const int bytes = qp_iq_block_bytes(id), elems = qp_iq_block_elems(id);
    if (bytes == 0 || elems == 0) return -1;
    for (long i = 0; i < nb; ++i)
        if (qp_iq_deq_block(id, blocks + i * bytes, out + (long)i * elems) != elems) return -2;
    return 0;
}
int qp_test_sizes(int id, int *elems, int *bytes) {
    uint8_t block[256] = {0};
    float out[256];
    *elems = qp_iq_block_elems(id);
    *bytes = qp_iq_block_bytes(id);
    return qp_iq_deq_block(id, block, out);
}
const void *qp_test_table(int which) {
    switch (which) {
    case 0: return qp_iq2xxs_grid; case 1: return qp_iq2xs_grid; case 2: return qp_iq2s_grid;
    case 3: return qp_iq3xxs_grid; case 4: return qp_iq3s_grid; case 5: return qp_iq1s_grid;
    case 6: return qp_ksigns_iq2xs; case 7: return qp_kvalues_iq4nl;
    default: return 0;
    }
}
"""
_TABLE_ORDER = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S"]
# the brief's flags, and a build that would contract multiply-adds if the arithmetic had any
FLAGS = {"fp-contract-off": ["-O2", "-ffp-contract=off"],
         "fp-contract-fast": ["-O3", "-ffp-contract=fast", "-march=native"]}


@pytest.fixture(scope="module", params=sorted(FLAGS))
def clib(request, tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (cc / gcc / clang) on PATH: the C header is not compiled here")
    d = tmp_path_factory.mktemp(f"iqc-{request.param}")
    (d / "harness.c").write_text(_HARNESS)
    so = d / "harness.so"
    cmd = [cc, "-std=c11", "-Wall", "-Wextra", "-pedantic", "-Werror", *FLAGS[request.param],
           "-shared", "-fPIC", "-I", str(HEADER.parent), str(d / "harness.c"), "-o", str(so)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 and request.param == "fp-contract-fast" and any(
            w in r.stderr + r.stdout for w in ("unrecognized", "unknown argument", "unsupported")):
        pytest.skip(f"{cc} lacks {FLAGS[request.param]}")
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
    lib = ctypes.CDLL(str(so))
    lib.qp_test_deq.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    lib.qp_test_table.restype = ctypes.c_void_p
    return lib


def c_dequantize(lib, blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    tid, elems, size = ggml_iq.IQ_TYPES[ggml_type]
    blocks = np.ascontiguousarray(blocks.reshape(-1, size))
    out = np.empty((blocks.shape[0], elems), dtype=np.float32)
    assert lib.qp_test_deq(tid, blocks.ctypes.data, blocks.shape[0], out.ctypes.data) == 0
    return out


@pytest.mark.parametrize("ggml_type", TYPES)
def test_c_decoder_bit_exact_on_random_blocks(clib, ggml_type):
    rng = np.random.default_rng(zlib.crc32(f"c/{ggml_type}".encode()))
    for scale in (1e-3, 1.0):
        blocks = random_iq_blocks(ggml_type, 2000, rng, scale)
        got = c_dequantize(clib, blocks, ggml_type)
        np.testing.assert_array_equal(_bits(got), _bits(_reference(blocks, ggml_type).reshape(got.shape)))


def test_c_block_sizes_and_dispatch(clib):
    elems, size = ctypes.c_int(), ctypes.c_int()
    for t in GGMLQuantizationType:
        written = clib.qp_test_sizes(int(t), ctypes.byref(elems), ctypes.byref(size))
        if t.name in ggml_iq.IQ_TYPES:
            assert (elems.value, size.value) == GGML_QUANT_SIZES[t] and written == elems.value, t.name
        else:  # every other id is refused, never decoded
            assert (elems.value, size.value, written) == (0, 0, 0), t.name


def test_c_tables_equal_gguf_pys(clib):
    for which, name in enumerate(_TABLE_ORDER):
        cls = GRIDS[name][0]
        cls.init_grid()
        theirs = np.array(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
        n = theirs.size  # one byte per value (grid words, value j in byte j, little-endian host)
        raw = np.ctypeslib.as_array(ctypes.cast(clib.qp_test_table(which), ctypes.POINTER(ctypes.c_uint8)), (n,))
        words = np.frombuffer(raw.tobytes(), dtype=np.int8 if name == "IQ1_S" else np.uint8)
        assert np.array_equal(words.reshape(theirs.shape).astype(np.float32), theirs), name
    ks = np.ctypeslib.as_array(ctypes.cast(clib.qp_test_table(6), ctypes.POINTER(ctypes.c_uint8)), (128,))
    assert ks.tobytes() == gq.IQ2_XXS.ksigns
    kv = np.ctypeslib.as_array(ctypes.cast(clib.qp_test_table(7), ctypes.POINTER(ctypes.c_int8)), (16,))
    assert tuple(kv.tolist()) == gq.IQ4_NL.kvalues


def test_header_is_self_contained():
    src = HEADER.read_text()
    assert set(re.findall(r"#include\s*<([^>]+)>", src)) == {"stdint.h", "string.h", "math.h"}
    assert not re.findall(r'#include\s*"', src)
    for name in ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq4_nl", "iq4_xs",
                 "tq1_0", "tq2_0"):
        assert re.search(rf"static\s+\w*\s*void qp_deq_{name}\(const uint8_t \*block, float \*out\)", src), name


# --- every IQ / TQ block of the llama.cpp-made fixtures --------------------------------------------

VENDOR = Path(__file__).parents[1] / "data" / "vendor"
FIXTURES = sorted(p.name for p in VENDOR.glob("gguf_*_dsv3") if (p / "model.gguf").is_file())


def test_the_llama_cpp_fixtures_are_present_and_hold_every_type():
    from gguf import GGUFReader

    seen = set()
    for name in FIXTURES:
        seen |= {t.tensor_type.name for t in GGUFReader(VENDOR / name / "model.gguf").tensors}
    assert set(ggml_iq.IQ_TYPES) <= seen, sorted(set(ggml_iq.IQ_TYPES) - seen)


@pytest.mark.parametrize("name", FIXTURES)
def test_torch_and_c_decode_every_iq_block_of_the_llama_cpp_fixtures(clib, name):
    from gguf import GGUFReader

    n = 0
    for t in GGUFReader(VENDOR / name / "model.gguf").tensors:
        ggml_type = t.tensor_type.name
        if ggml_type not in ggml_iq.IQ_TYPES:
            continue
        blocks = np.array(t.data).reshape(-1, ggml_iq.IQ_TYPES[ggml_type][2])
        ref = _bits(_reference(blocks, ggml_type).reshape(blocks.shape[0], -1))
        got = ggml_iq.dequantize_blocks(torch.from_numpy(blocks), ggml_type).numpy()
        np.testing.assert_array_equal(_bits(got), ref, err_msg=f"torch: {name} {t.name} ({ggml_type})")
        np.testing.assert_array_equal(_bits(c_dequantize(clib, blocks, ggml_type)), ref,
                                      err_msg=f"C: {name} {t.name} ({ggml_type})")
        n += blocks.shape[0]
    assert n > 0, f"{name} has no IQ / TQ tensor"
