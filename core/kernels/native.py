"""The native kernels (``qp_kernels.c``): built on first use with the system C compiler, loaded
with ctypes, and the weights bound to them.

Why: a decode step multiplies a token by every weight once, so its cost is reading the packed
weights. torch has no kernel that reads most stored forms as they are (GGUF blocks, FP8 with
block scales, int4 with group scales), and a torch dequantize-then-matmul costs a dozen ops and a
dense copy per matrix. The C file decodes each block in registers and accumulates in float32
(exact mode), or, for Q4_0 / Q8_0, takes llama.cpp's integer dot products (fast mode); it also
runs the core model's few-token steps (gated MLP / routed experts, absorbed latent attention, the
whole stack, a KDA token: ``quantplug.kernels.kda``) in one call each.

Build: ``$CC`` (default ``cc``) ``-O3 -march=native -fopenmp -shared -fPIC -ffp-contract=off`` of
``qp_kernels.c`` (one translation unit: it includes ``qp_types.h``, ``generic/``, ``arch/`` and
``blocks/``) into ``$QUANTPLUG_CACHE`` (default ``~/.cache/quantplug``)``/kernels/``, named by a hash
of every source file (:func:`sources`), the compiler's version, the CPU's flags and the flags. The cache is this user's own:
the directory is created mode 0700 and used only if this user owns it and nobody else can write
it; a cached library is loaded only if it is a regular file (not a symlink) owned by this user,
not writable by others, and not empty; a broken one (empty, truncated, missing a symbol) is
rebuilt once. Builds hold a file lock, so concurrent first uses compile once. OpenMP links the
``libgomp.so.1`` torch has loaded: these loops run on torch's threads.

``QUANTPLUG_NATIVE_MARCH`` replaces ``native`` in ``-march`` (the tests build ``x86-64-v3`` and
``x86-64`` too, so the AVX2 and portable paths are checked on any x86 machine).

No compiler, a failed build or load, or ``QUANTPLUG_NATIVE=0``: :func:`library` returns None and
:func:`status` says why; every caller then keeps its torch path, with the same exact-mode results.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import QuantplugError
from . import abi
from .forms import ACT_KINDS, FORMS, GLOBAL_MODES, INTEGER, SCALE_ENCODINGS, Weights, scale_values

SOURCE = Path(__file__).with_name("qp_kernels.c")
#: the directories beside ``qp_kernels.c`` whose files it includes (one translation unit)
SOURCE_DIRS = ("arch", "generic", "blocks")


def sources() -> list[Path]:
    """Every kernel source file, in a fixed order: ``qp_kernels.c`` (which includes the others), the
    headers beside it, and the ``.c`` / ``.h`` files under :data:`SOURCE_DIRS`. The build's cache
    key hashes all of them (name and contents), so a change in any one rebuilds."""
    here = SOURCE.parent
    files = sorted(here.glob("*.h")) + [f for d in SOURCE_DIRS for f in sorted((here / d).glob("*.[ch]"))]
    return [SOURCE, *files]


def source_digest() -> bytes:
    """The hash input of the kernel sources (see :func:`sources`)."""
    h = hashlib.sha256()
    for f in sources():
        data = f.read_bytes()
        h.update(f"{f.relative_to(SOURCE.parent).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.digest()
ISA_NAMES = {3: "AVX512 + VNNI", 4: "AVX512", 2: "AVX2", 0: "portable C"}
MODES = {"exact": 0, "fast": 1}
#: forms with a fast (integer dot product) mode
FAST_FORMS = frozenset({"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
#: the smallest non-zero magnitude of a scaled form's codes (FP8 E4M3: 2^-9; FP4 E2M1: 0.5)
MIN_CODE = {"FP8": 2.0 ** -9, "FP4": 0.5, "INT4": 1.0, "INT8": 1.0}
#: the symbols this module calls; a library missing one is rebuilt, then refused
SYMBOLS = ("qp_form_info", "qp_isa", "qp_check", "qp_dequant", "qp_act_rows", "qp_gemm", "qp_mlp",
           "qp_latent_pre", "qp_latent_post", "qp_latent_step", "qp_decode_step", "qp_spec_step", "qp_fp8_has_nan", "qp_row_kernel",
           "qp_pair_products", "qp_pair_tasks", "qp_bf16_has_subnormal",
           "qp_layout_table", "qp_kda_step", "qp_route", "qp_hyper_pre", "qp_hyper_post", "qp_window_step",
           "qp_hyper_decode_step")

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


def _private_dir(path: Path) -> Path:
    """``path`` created mode 0700, or checked: owned by this user, writable by nobody else."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(f"kernel cache {path} is not a directory (a symlink?)")
    if st.st_uid != os.getuid():
        raise OSError(f"kernel cache {path} belongs to uid {st.st_uid}, not this user ({os.getuid()})")
    if st.st_mode & 0o022:
        raise OSError(f"kernel cache {path} is writable by group or others (mode {oct(st.st_mode & 0o777)})")
    return path


