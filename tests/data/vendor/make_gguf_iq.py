"""Make the GGUF IQ / TQ fixtures with llama.cpp's own tools (not run by the tests).

    python tests/data/vendor/make_gguf_iq.py --bin BUILD/bin --work /tmp/work --out tests/data/vendor

``BUILD/bin`` holds ``llama-imatrix`` and ``llama-quantize`` built from the llama.cpp tree vendored
in the ``llama-cpp-python`` 0.3.36 source distribution (see README.md, "GGUF IQ / TQ"). Steps:

1. Two tiny DeepSeek-V3 models (``quantplug.testing.tiny_config`` + ``random_state``, every row a
   multiple of 256 except ``attn_k_b``'s, whose rows are qk_nope = 32 as DeepSeek's are not),
   written as F32 GGUFs by quantplug's gguf-py writer (``quantplug_expert_pack.export``) with a
   byte-level BPE vocabulary trained on the calibration text, so llama.cpp can tokenize it;
2. ``llama-imatrix`` on the calibration text (7 chunks of 128 tokens: 896 tokens): llama.cpp runs
   each model forward, so its deepseek2 loader accepts the files;
3. ``llama-quantize --imatrix``: ``per_type`` (1 MoE layer, 4 experts) once per IQ / TQ type with
   ``--pure`` (every tensor in that type, rows that do not fit falling back as llama.cpp decides;
   for IQ1_S / IQ2_XXS / IQ2_XS, which ggml quantizes only with importance data, ``token_embd``
   Q4_K and ``output`` Q6_K),
   and ``mixed`` (3 layers, 8 experts) as Unsloth's dynamic quants mix: base type IQ1_S, routed
   experts IQ1_S / IQ2_XXS, attention Q4_K / Q6_K, ``attn_k_b`` Q4_0 (``--tensor-type``);
4. the reference: every tensor dequantized by ``gguf.quants.dequantize`` (kv_b rebuilt from
   attn_k_b / attn_v_b), run by transformers' DeepseekV3ForCausalLM in float32:
   ``<name>.reference.safetensors`` with ``input_ids`` [2, 12] and ``logits``.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

PER_TYPE = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
            "TQ1_0", "TQ2_0")
#: mixed: --tensor-type overrides (llama-quantize regexes over tensor names), first match wins
MIXED_TYPES = [
    r"blk\.1\.ffn_(gate|up)_exps=iq1_s", r"blk\.2\.ffn_(gate|up)_exps=iq2_xxs", r"ffn_down_exps=iq2_xxs",
    r"attn_k_b=q4_0", r"attn_(q_a|q_b|v_b)=q4_k", r"attn_(kv_a_mqa|output)=q6_k",
    r"ffn_(gate|up)(_shexp)?\.=q4_k", r"ffn_down(_shexp)?\.=q6_k",
]
MIXED_EXTRA = ["--token-embedding-type", "q4_k", "--output-tensor-type", "q6_k"]
#: ggml quantizes these only with importance data, which llama-imatrix records neither for
#: token_embd (a row lookup) nor, by default, for output: there those two are Q4_K / Q6_K
NEEDS_IMATRIX = ("IQ1_S", "IQ2_XXS", "IQ2_XS")
#: llama-quantize's file type whose default tensor type is the type (llama_ftype_get_default_type:
#: its "IQ2_S" file type writes IQ2_XS tensors, its "IQ2_M" IQ2_S)
FTYPE = {"IQ2_S": "IQ2_M"}

CALIBRATION = """\
The river ran slowly past the old mill, and the miller's daughter watched the water turn the
wheel. Every morning she counted the sacks of grain that the farmers brought from the hills, and
every evening she wrote the numbers in a small green book. Her father said that the book was the
most important thing in the mill, more important than the wheel or the stones, because without
it nobody would know who had paid and who still owed. In the winter the river froze at the edges,
and the wheel turned more slowly; the farmers came less often, and the daughter read the books
her mother had left on the shelf above the stove. There were books about the stars and the
seasons, about ships that sailed to islands where the trees grew fruit as large as a man's head,
and about the kings who had built the bridges and the roads that the carts now used. She learned
that the stars move in circles around a point in the north, that the moon shows the same face to
the earth, and that the tides follow the moon across the sea. When spring came the ice broke with
a sound like thunder, and the river rose over the meadow. The farmers returned with their carts,
the wheel turned fast again, and the green book filled with new numbers. One day a traveller
stopped at the mill to ask the way to the city. He had a map drawn on thin paper, with the rivers
in blue and the roads in red, and he showed the daughter where the mill stood and how far the
city lay beyond the hills. She asked him how the map had been made, and he told her about the men
who walk the country with chains and poles, measuring every field and every turn of the road,
and about the tables of numbers they carry, which tell the angles of the sun at every hour. After
he left she began to draw her own map of the valley, with the mill at the centre, the river
running from the top of the page to the bottom, and the farms scattered along the roads like
seeds. Years later, when the mill had passed to her and the green books filled a whole shelf, she
still kept the map on the wall, and she added to it every time a new road was built or an old
bridge was mended. Travellers who stopped at the mill would look at the map and ask who had drawn
it, and she would tell them about the man with the thin paper and the tables of numbers, and
about the winter when the river froze and she read about the stars. The children of the valley
learned to count with her sacks of grain and to read with her books; some of them went to the city
to study, and some of them came back to build new mills further down the river, where the water
was faster and the wheels could be larger. In the evenings the old miller sat by the window and
listened to the water, and she thought that a river is like a book that is never finished: every
day it carries something new past the mill, and every day somebody writes it down.
"""


def byte_level_vocab(text: str, n_merges: int) -> tuple[list[str], list[str]]:
    """GPT-2 byte-level tokens (256) and ``n_merges`` BPE merges learned on ``text``."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_char = {b: chr(c) for b, c in zip(bs, cs)}
    tokens = [byte_char[b] for b in range(256)]
    words = [[byte_char[b] for b in w.encode()] for w in text.replace("\n", " ").split(" ") if w]
    words = [[byte_char[ord(" ")]] + w for w in words]
    merges: list[str] = []
    for _ in range(n_merges):
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w in words:
            pairs.update(zip(w, w[1:]))
        (a, b), _count = pairs.most_common(1)[0]
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        new_words = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words.append(out)
        words = new_words
    return tokens, merges


SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
VOCAB = 320


def config(kind: str) -> dict:
    from quantplug.testing import tiny_config

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                  q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=32,
                  n_shared_experts=1, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    if kind == "per_type":  # 1 MoE layer, 4 experts: small files, one per type
        cfg = tiny_config(**common, num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=2,
                          num_key_value_heads=2, v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2,
                          n_group=2, topk_group=1)
    else:  # the DeepSeek layout: a dense layer, then MoE layers
        cfg = tiny_config(**common, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                          num_key_value_heads=4, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
                          n_group=2, topk_group=1)
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "original_max_position_embeddings": 1024}
    return cfg


def write_f32(directory: Path, cfg: dict, seed: int) -> Path:
    from quantplug.models.config import parse_model_config
    from quantplug.testing import random_state
    from quantplug_expert_pack.export import gguf_state, write_gguf
    from quantplug_expert_pack.testing import rewrite_gguf

    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "f32.tmp.gguf"
    write_gguf(tmp, gguf_state(random_state(cfg, seed=seed), mc), mc, default_type="F32", types={"token_embd": "F32"})
    tokens, merges = byte_level_vocab(CALIBRATION, VOCAB - 256 - len(SPECIALS))
    tokens = SPECIALS + tokens

    def tokenizer(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("deepseek-v3")
        w.add_token_list(tokens)
        w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_add_bos_token(True)

    out = directory / "model-f32.gguf"
    rewrite_gguf(tmp, out, tokenizer)
    tmp.unlink()
    return out


def run(cmd: list[str], log: Path) -> None:
    print("$", " ".join(cmd), file=sys.stderr)
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)


def reference(directory: Path, cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """input_ids [2, 12] and transformers' logits on gguf-py's dequantization of the GGUF."""
    from quantplug.models.config import parse_model_config
    from quantplug.testing import to_layout
    from quantplug_expert_pack.testing import reference_state
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    hc = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    hc._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hc).eval()
    missing, unexpected = model.load_state_dict(to_layout(reference_state(directory, mc), "fused"), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    ids = torch.randint(2, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return {"input_ids": ids, "logits": model(ids).logits.contiguous()}


def main() -> None:
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    imatrix, quantize = str(args.bin / "llama-imatrix"), str(args.bin / "llama-quantize")
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "tools.log"
    calib = args.work / "calibration.txt"
    calib.write_text(CALIBRATION * 2)
    jobs = [("per_type", 1, [(f"gguf_{t.lower()}_dsv3", FTYPE.get(t, t), ["--pure", *(MIXED_EXTRA if t in NEEDS_IMATRIX else [])])
                             for t in PER_TYPE]),
            ("mixed", 2, [("gguf_iq_unsloth_dsv3", "IQ1_S",
                          [a for p in MIXED_TYPES for a in ("--tensor-type", p)] + MIXED_EXTRA)])]
    for kind, seed, outputs in jobs:
        cfg = config(kind)
        f32 = write_f32(args.work / kind, cfg, seed)
        imat = args.work / kind / "imatrix.gguf"
        run([imatrix, "-m", str(f32), "-f", str(calib), "-o", str(imat), "-c", "128", "--chunks", "7",
             "-t", str(args.threads), "-ngl", "0"], log)
        for name, ftype, extra in outputs:
            dst = args.out / name
            if dst.exists():
                shutil.rmtree(dst)
            dst.mkdir(parents=True)
            (dst / "config.json").write_text(json.dumps(cfg, indent=2))
            run([quantize, "--imatrix", str(imat), *extra, str(f32), str(dst / "model.gguf"), ftype,
                 str(args.threads)], log)
            save_file(reference(dst, cfg, seed), str(args.out / f"{name}.reference.safetensors"))
            print(f"{name}: {(dst / 'model.gguf').stat().st_size} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
