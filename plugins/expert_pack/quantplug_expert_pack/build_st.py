"""``expert-pack build`` for safetensors checkpoints: every format whose routed experts are stored
per expert under hub names (``...layers.L.mlp.experts.E.{gate,up,down}_proj.<suffix>``, under any
wrapper prefix): the DeepSeek FP8 releases, compressed-tensors, Quark, ModelSlim, ModelOpt,
GPTQ / AWQ, plain floats.

Writes ``experts.qpack`` (``QPXPACK`` version 2, layout in :mod:`.pack`) holding each expert's
stored tensors verbatim, then each shard that held experts again without them (the other
tensors' bytes copied verbatim, the header rewritten, ``__metadata__`` kept; a shard left with no
tensor is dropped), and ``model.safetensors.index.json`` with the experts mapped to the pack
(created when the checkpoint had no index). The backend detected from config.json is unchanged:
the core's checkpoint reader finds the experts in the pack through the index. Fused 3-D experts
(transformers 5 ``experts.gate_up_proj``) are refused: a pack stores per-expert tensors.

Everything is written under temporary names in ``out_dir`` and renamed when all is written
(pack, shards, index last); :func:`.build.build_pack` runs this inside its hidden partial
directory for ``-o``, so SRC is never touched. Free disk space is checked before the first byte
is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from quantplug.api import (
    Checkpoint,
    CheckpointError,
    Fields,
    TensorInfo,
    qpack,
    read_json,
    safetensors_header,
)

from ._staging import BuildResult, _copy, staged

INDEX_NAME = "model.safetensors.index.json"
#: a routed-expert tensor stored for all experts at once (transformers 5 fused / stacked layouts)
FUSED = re.compile(r"^(?:.+\.)?layers\.\d+\.mlp\.experts\.(?!\d+\.)")


@dataclass(frozen=True)
class _Item:
    """One expert tensor to move: its index key and its source."""

    layer: int
    expert: int
    role: int
    info: TensorInfo

    @property
    def key(self) -> tuple[int, int, int, str]:
        return self.layer, self.expert, self.role, self.info.name


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system holding ``path`` (tests replace this to simulate a full disk)."""
    return shutil.disk_usage(path).free


def _raw_header(file: Path) -> tuple[bytes, Any]:
    """The shard's header bytes (length prefix included) and its ``__metadata__``. The core's
    reader has validated the header already (``Checkpoint.open``)."""
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        raw = fh.read(n)
    return struct.pack("<Q", n) + raw, json.loads(raw).get("__metadata__")


def _collect(ckpt: Any, root: Path) -> list[_Item]:
    fused = sorted(n for n in ckpt.tensors if FUSED.match(n))
    if fused:
        t = ckpt.tensors[fused[0]]
        raise CheckpointError(f"{t.where()}: routed experts stored fused for all experts at once ({t.dtype} "
                              f"{list(t.shape)}; {len(fused)} such tensor(s)); an expert pack stores each expert's "
                              "own tensors verbatim, so it is built from the hub layout (...mlp.experts.E."
                              "{gate,up,down}_proj.*) only. Serve these experts from the checkpoint's own files "
                              "instead (load option expert_cache_mb: slices of the fused tensors)")
    items = []
    for name, info in ckpt.tensors.items():
        m = qpack.EXPERT_NAME.match(name)
        if m is None:
            continue
        if info.format != "safetensors":
            raise CheckpointError(f"{info.where()}: a routed expert's tensor outside the safetensors shards")
        layer, expert = int(m.group(1)), int(m.group(2))
        if layer >= 1 << 32 or expert >= 1 << 32:
            raise CheckpointError(f"{info.where()}: layer / expert number past what the pack index holds (u32)")
        if len(info.shape) > qpack.MAX_DIMS:
            raise CheckpointError(f"{info.where()}: rank {len(info.shape)}; the pack index holds up to "
                                  f"{qpack.MAX_DIMS} dims")
        items.append(_Item(layer, expert, qpack.ROLES.index(m.group(3)), info))
    if not items:
        raise CheckpointError(f"{root}: no per-expert routed-expert tensors (...layers.L.mlp.experts.E."
                              "{gate,up,down}_proj.*) in its safetensors files: nothing to pack")
    items.sort(key=lambda it: it.key)
    return items


