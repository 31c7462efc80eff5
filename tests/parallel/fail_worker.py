"""One rank of a job whose rank 1 fails (launched by test_failures.py, gloo on CPU).

argv: checkpoint out_dir scenario [tp_timeout_s]. Scenarios:

* ``load-panic``: rank 1's planning raises a ``BaseException`` (what a Rust library's panic is);
  then, in the same job, ``forward-raise``;
* ``forward-raise``: rank 1's forward raises inside layer 1 (its process stays alive);
* ``generate-raise``: rank 1 raises at its third decode step;
* ``forward-hang``: rank 1 never reaches layer 1's collectives (sleeps; the parent kills it).

Every rank writes ``rank{R}.json``: per step, the exception (type, message) and the seconds the
call took. Ranks end with ``os._exit``: a group left out of step keeps a collective pending, and
destroying it would wait for the peer's process.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


class Panic(BaseException):
    """Stands in for pyo3's PanicException (a BaseException, not an Exception)."""


def _record(out: dict, step: str, fn) -> None:
    t0 = time.monotonic()
    try:
        fn()
        out[step] = {"ok": True, "seconds": time.monotonic() - t0}
    except BaseException as exc:  # noqa: BLE001 (recorded for the parent)
        out[step] = {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}


def main() -> None:
    path, out_dir, scenario = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    import quantplug
    import quantplug.loader as loader

    out: dict = {}
    opts = {"tp_timeout_s": timeout}
    if scenario == "load-panic":
        real = loader.build_plan
        if rank == 1:
            def panicking(*a, **k):
                raise Panic("tokenizer panicked")
            loader.build_plan = panicking
        _record(out, "load-panic", lambda: quantplug.load(path, options=opts, progress=False))
        loader.build_plan = real
        scenario = "forward-raise"
    model = quantplug.load(path, options=opts, progress=False)
    ids = torch.tensor([[1, 2, 3, 4]])
    layer = model.model.layers[1]
    if rank == 1:
        calls = [0]

        def fault(_mod, _inp):
            calls[0] += 1
            if scenario == "forward-hang":
                time.sleep(600)
            if scenario == "forward-raise" or calls[0] == 3:
                raise RuntimeError("injected failure on rank 1")
        layer.register_forward_pre_hook(fault)
    with torch.no_grad():
        if scenario == "generate-raise":
            _record(out, scenario, lambda: model.generate(ids, 6))
        else:
            _record(out, scenario, lambda: model(ids))
        _record(out, "after", lambda: model(ids))  # the group is out of step: at once, on every rank
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    if rank == 1:  # a library user's process stays alive after its error: until rank 0 has decided (<= 30 s)
        until = time.monotonic() + 30
        while not (out_dir / "rank0.json").exists() and time.monotonic() < until:
            time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
