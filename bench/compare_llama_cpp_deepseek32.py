"""quantplug against llama.cpp itself on one tiny DeepSeek-V3.2 (``deepseek32``) F32 GGUF (not run by the tests).

    python bench/compare_llama_cpp_deepseek32.py write   --work /tmp/v32   # quantplug's venv
    LCPP/bin/python bench/compare_llama_cpp_deepseek32.py llama --work /tmp/v32   # llama-cpp-python
    python bench/compare_llama_cpp_deepseek32.py compare --work /tmp/v32

``LCPP`` is a virtualenv with ``llama-cpp-python`` 0.3.36 built from source (CPU; its vendored
llama.cpp is the one whose converter and ``src/models/deepseek32.cpp`` the plugin follows); that
step needs only numpy and llama_cpp. Steps:

1. ``write``: a tiny V3.2 (``index_topk`` 5 < the 16-token prompt; indexer head dim 64, the
   smallest Hadamard rotation llama.cpp builds for the indexer) as an F32 GGUF by the plugin's
   writer (arch ``deepseek32``, split K/V, ``blk.N.indexer.*``, ``attention.indexer.*``) plus a
   byte-level BPE vocabulary so llama.cpp loads it; rope ``default`` (``--rope yarn``: tiny_config's
   YaRN, factor 4) and one expert group; token ids ``[2, 16]`` saved;
2. ``llama``: llama.cpp's logits for each row, once as one prompt batch (every position) and once
   one token per ``llama_decode`` (the decode path: cached indexer keys, top-k over the cache), with
   the K cache (MLA latent and indexer keys) in F32;
3. ``compare``: quantplug's logits of the same file (full prompt, and cached one-token steps)
   against both, and transformers' ``DeepseekV32ForCausalLM`` on the same weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

TOPK = 5
SEQ = 16


def config(rope: str = "default") -> dict:
    from quantplug.testing import tiny_config

    cfg = tiny_config(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", vocab_size=320,
                       q_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, index_n_heads=8,
                       index_head_dim=64, index_topk=TOPK, n_group=1, topk_group=1, bos_token_id=0,
                       eos_token_id=1)
    if rope == "default":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    return cfg


def write(work: Path, rope: str) -> None:
    import torch
    from quantplug.models.config import parse_model_config
    from quantplug.testing import random_state
    from quantplug_expert_pack.export import gguf_state, write_gguf
    from quantplug_expert_pack.testing import rewrite_gguf
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "data" / "vendor"))  # make_gguf_iq
    from make_gguf_iq import CALIBRATION, SPECIALS, byte_level_vocab

    cfg = config(rope)
    mc = parse_model_config(cfg, cfg["architectures"][0], False)
    root = work / "ckpt"
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    state = random_state(cfg, seed=32)
    tmp = work / "f32.tmp.gguf"
    write_gguf(tmp, gguf_state(state, mc), mc, default_type="F32", types={"token_embd": "F32"})
    tokens, merges = byte_level_vocab(CALIBRATION, cfg["vocab_size"] - 256 - len(SPECIALS))

    def tokenizer(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("deepseek-v3")
        w.add_token_list(SPECIALS + tokens)
        w.add_token_types([3, 3] + [1] * len(tokens))
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)

    rewrite_gguf(tmp, root / "model.gguf", tokenizer)
    tmp.unlink()
    ids = torch.randint(2, cfg["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(5))
    save_file({"input_ids": ids}, str(work / "ids.safetensors"))
    np.save(work / "ids.npy", ids.numpy())
    print(f"wrote {root / 'model.gguf'} ({(root / 'model.gguf').stat().st_size} bytes)")


def llama(work: Path, rope: str) -> None:
    import llama_cpp

    ids = np.load(work / "ids.npy")
    out = {}
    for mode, n_batch in (("prompt", SEQ), ("steps", 1)):
        llm = llama_cpp.Llama(model_path=str(work / "ckpt" / "model.gguf"), n_ctx=64, n_batch=n_batch,
                              n_ubatch=n_batch, logits_all=True, n_threads=2, type_k=0, type_v=0, seed=0,
                              verbose=False)
        rows = []
        for row in ids:
            llm.reset()
            llm.eval([int(t) for t in row])
            rows.append(np.array(llm.scores[:SEQ], dtype=np.float32))
        out[mode] = np.stack(rows)
        del llm
    np.savez(work / "llama_cpp_logits.npz", **out)
    print(f"llama.cpp {llama_cpp.__version__}: logits {out['prompt'].shape} saved")


def compare(work: Path, rope: str) -> None:
    import quantplug
    import torch
    from quantplug.generate import new_cache
    from quantplug.testing.reference import hf_model, rel_err
    from quantplug_expert_pack.testing import reference_state

    torch.set_num_threads(1)
    cfg = config(rope)
    root = work / "ckpt"
    ids = torch.from_numpy(np.load(work / "ids.npy"))
    lc = np.load(work / "llama_cpp_logits.npz")
    model = quantplug.load(root, progress=False)
    with torch.no_grad():
        ours = model(ids)
        cache = new_cache(model, ids.shape[0], SEQ)
        steps = torch.stack([model.next_logits(ids[:, i:i + 1], cache) for i in range(SEQ)], dim=1)
        hf = hf_model(cfg, reference_state(root, model.quantplug_plan.model_config))(ids).logits
    for name, theirs in (("llama.cpp prompt batch", lc["prompt"]), ("llama.cpp one token per decode", lc["steps"])):
        t = torch.from_numpy(theirs)
        print(f"{name}: quantplug prompt rel {rel_err(ours, t):.3g}, quantplug cached steps rel "
              f"{rel_err(steps, t):.3g}, transformers rel {rel_err(hf, t):.3g}, argmax agree "
              f"{float((ours.argmax(-1) == t.argmax(-1)).float().mean()):.3f}")
    print(f"quantplug vs transformers: prompt rel {rel_err(ours, hf):.3g}, steps rel {rel_err(steps, hf):.3g}")
    # the selection matters here: every key kept gives other logits
    for layer in model.model.layers:
        layer.self_attn.indexer.topk = 1 << 20
    with torch.no_grad():
        print(f"dense MLA (no selection) vs llama.cpp prompt: rel "
              f"{rel_err(model(ids), torch.from_numpy(lc['prompt'])):.3g}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=("write", "llama", "compare"))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--rope", choices=("default", "yarn"), default="default",
                    help="yarn: tiny_config's YaRN (factor 4, mscale = mscale_all_dim = 1)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    {"write": write, "llama": llama, "compare": compare}[args.step](args.work, args.rope)


if __name__ == "__main__":
    main()
