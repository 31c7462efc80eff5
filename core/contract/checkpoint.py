"""What the hooks receive as ``checkpoint``: :class:`CheckpointView`, the header-only index of
a checkpoint (:class:`quantplug.checkpoint.Checkpoint`) as a backend reads it. A protocol, so the
hook specifications name it without importing the checkpoint package."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from ..types import TensorInfo


class CheckpointView(Protocol):
    """A checkpoint directory (config.json + safetensors shards and/or GGUF files), from headers."""

    @property
    def path(self) -> Path: ...

    @property
    def config(self) -> dict[str, Any]: ...

    @property
    def tensors(self) -> dict[str, TensorInfo]: ...

    @property
    def files(self) -> list[Path]: ...

    @property
    def gguf_metadata(self) -> dict[str, Any]: ...

    @property
    def names(self) -> dict[str, str]: ...

    def sidecar_names(self) -> list[str]: ...

    def sidecar(self, name: str) -> Any: ...

    def get(self, name: str) -> TensorInfo | None: ...

    def tensor(self, info: TensorInfo) -> torch.Tensor: ...

    def __contains__(self, name: object) -> bool: ...

    def __iter__(self) -> Iterator[TensorInfo]: ...
