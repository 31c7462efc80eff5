"""Untrusted checkpoints: validated metadata, containment, faults during load, a non-destructive
expert-pack build, concurrent forwards on a pack-backed model, grouped plan errors."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import struct
import sys
import threading
from pathlib import Path

import pytest
import quantplug
import torch
from quantplug import experts
from quantplug.api import stats_sources
from quantplug.checkpoint.gguf_index import read_gguf_header
from quantplug.cli import main
from quantplug.errors import CheckpointError, ConfigError, LoadError, PlanError, QuantplugError
from quantplug.testing import hub_rope_spelling, random_state, tiny_config, wrap_kimi, write_checkpoint
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from conftest import killed_child, run_threads  # noqa: E402
from fuzz import kit  # noqa: E402

IDS = kit.IDS


def _logits(path, **kw):
    model = quantplug.load(path, progress=False, **kw)
    with torch.no_grad():
        return model(IDS)


def _cfg_write(root: Path, cfg: dict) -> None:
    (root / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return kit.dense(tmp_path_factory.mktemp("dense") / "ckpt")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return kit.gguf(tmp_path_factory.mktemp("gguf") / "ckpt")


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return kit.packed(tmp_path_factory.mktemp("pack") / "ckpt")


# -- 1. validated config.json -------------------------------------------------------------------

BAD_VALUES = [
    ("rope_parameters.rope_theta", float("nan"), "rope_theta"),
    ("rope_parameters.rope_theta", 0, "rope_theta"),
    ("rope_parameters.rope_theta", 1, "rope_theta"),  # yarn divides by log(theta)
    ("rope_parameters.rope_theta", -10000.0, "rope_theta"),
    ("rope_parameters.factor", 0.0, "factor"),
    ("rope_parameters.factor", 1e-320, "factor"),  # found by the fuzz suite: non-finite logits
    ("rope_parameters.beta_fast", 1e-320, "beta_fast"),  # found by the fuzz suite: OverflowError in yarn
    ("rms_norm_eps", 1e-320, "rms_norm_eps"),
    ("rope_parameters.factor", "4", "factor"),
    ("rope_parameters.rope_type", "linear", "rope_type"),
    ("rms_norm_eps", 0.0, "rms_norm_eps"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps"),
    ("num_hidden_layers", 10**9, "num_hidden_layers"),
    ("num_hidden_layers", True, "num_hidden_layers"),
    ("num_hidden_layers", "3", "num_hidden_layers"),
    ("hidden_size", -64, "hidden_size"),
    ("n_routed_experts", 7, "n_group"),  # not divisible by n_group 2
    ("num_experts_per_tok", 9, "num_experts_per_tok"),  # > topk_group * experts per group
    ("qk_rope_head_dim", 15, "qk_rope_head_dim"),
    ("first_k_dense_replace", 4, "first_k_dense_replace"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings"),
    ("routed_scaling_factor", float("inf"), "routed_scaling_factor"),
]


@pytest.mark.parametrize("key,value,named", BAD_VALUES)
def test_bad_config_value_is_config_error_naming_file_and_key(tmp_path, dense_dir, key, value, named):
    root = kit.clone(dense_dir, tmp_path / "c", changed="config.json")
    cfg = json.loads((dense_dir / "config.json").read_text())
    node = cfg
    *parents, last = key.split(".")
    for p in parents:
        node = node[p]
    node[last] = value
    _cfg_write(root, cfg)
    with pytest.raises(QuantplugError) as e:
        quantplug.plan(root)
    msg = str(e.value)
    assert "config.json" in msg and named in msg, msg
    assert "expected" in msg or "NaN" in msg or "not valid JSON" in msg, msg


def test_both_rope_spellings_and_text_config_validated(tmp_path):
    cfg = hub_rope_spelling(tiny_config(), "rope_type")
    cfg["rope_scaling"]["factor"] = -4.0
    root = write_checkpoint(tmp_path / "hub", cfg, random_state(tiny_config()))
    with pytest.raises(ConfigError, match=r"config\.json: rope_scaling\.factor = -4\.0: expected a finite number"):
        quantplug.plan(root)
    wcfg, tensors = wrap_kimi(tiny_config(), random_state(tiny_config()))
    wcfg["text_config"]["rms_norm_eps"] = 0
    root = write_checkpoint(tmp_path / "kimi", wcfg, tensors)
    with pytest.raises(ConfigError, match=r"config\.json: text_config\.rms_norm_eps = 0: expected"):
        quantplug.plan(root)


def test_layer_count_must_match_tensors_before_the_model_is_built(tmp_path, dense_dir):
    root = kit.clone(dense_dir, tmp_path / "c", changed="config.json")
    cfg = json.loads((dense_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 1000  # in bounds, but the checkpoint has 3 layers
    _cfg_write(root, cfg)
    with pytest.raises(ConfigError, match="num_hidden_layers = 1000, but the checkpoint holds no tensor of layer 999"):
        quantplug.plan(root)


def test_json_bounds(tmp_path, dense_dir):
    root = kit.clone(dense_dir, tmp_path / "c", changed="config.json")
    (root / "config.json").write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(CheckpointError, match="nested deeper than 32"):
        quantplug.plan(root)
    (root / "config.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(CheckpointError, match="not valid UTF-8"):
        quantplug.plan(root)


# -- 2. containment ------------------------------------------------------------------------------

@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../x.safetensors"])
def test_index_may_not_name_files_outside_the_directory(tmp_path, dense_dir, shard):
    root = kit.clone(dense_dir, tmp_path / "c", changed="model.safetensors.index.json")
    idx = json.loads((dense_dir / "model.safetensors.index.json").read_text())
    first = next(iter(idx["weight_map"]))
    idx["weight_map"][first] = shard
    (root / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="relative to the checkpoint directory"):
        quantplug.plan(root)


def test_symlinks_leaving_the_directory_are_refused(tmp_path, dense_dir, gguf_dir):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = sorted(dense_dir.glob("*.safetensors"))[0]
    shutil.copy(shard, outside / shard.name)
    root = kit.clone(dense_dir, tmp_path / "st", changed=shard.name)
    os.symlink(outside / shard.name, root / shard.name)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        quantplug.plan(root)
    shutil.copy(gguf_dir / "model.gguf", outside / "model.gguf")
    root = kit.clone(gguf_dir, tmp_path / "gg", changed="model.gguf")
    os.symlink(outside / "model.gguf", root / "model.gguf")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        quantplug.plan(root)
    # a symlink that stays inside is fine
    root = kit.clone(gguf_dir, tmp_path / "ok", changed="model.gguf")
    (root / "blobs").mkdir()
    shutil.copy(gguf_dir / "model.gguf", root / "blobs" / "x")
    os.symlink(root / "blobs" / "x", root / "model.gguf")
    assert quantplug.plan(root).backend == "expert_pack"


def test_expert_pack_name_in_gguf_metadata_is_contained(tmp_path, pack_dir):
    data = (pack_dir / "model.gguf").read_bytes()
    key = b"quantplug.expert_pack.file"
    pos = data.index(key) + len(key) + 4  # u32 type, then u64 length + bytes
    (n,) = struct.unpack_from("<Q", data, pos)
    assert n == len(b"experts.qpack")
    evil = b"../x/eq.qpack"  # same length: the header stays well formed
    root = kit.clone(pack_dir, tmp_path / "c", changed="model.gguf")
    (root / "model.gguf").write_bytes(data[:pos + 8] + evil + data[pos + 8 + n:])
    with pytest.raises(CheckpointError, match=r"quantplug\.expert_pack\.file.*relative to the checkpoint directory"):
        quantplug.plan(root)


def test_expert_pack_metadata_is_read_by_the_plugin_typed(tmp_path, pack_dir):
    """The core's GGUF reader knows no ``quantplug.expert_pack.*`` key (the plugin reads its own keys
    through ``quantplug.api.Fields``): a pack file name stored as an array is the plugin's one-line
    error naming file, key and what was expected."""
    data = (pack_dir / "model.gguf").read_bytes()
    key = b"quantplug.expert_pack.file"
    pos = data.index(key) + len(key)  # u32 type 8 (string), u64 13, 13 bytes: 25 bytes in all
    assert struct.unpack_from("<IQ", data, pos) == (8, 13)
    as_array = struct.pack("<IIQ", 9, 0, 13 - 4) + bytes(range(9))  # an array of 9 u8: the same 25 bytes
    root = kit.clone(pack_dir, tmp_path / "c", changed="model.gguf")
    (root / "model.gguf").write_bytes(data[:pos] + as_array + data[pos + 25:])
    assert read_gguf_header(root / "model.gguf").metadata["quantplug.expert_pack.file"] == list(range(9))
    with pytest.raises(ConfigError, match=r"model\.gguf metadata: quantplug\.expert_pack\.file = \[0, 1, 2, .*: "
                                          r"expected a string"):
        quantplug.plan(root)


# -- GGUF header rules ---------------------------------------------------------------------------

def _patch_gguf(src: Path, dst: Path, fn) -> Path:
    data = bytearray(src.read_bytes())
    fn(data)
    dst.write_bytes(bytes(data))
    return dst


def _tensor_record(data: bytes, name: str) -> int:
    """Offset of the u32 n_dims of tensor ``name``'s info record."""
    raw = name.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