def _trusted(path: Path) -> bool:
    """A cached library we may load: a non-empty regular file (not a symlink) of this user's that
    nobody else can write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise OSError(f"cached kernel library {path} is not a regular file (a symlink?); refusing to load it")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"cached kernel library {path} is not this user's own private file; refusing to load it")
    return st.st_size > 0


def _compile(cc: str, flags: list[str], out: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise OSError(f"{cc} failed: {r.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    missing = [s for s in SYMBOLS if not hasattr(lib, s)]
    if missing:
        raise OSError(f"{path.name} lacks {', '.join(missing)}")
    _declare(lib)
    bad = layout_mismatches(layout_table(lib))
    if bad:  # the ctypes Structures below disagree with the compiled qp_abi.h: passing them would corrupt memory
        raise OSError(f"{path.name}: struct layout differs from native.py's: {'; '.join(bad[:4])}")
    return lib


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    if abi.stale():  # the structs' C side would disagree with the ctypes classes made from abi.py
        raise OSError(f"{abi.HEADER.name} is not abi.py's declaration: run `python -m quantplug.kernels.abi`")
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler ({cc!r} not on PATH)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    # -ffp-contract=off: "d * q - m" stays two roundings (gguf-py's values); the kernels' fused
    # multiply-adds are explicit intrinsics, which the flag does not touch
    flags = ["-O3", f"-march={os.environ.get('QUANTPLUG_NATIVE_MARCH', 'native')}", "-fopenmp", "-shared", "-fPIC",
             "-std=c11", "-ffp-contract=off"]
    src = source_digest()
    key = hashlib.sha256(src + version.encode() + _cpu_flags().encode() + " ".join(flags).encode()).hexdigest()[:16]
    d = _private_dir(cache_dir())
    out = d / f"qp_kernels-{key}.so"
    with open(d / ".build.lock", "a+") as lock:
        os.chmod(lock.name, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent first uses: one compiles, the others wait
        try:
            if not _trusted(out):
                _compile(cc, flags, out)
            try:
                return _open(out)
            except OSError:
                _compile(cc, flags, out)  # broken (truncated, stale): rebuilt once
                # loaded under a name of its own: the dynamic loader hands back the broken library
                # already loaded under the first name
                fresh = out.with_name(f"{out.stem}.{os.getpid()}.so")
                os.link(out, fresh)
                try:
                    return _open(fresh)
                finally:
                    fresh.unlink()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


#: the ctypes Structure of each C struct (``abi.STRUCTS``), filled as the classes below are made
STRUCTS: dict[str, type[ctypes.Structure]] = {}


def _struct(name: str, cls: type[ctypes.Structure]) -> type[ctypes.Structure]:
    """``cls`` with the fields of C struct ``name`` from its one declaration (:mod:`.abi`)."""
    cls._fields_ = abi.ctypes_fields(name, STRUCTS)
    STRUCTS[name] = cls
    return cls


class Act(ctypes.Structure):
    """``qp_act``: how a layer's activations are quantized before its product."""


class Mat(ctypes.Structure):
    """``qp_mat``: one weight matrix of one form."""


class LatentAttn(ctypes.Structure):
    """``qp_latent_attn``: one latent-attention layer's dimensions and matrices (DeepSeek's MLA)."""


class Pool(ctypes.Structure):
    """``qp_pool``: a pooled compressor of an attention's keys (DeepSeek-V4's CSA / HCA compressors)."""


class PoolState(ctypes.Structure):
    """``qp_pool_state``: one decode call's view of a pooled compressor's state (buffers Python owns)."""


