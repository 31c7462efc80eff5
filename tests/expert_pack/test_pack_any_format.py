"""``quantplug expert-pack build`` on safetensors checkpoints of every format (pack version 2,
issue 20): each routed expert's stored tensors verbatim in ``experts.qpack``, the shards rewritten
without them, the index pointing at the pack; the core's checkpoint reader serves the pack to
whichever backend claims the checkpoint, in memory and through ``expert_cache_mb``."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import quantplug
import quantplug_expert_pack.build as b
import quantplug_expert_pack.build_st as bst
import torch
from quantplug import experts
from quantplug.api import dense_state, qpack, stats_sources
from quantplug.checkpoint import Checkpoint
from quantplug.cli import main
from quantplug.errors import CheckpointError
from quantplug.testing import formats, random_state, tiny_config, to_layout, wrap_kimi, write_checkpoint
from conftest import killed_child
from quantplug_expert_pack.build import build_pack
from safetensors import safe_open
from safetensors.torch import load_file, save_file

VENDOR = Path(__file__).parents[1] / "data" / "vendor"
IDS = torch.tensor([[3, 17, 42, 99, 5, 150, 7, 64], [11, 2, 130, 77, 31, 9, 120, 45]])
PACK = "experts.qpack"


def _quark_per_expert(root: Path) -> Path:
    """A Quark MXFP4 checkpoint with the routed experts quantized per expert under hub names (as
    AMD's DeepSeek-R1 MXFP4 release stores them: ``experts.E.gate_proj.weight`` U8 [out, in/2] +
    ``weight_scale`` U8 [out, in/32]); quantplug's Quark exporter (like amd-quark on a
    transformers 5 model) keeps experts fused in float, which a pack cannot hold."""
    from quantplug.plugins import get_plugin_manager
    from quantplug_quark.scheme import quantize_mxfp4

    cfg = tiny_config(q_lora_rank=64)  # MXFP4 groups of 32
    dense = write_checkpoint(root / "dense", cfg, random_state(cfg, seed=4))
    model = quantplug.load(dense, progress=False)
    get_plugin_manager().call("quantplug_export", ["quark"], firstresult=True, model=model,
                              model_config=model.quantplug_plan.model_config, destination=root / "q", options={},
                              plan=model.quantplug_plan)
    out = {}
    for name, t in to_layout(load_file(str(root / "q" / "model.safetensors")), "hub").items():
        if ".mlp.experts." in name:
            out[name], out[name.removesuffix("weight") + "weight_scale"] = quantize_mxfp4(t)
        else:
            out[name] = t
    save_file(out, str(root / "q" / "model.safetensors"), metadata={"format": "pt"})
    return root / "q"


def _make(name: str, root: Path) -> tuple[Path, dict, float]:
    """(checkpoint, load options, expert cache budget in steps of one layer's experts)."""
    cfg = tiny_config()
    state = random_state(cfg, seed=1)
    if name == "fp8":  # DeepSeek's release layout: weight F8_E4M3 + weight_scale_inv F32 per expert
        return formats.fp8(root, cfg, state), {}, 1.5
    if name == "kimi-fp8":  # language_model. wrapper prefix, vision tensors, FP8 experts
        kc, kt = wrap_kimi(cfg, state)
        return formats.fp8(root, kc, kt), {}, 1.5
    if name == "ct-w4a16-experts-vendor":  # 3 shards + index, weight_packed / weight_scale / weight_shape
        return VENDOR / "ct_w4a16_experts_dsv3", {}, 1.5
    if name == "quark-per-expert":
        return _quark_per_expert(root), {}, 1.5
    if name == "modelslim-w8a8-dynamic":  # int8 weight + weight_scale / weight_offset per expert
        ms = tiny_config(q_lora_rank=64)
        return formats.modelslim(root, ms, random_state(ms, seed=5)), {}, 5.0
    if name == "gptq-vendor":  # qweight / qzeros / scales per expert (auto-round)
        return VENDOR / "autoround_gptq_dsv3", {}, 1.5
    if name == "modelopt-nvfp4-vendor":  # weight / weight_scale / weight_scale_2 / input_scale per expert
        return VENDOR / "modelopt_nvfp4_dsv3", {}, 1.5
    raise AssertionError(name)


CASES = ["fp8", "kimi-fp8", "ct-w4a16-experts-vendor", "quark-per-expert", "modelslim-w8a8-dynamic", "gptq-vendor",
         pytest.param("modelopt-nvfp4-vendor", marks=pytest.mark.slow)]


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _logits(path: Path, opts: dict, **extra) -> tuple[torch.nn.Module, torch.Tensor]:
    model = quantplug.load(path, progress=False, options={**opts, **extra})
    ids = IDS % model.quantplug_plan.model_config.vocab_size
    with torch.no_grad():
        return model, model(ids)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """name -> (source, packed copy, options, budget in steps), built once per case on first use."""
    root = tmp_path_factory.mktemp("pack2")
    made: dict[str, tuple[Path, Path, dict, float]] = {}

    def get(name: str) -> tuple[Path, Path, dict, float]:
        if name not in made:
            src, opts, steps = _make(name, root / name)
            before = _tree_digest(src)
            res = build_pack(src, root / f"{name}-packed", progress=False)
            assert res.format == "safetensors" and res.pack == root / f"{name}-packed" / PACK
            assert _tree_digest(src) == before  # -o: SRC byte-identical
            made[name] = (src, root / f"{name}-packed", opts, steps)
        return made[name]

    return get


@pytest.mark.parametrize("name", CASES)
def test_packed_logits_equal_the_original_in_memory_and_served(packed, name):
    src, dst, opts, steps = packed(name)
    ref, want = _logits(src, opts)
    got_model, got = _logits(dst, opts)
    assert got_model.quantplug_plan.backend == ref.quantplug_plan.backend
    assert torch.equal(got, want), name  # the same bytes through the same backend: bit-exact
    # every routed expert came from the pack, and each payload's sha256 was checked as it was read
    plan = got_model.quantplug_plan
    pack = plan.checkpoint.packs[dst / PACK]
    moved = {t.name for t in plan.checkpoint.tensors.values() if t.file == pack.path}
    assert moved == {p.name for p in pack.payloads} and pack._verified.all()
    # served from the pack per expert, with a cache that evicts: equal to the original served the same way
    mb = steps * experts.step_bytes(ref.quantplug_plan) / (1 << 20)
    served_src, l_src = _logits(src, opts, expert_cache_mb=mb)
    served, l_dst = _logits(dst, opts, expert_cache_mb=mb)
    assert torch.equal(l_dst, l_src), name
    assert stats_sources(served)["expert_cache"].stats()["evictions"] > 0
    stores = [m.qp_store for m in served.modules() if getattr(m, "qp_store", None) is not None]
    assert stores and all(p.info.file == dst / PACK for s in stores for proj in s.pieces.values()
                          for per in proj.values() for p in per)
    assert stats_sources(served)["expert_cache"].stats()["bytes_read"] == stats_sources(served_src)["expert_cache"].stats()["bytes_read"]


def _source_tensors(src: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    ckpt = Checkpoint.open(src)
    out = {}
    for name, t in ckpt.tensors.items():
        with open(t.file, "rb") as fh:
            fh.seek(t.offset)
            out[name] = (t.dtype, t.shape, fh.read(t.nbytes))
    ckpt.close()
    return out


@pytest.mark.parametrize("name", ["ct-w4a16-experts-vendor", "kimi-fp8"])
def test_pack_layout_index_and_rewritten_shards(packed, name):
    src, dst, _, _ = packed(name)
    stored = _source_tensors(src)
    pack = qpack.QPack(dst / PACK)
    expert_names = {n for n in stored if qpack.EXPERT_NAME.match(n)}
    assert {p.name for p in pack.payloads} == expert_names
    data = (dst / PACK).read_bytes()
    assert data[:8] == b"QPXPACK\0" and int.from_bytes(data[8:12], "little") == 2 and len(data) == pack.file_size
    for i, p in enumerate(pack.payloads):
        dtype, shape, raw = stored[p.name]
        assert (p.dtype, p.shape) == (dtype, shape)
        assert data[p.offset:p.offset + p.size] == raw  # verbatim
        assert hashlib.sha256(raw).digest() == p.sha256
        assert p.offset % 4096 == 0
        if i and (pack.payloads[i - 1].layer, pack.payloads[i - 1].expert) == (p.layer, p.expert):
            prev = pack.payloads[i - 1]  # one expert's payloads adjacent: the previous end, aligned up
            assert p.offset == -(-(prev.offset + prev.size) // 4096) * 4096
    # experts in order, every expert's projections gate, up, down
    keys = [(p.layer, p.expert, qpack.ROLES.index(p.role), p.name) for p in pack.payloads]
    assert keys == sorted(keys)
    # shards: every other tensor, byte for byte; no expert left in them; the index maps experts to the pack
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(stored)
    for n in stored:
        assert (index[n] == PACK) == (n in expert_names), n
        if n in expert_names:
            continue
        with safe_open(str(dst / index[n]), "pt") as f:
            t = f.get_tensor(n)
        assert t.contiguous().view(torch.uint8).numpy().tobytes() == stored[n][2] or t.numel() == 0, n
    for shard in {v for v in index.values() if v != PACK}:
        with safe_open(str(dst / shard), "pt") as f:
            keys = list(f.keys())  # noqa: SIM118 (a safe_open handle is no mapping)
            assert keys and not any(qpack.EXPERT_NAME.match(k) for k in keys)
            if (src / shard).is_file():  # __metadata__ kept
                with safe_open(str(src / shard), "pt") as g:
                    assert f.metadata() == g.metadata()


def test_shard_holding_only_experts_is_dropped_and_in_place_build(tmp_path):
    cfg = tiny_config()
    state = random_state(cfg, seed=2)
    root = tmp_path / "two"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg))
    ex = {n: t for n, t in state.items() if qpack.EXPERT_NAME.match(n)}
    rest = {n: t for n, t in state.items() if n not in ex}
    save_file(rest, str(root / "model-00001-of-00002.safetensors"))
    save_file(ex, str(root / "model-00002-of-00002.safetensors"))
    wm = {**{n: "model-00001-of-00002.safetensors" for n in rest}, **{n: "model-00002-of-00002.safetensors" for n in ex}}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}))
    _, want = _logits(root, {})
    res = build_pack(root, progress=False)  # in place
    assert res.dropped == ("model-00002-of-00002.safetensors",) and res.entries == len(ex)
    assert sorted(p.name for p in root.iterdir()) == ["config.json", PACK, "model-00001-of-00002.safetensors",
                                                      "model.safetensors.index.json"]
    doc = json.loads((root / "model.safetensors.index.json").read_text())
    assert doc["metadata"] == {"total_size": 1}  # the rest of the index kept as it was
    _, got = _logits(root, {})
    assert torch.equal(got, want)
    # a second build: refused, one line
    assert main(["expert-pack", "build", str(root), "--in-place"]) == 1
    with pytest.raises(CheckpointError, match="already has an expert pack"):
        build_pack(root, tmp_path / "again", progress=False)


