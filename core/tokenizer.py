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
GGUF's ``tokenizer.chat_template``) is rendered with jinja2's sandbox, as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import CheckpointError

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
        try:
            self._tk = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise CheckpointError(f"{file}: not a tokenizers file ({exc})") from None
        self._specials = {int(i) for i, tok in self._tk.get_added_tokens_decoder().items() if tok.special}
        return self

    @classmethod
    def from_tiktoken(cls, file: Path, config: dict[str, Any], template: str | None) -> Tokenizer:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self = cls("tiktoken.model", file, config, template)
        try:
            ranks = load_tiktoken_bpe(str(file))
        except Exception as exc:
            raise CheckpointError(f"{file}: not a tiktoken BPE file (lines of 'base64-token rank'): {exc}") from None
        n = len(ranks)
        named = {int(i): _token_str(t) for i, t in (config.get("added_tokens_decoder") or {}).items()}
        specials = {(named.get(i) or f"<|reserved_token_{i}|>"): i for i in range(n, n + KIMI_RESERVED)}
        pattern = str(config["pat_str"]) if isinstance(config.get("pat_str"), str) else KIMI_PATTERN
        self._tt = tiktoken.Encoding(name=file.parent.name or "tiktoken", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=specials)
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
        self.config = {**config, **{k: meta[k] for k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
                                    if k in meta}}
        return self

    # -- use ----------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids. ``add_special_tokens``:
        the tokenizer.json post-processor's BOS etc. (off for rendered chat templates, which hold them)."""
        if self._tt is not None:
            return list(self._tt.encode(text, allowed_special="all"))
        return list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._specials]
        if self._tt is not None:
            return self._tt.decode(ids)  # invalid UTF-8 (a split character) becomes U+FFFD
        return str(self._tk.decode(ids, skip_special_tokens=False))

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` ([{"role": ..., "content": ...}])."""
        if not self.chat_template:
            raise CheckpointError(f"{self.path.parent}: no chat template (tokenizer_config.json 'chat_template', "
                                  "chat_template.jinja or the GGUF's tokenizer.chat_template)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                      ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=_token_str(self.config.get("bos_token")) or "",
                eos_token=_token_str(self.config.get("eos_token")) or "")
        except TemplateError as exc:
            raise CheckpointError(f"{self.path.parent}: chat template failed: {exc}") from None


def _config(root: Path) -> dict[str, Any]:
    f = root / "tokenizer_config.json"
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{f}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: expected a JSON object")
    return cfg


def _template(root: Path, cfg: dict[str, Any]) -> str | None:
    t = cfg.get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    if isinstance(t, str):
        return t
    f = root / "chat_template.jinja"
    return f.read_text(encoding="utf-8") if f.is_file() else None


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of checkpoint directory ``path``, or None when it carries none."""
    root = Path(path)
    cfg = _config(root)
    if (root / "tokenizer.json").is_file():
        return Tokenizer.from_tokenizer_json(root / "tokenizer.json", cfg, _template(root, cfg))
    if (root / "tiktoken.model").is_file():
        return Tokenizer.from_tiktoken(root / "tiktoken.model", cfg, _template(root, cfg))
    for f in sorted(root.glob("*.gguf")):
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

    from .checkpoint.gguf_index import _ARRAY, _SCALARS, _STRING, GGUF_MAGIC, _Cursor

    out: dict[str, Any] = {}
    with open(file, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if bytes(buf[:4]) != GGUF_MAGIC:
                raise CheckpointError(f"{file}: not a GGUF file")
            cur = _Cursor(buf, file)
            cur.pos = 8
            cur.u64("the tensor count")
            n_kv = cur.u64("the metadata count")
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
