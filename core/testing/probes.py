"""Tools the conformance kit uses on checkpoints and plugin managers; public for backend tests.

* :func:`forbid_data_reads`: while active, any Python-level read of a weight file's tensor
  data (``open`` + read past the header, ``os.pread`` / ``preadv`` / ``read``, ``mmap``,
  ``numpy.fromfile``, ``Checkpoint.raw`` / ``tensor`` / ``fd``) is recorded with the code
  that did it. The core's own header readers (``Checkpoint.open``, ``read_gguf_header``) may
  map and read headers. Reads made by native code that opens files itself (e.g. the Rust side
  of ``safetensors.safe_open``) are not seen.
* :func:`rename_stored_tensor` / :func:`truncate_file`: damage a checkpoint copy in place,
  format-agnostically for safetensors and GGUF (a same-length rename keeps every offset valid).
* :func:`isolated_plugin_manager`: the core defaults plus the given backends, no entry points,
  no environment.
* :func:`write_distribution` / :func:`installed`: a throwaway installed distribution (a
  ``.dist-info`` with ``entry_points.txt``, no pip) on ``sys.path``, so entry-point discovery
  is exercised the way ``pip install`` sets it up.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import io
import json
import mmap
import os
import struct
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import Checkpoint, gguf_index
from ..checkpoint.safetensors_index import INDEX_NAME
from ..plugins import PluginManager

__all__ = ["DataReads", "forbid_data_reads", "rename_stored_tensor", "truncate_file", "isolated_plugin_manager",
           "write_distribution", "installed"]

_PKG = str(Path(__file__).resolve().parents[1])  # the quantplug package directory


# ---------------------------------------------------------------------------------------------
# no tensor data read while planning
# ---------------------------------------------------------------------------------------------

@dataclass
class DataReads:
    """Reads of tensor data seen by :func:`forbid_data_reads` (one line each: what, where, by whom)."""

    events: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events)


def _data_starts(path: str | Path) -> dict[tuple[int, int], tuple[Path, int]]:
    """(st_dev, st_ino) of each weight file -> (file, first byte of tensor data)."""
    ckpt = Checkpoint.open(path)
    starts: dict[Path, int] = {}
    for info in ckpt.tensors.values():
        starts[info.file] = min(starts.get(info.file, info.offset), info.offset)
    ckpt.close()
    out = {}
    for f in ckpt.files:
        st = os.stat(f)
        out[(st.st_dev, st.st_ino)] = (f, starts.get(f, st.st_size))
    return out


def _culprit() -> str:
    """The innermost caller outside quantplug's core, the standard library and pluggy."""
    stack = traceback.extract_stack()[:-3]
    stdlib = os.path.dirname(os.__file__)
    for frame in reversed(stack):
        f = frame.filename
        if (f.startswith(_PKG) or "/pluggy/" in f or f.startswith("<")
                or (f.startswith(stdlib) and "-packages" not in f)):
            continue
        return f"{f}:{frame.lineno} in {frame.name}"
    last = stack[-1] if stack else None
    return f"{last.filename}:{last.lineno} in {last.name}" if last else "?"


