"""Bounded, typed reading of untrusted checkpoint metadata (JSON files, GGUF keys, file names).

Everything quantplug parses itself goes through here: JSON is size- and depth-bounded before it
is decoded, values are read through :class:`Fields`, which checks type and range (a ``NaN`` /
``Infinity`` literal, which Python's json accepts, fails there, named by its key path) and names
the file and key path on failure, and every file name taken from a
checkpoint's own metadata is resolved with :func:`contained` (no ``..``, no absolute paths, no
symlink leaving the directory).

Why hand-written and not pydantic: pydantic is not installed here (transformers 5 does not pull it
in), a model class per config spelling would not read better than the ``Fields`` calls in
``models/config.py``, and every message must carry the file and the key path in quantplug's
wording; the helper is ~100 lines.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

from .errors import CheckpointError, ConfigError

#: largest JSON file read (config.json, sidecars, the shard index)
MAX_JSON_BYTES = 64 << 20
#: deepest nesting of objects / arrays accepted in any JSON file
MAX_JSON_DEPTH = 32
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def json_depth_ok(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``text``'s arrays / objects nest at most ``limit`` deep (scanned before parsing)."""
    if text.count("{") + text.count("[") <= limit:
        return True  # cannot nest deeper than the number of openers (the common case: C speed)
    depth = 0
    for ch in re.sub(r"[^\[\]{}]", "", _STRINGS.sub("", text)):
        depth += 1 if ch in "[{" else -1
        if depth > limit:
            return False
    return True


