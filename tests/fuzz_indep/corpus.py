"""Seed checkpoints: every bundled format, tiny, built fresh into a scratch directory per run.

Sources: ``quantplug.testing`` builders (dense safetensors, sharded with an index, Kimi wrapper,
Quark, ModelSlim, compressed-tensors, FP8, a deepseek2 GGUF), copies of the vendor fixtures in
``tests/data/vendor`` (files written by the vendors' own tools), expert packs v1 (GGUF) and v2
(safetensors) made by ``quantplug expert-pack build``, and tokenizers (tokenizer.json,
tiktoken.model, tokenizer_config.json with chat templates, chat_template.jinja).
"""

from __future__ import annotations

import base64
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

VENDOR = Path(__file__).resolve().parent.parent / "data" / "vendor"

#: vendor fixtures used as seeds (the large Quark / ModelSlim ones too: a few MB each)
VENDOR_SEEDS = (
    "ct_fp8_block_dsv3", "ct_w4a16_experts_dsv3", "ct_nvfp4_autoround_dsv3", "ct_mxfp4_autoround_dsv3",
    "autoround_gptq_dsv3", "autoround_awq_dsv3", "awq_autoround_dsv3", "gptq_autoround_dsv3",
    "modelopt_nvfp4_dsv3", "modelopt_mixed_dsv3", "modelslim_w8a8_dsv3", "quark_mxfp4_dsv3",
    "gguf_iq_unsloth_dsv3", "gguf_iq2_xs_dsv3", "gguf_iq1_m_dsv3", "gguf_iq4_nl_dsv3", "gguf_iq3_s_dsv3",
    "gguf_tq1_0_dsv3",
)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class Seed:
    name: str
    path: Path


def _tiny_cfg() -> dict:
    from quantplug.testing import tiny_config

    # q_lora_rank 64: every linear's input a multiple of 32, so the group-32 formats quantize all of them
    return tiny_config(q_lora_rank=64)


def _tokenizer_json(root: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab - 4)}
    words.update({"<unk>": vocab - 4, "<|bos|>": vocab - 3, "<|end|>": vocab - 2, "<|assistant|>": vocab - 1})
    tk = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<|bos|>", "<|end|>", "<|assistant|>"])
    tk.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": {"content": "<|end|>"}, "chat_template": CHAT_TEMPLATE,
         "model_max_length": 1024}, indent=1))


def _tiktoken(root: Path) -> None:
    ranks = {bytes([b]): b for b in range(256)}
    for i, tok in enumerate((b"he", b"ll", b"hell", b"hello", b" w", b"or", b"ld")):
        ranks[tok] = 256 + i
    (root / "tiktoken.model").write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "[BOS]", "eos_token": "[EOS]",
         "added_tokens_decoder": {"263": {"content": "[BOS]", "special": True},
                                  "264": {"content": "[EOS]", "special": True}}}, indent=1))
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _expert_pack(src: Path, dst: Path) -> None:
    """``quantplug expert-pack build SRC -o DST --alignment 64``, the CLI run in this process (a
    second interpreter would spend ~2 s importing torch per pack)."""
    import contextlib
    import io

    from quantplug.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["expert-pack", "build", str(src), "-o", str(dst), "--alignment", "64"])
    if rc:
        raise RuntimeError(f"expert-pack build {src}: {err.getvalue().strip()}")


def build(root: Path) -> list[Seed]:
    """Write every seed under ``root`` (created); the list is in a fixed order (case -> seed index)."""
    import torch
    from quantplug.testing import formats as fmt
    from quantplug.testing import random_state, wrap_kimi, write_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    cfg = _tiny_cfg()
    state = random_state(cfg, seed=7)
    seeds: list[Seed] = []

    def add(name: str, path: Path) -> None:
        seeds.append(Seed(name, path))

    p = write_checkpoint(root / "dense_tokjson", cfg, state, dtype=torch.bfloat16)
    _tokenizer_json(p, cfg["vocab_size"])
    add("dense_tokjson", p)
    p = write_checkpoint(root / "dense_sharded_tiktoken", cfg, state, shards=3)
    _tiktoken(p)
    add("dense_sharded_tiktoken", p)
    kcfg, kstate = wrap_kimi(cfg, state)
    add("kimi_wrapped", write_checkpoint(root / "kimi_wrapped", kcfg, kstate, dtype=torch.float16))
    for name, writer in fmt.FORMATS.items():
        add(f"fmt_{name}", writer(root / f"fmt_{name}", cfg, state))
    _tokenizer_json(root / "fmt_fp8", cfg["vocab_size"])
    # the Quark writer quantizes lm_head too, which Quark exports leave unquantized: exclude it
    qcfg = json.loads((root / "fmt_quark" / "config.json").read_text())
    qcfg["quantization_config"]["exclude"] = ["lm_head"]
    (root / "fmt_quark" / "config.json").write_text(json.dumps(qcfg, indent=2))
    for name in VENDOR_SEEDS:
        shutil.copytree(VENDOR / name, root / name)
        add(name, root / name)
    # a GGUF seed whose chat template comes from tokenizer_config.json
    (root / "gguf_iq2_xs_dsv3" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    _expert_pack(root / "fmt_expert_pack", root / "pack_v1_gguf")
    add("pack_v1_gguf", root / "pack_v1_gguf")
    _expert_pack(root / "dense_tokjson", root / "pack_v2_st")
    add("pack_v2_st", root / "pack_v2_st")
    _expert_pack(root / "ct_w4a16_experts_dsv3", root / "pack_v2_ct")
    add("pack_v2_ct", root / "pack_v2_ct")
    return seeds
