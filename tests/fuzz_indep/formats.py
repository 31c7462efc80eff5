"""Our own readers / writers of the container formats the mutators edit (no quantplug code).

* safetensors: 8-byte little-endian header length, JSON header, data;
* GGUF v3: magic, version, counts, metadata key/values, tensor infos, padding, data;
* expert pack v2 (``QPXPACK``): 256-byte header, 128-byte index entries, names, payloads.

Each parser records the byte spans of the fields, so a mutator can rewrite one field in place
(a count or a length that then lies) or re-emit the whole header.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

# -- safetensors -------------------------------------------------------------------------------

ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8, "F4": 1,
               "C64": 8}
PLAIN_FLOATS = ("F16", "BF16", "F32", "F64")


@dataclass
class Safetensors:
    header: dict[str, Any]
    header_len: int
    data: bytes

    @property
    def tensors(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def emit(self, header_text: str | None = None, keep_len: bool = False, pad: bool = True) -> bytes:
        text = header_text if header_text is not None else json.dumps(self.header, separators=(",", ":"))
        raw = text.encode("utf-8", "surrogatepass")
        if pad:
            raw += b" " * (-len(raw) % 8)
        n = self.header_len if keep_len else len(raw)
        return struct.pack("<Q", n) + raw + self.data


def parse_safetensors(blob: bytes) -> Safetensors | None:
    if len(blob) < 8:
        return None
    (n,) = struct.unpack_from("<Q", blob)
    if n > len(blob) - 8:
        return None
    try:
        header = json.loads(blob[8:8 + n])
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    return Safetensors(header, n, blob[8 + n:])


# -- GGUF ------------------------------------------------------------------------------------------

GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}
STRING, ARRAY = 8, 9
#: ggml type id -> (block elements, block bytes), the types our fixtures use and a few more
GGML_BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
              10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
              16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
              22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
              29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66)}


@dataclass
class KV:
    key: str
    vtype: int
    value: Any               # scalar, str, or (elem_type, [values])
    span: tuple[int, int]    # whole entry
    len_at: int              # offset of the key's string length
    type_at: int             # offset of the value type
    extra: dict[str, int] = field(default_factory=dict)  # "arr_type_at", "arr_len_at", "str_len_at"


@dataclass
class TInfo:
    name: str
    dims: list[int]
    ttype: int
    offset: int
    span: tuple[int, int]
    len_at: int
    ndim_at: int
    type_at: int
    offset_at: int


@dataclass
class GGUF:
    version: int
    kvs: list[KV]
    infos: list[TInfo]
    header_end: int     # end of the tensor infos
    data_start: int
    alignment: int
    blob: bytes

    def data(self) -> bytes:
        return self.blob[self.data_start:]


class _Reader:
    def __init__(self, blob: bytes, pos: int = 0) -> None:
        self.b, self.p = blob, pos

    def take(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.b, self.p)[0]
        self.p += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if n > len(self.b) - self.p:
            raise ValueError("string past end")
        s = self.b[self.p:self.p + n].decode("utf-8", "replace")
        self.p += n
        return s

    def value(self, t: int, extra: dict[str, int] | None = None) -> Any:
        if t in GGUF_SCALAR:
            return self.take(GGUF_SCALAR[t])
        if t == STRING:
            if extra is not None:
                extra["str_len_at"] = self.p
            return self.string()
        if t == ARRAY:
            if extra is not None:
                extra["arr_type_at"] = self.p
            et = self.take("<I")
            if extra is not None:
                extra["arr_len_at"] = self.p
            n = self.take("<Q")
            if n > len(self.b):
                raise ValueError("array too long")
            return (et, [self.value(et) for _ in range(n)])
        raise ValueError(f"type {t}")


def parse_gguf(blob: bytes) -> GGUF | None:
    try:
        r = _Reader(blob)
        if r.take("<4s") != b"GGUF":
            return None
        version = r.take("<I")
        n_t, n_kv = r.take("<Q"), r.take("<Q")
        if n_t > 100000 or n_kv > 100000:
            return None
        kvs = []
        for _ in range(n_kv):
            start = r.p
            key = r.string()
            type_at = r.p
            t = r.take("<I")
            extra: dict[str, int] = {}
            v = r.value(t, extra)
            kvs.append(KV(key, t, v, (start, r.p), start, type_at, extra))
        infos = []
        for _ in range(n_t):
            start = r.p
            name = r.string()
            ndim_at = r.p
            nd = r.take("<I")
            if nd > 8:
                return None
            dims = [r.take("<Q") for _ in range(nd)]
            type_at = r.p
            tt = r.take("<I")
            off_at = r.p
            off = r.take("<Q")
            infos.append(TInfo(name, dims, tt, off, (start, r.p), start, ndim_at, type_at, off_at))
        align = next((kv.value for kv in kvs if kv.key == "general.alignment" and kv.vtype == 4), 32) or 1
        data_start = r.p + (-r.p % align)
        return GGUF(version, kvs, infos, r.p, data_start, align, blob)
    except (struct.error, ValueError, UnicodeDecodeError):
        return None


def gguf_value_bytes(t: int, v: Any) -> bytes:
    if t in GGUF_SCALAR:
        return struct.pack(GGUF_SCALAR[t], v)
    if t == STRING:
        b = v.encode("utf-8", "surrogatepass") if isinstance(v, str) else bytes(v)
        return struct.pack("<Q", len(b)) + b
    et, items = v
    return struct.pack("<IQ", et, len(items)) + b"".join(gguf_value_bytes(et, x) for x in items)


def gguf_kv_bytes(key: str, t: int, v: Any) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", t) + gguf_value_bytes(t, v)


def gguf_info_bytes(name: str, dims: list[int], tt: int, off: int) -> bytes:
    n = name.encode("utf-8", "surrogatepass")
    return (struct.pack("<Q", len(n)) + n + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", tt, off))


def emit_gguf(g: GGUF, kv_blobs: list[bytes], info_blobs: list[bytes], *, n_tensors: int | None = None,
              n_kv: int | None = None, version: int | None = None, alignment: int | None = None,
              repad: bool = True) -> bytes:
    """Re-emit a GGUF from entry blobs; ``repad``: pad to the alignment again so the data section keeps
    its bytes (else the old data section follows the new header directly)."""
    head = (b"GGUF" + struct.pack("<I", g.version if version is None else version)
            + struct.pack("<QQ", len(info_blobs) if n_tensors is None else n_tensors,
                          len(kv_blobs) if n_kv is None else n_kv)
            + b"".join(kv_blobs) + b"".join(info_blobs))
    align = alignment or g.alignment
    if repad and align > 0:
        head += b"\0" * (-len(head) % align)
    return head + g.data()


# -- expert pack v2 ----------------------------------------------------------------------------------

QP_HEADER = struct.Struct("<8sIIIIIIIIQQQQQQ32s32s32s")
QP_FIELDS = ("magic", "version", "header_size", "entry_size", "alignment", "n_layers", "n_experts", "top_k",
             "reserved", "n_entries", "index_offset", "names_offset", "names_size", "data_offset", "file_size",
             "config_sha256", "source_sha256", "index_sha256")
#: one index entry: layer, expert, role, ndim, shape[4], offset, size, name_offset, name_len, reserved,
#: dtype (16 bytes), sha256 (32 bytes)
QP_ENTRY = struct.Struct("<IIII4QQQQII16s32s")
QP_ENTRY_FIELDS = ("layer", "expert", "role", "ndim", "shape0", "shape1", "shape2", "shape3", "offset", "size",
                   "name_offset", "name_len", "reserved", "dtype", "sha256")


@dataclass
class QPack:
    header: dict[str, Any]
    entries: list[dict[str, Any]]
    blob: bytes

    def index_bytes(self, entries: list[dict[str, Any]]) -> bytes:
        return b"".join(QP_ENTRY.pack(*(e[f] for f in QP_ENTRY_FIELDS)) for e in entries)

    def names(self) -> bytes:
        h = self.header
        return self.blob[h["names_offset"]:h["names_offset"] + h["names_size"]]

    def index_sha(self, entries: list[dict[str, Any]]) -> bytes:
        return hashlib.sha256(self.index_bytes(entries) + self.names()).digest()

    def emit(self, header: dict[str, Any], entries: list[dict[str, Any]], payload: bytes | None = None,
             payload_at: int = 0) -> bytes:
        out = bytearray(self.blob)
        out[:QP_HEADER.size] = QP_HEADER.pack(*(header[f] for f in QP_FIELDS))
        io = self.header["index_offset"]
        idx = self.index_bytes(entries)
        out[io:io + len(idx)] = idx
        if payload is not None:
            out[payload_at:payload_at + len(payload)] = payload
        return bytes(out)


def parse_qpack(blob: bytes) -> QPack | None:
    if len(blob) < 256 or blob[:8] != b"QPXPACK\0":
        return None
    header = dict(zip(QP_FIELDS, QP_HEADER.unpack_from(blob)))
    io, n = header["index_offset"], header["n_entries"]
    if io + n * QP_ENTRY.size > len(blob):
        return None
    entries = [dict(zip(QP_ENTRY_FIELDS, QP_ENTRY.unpack_from(blob, io + i * QP_ENTRY.size))) for i in range(n)]
    return QPack(header, entries, blob)
