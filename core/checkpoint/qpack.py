"""Expert packs of safetensors checkpoints (``QPXPACK`` version 2), as the checkpoint reader sees them.

``quantplug expert-pack build`` moves the routed experts of a safetensors checkpoint (any format
whose experts are stored per expert under hub names, ``...mlp.experts.{E}.{gate,up,down}_proj.*``)
into one file, ``experts.qpack``, and points their ``model.safetensors.index.json`` entries at it.
:func:`~quantplug.checkpoint.safetensors_index.index_safetensors` recognises such an entry by the
file's magic and adds the pack's tensors as :class:`~quantplug.types.TensorInfo` whose byte range
is the payload: every backend, the in-memory loader and the expert cache read them as they read a
shard's tensors. Version 1 (packs of GGUF experts) is named by a GGUF file's metadata and read by
the backend that claims such files, which adds its payloads to the checkpoint the same way
(:meth:`~quantplug.checkpoint.Checkpoint.add_pack`, any object of the :class:`Pack` protocol):
from then on both versions are served alike. The layout of version 2, little-endian throughout:

* header, 256 bytes: magic ``QPXPACK\\0``, version 2, header / entry sizes, alignment, counts,
  index / names / data offsets, exact file size, sha256 of config.json, of the source shards'
  headers and of the index (entries + names);
* index: one 128-byte entry per payload, ordered by (layer, expert, role, name): layer, expert,
  role (0 gate, 1 up, 2 down), rank and shape (up to 4 dims), absolute offset, size, the
  tensor's checkpoint name (offset and length in the names block), its safetensors dtype, sha256;
* names: the entries' checkpoint names, UTF-8, back to back;
* payloads: each stored tensor of each expert verbatim, on an ``alignment`` boundary, one
  expert's payloads adjacent (next payload at the previous one's end rounded up to the alignment).

Opening validates the header and the whole index (no payload is read): a truncated, extended or
corrupt pack is a :class:`~quantplug.errors.CheckpointError` naming it at plan time. Each payload's
sha256 is checked the first time the loader or the expert cache reads it (:func:`verify`).
"""

from __future__ import annotations

import hashlib
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import CheckpointError
from ..types import TORCH_DTYPE_NAMES, TensorInfo

MAGIC = b"QPXPACK\x00"
VERSION = 2
HEADER_SIZE = 256
ENTRY_SIZE = 128
MAX_DIMS = 4
#: the projections of a routed expert, in role order
ROLES = ("gate_proj", "up_proj", "down_proj")
#: a routed expert's stored tensor under its hub name (any wrapper prefix: Kimi's ``language_model.``)
EXPERT_NAME = re.compile(r"^(?:.+\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(.+)$")

#: magic, version, header_size, entry_size, alignment, n_layers, n_experts, top_k, reserved, n_entries,
#: index_offset, names_offset, names_size, data_offset, file_size, config_sha256, source_sha256, index_sha256
HEADER = struct.Struct("<8sIIIIIIIIQQQQQQ32s32s32s")
ENTRY_DTYPE = np.dtype([("layer", "<u4"), ("expert", "<u4"), ("role", "<u4"), ("ndim", "<u4"),
                        ("shape", "<u8", (MAX_DIMS,)), ("offset", "<u8"), ("size", "<u8"),
                        ("name_offset", "<u8"), ("name_len", "<u4"), ("reserved", "<u4"),
                        ("dtype", "V16"), ("sha256", "V32")])  # V, not S: S strips trailing NUL bytes
assert ENTRY_DTYPE.itemsize == ENTRY_SIZE and HEADER.size <= HEADER_SIZE

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
assert set(_ITEMSIZE) == set(TORCH_DTYPE_NAMES)
#: bytes hashed per read when a payload is verified from the file
_VERIFY_CHUNK = 16 << 20


class ChecksumError(CheckpointError):
    """A pack payload's bytes do not match the sha256 of its index entry."""


