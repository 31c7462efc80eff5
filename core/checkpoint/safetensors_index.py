"""Index safetensors files from their headers: names, dtypes, shapes, absolute byte ranges.

``safetensors.safe_open`` validates each header (JSON, offsets, file size); the byte offsets,
which its Python API does not expose, come from the same header's JSON.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from ..types import TORCH_DTYPE_NAMES, TensorInfo
from ..validation import check_inside, contained, read_json
from . import qpack

#: the one dtype table: safetensors dtype name -> torch dtype (``types.SAFETENSORS_DTYPES`` names
#: the keys, for code that must not import torch; GGUF's float / int types reuse these names)
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr in TORCH_DTYPE_NAMES.items()}
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


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, from its header only."""
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({exc})") from None
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    base = 8 + n
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
            for name, info in found.items():
                listed = weight_map.get(name)
                if listed is None:
                    raise CheckpointError(f"tensor {name} is in {shard} but not in {INDEX_NAME}")
                if listed != shard:
                    raise CheckpointError(f"tensor {name} is in {shard} but {INDEX_NAME} puts it in {listed}")
                if name in tensors:
                    raise CheckpointError(f"tensor {name} is in two shards: {tensors[name].file.name} and {shard}")
                tensors[name] = info
        absent = [n for n in weight_map if n not in tensors]
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