def test_cli_builds_a_safetensors_checkpoint(tmp_path, capsys):
    cfg = tiny_config()
    src = formats.fp8(tmp_path / "src", cfg, random_state(cfg, seed=3))
    assert main(["expert-pack", "build", str(src), "-o", str(tmp_path / "dst")]) == 0
    out = capsys.readouterr().out
    assert "experts.qpack: 2 MoE layers x 8 experts, 96 payloads (pack version 2)" in out
    assert "written: model.safetensors, model.safetensors.index.json" in out
    assert main(["plan", str(tmp_path / "dst")]) == 0


def _corrupt(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x10]))


def test_corrupt_payload_is_a_checkpoint_error_naming_the_expert_on_first_read(packed, tmp_path):
    _, dst, _, _ = packed("fp8")
    root = tmp_path / "corrupt"
    shutil.copytree(dst, root)
    pack = qpack.QPack(root / PACK)
    victim = next(p for p in pack.payloads if (p.layer, p.expert, p.role) == (2, 5, "down_proj")
                  and p.name.endswith(".weight"))
    _corrupt(root / PACK, victim.offset + victim.size // 2)
    quantplug.plan(root)  # header and index intact: plans
    want = (r"experts\.qpack: checksum mismatch in tensor model\.layers\.2\.mlp\.experts\.5\.down_proj\.weight "
            r"\(layer 2, expert 5, down_proj\)")
    with pytest.raises(CheckpointError, match=want):  # in memory: while loading
        quantplug.load(root, progress=False)
    model = quantplug.load(root, progress=False, options={"expert_cache_mb": 0.05})  # served: nothing read yet
    with pytest.raises(CheckpointError, match=want):  # the first read of that expert
        dense_state(model)
    # the other experts' payloads were verified and are served; the corrupt one fails every time
    with pytest.raises(CheckpointError, match=want):
        dense_state(model)
    # an intact pack: each payload hashed on its first read only (the cache re-reads evicted experts)
    fine = quantplug.load(dst, progress=False, options={"expert_cache_mb": 0.05})
    calls: list[tuple[int, bool]] = []
    real = qpack.QPack.verify

    def counting(self, i, fd, data=None):
        calls.append((i, bool(self._verified[i])))
        return real(self, i, fd, data)

    qpack.QPack.verify = counting  # type: ignore[method-assign]
    try:
        dense_state(fine)
        dense_state(fine)
    finally:
        qpack.QPack.verify = real  # type: ignore[method-assign]
    first = sorted(i for i, done in calls if not done)
    assert first == list(range(len(pack.payloads)))  # every payload hashed, each once
    assert sum(done for _, done in calls) >= len(pack.payloads)  # the second pass: reads, no hashing


def test_truncated_extended_or_foreign_pack_is_a_plan_time_error(packed, tmp_path):
    _, dst, _, _ = packed("fp8")
    root = tmp_path / "bad"
    shutil.copytree(dst, root)
    data = (root / PACK).read_bytes()
    last = qpack.QPack(root / PACK).payloads[-1]
    (root / PACK).write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=rf"{root / PACK}: truncated expert pack: tensor {last.name} \(layer 2, "
                                              r"expert 7, down_proj\) at offset [\d,]+ and 0 payload\(s\) after it lie "
                                              r"past the end of the file"):
        quantplug.plan(root)
    (root / PACK).write_bytes(data[:5000])  # inside the index
    with pytest.raises(CheckpointError, match=r"experts\.qpack: index of \d+ entries .* cannot fit"):
        quantplug.plan(root)
    (root / PACK).write_bytes(data + b"\0")
    with pytest.raises(CheckpointError, match=r"experts\.qpack: extended expert pack"):
        quantplug.plan(root)
    bad = bytearray(data)
    bad[qpack.HEADER_SIZE + 7] ^= 1
    (root / PACK).write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match=r"experts\.qpack: index checksum mismatch"):
        quantplug.plan(root)
    bad = bytearray(data)
    bad[8] = 1  # version 1: a GGUF pack
    (root / PACK).write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match=r"expert pack version 1 \(a GGUF expert pack"):
        quantplug.plan(root)
    # the index and the pack must agree on which tensors the pack holds
    (root / PACK).write_bytes(data)
    doc = json.loads((root / "model.safetensors.index.json").read_text())
    gone = next(n for n, f in doc["weight_map"].items() if f == PACK)
    doc["weight_map"][gone] = "model.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"is in (experts\.qpack but model\.safetensors\.index\.json does not map"
                                              r"|model\.safetensors but that shard does not hold)"):
        quantplug.plan(root)


