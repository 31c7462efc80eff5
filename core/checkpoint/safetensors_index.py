"""Index safetensors files from their headers: names, dtypes, shapes, absolute byte ranges.

``safetensors.safe_open`` validates each header (JSON, offsets, file size) and gives each
tensor's dtype and shape in offset order, from which the byte offsets follow (:func:`read_header`).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from safetensors import SafetensorError, safe_open

from ..contract.scheme import TORCH_DTYPES
from ..errors import CheckpointError
from ..types import TensorInfo
from ..validation import check_inside, contained, read_json
from . import qpack

INDEX_NAME = "model.safetensors.index.json"


class _Stored(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...


def write_header(tensors: Iterable[_Stored], metadata: Mapping[str, Any] | None) -> bytes:
    """The bytes before the data of a safetensors file holding ``tensors`` back to back in this
    order (each with ``name``, safetensors ``dtype``, ``shape`` and ``nbytes``): the 8-byte
    little-endian header length, then the JSON header padded with spaces to a multiple of 8 (as
    the safetensors library pads it); ``__metadata__`` only when ``metadata`` is given."""
    doc: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offset = 0
    for t in tensors:
        doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


#: a header entry written as a JSON array of its fields (``["BF16", [4], [0, 8]]``), which the
#: safetensors library reads but quantplug refuses: a ``[`` then a string can appear nowhere else in
#: a header, outside strings (shapes and offsets hold integers), so a search of the raw bytes finds it
_ARRAY_ENTRY = re.compile(rb'\[\s*"')
_ITEMSIZE = {name: TORCH_DTYPES[name].itemsize for name in TORCH_DTYPES}


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, from its header only.

    ``safetensors.safe_open`` validates the header (JSON, dtypes, shapes against byte lengths,
    offsets contiguous from 0 up to the file size) and gives each tensor's dtype and shape in offset
    order (``offset_keys``); each byte offset is then the sum of the lengths before it, so the JSON
    is not parsed a second time (it was, for the offsets: 1.1-1.4 s of a Kimi-K3 plan's 497,052
    tensors). A header where the raw bytes hint at an entry written as an array, and safetensors
    versions without ``offset_keys``, take the JSON path (:func:`_read_header_json`)."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            keys = handle.offset_keys() if hasattr(handle, "offset_keys") else None
            slices = list(map(handle.get_slice, keys)) if keys is not None else []
            dtypes = [s.get_dtype() for s in slices]
            shapes = [s.get_shape() for s in slices]
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({exc})") from None
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        raw = fh.read(n)
    if keys is None or _ARRAY_ENTRY.search(raw):
        return _read_header_json(file, raw, 8 + n)
    unknown = set(dtypes).difference(TORCH_DTYPES)
    if unknown:
        name, dtype = next((k, d) for k, d in zip(keys, dtypes) if d in unknown)
        raise CheckpointError(f"tensor {name} in {file.name}: dtype {dtype} is not supported; "
                              f"expected one of {', '.join(TORCH_DTYPES)}")
    out: dict[str, TensorInfo] = {}
    at = 8 + n
    itemsize, prod, new = _ITEMSIZE, math.prod, object.__new__
    for name, dtype, shape in zip(keys, dtypes, shapes):
        nbytes = prod(shape) * itemsize[dtype]
        info = new(TensorInfo)  # TensorInfo.trusted, inlined: ~500,000 calls for a Kimi-K3 index
        info.__dict__.update(name=name, file=file, dtype=dtype, shape=tuple(shape), offset=at, nbytes=nbytes,
                             format="safetensors", stored_name=None)
        out[name] = info
        at += nbytes
    return out


def _read_header_json(file: Path, raw: bytes, base: int) -> dict[str, TensorInfo]:
    """:func:`read_header` from the header's JSON (already validated by ``safe_open``)."""
    header = json.loads(raw)
    out: dict[str, TensorInfo] = {}
    # safe_open has validated the header: integer shapes, offsets contiguous and inside the file,
    # and end - start == numel * itemsize for every tensor; only our dtype support is checked here.
    trusted = TensorInfo.trusted
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            # the safetensors library also takes an entry written as a JSON array of its fields
            raise CheckpointError(f"tensor {name} in {file.name}: header entry {str(entry)[:60]}: expected an object "
                                  "with dtype, shape and data_offsets")
        dtype = entry["dtype"]
        if dtype not in TORCH_DTYPES:
            raise CheckpointError(f"tensor {name} in {file.name}: dtype {dtype} is not supported; "
                                  f"expected one of {', '.join(TORCH_DTYPES)}")
        start, end = entry["data_offsets"]
        out[name] = trusted(name, file, dtype, tuple(entry["shape"]), base + start, end - start)
    return out


