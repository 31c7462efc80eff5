"""Frozen values that cross the hook boundary.

Every value validates itself in ``__post_init__`` so a plugin that returns something malformed
fails at the hook call, with the plugin named, not later inside the loader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._version import __version__
from .errors import QuantplugError

#: safetensors dtype names we understand -> the name of their torch dtype (the one dtype table;
#: ``quantplug.api.TORCH_DTYPES`` resolves it to torch dtypes)
TORCH_DTYPE_NAMES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}
SAFETENSORS_DTYPES = tuple(TORCH_DTYPE_NAMES)
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_INT = {int}


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise QuantplugError(what)


@dataclass(frozen=True)
class PluginInfo:
    """Who answered: the entry-point name, its distribution and version ("core" for defaults)."""

    name: str
    distribution: str = ""
    version: str = ""

    def __post_init__(self) -> None:
        _need(bool(self.name), "PluginInfo.name must be non-empty")

    def __str__(self) -> str:
        if self.distribution:
            return f"{self.name} ({self.distribution} {self.version})".rstrip()
        return self.name


CORE = PluginInfo("core", "quantplug", __version__)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, known from headers only.

    ``dtype`` is the safetensors dtype name ("F32", "U8", ...) or, for GGUF, the ggml type name
    ("Q4_0", "F16", ...). ``shape`` is in PyTorch order (GGUF's ``ne`` reversed). ``offset`` is the
    absolute byte offset of the data in ``file``; ``nbytes`` its length.
    """

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    format: Literal["safetensors", "gguf"] = "safetensors"
    #: the name as stored in the file, when a backend's ``quantplug_tensor_names`` renamed it
    stored_name: str | None = None

    def __post_init__(self) -> None:
        _need(bool(self.name), "TensorInfo.name must be non-empty")
        # set(map(type, ...)): C-speed check; plans build tens of thousands of these
        _need(set(map(type, self.shape)) <= _INT and (not self.shape or min(self.shape) >= 0),
              f"tensor {self.name!r}: shape {self.shape} must be non-negative ints")
        _need(self.offset >= 0 and self.nbytes >= 0, f"tensor {self.name!r}: bad byte range")

    @classmethod
    def trusted(cls, name: str, file: Path, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int,
                fmt: Literal["safetensors", "gguf"] = "safetensors") -> TensorInfo:
        """Construct without re-validating: for the core's header readers, whose input the file
        format library (or the reader itself) has already checked. A 61-layer, 256-expert
        checkpoint has ~45,000 tensors; this keeps indexing them cheap."""
        obj = object.__new__(cls)
        obj.__dict__.update(name=name, file=file, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes,
                            format=fmt, stored_name=None)
        return obj

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def label(self) -> str:
        """The stored name, with the model name it was mapped to (if renamed)."""
        return f"{self.stored_name} (as {self.name})" if self.stored_name else self.name

    def where(self) -> str:
        return f"{self.label} in {self.file.name}"


@dataclass(frozen=True)
class Claim:
    """A backend's claim on a checkpoint: which backend, its parsed (frozen) config, and why."""

    backend: str
    quant_config: Any
    reason: str
    plugin: PluginInfo | None = None

    def __post_init__(self) -> None:
        _need(bool(self.backend), "Claim.backend must name the backend")
        _need(bool(self.reason), f"Claim by {self.backend!r} must give a reason")


@dataclass(frozen=True)
class AttentionLayout:
    """How one MLA layer's key/value up-projection is stored.

    ``dense``: one ``kv_b_proj`` [n_head*(nope+v), kv_lora]. ``split_kv``: llama.cpp's
    ``k_b`` [n_head, kv_lora, nope] and ``v_b`` [n_head, v, kv_lora] (GGUF ``attn_k_b`` /
    ``attn_v_b``); the checkpoint names of those tensors are given.
    """

    kind: Literal["dense", "split_kv"]
    reason: str
    k_b: str | None = None
    v_b: str | None = None

    def __post_init__(self) -> None:
        _need(self.kind in ("dense", "split_kv"), f"AttentionLayout.kind {self.kind!r} unknown")
        if self.kind == "split_kv":
            _need(bool(self.k_b and self.v_b), "split_kv layout must name its k_b and v_b tensors")


@dataclass(frozen=True)
class Decision:
    """One answered hook, recorded with who answered it."""

    hook: str
    target: str
    value: Any
    plugin: PluginInfo
    reason: str = ""

    def describe(self) -> str:
        return f"{self.hook}[{self.target}] = {self.value} (by {self.plugin}){': ' + self.reason if self.reason else ''}"


Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """Something wrong with a plan. Errors stop the load; warnings are reported in the plan."""

    message: str
    tensor: str | None = None
    file: str | None = None
    layer: str | None = None
    plugin: PluginInfo | None = None
    severity: Severity = "error"
    kind: str = "backend"

    def __post_init__(self) -> None:
        _need(bool(self.message), "Problem.message must be non-empty")
        _need(self.severity in ("error", "warning"), f"Problem.severity {self.severity!r}")

    def describe(self) -> str:
        where = []
        if self.tensor:
            where.append(f"tensor {self.tensor}")
        if self.layer and not self.tensor:
            where.append(f"layer {self.layer}")
        if self.file:
            where.append(f"file {self.file}")
        by = f" [{self.plugin}]" if self.plugin else ""
        loc = f"{', '.join(where)}: " if where else ""
        return f"{loc}{self.message}{by}"