def _mirror_bytes(root: Path, skip: set[str]) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        top = Path(dirpath) == root
        for name in filenames:
            if top and (name in skip or name.endswith(".tmp")):
                continue
            with contextlib.suppress(OSError):
                total += os.stat(Path(dirpath) / name).st_size
    return total


def build_safetensors(root: Path, out_dir: Path, alignment: int, progress: bool | None,
                      out_of_place: bool, copy: Callable[..., None] = _copy) -> Any:
    """Write the pack, the shards without their experts and the index into ``out_dir``; returns a
    :class:`.build.BuildResult` (its ``shards``: the rewritten shards and the index; ``dropped``:
    shards that held only experts). ``copy``: the chunked copy (``build._copy``, passed by
    :func:`.build.build_pack`)."""
    from .pack import PACK_NAME

    if alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"alignment {alignment} is not a power of two")
    pack_path = out_dir / PACK_NAME
    if (root / PACK_NAME).exists() or pack_path.exists():
        raise CheckpointError(f"{pack_path}: the checkpoint already has an expert pack")
    ckpt = Checkpoint.open(root)
    try:
        if ckpt.packs:
            raise CheckpointError(f"{next(iter(ckpt.packs))}: the checkpoint already has an expert pack")
        items = _collect(ckpt, root)
        moving = {it.info.name for it in items}
        by_file: dict[Path, list[TensorInfo]] = {}
        for info in ckpt.tensors.values():
            by_file.setdefault(info.file, []).append(info)
        return _write(root, out_dir, ckpt, items, moving, by_file, alignment, progress, out_of_place, BuildResult,
                      copy, pack_path)
    finally:
        ckpt.close()


