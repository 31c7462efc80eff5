"""Seeded mutation fuzzing of everything quantplug parses itself.

Bases: a sharded dense safetensors checkpoint (with index), a GGUF checkpoint, the same GGUF after
``expert-pack build`` (pack version 1), a DeepSeek-native block-FP8 checkpoint after ``expert-pack
build`` (version 2: experts.qpack named by the safetensors index), the vendor fixtures of amd-quark MXFP4, msmodelslim W8A8, llm-compressor
(compressed-tensors W4A16 experts, FP8 block), auto-round's compressed-tensors NVFP4 / MXFP4,
nvidia-modelopt NVFP4 and MIXED_PRECISION (hf_quant_config.json + config.json, and the
config.json-only form), auto-round's GPTQ, AWQ and AutoRound (GPTQ and AWQ packing) exports, a
DeepSeek-native block-FP8 checkpoint, and two tokenizer directories: tokenizer.json +
tokenizer_config.json + chat_template.jinja, and Kimi's tiktoken.model + tokenizer_config.json
(with a chat template).
Each case copies one base (hard links), replaces one file with a mutated version and runs, by
level, the file's own reader (``read``: for the tokenizer bases, load_tokenizer + encode +
decode + the chat template), ``quantplug.plan`` (``plan``) or plan + load + forward (``forward``).

Oracle, per case: it ends in success or a :class:`~quantplug.errors.QuantplugError` (anything
else, a hang over ``timeout_s`` or a MemoryError is a failure). A QuantplugError whose message
carries raw Python error text (an exception class name, "failed in quantplug_...: ValueError",
"object has no attribute"...) is a failure: every message is quantplug's own words. A JSON
mutation that is accepted while a key the base reads (through ``Fields``) was not read any more
is a failure too ("lenient": the mutated value was skipped, a default silently taken). A forward
that succeeds must give the base's logits bit for bit unless the difference is explained:

* ``data``: the mutated bytes lie inside the data of a tensor the plan uses (safetensors and GGUF
  carry no data checksum; the expert pack does, and its payload mutations must raise: a forward
  of a mutated version-2 pack that loads with different logits is a failure, never explained);
* ``declared``: the mutated header / config declares a different but valid model (the plan's
  fingerprint: parsed config, schemes, every used tensor's dtype / shape / byte range, differs
  from the base's); when only the config differs the logits must still be finite.

Anything else (same fingerprint, untouched data, different logits) is a failure: a silent wrong
load.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import random
import re
import resource
import signal
import struct
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from quantplug.checkpoint.gguf_index import read_gguf_header
from quantplug.checkpoint.safetensors_index import read_header
from quantplug.errors import QuantplugError
from quantplug.loader import execute
from quantplug.plan import build_plan
from quantplug.tokenizer import load_tokenizer
from quantplug.validation import recording_reads

from . import kit

VALUES: list[Any] = [
    None, -1, 0, 1, 2, 3, 7, 255, 2**31, 2**32 + 1, 2**63, -(2**63), 10**30, 0.0, -0.0, 1e-320, 1e308,
    -1.5, 0.5, 1e6, float("nan"), float("inf"), True, False, "", "x", "yarn", "default", "linear", "silu",
    "softmax", "fp4", "int8", "e8m0", "per_group", "W8A8", "FLOAT", "../../x.safetensors", "/etc/passwd",
    "model.safetensors", [], [1, 2], [None], {}, {"a": 1}, {"type": "yarn"}, "a" * 5000,
]
INTERESTING_U64 = [0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 4096, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1]
DTYPES = ["F32", "F16", "BF16", "U8", "I8", "I64", "F8_E4M3", "F8_E8M0", "BOOL", "F64", "Q4_0", "X"]


#: bases whose files only the tokenizer reads: read level only
TOKENIZER_KINDS = ("tok", "tiktoken")
#: bases whose config.json mutations focus on quantization_config (hf_quant_config.json's: on quantization)
QUANT_KINDS = ("quark", "ct", "ct_fp8", "ct_nvfp4", "ct_mxfp4", "fp8", "modelopt", "modelopt_mixed", "modelopt_cfg",
               "gptq", "awq", "autoround_gptq", "autoround_awq")
#: the key a JSON file's quantization settings live under
QUANT_KEYS = {"config.json": "quantization_config", "hf_quant_config.json": "quantization"}


@dataclass
class Base:
    kind: str
    root: Path
    targets: list[str]
    _ref: tuple[torch.Tensor, Any, dict[str, list[tuple[int, int]]]] | None = None
    _reads: dict[str, set[tuple[str, str]]] = field(default_factory=dict)

    def reads(self, level: str) -> set[tuple[str, str]]:
        """(file name, key path) read through Fields by the unmutated base at ``level`` (once)."""
        if level not in self._reads:
            with recording_reads() as seen:
                _operate(level, self.kind, self.root, "")
            self._reads[level] = set(seen)
        return self._reads[level]

    def reference(self) -> tuple[torch.Tensor, Any, dict[str, list[tuple[int, int]]]]:
        """The unmutated base's logits, plan fingerprint and used data ranges (computed once)."""
        if self._ref is None:
            self._ref = _forward(self.root)
        return self._ref


