"""One rank of a tensor-parallel test run (launched by test_parallel.py, gloo on CPU).

argv: cases.json out_dir. Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. For each
case: load under the default process group (``plugin``: with that plugin of tests/archs.py registered), run the forward, compare with the single-process
logits the parent saved, record decisions, planned and actually read bytes; write
``rank{R}.json``. A case may expect this rank to fail (``fail_on``: the ranks given a broken
path) and every other rank to raise rather than hang.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return -1


def run_case(case: dict, rank: int) -> dict:
    import quantplug
    from safetensors.torch import load_file

    path = case["path"]
    if rank in case.get("fail_on", []):
        path = path + "-missing-on-this-rank"
    rec: dict = {"name": case["name"]}
    from quantplug.kernels import native

    native.library()  # its one-time build check (reads the kernel source) is not the load's
    kw = {}
    if case.get("group") == "new":  # an explicit group= (a new group object over every rank)
        kw["group"] = dist.new_group(list(range(dist.get_world_size())))
    if case.get("plugin"):  # an architecture added by a plugin (tests/archs.py)
        from quantplug.plugins import PluginManager

        sys.path.insert(0, str(Path(__file__).parents[1]))
        import archs

        pm = PluginManager()
        pm.register(archs.PLUGINS[case["plugin"]](), case["plugin"].lower())
        kw["plugin_manager"] = pm
    # the modules a load imports (Python reads their sources, more in a fresh clone that has no
    # bytecode yet) are not the load's reads: a plan of the same checkpoint imports them first
    with contextlib.suppress(Exception):  # the load below records an error
        quantplug.plan(path, options=case.get("options", {}), plugin_manager=kw.get("plugin_manager"),
                       world_size=dist.get_world_size(), rank=dist.get_rank())
    before = _rchar()
    try:
        model = quantplug.load(path, options=case.get("options", {}), progress=False, **kw)
    except Exception as exc:  # noqa: BLE001 (recorded for the parent to check)
        rec["error"] = f"{type(exc).__name__}: {exc}"
        return rec
    rec["rchar"] = _rchar() - before
    ref = load_file(case["ref"])
    ids = ref["ids"]
    with torch.no_grad():
        out = model(ids)
    rec["rel_err"] = float((out - ref["logits"]).abs().max() / ref["logits"].abs().max())
    rec["shape"] = list(out.shape)
    plan = model.quantplug_plan
    rec["report"] = model.load_report
    from quantplug.api import stats_sources

    cache = stats_sources(model).get("expert_cache")
    if cache is not None and hasattr(cache, "counts"):  # routed experts served from the files
        rec["expert_cache"] = cache.stats()
        rec["served_layers"] = {m.qp_ckpt: list(range(m.first, m.first + m.count)) for m in model.modules()
                                if getattr(m, "qp_store", None) is not None}
        rec["served_slots"] = sum(m.qp_store.slots for m in model.modules() if getattr(m, "qp_store", None) is not None)
    rec["parallel"] = plan.parallel.to_dict() if plan.parallel is not None else None
    if case.get("generate"):  # greedy decode with the cache, split over ranks (KDA states by head)
        rec["generated"] = model.generate(ids[:1, :6], case["generate"], eos_token_id=None).tolist()
    if case.get("speculative"):  # the MTP draft logits and greedy speculative decoding, split over ranks
        lm = model.text_lm()
        from quantplug.generate import new_mtp_cache

        one = ids[:1]
        with torch.inference_mode():
            hidden = lm.model(one)
            nxt = torch.cat([one[:, 1:], ref["next"]], dim=1)
            draft = lm.mtp_logits(nxt, hidden, new_mtp_cache(lm, 1, one.shape[1]))
        rec["mtp_rel_err"] = float((draft - ref["mtp_logits"]).abs().max() / ref["mtp_logits"].abs().max())
        gen = model.stream(one, case["speculative"], eos_token_id=None, speculative="mtp")
        rec["spec_tokens"] = [int(t[0]) for t in gen]
        rec["drafts"] = gen.drafts
    return rec


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    from quantplug.plugins import get_plugin_manager

    get_plugin_manager()  # entry points imported before any case (their file reads are not the load's)
    rank = dist.get_rank()
    results = []
    for case in cases:
        try:
            results.append(run_case(case, rank))
        except Exception:  # noqa: BLE001
            results.append({"name": case["name"], "crash": traceback.format_exc()})
        # keep the ranks in step between cases (a case that failed on one rank must not skew the next)
        dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