def test_gguf_overlap_bool_alignment_duplicates_and_counts(tmp_path, gguf_dir):
    src = gguf_dir / "model.gguf"
    h = read_gguf_header(src)
    a, b = h.tensors[0], h.tensors[1]

    def move_offset(d):  # tensor b's offset onto tensor a's bytes
        pos = _tensor_record(d, b.name)
        (nd,) = struct.unpack_from("<I", d, pos)
        struct.pack_into("<Q", d, pos + 4 + 8 * nd + 4, a.offset - h.data_start)
    with pytest.raises(CheckpointError, match="overlap"):
        read_gguf_header(_patch_gguf(src, tmp_path / "o.gguf", move_offset))

    def bool_alignment(d):
        key = b"general.alignment"
        if key not in d:  # gguf-py writes it only when it differs from 32: add nothing, retype a key
            key = b"deepseek2.block_count"
        pos = d.index(key) + len(key)
        struct.pack_into("<I", d, pos, 7)  # bool
    with pytest.raises(CheckpointError, match="expected a non-negative integer"):
        read_gguf_header(_patch_gguf(src, tmp_path / "b.gguf", bool_alignment))

    def dup_key(d):  # rename one metadata key to another key's spelling of the same length
        keys = list(h.metadata)
        by_len: dict[int, list[str]] = {}
        for k in keys:
            by_len.setdefault(len(k), []).append(k)
        k1, k2 = next(v[:2] for v in by_len.values() if len(v) >= 2)
        raw2 = struct.pack("<Q", len(k2)) + k2.encode()
        pos = d.index(raw2)
        d[pos + 8:pos + 8 + len(k2)] = k1.encode()
    with pytest.raises(CheckpointError, match="appears twice"):
        read_gguf_header(_patch_gguf(src, tmp_path / "d.gguf", dup_key))

    def huge_count(d):
        struct.pack_into("<Q", d, 8, 2**60)  # n_tensors
    with pytest.raises(CheckpointError, match="lists 1,152,921,504,606,846,976 tensor entries; a GGUF of this format "
                                              "holds at most 65,536"):
        read_gguf_header(_patch_gguf(src, tmp_path / "c.gguf", huge_count))

    def large_count(d):
        struct.pack_into("<Q", d, 8, 60000)  # under the cap, more than the file can hold
    with pytest.raises(CheckpointError, match="tensor count = 60,000 needs at least|60,000 tensors need at least"):
        read_gguf_header(_patch_gguf(src, tmp_path / "e.gguf", large_count))