@dataclass
class Report:
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    #: failures by kind: crash, hang, oom, raw-message, lenient, silent-wrong-load
    kinds: Counter[str] = field(default_factory=Counter)
    #: cases that raised the process's peak RSS by more than 32 MB: (MB, case)
    rss_jumps: list[tuple[float, str]] = field(default_factory=list)
    max_case_s: float = 0.0
    slowest: str = ""
    rss_growth_mb: float = 0.0
    seconds: float = 0.0
    level_seconds: Counter[str] = field(default_factory=Counter)
    wrapped: list[str] = field(default_factory=list)
    #: (case label, outcome) of every case, when the fuzzer was asked to keep them (``log=True``)
    log: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        top = ", ".join(f"{k}: {v}" for k, v in sorted(self.outcomes.items()))
        lv = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(self.level_seconds.items()))
        kinds = ", ".join(f"{k} {self.kinds.get(k, 0)}" for k in FAILURE_KINDS)
        return (f"{self.cases} cases in {self.seconds:.1f} s ({lv}); {len(self.failures)} failure(s) ({kinds}); "
                f"slowest case {self.max_case_s:.2f} s ({self.slowest}); peak RSS growth {self.rss_growth_mb:.0f} MB"
                f"\n  {top}")

    def fail(self, kind: str, text: str) -> None:
        self.kinds[kind] += 1
        self.failures.append(f"[{kind}] {text}")


FAILURE_KINDS = ("crash", "hang", "oom", "raw-message", "lenient", "silent-wrong-load")


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def fire(*_: Any) -> None:
        raise CaseTimeout

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _forward(root: Path) -> tuple[torch.Tensor, Any, dict[str, list[tuple[int, int]]]]:
    plan = build_plan(root)
    plan.raise_for_problems()
    fp = fingerprint(plan)
    used: dict[str, list[tuple[int, int]]] = {}
    for pp in plan.params:
        for _, info in pp.sources:
            used.setdefault(info.file.name, []).append((info.offset, info.offset + info.nbytes))
    model = execute(plan, progress=False)
    with torch.no_grad():
        out = model(kit.IDS)
    plan.checkpoint.close()
    return out, fp, used


def fingerprint(plan: Any) -> Any:
    cfg = dataclasses.replace(plan.model_config, raw=None)
    tensors = sorted((i.name, i.dtype, i.shape, i.file.name, i.offset, i.nbytes)
                     for pp in plan.params for _, i in pp.sources)
    pack = getattr(plan.quant_config, "pack", None)
    return (repr(cfg), tuple(sorted(plan.schemes().items())), tuple(tensors), plan.prefix,
            pack.index_sha256 if pack is not None else None)


