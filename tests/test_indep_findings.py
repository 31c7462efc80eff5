"""Regressions for what the independent fuzzer (tests/fuzz_indep, docs/fuzzing.md) found.

Each test failed before its fix: a raw decoder message, a hang on a FIFO, a TypeError on a
safetensors header entry written as an array, an OSError / ValueError from the GGUF tokenizer
reader, a wrong-typed GGUF tokenizer key replaced by a default.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import quantplug
from fuzz_indep import formats as F
from quantplug.errors import CheckpointError, QuantplugError
from quantplug.testing import random_state, tiny_config, write_checkpoint
from quantplug.tokenizer import load_tokenizer

VENDOR = Path(__file__).parent / "data" / "vendor"


@pytest.fixture
def deadline() -> Iterator[None]:
    """Fail (instead of hanging the suite) if the test takes more than 20 s."""
    def boom(*_: object) -> None:
        raise TimeoutError("hung: a reader blocked")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config()
    return write_checkpoint(tmp_path_factory.mktemp("dense"), cfg, random_state(cfg))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("text, where, problem", [
    ("", "line 1 column 1", "expected a value"),
    ("{", "line 1 column 2", "expected a key in double quotes"),
    ('{"a": 1', "line 1 column 8", "expected ',' or the end of the object or list"),
    ('{"a": "x', "line 1 column 7", "a string is not closed"),
    ('{"a": 1} {}', "line 1 column 10", "more text after the JSON value"),
])
def test_invalid_json_message_is_ours_not_the_decoders(dense: Path, tmp_path: Path, text: str, where: str,
                                                       problem: str) -> None:
    ckpt = _copy(dense, tmp_path / "c")
    (ckpt / "config.json").write_text(text)
    with pytest.raises(CheckpointError) as e:
        quantplug.plan(ckpt)
    msg = str(e.value)
    assert msg == f"{ckpt / 'config.json'}: not valid JSON at {where}: {problem}"
    for raw in ("Expecting", "Unterminated", "Extra data", "char "):
        assert raw not in msg


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
def test_fifo_weight_file_or_index_is_refused_without_blocking(dense: Path, tmp_path: Path, deadline: None,
                                                                name: str) -> None:
    ckpt = _copy(dense, tmp_path / "c")
    (ckpt / name).unlink(missing_ok=True)
    os.mkfifo(ckpt / name)
    with pytest.raises(CheckpointError, match=rf"'{name}' is a FIFO, not a regular file"):
        quantplug.plan(ckpt)


def test_fifo_gguf_is_refused_without_blocking(tmp_path: Path, deadline: None) -> None:
    ckpt = _copy(VENDOR / "gguf_iq2_xs_dsv3", tmp_path / "c")
    (ckpt / "model.gguf").unlink()
    os.mkfifo(ckpt / "model.gguf")
    with pytest.raises(CheckpointError, match="'model.gguf' is a FIFO"):
        quantplug.plan(ckpt)
    with pytest.raises(CheckpointError, match="'model.gguf' is a FIFO"):
        load_tokenizer(ckpt)


def test_fifo_tokenizer_config_is_refused_without_blocking(dense: Path, tmp_path: Path, deadline: None) -> None:
    ckpt = _copy(dense, tmp_path / "c")
    (ckpt / "tokenizer.json").write_text("{}")
    os.mkfifo(ckpt / "tokenizer_config.json")
    with pytest.raises(CheckpointError, match="'tokenizer_config.json' is a FIFO"):
        load_tokenizer(ckpt)


def test_safetensors_entry_written_as_an_array_is_a_checkpoint_error(dense: Path, tmp_path: Path) -> None:
    ckpt = _copy(dense, tmp_path / "c")
    st = F.parse_safetensors((ckpt / "model.safetensors").read_bytes())
    assert st is not None
    e = st.header["model.norm.weight"]
    # the safetensors library reads [dtype, shape, data_offsets] as the entry's fields
    st.header["model.norm.weight"] = [e["dtype"], e["shape"], e["data_offsets"]]
    (ckpt / "model.safetensors").write_bytes(st.emit())
    with pytest.raises(CheckpointError, match=r"tensor model\.norm\.weight in model\.safetensors: header entry .*"
                                              "expected an object with dtype, shape and data_offsets"):
        quantplug.plan(ckpt)


@pytest.mark.parametrize("kind", ["dangling", "directory", "loop", "empty"])
def test_unreadable_gguf_is_a_checkpoint_error_for_the_tokenizer(tmp_path: Path, kind: str) -> None:
    ckpt = _copy(VENDOR / "gguf_iq2_xs_dsv3", tmp_path / "c")
    f = ckpt / "model.gguf"
    f.unlink()
    if kind == "dangling":
        f.symlink_to("nothing-here.gguf")
    elif kind == "directory":
        f.mkdir()
    elif kind == "loop":
        f.symlink_to("model.gguf")
    else:
        f.write_bytes(b"")
    with pytest.raises(CheckpointError, match="model.gguf"):
        load_tokenizer(ckpt)
    with pytest.raises(QuantplugError):
        quantplug.plan(ckpt)


@pytest.mark.parametrize("key, vtype, value", [
    ("tokenizer.ggml.pre", 5, 1),          # an int32 where llama.cpp reads a string
    ("tokenizer.ggml.merges", 8, "a b"),   # a string where an array is read
    ("tokenizer.ggml.token_type", 5, 1),   # an int32 where an array is read
])
def test_wrong_typed_gguf_tokenizer_key_is_refused_not_defaulted(tmp_path: Path, key: str, vtype: int,
                                                                 value: object) -> None:
    ckpt = _copy(VENDOR / "gguf_iq2_xs_dsv3", tmp_path / "c")
    g = F.parse_gguf((ckpt / "model.gguf").read_bytes())
    assert g is not None
    kvs = [F.gguf_kv_bytes(kv.key, vtype, value) if kv.key == key else g.blob[kv.span[0]:kv.span[1]]
           for kv in g.kvs]
    assert any(kv.key == key for kv in g.kvs)
    infos = [g.blob[t.span[0]:t.span[1]] for t in g.infos]
    (ckpt / "model.gguf").write_bytes(F.emit_gguf(g, kvs, infos))
    quantplug.plan(ckpt)  # the model side does not read the tokenizer keys
    with pytest.raises(CheckpointError, match=rf"model\.gguf: metadata {key} = .*: expected "):
        load_tokenizer(ckpt)


def test_the_emitted_gguf_is_unchanged_when_nothing_is_mutated(tmp_path: Path) -> None:
    """The fixture writer above re-emits a GGUF byte for byte (else the tests would test it)."""
    blob = (VENDOR / "gguf_iq2_xs_dsv3" / "model.gguf").read_bytes()
    g = F.parse_gguf(blob)
    assert g is not None
    again = F.emit_gguf(g, [blob[kv.span[0]:kv.span[1]] for kv in g.kvs], [blob[t.span[0]:t.span[1]] for t in g.infos])
    assert again == blob
    assert struct.unpack_from("<I", blob, 4)[0] == 3
    assert json.loads((VENDOR / "gguf_iq2_xs_dsv3" / "config.json").read_text())["architectures"]


def test_autoround_extra_config_data_type_is_typed_even_with_bits_16(tmp_path: Path) -> None:
    """``bits: 16`` alone leaves a layer in float, but a ``data_type`` of another type next to it
    was never read (short-circuit), so a wrong-typed value passed unchecked."""
    ckpt = _copy(VENDOR / "autoround_gptq_dsv3", tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["extra_config"]["model.layers.0.self_attn.kv_a_proj_with_mqa"]["data_type"] = 7
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantplugError, match=r"extra_config\..*data_type = 7: expected a string"):
        quantplug.plan(ckpt)


def _retype_gguf(ckpt: Path, name: str, ttype: int) -> None:
    g = F.parse_gguf((ckpt / "model.gguf").read_bytes())
    assert g is not None
    kvs = [g.blob[kv.span[0]:kv.span[1]] for kv in g.kvs]
    infos = [F.gguf_info_bytes(t.name, t.dims, ttype, t.offset) if t.name == name else g.blob[t.span[0]:t.span[1]]
             for t in g.infos]
    assert any(t.name == name for t in g.infos)
    (ckpt / "model.gguf").write_bytes(F.emit_gguf(g, kvs, infos))


def test_gguf_type_shrunk_within_the_alignment_padding_is_refused(tmp_path: Path) -> None:
    """F32 -> F16 of the 4-element router bias: 16 bytes become 8, and the tensor after it still
    starts at the next 32-byte boundary, so the tiling check alone passed and the bias was read
    from half of its old bytes. The padding after a tensor must be zeros."""
    ckpt = _copy(VENDOR / "gguf_tq1_0_dsv3", tmp_path / "c")
    _retype_gguf(ckpt, "blk.0.exp_probs_b.bias", 1)
    with pytest.raises(CheckpointError, match=r"the alignment padding after tensor .*exp_probs_b.* is not zeros"):
        quantplug.plan(ckpt)


def test_every_vendor_gguf_has_zero_padding() -> None:
    for d in sorted(p for p in VENDOR.glob("gguf_*") if p.is_dir()):
        quantplug.plan(d)


@pytest.mark.parametrize("key, value", [("tokenizer.ggml.bos_token_id", False), ("tokenizer.ggml.eos_token_id", 1 << 30)])
def test_gguf_bos_eos_ids_are_typed_token_ids(tmp_path: Path, key: str, value: object) -> None:
    ckpt = _copy(VENDOR / "gguf_iq2_xs_dsv3", tmp_path / "c")
    g = F.parse_gguf((ckpt / "model.gguf").read_bytes())
    assert g is not None
    vtype = 7 if isinstance(value, bool) else 4
    kvs = [F.gguf_kv_bytes(kv.key, vtype, value) if kv.key == key else g.blob[kv.span[0]:kv.span[1]] for kv in g.kvs]
    (ckpt / "model.gguf").write_bytes(F.emit_gguf(g, kvs, [g.blob[t.span[0]:t.span[1]] for t in g.infos]))
    with pytest.raises(CheckpointError, match=rf"metadata {key} = .*: expected a token id in \[0, 320\)"):
        load_tokenizer(ckpt)


@pytest.mark.parametrize("template", [
    # `~` doubles a string per step: 2^60 characters after 60 (it was compiled to an unchecked join)
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    # the replace filter (the str.replace method was bounded, the filter not): 3.6e9 characters
    "{% set s = 'a' * 60000 %}{{ s | replace('a', s) }}",
    # join of a list of bounded strings: 128 x 120,000 characters
    "{% set ns = namespace(l=['ab' * 60000]) %}{% for i in range(7) %}{% set ns.l = ns.l + ns.l %}{% endfor %}"
    "{{ ns.l | join }}",
])
def test_chat_template_growth_by_concat_join_replace_is_refused_before_allocating(template: str) -> None:
    """Each needed gigabytes before the render failed (a MemoryError, or the OOM killer without an
    address-space limit); now refused by the sandbox's size bound before the allocation."""
    import resource

    from quantplug.tokenizer import render_bounded

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (min(hard, 8 << 30) if hard != resource.RLIM_INFINITY else 8 << 30, hard))
    try:
        with pytest.raises(CheckpointError, match="refused by the sandbox: a value of"):
            render_bounded(template, {}, "t")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_chat_template_concat_join_replace_still_render() -> None:
    from quantplug.tokenizer import render_bounded

    assert render_bounded("{{ 'a' ~ 1 ~ none }}|{{ [1, 'x'] | join(', ') }}|{{ [{'n': 'p'}, {'n': 'q'}] | "
                          "join('+', attribute='n') }}|{{ 'aXbX' | replace('X', '--', 1) }}", {}, "t") == \
        "a1None|1, x|p+q|a--bX"


def test_chat_template_join_of_a_lazy_map_stops_at_the_bound() -> None:
    """60,000 strings of 60,000 characters made one by one by ``map('center')``: the join used to
    hold all 3.6e9 characters before its size was known."""
    import resource

    from quantplug.tokenizer import render_bounded

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (min(hard, 8 << 30) if hard != resource.RLIM_INFINITY else 8 << 30, hard))
    try:
        with pytest.raises(CheckpointError, match="refused by the sandbox: a value of"):
            render_bounded("{{ ('a' * 60000) | list | map('center', 60000) | join | length }}", {}, "t")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
