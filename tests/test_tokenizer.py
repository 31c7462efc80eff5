"""Tokenizers from the checkpoint directory: tokenizer.json, Kimi tiktoken.model, a GGUF's embedded
vocabulary; round trips, special tokens, chat templates. Every file is built here, tiny."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from quantplug.errors import CheckpointError
from quantplug.tokenizer import load_tokenizer, read_gguf_tokenizer

TEXTS = ["Hello, world!", "hello hello  wide  world\n\nnext line\t tab", "café naïve 日本語 🎉 x=1234567",
         "I'll say don't"]
CORPUS = ["hello world, hello there, the world is wide", "say hello to the wide world"] * 20
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_wordlevel_tokenizer(root: Path, vocab_size: int) -> Path:
    """tokenizer.json mapping words "w0".."w{n-1}" to ids 0..n-1 (whitespace split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tk.save(str(root / "tokenizer.json"))
    return root / "tokenizer.json"


def trained_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|bos|>", "<|end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tk


def test_tokenizer_json_round_trip_and_chat_template(tmp_path):
    tk = trained_bpe()
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": {"content": "<|end|>"}, "chat_template": TEMPLATE}))
    tok = load_tokenizer(tmp_path)
    assert tok is not None and tok.source == "tokenizer.json"
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == tk.encode(text).ids and tok.decode(ids) == text
    chat = tok.render_chat([{"role": "user", "content": "hello"}])
    assert chat == "<|bos|><|user|>hello<|end|><|assistant|>"
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids[0] == tk.token_to_id("<|bos|>") and tk.token_to_id("<|end|>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "<|user|>hello<|assistant|>"


def test_no_tokenizer_is_none_and_bad_file_is_named(tmp_path):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json: not a tokenizers file"):
        load_tokenizer(tmp_path)


def write_tiktoken(root: Path) -> dict[bytes, int]:
    """A tiny tiktoken BPE file: the 256 bytes, then merges of frequent pairs (rank = merge order)."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world", b"\xe6\x97", b"\xe6\x97\xa5"):
        ranks[word] = len(ranks)
    (root / "tiktoken.model").write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    return ranks


def test_tiktoken_model_with_kimi_specials_and_pattern(tmp_path):
    ranks = write_tiktoken(tmp_path)
    n = len(ranks)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n): {"content": "[BOS]", "special": True},
                                 str(n + 1): {"content": "[EOS]", "special": True},
                                 str(n + 3): {"content": "<|im_end|>", "special": True}},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": TEMPLATE}))
    tok = load_tokenizer(tmp_path)
    assert tok is not None and tok.source == "tiktoken.model"
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hello world") == [ranks[b"hello"], ranks[b" world"]]
    # Kimi's pattern keeps Han runs apart from Latin words: 日 is one merged token
    assert tok.encode("日x") == [ranks[b"\xe6\x97\xa5"], ord("x")]
    # specials: named ones from added_tokens_decoder, the rest of the 256 reserved ids by number
    assert tok.encode("[BOS]hello<|im_end|>") == [n, ranks[b"hello"], n + 3]
    assert tok.encode(f"<|reserved_token_{n + 2}|>") == [n + 2]
    assert tok.decode([n, ranks[b"hello"], n + 1], skip_special_tokens=True) == "hello"
    assert tok.render_chat([{"role": "user", "content": "hi"}]).startswith("[BOS]<|user|>hi")


def _unicode_bytes() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_gguf_vocab(path: Path, tk, pre: str, template: str | None = None) -> None:
    from gguf import GGUFWriter

    state = json.loads(tk.to_str())
    vocab = state["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    specials = {a["id"] for a in state["added_tokens"] if a["special"]}
    w = GGUFWriter(str(path), "deepseek2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_bos_token_id(vocab["<|bos|>"])
    if template:
        w.add_chat_template(template)
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", ["default", "deepseek-v3"])
def test_gguf_vocabulary_round_trip(tmp_path, pre):
    tk = trained_bpe()
    write_gguf_vocab(tmp_path / "model.gguf", tk, pre, TEMPLATE)
    tok = load_tokenizer(tmp_path)
    assert tok is not None and tok.source == "gguf"
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        if pre == "default":  # same vocabulary, merges and GPT-2 split: the same ids as the source
            assert ids == tk.encode(text).ids
    assert tok.encode("<|end|>hello") [0] == tk.token_to_id("<|end|>")
    assert tok.render_chat([{"role": "user", "content": "x"}]).endswith("<|assistant|>")
    meta = read_gguf_tokenizer(tmp_path / "model.gguf")
    assert meta["tokenizer.ggml.pre"] == pre and len(meta["tokenizer.ggml.tokens"]) == tk.get_vocab_size()


def test_gguf_without_bpe_vocabulary_is_refused_by_name(tmp_path):
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "m.gguf"), "deepseek2")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"m.gguf: tokenizer.ggml.model = 'llama'"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("merge", ["<a> <b>", "<a><b>", "<a> <zz>"])
def test_gguf_merges_outside_the_vocabulary_are_named_not_a_panic(tmp_path, merge):
    """A merge whose parts or result are not vocabulary tokens made the tokenizers library panic
    (a BaseException no handler caught, a raw traceback from the CLI): now a CheckpointError."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "m.gguf"), "deepseek2")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<a>", "<b>", "c"])
    w.add_token_merges([merge])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"m.gguf: tokenizer.ggml.merges\[0\]"):
        load_tokenizer(tmp_path)