def make_bases(work: Path) -> list[Base]:
    builders: list[tuple[str, Callable[[Path], Path], list[str]]] = [
        ("dense", kit.dense, ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                              "model-00002-of-00002.safetensors"]),
        ("gguf", kit.gguf, ["config.json", "model.gguf"]),
        ("pack", kit.packed, ["model.gguf", "experts.qpack"]),
        ("pack2", kit.packed_st, ["experts.qpack", "model.safetensors.index.json", "model.safetensors"]),
        ("quark", lambda p: kit.vendor(p, "quark_mxfp4_dsv3"), ["config.json"]),
        ("modelslim", lambda p: kit.vendor(p, "modelslim_w8a8_dsv3"), ["config.json", "quant_model_description.json"]),
        ("ct", lambda p: kit.vendor(p, "ct_w4a16_experts_dsv3"), ["config.json"]),
        ("ct_fp8", lambda p: kit.vendor(p, "ct_fp8_block_dsv3"), ["config.json"]),
        ("ct_nvfp4", lambda p: kit.vendor(p, "ct_nvfp4_autoround_dsv3"), ["config.json"]),
        ("ct_mxfp4", lambda p: kit.vendor(p, "ct_mxfp4_autoround_dsv3"), ["config.json"]),
        ("modelopt", lambda p: kit.vendor(p, "modelopt_nvfp4_dsv3"), ["hf_quant_config.json", "config.json"]),
        ("modelopt_mixed", lambda p: kit.vendor(p, "modelopt_mixed_dsv3"), ["hf_quant_config.json", "config.json"]),
        ("modelopt_cfg", lambda p: kit.vendor(p, "modelopt_nvfp4_dsv3", drop=("hf_quant_config.json",)),
         ["config.json"]),
        ("gptq", lambda p: kit.vendor(p, "gptq_autoround_dsv3"), ["config.json"]),
        ("awq", lambda p: kit.vendor(p, "awq_autoround_dsv3"), ["config.json"]),
        ("autoround_gptq", lambda p: kit.vendor(p, "autoround_gptq_dsv3"), ["config.json"]),
        ("autoround_awq", lambda p: kit.vendor(p, "autoround_awq_dsv3"), ["config.json"]),
        ("fp8", kit.fp8, ["config.json", "model.safetensors"]),
        ("tok", kit.tokenizer_json, ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]),
        ("tiktoken", kit.tiktoken, ["tiktoken.model", "tokenizer_config.json"]),
    ]
    return [Base(kind, build(work / f"base-{kind}"), targets) for kind, build, targets in builders]


# -- mutators ------------------------------------------------------------------------------------

def _paths(node: Any, prefix: tuple = (), out: list | None = None, limit: int = 400) -> list[tuple]:
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((*prefix, k))
            _paths(v, (*prefix, k), out, limit)
    elif isinstance(node, list):
        for i, v in enumerate(node[:20]):
            out.append((*prefix, i))
            _paths(v, (*prefix, i), out, limit)
    return out


def _bytes_op(rng: random.Random, data: bytes, lo: int = 0, hi: int | None = None) -> tuple[bytes, str, int]:
    hi = len(data) if hi is None else hi
    b = bytearray(data)
    op = rng.choice(["flip", "flip", "set", "truncate", "insert", "zero"])
    pos = rng.randrange(lo, max(hi, lo + 1)) if hi > lo else lo
    if op == "truncate":
        return bytes(b[:pos]), f"truncate at {pos}", pos
    if op == "insert":
        return bytes(b[:pos] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 9))) + b[pos:]), f"insert at {pos}", pos
    if pos >= len(b):
        return bytes(b) + b"\0", "append", pos
    if op == "flip":
        b[pos] ^= 1 << rng.randrange(8)
    elif op == "zero":
        b[pos] = 0
    else:
        b[pos] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
    return bytes(b), f"{op} byte {pos}", pos


