"""Kimi-K3 at its real widths, two layers (one KDA, one MLA with the latent MoE), small enough to
write in a minute: prompt and decode-step time, and the bytes a decode step reads.

    python bench/bench_k3_width.py [--out /tmp/k3-width] [--experts 16] [--steps 5]

Hidden 7168, 96 KDA heads of 128, MLA 96 heads with q-LoRA 1536 / kv-LoRA 512 and the output gate,
latent 3584 with experts of 3072 (top-8 of ``--experts``), 2 shared experts, a dense layer 4096
wide (the release's is 33792), vocab 1024; weights in the release's dtypes (bf16, conv / dt_bias /
A_log float32), float32 model. The checkpoint (~2.6 GB) is written once into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import quantplug
import torch
from quantplug.generate import new_cache
from quantplug.testing.kimi import kimi_k3_config, kimi_k3_state, write_kimi_checkpoint


def config(experts: int) -> dict:
    return kimi_k3_config(
        hidden_size=7168, num_hidden_layers=2, num_attention_heads=96, num_key_value_heads=96, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=4096,
        moe_intermediate_size=3072, routed_expert_hidden_size=3584, num_experts=experts, num_experts_per_token=8,
        num_shared_experts=2, vocab_size=1024, attn_res_block_size=12,
        linear_attn_config={"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "kda_layers": [1],
                            "full_attn_layers": [2], "use_full_rank_gate": True, "gate_lower_bound": -5.0})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/k3-width")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=8)
    args = ap.parse_args()
    out = Path(args.out)
    cfg = config(args.experts)
    if not (out / "config.json").exists() or json.loads((out / "config.json").read_text()) != cfg:
        write_kimi_checkpoint(out, cfg, kimi_k3_state(cfg, seed=0), dtype="release")
    t0 = time.perf_counter()
    lm = quantplug.load(out, progress=False).text_lm()
    load_s = time.perf_counter() - t0
    ids = torch.randint(0, cfg["text_config"]["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(0))
    cache = new_cache(lm, 1, args.prompt + args.steps + 1)
    with torch.no_grad():
        t0 = time.perf_counter()
        tok = lm.next_tokens(ids, cache)[1].view(1, 1)
        prompt_s = time.perf_counter() - t0
        steps = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            tok = lm.next_tokens(tok, cache)[1].view(1, 1)
            steps.append(time.perf_counter() - t0)
    routed = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if ".experts." in n)
    other = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if ".experts." not in n)
    read = other + routed * 8 // args.experts
    print(json.dumps({"load_s": round(load_s, 2), "prompt_tokens": args.prompt, "prompt_s": round(prompt_s, 3),
                      "decode_step_s": {"best": round(min(steps), 3), "median": round(sorted(steps)[len(steps) // 2], 3)},
                      "bytes_read_per_step": read, "gb_per_s_at_best": round(read / min(steps) / 1e9, 2)}, indent=2))


if __name__ == "__main__":
    main()
