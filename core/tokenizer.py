"""The tokenizer a checkpoint directory carries, for ``quantplug generate``.

Sources, first found wins:

* ``tokenizer.json``: the ``tokenizers`` library (DeepSeek-V3, most hub checkpoints);
* ``tiktoken.model``: Kimi's tiktoken BPE ranks through ``tiktoken``, with the pre-tokenizer
  pattern ``tokenization_kimi.py`` uses (or ``pat_str`` from tokenizer_config.json when it names
  one) and the 256 reserved special ids after the base vocabulary, named from
  tokenizer_config.json's ``added_tokens_decoder`` (the others ``<|reserved_token_N|>``);
* a GGUF's embedded vocabulary (``tokenizer.ggml.tokens`` / ``merges`` / ``token_type``, byte-level
  BPE, ``tokenizer.ggml.model`` = "gpt2"): read from the file only here, when generating; the
  plan's header reader walks over those arrays without decoding them.

The chat template (tokenizer_config.json ``chat_template``, a ``chat_template.jinja`` file, or the
GGUF's ``tokenizer.chat_template``) is rendered with jinja2's sandbox, as transformers does, within
bounds (:func:`render_bounded`): time, output size, string sizes and recursion; exceeding one is a
:class:`CheckpointError`, never a raw RecursionError / OverflowError or a render that runs for minutes.

Untrusted files: every tokenizer file must lie inside the checkpoint directory (a symlink leaving
it is refused); tokenizer.json and tokenizer_config.json go through the bounded JSON reader;
``tiktoken.model`` is parsed here (tiktoken's own loader caches the parsed file under a shared
temporary directory keyed by its path: an edited file was not re-read, and another local user
could plant the cache entry), its ranks checked (unique, dense from 0, every single byte present:
tiktoken's Rust core panics otherwise). A library panic (a ``BaseException``) while building or
using a tokenizer becomes a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import json
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .errors import CheckpointError, QuantplugError
from .validation import (
    MAX_JSON_BYTES,
    Fields,
    check_count,
    contained,
    json_depth_ok,
    read_bounded,
    read_json,
    read_text,
)

T = TypeVar("T")
#: largest tiktoken.model / chat_template.jinja read (Kimi's tiktoken.model is 2.8 MB)
MAX_TEXT_BYTES = 64 << 20
#: chat template bounds: seconds of rendering, characters of output, characters of any one string
#: it builds, largest integer width / repeat count it may pass to a string method
TEMPLATE_SECONDS = 5.0
TEMPLATE_OUTPUT_CHARS = 8 << 20
TEMPLATE_STRING_CHARS = 8 << 20
TEMPLATE_MAX_WIDTH = 1 << 16

#: Kimi's pre-tokenizer pattern (tokenization_kimi.py ``pat_str``): Han runs, cased words with
#: English contractions, 1-3 digits, punctuation runs, newlines, spaces
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
#: Kimi reserves this many special ids after the base vocabulary
KIMI_RESERVED = 256

#: llama.cpp ``tokenizer.ggml.pre`` -> the split patterns its pre-tokenizer applies before byte-level BPE
GGUF_PRE_PATTERNS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": (
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "kimi-k2": (KIMI_PATTERN,),
}
#: GGUF token types (llama.cpp ``llama_token_type``): control and user-defined tokens are special
GGUF_SPECIAL_TYPES = (3, 4)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """encode / decode / chat template over one of the three sources (``source`` says which)."""

    def __init__(self, source: str, path: Path, config: dict[str, Any], chat_template: str | None) -> None:
        self.source, self.path, self.config = source, path, config
        self.chat_template = chat_template
        self._tk: Any = None       # tokenizers.Tokenizer
        self._tt: Any = None       # tiktoken.Encoding
        self._specials: set[int] = set()

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_tokenizer_json(cls, file: Path, config: dict[str, Any], template: str | None) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        self = cls("tokenizer.json", file, config, template)
        text = _read_text(file, MAX_JSON_BYTES)
        if not json_depth_ok(text):
            raise CheckpointError(f"{file}: JSON nested too deeply")
        self._tk = _library(file, "not a tokenizers file", lambda: HFTokenizer.from_str(text))
        self._specials = _library(file, "not a tokenizers file", lambda: {
            int(i) for i, tok in self._tk.get_added_tokens_decoder().items() if tok.special})
        return self

    @classmethod
    def from_tiktoken(cls, file: Path, config: dict[str, Any], template: str | None) -> Tokenizer:
        import tiktoken

        self = cls("tiktoken.model", file, config, template)
        ranks = read_tiktoken_ranks(file)
        n = len(ranks)
        added = config.get("added_tokens_decoder") or {}
        if not isinstance(added, dict):
            raise CheckpointError(f"{file.parent / 'tokenizer_config.json'}: added_tokens_decoder = {added!r:.60}: "
                                  "expected an object of id -> token")
        named: dict[int, str | None] = {}
        for i, t in added.items():
            if not (isinstance(i, str) and i.isdigit() and len(i) < 12):
                raise CheckpointError(f"{file.parent / 'tokenizer_config.json'}: added_tokens_decoder key {i!r:.40}: "
                                      "expected a token id")
            named[int(i)] = _token_str(t)
        specials = {(named.get(i) or f"<|reserved_token_{i}|>"): i for i in range(n, n + KIMI_RESERVED)}
        if len(specials) != KIMI_RESERVED or any(k.encode() in ranks for k in specials):
            raise CheckpointError(f"{file.parent / 'tokenizer_config.json'}: added_tokens_decoder names two reserved "
                                  "ids alike, or a special token that is also a BPE token")
        pat = config.get("pat_str")
        if pat is not None and not isinstance(pat, str):
            raise CheckpointError(f"{file.parent / 'tokenizer_config.json'}: pat_str = {pat!r:.60}: expected a string")
        pattern = pat if isinstance(pat, str) else KIMI_PATTERN
        self._tt = _library(file, "tiktoken refused it", lambda: tiktoken.Encoding(
            name=file.parent.name or "tiktoken", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials))
        self._specials = set(specials.values())
        return self

    @classmethod
    def from_gguf(cls, file: Path, config: dict[str, Any]) -> Tokenizer:
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        meta = read_gguf_tokenizer(file)
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(f"{file}: tokenizer.ggml.model = {model!r}; quantplug reads byte-level BPE "
                                  "vocabularies ('gpt2', what DeepSeek / Kimi GGUFs carry) only; pass --tokens")
        tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges") or []
        if not isinstance(tokens, list) or not tokens:
            raise CheckpointError(f"{file}: tokenizer.ggml.tokens is missing or empty")
        # typed like llama.cpp reads them: a value of another type is refused, not replaced by a default
        for key, want, ok in (("tokenizer.ggml.merges", "an array of strings", isinstance(merges, list)),
                              ("tokenizer.ggml.pre", "a string", isinstance(meta.get("tokenizer.ggml.pre", ""), str)),
                              ("tokenizer.ggml.token_type", "an array of integers",
                               isinstance(meta.get("tokenizer.ggml.token_type", []), list)),
                              *((k, f"a token id in [0, {len(tokens)})", k not in meta or (
                                  type(meta[k]) is int and 0 <= meta[k] < len(tokens)))
                                for k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"))):
            if not ok:
                raise CheckpointError(f"{file}: metadata {key} = {str(meta.get(key))[:40]}: expected {want}")
        self = cls("gguf", file, config, meta.get("tokenizer.chat_template"))
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = []
        for i, m in enumerate(merges):
            a, sep, b = str(m).partition(" ")
            # checked here: the tokenizers library panics (a BaseException) on a merge whose
            # result is not in the vocabulary
            if not sep or a not in vocab or b not in vocab or a + b not in vocab:
                raise CheckpointError(f"{file}: tokenizer.ggml.merges[{i}] = {str(m)[:80]!r} does not merge two "
                                      "vocabulary tokens into a third: the GGUF's BPE vocabulary is inconsistent")
            pairs.append((a, b))
        try:
            self._tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
        except Exception as exc:  # the library's own checks, as a message naming the file
            raise CheckpointError(f"{file}: the GGUF's BPE vocabulary is not usable: {exc}") from None
        pre = str(meta.get("tokenizer.ggml.pre", ""))
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in GGUF_PRE_PATTERNS.get(pre, ())]
        self._tk.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not splits)])
        self._tk.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or []
        special = [i for i, t in enumerate(types) if t in GGUF_SPECIAL_TYPES]
        self._tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        self._specials = set(special)
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise CheckpointError(f"{file}: metadata tokenizer.ggml.add_bos_token = {str(add_bos)[:40]}: expected a bool")
        self.config = {**config, **{k: meta[k] for k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                                         "tokenizer.ggml.add_bos_token") if k in meta}}
        return self

    # -- use ----------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids. ``add_special_tokens``:
        the tokenizer.json post-processor's BOS etc. (off for rendered chat templates, which hold them)."""
        if self._tt is not None:
            return _library(self.path, "encoding failed", lambda: list(self._tt.encode(text, allowed_special="all")))
        return _library(self.path, "encoding failed",
                        lambda: list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids))

    def added_bos(self) -> int | None:
        """The BOS id this tokenizer puts before a text (llama.cpp's ``add_bos``), or None.

        tokenizer.json: the token its post-processor adds in front (``encode`` with and without
        special tokens compared); a GGUF vocabulary: ``tokenizer.ggml.bos_token_id`` when
        ``tokenizer.ggml.add_bos_token`` is true (absent: false, llama.cpp's default for the
        byte-level BPE vocabularies DeepSeek / Kimi GGUFs carry); tiktoken: tokenizer_config.json's
        ``add_bos_token`` and ``bos_token`` (Kimi's files set neither: none)."""
        if self.source == "gguf":
            bos = self.config.get("tokenizer.ggml.bos_token_id")
            return bos if self.config.get("tokenizer.ggml.add_bos_token") is True and isinstance(bos, int) else None
        if self._tt is not None:
            name = _token_str(self.config.get("bos_token"))
            if self.config.get("add_bos_token") is not True or not name:
                return None
            ids = self.encode(name)
            return ids[0] if len(ids) == 1 and ids[0] in self._specials else None
        with_special, plain = self.encode("a"), self.encode("a", add_special_tokens=False)
        if len(with_special) > len(plain) and with_special[1:1 + len(plain)] == plain:
            return with_special[0]
        return None

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._specials]
        if self._tt is not None:  # invalid UTF-8 (a split character) becomes U+FFFD
            return _library(self.path, "decoding failed", lambda: self._tt.decode(ids))
        return _library(self.path, "decoding failed", lambda: str(self._tk.decode(ids, skip_special_tokens=False)))

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` ([{"role": ..., "content": ...}]), within the
        bounds of :func:`render_bounded`."""
        if not self.chat_template:
            raise CheckpointError(f"{self.path.parent}: no chat template (tokenizer_config.json 'chat_template', "
                                  "chat_template.jinja or the GGUF's tokenizer.chat_template)")
        return render_bounded(self.chat_template, {
            "messages": list(messages), "add_generation_prompt": add_generation_prompt,
            "bos_token": _token_str(self.config.get("bos_token")) or "",
            "eos_token": _token_str(self.config.get("eos_token")) or ""}, f"{self.path.parent}: chat template")


# -- bounded chat templates ---------------------------------------------------------------------------

class _Deadline(BaseException):
    """Raised asynchronously in a render that ran past its time (a BaseException: templates
    cannot catch it)."""


def _sandbox() -> Any:
    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def sized(value: Any) -> Any:
        if isinstance(value, str | bytes | list | tuple | range) and len(value) > TEMPLATE_STRING_CHARS:
            raise SecurityError(f"a value of {len(value):,} items (more than {TEMPLATE_STRING_CHARS:,})")
        return value

    def width(n: Any) -> None:
        if isinstance(n, int) and not isinstance(n, bool) and abs(n) > TEMPLATE_MAX_WIDTH:
            raise SecurityError(f"a width / count of {n:,} (more than {TEMPLATE_MAX_WIDTH:,})")

    wide_format = re.compile(r"\d{6,}|%[^a-zA-Z%]*\*")

    def joined(parts: Any, sep: str = "") -> str:
        """``sep.join(str(p) for p in parts)``, its length counted while the parts are made, so a
        lazy sequence (``map('center', 60000)``) stops at the bound (``~`` and ``|join`` of bounded
        values still double a string per step: 60 steps are 2^60 characters)."""
        out: list[str] = []
        total = 0
        for p in parts:
            text = str(p)
            total += len(text) + (len(sep) if out else 0)
            sized(range(total))
            out.append(text)
        return sep.join(out)

    class Codegen(CodeGenerator):
        """``a ~ b ~ c`` through :func:`joined` (jinja compiles it to an unchecked ``str_join``)."""

        def visit_Concat(self, node: Any, frame: Any) -> None:
            self.write("environment.qp_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with string growth bounded: ``*`` / ``+`` / ``%`` / ``**`` results, widths
        passed to string methods and filters, format widths."""

        intercepted_binops = frozenset({"*", "+", "%", "**"})
        code_generator_class = Codegen

        def qp_concat(self, items: tuple[Any, ...]) -> str:
            return joined(items)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, str | bytes | list | tuple) and isinstance(b, int):
                        width(b)
                        sized(a[:0] if b <= 0 else range(len(a) * b))
            if operator == "**" and isinstance(right, int) and abs(right) > 256 and left not in (0, 1, -1):
                raise SecurityError(f"a power of {right:,}")
            if operator == "%" and isinstance(left, str) and wide_format.search(left):
                raise SecurityError("a %-format with a huge or '*' width")
            return sized(super().call_binop(context, operator, left, right))

        def wrap_str_format(self, value: Any) -> Any:
            """``'...'.format`` / ``format_map``: the sandbox's own wrapper, with the widths in the
            format string and in the arguments checked first."""
            fn = super().wrap_str_format(value)
            if fn is None:
                return None
            if wide_format.search(value.__self__):
                raise SecurityError("a format with a huge width")

            def checked(*args: Any, **kwargs: Any) -> Any:
                for a in (*args, *kwargs.values()):
                    width(a)
                return sized(fn(*args, **kwargs))
            return checked

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            name = getattr(__obj, "__name__", "")
            if isinstance(getattr(__obj, "__self__", None), str):
                for a in (*args, *kwargs.values()):
                    width(a)
                    if name in ("format", "format_map") and wide_format.search(__obj.__self__):
                        raise SecurityError("a format with a huge width")
                if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                    hits = __obj.__self__.count(args[0]) if args[0] else len(__obj.__self__) + 1
                    sized(range(len(__obj.__self__) + hits * len(args[1])))
            return sized(super().call(__context, __obj, *args, **kwargs))

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    for name in ("center", "indent", "truncate", "wordwrap", "format"):
        real = env.filters[name]

        def checked(*args: Any, __real: Any = real, __name: str = name, **kwargs: Any) -> Any:
            for a in (*args[1:], *kwargs.values()):
                width(a)
            if __name == "format" and args and isinstance(args[0], str) and wide_format.search(args[0]):
                raise SecurityError("a format with a huge width")
            return sized(__real(*args, **kwargs))
        checked.__dict__.update(getattr(real, "__dict__", {}))  # keep jinja's pass_* markers
        env.filters[name] = checked

    def tojson(x: Any, indent: Any = None, ensure_ascii: bool = False) -> str:
        if indent is not None and (not isinstance(indent, int) or isinstance(indent, bool) or not 0 <= indent <= 16):
            raise SecurityError(f"tojson indent {indent!r} (0..16)")
        return sized(json.dumps(x, indent=indent, ensure_ascii=ensure_ascii))

    def raise_exception(message: str) -> None:
        from jinja2 import TemplateError

        raise TemplateError(message)

    real_lipsum: Any = env.globals["lipsum"]

    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> Any:  # noqa: A002
        for a in (n, min, max):
            if not isinstance(a, int) or isinstance(a, bool) or not 0 <= a <= 1000:
                raise SecurityError(f"lipsum({n!r}, min={min!r}, max={max!r}): counts of 0..1000")
        return real_lipsum(n, html, min, max)

    env.filters["tojson"] = tojson
    real_join: Any = env.filters["join"]

    def join(ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> Any:
        from jinja2.filters import make_attrgetter

        items = value if attribute is None else map(make_attrgetter(ctx.environment, attribute), value)
        return joined(items, str(d))
    join.__dict__.update(getattr(real_join, "__dict__", {}))
    env.filters["join"] = join

    def replace(ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> Any:
        text = str(s)
        if isinstance(old, str) and isinstance(new, str):
            width(count)
            hits = (text.count(old) if old else len(text) + 1) if count is None else min(int(count), len(text) + 1)
            sized(range(len(text) + max(hits, 0) * len(new)))
        return sized(real_replace(ctx, s, old, new, count))
    real_replace: Any = env.filters["replace"]
    replace.__dict__.update(getattr(real_replace, "__dict__", {}))
    env.filters["replace"] = replace
    env.globals["raise_exception"] = raise_exception
    env.globals["lipsum"] = lipsum
    return env


def render_bounded(template: str, variables: dict[str, Any], what: str, *,
                   seconds: float | None = None, max_chars: int | None = None) -> str:
    """Render ``template`` in jinja2's immutable sandbox with bounds: ``seconds`` of wall time (an
    exception injected into the rendering thread at the deadline), ``max_chars`` of output
    (rendered in chunks, counted as they come), strings / lists the template builds and widths it
    passes to string methods (checked before they are made), and recursion (a recursive macro).
    Any failure, a bound or the template's own error, is a :class:`CheckpointError` naming
    ``what``: one line, no raw Python exception."""
    from jinja2 import TemplateError

    seconds = TEMPLATE_SECONDS if seconds is None else seconds
    limit = TEMPLATE_OUTPUT_CHARS if max_chars is None else max_chars
    tid = threading.get_ident()
    lock = threading.Lock()
    state = {"active": True, "fired": False}

    def fire() -> None:
        with lock:
            if state["active"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_Deadline))

    def run() -> str:
        env = _sandbox()
        parts: list[str] = []
        total = 0
        for chunk in env.from_string(template).generate(**variables):
            total += len(chunk)
            if total > limit:
                raise _Bound(f"its output passed {limit:,} characters")
            parts.append(chunk)
        return "".join(parts)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    try:
        try:
            timer.start()
            return run()
        finally:
            with lock:
                state["active"] = False
            timer.cancel()
    except _Deadline:
        raise CheckpointError(f"{what}: rendering took more than {seconds:g} s (a loop too long for a chat "
                              "template)") from None
    except _Bound as exc:
        raise CheckpointError(f"{what}: {exc}") from None
    except RecursionError:
        raise CheckpointError(f"{what}: recursion too deep (a macro calling itself without end)") from None
    except MemoryError:
        raise CheckpointError(f"{what}: out of memory while rendering") from None
    except TemplateError as exc:
        kind = {"TemplateSyntaxError": "syntax error", "SecurityError": "refused by the sandbox",
                "UndefinedError": "undefined value"}.get(type(exc).__name__, "failed")
        lineno = getattr(exc, "lineno", None)
        line = f" (line {lineno})" if lineno else ""
        raise CheckpointError(f"{what}: {kind}{line}: {_one_line(exc)}") from None
    except OverflowError as exc:  # the sandbox's range() limit, a float overflow
        raise CheckpointError(f"{what}: a number out of range ({_one_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 (any other error of the template's own making)
        raise CheckpointError(f"{what}: failed while rendering ({_one_line(exc)})") from None


class _Bound(Exception):
    pass


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


# -- untrusted tokenizer files ---------------------------------------------------------------------

def _library(file: Path, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, with any error of the tokenizer library (a Rust panic is a BaseException) as a
    CheckpointError naming ``file``."""
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit, GeneratorExit, QuantplugError):
        raise
    except BaseException as exc:  # noqa: BLE001
        raise CheckpointError(f"{file}: {what} ({_one_line(exc)})") from None


def _read_text(file: Path, max_bytes: int) -> str:
    return read_text(file, max_bytes, error=CheckpointError)


def read_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    """A ``tiktoken.model`` file's BPE ranks (lines ``base64-token rank``), read here (no cache):
    tokens unique, ranks unique and dense from 0, every single byte present (tiktoken's Rust core
    panics on a duplicate rank or a missing byte)."""
    raw = read_bounded(file, MAX_TEXT_BYTES, error=CheckpointError)
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}
    for no, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit() or len(parts[1]) > 12:
            raise CheckpointError(f"{file}: line {no}: expected 'base64-token rank', got {line[:60]!r}")
        try:
            token = base64.b64decode(parts[0], validate=True)
        except (binascii.Error, ValueError):
            raise CheckpointError(f"{file}: line {no}: {parts[0][:40]!r} is not base64") from None
        rank = int(parts[1])
        if not token:
            raise CheckpointError(f"{file}: line {no}: an empty token")
        if token in ranks:
            raise CheckpointError(f"{file}: line {no}: token {token[:20]!r} appears twice (lines {ranks[token]} "
                                  f"and {rank} as ranks)")
        if rank in seen:
            raise CheckpointError(f"{file}: line {no}: rank {rank} appears twice (lines {seen[rank]} and {no}): "
                                  "each BPE rank names one token")
        ranks[token], seen[rank] = rank, no
    if not ranks:
        raise CheckpointError(f"{file}: no BPE ranks (expected lines of 'base64-token rank')")
    if max(seen) != len(ranks) - 1:
        missing = next(i for i in range(len(ranks)) if i not in seen)
        raise CheckpointError(f"{file}: ranks must run 0..{len(ranks) - 1} without gaps; {missing} is missing")
    absent = [b for b in range(256) if bytes([b]) not in ranks]
    if absent:
        raise CheckpointError(f"{file}: {len(absent)} single byte(s) have no rank (first: {absent[0]:#04x}); "
                              "byte-level BPE needs all 256")
    return ranks


def _file(root: Path, name: str) -> Path | None:
    """``root / name`` when it is a file inside the checkpoint directory (a symlink leaving it is a
    CheckpointError), else None."""
    f = contained(root, name, f"{root}: tokenizer file")
    return f if f.is_file() else None


def _config(root: Path) -> dict[str, Any]:
    f = _file(root, "tokenizer_config.json")
    if f is None:
        return {}
    cfg = read_json(f, error=CheckpointError)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: expected a JSON object")
    _check_config(Fields(cfg, str(f)))
    return cfg


def _check_config(f: Fields) -> None:
    """The tokenizer_config.json keys quantplug reads have the types it reads them as (a wrong
    type is a ConfigError naming the key, never silently ignored)."""
    for key in ("bos_token", "eos_token"):
        v = f.raw(key)
        if isinstance(v, dict):
            tok = f.get_obj(key)
            assert tok is not None
            tok.get_str("content")
        elif v is not None:
            f.get_str(key)
    for _, tok in f.entries("added_tokens_decoder"):
        assert tok is not None
        tok.get_str("content")
    f.opt_str("pat_str")
    t = f.raw("chat_template")
    if isinstance(t, list):
        if not t:
            f.fail("chat_template", t, "a string or a non-empty list of {name, template} objects")
        for i, item in enumerate(t):
            if not isinstance(item, dict):
                f.fail(f"chat_template[{i}]", item, "an object with name and template")
            entry = Fields(item, f.file, f.sub(f"chat_template[{i}]"))
            entry.get_str("name")
            entry.get_str("template")
    elif t is not None:
        f.get_str("chat_template")


def _template(root: Path, cfg: dict[str, Any]) -> str | None:
    t = cfg.get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    if t is not None and not isinstance(t, str):
        raise CheckpointError(f"{root / 'tokenizer_config.json'}: chat_template = {t!r:.60}: expected a string or a "
                              "list of {name, template} objects")
    if isinstance(t, str):
        return t
    f = _file(root, "chat_template.jinja")
    return _read_text(f, MAX_TEXT_BYTES) if f is not None else None


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of checkpoint directory ``path``, or None when it carries none."""
    root = Path(path)
    cfg = _config(root)
    f = _file(root, "tokenizer.json")
    if f is not None:
        return Tokenizer.from_tokenizer_json(f, cfg, _template(root, cfg))
    f = _file(root, "tiktoken.model")
    if f is not None:
        return Tokenizer.from_tiktoken(f, cfg, _template(root, cfg))
    for f in sorted(root.glob("*.gguf")):
        contained(root, f.name, f"{root}: GGUF file")
        if "tokenizer.ggml.tokens" in read_gguf_tokenizer(f, keys_only=True):
            tok = Tokenizer.from_gguf(f, cfg)
            if _template(root, cfg):
                tok.chat_template = _template(root, cfg)
            return tok
    return None


def read_gguf_tokenizer(file: Path, keys_only: bool = False) -> dict[str, Any]:
    """Every ``tokenizer.*`` metadata value of a GGUF file, arrays decoded in full (the plan's
    header reader skips them). ``keys_only``: the keys present, values not decoded (None)."""
    import mmap

    import numpy as np

    from .checkpoint.gguf_index import _ARRAY, _SCALARS, _STRING, GGUF_MAGIC, MAX_KV, _Cursor

    out: dict[str, Any] = {}
    try:
        fh = open(file, "rb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot open ({exc.strerror})") from None
    with fh:
        try:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise CheckpointError(f"{file}: not a GGUF file (empty)") from None
        try:
            if bytes(buf[:4]) != GGUF_MAGIC:
                raise CheckpointError(f"{file}: not a GGUF file")
            cur = _Cursor(buf, file)
            cur.pos = 8
            cur.u64("the tensor count")
            n_kv = cur.u64("the metadata count")
            if n_kv > MAX_KV:
                raise CheckpointError(f"{file}: the header lists {n_kv:,} metadata entries; at most {MAX_KV:,}")
            for i in range(n_kv):
                key = cur.string(f"metadata key #{i}")
                vtype = cur.u32(f"metadata {key} (type)")
                if not key.startswith("tokenizer.") or keys_only or vtype != _ARRAY:
                    value = cur.value(vtype, key, not keys_only and key.startswith("tokenizer."))
                    if key.startswith("tokenizer."):
                        out[key] = None if keys_only else value
                    continue
                etype = cur.u32(f"metadata {key} (array type)")
                count = cur.u64(f"metadata {key} (array length)")
                check_count(count, _SCALARS[etype][1] if etype in _SCALARS else 8, cur.size - cur.pos,
                            f"metadata {key} (array length)", file)
                if etype == _STRING:
                    out[key] = [cur.string(f"metadata {key}[{j}]") for j in range(count)]
                elif etype in _SCALARS:
                    fmt, size = _SCALARS[etype]
                    cur.need(count * size, f"metadata {key}")
                    out[key] = np.frombuffer(buf, dtype=np.dtype(fmt), count=count, offset=cur.pos).tolist()
                    cur.pos += count * size
                else:
                    raise CheckpointError(f"{file}: metadata {key}: array of type {etype} is not a tokenizer field")
        finally:
            buf.close()
    return out