@dataclass(frozen=True)
class TensorSpec:
    """What a scheme expects of one checkpoint tensor feeding one parameter.

    ``dtypes``: accepted stored dtype names. ``shape``: expected stored shape, or None when the
    scheme checks it itself in ``check``. ``optional``: may be absent. ``target``: dtype name the
    parameter holds in memory (None: floats become the model dtype, others stay as stored).
    """

    suffix: str
    dtypes: tuple[str, ...]
    shape: tuple[int, ...] | None
    optional: bool = False
    target: str | None = None

    def __post_init__(self) -> None:
        _need(bool(self.dtypes), f"TensorSpec {self.suffix!r} must accept at least one dtype")


@dataclass(frozen=True)
class SkipRule:
    """A rule that removes checkpoint tensors from the load on purpose, listed in the plan."""

    name: str
    pattern: str
    reason: str


#: value types an option may declare
OPTION_TYPES: tuple[type, ...] = (bool, int, float, str, list)
_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a JSON list"}
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


@dataclass(frozen=True)
class OptionSpec:
    """One option a backend (or the core) reads: its name, value type, default, allowed values
    and one line of help. ``quantplug_options`` returns these; the plan checks every given
    option against them (an unknown name or an ill-typed value is a ``ConfigError`` naming the
    option, what was expected and who declares it) and hands hooks the converted values, with
    the defaults of the options not given.

    ``type``: ``bool``, ``int``, ``float`` (an int is accepted), ``str`` or ``list`` (a list or
    tuple, handed to hooks as a tuple); a string
    value (``-o KEY=VALUE`` on the command line) is converted by it (``true`` / ``false``,
    ``8``, ``0.5``, a JSON list). ``minimum`` / ``maximum``: bounds of a number. ``scope``:
    ``"load"`` (``load`` / ``plan`` ``options=``) or ``"export"`` (``quantplug_export``'s
    ``options``).

    .. versionadded:: 1.4
    """

    name: str
    type: type
    default: Any
    choices: tuple[Any, ...] | None = None
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    scope: Literal["load", "export"] = "load"

    def __post_init__(self) -> None:
        _need(isinstance(self.name, str) and self.name.isidentifier(),
              f"OptionSpec.name {self.name!r} must be an identifier (letters, digits, underscores)")
        _need(self.type in OPTION_TYPES, f"option {self.name}: type {self.type!r} must be one of "
              f"{', '.join(t.__name__ for t in OPTION_TYPES)}")
        _need(self.scope in ("load", "export"), f"option {self.name}: scope {self.scope!r} must be 'load' or 'export'")
        if self.choices is not None:
            object.__setattr__(self, "choices", tuple(self.choices))
            _need(bool(self.choices), f"option {self.name}: choices must not be empty")
            for c in self.choices:
                self._typed(c)
        if self.default is not None:
            if self.type is list:
                object.__setattr__(self, "default", tuple(self.default))  # frozen: a default is shared
            self.check(self.default)  # a default outside its own rules is the declaring plugin's bug

    def expected(self) -> str:
        """What a value must be, in words (for messages and ``quantplug plugins --options``)."""
        if self.choices is not None:
            return "one of " + ", ".join(map(repr, self.choices))
        words = _TYPE_WORDS[self.type]
        if self.minimum is not None and self.maximum is not None:
            return f"{words} in [{self.minimum:g}, {self.maximum:g}]"
        if self.minimum is not None:
            return f"{words} >= {self.minimum:g}"
        if self.maximum is not None:
            return f"{words} <= {self.maximum:g}"
        return words

    def _typed(self, value: Any) -> bool:
        t = self.type
        if t is bool:
            return type(value) is bool
        if t is int:
            return type(value) is int
        if t is float:
            return type(value) in (int, float) and math.isfinite(value)
        if t is list:
            return type(value) in (list, tuple)
        return type(value) is t

    def convert(self, value: Any) -> Any:
        """``value`` as this option's type (strings parsed by the type), or ``ValueError`` saying
        what was expected."""
        if isinstance(value, str):
            value = str(value)  # a str subclass (the CLI's text) is plain text here
        if isinstance(value, str) and self.type is not str:
            text = value.strip()
            try:
                if self.type is bool:
                    value = _BOOL_WORDS[text.lower()]
                elif self.type is int:
                    value = int(text, 10)
                elif self.type is float:
                    value = float(text)
                else:
                    import json

                    value = json.loads(text)
            except (KeyError, ValueError):
                raise ValueError(self.expected()) from None
        elif self.type is float and type(value) is int:
            value = float(value)
        self.check(value)
        if self.type is list:
            return tuple(value)  # immutable: one plan's options are shared by every hook
        return float(value) if self.type is float else value

    def check(self, value: Any) -> None:
        if not self._typed(value):
            raise ValueError(self.expected())
        if self.choices is not None and value not in self.choices:
            raise ValueError(self.expected())
        if self.type in (int, float) and ((self.minimum is not None and value < self.minimum)
                                          or (self.maximum is not None and value > self.maximum)):
            raise ValueError(self.expected())


@dataclass(frozen=True)
class ExportResult:
    """What ``quantplug_export`` wrote."""

    path: Path
    format: str
    files: tuple[Path, ...] = field(default_factory=tuple)