class WindowAttn(ctypes.Structure):
    """``qp_window_attn``: sliding-window attention with sinks, a pooled compressor and an indexer
    (DeepSeek-V4's SWA / CSA / HCA attention)."""


class Router(ctypes.Structure):
    """``qp_router``: a routed MoE's router as data (``quantplug.contract.routing.RouterSpec`` and its tensors)."""


class Layer(ctypes.Structure):
    """``qp_layer``: one decoder layer of the whole-stack decode step (``qp_stack_step``)."""


class WindowState(ctypes.Structure):
    """``qp_window_state``: one decode call's view of a window-attention layer's cache."""


class HyperBlock(ctypes.Structure):
    """``qp_hyper_block``: one decoder layer of residual streams (hyper-connections) around a
    window attention and a MoE / MLP (DeepSeek-V4's block)."""


class Draft(ctypes.Structure):
    """``qp_draft``: the drafter of a speculative step (``qp_spec_step``): two norms, a projection of
    their concatenation, one decoder layer, a final norm."""


for _name, _cls in (("qp_act", Act), ("qp_mat", Mat), ("qp_latent_attn", LatentAttn), ("qp_pool", Pool),
                    ("qp_pool_state", PoolState), ("qp_window_attn", WindowAttn), ("qp_router", Router),
                    ("qp_layer", Layer), ("qp_window_state", WindowState), ("qp_hyper_block", HyperBlock),
                    ("qp_draft", Draft)):
    _struct(_name, _cls)
assert list(STRUCTS) == list(abi.STRUCTS), "every declared struct has its ctypes class, in order"

MLA = LatentAttn  # the name before the kernel sources named block kinds, not models


class LayoutEntry(ctypes.Structure):
    """``qp_layout_entry`` (``layout.c``): one field's offset and size as the C compiler lays it out
    (field ``""``: the struct's own size)."""

    _fields_ = [  # noqa: RUF012
        ("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", ctypes.c_int64), ("size", ctypes.c_int64)]


def layout_table(lib: Any) -> dict[str, dict[str, tuple[int, int]]]:
    """``qp_layout_table()`` of a loaded library (or a probe built from ``layout.c``): struct name ->
    field name (``""`` for the struct) -> (offset, size)."""
    fn = lib.qp_layout_table
    fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_int64)], ctypes.POINTER(LayoutEntry)
    n = ctypes.c_int64()
    rows = fn(ctypes.byref(n))
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for i in range(n.value):
        e = rows[i]
        out.setdefault(e.type.decode(), {})[e.field.decode()] = (e.offset, e.size)
    return out


def layout_mismatches(table: dict[str, dict[str, tuple[int, int]]],
                      structs: dict[str, type[ctypes.Structure]] | None = None) -> list[str]:
    """How the ctypes Structures (default :data:`STRUCTS`) differ from the C layout ``table``: every
    struct and field missing on either side, and every field or struct whose offset or size
    differs; empty when they agree."""
    bad = []
    for name, cls in (structs or STRUCTS).items():
        c = table.get(name)
        if c is None:
            bad.append(f"{name}: not in the C table")
            continue
        py = {f[0]: (getattr(cls, f[0]).offset, getattr(cls, f[0]).size) for f in cls._fields_}
        if c.get("", (0, None))[1] != ctypes.sizeof(cls):
            bad.append(f"{name}: sizeof {c.get('', (0, None))[1]} in C, {ctypes.sizeof(cls)} in ctypes")
        for field in sorted(set(py) | set(c) - {""}):
            if field not in c:
                bad.append(f"{name}.{field}: not in C")
            elif field not in py:
                bad.append(f"{name}.{field}: not in ctypes")
            elif c[field] != py[field]:
                bad.append(f"{name}.{field}: (offset, size) {c[field]} in C, {py[field]} in ctypes")
    return bad


