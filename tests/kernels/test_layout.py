"""The structs Python passes to the native kernels, declared once (``abi.py``): the generated C
header ``qp_abi.h`` is up to date, and native.py's ctypes Structures (made from the declaration)
match the C compiler's layout of it (``qp_layout_table`` in ``layout.c``), field by field.

Checked twice: in the built library, and in a probe compiled from ``layout.c`` alone, which also
shows the check failing when a field moves on the C side (a copy of ``qp_abi.h`` with two fields
swapped) or on the Python side (a ctypes copy with two fields swapped, or one missing)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from quantplug.kernels import abi, native

CC = os.environ.get("CC", "cc")
needs_cc = pytest.mark.skipif(shutil.which(CC) is None, reason=f"no C compiler ({CC!r} not on PATH)")
needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")
HERE = native.SOURCE.parent


def probe(tmp_path: Path, abi_h: str | None = None) -> dict[str, dict[str, tuple[int, int]]]:
    """The layout table of ``layout.c`` compiled alone (with ``abi_h`` as ``qp_abi.h``)."""
    d = tmp_path / f"probe{len(list(tmp_path.glob('probe*')))}"  # a new path per probe: the loader
    d.mkdir()                                                         # hands back a library by path
    shutil.copy(HERE / "layout.c", d / "layout.c")
    shutil.copy(HERE / "qp_types.h", d / "qp_types.h")
    (d / "qp_abi.h").write_text(abi_h if abi_h is not None else (HERE / "qp_abi.h").read_text())
    so = d / "probe.so"
    subprocess.run([CC, "-O1", "-shared", "-fPIC", "-std=c11", str(d / "layout.c"), "-o", str(so)], check=True,
                   capture_output=True, timeout=120)
    return native.layout_table(ctypes.CDLL(str(so)))


@needs_native
def test_every_ctypes_struct_matches_the_libraries_layout():
    table = native.layout_table(native.library())
    assert set(table) == set(native.STRUCTS)
    assert native.layout_mismatches(table) == []
    for name, cls in native.STRUCTS.items():
        assert [f[0] for f in cls._fields_] == sorted((k for k in table[name] if k), key=lambda k: table[name][k][0])


@needs_cc
def test_the_header_alone_matches_the_ctypes_structs(tmp_path):
    assert native.layout_mismatches(probe(tmp_path)) == []


@needs_cc
def test_a_field_moved_in_the_c_header_is_caught(tmp_path):
    src = (HERE / "qp_abi.h").read_text()
    mode = "    int32_t mode;                           /* 0 exact, 1 fast (Q4_0 / Q8_0) */\n"
    nan = "    int32_t nan;                            /* FP8: may hold NaN codes */\n"
    assert mode + nan in src
    bad = native.layout_mismatches(probe(tmp_path, src.replace(mode + nan, nan + mode)))
    assert sorted(b.split(":")[0] for b in bad) == ["qp_mat.mode", "qp_mat.nan"]
    # a pointer field moved past an int64 one in the latent-attention struct
    q = "    const qp_mat *q_b;\n"
    assert src.count(q) == 1
    moved = src.replace(q, "").replace("    const qp_mat *o;  ", q + "    const qp_mat *o;  ")
    assert moved != src.replace(q, "")
    bad = native.layout_mismatches(probe(tmp_path, moved))
    assert "qp_latent_attn.q_b" in {b.split(":")[0] for b in bad}


@needs_cc
def test_a_field_moved_or_missing_in_ctypes_is_caught(tmp_path):
    table = probe(tmp_path)
    fields = list(native.Mat._fields_)
    i, j = [k for k, (name, _) in enumerate(fields) if name in ("mode", "nan")]
    fields[i], fields[j] = fields[j], fields[i]
    swapped = type("SwappedMat", (ctypes.Structure,), {"_fields_": fields})
    bad = native.layout_mismatches(table, {"qp_mat": swapped})
    assert sorted(b.split(":")[0] for b in bad) == ["qp_mat.mode", "qp_mat.nan"]
    # its last two fields (8 bytes: the size changes) gone; no other field moves
    last = {f"qp_layer.{name}" for name, _ in native.Layer._fields_[-2:]}
    short = type("ShortLayer", (ctypes.Structure,), {"_fields_": native.Layer._fields_[:-2]})
    bad = native.layout_mismatches(table, {"qp_layer": short})
    assert {b.split(":")[0] for b in bad} == {"qp_layer"} | last  # its size and the fields


def test_the_generated_header_is_the_declarations():
    """qp_abi.h is abi.py's declaration as written by ``python -m quantplug.kernels.abi`` (rerun it
    after changing abi.py); its ctypes classes are made from the same declaration, in order."""
    assert not abi.stale(), "qp_abi.h is stale: run `python -m quantplug.kernels.abi`"
    assert list(native.STRUCTS) == list(abi.STRUCTS)
    for name, (_, fields) in abi.STRUCTS.items():
        assert [f[0] for f in native.STRUCTS[name]._fields_] == [f[0] for f in fields]
        assert f"}} {name};" in abi.header()
    # the router's enums are generated from quantplug.contract.routing's kinds
    from quantplug.contract.routing import SCORES, SELECTS

    assert "QRS_SOFTMAX = 1" in abi.header() and SCORES["softmax"] == 1 and SELECTS["group_max"] == 2


def test_a_declared_type_abi_does_not_map_is_refused(monkeypatch):
    monkeypatch.setitem(abi.STRUCTS, "qp_bad", ("", [("x", "double", "")]))
    with pytest.raises(ValueError, match="double"):
        abi._check()
    monkeypatch.setitem(abi.STRUCTS, "qp_bad", ("", [("x", "const qp_later *", "")]))
    with pytest.raises(ValueError, match="not declared before"):
        abi._check()


def test_a_stale_header_refuses_the_build(monkeypatch):
    """abi.py changed without rewriting qp_abi.h: no library is built (the torch paths run)."""
    monkeypatch.setattr(abi, "header", lambda: "/* another declaration */\n")
    with pytest.raises(OSError, match="python -m quantplug.kernels.abi"):
        native._build()


@needs_native
def test_a_library_whose_layout_differs_is_refused(monkeypatch):
    """native.py checks the table when it opens a library: a mismatch raises (then the build is
    retried once and the torch paths run), never a call with a misplaced field."""
    lib = native.library()
    fields = list(native.Act._fields_)
    fields[0], fields[1] = fields[1], fields[0]
    monkeypatch.setitem(native.STRUCTS, "qp_act", type("SwappedAct", (ctypes.Structure,), {"_fields_": fields}))
    assert native.layout_mismatches(native.layout_table(lib))
    path = Path(lib._name)
    with pytest.raises(OSError, match="struct layout differs"):
        native._open(path)


def test_kernel_sources_name_no_model():
    """The C sources are kernels and block steps: no model (DeepSeek, Kimi) or attention-family
    (MLA) name in them; models compose block steps in Python."""
    import re
    from pathlib import Path

    import quantplug.kernels

    root = Path(quantplug.kernels.__file__).parent
    files = [p for p in root.rglob("*") if p.suffix in (".c", ".h")]
    assert len(files) > 10
    hits = [f"{p.relative_to(root)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"deepseek|kimi|\bmla\b", line, re.IGNORECASE)]
    assert not hits, hits