def read_bounded(path: Path, max_bytes: int, *, error: type[Exception] = ConfigError, what: str = "") -> bytes:
    """A file's bytes, its size checked against ``max_bytes`` before it is read; failures name the file."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
            raise error(f"{path}: {_special(st.st_mode)}, not a regular file")
        size = st.st_size
        if size > max_bytes:
            raise error(f"{path}: {size:,} bytes, more than the {max_bytes:,} accepted{what}")
        return path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None


def read_text(path: Path, max_bytes: int, *, error: type[Exception] = ConfigError, what: str = "") -> str:
    """:func:`read_bounded`, decoded as UTF-8 (an invalid byte: ``error`` naming the file and its offset)."""
    raw = read_bounded(path, max_bytes, error=error, what=what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def read_json(path: Path, *, error: type[Exception] = ConfigError, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file with its size and nesting bounded first; failures name the file."""
    text = read_text(path, max_bytes, error=error, what=" for a JSON file")
    if not json_depth_ok(text):
        raise error(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise error(f"{path}: key {exc.args[0]!r} appears twice in one JSON object (which one a reader "
                    "takes differs between parsers)") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {_json_problem(exc.msg)}") from None
    except (ValueError, RecursionError):
        raise error(f"{path}: not valid JSON") from None


#: the JSON decoder's messages, said in our words (its own text is Python's, not the user's)
_JSON_PROBLEMS = (
    ("Expecting value", "expected a value"),
    ("Expecting property name", "expected a key in double quotes"),
    ("Expecting ',' delimiter", "expected ',' or the end of the object or list"),
    ("Expecting ':' delimiter", "expected ':' after a key"),
    ("Unterminated string", "a string is not closed"),
    ("Invalid control character", "a control character inside a string"),
    ("Invalid \\escape", "an invalid escape sequence"),
    ("Invalid \\u", "an invalid \\u escape"),
    ("Extra data", "more text after the JSON value"),
)


#: the regular-expression compiler's messages, said in our words
_REGEX_PROBLEMS = (
    ("unterminated character set", "a [ set is not closed"),
    ("missing ), unterminated subpattern", "a ( group is not closed"),
    ("unbalanced parenthesis", "a ) without its ("),
    ("nothing to repeat", "a repeat (*, +, ?, {n}) with nothing before it"),
    ("multiple repeat", "two repeats in a row"),
    ("bad escape", "an unknown backslash escape"),
    ("bad character range", "a character range whose end is before its start"),
    ("look-behind requires fixed-width pattern", "a look-behind of variable width"),
    ("unknown extension", "an unknown (? extension"),
    ("missing -, : or )", "an unfinished (? flag group"),
    ("missing group name", "a group without its name"),
    ("unknown group name", "a reference to an unknown group"),
    ("invalid group reference", "a reference to an unknown group"),
)


def regex_problem(exc: BaseException) -> str:
    """What is wrong with a pattern ``re.compile`` refused, in our words, with the position."""
    if not isinstance(exc, re.error):
        return "too deeply nested or too large"
    what = next((ours for theirs, ours in _REGEX_PROBLEMS if exc.msg.startswith(theirs)), "malformed")
    return what if exc.pos is None else f"{what}, at position {exc.pos}"


def _json_problem(msg: str) -> str:
    return next((ours for theirs, ours in _JSON_PROBLEMS if msg.startswith(theirs)), "malformed")


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: a JSON object with a repeated key is an error, not "last one wins"
    (a 45,000-entry index costs ~9 ms more than plain ``json.loads``)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


def contained(root: Path, name: Any, what: str) -> Path:
    """``root / name`` after checking that ``name`` (taken from checkpoint metadata) is a plain
    relative path that, symlinks resolved, stays inside ``root``."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{what}: file name {name!r} is not a non-empty string")
    parts = re.split(r"[\\/]", name)
    if len(name) > 4096 or any(len(part.encode()) > 255 for part in parts):
        raise CheckpointError(f"{what}: file name {name[:80]!r}... is longer than a file system allows")
    p = Path(name)
    if p.is_absolute() or name.startswith(("/", "\\")) or ".." in parts:
        raise CheckpointError(f"{what}: file name {name!r} must be relative to the checkpoint directory "
                              "(no absolute path, no '..')")
    full = root / p
    if len(parts) == 1:  # fast path (one lstat): a plain file directly in root cannot leave it
        try:
            mode = os.lstat(full).st_mode
        except OSError:
            return full  # absent: whoever opens it reports that
        if not stat.S_ISLNK(mode):
            _not_special(full, mode, what)
            return full
    base = Path(os.path.realpath(root))
    real = Path(os.path.realpath(full))
    if real != base and base not in real.parents:
        raise CheckpointError(f"{what}: {name!r} resolves to {real}, outside the checkpoint directory {base} "
                              "(a symlink leaving the directory)")
    with contextlib.suppress(OSError):  # absent or unreadable: whoever opens it reports that
        _not_special(full, os.stat(full).st_mode, what)
    return full


def _special(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file")


def _not_special(full: Path, mode: int, what: str) -> None:
    """A FIFO, socket or device where a file is expected is refused before anything opens it (opening
    a FIFO blocks until a writer comes; a device never ends)."""
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode) and not stat.S_ISLNK(mode):
        raise CheckpointError(f"{what}: {full.name!r} is {_special(mode)}, not a regular file")


def check_inside(root: Path, files: Iterable[Path], what: str) -> None:
    """Every file (found by globbing ``root``) resolves inside ``root`` (symlinks followed)."""
    for f in files:
        contained(root, f.name, what)



#: (file name, key path) of every key read through :class:`Fields` while :func:`recording_reads`
#: is active (tests and the fuzz suite: a key the base reads but a mutated run does not read any
#: more was bypassed, a value skipped without being validated)
_reads: set[tuple[str, str]] | None = None


@contextlib.contextmanager
def recording_reads() -> Iterator[set[tuple[str, str]]]:
    """Collect (file name, key path) of every key read through :class:`Fields` in this block."""
    global _reads
    saved, _reads = _reads, set()
    try:
        yield _reads
    finally:
        _reads = saved


class Fields:
    """Typed, range-checked reads from one JSON object; failures name ``file`` and the key path.

    The one way quantplug and its plugins read checkpoint metadata (``quantplug.api.Fields``):
    every reader either returns a value of the promised type and range, or raises a
    :class:`ConfigError` such as ``/ckpt/config.json: quantization_config.exclude[2] = 're:[':
    expected a valid regular expression (a [ set is not closed, at position 0)``. A key that
    is absent (or ``null``) takes the default given; a present value of another type is never
    replaced by a default.
    """

    def __init__(self, data: Mapping[str, Any], file: str, path: str = "") -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{file}: {path or '(top level)'}: expected an object, got {_kind(data)}")
        self.data, self.file, self.path = data, file, path

    def _note(self, key: str) -> None:
        if _reads is not None:
            _reads.add((os.path.basename(self.file), self.sub(key)))

    def sub(self, key: str | int) -> str:
        """The key path of ``key`` under this object (``a.b``, ``a.b[3]``)."""
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path + '.' if self.path else ''}{key}"

    def where(self, key: str | int) -> str:
        return f"{self.file}: {self.sub(key)}"

    def fail(self, key: str | int, value: Any, expected: str) -> NoReturn:
        raise ConfigError(f"{self.where(key)} = {_short(value)}: expected {expected}")

    def has(self, key: str) -> bool:
        self._note(key)
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        self._note(key)
        v = self.data.get(key)
        return default if v is None else v

    def get_int(self, key: str, lo: int, hi: int, default: Any = ConfigError) -> int:
        self._note(key)
        v = self.data.get(key)
        if v is None:
            if default is ConfigError:
                raise ConfigError(f"{self.where(key)} is missing: expected an integer in [{lo}, {hi}]")
            return int(default)
        if isinstance(v, float) and v.is_integer() and lo <= v <= hi:
            v = int(v)  # 4096.0 in a hand-edited config
        if type(v) is not int or not lo <= v <= hi:
            self.fail(key, v, f"an integer in [{lo}, {hi}]")
        return v

    def opt_int(self, key: str, lo: int, hi: int) -> int | None:
        self._note(key)
        return None if self.data.get(key) is None else self.get_int(key, lo, hi)

    def get_float(self, key: str, lo: float, hi: float, default: Any = ConfigError, *, open_lo: bool = False) -> float:
        self._note(key)
        v = self.data.get(key)
        if v is None:
            if default is ConfigError:
                raise ConfigError(f"{self.where(key)} is missing: expected a number")
            return float(default)
        ok = type(v) in (int, float) and math.isfinite(v) and (lo < v if open_lo else lo <= v) and v <= hi
        if not ok:
            self.fail(key, v, f"a finite number in {'(' if open_lo else '['}{lo:g}, {hi:g}]")
        return float(v)

    def opt_float(self, key: str, lo: float, hi: float, *, open_lo: bool = False) -> float | None:
        self._note(key)
        return None if self.data.get(key) is None else self.get_float(key, lo, hi, open_lo=open_lo)

    def get_bool(self, key: str, default: bool) -> bool:
        self._note(key)
        v = self.data.get(key)
        if v is None:
            return default
        if type(v) is not bool:
            self.fail(key, v, "true or false")
        return v

    def get_str(self, key: str, default: Any = ConfigError, choices: Iterable[str] | None = None) -> str:
        self._note(key)
        v = self.data.get(key)
        if v is None:
            if default is ConfigError:
                raise ConfigError(f"{self.where(key)} is missing: expected a string")
            return str(default)
        allowed = tuple(choices) if choices is not None else None
        if type(v) is not str or (allowed is not None and v not in allowed):
            self.fail(key, v, f"one of {', '.join(map(repr, allowed))}" if allowed else "a string")
        return v

    def get_obj(self, key: str, required: bool = False) -> Fields | None:
        self._note(key)
        v = self.data.get(key)
        if v is None:
            if required:
                raise ConfigError(f"{self.where(key)} is missing: expected an object")
            return None
        if not isinstance(v, dict):
            self.fail(key, v, "an object")
        return Fields(v, self.file, self.sub(key))

    # -- readers for plugin configs (contract 1.4) -------------------------------------------------

    def opt_str(self, key: str, choices: Iterable[str] | None = None) -> str | None:
        """A string (one of ``choices``) or None when absent / null."""
        self._note(key)
        return None if self.data.get(key) is None else self.get_str(key, choices=choices)

    def str_list(self, key: str, *, single: bool = False, nonempty_items: bool = True) -> tuple[str, ...]:
        """A list of strings (``single``: a lone string counts as a list of one); absent: ``()``."""
        self._note(key)
        v = self.data.get(key)
        if v is None:
            return ()
        if single and isinstance(v, str):
            v = [v]
        if not isinstance(v, list):
            self.fail(key, v, "a list of strings" + (" or a string" if single else ""))
        for i, x in enumerate(v):
            if type(x) is not str or (nonempty_items and not x):
                raise ConfigError(f"{self.where(key)}[{i}] = {_short(x)}: expected a non-empty string")
        return tuple(v)

    def int_list(self, key: str, lo: int, hi: int, length: int | None = None) -> tuple[int, ...] | None:
        """A list of integers in [lo, hi] (of ``length`` items); absent: None."""
        self._note(key)
        v = self.data.get(key)
        if v is None:
            return None
        ok = (isinstance(v, list) and (length is None or len(v) == length)
              and all(type(x) is int and lo <= x <= hi for x in v))
        if not ok:
            n = f"{length} " if length is not None else ""
            self.fail(key, v, f"a list of {n}integers in [{lo}, {hi}]")
        return tuple(v)

    def opt_obj(self, key: str) -> Fields | None:
        self._note(key)
        return self.get_obj(key)

    def obj_or_list(self, key: str) -> list[Fields] | None:
        """An object, or a list of objects (each read as its own Fields); absent: None."""
        self._note(key)
        v = self.data.get(key)
        if v is None:
            return None
        if isinstance(v, dict):
            return [Fields(v, self.file, self.sub(key))]
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            return [Fields(x, self.file, f"{self.sub(key)}[{i}]") for i, x in enumerate(v)]
        self.fail(key, v, "an object or a non-empty list of objects")

    def entries(self, key: str, *, nullable: bool = False) -> list[tuple[str, Fields | None]]:
        """An object whose values are objects (``nullable``: or null), as (name, Fields) pairs in
        file order; absent: ``[]``."""
        self._note(key)
        v = self.data.get(key)
        if v is None:
            return []
        if not isinstance(v, dict):
            self.fail(key, v, "an object of objects")
        out: list[tuple[str, Fields | None]] = []
        for name, x in v.items():
            path = f"{self.sub(key)}.{name}"
            if x is None and nullable:
                out.append((name, None))
            elif isinstance(x, dict):
                out.append((name, Fields(x, self.file, path)))
            else:
                raise ConfigError(f"{self.file}: {path} = {_short(x)}: expected an object"
                                  + (" or null" if nullable else ""))
        return out

    def regex(self, key: str | int, pattern: str) -> re.Pattern[str]:
        """``pattern`` (the value at ``key``, e.g. a ``re:`` entry without its prefix) compiled; a
        ConfigError naming the key path when it is not a valid regular expression."""
        try:
            return re.compile(pattern)
        except (re.error, RecursionError, OverflowError, ValueError) as exc:
            raise ConfigError(f"{self.where(key)} = {_short(pattern)}: expected a valid regular expression "
                              f"({regex_problem(exc)})") from None

    def expect(self, cond: bool, key: str, expected: str) -> None:
        """Fail naming ``key`` (and its value) unless ``cond``: a cross-field rule."""
        if not cond:
            self.fail(key, self.data.get(key), expected)


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def quant_config_fields(config: Mapping[str, Any], file: str) -> tuple[Fields | None, str]:
    """``quantization_config`` of config.json (or, Kimi wrappers, of its ``text_config``) as
    :class:`Fields`, with where it was found (``"quantization_config"`` or
    ``"text_config.quantization_config"``); ``(None, "")`` when there is none. A value that is not
    an object, or a ``quant_method`` that is not a string, is a :class:`ConfigError`; so are both
    places holding different configs (Kimi releases repeat the same one in both; which of two
    different ones the weights follow cannot be told)."""
    top = Fields(config, file)
    text = top.get_obj("text_config")
    outer = top.get_obj("quantization_config")
    inner = text.get_obj("quantization_config") if text is not None else None
    if outer is not None and inner is not None and outer.data != inner.data:
        raise ConfigError(f"{file}: quantization_config and text_config.quantization_config differ; quantplug will "
                          "not guess which one the weights follow")
    found = outer if outer is not None else inner
    if found is None:
        return None, ""
    found.opt_str("quant_method")
    return found, found.path


def check_count(n: int, unit: int, available: int, what: str, file: Path, fmt: str = "GGUF") -> None:
    """A count read from a file must fit the bytes left (``unit`` bytes each at least) before
    anything is allocated or looped for it."""
    if n < 0 or n * unit > available:
        raise CheckpointError(f"{file}: truncated {fmt} header (or a corrupt count): {what} = {n:,} needs at "
                              f"least {n * unit:,} bytes, {available:,} are left")