# -- Quark: F8_E8M0 weight_scale is U8's encoding ---------------------------------------------------

def test_quark_e8m0_scales_give_identical_logits(tmp_path):
    # amd-quark writes weight_scale as U8; F8_E8M0 is the same byte (biased exponent). Both files
    # below have one layout (the U8 header is padded with JSON whitespace to the same length), so
    # every tensor sits at the same offset and the logits must be bit-identical.
    root = kit.vendor(tmp_path / "e8m0", "quark_mxfp4_dsv3")
    st = load_file(str(root / "model.safetensors"))
    n = 0
    for k in list(st):
        if k.endswith("weight_scale"):
            st[k] = st[k].view(torch.float8_e8m0fnu)
            n += 1
    assert n
    save_file(st, str(root / "model.safetensors"))
    data = (root / "model.safetensors").read_bytes()
    (hlen,) = struct.unpack_from("<Q", data, 0)
    header = data[8:8 + hlen].replace(b'"F8_E8M0"', b'"U8"     ')
    assert header.count(b'"U8"     ') == n
    control = kit.clone(root, tmp_path / "u8", changed="model.safetensors")
    (control / "model.safetensors").write_bytes(data[:8] + header + data[8 + hlen:])
    assert torch.equal(_logits(root), _logits(control))


