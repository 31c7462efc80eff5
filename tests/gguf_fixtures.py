"""A llama.cpp deepseek2 GGUF written for tests: split K/V (``attn_k_b`` / ``attn_v_b``), routed
experts stacked (``*_exps``), their down projections random K-quant rows (Q4_K on odd layers,
Q6_K on even ones), every other tensor in the type ``types`` names for it (default Q8_0)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from quantplug.testing import random_state


def write_kquant_gguf(root: Path, cfg: dict[str, Any], types: dict[str, str]) -> Path:
    from quantplug.models.config import parse_model_config
    from quantplug_expert_pack.export import gguf_state, write_gguf
    from quantplug_expert_pack.testing import random_rows

    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    tensors = gguf_state(random_state(cfg, seed=3), mc, split_kv=True)
    rng = np.random.default_rng(0)
    raw = {}
    for i in range(mc.num_hidden_layers):
        name = f"blk.{i}.ffn_down_exps.weight"
        if name in tensors:
            typ = "Q4_K" if i % 2 else "Q6_K"
            raw[name] = (random_rows(typ, tuple(tensors.pop(name).shape), rng, scale=2e-4), typ)
    write_gguf(root / "model.gguf", tensors, mc, default_type="Q8_0", types=types, vocab=cfg["vocab_size"], raw=raw)
    return root