def _declare(lib: ctypes.CDLL) -> None:
    i64, p, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    mp = ctypes.POINTER(Mat)
    mpp = ctypes.POINTER(mp)
    sig = {
        "qp_form_info": ([i32, ctypes.POINTER(i64), ctypes.POINTER(i64)], i32),
        "qp_isa": ([], i32),
        "qp_check": ([mp], i32),
        "qp_dequant": ([mp, i64, i64, p, i64, i32], i32),
        "qp_act_rows": ([mp, i64, p, i64, p], i32),
        "qp_gemm": ([mpp, i32, i64, i64, p, i64, p, p, p, p, p, i64, i32], i32),
        "qp_mlp": ([mpp, mpp, mpp, i32, i64, p, i64, i32, p, p, p, p, i64, i32, i32, ctypes.c_float, ctypes.c_float], i32),
        "qp_latent_pre": ([ctypes.POINTER(LatentAttn), i64, p, p, p, p, p, i32], i32),
        "qp_latent_post": ([ctypes.POINTER(LatentAttn), i64, p, p, i64, i64, p, i64, i64, i64, p, i64, p, i32, p, p,
                            i32], i32),
        "qp_latent_step": ([ctypes.POINTER(LatentAttn), i64, p, p, p, i64, i64, p, i64, i64, i64, p, i64, p, i32, p,
                            i32], i32),
        "qp_decode_step": ([ctypes.POINTER(Layer), i32, i64, i64, p, mp, p, p, p, p, i64, i64, i64, i64, i64, p, i64, p,
                            i32, p, i32, ctypes.c_float, p, mp, p, p, i32], i32),
        "qp_spec_step": ([ctypes.POINTER(Layer), i32, i64, p, mp, p, p, p, i64, i64, i64, i32, p, i32, ctypes.c_float,
                          mp, ctypes.POINTER(Draft), p, p, i64, p, p, p, p, p, i32], i32),
        "qp_route": ([ctypes.POINTER(Router), i32, i64, i64, p, i32, p, p, p], i32),
        "qp_fp8_has_nan": ([p, i64], i32),
        "qp_row_kernel": ([mp, i32], i32),
        "qp_pair_products": ([i32], i32),
        "qp_pair_tasks": ([], i64),
        "qp_bf16_has_subnormal": ([p, i64], i32),
        "qp_kda_step": ([i64, i64, i64, i64, p, p, p, p, p, p, i32, ctypes.c_float, p, p, p, ctypes.c_float, p, i32,
                         p], i32),
    }
    f32 = ctypes.c_float
    sig["qp_hyper_pre"] = ([i64, i32, i64, p, p, i32, p, p, i32, f32, f32, p, p, p, p], i32)
    sig["qp_hyper_post"] = ([i64, i32, i64, p, p, p, p, p], i32)
    sig["qp_window_step"] = ([ctypes.POINTER(WindowAttn), i64, p, p, p, p, i64, ctypes.POINTER(PoolState),
                              ctypes.POINTER(PoolState), p, i32], i32)
    sig["qp_hyper_decode_step"] = ([ctypes.POINTER(HyperBlock), ctypes.POINTER(WindowState), i32, i64, i64, p, mp, p, p,
                                    p, p, f32, p, mp, p, p, i32], i32)
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


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
                    _status = f"built ({ISA_NAMES.get(_lib.qp_isa(), '?')})"
                except (OSError, subprocess.SubprocessError, AttributeError) as e:
                    _lib = None
                    _status = f"unavailable, torch paths used: {e}"
            _tried = True
    return _lib


def status() -> str:
    """How the native kernels stand in this process: built (which SIMD path), disabled, or why not."""
    library()
    return _status


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise QuantplugError(f"native kernel {what} refused its arguments (code {rc})")


class disabled:
    """``with native.disabled():`` the torch paths only, in this process, for the block (tests
    compare the two)."""

    def __enter__(self) -> None:
        global _lib, _tried
        library()
        self._saved = (_lib, _tried)
        _lib, _tried = None, True

    def __exit__(self, *exc: object) -> None:
        global _lib, _tried
        _lib, _tried = self._saved


# -- binding a layer's weights ------------------------------------------------------------------

WROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Bound:
    """A layer's :class:`~quantplug.kernels.forms.Weights` as native matrices: one ``qp_mat`` per
    slot (one for a plain linear, E for stacked experts or per-head K/V), validated once here and
    again by the C code. Holds every tensor it points into."""

    def __init__(self, weights: Weights, out_features: int, in_features: int, slots: int | None,
                 model_dtype: torch.dtype, mode: str, where: str, lookups: bool = False) -> None:
        weights.check(out_features, in_features, slots, where)
        f = weights.form
        if model_dtype not in WROUND:
            raise QuantplugError(f"{where}: model dtype {model_dtype} has no native kernels")
        self.weights, self.form, self.where = weights, f, where
        self.n, self.k, self.slots = out_features, in_features, slots
        self.model_dtype, self.wround = model_dtype, WROUND[model_dtype]
        self.mode = mode if f.dtype in FAST_FORMS else "exact"
        self.device_ok = all(t.device.type == "cpu" for t in self._tensors())
        count = slots or 1
        self._keep: list[torch.Tensor] = [weights.weight, *weights.keep]
        rb = f.row_bytes(in_features)
        slot_w = weights.weight.stride(0) * weights.weight.element_size() if slots is not None else 0
        rowsum = bias = oscale = None
        act = f.act
        if act is not None and act.integer != "float":
            codes = weights.weight.view(torch.int8)
            rowsum = codes.to(torch.int32).sum(-1, dtype=torch.int32).contiguous()
            self._keep.append(rowsum)
            if act.integer == "static":
                assert weights.bias is not None and weights.output_scale is not None
                bias = weights.bias.to(torch.int32).contiguous()
                oscale = weights.output_scale.to(torch.float32).contiguous()
                self._keep += [bias, oscale]
        scale = weights.scale
        if scale is not None:
            scale = scale.contiguous()
            if f.scale in ("E8M0", "E4M3"):
                scale = scale.view(torch.uint8)
            self._keep.append(scale)
        zero = weights.zero
        if zero is not None:
            self._keep.append(zero)
        srows, scols = weights.scale_shape(out_features, in_features)
        slot_s = srows * scols if scale is not None and scale.numel() > 1 else 0
        gs = (weights.global_scale.to(torch.float32).reshape(-1).tolist()
              if f.global_scale and weights.global_scale is not None else [1.0] * count)
        ins = (weights.input_scale.to(torch.float32).reshape(-1).tolist()
               if weights.input_scale is not None else [0.0] * count)
        ino = (weights.input_offset.to(torch.float32).reshape(-1).tolist()
               if weights.input_offset is not None else [0.0] * count)
        nan = int(f.dtype == "FP8" and has_nan_codes(weights.weight))
        eff = (_effective_scales(scale, f.scale, f.global_mode, gs, count).abs().nan_to_num(0.0)
               if f.scaled and scale is not None else None)
        big = int(f.dtype == "FP8" and eff is not None and bool(eff.max() >= 2.0 ** 119))
        # a weight q * s may be subnormal: the smallest non-zero code times the smallest non-zero
        # scale below 2^-126 (then no kernel may flush it: the bfloat16 conversion instruction would)
        nz = eff[eff > 0] if eff is not None else None
        tiny = int(nz is not None and nz.numel() > 0 and float(nz.min()) * MIN_CODE.get(f.dtype, 1.0) < 2.0 ** -126)
        if f.dtype == "BF16" and self.wround == WROUND[torch.bfloat16]:
            # stored bfloat16 rows in a bfloat16 model take the pair products (which read a
            # subnormal as zero) unless a value is subnormal. An embedding table (``lookups``:
            # rows looked up, or a tied head's products) is not scanned, which would read the
            # whole table at load (a file-backed one then resident): marked, it keeps the FMA tile
            tiny = 1 if lookups else int(has_subnormal_bf16(weights.weight))
        self.mats = (Mat * count)()
        base = weights.weight.data_ptr()
        for i in range(count):
            m = self.mats[i]
            m.type, m.n, m.k = FORMS[f.dtype][0], out_features, in_features
            m.w, m.ldw = base + i * slot_w, rb
            m.mode, m.nan, m.big, m.tiny = MODES[self.mode], nan, big, tiny
            if f.scaled:
                assert scale is not None
                m.sdt = SCALE_ENCODINGS[f.scale]
                m.s = scale.data_ptr() + i * slot_s * scale.element_size()
                m.lds = 0 if scale.numel() == 1 or (f.rows == 0 and f.group == 0) else scols
                m.gk = f.group if f.group else in_features
                m.gn = f.rows if f.rows else out_features
                if zero is not None:
                    m.z = zero.data_ptr() + i * slot_s * zero.element_size()
                    m.zi8 = int(zero.dtype == torch.int8)
                m.gs = gs[i]
                m.gmode = GLOBAL_MODES[f.global_mode] if f.global_scale else 0
            if rowsum is not None:
                m.rowsum = rowsum.data_ptr() + i * out_features * 4
            if bias is not None and oscale is not None:
                m.bias = bias.data_ptr() + i * out_features * 4
                m.os = oscale.data_ptr() + i * out_features * 4
            if act is not None:
                m.act.kind, m.act.group, m.act.ue8m0 = ACT_KINDS[act.kind], act.group, int(act.ue8m0)
                m.act.epi, m.act.floor = INTEGER[act.integer], act.floor
                m.act.scale, m.act.offset = ins[i], ino[i]
        self.ptrs = [ctypes.pointer(self.mats[i]) for i in range(count)]
        #: (parameter name, tensor, data pointer) that compute.bound() checks; set by compute.bind
        self.sentinel: tuple[str, torch.Tensor, int] | None = None

    def native_shapes(self) -> bool:
        """The C code's shape rules (``mat_ok``), decided here whether or not the library is loaded,
        so a binding never depends on when it was made: inputs in whole blocks and a multiple of
        32, scale groups a multiple of 16 (or the whole row)."""
        e, _ = self.form.block
        if self.k % max(e, 32) or (self.form.scaled and self.form.group and self.form.group % 16):
            return False
        lib = library()
        return lib is None or all(lib.qp_check(ctypes.byref(m)) == 0 for m in self.mats)

    def _tensors(self) -> list[torch.Tensor]:
        w = self.weights
        return [t for t in (w.weight, w.scale, w.zero) if t is not None]

    def valid(self) -> bool:
        """Library loaded and every tensor on the CPU (a model moved to another device is not read)."""
        return self.device_ok and library() is not None

    def verify(self) -> None:
        """The C code's own validation of every slot (raises QuantplugError)."""
        lib = library()
        if lib is None:
            return
        for i in range(len(self.mats)):
            if lib.qp_check(ctypes.byref(self.mats[i])) != 0:
                raise QuantplugError(f"{self.where}: the native kernels refuse form {self.form.describe()} "
                                     f"for [{self.n}, {self.k}]")

    def ptr(self, slot: int | None = None) -> Any:
        return self.ptrs[slot or 0]