@contextlib.contextmanager
def forbid_data_reads(path: str | Path, current: Callable[[], str] = lambda: "") -> Iterator[DataReads]:
    """Record every read of tensor data of checkpoint ``path`` made inside the block.

    ``current()`` names what is running (the kit passes the hook being called) for messages.
    A read is recorded, and raises an ``AssertionError`` where it happens (a plugin that
    swallows it is still reported through the returned :class:`DataReads`).
    """
    files = _data_starts(path)
    allowed = {Checkpoint.open.__code__, gguf_index.read_gguf_header.__code__}
    reads = DataReads()
    fds: dict[int, tuple[Path, int]] = {}

    def trusted() -> bool:
        f: Any = sys._getframe(2)
        while f is not None:
            if f.f_code in allowed:
                return True
            f = f.f_back
        return False

    def violation(what: str) -> None:
        where = current()
        msg = f"{what}{f' during {where}' if where else ''}, by {_culprit()}"
        reads.events.append(msg)
        raise AssertionError(f"tensor data read while planning: {msg}")

    def lookup(target: Any) -> tuple[Path, int] | None:
        try:
            st = os.fstat(target) if isinstance(target, int) else os.stat(target)
        except (OSError, TypeError, ValueError):
            return None
        return files.get((st.st_dev, st.st_ino))

    class GuardedFile(io.BufferedReader):
        #: the weight file it reads and where its tensor data starts
        _qp_file: tuple[Path, int]

        def _check(self, n: int) -> None:
            path_, start = self._qp_file
            pos = self.tell()
            if n != 0 and (n < 0 or pos + n > start) and not trusted():
                violation(f"read of {path_.name} bytes {pos}..{'end' if n < 0 else pos + n} "
                          f"(tensor data starts at byte {start})")

        def read(self, n: int | None = -1) -> bytes:
            self._check(-1 if n is None else n)
            return super().read(n)

        def read1(self, n: int = -1) -> bytes:
            self._check(n)
            return super().read1(n)

        def readinto(self, b: Any) -> int:
            self._check(len(memoryview(b)))
            return super().readinto(b)

    real_open, real_os_open = builtins.open, os.open
    real_pread, real_preadv, real_read = os.pread, getattr(os, "preadv", None), os.read
    real_fromfile = np.fromfile
    saved_ckpt = {k: getattr(Checkpoint, k) for k in ("raw", "tensor", "fd")}

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(file, mode, *args, **kwargs)
        hit = lookup(file) if "r" in mode and not isinstance(file, int) else None
        if hit is None or "b" not in mode or not isinstance(fh, io.BufferedReader):
            if hit is not None and not trusted():
                fh.close()
                violation(f"open({hit[0].name!r}, {mode!r}) of a weight file in text mode")
            return fh
        raw = fh.detach()
        guarded = GuardedFile(raw)
        guarded._qp_file = hit
        return guarded

    def os_open(file: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_os_open(file, flags, *args, **kwargs)
        hit = lookup(fd)
        if hit is not None:
            fds[fd] = hit
        return fd

    def check_fd(fd: int, offset: int, n: int, call: str) -> None:
        hit = fds.get(fd) or lookup(fd)
        if hit is not None and offset + n > hit[1] and not trusted():
            violation(f"{call} of {hit[0].name} bytes {offset}..{offset + n} (tensor data starts at byte {hit[1]})")

    def pread(fd: int, n: int, offset: int) -> bytes:
        check_fd(fd, offset, n, "os.pread")
        return real_pread(fd, n, offset)

    def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        check_fd(fd, offset, sum(len(memoryview(b)) for b in buffers), "os.preadv")
        assert real_preadv is not None
        return real_preadv(fd, buffers, offset, *args)

    def read(fd: int, n: int) -> bytes:
        if fd in fds or lookup(fd) is not None:
            check_fd(fd, os.lseek(fd, 0, os.SEEK_CUR), n, "os.read")
        return real_read(fd, n)

    class GuardedMmap(mmap.mmap):  # (defined before patching) a subclass, so isinstance(x, mmap.mmap) keeps working
        def __new__(cls, fileno: int, *args: Any, **kwargs: Any) -> GuardedMmap:
            hit = lookup(fileno) if fileno != -1 else None
            if hit is not None and not trusted():
                violation(f"mmap of {hit[0].name}")
            return super().__new__(cls, fileno, *args, **kwargs)

    def fromfile(file: Any, *args: Any, **kwargs: Any) -> Any:
        hit = lookup(file.fileno() if hasattr(file, "fileno") else file)
        if hit is not None:
            violation(f"numpy.fromfile of {hit[0].name}")
        return real_fromfile(file, *args, **kwargs)

    def ckpt_method(name: str) -> Callable[..., Any]:
        def poisoned(self: Checkpoint, arg: Any) -> Any:
            label = getattr(arg, "name", arg)
            violation(f"Checkpoint.{name}({label})")
        return poisoned

    patches: list[tuple[Any, str, Any]] = [
        (builtins, "open", open_), (io, "open", open_), (os, "open", os_open), (os, "pread", pread),
        (os, "read", read), (mmap, "mmap", GuardedMmap), (np, "fromfile", fromfile),
    ]
    if real_preadv is not None:
        patches.append((os, "preadv", preadv))
    patches += [(Checkpoint, k, ckpt_method(k)) for k in saved_ckpt]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield reads
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


# ---------------------------------------------------------------------------------------------
# damaging a checkpoint copy
# ---------------------------------------------------------------------------------------------

def _renamed(name: str) -> str:
    return name[:-1] + ("Y" if name[-1] == "X" else "X")


def rename_stored_tensor(file: str | Path, stored_name: str) -> str:
    """Rename tensor ``stored_name`` in a safetensors or GGUF ``file``, in place, to a name of the
    same length (last character changed): the checkpoint then lacks ``stored_name`` and holds one
    unexpected tensor, every offset still valid. The shard index, if any, follows. Returns the
    new name."""
    path = Path(file)
    new = _renamed(stored_name)
    data = bytearray(path.read_bytes())
    if path.suffix == ".gguf":
        end = gguf_index.read_gguf_header(path).infos_end
        needle = struct.pack("<Q", len(stored_name.encode())) + stored_name.encode()
        replacement = needle[:8] + new.encode()
    else:
        (n,) = struct.unpack("<Q", data[:8])
        end = 8 + n
        needle, replacement = json.dumps(stored_name).encode(), json.dumps(new).encode()
    at = data.find(needle, 0, end)
    if at < 0 or data.find(needle, at + 1, end) >= 0:
        raise ValueError(f"{path.name}: tensor {stored_name} is not named exactly once in the header")
    data[at:at + len(needle)] = replacement
    path.write_bytes(bytes(data))
    index = path.parent / INDEX_NAME
    if path.suffix == ".safetensors" and index.is_file():
        doc = json.loads(index.read_text())
        if stored_name in doc.get("weight_map", {}):
            doc["weight_map"][new] = doc["weight_map"].pop(stored_name)
            index.write_text(json.dumps(doc))
    return new


def truncate_file(file: str | Path, size: int) -> int:
    """Cut ``file`` to ``size`` bytes; returns how many bytes were cut."""
    path = Path(file)
    before = path.stat().st_size
    os.truncate(path, size)
    return before - size


# ---------------------------------------------------------------------------------------------
# plugin managers and throwaway distributions
# ---------------------------------------------------------------------------------------------

def isolated_plugin_manager(backends: Mapping[str, object] | None = None, *, distribution: str = "",
                            version: str = "") -> PluginManager:
    """A manager with the core defaults and ``backends`` ({entry-point name: module or object}),
    ignoring installed entry points and every ``QUANTPLUG_*`` variable."""
    pm = PluginManager(entry_points=False, env={})
    for name, plugin in (backends or {}).items():
        pm.register(plugin, name, distribution=distribution, version=version)
    return pm


def write_distribution(site: str | Path, dist: str, version: str, entry_points: Mapping[str, str],
                       modules: Mapping[str, str] | None = None, group: str = "quantplug.backends") -> Path:
    """Write an installed distribution into directory ``site`` as pip would (``METADATA``,
    ``entry_points.txt``, ``RECORD``), plus top-level ``modules`` {name: source}. Returns the
    ``.dist-info`` path. Put ``site`` on ``sys.path`` (:func:`installed`) to make it visible."""
    root = Path(site)
    root.mkdir(parents=True, exist_ok=True)
    for name, source in (modules or {}).items():
        (root / f"{name}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
    (info / "RECORD").write_text("")
    return info


@contextlib.contextmanager
def installed(site: str | Path) -> Iterator[Path]:
    """``site`` on ``sys.path`` for the block; modules imported from it are forgotten afterwards."""
    root = str(Path(site))
    before = set(sys.modules)
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    try:
        yield Path(site)
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(root)
        for name in set(sys.modules) - before:
            mod = sys.modules.get(name)
            if (getattr(mod, "__file__", None) or "").startswith(root):
                del sys.modules[name]
        importlib.invalidate_caches()
