"""Native Q4_0 / Q8_0 / Q2_K..Q6_K kernels (``qpk_kernels.c``), built on first use with the system
C compiler.

Why: a decode step multiplies one token by every weight once, so its cost is reading the packed
blocks. torch has no kernel that reads GGUF blocks as they are (its int4 CPU kernel needs its own
layout, bfloat16 activations and, for Q8_0, two int4 halves: twice the work), and the exact path
dequantizes each block with ~10 torch ops. The C file does what llama.cpp's CPU backend does, on
the blocks as loaded: exact mode dequantizes a block in registers and accumulates in float32;
fast mode quantizes the activations to int8 blocks and takes integer dot products (AVX512-VNNI or
AVX2 where the CPU has them, portable C otherwise).

Build: ``$CC`` (default ``cc``) ``-O3 -march=native -fopenmp -shared -fPIC``, into
``$QUANTPLUG_CACHE`` (default ``~/.cache/quantplug``)``/kernels/``, named by a hash of the source,
the compiler's version and the CPU's flags, written to a temporary name and renamed (concurrent
processes never load a half-written library). OpenMP links the ``libgomp.so.1`` torch has already
loaded, so these loops run on torch's threads (``torch.set_num_threads`` applies).

``QUANTPLUG_NATIVE_MARCH`` replaces ``native`` in ``-march`` (the tests build ``x86-64-v3`` and
``x86-64`` too, so the AVX2 and portable paths are checked on any x86 machine).

No compiler, a failed build or ``QUANTPLUG_NATIVE=0``: :func:`library` returns None and says why in
:func:`status`; every caller then keeps its torch path. Nothing here is needed for correctness.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("qp_kernels.c")
#: ggml type -> the C file's type code
TYPES = {"Q4_0": 0, "Q8_0": 1, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5, "Q2_K": 6, "Q3_K": 7}
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q2_K": 84, "Q3_K": 110}
BLOCK_ELEMS = {t: 32 if t in ("Q4_0", "Q8_0") else 256 for t in TYPES}
#: types whose products always take the exact path (no int8-block form of their scales)
EXACT_ONLY = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"})
MODES = {"exact": 0, "fast": 1}
ISA_NAMES = {3: "AVX512-VNNI", 2: "AVX2", 0: "portable C"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status = "not built yet"
_tried = False


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTPLUG_CACHE") or Path.home() / ".cache" / "quantplug") / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler ({cc!r} not on PATH)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    # -ffp-contract=off: "d * q - m" stays two roundings (gguf-py's values); the kernels' fused
    # multiply-adds are explicit intrinsics, which the flag does not touch
    flags = ["-O3", f"-march={os.environ.get('QUANTPLUG_NATIVE_MARCH', 'native')}", "-fopenmp", "-shared", "-fPIC",
             "-std=c11", "-ffp-contract=off"]
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + version.encode() + _cpu_flags().encode() + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir() / f"qpk_kernels-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise OSError(f"{cc} failed: {r.stderr.strip()[-500:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.qpk_gemm.argtypes = [ctypes.c_int, ctypes.c_int, i64, i64, p, i64, ctypes.c_int, p, p, p, p, p, p, p, i64]
    lib.qpk_gemm.restype = ctypes.c_int
    lib.qpk_mlp_one.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, p, ctypes.c_int,
                                p, p, p, p, p]
    lib.qpk_mlp_one.restype = ctypes.c_int
    lib.qpk_mla_pre.argtypes = [p, p, p, p]
    lib.qpk_mla_pre.restype = ctypes.c_int
    lib.qpk_mla_post.argtypes = [p, p, p, i64, p, i64, i64, p]
    lib.qpk_mla_post.restype = ctypes.c_int
    lib.qpk_dequantize.argtypes = [ctypes.c_int, i64, p, p]
    lib.qpk_dequantize.restype = ctypes.c_int
    lib.qpk_isa.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on the first call; None when unavailable (see :func:`status`)."""
    global _lib, _status, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("QUANTPLUG_NATIVE", "1") == "0":
                _status = "disabled (QUANTPLUG_NATIVE=0)"
            else:
                try:
                    _lib = _build()
                    _status = f"built ({ISA_NAMES.get(_lib.qpk_isa(), '?')})"
                except (OSError, subprocess.SubprocessError) as e:
                    _status = f"unavailable: {e}"
            _tried = True
    return _lib


