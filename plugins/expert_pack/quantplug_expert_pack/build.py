"""``quantplug expert-pack build SRC -o DST``: a copy of a checkpoint with its routed experts
moved into an expert pack (``--in-place``: rewrite SRC itself, the original behaviour).

A directory with ``.gguf`` files gets the GGUF build below (pack version 1); a safetensors
checkpoint of any format with per-expert hub tensors gets :mod:`.build_st` (pack version 2).

Reads the GGUF headers with quantplug's header reader, copies every ``blk.N.ffn_{gate,up,down}_exps``
tensor expert by expert into ``experts.qpack`` (format: :mod:`.pack`), then rewrites each GGUF
without those tensors: metadata bytes copied verbatim, plus two keys tying the GGUF to its pack
(``quantplug.expert_pack.file`` and ``quantplug.expert_pack.index_sha256``). Files are written
under temporary names and renamed only when everything is written, pack first; a failed build
leaves the original GGUF untouched.

Out of place (``output=``, the CLI's ``-o``), everything is written into a hidden sibling
``.DST.partial-PID`` directory (every other file of SRC cloned: a reflink where the file system
supports one, else an in-kernel copy; never a hard link, so no write to DST can change SRC) that
is renamed to DST as the very last step: a build killed at any point, or failing on a full disk,
leaves SRC byte-identical and nothing under DST.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import struct
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from quantplug.api import (
    CheckpointError,
    Fields,
    GGUFHeader,
    TensorInfo,
    check_inside,
    contained,
    read_gguf_header,
    read_json,
)

from ._staging import COPY_CHUNK, BuildResult, _copy, staged
from .pack import (
    _HEADER,
    ENTRY_DTYPE,
    ENTRY_SIZE,
    HEADER_SIZE,
    KV_FILE,
    KV_INDEX_SHA,
    MAGIC,
    PACK_NAME,
    ROLES,
    VERSION,
    _type_tables,
)

MAGIC_GGUF = b"GGUF"
EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
#: Linux ``FICLONE`` ioctl (``_IOW(0x94, 9, int)``): share extents copy-on-write (btrfs, XFS, bcachefs)
FICLONE = 0x40049409


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _rewrite_gguf(header: GGUFHeader, keep: list[TensorInfo], extra_kv: dict[str, str], out: Path) -> None:
    """Write ``header.file`` with only ``keep`` tensors and ``extra_kv`` string keys added."""
    _, ids = _type_tables()
    a = header.alignment
    with open(header.file, "rb") as src, open(out, "wb") as dst:
        dst.write(MAGIC_GGUF + struct.pack("<IQQ", header.version, len(keep), header.n_kv + len(extra_kv)))
        src.seek(24)
        dst.write(src.read(header.kv_end - 24))  # metadata, verbatim (vocabulary included)
        for k, v in extra_kv.items():
            dst.write(_gguf_string(k) + struct.pack("<I", 8) + _gguf_string(v))
        rel = 0
        offsets = []
        for t in keep:
            offsets.append(rel)
            ne = tuple(reversed(t.shape))
            dst.write(_gguf_string(t.name) + struct.pack(f"<I{len(ne)}Q", len(ne), *ne)
                      + struct.pack("<IQ", ids[t.dtype], rel))
            rel = _align(rel + t.nbytes, a)
        dst.write(b"\0" * (_align(dst.tell(), a) - dst.tell()))
        base = dst.tell()
        for t, off in zip(keep, offsets):
            dst.write(b"\0" * (base + off - dst.tell()))
            _copy(src, dst, t.offset, t.nbytes)
        dst.flush()
        os.fsync(dst.fileno())



def build_pack(directory: str | Path, output: str | Path | None = None, *, alignment: int = 4096,
               progress: bool | None = None) -> BuildResult:
    """Move every routed-expert tensor of the GGUF files in ``directory`` into ``experts.qpack``.

    ``output``: write a new checkpoint directory there (must not exist) and leave ``directory``
    untouched; None: rewrite ``directory`` in place. I/O failures (a full disk) are
    :class:`CheckpointError` naming the file; the partial output is removed.
    """
    root = Path(directory)
    if output is None:
        return _guarded(root, lambda: _build_any(root, root, alignment, progress, False))
    dst = Path(output)
    if dst.exists() or dst.is_symlink():
        raise CheckpointError(f"{dst}: already exists; `expert-pack build -o` writes a new directory")
    src_real, dst_real = Path(os.path.realpath(root)), Path(os.path.realpath(dst))
    if dst_real == src_real or src_real in dst_real.parents:
        raise CheckpointError(f"{dst}: the output directory must not lie inside the source {root}")
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: config.json is missing (expected a checkpoint directory)")
    partial = dst.parent / f".{dst.name}.partial-{os.getpid()}"

    def run() -> BuildResult:
        dst.parent.mkdir(parents=True, exist_ok=True)
        partial.mkdir()
        try:
            res = _build_any(root, partial, alignment, progress, True)
            mirrored = _mirror(root, partial, res.written)
            _fsync_dir(partial)
            os.rename(partial, dst)  # the one step that makes DST appear, whole
            _fsync_dir(dst.parent)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return BuildResult(dst / res.pack.name, res.layers, res.experts, res.entries, res.moved_bytes,
                           tuple(dst / p.name for p in res.gguf_files), dict(mirrored),
                           tuple(dst / p.name for p in res.shards), res.dropped, res.format)

    return _guarded(dst, run)


def _guarded(where: Path, fn: Any) -> BuildResult:
    try:
        result: BuildResult = fn()
    except OSError as exc:  # ENOSPC, EIO, permissions: one error class, naming the file
        name = exc.filename or where
        raise CheckpointError(f"{name}: {exc.strerror or exc} while building the expert pack; the source checkpoint "
                              "is unchanged and no partial output was kept") from None
    return result


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mirror(src: Path, dst: Path, skip: set[str]) -> Counter[str]:
    """Every file of ``src`` not in ``skip`` (top level) into ``dst`` as an independent copy (see
    :func:`clone_file`; never a hard link: editing DST's tokenizer.json must not edit SRC's).
    Symlinks must stay inside ``src``. Returns how many files each method copied."""
    methods: Counter[str] = Counter()
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        for d in dirnames:
            (dst / rel / d).mkdir(exist_ok=True)
        for name in filenames:
            if rel == Path(".") and (name in skip or name.endswith(".tmp")):
                continue
            s = Path(dirpath) / name
            contained(src, str(rel / name), f"{src}: file")
            methods[clone_file(Path(os.path.realpath(s)), dst / rel / name)] += 1
    return methods


def clone_file(src: Path, dst: Path) -> str:
    """Write ``dst`` (new) with ``src``'s bytes and times, sharing no inode with it; returns the
    method: ``"reflink"`` (FICLONE: extents shared copy-on-write, instant; a write to either file
    leaves the other alone), ``"copy_file_range"`` (an in-kernel copy; some file systems reflink
    or copy server-side here), or ``"copy"`` (read and write)."""
    with open(src, "rb") as fi, open(dst, "xb") as fo:
        method = "copy"
        if sys.platform.startswith("linux"):
            try:
                import fcntl

                fcntl.ioctl(fo.fileno(), FICLONE, fi.fileno())
                method = "reflink"
            except OSError:
                pass  # not supported here (ext4, tmpfs, another file system): copy
        if method == "copy" and hasattr(os, "copy_file_range"):
            size = os.fstat(fi.fileno()).st_size
            try:
                done = 0
                while done < size:
                    n = os.copy_file_range(fi.fileno(), fo.fileno(), min(size - done, 1 << 30))
                    if n == 0:
                        break
                    done += n
                if done == size:
                    method = "copy_file_range"
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                    raise
        if method == "copy":
            fi.seek(0)
            fo.seek(0)
            fo.truncate()
            shutil.copyfileobj(fi, fo, COPY_CHUNK)
    shutil.copystat(src, dst)
    return method


def _build_any(root: Path, out_dir: Path, alignment: int, progress: bool | None, out_of_place: bool) -> BuildResult:
    """GGUF files in ``root``: :func:`_build` (pack version 1); else the safetensors build (version 2)."""
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: config.json is missing (expected a checkpoint directory)")
    if any(root.glob("*.gguf")):
        return _build(root, out_dir, alignment, progress)
    from .build_st import build_safetensors

    # this module's ``_copy`` (looked up now): the one both builders copy with
    result: BuildResult = build_safetensors(root, out_dir, alignment, progress, out_of_place, copy=_copy)
    return result


def _build(root: Path, out_dir: Path, alignment: int, progress: bool | None) -> BuildResult:
    """The build proper: read from ``root``, write the pack and rewritten GGUFs into ``out_dir``
    (temporary names, renamed at the end)."""
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: config.json is missing (expected a checkpoint directory)")
    if alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"alignment {alignment} is not a power of two")
    pack_path = out_dir / PACK_NAME
    if (root / PACK_NAME).exists() or pack_path.exists():
        raise CheckpointError(f"{pack_path}: the checkpoint already has an expert pack")
    files = sorted(root.glob("*.gguf"))
    check_inside(root, files, str(root))
    if not files:
        raise CheckpointError(f"{root}: no .gguf files to take experts from")
    headers = [read_gguf_header(f) for f in files]
    exps: dict[tuple[int, str], TensorInfo] = {}
    source_sha = hashlib.sha256()
    for h in headers:
        with open(h.file, "rb") as fh:
            source_sha.update(fh.read(h.infos_end))
        for t in h.tensors:
            m = EXPS.match(t.name)
            if m:
                exps[(int(m.group(1)), f"{m.group(2)}_proj")] = t
    if not exps:
        raise CheckpointError(f"{root}: no routed-expert tensors (blk.N.ffn_*_exps.weight) in {', '.join(f.name for f in files)}")
    layers = sorted({layer for layer, _ in exps})
    n_experts = None
    for layer in layers:
        for role in ROLES:
            t = exps.get((layer, role))
            if t is None:
                raise CheckpointError(f"{root}: layer {layer} has no blk.{layer}.ffn_{role[:-5]}_exps.weight")
            if len(t.shape) != 3:
                raise CheckpointError(f"{t.where()}: expected [experts, out, in], got {list(t.shape)}")
            if n_experts is None:
                n_experts = t.shape[0]
            if t.shape[0] != n_experts:
                raise CheckpointError(f"{t.where()}: {t.shape[0]} experts, others have {n_experts}")
    assert n_experts is not None
    config_bytes = (root / "config.json").read_bytes()
    top = Fields(read_json(root / "config.json"), str(root / "config.json"))
    text = top.get_obj("text_config") or top
    top_k = text.get_int("num_experts_per_tok", 0, 1 << 16, 0)  # informational, in the pack header
    _, ids = _type_tables()

    n_entries = len(layers) * n_experts * len(ROLES)
    index = np.zeros(n_entries, dtype=ENTRY_DTYPE)
    data_offset = _align(HEADER_SIZE + n_entries * ENTRY_SIZE, alignment)
    tmp_pack = pack_path.with_suffix(".qpack.tmp")
    tmp_ggufs: list[tuple[Path, Path]] = []
    total = sum(t.nbytes for t in exps.values())
    with staged(lambda: [tmp_pack, *(t for t, _ in tmp_ggufs)], total, progress) as bar:
        with contextlib.ExitStack() as stack:
            srcs = {f: stack.enter_context(open(f, "rb")) for f in files}
            with open(tmp_pack, "wb") as out:
                out.write(b"\0" * data_offset)
                i = 0
                for layer in layers:
                    for e in range(n_experts):
                        for r, role in enumerate(ROLES):
                            t = exps[(layer, role)]
                            size = t.nbytes // n_experts
                            pos = _align(out.tell(), alignment)
                            out.write(b"\0" * (pos - out.tell()))
                            sha = hashlib.sha256()
                            _copy(srcs[t.file], out, t.offset + e * size, size, sha)
                            index[i] = (layer, e, r, ids[t.dtype], t.shape[1], t.shape[2], pos, size, sha.digest())
                            i += 1
                            if bar is not None:
                                bar.update(size)
                file_size = out.tell()
                raw_index = index.tobytes()
                index_sha = hashlib.sha256(raw_index).digest()
                head = _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, ENTRY_SIZE, alignment, len(layers), n_experts,
                                    len(ROLES), top_k, n_entries, HEADER_SIZE, data_offset, file_size,
                                    hashlib.sha256(config_bytes).digest(), source_sha.digest(), index_sha)
                out.seek(0)
                out.write(head.ljust(HEADER_SIZE, b"\0"))
                out.write(raw_index)
                out.flush()
                os.fsync(out.fileno())
        extra = {KV_FILE: PACK_NAME, KV_INDEX_SHA: index_sha.hex()}
        for h in headers:
            keep = [t for t in h.tensors if not EXPS.match(t.name)]
            if len(keep) == len(h.tensors):
                continue
            tmp = (out_dir / h.file.name).with_suffix(".gguf.tmp")
            tmp_ggufs.append((tmp, out_dir / h.file.name))
            _rewrite_gguf(h, keep, extra, tmp)
        os.replace(tmp_pack, pack_path)
        for tmp, final in tmp_ggufs:
            os.replace(tmp, final)
    return BuildResult(pack_path, len(layers), n_experts, n_entries, total, tuple(f for _, f in tmp_ggufs))