# -- 7. grouped errors ---------------------------------------------------------------------------

def test_one_unsupported_group_size_is_said_once(tmp_path, capsys):
    root = kit.vendor(tmp_path / "q", "quark_mxfp4_dsv3")
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"]["global_quant_config"]["weight"]["group_size"] = 64
    _cfg_write(root, cfg)
    with pytest.raises(PlanError) as e:
        quantplug.plan(root)
    lines = e.value.lines
    assert len(e.value.problems) > 20 and len(lines) == 2, lines
    assert lines[0].startswith("24 layers: ") and "group_size 64" in lines[0]
    assert "follow from the refusal" in lines[1]
    assert str(e.value).count("group_size 64") == 1
    assert main(["load", str(root)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)


# -- 4. faults during load -----------------------------------------------------------------------

def test_file_shrunk_or_replaced_between_plan_and_load(tmp_path, dense_dir):
    from quantplug.loader import execute
    from quantplug.plan import build_plan

    root = tmp_path / "c"
    shutil.copytree(dense_dir, root)
    base = _logits(root)
    shard = sorted(root.glob("*.safetensors"))[-1]
    good = shard.read_bytes()
    plan = build_plan(root)
    with open(shard, "r+b") as fh:
        fh.truncate(len(good) - 100)
    with pytest.raises(LoadError, match=rf"{shard.name}: changed since the plan was made \(size .*first tensor in it"):
        execute(plan, progress=False)
    shard.write_bytes(good)
    plan = build_plan(root)
    shard.unlink()
    shard.write_bytes(good)  # same bytes, a new file: still not the file the plan read
    with pytest.raises(LoadError, match=rf"{shard.name}: changed since the plan was made \((replaced|rewritten)"):
        execute(plan, progress=False)
    assert torch.equal(_logits(root), base)  # retry (a new plan) after the repair


def test_io_error_mid_read_is_load_error_naming_file_and_tensor(tmp_path, dense_dir, monkeypatch):
    import quantplug.memory as memory

    calls = {"n": 0}
    real = os.preadv

    def flaky(fd, bufs, offset):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(memory.os, "preadv", flaky)
    with pytest.raises(LoadError, match=r"\.weight in model-\d+-of-\d+\.safetensors .*Input/output error"):
        quantplug.load(dense_dir, dtype=torch.bfloat16, progress=False)  # bf16: converted, read with preadv
    monkeypatch.setattr(memory.os, "preadv", real)
    assert quantplug.load(dense_dir, dtype=torch.bfloat16, progress=False) is not None


def test_corrupt_expert_payload_during_forward_then_repair(tmp_path, pack_dir):
    from quantplug_expert_pack.pack import PACK_NAME, ExpertPack

    root = tmp_path / "p"
    shutil.copytree(pack_dir, root)
    base = _logits(root)
    pack = ExpertPack(root / PACK_NAME)
    entries = [pack.entry(layer, e, "down_proj") for layer in pack.layers for e in range(pack.n_experts)]
    with open(root / PACK_NAME, "r+b") as fh:
        saved = []
        for entry in entries:  # every expert's down_proj: whichever the router picks is corrupt
            fh.seek(entry.offset)
            saved.append(fh.read(1))
            fh.seek(entry.offset)
            fh.write(bytes([saved[-1][0] ^ 0xFF]))
    want = r"experts\.qpack: tensor blk\.\d+\.ffn_down_exps\.weight expert \d+: checksum"
    with pytest.raises(CheckpointError, match=want):  # experts in memory: read, and checked, at load
        quantplug.load(root, progress=False)
    model = quantplug.load(root, progress=False, options={"expert_cache_mb": 1})  # served: read on demand
    with pytest.raises(CheckpointError, match=want), torch.no_grad():
        model(IDS)
    with open(root / PACK_NAME, "r+b") as fh:  # repair
        for entry, b in zip(entries, saved):
            fh.seek(entry.offset)
            fh.write(b)
    with torch.no_grad():
        assert torch.equal(model(IDS), base)  # same model object: the process keeps running, retry works


# -- 5. nothing lost: expert-pack build ---------------------------------------------------------------

def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_build_to_new_directory_leaves_source_and_matches(tmp_path, gguf_dir, pack_dir):
    src = tmp_path / "src"
    shutil.copytree(gguf_dir, src)
    before = _tree_digest(src)
    dst = tmp_path / "out" / "packed"
    assert main(["expert-pack", "build", str(src), "-o", str(dst)]) == 0
    assert _tree_digest(src) == before
    assert (dst / "experts.qpack").is_file() and (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
    torch.testing.assert_close(_logits(dst), _logits(src), rtol=1e-5, atol=1e-6)  # pack: cache path, src: native
    assert main(["expert-pack", "build", str(src), "-o", str(dst)]) == 1  # exists: refused, one line
    assert main(["expert-pack", "build", str(src)]) == 2  # neither -o nor --in-place: usage error


def test_build_output_shares_no_inode_with_the_source(tmp_path, gguf_dir):
    """Issue 22: ``build -o`` hard-linked SRC's large files (a >= 1 MiB tokenizer.json) into DST, so
    editing DST's tokenizer.json edited SRC's. Every file of DST is now its own inode (a reflink
    where the file system supports one, else a copy)."""
    src = tmp_path / "src"
    shutil.copytree(gguf_dir, src)
    (src / "tokenizer.json").write_text(json.dumps({"pad": "x" * (2 << 20)}))  # large: was hard-linked
    (src / "sub").mkdir()
    (src / "sub" / "notes.bin").write_bytes(os.urandom(3 << 20))
    before = _tree_digest(src)
    dst = tmp_path / "dst"
    import quantplug_expert_pack.build as b

    res = b.build_pack(src, dst, progress=False)
    assert sum(res.mirrored.values()) == 3  # config.json, tokenizer.json, sub/notes.bin
    src_inodes = {p.stat().st_ino for p in src.rglob("*") if p.is_file()}
    for f in dst.rglob("*"):
        if f.is_file():
            assert f.stat().st_ino not in src_inodes and f.stat().st_nlink == 1, f
    with open(dst / "tokenizer.json", "r+b") as fh:  # an in-place write, as an editor may do
        fh.write(b"{}     ")
    (dst / "sub" / "notes.bin").write_bytes(b"changed")
    assert _tree_digest(src) == before
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_clone_file_falls_back_to_a_copy(tmp_path, monkeypatch):
    import quantplug_expert_pack.build as b

    src = tmp_path / "a"
    src.write_bytes(os.urandom(100_000))
    monkeypatch.setattr(b.os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "x")),
                        raising=False)
    assert b.clone_file(src, tmp_path / "b") in ("reflink", "copy")
    assert (tmp_path / "b").read_bytes() == src.read_bytes()
    assert (tmp_path / "b").stat().st_ino != src.stat().st_ino