def read_index(root: Path) -> dict[str, str]:
    """``weight_map`` of the shard index: tensor name -> shard file name, each shard name checked
    to lie inside ``root`` (no ``..``, no absolute path, no symlink leaving the directory)."""
    index_path = root / INDEX_NAME
    contained(root, INDEX_NAME, str(index_path))
    doc = read_json(index_path, error=CheckpointError)
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise CheckpointError(f"{index_path}: weight_map: expected an object of tensor name -> shard file name")
    weight_map: dict[str, str] = doc["weight_map"]
    try:
        distinct = set(weight_map.values())
    except TypeError:  # an unhashable value: the loop below names it
        distinct = None
    if distinct is not None and all(type(v) is str for v in distinct):
        try:
            for shard in distinct:  # each file once, not once per tensor (a Kimi-K3 index: 497,052)
                contained(root, shard, INDEX_NAME)
        except CheckpointError:
            pass  # the loop below says which tensor names the bad file first
        else:
            return weight_map
    checked: set[str] = set()
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index_path}: weight_map[{name!r}] = {shard!r}: expected a shard file name")
        if shard in checked:
            continue
        contained(root, shard, f"{index_path}: weight_map[{name!r}]")
        checked.add(shard)
    return weight_map


def _pack_tensors(root: Path, shard: str, listed: set[str]) -> tuple[dict[str, TensorInfo], qpack.QPack]:
    """The tensors of the expert pack the index names as shard ``shard`` (``quantplug expert-pack
    build``): exactly the names the index maps to it."""
    pack = qpack.QPack(root / shard)
    tensors = pack.tensors()
    extra = sorted(set(tensors) - listed)
    if extra:
        raise CheckpointError(f"tensor {extra[0]} is in {shard} but {INDEX_NAME} does not map it there "
                              f"({len(extra)} such tensor(s)): the pack does not belong to this index")
    return tensors, pack


def index_safetensors(root: Path) -> tuple[dict[str, TensorInfo], list[Path], dict[Path, qpack.QPack]]:
    """All tensors of the safetensors files in ``root``, checked against the shard index if any,
    and the expert packs (``QPXPACK`` v2) the index names as shards, by file."""
    files = sorted(root.glob("*.safetensors"))
    check_inside(root, files, str(root))
    index_path = root / INDEX_NAME
    tensors: dict[str, TensorInfo] = {}
    packs: dict[Path, qpack.QPack] = {}
    if os.path.lexists(index_path):  # a symlink (even broken) or any file there, a FIFO too: read_index refuses what is not a file
        weight_map = read_index(root)
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise CheckpointError(f"{index_path.name} lists shard(s) missing from disk: {', '.join(missing)}")
        unlisted = [f.name for f in files if f.name not in set(shards)]
        if unlisted:
            raise CheckpointError(f"{root}: file(s) not in {INDEX_NAME}: {', '.join(unlisted)}")
        for shard in shards:
            if qpack.is_qpack(root / shard):
                found, packs[root / shard] = _pack_tensors(root, shard, {n for n, s in weight_map.items() if s == shard})
            else:
                found = read_header(root / shard)
            # the index must put every tensor of the shard here (checked at C speed, name by name
            # only to say which); then no tensor can be in two shards, the index naming one each
            listed_all = list(map(weight_map.get, found))
            if listed_all.count(shard) != len(listed_all):
                for name in found:
                    listed = weight_map.get(name)
                    if listed is None:
                        raise CheckpointError(f"tensor {name} is in {shard} but not in {INDEX_NAME}")
                    if listed != shard:
                        raise CheckpointError(f"tensor {name} is in {shard} but {INDEX_NAME} puts it in {listed}")
                    if name in tensors:
                        raise CheckpointError(f"tensor {name} is in two shards: {tensors[name].file.name} and {shard}")
            tensors.update(found)
        # every tensor found is in the weight map, each once: equal counts mean the same names
        absent = [n for n in weight_map if n not in tensors] if len(tensors) != len(weight_map) else []
        if absent:
            raise CheckpointError(f"{INDEX_NAME} lists tensor {absent[0]} in {weight_map[absent[0]]}, "
                                  f"but that shard does not hold it ({len(absent)} such tensor(s))")
        return tensors, [root / s for s in shards], packs
    for file in files:
        for name, info in read_header(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} is in two files: {tensors[name].file.name} and {file.name}")
            tensors[name] = info
    return tensors, files, packs
