"""Mutators: (run seed, case index) -> one mutated checkpoint directory, deterministically.

A case copies its seed directory (hard links: every mutator replaces the file it edits, never
writes through a link) and applies one mutator, or two for 1 case in 8. Each mutator returns what
it did and what the change *means* for the oracle:

* ``data``: the change may legitimately alter the model (a tensor's bytes, a hyperparameter of
  the right type, two same-shaped tensors swapped): a load with other logits is fine;
* ``struct``: the checkpoint is now inconsistent or malformed: it must be refused, or load
  exactly the base model (the change touched nothing the model uses);
* ``lenient``: a value of the wrong type or out of range: it must be refused; a load is reported
  as ``lenient`` (the value was ignored, replaced by a default, or used as is) unless the key is
  one quantplug documents as not read (``UNREAD_KEYS``);
* ``escape``: a file resolving outside the checkpoint: any load is a failure;
* ``none``: nothing the model reads (a tokenizer, a chat template): only errors are judged.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import formats as F

RANK = {"none": 0, "data": 1, "struct": 2, "lenient": 3, "escape": 4}


@dataclass
class Mutation:
    mutator: str
    file: str
    detail: str
    meaning: str
    key: str = ""


@dataclass
class Ctx:
    rng: random.Random
    root: Path        # the case directory
    outside: Path     # a directory next to the case, outside it: symlink targets
    seed_name: str
    done: list[Mutation] = field(default_factory=list)

    def files(self, pred: Callable[[str], bool] = lambda n: True) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if (p.is_file() or p.is_symlink()) and pred(p.name))

    def read(self, name: str) -> bytes:
        p = self.root / name
        if not p.is_file():  # a FIFO or /dev/zero an earlier mutation put there: never read it
            raise ValueError(f"{name} is not a regular file")
        return p.read_bytes()

    def write(self, name: str, data: bytes | str) -> None:
        p = self.root / name
        if p.is_symlink() or p.exists():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogatepass")
        p.write_bytes(data)

    def pick(self, seq: Any) -> Any:
        seq = list(seq)
        return seq[self.rng.randrange(len(seq))]


def _is_st(n: str) -> bool:
    return n.endswith(".safetensors")


def _is_json(n: str) -> bool:
    return n.endswith(".json")


# -- blind byte mutations --------------------------------------------------------------------------

def _regions(ctx: Ctx, name: str, blob: bytes) -> Callable[[int, int], str]:
    """meaning of overwriting bytes [a, b) of ``name`` (same length)"""
    if _is_st(name):
        st = F.parse_safetensors(blob)
        hend = 8 + st.header_len if st else len(blob)
        return lambda a, b: "struct" if a < hend else "data"
    if name.endswith(".gguf"):
        g = F.parse_gguf(blob)
        if g is None:
            return lambda a, b: "struct"
        kv_end = g.kvs[-1].span[1] if g.kvs else 24
        # metadata values are hyperparameters and tensor data is data; counts, lengths, types, the
        # tensor infos and the padding before the data are structure
        lens = {kv.len_at for kv in g.kvs} | {kv.type_at for kv in g.kvs} | {
            v for kv in g.kvs for v in kv.extra.values()}

        def meaning(a: int, b: int) -> str:
            if g.header_end <= a and b <= g.data_start:
                return "data"  # alignment padding: no reader looks at its bytes
            if b <= 24 or (kv_end <= a < g.data_start) or (a < g.data_start and b > kv_end):
                return "struct"
            if a >= g.data_start:
                return "data"
            return "struct" if any(a < x + 8 and x < b for x in lens) else "data"
        return meaning
    if name == "experts.qpack":
        return lambda a, b: "struct"
    if name in ("tokenizer.json", "tiktoken.model", "chat_template.jinja", "tokenizer_config.json"):
        return lambda a, b: "none"
    return lambda a, b: "data"  # a JSON file edited bytewise may hold another valid value


def _structural_offsets(name: str, blob: bytes) -> list[int]:
    out = [0, 1, 4, 7, 8, 9, len(blob) // 2, len(blob) - 1]
    st = F.parse_safetensors(blob) if _is_st(name) else None
    if st:
        out += [8 + st.header_len - 1, 8 + st.header_len, 8 + st.header_len + 1]
        base = 8 + st.header_len
        for k in st.tensors[:50]:
            off = st.header[k].get("data_offsets") if isinstance(st.header[k], dict) else None
            if isinstance(off, list) and len(off) == 2 and all(isinstance(x, int) for x in off):
                out += [base + off[0], base + off[1] - 1]
    g = F.parse_gguf(blob) if name.endswith(".gguf") else None
    if g:
        out += [16, 24, g.header_end, g.data_start, g.data_start + 1]
        out += [kv.span[0] for kv in g.kvs] + [t.span[0] for t in g.infos]
        out += [g.data_start + t.offset for t in g.infos]
    q = F.parse_qpack(blob) if name == "experts.qpack" else None
    if q:
        h = q.header
        out += [h["index_offset"], h["names_offset"], h["data_offset"]] + [e["offset"] for e in q.entries]
    return sorted({o for o in out if 0 <= o < len(blob)})


def m_bytes(ctx: Ctx) -> Mutation | None:
    files = ctx.files(lambda n: (ctx.root / n).is_file() and (ctx.root / n).stat().st_size > 0)
    if not files:
        return None
    # weight files first: that is where the interesting structure is
    heavy = [n for n in files if n.endswith((".safetensors", ".gguf", ".qpack"))]
    name = ctx.pick(heavy if heavy and ctx.rng.random() < 0.7 else files)
    blob = bytearray(ctx.read(name))
    n = len(blob)
    meaning_of = _regions(ctx, name, bytes(blob))
    r = ctx.rng
    # a bias towards the header: most parsing happens there
    hot = min(n, 4096) if r.random() < 0.6 else n
    kind = ctx.pick(["bitflip", "random_run", "const_run", "truncate", "delete", "duplicate", "insert", "append"])
    if kind == "bitflip":
        k = r.choice([1, 1, 2, 4, 8])
        spots = [r.randrange(hot) for _ in range(k)]
        for s in spots:
            blob[s] ^= 1 << r.randrange(8)
        meaning = max((meaning_of(s, s + 1) for s in spots), key=RANK.__getitem__)
        detail = f"bitflip at {spots}"
    elif kind in ("random_run", "const_run"):
        length = min(n, r.choice([1, 2, 4, 8, 16, 64, 512]))
        at = r.randrange(max(1, hot - length + 1))
        fill = bytes(r.randrange(256) for _ in range(length)) if kind == "random_run" else \
            bytes([r.choice([0, 0xFF])]) * length
        blob[at:at + length] = fill
        meaning = meaning_of(at, at + length)
        detail = f"{kind} {length} bytes at {at}: {fill[:8].hex()}"
    elif kind == "truncate":
        cut = ctx.pick(_structural_offsets(name, bytes(blob))) if r.random() < 0.6 else r.randrange(n)
        del blob[cut:]
        meaning = "struct" if meaning_of(0, 1) != "none" else "none"
        if _is_json(name) and meaning != "none":
            meaning = "data"
        detail = f"truncate at {cut} of {n}"
    else:
        at = ctx.pick(_structural_offsets(name, bytes(blob))) if r.random() < 0.5 else r.randrange(hot)
        length = r.choice([1, 3, 8, 32, 100, 4096])
        if kind == "delete":
            del blob[at:at + length]
        elif kind == "duplicate":
            blob[at:at] = blob[at:at + length]
        elif kind == "insert":
            blob[at:at] = bytes(r.randrange(256) for _ in range(length))
        else:
            at = n
            blob += r.choice([b"\0" * length, b"\xff" * length, bytes(r.randrange(256) for _ in range(length)),
                              b"{}", b"\n"])
        meaning = "struct" if meaning_of(0, 1) != "none" else "none"
        if _is_json(name) and kind != "append" and meaning != "none":
            meaning = "data"  # a JSON file with bytes cut or added may hold other valid values
        detail = f"{kind} {length} bytes at {at} of {n}"
    ctx.write(name, bytes(blob))
    return Mutation(f"bytes.{kind}", name, detail, meaning)


# -- safetensors header -------------------------------------------------------------------------------

_ODD_DTYPES = ["f32", "F32 ", "", "FLOAT", "I4", "F4", "U16", "U32", "U64", "C64", "F8_E4M3FN", 5, None, ["F32"],
               {"dtype": "F32"}]
_HUGE = [2 ** 31, 2 ** 32, 2 ** 53 + 1, 2 ** 63, 2 ** 64, 2 ** 64 + 5, 10 ** 30]


def _st_pick(ctx: Ctx) -> tuple[str, F.Safetensors] | None:
    files = ctx.files(_is_st)
    ctx.rng.shuffle(files)
    for name in files:
        st = F.parse_safetensors(ctx.read(name))
        if st and st.tensors:
            return name, st
    return None


def _st_entry(ctx: Ctx, st: F.Safetensors) -> tuple[str, dict[str, Any]]:
    names = [k for k in st.tensors if isinstance(st.header[k], dict)]
    k = ctx.pick(names)
    return k, st.header[k]


def m_st_header(ctx: Ctx) -> Mutation | None:
    got = _st_pick(ctx)
    if got is None:
        return None
    name, st = got
    r = ctx.rng
    k, e = _st_entry(ctx, st)
    shape, dtype, off = list(e.get("shape", [])), e.get("dtype"), list(e.get("data_offsets", [0, 0]))
    kind = ctx.pick(["dtype", "shape", "offsets", "swap", "dup_name", "remove", "add", "rename", "wrong_type",
                     "metadata", "length", "encoding", "order"])
    meaning, detail, text, keep_len = "struct", "", None, False
    if kind == "dtype":
        new = ctx.pick(list(F.ST_ITEMSIZE) + _ODD_DTYPES)
        e["dtype"] = new
        if isinstance(new, str) and new in F.ST_ITEMSIZE and dtype in F.PLAIN_FLOATS and new in F.PLAIN_FLOATS \
                and F.ST_ITEMSIZE[new] == F.ST_ITEMSIZE[dtype]:
            meaning = "data"   # F16 <-> BF16: another float model, bytes reread
        if r.random() < 0.4 and isinstance(new, str) and new in F.ST_ITEMSIZE and dtype in F.ST_ITEMSIZE:
            # keep the byte range consistent: rescale the last dimension
            num, den = F.ST_ITEMSIZE[dtype], F.ST_ITEMSIZE[new]
            if shape and (shape[-1] * num) % den == 0:
                shape[-1] = shape[-1] * num // den
                e["shape"] = shape
        detail = f"{k}: dtype {dtype!r} -> {new!r}, shape {e.get('shape')}"
    elif kind == "shape":
        v = ctx.pick(["swap", "reshape", "lead1", "drop", "zero", "neg", "huge", "float", "str", "nested", "null",
                      "scalar", "plus1"])
        new_shape: Any = list(shape)
        if v == "swap" and len(shape) >= 2:
            new_shape = [shape[1], shape[0], *shape[2:]]
            meaning = "struct" if shape[0] != shape[1] else "data"
        elif v == "reshape" and len(shape) >= 2 and shape[0] % 2 == 0:
            new_shape = [shape[0] // 2, shape[1] * 2, *shape[2:]]
        elif v == "lead1":
            new_shape = [1, *shape]
        elif v == "drop" and shape:
            new_shape = shape[1:]
        elif v == "zero" and shape:
            new_shape[r.randrange(len(shape))] = 0
        elif v == "neg" and shape:
            new_shape[r.randrange(len(shape))] = -shape[0]
        elif v == "huge" and shape:
            new_shape[r.randrange(len(shape))] = ctx.pick(_HUGE)
        elif v == "float" and shape:
            new_shape[0] = float(shape[0])
        elif v == "str" and shape:
            new_shape[0] = str(shape[0])
        elif v == "nested":
            new_shape = [shape]
        elif v == "null":
            new_shape = None
        elif v == "scalar":
            new_shape = []
        elif shape:
            new_shape[-1] += 1
        e["shape"] = new_shape
        detail = f"{k}: shape {shape} -> {new_shape} ({v})"
    elif kind == "offsets":
        size = off[1] - off[0] if len(off) == 2 else 0
        v = ctx.pick(["shift", "end+1", "end-1", "inverted", "past_end", "huge", "neg", "float", "str", "three",
                      "overlap", "empty"])
        new: Any = list(off)
        if v == "shift":
            d = r.choice([1, 2, 8, size or 4, -(size or 4)])
            new = [off[0] + d, off[1] + d]
        elif v == "end+1":
            new = [off[0], off[1] + 1]
        elif v == "end-1":
            new = [off[0], off[1] - 1]
        elif v == "inverted":
            new = [off[1], off[0]]
        elif v == "past_end":
            new = [len(st.data) - size // 2, len(st.data) - size // 2 + size]
        elif v == "huge":
            h = ctx.pick(_HUGE)
            new = [h, h + size]
        elif v == "neg":
            new = [-size, 0]
        elif v == "float":
            new = [float(off[0]), float(off[1])]
        elif v == "str":
            new = [str(off[0]), str(off[1])]
        elif v == "three":
            new = [off[0], off[1], off[1]]
        elif v == "overlap":
            new = [0, size]
            meaning = "struct"
        else:
            new = [off[0], off[0]]
        e["data_offsets"] = new
        detail = f"{k}: data_offsets {off} -> {new} ({v})"
    elif kind == "swap":
        same = [j for j in st.tensors if j != k and isinstance(st.header[j], dict)
                and st.header[j].get("data_offsets", [0, 0])[1] - st.header[j].get("data_offsets", [0, 0])[0]
                == off[1] - off[0]]
        if not same:
            return None
        j = ctx.pick(same)
        o = st.header[j]
        consistent = o.get("dtype") == dtype and o.get("shape") == shape
        e["data_offsets"], o["data_offsets"] = o["data_offsets"], e["data_offsets"]
        # still a valid file (ranges tile the data): each tensor now holds other bytes, which no
        # reader can tell from a publisher's own values (safetensors has no checksum)
        meaning = "data"
        detail = f"swap data_offsets of {k} and {j} ({'same' if consistent else 'different'} dtype/shape)"
    elif kind == "dup_name":
        # raw JSON: the same tensor name twice, the second entry pointing at another tensor's bytes
        other = st.header[ctx.pick([j for j in st.tensors if j != k] or [k])]
        body = json.dumps(st.header, separators=(",", ":"))
        text = body[:-1] + "," + json.dumps(k) + ":" + json.dumps(other, separators=(",", ":")) + "}"
        detail = f"{k} named twice (second entry {other})"
    elif kind == "remove":
        del st.header[k]
        detail = f"entry {k} removed"
    elif kind == "add":
        extra = ctx.pick(["model.layers.0.mlp.unknown.weight", k + "_extra", "lm_head.bias",
                          "model.layers.99.self_attn.o_proj.weight", "__metadata__x", ""])
        st.header[extra] = {"dtype": dtype, "shape": shape, "data_offsets": off}
        detail = f"extra entry {extra!r} aliasing {k}'s bytes"
    elif kind == "rename":
        new_name = ctx.pick([k.upper(), k + " ", k.replace(".", "..", 1), k.replace("weight", "wieght"),
                             "../" + k, k + "\u0000", ctx.pick(st.tensors)])
        st.header = {(new_name if j == k else j): v for j, v in st.header.items()}
        detail = f"{k} renamed {new_name!r}"
    elif kind == "wrong_type":
        v = ctx.pick(["entry_list", "entry_str", "entry_null", "entry_int", "header_list", "offsets_dict",
                      "missing_dtype", "missing_shape", "missing_offsets", "extra_field"])
        if v == "entry_list":
            st.header[k] = [dtype, shape, off]
        elif v == "entry_str":
            st.header[k] = "F32"
        elif v == "entry_null":
            st.header[k] = None
        elif v == "entry_int":
            st.header[k] = 0
        elif v == "header_list":
            text = json.dumps(list(st.header.items()))
        elif v == "offsets_dict":
            e["data_offsets"] = {"start": off[0], "end": off[1]}
        elif v.startswith("missing"):
            e.pop({"missing_dtype": "dtype", "missing_shape": "shape", "missing_offsets": "data_offsets"}[v], None)
        else:
            e["quant"] = {"scale": 2.0}
        detail = f"{k}: {v}"
    elif kind == "metadata":
        v = ctx.pick(["list", "deep", "nonstr", "huge_str", "format_tf", "null", "nested_dict", "int_key"])
        md: Any = {"format": "pt"}
        if v == "list":
            md = ["format", "pt"]
        elif v == "deep":
            md = {"x": "[" * 5000 + "]" * 5000}
            text = json.dumps(st.header, separators=(",", ":"))[:-1] + ',"__metadata__":{"d":' + \
                "[" * r.choice([40, 1000, 100000]) + "]" * 0 + "}}"
        elif v == "nonstr":
            md = {"format": "pt", "total": 12345, "ok": True, "n": None}
        elif v == "huge_str":
            md = {"format": "pt", "blob": "x" * r.choice([1 << 10, 1 << 20])}
        elif v == "format_tf":
            md = {"format": "tf"}
        elif v == "null":
            md = None
        elif v == "nested_dict":
            md = {"format": {"pt": True}}
        else:
            md = {"format": "pt"}
            text = json.dumps(st.header, separators=(",", ":"))[:-1] + ',"__metadata__":{1:2}}'
        if text is None:
            st.header["__metadata__"] = md
        detail = f"__metadata__ {v}"
    elif kind == "length":
        v = ctx.pick(["keep_len", "zero", "small", "minus1", "plus1", "file", "huge", "max"])
        body = json.dumps(st.header, separators=(",", ":"))
        raw = body.encode() + b" " * (-len(body) % 8)
        lens = {"zero": 0, "small": 7, "minus1": len(raw) - 1, "plus1": len(raw) + 1,
                "file": len(raw) + len(st.data), "huge": 1 << 40, "max": (1 << 64) - 1}
        if v == "keep_len":
            st.header.setdefault("__metadata__", {"format": "pt"})
            st.header["__metadata__"] = {**(st.header["__metadata__"] or {}), "pad": "x" * r.choice([1, 9, 100])}
            keep_len = True
        else:
            ctx.write(name, struct.pack("<Q", lens[v]) + raw + st.data)
            return Mutation("st.length", name, f"header length {v} ({lens[v]}, header {len(raw)})", "struct")
        detail = f"header re-emitted, length left {st.header_len}"
    elif kind == "encoding":
        body = json.dumps(st.header, separators=(",", ":"))
        v = ctx.pick(["bom", "latin1", "nul_pad", "lone_surrogate", "utf16", "trailing"])
        if v == "bom":
            text = "\ufeff" + body
        elif v == "latin1":
            raw = body.encode()
            i = raw.find(b'"', 2)
            ctx.write(name, struct.pack("<Q", len(raw) + 1) + raw[:i + 1] + b"\xe9" + raw[i + 1:] + st.data)
            return Mutation("st.encoding", name, "a Latin-1 byte in a name", "struct")
        elif v == "nul_pad":
            raw = body.encode() + b"\0" * 8
            ctx.write(name, struct.pack("<Q", len(raw)) + raw + st.data)
            return Mutation("st.encoding", name, "NUL padding after the JSON", "struct")
        elif v == "lone_surrogate":
            text = body[:-1] + ',"\\ud800x":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'
        elif v == "utf16":
            raw = body.encode("utf-16")
            ctx.write(name, struct.pack("<Q", len(raw)) + raw + st.data)
            return Mutation("st.encoding", name, "UTF-16 header", "struct")
        else:
            text = body + ' {"x":1}'
        detail = f"header encoding {v}"
    else:  # order: entries in another order, data untouched (fine: offsets are explicit)
        items = list(st.header.items())
        r.shuffle(items)
        st.header = dict(items)
        meaning = "struct"
        detail = "entries reordered"
    ctx.write(name, st.emit(text, keep_len=keep_len))
    return Mutation(f"st.{kind}", name, detail, meaning)


# -- GGUF ------------------------------------------------------------------------------------------------

def _gguf_pick(ctx: Ctx) -> tuple[str, F.GGUF] | None:
    for name in ctx.files(lambda n: n.endswith(".gguf")):
        g = F.parse_gguf(ctx.read(name))
        if g:
            return name, g
    return None


def _patch(blob: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(blob)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def _extreme(ctx: Ctx, t: int, v: Any) -> tuple[Any, bool]:
    """(a new value of GGUF type ``t``, whether it is out of any sensible range)"""
    r = ctx.rng
    if t in (6, 12):
        x = ctx.pick([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e38, v * 2, v + 0.5, -v])
        extreme = not math.isfinite(x) or x <= 0 or abs(x) > 1e30 if v > 0 else not math.isfinite(x)
        return x, extreme
    if t == 7:
        return (not v), False
    if t in F.GGUF_SCALAR:
        bits = struct.calcsize(F.GGUF_SCALAR[t]) * 8
        signed = F.GGUF_SCALAR[t][1].islower()
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        x = ctx.pick([0, hi, lo, v + 1, v * 2, max(lo, v - 1), r.randrange(lo, hi)])
        x = min(hi, max(lo, x))
        return x, (x in (hi, lo) and x != 0) or x > 1 << 20  # 0 is a valid id / count for many keys
    if t == F.STRING:
        return ctx.pick(["", "x" * 1000, "deepseek3", "llama", str(v)[::-1], "\u202e" + str(v), "a\0b"]), False
    return v, False


#: GGUF metadata the model side reads (config.json holds the hyperparameters; these are checked
#: against it or structure the file); other keys are informational
_GGUF_READ = ("general.architecture", "general.alignment", "quantplug.", "tokenizer.ggml.", "tokenizer.chat_template",
              "deepseek2.block_count", "deepseek2.head_count", "deepseek2.expert_count", "deepseek2.expert_used_count",
              "deepseek2.leading_dense_block_count", "deepseek2.embedding_length")


def _gguf_read(key: str) -> bool:
    return key.startswith(_GGUF_READ) and key not in (
        "deepseek2.head_count_kv", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")


def m_gguf(ctx: Ctx) -> Mutation | None:
    got = _gguf_pick(ctx)
    if got is None:
        return None
    name, g = got
    r = ctx.rng
    blob = g.blob
    kv_blobs = [blob[kv.span[0]:kv.span[1]] for kv in g.kvs]
    info_blobs = [blob[t.span[0]:t.span[1]] for t in g.infos]
    kind = ctx.pick(["count", "version", "strlen", "kvtype", "arrlen", "kvvalue", "kvwrongtype", "kvdup", "kvdelete",
                     "ttype", "tdims", "toffset", "tname", "alignment", "norepad", "tdup"])
    meaning, key = "struct", ""
    out: bytes
    if kind == "count":
        which = ctx.pick(["tensors", "kv"])
        cur = len(g.infos) if which == "tensors" else len(g.kvs)
        v = ctx.pick([0, cur - 1, cur + 1, 1 << 32, 1 << 63, (1 << 64) - 1, 65537, 1 << 20])
        out = _patch(blob, 8 if which == "tensors" else 16, "<Q", max(0, v))
        detail = f"n_{which} {cur} -> {v}"
    elif kind == "version":
        v = ctx.pick([0, 1, 2, 4, 0xFFFFFFFF, 3 << 16])
        out = _patch(blob, 4, "<I", v)
        detail = f"version -> {v}"
    elif kind == "strlen":
        item = ctx.pick(g.kvs + g.infos)
        at = item.len_at
        if isinstance(item, F.KV) and "str_len_at" in item.extra and r.random() < 0.5:
            at = item.extra["str_len_at"]
        (cur,) = struct.unpack_from("<Q", blob, at)
        v = ctx.pick([0, cur + 1, max(0, cur - 1), 1 << 40, (1 << 64) - 1, len(blob)])
        out = _patch(blob, at, "<Q", v)
        detail = f"string length at {at} ({getattr(item, 'key', getattr(item, 'name', ''))}) {cur} -> {v}"
    elif kind == "kvtype":
        kv = ctx.pick(g.kvs)
        v = ctx.pick([*range(13), 13, 255, 1 << 31])
        out = _patch(blob, kv.type_at, "<I", v)
        detail, key = f"{kv.key}: value type {kv.vtype} -> {v}", kv.key
    elif kind == "arrlen":
        arrs = [kv for kv in g.kvs if kv.vtype == F.ARRAY]
        if not arrs:
            return None
        kv = ctx.pick(arrs)
        if r.random() < 0.5:
            n = len(kv.value[1])
            v = ctx.pick([0, n + 1, max(0, n - 1), 1 << 32, 1 << 62, (1 << 64) - 1])
            out = _patch(blob, kv.extra["arr_len_at"], "<Q", v)
            detail = f"{kv.key}: array length {n} -> {v}"
        else:
            v = ctx.pick([*range(13), 9, 99])
            out = _patch(blob, kv.extra["arr_type_at"], "<I", v)
            detail = f"{kv.key}: array element type {kv.value[0]} -> {v}"
        key = kv.key
    elif kind in ("kvvalue", "kvwrongtype"):
        kvs = [kv for kv in g.kvs if kv.vtype != F.ARRAY]
        kv = ctx.pick(kvs)
        i = g.kvs.index(kv)
        key = kv.key
        if kind == "kvvalue":
            v, extreme = _extreme(ctx, kv.vtype, kv.value)
            kv_blobs[i] = F.gguf_kv_bytes(kv.key, kv.vtype, v)
            meaning = "lenient" if extreme and v != kv.value else "data"
            if kv.key == "general.alignment" or kv.key.startswith("quantplug."):
                meaning = "struct"
            detail = f"{kv.key}: {kv.value!r:.40} -> {v!r:.40}"
        else:
            t = ctx.pick([t for t in (4, 5, 6, 7, 8, 10, 11, 12, 0) if t != kv.vtype])
            v = kv.value
            if t == F.STRING:
                v = str(v)
            elif t in (6, 12):
                v = float(v) if isinstance(v, int | float) else 1.0
            elif t == 7:
                v = bool(v)
            else:
                v = int(v) if isinstance(v, int | float) and not isinstance(v, float) or isinstance(v, bool) else 1
                bits = struct.calcsize(F.GGUF_SCALAR[t]) * 8
                v = max(0, min(v, (1 << (bits - 1)) - 1))
            kv_blobs[i] = F.gguf_kv_bytes(kv.key, t, v)
            ints, floats = {0, 1, 2, 3, 4, 5, 10, 11}, {6, 12}
            same_kind = (kv.vtype in ints and t in ints) or (kv.vtype in floats and t in floats | ints)
            meaning = "data" if same_kind or not _gguf_read(kv.key) else "lenient"
            detail = f"{kv.key}: type {kv.vtype} -> {t} (value {v!r:.40})"
        out = F.emit_gguf(g, kv_blobs, info_blobs)
        if meaning == "lenient" and not _gguf_read(kv.key):
            meaning = "data"
    elif kind == "kvdup":
        kv = ctx.pick(g.kvs)
        i = g.kvs.index(kv)
        dup = kv_blobs[i]
        if kv.vtype in F.GGUF_SCALAR or kv.vtype == F.STRING:
            dup = F.gguf_kv_bytes(kv.key, kv.vtype, _extreme(ctx, kv.vtype, kv.value)[0])
        kv_blobs.insert(r.randrange(len(kv_blobs) + 1), dup)
        out = F.emit_gguf(g, kv_blobs, info_blobs)
        detail, key = f"{kv.key} twice", kv.key
    elif kind == "kvdelete":
        kv = ctx.pick(g.kvs)
        del kv_blobs[g.kvs.index(kv)]
        out = F.emit_gguf(g, kv_blobs, info_blobs)
        meaning = "struct" if kv.key == "general.alignment" or kv.key.startswith("quantplug.") else "data"
        detail, key = f"{kv.key} deleted", kv.key
    elif kind in ("ttype", "tdims", "toffset", "tname", "tdup"):
        t = ctx.pick(g.infos)
        i = g.infos.index(t)
        name_, dims, tt, off = t.name, list(t.dims), t.ttype, t.offset
        if kind == "ttype":
            tt = ctx.pick([*F.GGML_BLOCK, 4, 5, 31, 39, 40, 1000, 0xFFFFFFFF])
            if r.random() < 0.3 and tt in F.GGML_BLOCK and t.ttype in F.GGML_BLOCK:
                # keep the byte size if the row length allows it
                be, bb = F.GGML_BLOCK[t.ttype]
                ne, nb = F.GGML_BLOCK[tt]
                row = dims[0] // be * bb
                if row % nb == 0:
                    dims[0] = row // nb * ne
            detail = f"{t.name}: type {t.ttype} -> {tt}, dims {t.dims} -> {dims}"
            old_b, new_b = F.GGML_BLOCK.get(t.ttype), F.GGML_BLOCK.get(tt)
            if dims == t.dims and old_b and new_b and dims[0] % old_b[0] == 0 and dims[0] % new_b[0] == 0 and \
                    dims[0] // old_b[0] * old_b[1] == dims[0] // new_b[0] * new_b[1]:
                # the same bytes per row (Q4_0 <-> IQ4_NL, IQ4_NL <-> Q4_K on 256-wide rows, F16 <->
                # BF16): the bytes read as another code book, which no reader can tell from the
                # publisher's own choice
                meaning = "data"
        elif kind == "tdims":
            v = ctx.pick(["swap", "double", "zero", "huge", "add", "drop", "five"])
            if v == "swap" and len(dims) >= 2:
                dims[0], dims[1] = dims[1], dims[0]
                meaning = "data" if dims[0] == dims[1] else "struct"
            elif v == "double":
                dims[-1] *= 2
            elif v == "zero":
                dims[r.randrange(len(dims))] = 0
            elif v == "huge":
                dims[r.randrange(len(dims))] = ctx.pick([1 << 32, 1 << 62, (1 << 64) - 1])
            elif v == "add":
                dims.append(1)
            elif v == "drop" and len(dims) > 1:
                dims = dims[:-1]
            elif v == "five":
                dims = dims + [1] * (5 - len(dims))
            detail = f"{t.name}: dims {t.dims} -> {dims} ({v})"
        elif kind == "toffset":
            same = [o for o in g.infos if o is not t and o.ttype == t.ttype and o.dims == t.dims]
            v = ctx.pick(["plus_align", "minus_align", "unaligned", "huge", "zero", "swap"])
            if v == "swap" and same:
                o = ctx.pick(same)
                j = g.infos.index(o)
                info_blobs[j] = F.gguf_info_bytes(o.name, o.dims, o.ttype, off)
                off = o.offset
                meaning = "data"
            elif v == "swap":
                return None
            else:
                off = {"plus_align": off + g.alignment, "minus_align": max(0, off - g.alignment),
                       "unaligned": off + 1, "huge": (1 << 64) - 16, "zero": 0}[v]
            detail = f"{t.name}: offset {t.offset} -> {off} ({v})"
        elif kind == "tname":
            same = [o for o in g.infos if o is not t and o.ttype == t.ttype and o.dims == t.dims]
            v = ctx.pick(["dup", "empty", "unknown", "long", "swap", "nul"])
            if v == "dup":
                name_ = ctx.pick([o.name for o in g.infos if o is not t])
            elif v == "empty":
                name_ = ""
            elif v == "unknown":
                name_ = t.name.replace("blk.", "blk.9")
            elif v == "long":
                name_ = "x" * r.choice([64, 1000, 70000])
            elif v == "nul":
                name_ = t.name + "\0"
            elif same:
                o = ctx.pick(same)
                j = g.infos.index(o)
                info_blobs[j] = F.gguf_info_bytes(t.name, o.dims, o.ttype, o.offset)
                name_ = o.name
                meaning = "data"
            else:
                return None
            detail = f"{t.name}: renamed {name_[:60]!r} ({v})"
        else:  # tdup: one tensor info listed twice
            info_blobs.insert(i, info_blobs[i])
            out = F.emit_gguf(g, kv_blobs, info_blobs)
            ctx.write(name, out)
            return Mutation("gguf.tdup", name, f"{t.name} listed twice", "struct")
        info_blobs[i] = F.gguf_info_bytes(name_, dims, tt, off)
        out = F.emit_gguf(g, kv_blobs, info_blobs)
    elif kind == "alignment":
        v = ctx.pick([0, 1, 3, 8, 16, 64, 4096, 1 << 31, 0xFFFFFFFF])
        kvs = [kv for kv in g.kvs if kv.key != "general.alignment"]
        kv_blobs = [blob[kv.span[0]:kv.span[1]] for kv in kvs] + [F.gguf_kv_bytes("general.alignment", 4, v)]
        repad = r.random() < 0.5 and 0 < v <= 4096
        out = F.emit_gguf(g, kv_blobs, info_blobs, alignment=v if repad else g.alignment)
        detail, key = f"general.alignment -> {v} (data {'re-padded' if repad else 'where it was'})", "general.alignment"
    else:  # norepad: the header is re-emitted one entry shorter/longer without re-padding the data section
        kv_blobs.append(F.gguf_kv_bytes("general.comment", F.STRING, "x" * r.randrange(1, 40)))
        out = F.emit_gguf(g, kv_blobs, info_blobs, repad=False)
        detail = "a metadata key added, data section not re-aligned"
    ctx.write(name, out)
    return Mutation(f"gguf.{kind}", name, detail, meaning, key)


# -- expert pack v2 -----------------------------------------------------------------------------------------

def m_qpack(ctx: Ctx) -> Mutation | None:
    if "experts.qpack" not in ctx.files():
        return None
    q = F.parse_qpack(ctx.read("experts.qpack"))
    if q is None or q.header["version"] != 2:
        return None
    r = ctx.rng
    h, entries = dict(q.header), [dict(e) for e in q.entries]
    kind = ctx.pick(["header", "entry", "entry_resigned", "payload", "payload_resigned", "swap_resigned"])
    meaning = "struct"
    payload, payload_at = None, 0
    if kind == "header":
        f = ctx.pick([f for f in F.QP_FIELDS if f not in ("magic",)])
        cur = h[f]
        if isinstance(cur, bytes):
            h[f] = bytes(32)
        else:
            h[f] = min(ctx.pick([0, cur + 1, max(0, cur - 1), cur * 2, 0xFFFFFFFF, 1 << 40]),
                       0xFFFFFFFF if F.QP_HEADER.format[1 + F.QP_FIELDS.index(f)] == "I" else (1 << 64) - 1)
        detail = f"header {f}: {cur!r:.20} -> {h[f]!r:.20}"
    elif kind.startswith("entry"):
        e = ctx.pick(entries)
        f = ctx.pick(["layer", "expert", "role", "ndim", "shape0", "shape1", "offset", "size", "name_offset",
                      "name_len", "dtype"])
        cur = e[f]
        if f == "dtype":
            e[f] = ctx.pick([b"F32", b"I8", b"U8", b"XX", b"", b"BF16\x00x"]).ljust(16, b"\0")
        else:
            lim = 0xFFFFFFFF if f in ("layer", "expert", "role", "ndim", "name_len") else (1 << 64) - 1
            e[f] = min(lim, max(0, ctx.pick([0, cur + 1, cur - 1, cur * 2, lim, cur + h["alignment"]])))
        if kind == "entry_resigned":
            h["index_sha256"] = q.index_sha(entries)
        detail = f"entry (layer {e['layer']} expert {e['expert']} role {e['role']}) {f}: {cur!r:.24} -> {e[f]!r:.24}" \
            + (" (index sha256 recomputed)" if kind == "entry_resigned" else "")
    elif kind.startswith("payload"):
        import hashlib

        e = ctx.pick(entries)
        data = bytearray(q.blob[e["offset"]:e["offset"] + e["size"]])
        for _ in range(r.choice([1, 4, 64])):
            data[r.randrange(len(data))] ^= 1 << r.randrange(8)
        payload, payload_at = bytes(data), e["offset"]
        if kind == "payload_resigned":
            e["sha256"] = hashlib.sha256(payload).digest()
            h["index_sha256"] = q.index_sha(entries)
            meaning = "data"
        detail = f"payload bytes of layer {e['layer']} expert {e['expert']} role {e['role']} changed" + \
            (" (sha256s recomputed)" if kind == "payload_resigned" else "")
    else:  # swap two same-sized payloads' offsets (and shas), index re-signed: a consistent pack of other experts
        a = ctx.pick(entries)
        same = [e for e in entries if e is not a and e["size"] == a["size"] and e["dtype"] == a["dtype"]
                and e["role"] == a["role"]]
        if not same:
            return None
        b = ctx.pick(same)
        a["offset"], b["offset"] = b["offset"], a["offset"]
        a["sha256"], b["sha256"] = b["sha256"], a["sha256"]
        h["index_sha256"] = q.index_sha(entries)
        meaning = "data"
        detail = f"payloads of (L{a['layer']} E{a['expert']}) and (L{b['layer']} E{b['expert']}) role {a['role']} swapped"
    ctx.write("experts.qpack", q.emit(h, entries, payload, payload_at))
    return Mutation(f"qpack.{kind}", "experts.qpack", detail, meaning)


# -- JSON files ------------------------------------------------------------------------------------------------

def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:20]):
            out += _paths(v, (*prefix, i))
    return out


def _get(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


def _set(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(root, path[:-1])[path[-1]] = value
    return root


def _path_str(path: tuple) -> str:
    s = ""
    for p in path:
        s += f"[{p}]" if isinstance(p, int) else (("." if s else "") + str(p))
    return s


_UNICODE = ["\u0000", "\ud800", "\u202e", "\ufeff", "e\u0301", "\U0001f600", "\x7f", "\\", "\u2028"]


def _wrong(ctx: Ctx, v: Any) -> tuple[Any, str]:
    """(a replacement value, "type" | "range" | "same")"""
    r = ctx.rng
    if isinstance(v, bool):
        new = ctx.pick([0, 1, "true", "false", None, [True]])
        return new, "same" if new is None else "type"
    if isinstance(v, int | float):
        c = ctx.pick(["str", "list", "dict", "bool", "nan", "inf", "ninf", "big", "neg", "zero", "huge_int",
                      "float_of_int", "small_change"])
        if c == "str":
            return str(v), "type"
        if c == "list":
            return [v], "type"
        if c == "dict":
            return {"value": v}, "type"
        if c == "bool":
            return True, "type"
        if c == "nan":
            return math.nan, "range"
        if c == "inf":
            return math.inf, "range"
        if c == "ninf":
            return -math.inf, "range"
        if c == "big":
            return 1e308, "range"
        if c == "neg":
            return -1 if isinstance(v, int) else -abs(v) - 1, "range" if v >= 0 else "same"
        if c == "zero":  # 0 is in range for many fields (first_k_dense_replace, mscale_all_dim...)
            return 0, "same"
        if c == "huge_int":  # for a float field, a big finite number is a value, not an error
            return ctx.pick(_HUGE), "range" if isinstance(v, int) else "same"
        if c == "float_of_int":  # an integer where a float is expected is a valid float
            return (v + 0.5, "int->float") if isinstance(v, int) else (int(v), "same")
        return (v + 1 if isinstance(v, int) else v * 1.5), "same"
    if isinstance(v, str):
        c = ctx.pick(["int", "list", "null", "empty", "unicode", "long", "case", "dict"])
        if c == "int":
            return 7, "type"
        if c == "list":
            return [v], "type"
        if c == "dict":
            return {v: v}, "type"
        if c == "null":
            return None, "same"
        # another string is another value, not a type error: a load with other logits is fine, a
        # string the reader does not know must be refused or load the same model
        if c == "empty":
            return "", "str"
        if c == "unicode":
            u = ctx.pick(_UNICODE)
            return (v + u if r.random() < 0.5 else u + v), "str"
        if c == "long":
            return v * (1 + 100000 // max(1, len(v))), "str"
        return v.upper() if v != v.upper() else v.lower(), "str"
    if isinstance(v, list):
        c = ctx.pick(["dict", "empty", "nested", "str", "dup", "null"])
        if c == "dict":
            return {str(i): x for i, x in enumerate(v)}, "type"
        if c == "empty":  # an empty list is a list: what it means is the reader's documented default
            return [], "same"
        if c == "nested":
            return [v], "type"
        if c == "str":
            return json.dumps(v), "type"
        if c == "dup":
            return v + v, "same"
        return None, "same"
    if isinstance(v, dict):
        c = ctx.pick(["list", "empty", "str", "null", "int"])
        if c == "list":
            return list(v.values()), "type"
        if c == "empty":
            return {}, "same"
        if c == "str":
            return json.dumps(v)[:200], "type"
        if c == "int":
            return 1, "type"
        return None, "same"
    # null: an empty object or list is as absent as null; a scalar is a type error
    new = ctx.pick([0, "", [], {}, -1, True])
    return new, "same" if new in ([], {}, "") else "type"


#: config keys whose values are floats (an integer there is just a round value)
FLOAT_KEYS = frozenset({"rope_theta", "beta_fast", "beta_slow", "factor", "mscale", "mscale_all_dim", "attention_factor",
                        "routed_scaling_factor", "rms_norm_eps", "initializer_range", "aux_loss_alpha"})


def _changed(ctx: Ctx, v: Any) -> tuple[Any, str]:
    new, how = _wrong(ctx, v)
    if type(new) is type(v) and new == v:
        return new, "same"  # no change at all
    return new, how


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, ensure_ascii=False)  # NaN / Infinity literals as Python writes them


#: quantization_config.json beside config.json is AutoRound's copy of config.json's quantization_config:
#: no reader takes it (transformers, vLLM and quantplug read config.json's)
UNREAD_FILES = ("quantization_config.json",)
_JSON_MEANING = {"tokenizer.json": "none", "tokenizer_config.json": "none", "model.safetensors.index.json": "struct",
                 **{f: "none" for f in UNREAD_FILES}}


def m_json(ctx: Ctx) -> Mutation | None:
    files = ctx.files(lambda n: _is_json(n) and (ctx.root / n).is_file())
    if not files:
        return None
    weights = [6 if n == "config.json" else 1 for n in files]
    name = ctx.rng.choices(files, weights)[0]
    raw = ctx.read(name)
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    r = ctx.rng
    kind = ctx.pick(["value", "value", "value", "delete", "add", "dupkey", "deep", "whole", "listdict", "encoding"])
    paths = [p for p in _paths(obj) if p]
    if name == "config.json":
        qpaths = [p for p in paths if "quantization_config" in p]
        if qpaths and r.random() < 0.4:
            paths = qpaths
    if name == "tokenizer.json":  # its vocabulary is big: mutate the interesting top of it
        paths = [p for p in paths if len(p) <= 3 and not (len(p) >= 2 and p[1] == "vocab")] or paths
    base_meaning = _JSON_MEANING.get(name, "data")
    key, text = "", None
    if kind == "value" and paths:
        p = ctx.pick(paths)
        old = _get(obj, p)
        new, how = _changed(ctx, old)
        obj = _set(obj, p, new)
        key = _path_str(p)
        if how == "int->float":  # 1 -> 1.5: a type error for an integer field, a value for a float one
            how = "same" if p[-1] in FLOAT_KEYS else "type"
        meaning = {"type": "lenient", "range": "lenient", "same": "data", "str": "data"}[how]
        if base_meaning in ("none", "struct") and meaning != "lenient":
            meaning = base_meaning
        if base_meaning == "none":
            meaning = "none"
        detail = f"{key}: {old!r:.60} -> {new!r:.60} ({how})"
    elif kind == "delete" and paths:
        p = ctx.pick(paths)
        parent = _get(obj, p[:-1])
        del parent[p[-1]]
        key = _path_str(p)
        meaning = "data" if base_meaning == "data" else base_meaning
        detail = f"{key} deleted"
    elif kind == "add":
        dicts = [p for p in [(), *paths] if isinstance(_get(obj, p), dict)]
        p = ctx.pick(dicts)
        _get(obj, p)[ctx.pick(["zzz_unknown", "quant_method", "", "\u0000", "__proto__"])] = ctx.pick(
            [1, "x", None, {"a": [1, 2]}])
        meaning, detail = "none" if base_meaning == "none" else "struct", f"key added under {_path_str(p) or '/'}"
    elif kind == "dupkey":
        dicts = [p for p in [(), *paths] if isinstance(_get(obj, p), dict) and _get(obj, p)]
        p = ctx.pick(dicts)
        d = _get(obj, p)
        k = ctx.pick(list(d))
        new, _ = _wrong(ctx, d[k])
        marker = "__DUP_MARKER__"
        d[marker] = 0
        text = _dump(obj).replace(f'"{marker}": 0', f"{json.dumps(k)}: {json.dumps(new)}")
        key = _path_str((*p, k))
        meaning = "none" if base_meaning == "none" else "struct"
        detail = f"{key} given twice (second {new!r:.40})"
    elif kind == "deep":
        depth = r.choice([33, 200, 5000, 200000])
        p = ctx.pick(paths) if paths else ()
        marker = "__DEEP_MARKER__"
        obj = _set(obj, p, marker)
        text = _dump(obj).replace(json.dumps(marker), "[" * depth + "]" * depth)
        key = _path_str(p)
        meaning = "none" if base_meaning == "none" else "lenient"
        detail = f"{key} -> nesting depth {depth}"
    elif kind == "whole":
        text = ctx.pick(["[]", "null", '"x"', "1", "", "{", raw.decode("utf-8", "replace")[: len(raw) // 2],
                         raw.decode("utf-8", "replace") + "}{", "{}", "{} {}", " " * 100])
        meaning = "none" if base_meaning == "none" else "struct"
        detail = f"file replaced by {text[:30]!r}{'...' if len(text) > 30 else ''}"
    elif kind == "listdict":
        cands = [p for p in paths if isinstance(_get(obj, p), list | dict)]
        if not cands:
            return None
        p = ctx.pick(cands)
        v = _get(obj, p)
        new = {str(i): x for i, x in enumerate(v)} if isinstance(v, list) else list(v.values())
        obj = _set(obj, p, new)
        key = _path_str(p)
        meaning = "none" if base_meaning == "none" else "lenient"
        detail = f"{key}: {'list -> object' if isinstance(v, list) else 'object -> list'}"
    else:  # encoding
        body = _dump(obj).encode("utf-8", "surrogatepass")
        v = ctx.pick(["bom", "utf16", "latin1", "nul", "crlf", "huge"])
        if v == "bom":
            data = b"\xef\xbb\xbf" + body
        elif v == "utf16":
            data = body.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")
        elif v == "latin1":
            data = body.replace(b'"', b'"\xe9', 1)
        elif v == "nul":
            data = body + b"\0"
        elif v == "crlf":
            data = body.replace(b"\n", b"\r\n")
        else:  # past the 64 MiB JSON bound
            data = body[:-1].rstrip() + b" " * (65 << 20) + b"}"
        ctx.write(name, data)
        meaning = "none" if base_meaning == "none" or v == "crlf" else "struct"
        if v == "crlf":
            meaning = "none"
        return Mutation("json.encoding", name, f"{v}", meaning)
    if kind in ("value", "delete") and not paths:
        return None
    ctx.write(name, text if text is not None else _dump(obj))
    return Mutation(f"json.{kind}", name, detail, meaning, key)


def m_index(ctx: Ctx) -> Mutation | None:
    if "model.safetensors.index.json" not in ctx.files():
        return None
    try:
        idx = json.loads(ctx.read("model.safetensors.index.json"))
        wm = idx["weight_map"]
        k = ctx.pick(sorted(wm))
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    old = wm[k]
    shards = sorted(set(wm.values()))
    new = ctx.pick(["../outside.safetensors", str(ctx.outside / "outside.safetensors"), "/etc/hostname", "missing.safetensors",
                    ".", "", "./" + old, old + "/", "config.json", ctx.pick(shards), "sub/" + old, "experts.qpack",
                    old.upper(), "\u0000" + old, 5, None, [old]])
    meaning = "struct"
    if new in ("../outside.safetensors", str(ctx.outside / "outside.safetensors"), "/etc/hostname"):
        meaning = "escape"
    if new == "./" + old:
        meaning = "struct"  # the same file: must load identically or be refused
    wm[k] = new
    ctx.write("model.safetensors.index.json", json.dumps(idx, indent=1))
    return Mutation("index.weight_map", "model.safetensors.index.json", f"{k}: {old!r} -> {new!r}", meaning, k)


# -- tokenizers and chat templates ---------------------------------------------------------------------------

HOSTILE_TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'a' * 1000000000 }}",
    "{{ [1] * 1000000000 }}",
    "{{ 9 ** 9 ** 9 }}",
    "{{ 'x'.center(1000000000) }}",
    "{{ '%*s' | format(1000000000, 'x') }}",
    "{{ '{:>1000000000}'.format(1) }}",
    "{{ messages | tojson(indent=100000) }}",
    "{{ lipsum(1000000) }}",
    "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.__class__ }}{{ self._TemplateReference__context }}",
    "{% include 'other.jinja' %}",
    "{% import 'x' as y %}",
    "{% extends 'base' %}",
    "{{ raise_exception('no') }}",
    "{{ undefined_thing.attr }}",
    "{{ messages[99]['content'] }}",
    "{% for %}",
    "{{ ",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s=[1]) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set s = 'a' * 60000 %}{{ s.replace('a', s) | length }}",
    "{% set s = 'a' * 60000 %}{{ s | replace('a', s) | length }}",
    "{% set s = 'a' * 60000 %}{{ (s, s, s) | join(s) | length }}",
    "{% set s = 'a' * 60000 %}{{ '%s%s' % (s, s) }}{{ s | indent(1000000000) | length }}",
    "{% set s = 'a' * 60000 %}{{ s | wordwrap(1) | length }}{{ s.ljust(2000000000) | length }}",
    "{% set s = 'ab' * 30000 %}{{ s.expandtabs(100000) }}{{ (s ~ '\\t' * 60000).expandtabs(60000) | length }}",
    "{{ range(100000) | list | map('string') | join(',' * 60000) | length }}",
    "{{ range(100000) | batch(100000, 'x' * 60000) | list | length }}",
    "{% set d = {} %}{{ d.update({'a': 1}) }}",
    "{{ ('a' * 60000) | list | map('center', 60000) | join | length }}",
    "{{ ('a' * 60000) | format(*range(100000)) }}",
    "{{ 'x' | truncate(1000000000) }}{{ ((range(99999)|list) * 80)|length }}",
    "{{ 1000000 * 'a' * 10 }}",
    "{{ ('%0' ~ 1000000000 ~ 'd') % 1 }}",
    "{{ (2 ** 100000) | string | length }}",
    "{{ 10 ** 1000000 }}",
    "{{ messages | tojson(indent=16) * 1000000 }}",
    "{{ 'a'.zfill(1000000000) }}",
    "{{ 'a' | center(width=1000000000) }}",
    "{{ dict(a=1) | dictsort(by='value') }}{{ ''.join(['a'] * 10) }}",
    "{{ '%c' % 1114112 }}",
    "{{ '\\ud800' }}{{ '\\x00' }}",
    "\ud800 {{ bos_token }}",
]


def m_template(ctx: Ctx) -> Mutation | None:
    r = ctx.rng
    tmpl = ctx.pick(HOSTILE_TEMPLATES)
    where = "chat_template.jinja" if "chat_template.jinja" in ctx.files() or r.random() < 0.3 else \
        "tokenizer_config.json"
    if where == "tokenizer_config.json":
        try:
            cfg = json.loads(ctx.read(where)) if where in ctx.files() else {}
        except ValueError:
            cfg = {}
        if not isinstance(cfg, dict):
            cfg = {}
        cfg["chat_template"] = tmpl if r.random() < 0.8 else [{"name": "default", "template": tmpl}]
        ctx.write(where, json.dumps(cfg, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    else:
        ctx.write(where, tmpl)
    return Mutation("template.hostile", where, tmpl[:80], "none")


def m_tiktoken(ctx: Ctx) -> Mutation | None:
    if "tiktoken.model" not in ctx.files():
        return None
    lines = ctx.read("tiktoken.model").decode().splitlines()
    r = ctx.rng
    kind = ctx.pick(["dup_rank", "dup_token", "drop_byte", "bad_b64", "rank_str", "rank_neg", "rank_huge",
                     "extra_field", "blank", "crlf", "gap", "huge_file", "swap_ranks"])
    i = r.randrange(len(lines))
    tok, rank = lines[i].split()
    if kind == "dup_rank":
        lines.append(f"{ctx.pick(['aGk=', 'eHl6', 'IA=='])} {rank}")
    elif kind == "dup_token":
        lines.append(f"{tok} {len(lines) + 5}")
    elif kind == "drop_byte":
        del lines[r.randrange(256)]
    elif kind == "bad_b64":
        lines[i] = f"!!{tok}== {rank}"
    elif kind == "rank_str":
        lines[i] = f"{tok} {ctx.pick(['1e3', 'x', '0x10', '٣', '+5'])}"
    elif kind == "rank_neg":
        lines[i] = f"{tok} -{rank}"
    elif kind == "rank_huge":
        lines[i] = f"{tok} {10 ** 30}"
    elif kind == "extra_field":
        lines[i] = f"{tok} {rank} extra"
    elif kind == "blank":
        lines.insert(i, ctx.pick(["", " ", "\t"]))
    elif kind == "crlf":
        ctx.write("tiktoken.model", "\r\n".join(lines) + "\r\n")
        return Mutation("tiktoken.crlf", "tiktoken.model", "CRLF line ends", "none")
    elif kind == "gap":
        lines[-1] = f"{lines[-1].split()[0]} {int(lines[-1].split()[1]) + 1000}"
    elif kind == "huge_file":
        lines += [f"{i:x} 0" for i in range(1)] * 0
        ctx.write("tiktoken.model", "\n".join(lines) + "\n" + "#" * (65 << 20))
        return Mutation("tiktoken.huge_file", "tiktoken.model", "past 64 MiB", "none")
    else:
        j = r.randrange(len(lines))
        (a, ra), (b, rb) = lines[i].split(), lines[j].split()
        lines[i], lines[j] = f"{a} {rb}", f"{b} {ra}"
    ctx.write("tiktoken.model", "\n".join(lines) + "\n")
    return Mutation(f"tiktoken.{kind}", "tiktoken.model", f"line {i}: {kind}", "none")


# -- file system -------------------------------------------------------------------------------------------

def m_fs(ctx: Ctx) -> Mutation | None:
    files = ctx.files()
    if not files:
        return None
    r = ctx.rng
    name = ctx.pick(files)
    p = ctx.root / name
    kind = ctx.pick(["delete", "dir", "symlink_out", "symlink_in", "symlink_loop", "dangling", "empty", "fifo",
                     "dev_zero", "extra", "symlink_parent"])
    meaning = "struct" if name not in ("tokenizer.json", "tokenizer_config.json", "tiktoken.model",
                                       "chat_template.jinja", *UNREAD_FILES) else "none"
    if kind == "delete":
        p.unlink()
        detail = "deleted"
        if meaning == "struct":
            meaning = "data"  # a sidecar may be optional: judged by hand when it changes the model
    elif kind == "dir":
        p.unlink()
        p.mkdir()
        (p / "inner").write_bytes(b"{}")
        detail = "replaced by a directory"
    elif kind == "symlink_out":
        target = ctx.outside / name
        if not target.exists():
            shutil.copyfile(p, target)
        p.unlink()
        p.symlink_to(target if r.random() < 0.5 else os.path.relpath(target, ctx.root))
        detail, meaning = f"symlink to an identical copy outside: {target}", "escape"
        if name in UNREAD_FILES:
            meaning = "none"
    elif kind == "symlink_parent":
        # the directory itself reached through ../ (still inside after resolving): must load the same
        p.unlink()
        p.symlink_to(Path("..") / ctx.root.name / "_moved" / name)
        (ctx.root / "_moved").mkdir(exist_ok=True)
        shutil.copyfile(ctx.outside.parent / "seeds" / ctx.seed_name / name, ctx.root / "_moved" / name) \
            if (ctx.outside.parent / "seeds" / ctx.seed_name / name).is_file() else None
        detail = "symlink to a copy in a subdirectory, spelled through ../<case>/"
        meaning = "struct" if meaning == "struct" else "none"
    elif kind == "symlink_in":
        other = ctx.pick([f for f in files if f != name] or [name])
        p.unlink()
        p.symlink_to(other)
        detail = f"symlink to {other}"
    elif kind == "symlink_loop":
        p.unlink()
        p.symlink_to(name)
        detail = "symlink to itself"
    elif kind == "dangling":
        p.unlink()
        p.symlink_to("does-not-exist")
        detail = "dangling symlink"
    elif kind == "empty":
        ctx.write(name, b"")
        detail = "zero-length"
    elif kind == "fifo":
        p.unlink()
        os.mkfifo(p)
        detail = "replaced by a FIFO"
    elif kind == "dev_zero":
        p.unlink()
        p.symlink_to(ctx.pick(["/dev/zero", "/dev/null", "/dev/urandom"]))
        detail, meaning = f"symlink to {os.readlink(p)}", "escape"
        if name in UNREAD_FILES:
            meaning = "none"
    else:
        extra = ctx.pick(["extra.safetensors", "zz.gguf", "experts.qpack", "model.safetensors.index.json",
                          "tokenizer.json", "quantization_config.json", "hf_quant_config.json",
                          "quant_model_description.json", "chat_template.jinja", "tiktoken.model",
                          "model-00001-of-00001.safetensors", "a.safetensors"])
        if extra in files:
            return None
        src = ctx.pick(files)
        content = ctx.pick([b"", b"{}", b"garbage" * 10, ctx.read(src)])
        ctx.write(extra, content)
        detail = f"stray {extra} ({len(content)} bytes, {'copy of ' + src if len(content) > 80 else 'junk'})"
        name = extra
        meaning = "struct" if extra not in ("tokenizer.json", "chat_template.jinja", "tiktoken.model") else "none"
    return Mutation(f"fs.{kind}", name, detail, meaning)


#: mutator -> weight
MUTATORS: dict[str, tuple[Callable[[Ctx], Mutation | None], int]] = {
    "bytes": (m_bytes, 26), "st": (m_st_header, 20), "gguf": (m_gguf, 14), "qpack": (m_qpack, 6),
    "json": (m_json, 18), "index": (m_index, 3), "template": (m_template, 4), "tiktoken": (m_tiktoken, 2),
    "fs": (m_fs, 7),
}


def case_rng(run_seed: int, index: int) -> random.Random:
    return random.Random(f"quantplug-indep-fuzz:{run_seed}:{index}")


def make_case(run_seed: int, index: int, seeds: list[tuple[str, Path]], dst: Path, outside: Path) -> tuple[
        str, list[Mutation]]:
    """Build case ``index`` of run ``run_seed`` into ``dst`` (must not exist); returns the seed's name and
    the mutations applied."""
    rng = case_rng(run_seed, index)
    seed_name, src = seeds[rng.randrange(len(seeds))]
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        os.link(f, dst / f.name)
    outside.mkdir(parents=True, exist_ok=True)
    if not (outside / "outside.safetensors").exists():
        shutil.copyfile(next(src.glob("*.safetensors"), src / "config.json"), outside / "outside.safetensors")
    ctx = Ctx(rng, dst, outside, seed_name)
    sizes = {f.name: f.stat().st_size for f in src.iterdir() if f.is_file()}
    names = list(MUTATORS)
    weights = [MUTATORS[n][1] for n in names]
    n_mut = 2 if rng.random() < 0.125 else 1
    done: list[Mutation] = []
    tries = 0
    while len(done) < n_mut and tries < 30:
        tries += 1
        try:
            m = MUTATORS[rng.choices(names, weights)[0]][0](ctx)
        except (ValueError, IndexError, KeyError, TypeError, AttributeError, RecursionError, ZeroDivisionError,
                OSError, struct.error):
            m = None  # not applicable to this file (an empty object, a file an earlier mutation broke)
        if m is not None:
            done.append(m)
    # blind edits that cut and re-add bytes beyond a weight file's header leave a valid file holding
    # shifted data: a data change, not a structural one
    for m in done:
        if m.mutator.startswith("bytes.") and m.meaning == "struct" and m.file.endswith((".safetensors", ".gguf")):
            f = dst / m.file
            if f.is_file() and not f.is_symlink() and f.stat().st_size == sizes.get(m.file) and \
                    _header(f.read_bytes(), m.file) == _header((src / m.file).read_bytes(), m.file):
                m.meaning = "data"
        # two JSON mutations that undo each other (list -> object -> list) leave the seed's content
        if m.mutator.startswith("json.") and m.file and _same_json(dst / m.file, src / m.file):
            m.meaning = "none"
        # a later mutation may have replaced the symlink that left the directory
        if m.meaning == "escape" and m.file:
            real = os.path.realpath(dst / m.file)
            if os.path.commonpath([real, os.path.realpath(dst)]) == os.path.realpath(dst):
                m.meaning = "struct"
    return seed_name, done


def _same_json(mutated: Path, seed: Path) -> bool:
    """Whether a JSON file parses to exactly its seed's value (what a pair of inverse edits leaves)."""
    if mutated.is_symlink() or not mutated.is_file() or not seed.is_file():
        return False
    try:
        return json.loads(mutated.read_bytes()) == json.loads(seed.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False  # not JSON any more: a real change


def _header(blob: bytes, name: str) -> bytes | None:
    if name.endswith(".safetensors"):
        st = F.parse_safetensors(blob)
        return blob[:8 + st.header_len] if st else None
    g = F.parse_gguf(blob)
    return blob[:g.data_start] if g else None