def test_pack_truncated_after_plan_or_while_served_names_the_file_and_the_expert(packed, tmp_path):
    """A pack cut short after its index was validated: between plan and load, a LoadError naming
    the pack; while experts are served from it, a LoadError naming the pack and the expert whose
    read came up short (a QuantplugError either way, never a bare OSError)."""
    from quantplug.errors import LoadError, QuantplugError
    from quantplug.loader import execute
    from quantplug.plan import build_plan

    _, dst, _, _ = packed("fp8")
    root = tmp_path / "cut"
    shutil.copytree(dst, root)
    size = (root / PACK).stat().st_size
    last = [p for p in qpack.QPack(root / PACK).payloads if p.name.endswith(".weight")][-1]
    plan = build_plan(root)
    os.truncate(root / PACK, size - 10)
    with pytest.raises(LoadError, match=rf"{root / PACK}: changed since the plan was made \(size .*first tensor in it"):
        execute(plan, progress=False)
    plan.checkpoint.close()
    shutil.rmtree(root)
    shutil.copytree(dst, root)
    model = quantplug.load(root, progress=False, options={"expert_cache_mb": 0.05})
    os.truncate(root / PACK, last.offset + last.size // 2)  # the last expert's down_proj weight cut
    with pytest.raises(QuantplugError, match=rf"{last.name} in experts\.qpack \({root / PACK}\): cannot read "
                                             rf"expert {last.expert} of model\.layers\.{last.layer}\.mlp\.experts\."
                                             r"down_proj \(short read"):
        dense_state(model)


def _write_raw_pack(path: Path, entries: list[tuple[str, int, int, int, bytes]], alignment: int = 4096) -> None:
    """A v2 pack written by hand: (name, layer, expert, role, payload) each F32 [len/4]."""
    import numpy as np

    names = [n.encode() for n, *_ in entries]
    blob = b"".join(names)
    data_offset = qpack.align(qpack.HEADER_SIZE + len(entries) * qpack.ENTRY_SIZE + len(blob), alignment)
    idx = np.zeros(len(entries), dtype=qpack.ENTRY_DTYPE)
    body = bytearray(b"\0" * data_offset)
    pos = 0
    for i, (_, layer, expert, role, payload) in enumerate(entries):
        off = qpack.align(len(body), alignment)
        body += b"\0" * (off - len(body)) + payload
        idx[i] = (layer, expert, role, 1, [len(payload) // 4, 0, 0, 0], off, len(payload), pos, len(names[i]), 0,
                  qpack.dtype_field("F32"), hashlib.sha256(payload).digest())
        pos += len(names[i])
    raw = idx.tobytes() + blob
    head = qpack.HEADER.pack(qpack.MAGIC, 2, 256, 128, alignment, len({e[1] for e in entries}),
                             len({(e[1], e[2]) for e in entries}), 2, 0, len(entries), 256,
                             256 + len(entries) * 128, len(blob), data_offset, len(body), b"\0" * 32, b"\0" * 32,
                             hashlib.sha256(raw).digest())
    body[:qpack.HEADER_SIZE] = head.ljust(qpack.HEADER_SIZE, b"\0")
    body[qpack.HEADER_SIZE:qpack.HEADER_SIZE + len(raw)] = raw
    path.write_bytes(bytes(body))


@pytest.mark.parametrize("entries,error", [
    ([("model.layers.1.mlp.experts.0.gate_proj.weight", 1, 0, 0, b"\1" * 16),
      ("model.layers.1.mlp.experts.0.up_proj.weight", 1, 0, 1, b"\2" * 16)], None),
    ([("model.embed_tokens.weight", 1, 0, 0, b"\1" * 16)], "not a routed expert's tensor"),
    ([("model.layers.1.mlp.experts.0.gate_proj.weight", 1, 3, 0, b"\1" * 16)], "not a routed expert's tensor of layer 1, expert 3"),
    ([("model.layers.1.mlp.experts.0.up_proj.weight", 1, 0, 1, b"\1" * 16),
      ("model.layers.1.mlp.experts.0.gate_proj.weight", 1, 0, 0, b"\2" * 16)], "out of order"),
    ([("model.layers.1.mlp.experts.0.gate_proj.weight", 1, 0, 0, b"\1" * 16),
      ("model.layers.1.mlp.experts.0.gate_proj.weight", 1, 0, 0, b"\2" * 16)], "the name appears twice"),
])
def test_index_entries_are_validated(tmp_path, entries, error):
    _write_raw_pack(tmp_path / "p.qpack", entries)
    if error is None:
        pack = qpack.QPack(tmp_path / "p.qpack")
        assert [p.offset for p in pack.payloads] == [4096, 8192] and pack.n_experts == 1
        return
    with pytest.raises(CheckpointError, match=error):
        qpack.QPack(tmp_path / "p.qpack")


def test_payloads_not_adjacent_or_misaligned_are_refused(tmp_path):
    entries = [("model.layers.1.mlp.experts.0.gate_proj.weight", 1, 0, 0, b"\1" * 16),
               ("model.layers.1.mlp.experts.0.up_proj.weight", 1, 0, 1, b"\2" * 16)]
    _write_raw_pack(tmp_path / "p.qpack", entries)
    raw = bytearray((tmp_path / "p.qpack").read_bytes())
    import numpy as np

    n = len(entries)
    idx = np.frombuffer(bytes(raw[256:256 + n * 128]), dtype=qpack.ENTRY_DTYPE).copy()
    for field, value, error in [("offset", 16384, "must be adjacent"), ("offset", 12290, "misaligned")]:
        bad = idx.copy()
        bad[1][field] = value
        blob = bad.tobytes() + bytes(raw[256 + n * 128:256 + n * 128 + sum(len(e[0]) for e in entries)])
        out = bytearray(raw)
        out[256:256 + len(blob)] = blob
        out[152:184] = hashlib.sha256(blob).digest()
        if value == 16384:
            out += b"\0" * (16384 + 16 - len(out))
            out[80:88] = len(out).to_bytes(8, "little")
        (tmp_path / "q.qpack").write_bytes(bytes(out))
        with pytest.raises(CheckpointError, match=error):
            qpack.QPack(tmp_path / "q.qpack")


@pytest.mark.parametrize("vendor", ["quark_mxfp4_dsv3", "modelslim_w8a8_dsv3"])
def test_fused_experts_are_refused_naming_the_tensor(tmp_path, vendor):
    """amd-quark and msmodelslim ran on transformers 5 models keep the routed experts fused in float
    (``experts.gate_up_proj`` [E, 2I, H]): a pack stores per-expert tensors, so the build refuses
    them (expert_cache_mb serves them from the file as slices)."""
    src = VENDOR / vendor
    before = _tree_digest(src)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.down_proj in .*: routed experts "
                                              r"stored fused for all experts at once \(F32 \[8, \d+, \d+\]; 4 such "
                                              r"tensor\(s\)\); an expert pack stores each expert's own tensors"):
        build_pack(src, tmp_path / "dst", progress=False)
    assert _tree_digest(src) == before and sorted(os.listdir(tmp_path)) == []
    assert main(["expert-pack", "build", str(src), "-o", str(tmp_path / "dst")]) == 1
    cfg = tiny_config()
    fused = write_checkpoint(tmp_path / "fused", cfg, to_layout(random_state(cfg), "fused"))
    with pytest.raises(CheckpointError, match=r"experts\.(gate_up_proj|down_proj) in model\.safetensors: routed "
                                              "experts stored fused"):
        build_pack(fused, progress=False)  # in place: nothing changed either
    assert sorted(p.name for p in fused.iterdir()) == ["config.json", "model.safetensors"]


def test_no_routed_experts_is_refused(tmp_path):
    cfg = tiny_config(first_k_dense_replace=3)
    src = write_checkpoint(tmp_path / "dense", cfg, random_state(cfg))
    with pytest.raises(CheckpointError, match="no per-expert routed-expert tensors"):
        build_pack(src, tmp_path / "dst", progress=False)


def test_disk_space_is_checked_before_writing(tmp_path, monkeypatch):
    cfg = tiny_config()
    src = formats.fp8(tmp_path / "src", cfg, random_state(cfg, seed=3))
    before = _tree_digest(src)
    monkeypatch.setattr(bst, "_free_bytes", lambda path: 50_000)
    with pytest.raises(CheckpointError, match=r"the expert pack build needs [\d,]+ bytes \(.* GiB: pack [\d,]+, 1 "
                                              r"rewritten shard\(s\) and the index, the copied files\) but 50,000 "
                                              r"bytes \(.* GiB\) are free on that file system; nothing was written"):
        build_pack(src, tmp_path / "dst", progress=False)
    assert _tree_digest(src) == before and sorted(os.listdir(tmp_path)) == ["src"]
    with pytest.raises(CheckpointError, match=r"needs [\d,]+ bytes .* and the index\) but 50,000"):
        build_pack(src, progress=False)  # in place
    assert _tree_digest(src) == before


@pytest.mark.parametrize("in_place", [False, True])
def test_a_failure_while_writing_leaves_the_source_untouched(tmp_path, monkeypatch, in_place):
    src = tmp_path / "src"
    shutil.copytree(VENDOR / "ct_w4a16_experts_dsv3", src)
    before = _tree_digest(src)
    real, count = b._copy, {"n": 0}

    def full(s, d, offset, size, sha=None):
        count["n"] += 1
        if count["n"] == 147:  # 144 payloads written: while the shards are rewritten
            raise OSError(errno.ENOSPC, "No space left on device", str(d.name))
        return real(s, d, offset, size, sha)

    monkeypatch.setattr(b, "_copy", full)
    with pytest.raises(CheckpointError, match="No space left on device while building the expert pack"):
        build_pack(src, None if in_place else tmp_path / "dst", progress=False)
    assert count["n"] == 147
    assert _tree_digest(src) == before
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.parametrize("point", ["pack", "shard", "mirror", "rename"])
def test_build_killed_at_any_point_leaves_source_intact(tmp_path, point):
    src = tmp_path / "src"
    shutil.copytree(VENDOR / "ct_w4a16_experts_dsv3", src)
    before = _tree_digest(src)
    dst = tmp_path / "dst"

    def child() -> None:
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)

        if point in ("pack", "shard"):  # the 20th payload / the first shard's tensors
            real, count, at = b._copy, [0], 20 if point == "pack" else 145
            def _copy(*a, **k):
                count[0] += 1
                if count[0] == at:
                    die()
                return real(*a, **k)
            b._copy = _copy
        elif point == "mirror":
            b._mirror = die
        else:
            b.os.rename = die
        b.build_pack(src, dst, progress=False)

    status = killed_child(child)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert _tree_digest(src) == before
    assert not dst.exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "src"]
    assert all(name.startswith(".dst.partial-") for name in leftovers), leftovers


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")
def test_pack_reads_advise_random_access_shards_not(packed, monkeypatch):
    """The pack is read by explicit ranges: its descriptor gets POSIX_FADV_RANDOM (no readahead of
    the next experts); a shard's descriptor keeps the kernel's default."""
    _, dst, _, _ = packed("fp8")
    advised: list[tuple[int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, adv: (advised.append((fd, adv)), real(fd, off, n, adv)))
    ckpt = Checkpoint.open(dst)
    try:
        pack_fd, shard_fd = ckpt.fd(dst / PACK), ckpt.fd(dst / "model.safetensors")
        assert advised == [(pack_fd, os.POSIX_FADV_RANDOM)] and shard_fd != pack_fd
        ckpt.fd(dst / PACK)  # opened once, advised once
        assert len(advised) == 1
    finally:
        ckpt.close()


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_in_place_build_interrupted_by_an_exception_removes_its_temporary_files(tmp_path, monkeypatch, kind):
    """An exception (Ctrl-C included) while an in-place build renames its files into place: the
    temporary pack and rewritten shards are removed and SRC's files are as they were."""
    cfg = tiny_config()
    if kind == "safetensors":
        root = formats.fp8(tmp_path / "src", cfg, random_state(cfg, seed=3))
    else:
        import sys

        sys.path.insert(0, str(Path(__file__).parents[1]))
        from gguf_fixtures import write_kquant_gguf

        root = write_kquant_gguf(tmp_path / "src", tiny_config(moe_intermediate_size=256), {})
    before = _tree_digest(root)
    real = os.replace

    def interrupted(src, dst):
        if not str(src).endswith(".tmp") or str(src).endswith((".qpack.tmp", PACK + ".tmp")):
            return real(src, dst)
        raise KeyboardInterrupt  # the first rewritten shard / GGUF, after the pack was renamed

    monkeypatch.setattr(b.os, "replace", interrupted)
    monkeypatch.setattr(bst.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_pack(root, progress=False)
    left = {p.name for p in root.iterdir()}
    assert not [n for n in left if n.endswith(".tmp")], left
    assert {n: h for n, h in _tree_digest(root).items() if n != PACK} == before
