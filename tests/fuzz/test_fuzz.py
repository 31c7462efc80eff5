"""The fuzz suite: seeded mutations of every parsed input, through read / plan / load + forward.

Default run (CI): 1,026 cases (~8 s), most of them reader- and plan-level (cheap), 16 through load and
forward (on the small dense / GGUF / expert-pack v1 and v2 bases). ``pytest -m slow``: 20,000 cases. ``python -m fuzz.run`` (from tests/) runs any budget
and prints the report. Seeds are fixed: a failure reproduces with the same seed and budget.
"""

from __future__ import annotations

import pytest

from .engine import Fuzzer

CI = {"read": 650, "plan": 360, "forward": 16}  # fixed seed: the same cases each run; the slow budget searches
SLOW = {"read": 9000, "plan": 10000, "forward": 1000}


def _run(tmp_path, seed: int, counts: dict[str, int], **kw) -> None:
    fz = Fuzzer(tmp_path, seed=seed, **kw)
    rep = fz.run(counts)
    print(rep.summary())
    assert rep.cases == sum(counts.values()) >= 1000
    assert not rep.failures, "\n".join(rep.failures[:20])
    assert rep.max_case_s < 20, rep.slowest
    assert rep.rss_growth_mb < 1024


def test_fuzz_ci_budget(tmp_path):
    _run(tmp_path, seed=20261130, counts=CI, forward_kinds=("dense", "gguf", "pack", "pack2"))


@pytest.mark.slow
def test_fuzz_slow_budget(tmp_path):
    _run(tmp_path, seed=1, counts=SLOW)


def test_the_lenient_oracle_flags_a_skipped_value(tmp_path, monkeypatch):
    """A reader that skips a wrong-typed value (the pre-issue-22 ``rope_parameters`` handling:
    ``isinstance(params, dict)`` else the hub keys) leaves a key the base read unread: flagged."""
    import json

    import quantplug.contract.config as mc
    from quantplug.plan import build_plan
    from quantplug.validation import recording_reads

    from . import kit
    from .engine import _bypassed

    base = kit.dense(tmp_path / "b", shards=1)
    with recording_reads() as base_reads:
        build_plan(base)
    cfg = json.loads((base / "config.json").read_text())
    cfg["rope_parameters"] = [cfg["rope_parameters"]]  # wrapped in a list
    mutated = kit.clone(base, tmp_path / "m", changed="config.json")
    (mutated / "config.json").write_text(json.dumps(cfg))
    real = mc._rope

    def old_rope(f, mpe):  # the pre-issue-22 lookup: a non-object rope_parameters silently ignored
        if isinstance(f.data.get("rope_parameters"), dict):
            return real(f, mpe)
        return mc.RopeConfig(f.get_float("rope_theta", 1.0, mc.MAX_THETA, 10000.0, open_lo=True), "default")
    monkeypatch.setattr(mc, "_rope", old_rope)
    with recording_reads() as seen:
        build_plan(mutated)
    assert _bypassed(base_reads, seen, "config.json", ("rope_parameters", 0)) == "rope_parameters"
    monkeypatch.setattr(mc, "_rope", real)
    with pytest.raises(Exception, match="rope_parameters = .*expected an object"):
        build_plan(mutated)


def test_every_quantized_base_reads_its_config_through_fields(tmp_path):
    """The lenient oracle sees only keys read through ``Fields``: for each quantized base, the
    plan of the unmutated checkpoint must read its quantization settings that way (before:
    ModelOpt and GPTQ / AWQ / AutoRound read raw dicts, so a skipped or coerced value was
    invisible: 239 of a 20,000-case run's mutations, refused now, were accepted then)."""
    from .engine import QUANT_KEYS, QUANT_KINDS, make_bases

    bases = {b.kind: b for b in make_bases(tmp_path)}
    assert set(QUANT_KINDS) <= set(bases)
    for kind in QUANT_KINDS:
        base = bases[kind]
        reads = base.reads("plan")
        for target in base.targets:
            key = QUANT_KEYS.get(target)
            if key is None:
                continue
            read = sorted(path for file, path in reads if file == target and path.startswith(key + "."))
            assert len(read) >= 2, (kind, target, read)
