"""The expert pack: a checkpoint's routed experts in one SSD-resident file, read on demand.

Two versions, one magic (``QPXPACK``), both our own (in the spirit of sglang's
SGLANG-EXPERTPACK-v1, not byte-compatible), both little-endian, both with a 256-byte header, a
fixed-size index checked by its sha256, payloads on an ``alignment`` boundary (4096), one
expert's payloads adjacent, a sha256 per payload checked the first time it is read, and the
exact file size in the header (truncation is a plan-time error):

* version 1 (:class:`ExpertPack`, this module): the routed experts of a GGUF checkpoint
  (``blk.N.ffn_{gate,up,down}_exps`` slabs as ggml blocks), named by the stripped GGUF's
  metadata; this backend validates it and adds each payload to the checkpoint as a per-expert
  GGUF tensor (:meth:`ExpertPack.tensors`, ``Checkpoint.add_pack``), which the core then loads or
  serves through its expert cache (``expert_cache_mb``) like any tensor;
* version 2 (``quantplug.api.qpack``, read by the core): the routed experts of a safetensors
  checkpoint in any format, each expert's stored tensors verbatim under their checkpoint names,
  named by ``model.safetensors.index.json``; every backend reads them as it reads a shard.

Format ``QPXPACK`` version 1 (our own; in the spirit of sglang's SGLANG-EXPERTPACK-v1, not
byte-compatible). Little-endian throughout.

Header, 256 bytes::

    off  size  field
      0     8  magic            b"QPXPACK\\0"
      8     4  version          u32 = 1
     12     4  header_size      u32 = 256
     16     4  entry_size       u32 = 80
     20     4  alignment        u32, power of two (4096): every payload starts on a multiple
     24     4  n_layers         u32  MoE layers in the pack
     28     4  n_experts        u32  routed experts per layer
     32     4  n_roles          u32 = 3 (gate_proj, up_proj, down_proj)
     36     4  top_k            u32  experts per token (informational)
     40     8  n_entries        u64 = n_layers * n_experts * n_roles
     48     8  index_offset     u64 = header_size
     56     8  data_offset      u64  first payload (aligned)
     64     8  file_size        u64  exact size of the file (truncation check)
     72    32  config_sha256    sha256 of config.json's bytes
    104    32  source_sha256    sha256 of the source GGUF header (metadata + tensor infos)
    136    32  index_sha256     sha256 of the index bytes
    168    88  reserved (zero)

Index: ``n_entries`` entries of 80 bytes, ordered by (layer, expert, role)::

    u32 layer | u32 expert | u32 role (0 gate, 1 up, 2 down) | u32 ggml type id
    u64 rows (out features) | u64 row_len (in features) | u64 offset (absolute) | u64 size
    32 B sha256 of the payload

Payloads: the expert's rows exactly as the GGUF stored them (ggml blocks), each starting on an
``alignment`` boundary; one expert's three payloads are adjacent (the core's expert cache reads
them as three positional reads of one contiguous span). Validation on open (header and index only): magic, version, sizes, entry count, index
order and checksum, every payload inside the file, payload size = rows x row bytes of its type,
payloads in index order without overlaps, one expert's three adjacent (up to alignment padding).
Each payload's sha256 is checked the first time it is read (:meth:`ExpertPack.verify`, called by
the core's loader and expert cache); a mismatch is a :class:`~quantplug.errors.CheckpointError`
naming the pack, the GGUF tensor, the expert and the role.

Format ``QPXPACK`` version 2 (safetensors checkpoints, any format). Header, 256 bytes::

    off  size  field
      0     8  magic            b"QPXPACK\\0"
      8     4  version          u32 = 2
     12     4  header_size      u32 = 256
     16     4  entry_size       u32 = 128
     20     4  alignment        u32, power of two (4096): every payload starts on a multiple
     24     4  n_layers         u32  MoE layers with experts in the pack
     28     4  n_experts        u32  (layer, expert) pairs in the pack
     32     4  top_k            u32  experts per token (informational, from config.json)
     36     4  reserved         u32 = 0
     40     8  n_entries        u64  payloads (= index entries)
     48     8  index_offset     u64 = header_size
     56     8  names_offset     u64 = index_offset + n_entries * entry_size
     64     8  names_size       u64  bytes of the names block
     72     8  data_offset      u64  first payload (aligned, after the names)
     80     8  file_size        u64  exact size of the file (truncation check)
     88    32  config_sha256    sha256 of config.json's bytes
    120    32  source_sha256    sha256 of the source shards' headers (length prefix + JSON, by file name)
    152    32  index_sha256     sha256 of the index bytes followed by the names block
    184    72  reserved (zero)

Index: ``n_entries`` entries of 128 bytes, ordered by (layer, expert, role, name)::

    u32 layer | u32 expert | u32 role (0 gate_proj, 1 up_proj, 2 down_proj) | u32 ndim (<= 4)
    u64 shape[4] (PyTorch order; dims past ndim zero)
    u64 offset (absolute) | u64 size
    u64 name_offset (in the names block) | u32 name_len | u32 reserved (0)
    16 B safetensors dtype name, ASCII, NUL padded ("F8_E4M3", "I32", "BF16", ...)
    32 B sha256 of the payload

Names: each entry's tensor name as the checkpoint stored it (``model.layers.3.mlp.experts.17.
down_proj.weight_scale_inv``, ``language_model.model.layers.1.mlp.experts.0.gate_proj.qweight``),
UTF-8, back to back; each must be a routed expert's tensor whose layer, expert and projection
are the entry's. Payloads: every stored tensor of every routed expert (weights, scales, zero
points, ``g_idx``, global scales, shape records: whatever the format stores per expert) byte for
byte, each on an ``alignment`` boundary, an expert's payloads adjacent (each starts at the
previous one's end rounded up to the alignment), experts in index order. Size = numel x the
dtype's item size. ``build`` rewrites the shards without those tensors and maps them to the pack
in ``model.safetensors.index.json``; the core's checkpoint reader (``quantplug.api.qpack``)
validates header and index on open (as for version 1, plus names, dtypes and sizes) and checks
each payload's sha256 on first read (the in-memory loader and the expert cache alike): a
mismatch is a :class:`~quantplug.errors.CheckpointError` naming the pack, tensor, layer and expert.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from quantplug.api import GGUF_FLOATS, CheckpointError, QuantplugError, TensorInfo, ggml, ggml_types, qpack

BLOCKS, FLOAT_TYPES = ggml.BLOCKS, ggml.FLOAT_TYPES

MAGIC = b"QPXPACK\x00"
VERSION = 1
HEADER_SIZE = 256
ENTRY_SIZE = 80
ROLES = ("gate_proj", "up_proj", "down_proj")
PACK_NAME = "experts.qpack"
#: GGUF metadata keys written by ``build`` into the stripped GGUF
KV_FILE = "quantplug.expert_pack.file"
KV_INDEX_SHA = "quantplug.expert_pack.index_sha256"

_HEADER = struct.Struct("<8sIIIIIIIIQQQQ32s32s32s")
ENTRY_DTYPE = np.dtype([("layer", "<u4"), ("expert", "<u4"), ("role", "<u4"), ("ggml_type", "<u4"),
                        ("rows", "<u8"), ("row_len", "<u8"), ("offset", "<u8"), ("size", "<u8"),
                        ("sha256", "V32")])  # V, not S: S strips trailing NUL bytes
assert ENTRY_DTYPE.itemsize == ENTRY_SIZE


def _type_tables() -> tuple[dict[int, str], dict[str, int]]:
    by_id = {type_id: name for type_id, (name, _, _) in ggml_types().items()}
    return by_id, {v: k for k, v in by_id.items()}


def _tensor(layer: int, role: str) -> str:
    """The GGUF tensor an expert payload came from (for messages)."""
    return f"tensor blk.{layer}.ffn_{role.removesuffix('_proj')}_exps.weight"


def payload_size(ggml_type: str, rows: int, row_len: int) -> int:
    if ggml_type in FLOAT_TYPES:
        return rows * row_len * GGUF_FLOATS[ggml_type].itemsize
    block, size = BLOCKS[ggml_type]
    return rows * (row_len // block) * size


@dataclass(frozen=True)
class PackEntry:
    layer: int
    expert: int
    role: str
    ggml_type: str
    shape: tuple[int, int]
    offset: int
    size: int
    sha256: bytes

    def describe(self) -> str:
        return f"layer {self.layer} expert {self.expert} {self.role} ({self.ggml_type} {list(self.shape)})"


class ExpertPack:
    """A validated version-1 pack: header and index in memory; its payloads are the checkpoint's
    tensors (:meth:`tensors`), read by the core, checked on first read (:meth:`verify`).
    Follows ``quantplug.api.qpack.Pack``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._read_header()
        self._verified = np.zeros(len(self._idx), dtype=bool)
        self._starts = self._idx["offset"].astype(np.int64)

    # -- validation (header + index only) -----------------------------------------------------

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}")

    def _read_header(self) -> None:
        head, actual = qpack.read_head(self.path, HEADER_SIZE)
        (magic, version, header_size, entry_size, alignment, n_layers, n_experts, n_roles, top_k,
         n_entries, index_offset, data_offset, file_size, config_sha, source_sha, index_sha) = _HEADER.unpack_from(head)
        if magic != MAGIC:
            raise self._fail(f"not an expert pack (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise self._fail(f"expert pack version {version} is not supported (expected {VERSION})")
        if header_size != HEADER_SIZE or entry_size != ENTRY_SIZE:
            raise self._fail(f"header/entry size {header_size}/{entry_size}, expected {HEADER_SIZE}/{ENTRY_SIZE}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise self._fail(f"alignment {alignment} is not a power of two")
        if n_roles != len(ROLES) or n_entries != n_layers * n_experts * n_roles:
            raise self._fail(f"index holds {n_entries} entries, expected layers*experts*roles = "
                             f"{n_layers}*{n_experts}*{n_roles}")
        if file_size < actual:
            raise self._fail(f"extended expert pack: header says {file_size} bytes, the file has {actual}")
        if n_entries * ENTRY_SIZE > actual - HEADER_SIZE:  # checked before anything is read or allocated
            raise self._fail(f"index of {n_entries:,} entries ({n_entries * ENTRY_SIZE:,} bytes) cannot fit in the "
                             f"{actual:,}-byte file: the header is corrupt")
        if index_offset != HEADER_SIZE or data_offset < index_offset + n_entries * ENTRY_SIZE:
            raise self._fail(f"index at {index_offset} / data at {data_offset} overlap or are misplaced")
        with open(self.path, "rb") as fh:
            fh.seek(index_offset)
            raw = fh.read(n_entries * ENTRY_SIZE)
        if len(raw) != n_entries * ENTRY_SIZE:
            raise self._fail("truncated expert pack index")
        if hashlib.sha256(raw).digest() != index_sha:
            raise self._fail("index checksum mismatch: the pack index is corrupt")
        idx = np.frombuffer(raw, dtype=ENTRY_DTYPE)
        self.alignment, self.n_experts, self.top_k = alignment, n_experts, top_k
        self.data_offset, self.file_size = data_offset, file_size
        self.config_sha256, self.source_sha256, self.index_sha256 = config_sha, source_sha, index_sha
        layers = idx["layer"].reshape(n_layers, n_experts, n_roles)[:, 0, 0] if n_entries else np.zeros(0, np.uint32)
        self.layers = [int(x) for x in layers]
        grid_l = np.repeat(layers, n_experts * n_roles)
        grid_e = np.tile(np.repeat(np.arange(n_experts, dtype=np.uint32), n_roles), n_layers)
        grid_r = np.tile(np.arange(n_roles, dtype=np.uint32), n_layers * n_experts)
        bad = np.nonzero((idx["layer"] != grid_l) | (idx["expert"] != grid_e) | (idx["role"] != grid_r))[0]
        if len(bad) or (len(layers) > 1 and not np.all(np.diff(layers.astype(np.int64)) > 0)):
            i = int(bad[0]) if len(bad) else 0
            raise self._fail(f"index entry #{i} is out of order: expected (layer, expert, role) ascending, "
                             f"one entry per (layer, expert, role)")
        by_id, _ = _type_tables()
        ends = idx["offset"].astype(np.int64) + idx["size"].astype(np.int64)
        if file_size > actual:  # name the first entry the truncation cut
            cut = np.nonzero(ends > actual)[0]
            what = f"entry {self._entry(idx, int(cut[0]), by_id).describe()} at offset {int(idx['offset'][cut[0]])} " \
                   f"and {len(cut) - 1} after it lie" if len(cut) else "its tail lies"
            raise self._fail(f"truncated expert pack: {what} past the end of the file ({actual} bytes; the header "
                             f"says {file_size})")
        for i in np.nonzero((idx["offset"] % alignment != 0) | (idx["offset"] < data_offset) | (ends > file_size))[0][:1]:
            raise self._fail(f"entry {self._entry(idx, int(i), by_id).describe()}: payload {int(idx['offset'][i])}+"
                             f"{int(idx['size'][i])} is misaligned or outside the data region (file {file_size} bytes)")
        if len(idx) > 1:
            # payloads follow the index order (layer, expert, role) without sharing bytes, and one
            # expert's three are adjacent up to alignment padding: an expert is one contiguous span of the file
            starts = idx["offset"].astype(np.int64)
            clash = np.nonzero(starts[1:] < ends[:-1])[0]
            if len(clash):
                a, b = int(clash[0]), int(clash[0]) + 1
                what = "overlap" if starts[b] >= starts[a] else "are out of order (payloads must follow the index order)"
                raise self._fail(f"entries {self._entry(idx, a, by_id).describe()} and {self._entry(idx, b, by_id).describe()}"
                                 f" {what}: the index is corrupt")
            padded = -(-ends // alignment) * alignment
            roles = np.arange(len(idx)) % len(ROLES)
            gap = np.nonzero((roles[1:] != 0) & (starts[1:] != padded[:-1]))[0]
            if len(gap):
                a = int(gap[0])
                raise self._fail(f"entry {self._entry(idx, a + 1, by_id).describe()} starts at {int(starts[a + 1])}, not "
                                 f"right after {self._entry(idx, a, by_id).describe()} (ends {int(ends[a])}): one expert's "
                                 "payloads must be adjacent")
        self._idx, self._by_id = idx, by_id
        self._layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        for i in range(len(idx)):  # per-entry type/size agreement (cheap: ints only)
            t = by_id.get(int(idx["ggml_type"][i]))
            if t is None or (t not in BLOCKS and t not in FLOAT_TYPES):
                raise self._fail(f"index entry #{i}: ggml type id {int(idx['ggml_type'][i])} is not supported")
            rows, row_len = int(idx["rows"][i]), int(idx["row_len"][i])
            if t in BLOCKS and row_len % BLOCKS[t][0]:
                raise self._fail(f"entry {self._entry(idx, i, by_id).describe()}: row length not a multiple of {t} blocks")
            if payload_size(t, rows, row_len) != int(idx["size"][i]):
                raise self._fail(f"entry {self._entry(idx, i, by_id).describe()}: size {int(idx['size'][i])}, "
                                 f"expected {payload_size(t, rows, row_len)}")

    @staticmethod
    def _entry(idx: np.ndarray, i: int, by_id: dict[int, str]) -> PackEntry:
        r = idx[i]
        return PackEntry(int(r["layer"]), int(r["expert"]), ROLES[int(r["role"]) % 3],
                         by_id.get(int(r["ggml_type"]), f"type{int(r['ggml_type'])}"),
                         (int(r["rows"]), int(r["row_len"])), int(r["offset"]), int(r["size"]), bytes(r["sha256"]))

    # -- lookup ---------------------------------------------------------------------------------

    def _pos(self, layer: int, expert: int, role: int) -> int:
        return (self._layer_pos[layer] * self.n_experts + expert) * len(ROLES) + role

    def has_layer(self, layer: int) -> bool:
        return layer in self._layer_pos

    def entry(self, layer: int, expert: int, role: str) -> PackEntry:
        if layer not in self._layer_pos or not 0 <= expert < self.n_experts:
            raise QuantplugError(f"{self.path}: no entry for layer {layer} expert {expert}")
        return self._entry(self._idx, self._pos(layer, expert, ROLES.index(role)), self._by_id)

    def layer_entries(self, layer: int, role: str) -> list[PackEntry]:
        return [self.entry(layer, e, role) for e in range(self.n_experts)]

    # -- storage: the checkpoint's view ------------------------------------------------------------

    def tensors(self) -> dict[str, TensorInfo]:
        """Every payload as a GGUF tensor of the checkpoint: the slab ``e`` of the
        ``blk.L.ffn_{gate,up,down}_exps.weight`` it came from, stored name
        ``blk.L.ffn_gate_exps.weight[e]`` (:func:`stored_name`), its ggml type, shape [rows, row
        length], byte range in the pack. The backend maps them to the model's per-expert names
        and adds them to the checkpoint (``Checkpoint.add_pack``): the core's loader and expert
        cache read them like any tensor, each payload's sha256 checked on first read
        (:meth:`verify`)."""
        idx, by_id = self._idx, self._by_id
        cols = {f: idx[f].tolist() for f in ("layer", "expert", "role", "ggml_type", "rows", "row_len", "offset",
                                             "size")}
        trusted = TensorInfo.trusted  # validated on open: types, sizes, bounds, order
        out: dict[str, TensorInfo] = {}
        for i in range(len(idx)):
            name = stored_name(cols["layer"][i], ROLES[cols["role"][i]], cols["expert"][i])
            out[name] = trusted(name, self.path, by_id[cols["ggml_type"][i]], (cols["rows"][i], cols["row_len"][i]),
                                cols["offset"][i], cols["size"][i], "gguf")
        return out

    def payload_at(self, offset: int) -> int:
        """Index of the payload holding byte ``offset`` of the pack, or -1."""
        i = int(np.searchsorted(self._starts, offset, side="right")) - 1
        if i < 0 or offset >= int(self._starts[i]) + max(int(self._idx["size"][i]), 1):
            return -1
        return i

    def payload_span(self, i: int) -> tuple[int, int]:
        return int(self._idx["offset"][i]), int(self._idx["size"][i])

    def verify(self, i: int, fd: int, data: Any = None) -> None:
        """Check payload ``i``'s sha256 unless already checked: over ``data`` (the whole payload as
        just read) when given, else over the pack's bytes through ``fd``. A mismatch is a
        ``ChecksumError`` (a :class:`~quantplug.errors.CheckpointError`) naming the pack, the GGUF
        tensor, the expert and the role; nothing is marked checked, so a read after the file is
        repaired checks it again."""
        if self._verified[i]:
            return
        e = self._entry(self._idx, i, self._by_id)
        where = f"{self.path}: {_tensor(e.layer, e.role)} expert {e.expert}"
        if qpack.payload_sha256(fd, e.offset, e.size, data, where=where) != e.sha256:
            raise qpack.ChecksumError(f"{where}: checksum mismatch in {e.describe()} at offset {e.offset} ({e.size} "
                                      "bytes): the expert pack is corrupt (rebuild it with `quantplug expert-pack "
                                      "build`)")
        with self._lock:
            self._verified[i] = True

    def expert_span(self, layer: int, expert: int) -> tuple[int, int]:
        """(file offset, length) of one expert's three adjacent payloads (alignment padding included)."""
        first, last = self.entry(layer, expert, ROLES[0]), self.entry(layer, expert, ROLES[-1])
        return first.offset, last.offset + last.size - first.offset


def stored_name(layer: int, role: str, expert: int) -> str:
    """The checkpoint's name of a version-1 payload: slab ``expert`` of the GGUF tensor it came from."""
    return f"blk.{layer}.ffn_{role.removesuffix('_proj')}_exps.weight[{expert}]"
