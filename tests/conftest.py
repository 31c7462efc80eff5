"""Shared fixtures: tiny checkpoints, a transformers reference, a fresh plugin manager.

The suite runs torch (and the native kernels, which run on torch's OpenMP threads) on ONE thread,
and so do the processes it starts (``OMP_NUM_THREADS=1``): at the sizes of test models a thread
pool only waits on its peers, and on a shared 2-core machine two spinning threads make every small
op several times slower (``quantplug demo`` took 5.8 s on one thread, 37.7 s on two, with the other
core busy). Tests of multi-threaded results set their thread count themselves
(tests/kernels/test_native.py); ``QUANTPLUG_TEST_THREADS=N`` runs the whole suite on N threads.
Under pytest-xdist each worker is one of those single-threaded processes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from quantplug.kernels import native
from quantplug.plugins import PluginManager, reset_plugin_manager
from quantplug.testing.reference import hf_logits, rel_err

__all__ = ["VENDOR", "hf_logits", "killed_child", "load_logits", "rel_err", "run_threads"]  # the transformers reference is quantplug.testing's

VENDOR = Path(__file__).parent / "data" / "vendor"

#: torch threads of the suite and of the processes it starts (module docstring)
TEST_THREADS = int(os.environ.get("QUANTPLUG_TEST_THREADS", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(autouse=True)
def _fresh_default_manager():
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture(scope="session")
def two_layer(tmp_path_factory) -> Callable[[str], Path]:
    """``two_layer(kind)``: a tiny 2-layer checkpoint ("dense", "fp8" or "gguf"), written once per
    session. Shared: tests read it (or copy it) and never write into it."""
    from quantplug.testing import formats, random_state, tiny_config, write_checkpoint

    made: dict[str, Path] = {}
    writers = {"dense": write_checkpoint, "fp8": formats.fp8, "gguf": formats.gguf}

    def get(kind: str) -> Path:
        if kind not in made:
            cfg = tiny_config(num_hidden_layers=2)
            made[kind] = Path(writers[kind](tmp_path_factory.mktemp(kind) / "c", cfg, random_state(cfg)))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def march_build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """``march_build(march)``: the kernel library built with ``QUANTPLUG_NATIVE_MARCH=march`` in a
    cache of the session's own (a full compile each: the AVX2 and portable builds are shared by
    tests/kernels/test_native.py and test_kda_step.py instead of compiled by each)."""
    built: dict[str, Any] = {}

    def get(march: str) -> Any:
        if march not in built:
            saved = {k: os.environ.get(k) for k in ("QUANTPLUG_NATIVE_MARCH", "QUANTPLUG_CACHE")}
            os.environ["QUANTPLUG_NATIVE_MARCH"] = march
            os.environ["QUANTPLUG_CACHE"] = str(tmp_path_factory.mktemp(f"kernels-{march}"))
            try:
                built[march] = native._build()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return built[march]

    return get


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module of tiny models (``pytestmark =
    pytest.mark.usefixtures("one_torch_thread")``) even where ``QUANTPLUG_TEST_THREADS`` asks for
    more: a thread pool only waits on its peers at these sizes."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def pm() -> PluginManager:
    """A plugin manager with the core defaults only (no entry points)."""
    return PluginManager(entry_points=False, env={})


def load_logits(path, ids: torch.Tensor, **kw):
    """quantplug.load(path, **kw) and its logits on ids."""
    import quantplug

    model = quantplug.load(path, **kw)
    with torch.no_grad():
        return model, model(ids)


def killed_child(fn: Callable[[], None]) -> int:
    """Run ``fn`` in a forked child that is expected to SIGKILL itself; return its wait status
    (exit status 3 when ``fn`` returned or raised instead)."""
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            fn()
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return status


def run_threads(fn: Callable[[int], None], n: int = 2) -> None:
    """``fn(0)`` .. ``fn(n - 1)`` in n threads at once; the first exception any of them raised is
    raised here after all have finished."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 (raised below, in the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