def key_path(path: tuple) -> str:
    """A JSON path tuple as Fields spells it: ``a.b[3].c``."""
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def mutate_json(rng: random.Random, data: bytes, focus: str | None = None) -> tuple[bytes, str, tuple | None]:
    """A mutated JSON document, what was done, and the path of the value changed (None: text-level)."""
    if rng.random() < 0.15:
        out, what, _ = _bytes_op(rng, data)
        return out, f"json text: {what}", None
    doc = json.loads(data)
    paths = _paths(doc)
    if focus:
        focused = [p for p in paths if p and p[0] == focus]
        paths = focused or paths
    if not paths:
        return b"[]", "json: replaced by []", None
    path = rng.choice(paths)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    op = rng.random()
    if op < 0.6:
        value = rng.choice(VALUES)
        if rng.random() < 0.05:
            value = json.loads("[" * 40 + "]" * 40)
        parent[last] = value
        what = f"set {'.'.join(map(str, path))} = {str(value)[:30]!r}"
    elif op < 0.75 and isinstance(parent, dict):
        del parent[last]
        what = f"delete {'.'.join(map(str, path))}"
    elif op < 0.85:
        parent[last] = [parent[last]] if rng.random() < 0.5 else {"v": parent[last]}
        what = f"wrap {'.'.join(map(str, path))}"
    elif isinstance(parent, dict):
        key = rng.choice(["rope_type", "type", "factor", "weight_map", "quant_method", "x", "dtype", "group_size",
                          "targets", "ignore", "exclude", "weight_block_size", "chat_template", "eos_token"])
        parent[key] = rng.choice(VALUES)
        what = f"add key under {'.'.join(map(str, path[:-1])) or '(root)'}"
        path = (*path[:-1], key)
    else:
        parent.append(rng.choice(VALUES))
        what = f"append to {'.'.join(map(str, path[:-1]))}"
        path = path[:-1]
    return json.dumps(doc, allow_nan=True).encode(), what, path


TEMPLATE_FRAGMENTS = [
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "{% for i in range(10**9) %}{{ i }}{% endfor %}",
    "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}", "{{ 'x' * 10**9 }}",
    "{{ 'a'|center(10**9) }}", "{{ '%0999999999d' % 1 }}", "{{ '{:>999999999}'.format(1) }}", "{% for %}",
    "{{ 1 // 0 }}", "{{ messages[99]['content'] }}", "{{ messages.__class__.__mro__ }}", "{{", "{% if %}",
    "{{ (" * 300 + "1" + ")" * 300 + " }}", "{{ raise_exception('stop') }}", "{{ messages|tojson(indent=99999) }}",
    "{% set ns = namespace(s='x' * 9999) %}{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ undefined_name.attr }}", "{{ bos_token * 99999999 }}", "{{ lipsum(99999) }}", "{% include 'x' %}",
    "{{ cycler }}", "{% for m in messages %}{{ m.content|int }}{% endfor %}", "{{ 10**(10**8) }}",
    "{{ range(99999)|list|join(',') * 1000 }}",
]