def _effective_scales(scale: torch.Tensor, encoding: str, mode: str, gs: list[float], count: int) -> torch.Tensor:
    """The scales as the kernels multiply by them (a global scale folded in by ``mode``)."""
    sv = scale_values(scale, encoding)
    if mode == "after" or sv.numel() == 1 and count > 1:
        return sv
    g = torch.tensor(gs, dtype=torch.float32).reshape(count, *[1] * max(sv.dim() - 1, 0)) if count > 1 else torch.tensor(gs[0])
    return sv * g if mode == "times_scale" else sv / g


#: bit 7 of each byte of an int64 (0x8080808080808080 as a signed value)
_TOP = -0x7F7F7F7F7F7F7F80


def _native_scan(fn: str, b: torch.Tensor) -> bool | None:
    """The native scan ``fn(pointer, count)`` (1: found, 0: not) over contiguous ``b``; None off the
    CPU or without the kernels (the caller scans in torch)."""
    lib = library() if b.device.type == "cpu" else None
    if lib is None:
        return None
    rc = getattr(lib, fn)(b.data_ptr(), b.numel())
    check(min(rc, 0), fn)
    return rc == 1


def has_nan_codes(q: torch.Tensor) -> bool:
    """Whether float8 e4m3 (or its uint8 bytes) ``q`` holds a NaN code (S.1111.111): natively at
    memory speed (``qp_fp8_has_nan``, any alignment), else eight bytes per int64 lane in torch,
    the unaligned head and the tail byte by byte."""
    b = q.contiguous().view(torch.uint8).reshape(-1)
    found = _native_scan("qp_fp8_has_nan", b)
    if found is not None:
        return found
    head = min(-b.storage_offset() % 8, b.numel())  # int64 views need 8-byte aligned offsets
    n8 = (b.numel() - head) // 8 * 8
    if n8:
        w = b[head:head + n8].view(torch.int64)
        if bool(((w & 0x7F7F7F7F7F7F7F7F) + 0x0101010101010101).bitwise_and_(_TOP).any()):
            return True
    rest = torch.cat([b[:head], b[head + n8:]])
    return bool(((rest & 0x7F) == 0x7F).any())


