"""Index GGUF files from their headers: metadata, tensor infos, absolute byte ranges.

Why our own reader: gguf-py's ``GGUFReader`` builds numpy views for every metadata value on
open, and real DeepSeek / Kimi GGUFs carry 129k-160k-token vocabularies (``tokenizer.ggml.*``
string arrays of hundreds of thousands of entries); parsing them costs seconds per file. The plan
needs only the tensor infos and a few hyper-parameters, so this reader walks the header once,
decodes scalar and small array values, and *skips* the ``tokenizer.*`` arrays (one length read
per string, no decode). It reads the header only, never tensor data. ``tests`` check it against
``GGUFReader`` field by field and tensor by tensor.

File layout (GGUF v2/v3, little-endian; ggml-org/ggml docs/gguf.md)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key | u32 value_type | value)         string = u64 length + UTF-8 bytes
    n_tensors x (string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset)
    padding to general.alignment (default 32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..types import TORCH_DTYPE_NAMES, TensorInfo
from ..validation import check_count, check_inside

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
#: value types: id -> (struct format, size); 8 = string, 9 = array
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9
#: metadata whose arrays are skipped, not decoded (vocabularies, merges, token types)
SKIP_PREFIXES = ("tokenizer.",)
#: arrays longer than this are skipped too (kept as ``SkippedArray``), whatever their key
MAX_DECODED_ARRAY = 4096
#: deepest array-of-arrays nesting walked
MAX_ARRAY_DEPTH = 4
#: GGML_MAX_DIMS
MAX_DIMS = 4
#: largest general.alignment accepted (llama.cpp writes 32; anything past a huge page is corrupt)
MAX_ALIGNMENT = 1 << 21
#: most tensors / metadata keys one GGUF file may list. DeepSeek-V3 / Kimi GGUFs hold ~1,100
#: tensors (routed experts stacked per layer) and ~50 keys; a header listing more is refused
#: before any per-entry work (a million empty tensor infos cost seconds and ~80 MiB to walk)
MAX_TENSORS = 1 << 16
MAX_KV = 1 << 16
#: least bytes of one tensor info: name length (8) + a non-empty name (1) + n_dims (4) + type (4) + offset (8)
MIN_INFO_BYTES = 25
_INT_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_FLOAT_TYPES = frozenset({6, 12})
#: metadata keys (by suffix) whose type and range the reader checks: they size tensors and loops
_INT_SUFFIXES = ("_count", "_length", "_size", "_rank", ".alignment", "split.count", "split.no",
                 "key_length", "value_length")
_FLOAT_SUFFIXES = ("freq_base", "_epsilon", "scaling.factor", "scaling.yarn_log_multiplier")
#: string keys the core reads itself (a plugin reads its own keys through ``quantplug.api.Fields``)
_STRING_KEYS = ("general.architecture",)


class SkippedArray:
    """Placeholder for a metadata array that was walked over but not decoded."""

    def __init__(self, value_type: int, count: int) -> None:
        self.value_type, self.count = value_type, count

    def __repr__(self) -> str:
        return f"<array of {self.count} (type {self.value_type}), not decoded>"


@functools.cache
def ggml_types() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, block size, bytes per block), from gguf-py's constants."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, file: Path) -> None:
        self.buf, self.pos, self.file, self.size = buf, 0, file, len(buf)

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise CheckpointError(f"{self.file}: truncated GGUF header while reading {what} "
                                  f"(needs {n} bytes at offset {self.pos}, file has {self.size})")

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", 8, what))

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.file}: {what} at offset {self.pos - n} is not UTF-8") from None

    def skip_strings(self, count: int, what: str) -> None:
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, what)
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos
        self.need(0, what)
        if pos > size:
            raise CheckpointError(f"{self.file}: truncated GGUF header in {what}")

    def value(self, vtype: int, key: str, decode: bool, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.scalar(fmt, size, f"metadata {key}")
        if vtype == _STRING:
            return self.string(f"metadata {key}")
        if vtype == _ARRAY:
            etype = self.u32(f"metadata {key} (array type)")
            count = self.u64(f"metadata {key} (array length)")
            least = _SCALARS[etype][1] if etype in _SCALARS else 8 if etype == _STRING else 12
            check_count(count, least, self.size - self.pos, f"metadata {key} (array length)", self.file)
            if etype in _SCALARS:
                fmt, size = _SCALARS[etype]
                self.need(count * size, f"metadata {key}")
                if not decode or count > MAX_DECODED_ARRAY:
                    self.pos += count * size
                    return SkippedArray(etype, count)
                vals = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos += count * size
                return vals
            if etype == _STRING:
                if not decode or count > MAX_DECODED_ARRAY:
                    self.skip_strings(count, f"metadata {key}")
                    return SkippedArray(etype, count)
                return [self.string(f"metadata {key}[{i}]") for i in range(count)]
            if etype == _ARRAY:  # nested arrays: walk them (rare; never decoded)
                if depth >= MAX_ARRAY_DEPTH:
                    raise CheckpointError(f"{self.file}: metadata {key}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
                for _ in range(count):
                    self.value(_ARRAY, key, False, depth + 1)
                return SkippedArray(etype, count)
            raise CheckpointError(f"{self.file}: metadata {key}: unknown array element type {etype}")
        raise CheckpointError(f"{self.file}: metadata {key}: unknown value type {vtype}")


@dataclass(frozen=True)
class GGUFHeader:
    """One GGUF file's header: metadata, tensors (absolute byte ranges) and section positions.

    ``kv_end`` is where the metadata section ends (it starts at byte 24), ``infos_end`` where the
    tensor infos end; ``data_start`` is the aligned start of tensor data. Tools that rewrite a
    GGUF (``quantplug expert-pack build``) copy the metadata bytes verbatim from these positions.
    """

    file: Path
    version: int
    n_kv: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    kv_end: int
    infos_end: int
    alignment: int
    data_start: int


def read_gguf_header(file: Path) -> GGUFHeader:
    """Parse one GGUF file's header (no tensor data read)."""
    types = ggml_types()
    with contextlib.ExitStack() as stack:
        try:
            fh = stack.enter_context(open(file, "rb"))
        except OSError as exc:
            raise CheckpointError(f"{file}: cannot open ({exc.strerror})") from None
        try:
            buf: mmap.mmap | bytes = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # empty file
            buf = b""
        file_size = len(buf)
        cur = _Cursor(buf, file)
        cur.need(4, "the magic")
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise CheckpointError(f"{file}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        version = cur.u32("the version")
        if version not in (2, 3):
            raise CheckpointError(f"{file}: GGUF version {version} is not supported (expected 2 or 3)")
        n_tensors = cur.u64("the tensor count")
        n_kv = cur.u64("the metadata count")
        # counts are checked against fixed limits and the bytes present before anything loops over them
        for count, limit, what in ((n_tensors, MAX_TENSORS, "tensor"), (n_kv, MAX_KV, "metadata")):
            if count > limit:
                raise CheckpointError(f"{file}: the header lists {count:,} {what} entries; a GGUF of this format "
                                      f"holds at most {limit:,} (the header is corrupt)")
        check_count(n_kv, 13, file_size - cur.pos, "the metadata count", file)
        check_count(n_tensors, MIN_INFO_BYTES, file_size - cur.pos, "the tensor count", file)
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in metadata:
                raise CheckpointError(f"{file}: metadata key {key!r} appears twice (keys #{list(metadata).index(key)} "
                                      f"and #{i})")
            vtype = cur.u32(f"metadata {key} (type)")
            metadata[key] = _typed(file, key, vtype, cur.value(vtype, key, not key.startswith(SKIP_PREFIXES)))
        kv_end = cur.pos
        alignment = _alignment(file, metadata)
        # every tensor holds at least one byte and starts on an alignment boundary after the infos:
        # the smallest file that can hold n_tensors of them, checked before the per-tensor loop
        least = kv_end + n_tensors * MIN_INFO_BYTES + (max(n_tensors - 1, 0) * alignment + 1 if n_tensors else 0)
        if least > file_size:
            raise CheckpointError(f"{file}: truncated GGUF header (or a corrupt count): {n_tensors:,} tensors need at "
                                  f"least {least:,} bytes of tensor infos and {alignment}-aligned data, the file "
                                  f"has {file_size:,}")
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = cur.string(f"tensor info #{i}")
            if not name:
                raise CheckpointError(f"{file}: tensor info #{i} has an empty name")
            if name in names:
                raise CheckpointError(f"{file}: tensor {name} is listed twice in the tensor infos")
            names.add(name)
            n_dims = cur.u32(f"tensor {name} (n_dims)")
            if n_dims > MAX_DIMS:
                raise CheckpointError(f"{file}: tensor {name} has {n_dims} dimensions (GGUF allows at most {MAX_DIMS})")
            cur.need(8 * n_dims, f"tensor {name} (shape)")
            ne = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
            cur.pos += 8 * n_dims
            ttype = cur.u32(f"tensor {name} (type)")
            offset = cur.u64(f"tensor {name} (offset)")
            raw.append((name, tuple(int(d) for d in ne), ttype, offset))
        infos_end = cur.pos
        data_start = -(-infos_end // alignment) * alignment
        if isinstance(buf, mmap.mmap):
            buf.close()
    tensors: list[TensorInfo] = []
    for name, ne, ttype, offset in raw:
        if ttype not in types:
            raise CheckpointError(f"{file}: tensor {name} has unknown ggml type id {ttype}")
        tname, block, type_size = types[ttype]
        if 0 in ne:
            raise CheckpointError(f"{file}: tensor {name} ({tname} {list(reversed(ne))}) has a zero dimension: an "
                                  "empty tensor (no model quantplug loads has one)")
        if ne and ne[0] % block:
            raise CheckpointError(f"{file}: tensor {name} ({tname}): row length {ne[0]} is not a multiple "
                                  f"of the block size {block}")
        rows = 1
        for d in ne[1:]:
            rows *= d
        nbytes = rows * (ne[0] // block * type_size if ne else type_size)
        start = data_start + offset
        if offset % alignment:
            raise CheckpointError(f"{file}: tensor {name}: data offset {offset} is not aligned to {alignment}")
        if start + nbytes > file_size:
            raise CheckpointError(f"{file}: tensor {name} ({tname} {list(reversed(ne))}): bytes {start}..{start + nbytes}"
                                  f" lie past the end of the file ({file_size} bytes); the file is truncated")
        tensors.append(TensorInfo(name, file, tname, tuple(reversed(ne)), start, nbytes, "gguf"))
    _check_tiling(file, tensors, data_start, alignment, file_size)
    return GGUFHeader(file, version, n_kv, metadata, tensors, kv_end, infos_end, alignment, data_start)


def _alignment(file: Path, metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise CheckpointError(f"{file}: general.alignment = {alignment!r}: expected an integer power of two "
                              f"up to {MAX_ALIGNMENT}")
    return alignment


def _typed(file: Path, key: str, vtype: int, value: Any) -> Any:
    """Metadata values that size tensors or loops must have the type and range they promise."""
    if key.endswith(_INT_SUFFIXES) and not key.startswith(SKIP_PREFIXES):
        if vtype not in _INT_TYPES or value < 0:  # arrays too: the readers of these keys take one int
            raise CheckpointError(f"{file}: metadata {key} = {value!r} (value type {vtype}): expected a "
                                  "non-negative integer")
    elif key.endswith(_FLOAT_SUFFIXES):
        if vtype not in _FLOAT_TYPES | _INT_TYPES or not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{file}: metadata {key} = {value!r}: expected a finite positive number")
    elif key in _STRING_KEYS and vtype != _STRING:
        raise CheckpointError(f"{file}: metadata {key} = {value!r}: expected a string")
    return value


def _check_tiling(file: Path, tensors: list[TensorInfo], data_start: int, alignment: int, file_size: int) -> None:
    """The tensors' data ranges tile the data section: sorted by offset, each starts where the one
    before ends (rounded up to ``alignment``), the first at ``data_start``, and the file ends after
    the last one's padding at most. A range that overlaps another (an offset moved onto another
    tensor's data, a type that grew a tensor) or leaves bytes no tensor accounts for (a type
    changed Q4_0 -> Q2_K shrinks a tensor: the rest of its old bytes would be silently skipped) is
    refused, naming the tensors around it. The alignment padding after each tensor must be zeros (as
    llama.cpp and gguf-py write it): a type changed to a smaller one within the padding (F32 -> F16
    of a 4-element bias) leaves its old bytes there."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.label) for t in tensors)
    expected, before = data_start, "the start of the data section"
    pads: list[tuple[int, int, str]] = []
    for start, end, name in spans:
        if start < expected:
            raise CheckpointError(f"{file}: {before} and tensor {name} overlap (bytes {start}..{expected} belong "
                                  "to both); the tensor infos are corrupt")
        if start > expected:
            raise CheckpointError(f"{file}: bytes {expected}..{start} between {before} and tensor {name} belong to no "
                                  f"tensor: tensor data must tile the data section (up to {alignment}-byte alignment "
                                  "padding); a tensor's type or shape in the header does not match its data")
        expected, before = -(-end // alignment) * alignment, f"tensor {name}"
        if min(expected, file_size) > end:
            pads.append((end, min(expected, file_size), name))
    last_end = spans[-1][1] if spans else data_start
    if file_size > max(expected, data_start):
        raise CheckpointError(f"{file}: bytes {max(last_end, data_start)}..{file_size} after {before} belong to no "
                              f"tensor: tensor data must tile the data section (up to {alignment}-byte alignment "
                              "padding); a tensor's type or shape in the header does not match its data")
    if pads:  # at most alignment - 1 bytes after each tensor: every run in one call of the byte reader
        from ..memory import read_runs

        buf = torch.empty(sum(end - start for start, end, _ in pads), dtype=torch.uint8)
        try:
            with open(file, "rb") as fh:
                read_runs(fh.fileno(), [(start, end - start) for start, end, _ in pads], buf)
        except OSError as exc:
            raise CheckpointError(f"{file}: cannot read ({exc.strerror or exc})") from None
        at = 0
        for start, end, name in pads if bool(buf.any()) else ():  # locate the first non-zero padding
            if buf[at:at + end - start].any():
                raise CheckpointError(f"{file}: the alignment padding after tensor {name} (bytes {start}..{end})"
                                      " is not zeros: a tensor's type or shape in the header does not match its data")
            at += end - start


def index_gguf(root: Path) -> tuple[dict[str, TensorInfo], list[Path], dict[str, Any]]:
    files = sorted(root.glob("*.gguf"))
    check_inside(root, files, str(root))
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, Any] = {}
    for file in files:
        header = read_gguf_header(file)
        for key, value in header.metadata.items():
            if (key in metadata and metadata[key] != value and not key.startswith(("split.", "general."))
                    and not isinstance(value, SkippedArray)):
                raise CheckpointError(f"{file.name}: metadata {key} = {value!r} disagrees with another GGUF "
                                      f"file of the checkpoint ({metadata[key]!r})")
            metadata.setdefault(key, value)
        for t in header.tensors:
            if t.name in tensors:
                raise CheckpointError(f"tensor {t.name} is in two GGUF files: {tensors[t.name].file.name} "
                                      f"and {file.name}")
            tensors[t.name] = t
    return tensors, files, metadata


def storage_shape(info: TensorInfo) -> tuple[int, ...]:
    """Shape of the tensor's bytes as held in memory: the logical shape for float types;
    for block-quantized types the last dimension counts bytes ([..., row_bytes], uint8)."""
    if info.format != "gguf" or info.dtype in GGUF_FLOATS or not info.shape:
        return info.shape
    rows = 1
    for d in info.shape[:-1]:
        rows *= d
    return (*info.shape[:-1], info.nbytes // max(rows, 1))


#: GGUF's unquantized types (ggml names equal the safetensors names) -> torch dtype
GGUF_FLOATS: dict[str, torch.dtype] = {name: getattr(torch, TORCH_DTYPE_NAMES[name])
                                       for name in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")}


def gguf_view(raw: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    """Raw GGUF tensor bytes as a typed tensor (float / int types) or [..., row_bytes] uint8 blocks."""
    if info.dtype in GGUF_FLOATS:
        return raw.view(GGUF_FLOATS[info.dtype]).view(info.shape)
    return raw.view(storage_shape(info)) if info.nbytes else raw