def is_qpack(path: Path) -> bool:
    """Whether ``path`` starts with the expert pack's magic (reads 8 bytes)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(MAGIC)) == MAGIC
    except OSError:  # unreadable: not taken for a pack; the shard reader then reports the file
        return False


def align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def dtype_field(dtype: str) -> bytes:
    """A safetensors dtype name as the index stores it (16 bytes, NUL padded)."""
    raw = dtype.encode("ascii")
    if len(raw) > 16:
        raise CheckpointError(f"dtype {dtype!r} is longer than an expert pack index holds (16 bytes)")
    return raw.ljust(16, b"\0")


@dataclass(frozen=True)
class Payload:
    """One stored tensor of one routed expert, as the pack index describes it."""

    name: str
    layer: int
    expert: int
    role: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    size: int
    sha256: bytes

    def describe(self) -> str:
        return f"tensor {self.name} (layer {self.layer}, expert {self.expert}, {self.role})"


def read_head(path: Path, size: int = HEADER_SIZE) -> tuple[bytes, int]:
    """The first ``size`` bytes of the expert pack at ``path`` and the file's size; a
    CheckpointError naming the file when it cannot be read or is shorter than ``size`` (every pack
    version opens with a fixed-size header; the GGUF pack reader uses this too)."""
    try:
        actual = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(size)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the expert pack ({exc.strerror})") from None
    if len(head) < size:
        raise CheckpointError(f"{path}: truncated expert pack: {len(head)} bytes, the header alone is {size}")
    return head, actual


@runtime_checkable
class Pack(Protocol):
    """What the checkpoint reader needs of an expert pack (:class:`QPack`, version 2; a backend's
    own, such as the GGUF backend's version 1): its tensors, and each payload's sha256 checked on
    first read. Methods may be called from the expert cache's reader threads.

    .. versionadded:: 1.9
    """

    path: Path

    def tensors(self) -> dict[str, TensorInfo]:
        """Every payload as a tensor of the checkpoint (stored name -> info, ``file`` = the pack)."""
        ...

    def payload_at(self, offset: int) -> int:
        """Index of the payload holding byte ``offset`` of the pack, or -1."""
        ...

    def payload_span(self, i: int) -> tuple[int, int]:
        """(offset, size) of payload ``i``."""
        ...

    def verify(self, i: int, fd: int, data: Any = None) -> None:
        """Check payload ``i``'s sha256 unless already checked: over ``data`` (the whole payload,
        as just read) when given, else over the file's bytes through ``fd``; a mismatch is a
        ``ChecksumError`` naming the pack, the tensor and the expert."""
        ...


def payload_sha256(fd: int, offset: int, size: int, data: Any = None, *, where: str = "") -> bytes:
    """sha256 of a payload: over ``data`` (a buffer holding it) when given, else over the file's
    bytes at ``offset`` read through ``fd`` in chunks. A short read is a :class:`CheckpointError`
    naming ``where``."""
    sha = hashlib.sha256()
    if data is not None:
        sha.update(memoryview(data).cast("B"))
        return sha.digest()
    import torch

    from ..memory import read_runs

    buf = torch.empty(min(size, _VERIFY_CHUNK), dtype=torch.uint8)
    done = 0
    while done < size:  # the checkpoint byte reader, a chunk at a time
        n = min(buf.numel(), size - done)
        try:
            read_runs(fd, [(offset + done, n)], buf[:n])
        except OSError as exc:
            raise CheckpointError(f"{where}: short read in bytes {offset:,}..{offset + size:,} (the pack was "
                                  "truncated after it was opened?)") from exc
        sha.update(buf[:n].numpy().data)
        done += n
    return sha.digest()


class QPack:
    """A validated version-2 pack: header and index in memory, payloads read by the loader.

    ``payloads`` lists the index in order; :meth:`tensors` gives the checkpoint's view of them.
    Thread-safe: :meth:`verify` may be called from the expert cache's reader threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._read()
        self._verified = np.zeros(len(self.payloads), dtype=bool)
        self._starts = np.asarray([p.offset for p in self.payloads], dtype=np.int64)

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}")

    def _read(self) -> None:
        head, actual = read_head(self.path)
        (magic, version, header_size, entry_size, alignment, n_layers, n_experts, top_k, _, n_entries,
         index_offset, names_offset, names_size, data_offset, file_size, config_sha, source_sha,
         index_sha) = HEADER.unpack_from(head)
        if magic != MAGIC:
            raise self._fail(f"not an expert pack (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            what = " (a GGUF expert pack: it is named by its GGUF file's metadata, not by a safetensors index)" \
                if version == 1 else ""
            raise self._fail(f"expert pack version {version}{what}; a safetensors index can name version {VERSION}")
        if header_size != HEADER_SIZE or entry_size != ENTRY_SIZE:
            raise self._fail(f"header/entry size {header_size}/{entry_size}, expected {HEADER_SIZE}/{ENTRY_SIZE}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise self._fail(f"alignment {alignment} is not a power of two")
        if file_size < actual:
            raise self._fail(f"extended expert pack: the header says {file_size:,} bytes, the file has {actual:,}")
        index_bytes = n_entries * ENTRY_SIZE
        if index_bytes + names_size > actual - HEADER_SIZE:  # checked before anything is read or allocated
            raise self._fail(f"index of {n_entries:,} entries and {names_size:,} bytes of names cannot fit in the "
                             f"{actual:,}-byte file: the header is corrupt or the file truncated")
        if (index_offset != HEADER_SIZE or names_offset != index_offset + index_bytes
                or data_offset < names_offset + names_size or data_offset % alignment):
            raise self._fail(f"index at {index_offset}, names at {names_offset} (+{names_size}), data at "
                             f"{data_offset}: overlapping, misplaced or misaligned")
        with open(self.path, "rb") as fh:
            fh.seek(index_offset)
            raw = fh.read(index_bytes + names_size)
        if len(raw) != index_bytes + names_size:
            raise self._fail("truncated expert pack index")
        if hashlib.sha256(raw).digest() != index_sha:
            raise self._fail("index checksum mismatch: the pack index is corrupt")
        idx = np.frombuffer(raw, dtype=ENTRY_DTYPE, count=n_entries)
        names = raw[index_bytes:]
        self.alignment, self.top_k, self.data_offset, self.file_size = alignment, top_k, data_offset, file_size
        self.config_sha256, self.source_sha256, self.index_sha256 = config_sha, source_sha, index_sha
        payloads = self._entries(idx, names)
        self._check_layout(idx, payloads, actual)
        self.payloads = payloads
        self.layers = sorted({p.layer for p in payloads})
        self.n_experts = len({(p.layer, p.expert) for p in payloads})
        if (len(self.layers), self.n_experts) != (n_layers, n_experts):
            raise self._fail(f"the header counts {n_layers} layers / {n_experts} experts, the index holds "
                             f"{len(self.layers)} / {self.n_experts}")

    def _entries(self, idx: np.ndarray, names: bytes) -> list[Payload]:
        """The index as payloads: each entry's name, dtype, shape and size checked (ints only)."""
        n = len(idx)
        ndim = idx["ndim"]
        bad = np.nonzero((ndim > MAX_DIMS) | (idx["role"] >= len(ROLES)) | (idx["reserved"] != 0)
                         | (idx["name_offset"] > len(names))
                         | (idx["name_offset"] + idx["name_len"] > len(names))
                         | (idx["name_len"] == 0))[0]
        if len(bad):
            raise self._fail(f"index entry #{int(bad[0])}: rank, role, reserved field or name range out of bounds")
        out: list[Payload] = []
        seen: set[str] = set()
        cols = {f: idx[f].tolist() for f in ("layer", "expert", "role", "ndim", "shape", "offset", "size",
                                             "name_offset", "name_len")}
        dtypes, shas = idx["dtype"].tobytes(), idx["sha256"].tobytes()
        match = EXPERT_NAME.match
        for i in range(n):
            lo = cols["name_offset"][i]
            try:
                name = names[lo:lo + cols["name_len"][i]].decode("utf-8")
            except UnicodeDecodeError:
                raise self._fail(f"index entry #{i}: its name is not UTF-8") from None
            dtype = dtypes[16 * i:16 * i + 16].rstrip(b"\0").decode("ascii", "replace")
            k, dims = cols["ndim"][i], cols["shape"][i]
            shape = tuple(dims[:k])
            where = f"index entry #{i} ({name})"
            if any(dims[k:]):
                raise self._fail(f"{where}: dims past its rank {k} are not zero")
            if dtype not in _ITEMSIZE:
                raise self._fail(f"{where}: dtype {dtype!r} is not a safetensors dtype quantplug reads "
                                 f"({', '.join(_ITEMSIZE)})")
            m = match(name)
            layer, expert, role = cols["layer"][i], cols["expert"][i], ROLES[cols["role"][i]]
            if m is None or (int(m.group(1)), int(m.group(2)), m.group(3)) != (layer, expert, role):
                raise self._fail(f"{where}: not a routed expert's tensor of layer {layer}, expert {expert}, {role} "
                                 "(expected ...layers.L.mlp.experts.E.{gate,up,down}_proj.*)")
            if name in seen:
                raise self._fail(f"{where}: the name appears twice")
            seen.add(name)
            numel = 1
            for d in shape:
                numel *= d
            size = cols["size"][i]
            if numel * _ITEMSIZE[dtype] != size:
                raise self._fail(f"{where}: {dtype} {list(shape)} is {numel * _ITEMSIZE[dtype]:,} bytes, the index "
                                 f"says {size:,}")
            out.append(Payload(name, layer, expert, role, dtype, shape, cols["offset"][i], size,
                               shas[32 * i:32 * i + 32]))
        return out

    def _check_layout(self, idx: np.ndarray, payloads: list[Payload], actual: int) -> None:
        """Order, alignment, bounds and adjacency of the payloads (vectorised: 10^5 entries)."""
        if not payloads:
            return
        keys = [(p.layer, p.expert, ROLES.index(p.role), p.name) for p in payloads]
        for i in range(1, len(keys)):
            if keys[i] <= keys[i - 1]:
                raise self._fail(f"index entry #{i} ({payloads[i].name}) is out of order: expected (layer, expert, "
                                 "role, name) ascending")
        if self.file_size > actual:  # name the first payload the truncation cut
            cut = [i for i, p in enumerate(payloads) if p.offset + p.size > actual]
            what = (f"{payloads[cut[0]].describe()} at offset {payloads[cut[0]].offset:,} and {len(cut) - 1} "
                    "payload(s) after it lie" if cut else "its tail lies")
            raise self._fail(f"truncated expert pack: {what} past the end of the file ({actual:,} bytes; the header "
                             f"says {self.file_size:,})")
        for p in payloads:  # Python ints: no overflow whatever the index holds
            if p.offset % self.alignment or p.offset < self.data_offset or p.offset + p.size > self.file_size:
                raise self._fail(f"{p.describe()}: payload {p.offset}+{p.size} is misaligned or outside the data "
                                 f"region (data from {self.data_offset:,}, file {self.file_size:,} bytes)")
        starts = idx["offset"].astype(np.int64)  # all inside the file now
        ends = starts + idx["size"].astype(np.int64)
        clash = np.nonzero(starts[1:] < ends[:-1])[0]
        if len(clash):
            a = int(clash[0])
            raise self._fail(f"{payloads[a].describe()} and {payloads[a + 1].describe()}: payloads overlap or are not "
                             "in index order; the index is corrupt")
        same = (idx["layer"][1:] == idx["layer"][:-1]) & (idx["expert"][1:] == idx["expert"][:-1])
        padded = -(-ends[:-1] // self.alignment) * self.alignment
        gap = np.nonzero(same & (starts[1:] != padded))[0]
        if len(gap):
            a = int(gap[0])
            raise self._fail(f"{payloads[a + 1].describe()} starts at {int(starts[a + 1]):,}, not right after "
                             f"{payloads[a].describe()} (ends {int(ends[a]):,}): one expert's payloads must be adjacent")

    # -- the checkpoint's view --------------------------------------------------------------------

    def tensors(self) -> dict[str, TensorInfo]:
        """Every payload as the tensor it was in the checkpoint: name, dtype, shape; file = the pack."""
        trusted = TensorInfo.trusted
        return {p.name: trusted(p.name, self.path, p.dtype, p.shape, p.offset, p.size) for p in self.payloads}

    def payload_at(self, offset: int) -> int:
        """Index of the payload holding byte ``offset`` of the pack, or -1."""
        i = int(np.searchsorted(self._starts, offset, side="right")) - 1
        if i < 0 or offset >= self.payloads[i].offset + max(self.payloads[i].size, 1):
            return -1
        return i

    def payload_span(self, i: int) -> tuple[int, int]:
        p = self.payloads[i]
        return p.offset, p.size

    def verify(self, i: int, fd: int, data: Any = None) -> None:
        """Check payload ``i``'s sha256 unless already checked: over ``data`` (a buffer holding the
        whole payload, as just read) when given, else over the file's bytes (read in chunks).
        A mismatch is a :class:`CheckpointError` naming the pack, the tensor and the expert."""
        if self._verified[i]:
            return
        p = self.payloads[i]
        if payload_sha256(fd, p.offset, p.size, data, where=f"{self.path}: {p.describe()}") != p.sha256:
            raise ChecksumError(f"{self.path}: checksum mismatch in {p.describe()}: its {p.size:,}-byte payload at "
                                f"offset {p.offset:,} does not match the sha256 in the pack index; the expert pack is "
                                "corrupt (rebuild it with `quantplug expert-pack build`)")
        with self._lock:
            self._verified[i] = True


def verify(ckpt: Any, info: TensorInfo, data: Any = None) -> None:
    """Check the sha256 of the pack payload ``info`` lies in, the first time it is read (nothing
    for a tensor of any other file). ``data``: the bytes just read for ``info``, hashed instead of
    re-reading the file when they are the whole payload. Called by the loader and the expert cache."""
    packs = getattr(ckpt, "packs", None)
    pack = packs.get(info.file) if packs else None
    if pack is None:
        return
    i = pack.payload_at(info.offset)
    if i < 0:
        raise CheckpointError(f"{pack.path}: tensor {info.label} at offset {info.offset:,} is in no payload of the "
                              "pack index")
    whole = data is not None and (info.offset, info.nbytes) == pack.payload_span(i)
    pack.verify(i, ckpt.fd(info.file), data.numpy() if whole and hasattr(data, "numpy") else data if whole else None)


__all__ = ["ChecksumError", "ENTRY_DTYPE", "ENTRY_SIZE", "EXPERT_NAME", "HEADER", "HEADER_SIZE", "MAGIC", "MAX_DIMS", "Pack",
           "Payload", "QPack", "ROLES", "VERSION", "align", "dtype_field", "is_qpack", "payload_sha256", "verify"]