@pytest.mark.parametrize("point,n", [("copy", 1), ("copy", 20), ("copy", 60), ("mirror", 0), ("rename", 0)])
def test_build_killed_at_any_point_leaves_source_intact(tmp_path, gguf_dir, point, n):
    import quantplug_expert_pack.build as b

    src = tmp_path / "src"
    shutil.copytree(gguf_dir, src)
    before = _tree_digest(src)
    dst = tmp_path / "dst"

    def child() -> None:
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)

        if point == "copy":  # killed while writing the n-th payload / tensor
            real, count = b._copy, [0]

            def _copy(*a, **k):
                count[0] += 1
                if count[0] == n:
                    die()
                return real(*a, **k)
            b._copy = _copy
        elif point == "mirror":  # pack and GGUF written, other files not yet linked
            b._mirror = die
        else:  # everything written, just before DST appears
            b.os.rename = die
        b.build_pack(src, dst, progress=False)

    status = killed_child(child)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert _tree_digest(src) == before
    assert not dst.exists()  # nothing under the final name; only the hidden .partial directory
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "src"]
    assert all(name.startswith(".dst.partial-") for name in leftovers), leftovers


def test_build_on_full_disk_is_checkpoint_error_and_cleans_up(tmp_path, gguf_dir, monkeypatch):
    import quantplug_expert_pack.build as b

    src = tmp_path / "src"
    shutil.copytree(gguf_dir, src)
    before = _tree_digest(src)
    real = b._copy
    count = {"n": 0}

    def full(s, d, offset, size, sha=None):
        count["n"] += 1
        if count["n"] == 30:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "dst"))
        return real(s, d, offset, size, sha)

    monkeypatch.setattr(b, "_copy", full)
    with pytest.raises(CheckpointError, match="No space left on device while building the expert pack"):
        b.build_pack(src, tmp_path / "dst", progress=False)
    assert _tree_digest(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # partial output removed
    count["n"] = 0
    with pytest.raises(CheckpointError, match="No space left"):  # in place: the originals survive too
        b.build_pack(src, progress=False)
    assert _tree_digest(src) == before


# -- 6. concurrency --------------------------------------------------------------------------------

def test_two_threads_forward_on_one_pack_model_match_one_thread(pack_dir):
    # a cache of little more than one step: the threads evict each other's experts all the time
    model = quantplug.load(pack_dir, progress=False, options={"expert_cache_mb": 0.02})
    cache = stats_sources(model)["expert_cache"]
    assert cache.budget < 2 * experts.step_bytes(model.quantplug_plan)
    ids = [torch.tensor([[i, (7 * i) % 160, (13 * i) % 160, 5, 9]]) for i in range(4)]
    with torch.no_grad():
        ref = [model(x) for x in ids]
    out: dict[tuple[int, int], torch.Tensor] = {}

    def run(t: int) -> None:
        for rep in range(2):
            for i in range(t, len(ids), 2):
                with torch.no_grad():
                    out[(i, rep)] = model(ids[i])

    run_threads(run)
    for (i, _), o in out.items():
        assert torch.equal(o, ref[i]), i


def test_two_threads_generate_on_one_pack_model_match_one_thread(pack_dir):
    model = quantplug.load(pack_dir, progress=False, options={"expert_cache_mb": 0.02})
    prompts = [torch.tensor([[i + 1, 40 + i, 7]]) for i in range(4)]
    ref = [model.generate(p, max_new_tokens=4, eos_token_id=None) for p in prompts]
    out: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            for i in range(t, len(prompts), 2):
                out[i] = model.generate(prompts[i], max_new_tokens=4, eos_token_id=None)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(torch.equal(out[i], ref[i]) for i in range(len(prompts)))


def test_pack_counts_checked_before_reading_and_payloads_may_not_overlap(tmp_path, pack_dir):
    import numpy as np
    from quantplug_expert_pack.pack import ENTRY_DTYPE, HEADER_SIZE, PACK_NAME, ExpertPack

    data = (pack_dir / PACK_NAME).read_bytes()
    huge = bytearray(data)
    struct.pack_into("<II", huge, 24, 2**20, 2**20)  # layers, experts: consistent with n_entries below
    struct.pack_into("<Q", huge, 40, 3 * 2**40)
    (tmp_path / "h.qpack").write_bytes(bytes(huge))
    with pytest.raises(CheckpointError, match="cannot fit in the .*-byte file"):
        ExpertPack(tmp_path / "h.qpack")
    (n_entries,) = struct.unpack_from("<Q", data, 40)
    idx = np.frombuffer(data[HEADER_SIZE:HEADER_SIZE + 80 * n_entries], dtype=ENTRY_DTYPE).copy()
    idx["offset"][1] = idx["offset"][0]  # up_proj onto gate_proj's bytes, checksum made to match
    raw = idx.tobytes()
    bad = bytearray(data)
    bad[HEADER_SIZE:HEADER_SIZE + len(raw)] = raw
    bad[136:168] = hashlib.sha256(raw).digest()
    (tmp_path / "o.qpack").write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match="overlap: the index is corrupt"):
        ExpertPack(tmp_path / "o.qpack")


