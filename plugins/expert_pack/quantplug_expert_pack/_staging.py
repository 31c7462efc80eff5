"""What both pack builders share (:mod:`.build` for GGUF sources, :mod:`.build_st` for
safetensors): the staged-output context, the build's result and the chunked copy. Apart from
both so that neither imports the other back."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantplug.api import CheckpointError

COPY_CHUNK = 64 << 20


@contextlib.contextmanager
def staged(temporaries: Callable[[], Iterable[Path]], total: int, progress: bool | None) -> Iterator[Any]:
    """A build writing temporary files renamed into place at its end: yields its progress bar
    (None when not shown; ``progress`` None shows it on a terminal) and, on any failure,
    interruption included, removes every file ``temporaries()`` names that exists."""
    bar: Any = None
    if sys.stderr.isatty() if progress is None else progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="expert pack", file=sys.stderr)
    try:
        yield bar
    except BaseException:
        for p in temporaries():
            if p.exists():
                p.unlink()
        raise
    finally:
        if bar is not None:
            bar.close()


@dataclass(frozen=True)
class BuildResult:
    pack: Path
    layers: int
    experts: int
    entries: int
    moved_bytes: int
    gguf_files: tuple[Path, ...]
    #: ``-o``: how SRC's other files reached DST ({"reflink": n, "copy_file_range": n, "copy": n})
    mirrored: dict[str, int] = field(default_factory=dict, compare=False)
    #: safetensors builds: the rewritten shards and ``model.safetensors.index.json``
    shards: tuple[Path, ...] = ()
    #: safetensors builds: shards that held only routed experts (not written; removed in place)
    dropped: tuple[str, ...] = ()
    #: "gguf" (pack version 1) or "safetensors" (version 2)
    format: str = "gguf"

    @property
    def written(self) -> set[str]:
        """Top-level names the build wrote or dropped (not copied from SRC by ``-o``)."""
        return {p.name for p in (self.pack, *self.gguf_files, *self.shards)} | set(self.dropped)


def _copy(src: Any, dst: Any, offset: int, size: int, sha: Any = None) -> None:
    src.seek(offset)
    left = size
    while left:
        chunk = src.read(min(COPY_CHUNK, left))
        if not chunk:
            raise CheckpointError(f"{src.name}: unexpected end of file at {offset + size - left}")
        if sha is not None:
            sha.update(chunk)
        dst.write(chunk)
        left -= len(chunk)