def _write(root: Path, out_dir: Path, ckpt: Any, items: list[_Item], moving: set[str],
           by_file: dict[Path, list[TensorInfo]], alignment: int, progress: bool | None, out_of_place: bool,
           result: Any, copy: Any, pack_path: Path) -> Any:
    # -- the layout, computed before anything is written -----------------------------------------
    names = [it.info.name.encode() for it in items]
    names_blob = b"".join(names)
    n = len(items)
    data_offset = qpack.align(qpack.HEADER_SIZE + n * qpack.ENTRY_SIZE + len(names_blob), alignment)
    offsets, pos = [], data_offset
    for it in items:
        pos = qpack.align(pos, alignment)
        offsets.append(pos)
        pos += it.info.nbytes
    pack_size = pos
    rewrite: dict[Path, tuple[list[TensorInfo], bytes]] = {}
    dropped: list[str] = []
    source_sha = hashlib.sha256()
    for file in sorted(by_file):
        raw, metadata = _raw_header(file)
        source_sha.update(raw)
        infos = by_file[file]
        if not any(t.name in moving for t in infos):
            continue
        kept = sorted((t for t in infos if t.name not in moving), key=lambda t: t.offset)
        if kept:
            rewrite[file] = (kept, safetensors_header(kept, metadata if isinstance(metadata, dict) else None))
        else:
            dropped.append(file.name)
    index_path = root / INDEX_NAME
    if index_path.is_file():
        doc = read_json(index_path, error=CheckpointError)
        weight_map = doc["weight_map"]  # the core's reader checked it is an object of names -> shards
    else:
        doc = {"metadata": {"total_size": sum(t.nbytes for t in ckpt.tensors.values())}, "weight_map": {}}
        weight_map = doc["weight_map"]
        for name, info in sorted(ckpt.tensors.items()):
            weight_map[name] = info.file.name
    for name in moving:
        weight_map[name] = pack_path.name
    index_bytes = (json.dumps(doc, indent=2) + "\n").encode()
    need = pack_size + sum(len(h) + sum(t.nbytes for t in kept) for kept, h in rewrite.values()) + len(index_bytes)
    if out_of_place:  # SRC's other files are copied too (a reflink, where the file system has them, costs less)
        need += _mirror_bytes(root, {f.name for f in rewrite} | set(dropped) | {INDEX_NAME})
    free = _free_bytes(out_dir)
    if need > free:
        gib = 1 << 30
        raise CheckpointError(f"{out_dir}: the expert pack build needs {need:,} bytes ({need / gib:.2f} GiB: pack "
                              f"{pack_size:,}, {len(rewrite)} rewritten shard(s) and the index"
                              f"{', the copied files' if out_of_place else ''}) but {free:,} bytes ({free / gib:.2f} "
                              "GiB) are free on that file system; nothing was written")

    # -- writing: temporary names, renamed at the end ---------------------------------------------
    cfg = Fields(read_json(root / "config.json"), str(root / "config.json"))
    text = cfg.get_obj("text_config") or cfg
    top_k = text.get_int("num_experts_per_tok", 0, 1 << 16, 0)  # informational, in the pack header
    config_sha = hashlib.sha256((root / "config.json").read_bytes()).digest()
    index = np.zeros(n, dtype=qpack.ENTRY_DTYPE)
    tmp_pack = pack_path.with_name(pack_path.name + ".tmp")
    tmps: list[tuple[Path, Path]] = []
    total = sum(it.info.nbytes for it in items)
    with staged(lambda: [tmp_pack, *(t for t, _ in tmps)], total, progress) as bar:
        with contextlib.ExitStack() as stack:
            srcs = {f: stack.enter_context(open(f, "rb")) for f in by_file}
            with open(tmp_pack, "wb") as out:
                out.write(b"\0" * data_offset)
                name_pos = 0
                for i, it in enumerate(items):
                    out.write(b"\0" * (offsets[i] - out.tell()))
                    sha = hashlib.sha256()
                    copy(srcs[it.info.file], out, it.info.offset, it.info.nbytes, sha)
                    shape = list(it.info.shape) + [0] * (qpack.MAX_DIMS - len(it.info.shape))
                    index[i] = (it.layer, it.expert, it.role, len(it.info.shape), shape, offsets[i], it.info.nbytes,
                                name_pos, len(names[i]), 0, qpack.dtype_field(it.info.dtype), sha.digest())
                    name_pos += len(names[i])
                    if bar is not None:
                        bar.update(it.info.nbytes)
                if out.tell() != pack_size:
                    raise CheckpointError(f"{tmp_pack}: wrote {out.tell():,} bytes, planned {pack_size:,}")
                raw_index = index.tobytes() + names_blob
                head = qpack.HEADER.pack(qpack.MAGIC, qpack.VERSION, qpack.HEADER_SIZE, qpack.ENTRY_SIZE, alignment,
                                         len({it.layer for it in items}), len({(it.layer, it.expert) for it in items}),
                                         top_k, 0, n,
                                         qpack.HEADER_SIZE, qpack.HEADER_SIZE + n * qpack.ENTRY_SIZE,
                                         len(names_blob), data_offset, pack_size, config_sha, source_sha.digest(),
                                         hashlib.sha256(raw_index).digest())
                out.seek(0)
                out.write(head.ljust(qpack.HEADER_SIZE, b"\0"))
                out.write(raw_index)
                out.flush()
                os.fsync(out.fileno())
            for file, (kept, header) in rewrite.items():
                tmp = out_dir / (file.name + ".tmp")
                tmps.append((tmp, out_dir / file.name))
                with open(tmp, "wb") as dst:
                    dst.write(header)
                    run_start, run_len = kept[0].offset, 0
                    for t in kept:  # contiguous kept tensors: one copy
                        if t.offset != run_start + run_len:
                            copy(srcs[file], dst, run_start, run_len)
                            run_start, run_len = t.offset, 0
                        run_len += t.nbytes
                    copy(srcs[file], dst, run_start, run_len)
                    dst.flush()
                    os.fsync(dst.fileno())
        tmp_index = out_dir / (INDEX_NAME + ".tmp")
        tmps.append((tmp_index, out_dir / INDEX_NAME))
        with open(tmp_index, "wb") as fh:
            fh.write(index_bytes)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_pack, pack_path)
        for tmp, final in tmps:  # the index last: until then SRC's index names no pack
            os.replace(tmp, final)
        if not out_of_place:
            for name in dropped:
                os.unlink(root / name)
    experts: dict[int, set[int]] = {}
    for it in items:
        experts.setdefault(it.layer, set()).add(it.expert)
    return result(pack_path, len(experts), max(map(len, experts.values())), n, total, (),
                  shards=tuple(final for _, final in tmps), dropped=tuple(dropped), format="safetensors")