def mutate_template(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    text = data.decode()
    if rng.random() < 0.3:
        out, what, _ = _bytes_op(rng, data)
        return out, f"template text: {what}"
    frag = rng.choice(TEMPLATE_FRAGMENTS)
    pos = rng.randrange(len(text) + 1)
    return (text[:pos] + frag + text[pos:]).encode(), f"template: insert {frag[:40]!r} at {pos}"


def mutate_tiktoken(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    lines = data.split(b"\n")
    body = [ln for ln in lines if ln]
    op = rng.choice(["dup-rank", "dup-token", "swap", "delete", "rank", "base64", "bytes", "extra"])
    i, j = rng.randrange(len(body)), rng.randrange(len(body))
    tok_i, rank_i = body[i].split()
    tok_j, rank_j = body[j].split()
    if op == "dup-rank":
        body.append(base64.b64encode(b"zz" + bytes([rng.randrange(256)])) + b" " + rank_i)
    elif op == "dup-token":
        body.append(tok_i + b" " + str(len(body)).encode())
    elif op == "swap":
        body[i], body[j] = tok_i + b" " + rank_j, tok_j + b" " + rank_i
    elif op == "delete":
        del body[i]
    elif op == "rank":
        body[i] = tok_i + b" " + rng.choice([b"-1", b"99999999999999", b"x", b"1.5", b"", str(len(body) + 9).encode()])
    elif op == "base64":
        body[i] = rng.choice([b"!!!", b"a", b"====", b"YQ", b""]) + b" " + rank_i
    elif op == "extra":
        body[i] = body[i] + b" 7"
    else:
        out, what, _ = _bytes_op(rng, data)
        return out, f"tiktoken text: {what}"
    return b"\n".join(body) + b"\n", f"tiktoken: {op} (lines {i}, {j})"


def mutate_safetensors(rng: random.Random, data: bytes, data_only: bool) -> tuple[bytes, str, int]:
    (n,) = struct.unpack_from("<Q", data, 0)
    if data_only:
        out, what, pos = _bytes_op(rng, data, 8 + n, len(data))
        return out, f"data: {what}", pos
    r = rng.random()
    if r < 0.35:
        out, what, _ = _bytes_op(rng, data, 0, 8 + n)
        return out, f"header: {what}", -1
    if r < 0.45:
        v = rng.choice([0, 1, n - 1, n + 1, n + 8, 2**63, len(data), rng.randrange(2**64)])
        return struct.pack("<Q", v) + data[8:], f"header length = {v}", -1
    header = json.loads(data[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    field_ = rng.choice(["dtype", "shape", "data_offsets", "data_offsets", "shape"])
    if field_ == "dtype":
        entry["dtype"] = rng.choice(DTYPES)
    elif field_ == "shape":
        shape = list(entry["shape"])
        if shape and rng.random() < 0.7:
            i = rng.randrange(len(shape))
            shape[i] = rng.choice([0, 1, shape[i] * 2, shape[i] // 2, shape[i] + 1, -1, 2**40])
        else:
            shape = shape + [1] if rng.random() < 0.5 else shape[1:]
        entry["shape"] = shape
    else:
        s, e = entry["data_offsets"]
        other = header[rng.choice(names)]["data_offsets"]
        entry["data_offsets"] = rng.choice([[s + 4, e + 4], [s, e - 4], other, [e, s], [s, 2**62], [-1, e]])
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data[8 + n:], f"header: {name}.{field_} = {entry[field_]}", -1


def _gguf_layout(path: Path) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """data_start, (tensor name, offset of its n_dims field), (metadata key, offset of its type field)."""
    h = read_gguf_header(path)
    data = path.read_bytes()[:h.data_start]
    tensors = []
    for t in h.tensors:
        raw = t.name.encode()
        pos = data.index(struct.pack("<Q", len(raw)) + raw, h.kv_end) + 8 + len(raw)
        tensors.append((t.name, pos))
    keys = []
    for k in h.metadata:
        raw = k.encode()
        keys.append((k, data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)))
    return h.data_start, tensors, keys


def mutate_gguf(rng: random.Random, data: bytes, layout: Any, data_only: bool) -> tuple[bytes, str, int]:
    data_start, tensors, keys = layout
    if data_only:
        out, what, pos = _bytes_op(rng, data, data_start, len(data))
        return out, f"data: {what}", pos
    b = bytearray(data)
    r = rng.random()
    if r < 0.3:
        out, what, _ = _bytes_op(rng, data, 0, data_start)
        return out, f"header: {what}", -1
    if r < 0.4:
        pos = rng.choice([8, 16]) if rng.random() < 0.5 else rng.randrange(0, data_start - 8)
        v = rng.choice(INTERESTING_U64)
        struct.pack_into("<Q", b, pos, v)
        return bytes(b), f"u64 at {pos} = {v}", -1
    if r < 0.75:
        name, pos = rng.choice(tensors)
        (nd,) = struct.unpack_from("<I", b, pos)
        f = rng.choice(["n_dims", "dim", "type", "offset", "offset", "offset"])
        if f == "n_dims":
            struct.pack_into("<I", b, pos, rng.choice([0, 1, 2, 3, 4, 5, 9, 2**31]))
        elif f == "dim" and nd:
            i = rng.randrange(nd)
            (d,) = struct.unpack_from("<Q", b, pos + 4 + 8 * i)
            struct.pack_into("<Q", b, pos + 4 + 8 * i, rng.choice([0, 1, d * 2, d // 2, d + 32, 2**40, 2**63]))
        elif f == "type":
            struct.pack_into("<I", b, pos + 4 + 8 * nd, rng.choice([0, 1, 2, 3, 6, 7, 8, 9, 10, 12, 14, 30, 39, 99]))
        else:
            (off,) = struct.unpack_from("<Q", b, pos + 4 + 8 * nd + 4)
            _, other = rng.choice(tensors)
            (ond,) = struct.unpack_from("<I", b, other)
            (ooff,) = struct.unpack_from("<Q", b, other + 4 + 8 * ond + 4)
            v = rng.choice([ooff, off + 32, off - 32, off + 1, 2**40, ooff + 32])
            struct.pack_into("<Q", b, pos + 4 + 8 * nd + 4, v % 2**64)
        return bytes(b), f"tensor {name}: {f}", -1
    key, pos = rng.choice(keys)
    if rng.random() < 0.5:
        struct.pack_into("<I", b, pos, rng.choice([0, 1, 4, 5, 6, 7, 8, 9, 10, 12, 13, 2**31]))
        return bytes(b), f"metadata {key}: value type", -1
    (vt,) = struct.unpack_from("<I", b, pos)
    width = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}.get(vt, 8)
    for i in range(width):
        b[pos + 4 + i] = rng.choice([0, 0xFF, rng.randrange(256)])
    return bytes(b), f"metadata {key}: value bytes", -1


#: (offset of data_offset, the header's field offsets, the first 8-byte field) per pack version
PACK_HEADERS = {1: (56, [8, 12, 16, 20, 24, 28, 32, 36, 40, 48, 56, 64], 40),
                2: (68, [8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 52, 60, 68, 76], 44)}


def mutate_pack(rng: random.Random, data: bytes, data_only: bool, version: int = 1) -> tuple[bytes, str, int]:
    at, fields, wide = PACK_HEADERS[version]
    (data_offset,) = struct.unpack_from("<Q", data, at)
    if data_only:
        out, what, pos = _bytes_op(rng, data, data_offset, len(data))
        return out, f"payload: {what}", pos
    if rng.random() < 0.5:
        b = bytearray(data)
        pos = rng.choice(fields)
        width = 8 if pos >= wide else 4
        v = rng.choice(INTERESTING_U64) % (2 ** (8 * width))
        b[pos:pos + width] = v.to_bytes(width, "little")
        return bytes(b), f"header field @{pos} = {v}", -1
    out, what, _ = _bytes_op(rng, data, 0, data_offset)
    return out, f"header/index: {what}", -1


# -- runner --------------------------------------------------------------------------------------

LEVELS = ("read", "plan", "forward")
#: raw Python error text in a message: a wrapped plugin crash, an exception class name, Python's own phrasing
RAW = re.compile(
    r"failed in quantplug_\w+: \w+|\b(ValueError|TypeError|KeyError|IndexError|AttributeError|OverflowError|"
    r"RecursionError|ZeroDivisionError|UnicodeDecodeError|UnicodeEncodeError|AssertionError|NameError|"
    r"StopIteration|PanicException|MemoryError|struct\.error)\b|object has no attribute|is not subscriptable|"
    r"not supported between instances|unhashable type|invalid literal for int|cannot convert float|"
    r"object is not iterable|positional argument|NoneType")


def _operate(level: str, kind: str, root: Path, target: str) -> str:
    """The case's work at ``level`` on directory ``root`` (``target``: the file mutated, "" for the base)."""
    if level == "plan":
        p = build_plan(root)
        p.checkpoint.close()
        p.raise_for_problems()
        return "ok"
    if kind in TOKENIZER_KINDS:
        tok = load_tokenizer(root)
        if tok is None:
            raise QuantplugError(f"{root}: no tokenizer")  # the base has one: a mutated file removed it
        ids = tok.encode("Hello, world! 日本 [BOS]<|end|> 1234567")
        tok.decode(ids)
        tok.decode(ids, skip_special_tokens=True)
        if tok.chat_template:
            tok.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
        return "ok"
    path = root / target
    if target.endswith(".safetensors"):
        read_header(path)
    elif target.endswith(".gguf"):
        read_gguf_header(path)
        load_tokenizer(root)  # the vocabulary arrays the header reader skips, decoded in full
    elif target.endswith(".qpack") and kind == "pack2":
        from quantplug.checkpoint.qpack import QPack

        QPack(path)
    elif target.endswith(".qpack"):
        from quantplug_expert_pack.pack import ExpertPack

        ExpertPack(path).tensors()  # the per-expert tensors the checkpoint gets from the index
    return "ok"


def _bypassed(base_reads: set[tuple[str, str]], seen: set[tuple[str, str]], file: str, path: tuple) -> str | None:
    """The deepest key on ``path`` (or above it) the base read but the mutated run did not: a value
    skipped rather than validated; None when every such key was read again."""
    for n in range(len(path), 0, -1):
        key = (file, key_path(path[:n]))
        if key in base_reads:
            return None if key in seen else key[1]
    return None


class Fuzzer:
    def __init__(self, work: Path, seed: int, timeout_s: float = 20.0, log: bool = False,
                 forward_kinds: tuple[str, ...] = ("dense", "gguf", "pack", "pack2", "quark", "modelslim", "modelopt", "gptq",
                                                   "awq", "autoround_gptq")) -> None:
        self.work, self.rng, self.timeout_s, self.keep_log = work, random.Random(seed), timeout_s, log
        self.forward_kinds = forward_kinds
        self.bases = make_bases(work)
        self.layouts = {b.kind: _gguf_layout(b.root / "model.gguf") for b in self.bases if b.kind in ("gguf", "pack")}
        self.originals = {(b.kind, t): (b.root / t).read_bytes() for b in self.bases for t in b.targets}
        # one working copy per base (hard links); a case swaps in its mutated file, then the link back
        self.copies = {b.kind: kit.clone(b.root, work / f"case-{b.kind}") for b in self.bases}
        self.n = 0

    def case(self, level: str) -> tuple[Base, str, bytes, str, int, tuple | None]:
        rng = self.rng
        base = rng.choice([b for b in self.bases if b.kind not in TOKENIZER_KINDS])
        if level == "read":
            base = rng.choice([b for b in self.bases if b.kind in ("dense", "gguf", "pack", "pack2", *TOKENIZER_KINDS)])
            targets = base.targets if base.kind in TOKENIZER_KINDS else [t for t in base.targets
                                                                         if not t.endswith(".json")]
            target = rng.choice(targets)
        elif level == "forward":
            base = rng.choice([b for b in self.bases if b.kind in self.forward_kinds])
            target = rng.choice(base.targets)
        else:
            target = rng.choice(base.targets)
        data = self.originals[(base.kind, target)]
        data_only = level == "forward" and rng.random() < 0.3
        pos, path = -1, None
        if target.endswith(".json"):
            focus = QUANT_KEYS.get(target) if base.kind in QUANT_KINDS and rng.random() < 0.7 else None
            out, what, path = mutate_json(rng, data, focus)
        elif target.endswith(".safetensors"):
            out, what, pos = mutate_safetensors(rng, data, data_only)
        elif target.endswith(".gguf"):
            out, what, pos = mutate_gguf(rng, data, self.layouts[base.kind], data_only)
        elif target.endswith(".jinja"):
            out, what = mutate_template(rng, data)
        elif target == "tiktoken.model":
            out, what = mutate_tiktoken(rng, data)
        else:
            out, what, pos = mutate_pack(rng, data, data_only, 2 if base.kind == "pack2" else 1)
        return base, target, out, what, pos, path

    def run(self, counts: dict[str, int]) -> Report:
        rep = Report()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t_start = time.perf_counter()
        plan_ = [lvl for lvl in LEVELS for _ in range(counts.get(lvl, 0))]
        self.rng.shuffle(plan_)
        for level in plan_:
            self.one(level, rep)
        rep.seconds = time.perf_counter() - t_start
        rep.rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        return rep

    def one(self, level: str, rep: Report) -> None:
        base, target, data, what, pos, path = self.case(level)
        if level == "forward":
            base.reference()  # the base's own logits, once, outside the case's clock
        # a changed value the base read must be read (validated) again; deleting a key is "absent"
        lenient_check = path is not None and level != "forward" and not what.startswith("delete")
        if lenient_check:
            base.reads(level)  # the base's own reads, once, outside the case's clock
        self.n += 1
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        root = self.copies[base.kind]
        (root / target).unlink()
        (root / target).write_bytes(data)
        label = f"#{self.n} {level} {base.kind}/{target}: {what[:150]}"
        t0 = time.perf_counter()
        seen: set[tuple[str, str]] = set()
        try:
            with _deadline(self.timeout_s), recording_reads() as seen:
                outcome = self._execute(level, base, root, target, pos)
        except CaseTimeout:
            outcome = "FAIL"
            rep.fail("hang", f"{label}: no result within {self.timeout_s} s")
        except QuantplugError as exc:
            outcome = "error"
            raw = RAW.search(str(exc))
            if raw:  # a message carrying raw Python error text: not quantplug's own words
                outcome = "FAIL"
                rep.fail("raw-message", f"{label}: {type(exc).__name__}: {str(exc)[:240]} (raw: {raw.group(0)!r})")
                rep.wrapped.append(f"{label}: {str(exc)[:200]}")
        except MemoryError:
            outcome = "FAIL"
            rep.fail("oom", f"{label}: MemoryError")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 (the point: anything but QuantplugError is a finding; a
            outcome = "FAIL"          # Rust library's panic is a BaseException)
            tb = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
            rep.fail("crash", f"{label}: {type(exc).__name__}: {exc} | {''.join(tb).strip()[-400:]}")
        if isinstance(outcome, tuple):
            outcome, problem = outcome
            rep.fail("silent-wrong-load", f"{label}: {problem}")
        if lenient_check and outcome in ("ok", "same", "explained-data", "explained-declared"):
            bypassed = _bypassed(base.reads(level), seen, target, path)
            if bypassed:
                outcome = "FAIL"
                rep.fail("lenient", f"{label}: accepted, but {target}: {bypassed} (read by the base) was not read: "
                                    "the mutated value was skipped unvalidated")
        dt = time.perf_counter() - t0
        jump = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
        if jump > 32:
            rep.rss_jumps.append((round(jump, 1), label))
        rep.level_seconds[level] += dt
        if dt > rep.max_case_s:
            rep.max_case_s, rep.slowest = dt, label
        rep.cases += 1
        rep.outcomes[f"{level}:{outcome}"] += 1
        if self.keep_log:
            rep.log.append((label, outcome))
        (root / target).unlink()
        os.link(base.root / target, root / target)

    def _execute(self, level: str, base: Base, root: Path, target: str, pos: int) -> Any:
        if level in ("read", "plan"):
            return _operate(level, base.kind, root, target)
        ref_logits, ref_fp, _ = base.reference()
        out, fp, used = _forward(root)
        if torch.equal(out, ref_logits) or (out.shape == ref_logits.shape
                                            and torch.equal(out.isnan(), ref_logits.isnan())
                                            and torch.equal(out.nan_to_num(), ref_logits.nan_to_num())):
            return "same"
        if pos >= 0 and fp == ref_fp and any(lo <= pos < hi for lo, hi in used.get(target, [])):
            if base.kind == "pack2" and target == "experts.qpack":  # every payload carries its sha256
                return "FAIL", "a changed pack payload loaded without a checksum error"
            return "explained-data"
        if fp != ref_fp:
            only_config = fp[1:] == ref_fp[1:]
            if only_config and not bool(out.isfinite().all()):
                return "FAIL", "a config the validator accepted gives non-finite logits"
            return "explained-declared"
        return "FAIL", "loaded without error but the logits differ (same plan, untouched tensor data)"