def test_pack_payloads_listed_out_of_order_fail_validation(tmp_path, pack_dir):
    """Issue 22: an index whose payload offsets do not follow its (layer, expert, role) order
    (gate and down of one expert swapped, checksums kept consistent) passed validation; an
    expert's span (one read) then covered the wrong bytes."""
    import numpy as np
    from quantplug_expert_pack.pack import ENTRY_DTYPE, HEADER_SIZE, PACK_NAME, ExpertPack

    data = (pack_dir / PACK_NAME).read_bytes()
    (n_entries,) = struct.unpack_from("<Q", data, 40)
    idx = np.frombuffer(data[HEADER_SIZE:HEADER_SIZE + 80 * n_entries], dtype=ENTRY_DTYPE).copy()
    assert idx["size"][0] == idx["size"][2]  # gate [I, H] and down [H, I]: same bytes
    for field in ("offset", "sha256"):
        idx[field][[0, 2]] = idx[field][[2, 0]]
    raw = idx.tobytes()
    bad = bytearray(data)
    bad[HEADER_SIZE:HEADER_SIZE + len(raw)] = raw
    bad[136:168] = hashlib.sha256(raw).digest()
    (tmp_path / "s.qpack").write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match=r"entries layer \d+ expert 0 gate_proj .* and layer \d+ expert 0 up_proj "
                                              r".* are out of order \(payloads must follow the index order\)"):
        ExpertPack(tmp_path / "s.qpack")


def test_duplicate_json_keys_are_errors(tmp_path):
    """Python's json keeps the last of two equal keys, other parsers the first: refuse the file."""
    from quantplug.errors import CheckpointError
    from quantplug.testing import random_state, tiny_config, write_checkpoint

    cfg = tiny_config()
    path = write_checkpoint(tmp_path / "dup", cfg, random_state(cfg))
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text.replace('"hidden_size": 64,', '"hidden_size": 64, "hidden_size": 128,', 1))
    with pytest.raises(CheckpointError, match="config.json: key 'hidden_size' appears twice"):
        quantplug.plan(path)


def test_build_reads_config_json_typed(tmp_path, gguf_dir):
    """``expert-pack build`` read num_experts_per_tok with int(): NaN was a raw ValueError."""
    src = tmp_path / "src"
    shutil.copytree(gguf_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts_per_tok"] = float("nan")
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["expert-pack", "build", str(src), "-o", str(tmp_path / "dst")]) == 1