def has_subnormal_bf16(w: torch.Tensor) -> bool:
    """Whether bfloat16 ``w`` holds a subnormal value (exponent bits 0, mantissa not 0): natively
    at memory speed (``qp_bf16_has_subnormal``), else in torch."""
    b = w.contiguous().view(torch.int16).reshape(-1)
    found = _native_scan("qp_bf16_has_subnormal", b)
    if found is not None:
        return found
    return bool((((b & 0x7F80) == 0) & ((b & 0x7F) != 0)).any())


def pair_products(on: bool | None = None) -> bool:
    """bfloat16 pair products (AVX512-BF16 builds): a bfloat16 model's exact products on bfloat16
    inputs multiply pairs of bfloat16 values in one instruction (``vdpbf16ps``) instead of two
    float32 FMAs; the same products, summed in another order (docs/kernels.md). ``on`` switches them for later products (tests
    compare both ways); returns whether they were on before (False where the build has none)."""
    lib = library()
    if lib is None:
        return False
    return lib.qp_pair_products(-1 if on is None else int(on)) == 1


def pair_tasks() -> int:
    """How many row tasks have taken the bfloat16 pair products in this process."""
    lib = library()
    return 0 if lib is None else int(lib.qp_pair_tasks())


def native_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in WROUND


def _as_f32_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    return x2 if x2.stride(-1) == 1 and (x2.shape[0] <= 1 or x2.stride(0) >= k) else x2.contiguous()


def gemm(x: torch.Tensor, mats: Sequence[Any], groups: Sequence[tuple[int, int, int, int]] | None = None,
         out_rows: int | None = None, wround: int = 0) -> torch.Tensor:
    """float32 ``x`` [M, K] (``x.stride(1) == 1``) through native matrices ``mats`` (``Mat``
    pointers, each of K inputs). Without ``groups``: every matrix on all M rows, outputs side by
    side: [M, sum N]. With ``groups`` (one ``(x_row, x_rows, y_row, y_col)`` per matrix): matrix g
    on x rows ``[x_row, x_row + x_rows)`` into ``y[y_row:, y_col:]``; y is [``out_rows``,
    max(y_col + N_g)], zero where no group writes."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    g = len(mats)
    ns = [mp.contents.n for mp in mats]
    if g == 0:
        raise QuantplugError("native gemm: no matrices")
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
        if len(groups) != g or any(xr < 0 or xm < 1 or xr + xm > m or yr < 0 or yr + xm > rows or yc < 0
                                   for xr, xm, yr, yc in groups):
            raise QuantplugError(f"native gemm: groups {list(groups)} do not fit x [{m}, {k}] / y [{rows}, {width}]")
        covered = sum(xm * n for (_, xm, _, _), n in zip(groups, ns))
        y = (torch.empty if covered == rows * width else torch.zeros)(rows, width, dtype=torch.float32)
    arr = ctypes.c_int64 * g
    rc = lib.qp_gemm((ctypes.POINTER(Mat) * g)(*mats), g, m, k, x.data_ptr(), x.stride(0),
                     arr(*[t[0] for t in groups]), arr(*[t[1] for t in groups]),
                     arr(*[t[2] for t in groups]), arr(*[t[3] for t in groups]), y.data_ptr(), y.stride(0), wround)
    check(rc, "gemm")
    return y


def dequant(mat: Any, r0: int, r1: int, out: torch.Tensor, wround: int = 0) -> torch.Tensor:
    """Rows [r0, r1) of one native matrix, exactly decoded, into float32 ``out`` [r1 - r0, K]."""
    lib = library()
    assert lib is not None and out.dtype == torch.float32 and out.stride(1) == 1
    check(lib.qp_dequant(mat, r0, r1, out.data_ptr(), out.stride(0), wround), "dequant")
    return out


def act_rows(mat: Any, x: torch.Tensor) -> torch.Tensor:
    """float32 rows ``x`` [M, K] as ``mat``'s exact product sees them (activation quantization applied)."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and x.stride(1) == 1
    out = torch.empty(x.shape, dtype=torch.float32)
    check(lib.qp_act_rows(mat, x.shape[0], x.data_ptr(), x.stride(0), out.data_ptr()), "act_rows")
    return out
