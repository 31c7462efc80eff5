"""examples/deepseek_v2 through the architecture conformance kit (quantplug.testing.ArchitectureConformance),
with transformers' DeepseekV2ForCausalLM as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quantplug.testing import ArchitectureConformance

pytest.importorskip("quantplug_deepseek_v2", reason="examples/deepseek_v2 is not installed (.ci/run installs it)")
transformers = pytest.importorskip("transformers")
from test_example_architecture import randomized  # noqa: E402


class TestDeepseekV2(ArchitectureConformance):
    architecture = "DeepseekV2ForCausalLM"

    def write_checkpoint(self, path: Path) -> None:
        # every in_features a multiple of 64 (MXFP4 / int4 groups of 32, ggml blocks of 32)
        cfg = transformers.DeepseekV2Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=64,
            q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, first_k_dense_replace=1,
            n_group=2, topk_group=1, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
            max_position_embeddings=256)
        randomized(cfg, seed=0).save_pretrained(path, safe_serialization=True)

    def reference_logits(self, path: Path, ids: torch.Tensor) -> torch.Tensor:
        ref = transformers.DeepseekV2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            return ref(ids).logits
