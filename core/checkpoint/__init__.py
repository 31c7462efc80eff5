"""Header-only view of a checkpoint directory: config, sidecar JSON files, every tensor's info.

``Checkpoint.open(path)`` reads no tensor data. :meth:`Checkpoint.tensor` later returns a
zero-copy view of one tensor's bytes from a private memory map of its file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, LoadError
from ..types import TensorInfo
from ..validation import contained, read_json
from .gguf_index import gguf_view, index_gguf, storage_shape
from .qpack import Pack
from .safetensors_index import TORCH_DTYPES, index_safetensors

__all__ = ["Checkpoint", "TORCH_DTYPES", "storage_shape"]


class Checkpoint:
    """A checkpoint directory (config.json + safetensors shards and/or GGUF files)."""

    def __init__(self, path: Path, config: dict[str, Any], tensors: dict[str, TensorInfo],
                 files: list[Path], gguf_metadata: dict[str, Any]) -> None:
        self.path = path
        self.config = config
        self.tensors = tensors
        self.files = files
        self.gguf_metadata = gguf_metadata
        self._files = _OpenFiles()
        self._maps = self._files.maps
        self._sidecars: dict[str, Any] = {}
        #: expert packs (``quantplug expert-pack build``) holding some of ``tensors``, by file:
        #: version 2 found by the index, others added by their backend (:meth:`add_pack`)
        self.packs: dict[Path, Pack] = {}
        #: model name -> stored name, when a backend renamed the tensors (see :meth:`renamed`)
        self.names: dict[str, str] = {}
        #: file -> (size, mtime_ns, inode) when the headers were read (see :meth:`check_unchanged`)
        self.identity: dict[Path, tuple[int, int, int]] = {}
        for f in files:
            with contextlib.suppress(OSError):
                st = os.stat(f)
                self.identity[f] = (st.st_size, st.st_mtime_ns, st.st_ino)

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        root = Path(path)
        if root.is_file():
            raise CheckpointError(f"{root}: expected a checkpoint directory holding config.json, got a file")
        if not root.is_dir():
            raise CheckpointError(f"{root}: no such checkpoint directory")
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{root}: config.json is missing")
        contained(root, "config.json", str(root))
        config = read_json(cfg_path, error=CheckpointError)
        if not isinstance(config, dict):
            raise CheckpointError(f"{cfg_path}: expected a JSON object")
        tensors, files, packs = index_safetensors(root)
        gguf_tensors, gguf_files, metadata = index_gguf(root)
        for name, info in gguf_tensors.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} is in both {tensors[name].file.name} and {info.file.name}")
            tensors[name] = info
        files += gguf_files
        if not files:
            raise CheckpointError(f"{root}: no .safetensors or .gguf weight files found")
        ckpt = cls(root, config, tensors, files, metadata)
        ckpt.packs = dict(packs)
        return ckpt

    def add_pack(self, pack: Pack) -> None:
        """Add the tensors of an expert pack that this checkpoint's format names itself (the GGUF
        backend's version-1 packs, named by a GGUF file's metadata), under their stored names.

        From then on they are this checkpoint's tensors like a version-2 pack's: the plan resolves
        them, the loader and the expert cache (``expert_cache_mb``) read them through the pack's
        descriptor advised for random reads, each payload's sha256 checked on first read
        (``quantplug.checkpoint.qpack.verify``), and a pack replaced or resized after this call
        is a :class:`LoadError` at load (:meth:`check_unchanged`). A backend calls it from
        ``quantplug_tensor_names`` (before the tensors are renamed); adding the same pack again
        does nothing; a stored name another file already holds is a :class:`CheckpointError`.

        .. versionadded:: 1.9 (hook contract)
        """
        path = Path(pack.path)
        if path in self.packs:
            return
        tensors = pack.tensors()
        for name, info in tensors.items():
            if name in self.tensors:
                raise CheckpointError(f"tensor {name} is in both {self.tensors[name].file.name} and {path.name}")
            if info.file != path:
                raise CheckpointError(f"{path}: expert pack tensor {name} names file {info.file}, not the pack")
        self.tensors.update(tensors)
        self.packs[path] = pack
        with contextlib.suppress(OSError):
            st = os.stat(path)
            self.identity[path] = (st.st_size, st.st_mtime_ns, st.st_ino)

    def renamed(self, names: dict[str, str]) -> Checkpoint:
        """A view of this checkpoint whose tensors carry model names.

        ``names`` maps model tensor names to stored names (a backend's ``quantplug_tensor_names``
        answer, e.g. ``model.layers.3.self_attn.q_a_proj.weight -> blk.3.attn_q_a.weight``). Stored
        tensors it does not name keep their stored names (and show up as unexpected unless a skip
        rule covers them). Each renamed :class:`TensorInfo` keeps its ``stored_name`` for messages.
        Two model names for one stored tensor is a :class:`CheckpointError`.
        """
        to_model: dict[str, str] = {}
        for model_name, stored in names.items():
            if stored in to_model:
                raise CheckpointError(f"{self.path}: stored tensor {stored} is mapped to two model names: "
                                      f"{to_model[stored]} and {model_name}")
            to_model[stored] = model_name
        tensors: dict[str, TensorInfo] = {}
        for stored, info in self.tensors.items():
            model_name = to_model.get(stored, stored)
            if model_name in tensors:
                raise CheckpointError(f"{self.path}: tensors {tensors[model_name].label} and {stored} both "
                                      f"resolve to model name {model_name}")
            tensors[model_name] = (info if model_name == stored
                                   else dataclasses.replace(info, name=model_name, stored_name=stored))
        view = Checkpoint(self.path, self.config, tensors, self.files, self.gguf_metadata)
        view._files, view._maps, view._sidecars, view.names = self._files, self._maps, self._sidecars, dict(names)
        view.identity, view.packs = self.identity, self.packs
        return view

    def label(self, model_name: str) -> str:
        """How messages name a tensor: the stored name (and the model name) when renamed."""
        info = self.tensors.get(model_name)
        if info is not None:
            return info.label
        stored = self.names.get(model_name)
        return f"{stored} (as {model_name})" if stored else model_name

    # -- sidecars -----------------------------------------------------------------------------

    @cached_property
    def sidecar_names(self) -> list[str]:
        skip = {"config.json", "model.safetensors.index.json"}
        return sorted(p.name for p in self.path.glob("*.json") if p.name not in skip)

    def sidecar(self, name: str) -> Any:
        """Parsed JSON of a sidecar file next to config.json (read on first use), or None."""
        if name not in self._sidecars:
            p = contained(self.path, name, f"{self.path}: sidecar")
            if not p.is_file():
                return None
            self._sidecars[name] = read_json(p, error=CheckpointError)
        return self._sidecars[name]

    # -- tensors ------------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def get(self, name: str) -> TensorInfo | None:
        return self.tensors.get(name)

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def _map(self, file: Path) -> mmap.mmap:
        mm = self._maps.get(file)
        if mm is None:
            with open(file, "rb") as fh:
                # ACCESS_COPY: private, writable pages (torch wants writable buffers); pages stay
                # shared with the page cache until written, so views cost no memory of their own.
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[file] = mm
        return mm

    def raw(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as a zero-copy uint8 view of the memory-mapped file."""
        mm = self._map(info.file)
        if info.offset + info.nbytes > len(mm):
            raise CheckpointError(f"{info.where()}: byte range {info.offset}+{info.nbytes} is past the end "
                                  f"of the file ({len(mm)} bytes); the file is truncated")
        if info.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(mm, dtype=torch.uint8, count=info.nbytes, offset=info.offset)

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        """A safetensors tensor as stored (dtype and shape), zero-copy; GGUF data as raw bytes
        shaped [rows, bytes_per_row] for quantized types."""
        raw = self.raw(info)
        if info.format == "gguf":
            return gguf_view(raw, info)
        dtype = TORCH_DTYPES[info.dtype]
        if info.offset % dtype.itemsize == 0:
            mm = self._map(info.file)
            if info.numel == 0:
                return torch.empty(info.shape, dtype=dtype)
            return torch.frombuffer(mm, dtype=dtype, count=info.numel, offset=info.offset).view(info.shape)
        return raw.clone().view(dtype).view(info.shape)  # unaligned: one copy, still correct

    def read(self, info: TensorInfo, *, random_access: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensor read into memory of its own (no memory map): ``(raw bytes, the tensor as
        stored)``, the second a view of the first with :meth:`tensor`'s dtype and shape (GGUF
        blocks as [..., row_bytes]). ``random_access``: through the descriptor advised for
        scattered reads (see :meth:`fd`)."""
        from ..memory import read_into

        raw = torch.empty(info.nbytes, dtype=torch.uint8)
        if info.nbytes:
            read_into(self.fd(info.file, random_access), info.offset, raw)
        if info.format == "gguf":
            return raw, gguf_view(raw, info)
        return raw, raw.view(TORCH_DTYPES[info.dtype]).view(info.shape)

    def fd(self, file: Path, random_access: bool = False) -> int:
        """A read-only file descriptor for ``file`` (for ``preadv``), opened once.

        ``random_access``: a second descriptor of the file advised ``POSIX_FADV_RANDOM``, for reads
        of scattered ranges (experts served on demand): readahead state is per open file, so the
        load's sequential reads through the first descriptor keep the kernel's readahead. An expert
        pack's descriptor is always advised random."""
        fds = self._files.random_fds if random_access and file not in self.packs else self._files.fds
        fd = fds.get(file)
        if fd is None:
            try:
                fd = fds[file] = os.open(file, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointError(f"{file}: cannot open ({exc.strerror})") from None
            if (random_access or file in self.packs) and hasattr(os, "posix_fadvise"):
                # served experts are read by explicit ranges (a payload, an expert's tensors); the
                # kernel's readahead, which grows on sequential reads, would read the next experts
                # too. Measured on a device with 8 MiB read-ahead, experts served cold from an expert
                # pack: 66 MB read from the device per token for 27 MB requested without this advice,
                # 31 MB with it (bench/bench_pack.py serve --size moderate --cold)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def check_unchanged(self) -> None:
        """:class:`LoadError` if a weight file was replaced, shrunk, grown or rewritten since its
        header was read (between plan and load): the plan's byte ranges would no longer hold."""
        for f, (size, mtime, ino) in self.identity.items():
            try:
                st = os.stat(f)
            except OSError as exc:
                raise LoadError(f"{f}: cannot stat it any more ({exc.strerror}); it was removed or replaced "
                                "after the plan was made: plan and load again") from None
            if (st.st_size, st.st_mtime_ns, st.st_ino) != (size, mtime, ino):
                first = next((t.label for t in self.tensors.values() if t.file == f), "(no tensor)")
                what = (f"size {size:,} -> {st.st_size:,} bytes" if st.st_size != size
                        else "replaced (new inode)" if st.st_ino != ino else "rewritten (new mtime)")
                raise LoadError(f"{f}: changed since the plan was made ({what}; first tensor in it: {first}); "
                                "plan and load again")

    def close(self) -> None:
        self._files.close()


class _OpenFiles:
    """Memory maps and file descriptors of one checkpoint, shared by its renamed views and
    closed when the last of them is gone."""

    def __init__(self) -> None:
        self.maps: dict[Path, mmap.mmap] = {}
        self.fds: dict[Path, int] = {}
        self.random_fds: dict[Path, int] = {}

    def close(self) -> None:
        self.maps.clear()  # views of a map keep it alive until they are freed
        fds, self.fds, rfds, self.random_fds = self.fds, {}, self.random_fds, {}
        for fd in [*fds.values(), *rfds.values()]:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