def status() -> str:
    """How the native kernels stand in this process: built (which SIMD path), disabled, or why not."""
    library()
    return _status


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"qpk_kernels {what} failed with code {rc}")


def dequantize(data: torch.Tensor, ggml_type: str, out: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of contiguous packed ``data`` into contiguous float32 ``out`` (bit-equal
    to gguf-py: ``d * q`` in float32)."""
    lib = library()
    assert lib is not None and data.is_contiguous() and out.is_contiguous() and out.dtype == torch.float32
    nblocks = data.numel() // BLOCK_BYTES[ggml_type]
    assert out.numel() == nblocks * BLOCK_ELEMS[ggml_type]
    _check(lib.qpk_dequantize(TYPES[ggml_type], nblocks, data.data_ptr(), out.data_ptr()), "dequantize")
    return out


def gemm(x: torch.Tensor, ptrs: Sequence[int], ns: Sequence[int], ggml_type: str, mode: str,
         groups: Sequence[tuple[int, int, int, int]] | None = None, out_rows: int | None = None) -> torch.Tensor:
    """float32 ``x`` [M, K] (``x.stride(1) == 1``; ``stride(0)`` may be 0: one row repeated) against
    packed weights given as the addresses ``ptrs`` of contiguous [N_g, row_bytes] blocks (the caller
    keeps the tensors alive), ``ns`` their row counts.

    Without ``groups``: every weight on all M rows, outputs side by side: [M, sum N_g]. With
    ``groups`` (one ``(x_row, x_rows, y_row, y_col)`` per weight): weight g on x rows
    ``[x_row, x_row + x_rows)`` into ``y[y_row:, y_col:]``; y is [``out_rows``, max(y_col + N_g)],
    zero where no group writes."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    g = len(ptrs)
    if len(ns) != g or g == 0:
        raise ValueError(f"native.gemm: {g} weight addresses, {len(ns)} row counts")
    if groups is None:
        cols, gl = 0, []
        for n in ns:
            gl.append((0, m, 0, cols))
            cols += n
        groups = gl
        y = torch.empty(m, cols, dtype=torch.float32)
    else:
        width = max(c + n for (_, _, _, c), n in zip(groups, ns))
        rows = out_rows if out_rows is not None else m
        # the C code trusts these: a group outside x or y would read or write out of bounds
        if len(groups) != g or any(xr < 0 or xm < 1 or xr + xm > m or yr < 0 or yr + xm > rows or yc < 0
                                   for xr, xm, yr, yc in groups):
            raise ValueError(f"native.gemm: groups {list(groups)} do not fit x [{m}, {k}] / y [{rows}, {width}]")
        covered = sum(xm * n for (_, xm, _, _), n in zip(groups, ns))
        y = (torch.empty if covered == rows * width else torch.zeros)(rows, width, dtype=torch.float32)
    arr = ctypes.c_int64 * g
    rc = lib.qpk_gemm(TYPES[ggml_type], MODES[mode], m, k, x.data_ptr(), x.stride(0), g, (ctypes.c_void_p * g)(*ptrs),
                      arr(*ns), arr(*[t[0] for t in groups]), arr(*[t[1] for t in groups]),
                      arr(*[t[2] for t in groups]), arr(*[t[3] for t in groups]), y.data_ptr(), y.stride(0))
    _check(rc, "gemm")
    return y


def mlp_one(x: torch.Tensor, types: tuple[str, str, str], gate: Sequence[int], up: Sequence[int],
            down: Sequence[int], inter: int, mode: str, weights: Sequence[float] | None = None) -> torch.Tensor:
    """One token through gated MLPs: float32 ``x`` [1, H] -> [1, H] = the sum, in the order given,
    of ``weights[e] * down_e(silu(gate_e x) * up_e x)`` (weight 1 without ``weights``). ``gate`` /
    ``up`` / ``down``: addresses of each MLP's packed [I, H/32 blocks] / [I, ...] / [H, I/32 blocks]
    matrices in ggml ``types`` (gate, up, down), ``inter`` = I. One call, one parallel region."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and x.is_contiguous() and x.numel() == x.shape[-1]
    h, e = x.shape[-1], len(gate)
    out = torch.empty(1, h, dtype=torch.float32)
    arr = ctypes.c_void_p * e
    wt = None if weights is None else (ctypes.c_float * e)(*weights)
    rc = lib.qpk_mlp_one(TYPES[types[0]], TYPES[types[1]], TYPES[types[2]], MODES[mode], h, inter, x.data_ptr(), e,
                         arr(*gate), arr(*up), arr(*down), wt, out.data_ptr())
    _check(rc, "mlp_one")
    return out


#: matrix type codes of the MLA step: the packed types, and float32 rows
MAT_TYPES = {**TYPES, "F32": 2}


class MLAStep(ctypes.Structure):
    """``qpk_mla`` in ``qpk_kernels.c``: one MLA layer's dimensions and weight addresses."""

    _fields_ = [  # noqa: RUF012 (ctypes reads the class attribute)
        ("mode", ctypes.c_int), ("H", ctypes.c_int64), ("q_lora", ctypes.c_int64), ("kv_lora", ctypes.c_int64),
        ("rope", ctypes.c_int64), ("nope", ctypes.c_int64), ("v", ctypes.c_int64), ("nh", ctypes.c_int64),
        ("eps_q", ctypes.c_float), ("eps_kv", ctypes.c_float), ("scale", ctypes.c_float),
        ("q_a", ctypes.c_void_p), ("t_q_a", ctypes.c_int), ("kv_a", ctypes.c_void_p), ("t_kv_a", ctypes.c_int),
        ("q_a_norm", ctypes.c_void_p), ("kv_a_norm", ctypes.c_void_p), ("q_b", ctypes.c_void_p), ("t_q_b", ctypes.c_int),
        ("k_b", ctypes.c_void_p), ("t_k_b", ctypes.c_int), ("s_k_b", ctypes.c_int64),
        ("v_b", ctypes.c_void_p), ("t_v_b", ctypes.c_int), ("s_v_b", ctypes.c_int64),
        ("o", ctypes.c_void_p), ("t_o", ctypes.c_int), ("rot", ctypes.c_void_p), ("kv_mode", ctypes.c_int)]


def mla_step(step: MLAStep, x: torch.Tensor, append: Any) -> torch.Tensor:
    """One decode step of one MLA layer: float32 ``x`` [H] -> [H]. ``append(latent, key)`` stores
    the token's normed latent [kv_lora] and roped key [rope] in the cache and returns every cached
    token's (latent [n, kv_lora], keys [n, rope]) as row-strided float32 views."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and x.is_contiguous()
    kl, rp = step.kv_lora, step.rope
    qcat = torch.empty(step.nh, kl + rp)
    kvrow = torch.empty(kl + rp)
    ref = ctypes.byref(step)
    _check(lib.qpk_mla_pre(ref, x.data_ptr(), qcat.data_ptr(), kvrow.data_ptr()), "mla_pre")
    lat, kr = append(kvrow[:kl], kvrow[kl:])
    out = torch.empty(step.H)
    _check(lib.qpk_mla_post(ref, qcat.data_ptr(), lat.data_ptr(), lat.stride(0), kr.data_ptr(), kr.stride(0),
                            lat.shape[0], out.data_ptr()), "mla_post")
    return out


class disabled:
    """``with native.disabled():`` the torch paths only, in this process, for the block (tests
    compare the two; a layer keeps what it made at load, e.g. no int4 form for Q8_0)."""

    def __enter__(self) -> None:
        global _lib, _tried
        library()
        self._saved = (_lib, _tried)
        _lib, _tried = None, True

    def __exit__(self, *exc: object) -> None:
        global _lib, _tried
        _lib, _tried = self._saved
