"""Memory helpers shared by the loader and backends.

``read_into`` fills a tensor from a file range with ``preadv``: no memory map, so the source
pages never count against the process's resident memory (they stay in the page cache).

Tried and rejected (measured in bench/): advising transparent huge pages for large outputs
(``madvise(MADV_HUGEPAGE)``) halves the page-fault cost of a warm process but, with the
kernel's default ``defrag=madvise``, a fresh process stalls in direct compaction (a 952 MB load
went from 0.32 s to 1.8 s); ``MAP_POPULATE`` pre-faulting was slower than faulting on write.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def read_runs(fd: int, runs: Sequence[tuple[int, int]], out: torch.Tensor) -> None:
    """The checkpoint byte reader every path uses (a load without the memory map, a
    tensor-parallel rank's slices, experts served from the files): the file ranges ``runs``
    (offset, length) of ``fd``, back to back, into contiguous CPU tensor ``out`` (any dtype; its
    bytes), with ``preadv`` through one memory view (a column slice is thousands of short runs: a
    view per run would cost more than the reads). A short read continues where it stopped; a read
    that returns nothing is an ``OSError`` (the file was truncated)."""
    arr: Any = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else b""
    view = memoryview(arr).cast("B")
    pos = 0
    for off, n in runs:
        got = 0
        while got < n:
            r = os.preadv(fd, [view[pos + got:pos + n]], off + got)
            if r <= 0:
                raise OSError(f"short read at offset {off + got}: file truncated?")
            got += r
        pos += n


def read_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """Fill contiguous CPU tensor ``out`` with the bytes at ``offset`` of file ``fd``
    (``read_runs`` of one run)."""
    read_runs(fd, [(offset, out.numel() * out.element_size())], out)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block (plan building; each generation step).

    A DeepSeek-V3 plan allocates ~100,000 small objects (tensor infos, sources, modules) that all
    stay alive; with the collector on, its repeated full-heap passes took half of the 351-shard
    plan time (0.65 s -> 0.35 s measured). A decode step allocates only acyclic objects (freed by
    reference counting), while a collection pass would walk the whole model's object graph (5% of
    a small model's decode time, measured with perf). The collector runs normally afterwards.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def available_memory() -> int:
    """Bytes of memory this machine can give a new allocation now (``MemAvailable`` of
    ``/proc/meminfo``: free plus reclaimable page cache), or the physical memory where that is
    not reported, or 2**62 where neither is (no bound)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 1 << 62
