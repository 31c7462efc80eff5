"""Index GGUF files with gguf-py's memory-mapped GGUFReader (no tensor data read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..types import TensorInfo


def index_gguf(root: Path) -> tuple[dict[str, TensorInfo], list[Path], dict[str, Any]]:
    files = sorted(root.glob("*.gguf"))
    if not files:
        return {}, [], {}
    from gguf import GGUFReader

    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, Any] = {}
    for file in files:
        try:
            reader = GGUFReader(file, "r")
        except Exception as exc:  # gguf-py raises ValueError/struct.error/IndexError on bad files
            raise CheckpointError(f"{file}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from None
        for key, fld in reader.fields.items():
            if key.startswith("tokenizer.") or key.startswith("GGUF."):
                continue
            try:
                metadata[key] = fld.contents()
            except Exception:  # gguf-py cannot decode some array types; keep what it can read
                metadata[key] = None
        for t in reader.tensors:
            name = t.name
            if name in tensors:
                raise CheckpointError(f"tensor {name} is in two GGUF files: {tensors[name].file.name} and {file.name}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            tensors[name] = TensorInfo(name, file, t.tensor_type.name, shape, int(t.data_offset),
                                       int(t.n_bytes), "gguf")
    return tensors, files, metadata


def gguf_view(raw: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    """Raw GGUF tensor bytes as a typed tensor (float types) or [rows, row_bytes] uint8 blocks."""
    float_types = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    if info.dtype in float_types:
        return raw.view(float_types[info.dtype]).view(info.shape)
    rows = max(1, info.numel // info.shape[-1]) if info.shape else 1
    return raw.view(rows, -1) if info.nbytes else raw
