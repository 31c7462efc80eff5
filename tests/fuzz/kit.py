"""Tiny checkpoints of every kind the fuzz suite and the untrusted-input tests mutate."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import torch
from quantplug.models.config import parse_model_config
from quantplug.testing import random_state, tiny_config, write_checkpoint

VENDOR = Path(__file__).parents[1] / "data" / "vendor"
IDS = torch.tensor([[3, 17, 42, 99, 5, 150]])


def dense(root: Path, shards: int = 2, **overrides) -> Path:
    cfg = tiny_config(**overrides)
    return write_checkpoint(root, cfg, random_state(cfg), shards=shards)


def gguf(root: Path, **overrides) -> Path:
    from quantplug_expert_pack.export import gguf_state, write_gguf

    cfg = tiny_config(**overrides)
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    write_gguf(root / "model.gguf", gguf_state(random_state(cfg), mc), mc, default_type="Q8_0",
               types={"attn_k_b": "Q4_0"}, vocab=cfg["vocab_size"])  # a vocabulary: the read level decodes it
    return root


def packed(root: Path) -> Path:
    from quantplug_expert_pack.build import build_pack

    gguf(root)
    build_pack(root, progress=False)
    return root


def vendor(root: Path, name: str, drop: tuple[str, ...] = ()) -> Path:
    """A copy of vendor fixture ``name`` (``drop``: files left out, e.g. ModelOpt's sidecar)."""
    shutil.copytree(VENDOR / name, root, ignore=lambda _d, names: [n for n in names if n in drop])
    return root


def clone(src: Path, dst: Path, changed: str | None = None) -> Path:
    """``dst`` holding ``src``'s files, hard-linked, except ``changed`` (written by the caller)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != changed:
            os.link(f, dst / f.name)
    return dst


def fp8(root: Path) -> Path:
    """DeepSeek-native block FP8: F8_E4M3 weights, F32 weight_scale_inv per [128, 128] block."""
    from quantplug.testing import formats

    cfg = tiny_config(num_hidden_layers=2)
    return formats.fp8(root, cfg, random_state(cfg))


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["hello world, hello there, the world is wide", "say hello to the wide world"] * 20


def tokenizer_json(root: Path) -> Path:
    """tokenizer.json (a small trained byte-level BPE), tokenizer_config.json and chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root.mkdir(parents=True)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|bos|>", "<|end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": {"content": "<|end|>"},
                                                            "model_max_length": 1024}))
    (root / "chat_template.jinja").write_text(TEMPLATE)
    return root


def tiktoken(root: Path) -> Path:
    """Kimi-style tiktoken.model (the 256 bytes, then merges) and tokenizer_config.json with specials
    and a chat template."""
    root.mkdir(parents=True)
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world", b"\xe6\x97", b"\xe6\x97\xa5"):
        ranks[word] = len(ranks)
    (root / "tiktoken.model").write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    n = len(ranks)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n): {"content": "[BOS]", "special": True},
                                 str(n + 1): {"content": "[EOS]", "special": True}},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": TEMPLATE}))
    return root
