"""GGUF data section fully accounted for, header cost bounded by the file size (issue 22)."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import quantplug
from quantplug.checkpoint.gguf_index import ggml_types, read_gguf_header
from quantplug.errors import CheckpointError
from quantplug.models.config import parse_model_config
from quantplug.testing import random_state, tiny_config


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory) -> Path:
    """A GGUF whose attention q_a rows are 256 wide (a whole Q2_K super-block), stored Q4_0."""
    from quantplug_expert_pack.export import gguf_state, write_gguf

    cfg = tiny_config(hidden_size=256, num_hidden_layers=2)
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    root = tmp_path_factory.mktemp("wide") / "c"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg))
    write_gguf(root / "model.gguf", gguf_state(random_state(cfg), mc), mc, default_type="Q8_0",
               types={"attn_k_b": "Q4_0", "attn_q_a": "Q4_0"})
    return root


def _retype(src: Path, dst: Path, name: str, type_id: int) -> Path:
    data = bytearray(src.read_bytes())
    raw = name.encode()
    pos = data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)
    (nd,) = struct.unpack_from("<I", data, pos)
    struct.pack_into("<I", data, pos + 4 + 8 * nd, type_id)
    dst.mkdir()
    (dst / "config.json").write_bytes((src.parent / "config.json").read_bytes())
    (dst / "model.gguf").write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("old", ["Q4_0", "Q8_0"])
def test_a_tensor_type_changed_to_q2_k_is_refused(wide_gguf, tmp_path, old):
    # before: Q4_0 -> Q2_K loaded and ran, the tensor covering part of its old bytes
    name = "blk.0.attn_q_a.weight" if old == "Q4_0" else "blk.0.attn_kv_a_mqa.weight"
    assert {t.name: t.dtype for t in read_gguf_header(wide_gguf / "model.gguf").tensors}[name] == old
    q2k = next(i for i, (n, _, _) in ggml_types().items() if n == "Q2_K")
    root = _retype(wide_gguf / "model.gguf", tmp_path / "c", name, q2k)
    with pytest.raises(CheckpointError, match=rf"belong to no tensor.*tile the data section.*{name}|{name}.*belong to "
                                              r"no tensor"):
        quantplug.plan(root)


def test_trailing_bytes_after_the_last_tensor_are_refused(wide_gguf, tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "config.json").write_bytes((wide_gguf / "config.json").read_bytes())
    (root / "model.gguf").write_bytes((wide_gguf / "model.gguf").read_bytes() + b"\0" * 4096)
    with pytest.raises(CheckpointError, match=r"bytes \d+\.\.\d+ after tensor .* belong to no tensor"):
        read_gguf_header(root / "model.gguf")


def test_an_unpadded_last_tensor_is_accepted(wide_gguf, tmp_path):
    """Writers that stop at the last tensor's end (quantplug's own expert-pack rewrite) tile too."""
    h = read_gguf_header(wide_gguf / "model.gguf")
    last = max(h.tensors, key=lambda t: t.offset)
    p = tmp_path / "m.gguf"
    p.write_bytes((wide_gguf / "model.gguf").read_bytes()[:last.offset + last.nbytes])
    assert len(read_gguf_header(p).tensors) == len(h.tensors)


def _infos(path: Path, n: int, name: bytes = b"", n_kv: int = 0) -> Path:
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, n, n_kv))
        f.write((struct.pack("<Q", len(name)) + name + struct.pack("<IIQ", 0, 0, 0)) * n)
    return path


def test_a_million_empty_tensor_infos_are_refused_fast_and_cheaply(tmp_path):
    # before: 3.6 s and 85 MiB walking the infos before the refusal
    p = _infos(tmp_path / "m.gguf", 1_000_000)
    ggml_types()  # gguf-py's constants imported outside the clock
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="lists 1,000,000 tensor entries; a GGUF of this format holds at most"):
        read_gguf_header(p)
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 4 << 20, (elapsed, peak)


def test_tensor_counts_under_the_cap_are_bounded_by_the_file_size(tmp_path):
    p = _infos(tmp_path / "n.gguf", 60_000, b"t")  # 25 bytes per info, but no room for 60,000 aligned tensors
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"60,000 tensors need at least [\d,]+ bytes of tensor infos and "
                                              r"32-aligned data"):
        read_gguf_header(p)
    assert time.perf_counter() - t0 < 0.5
    with pytest.raises(CheckpointError, match="lists 100,000 metadata entries"):
        read_gguf_header(_infos(tmp_path / "k.gguf", 0, n_kv=100_000))


def test_empty_names_duplicates_and_empty_tensors_stop_at_the_first(tmp_path):
    p = _infos(tmp_path / "e.gguf", 2)
    with open(p, "ab") as f:
        f.write(b"\0" * 256)
    with pytest.raises(CheckpointError, match="tensor info #0 has an empty name"):
        read_gguf_header(p)
    p = _infos(tmp_path / "d.gguf", 2, b"x")
    with open(p, "ab") as f:
        f.write(b"\0" * 256)
    with pytest.raises(CheckpointError, match="tensor x is listed twice"):
        read_gguf_header(p)
    p = tmp_path / "z.gguf"
    with open(p, "wb") as f:  # one F32 tensor [0, 4]: a zero dimension
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"z"
                + struct.pack("<I2QIQ", 2, 4, 0, 0, 0) + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"tensor z \(F32 \[0, 4\]\) has a zero dimension"):
        read_gguf_header(p)
