"""DeepSeek-V3.2 through the architecture conformance kit (quantplug.testing.ArchitectureConformance):
the core's own architecture held to what a third party's must pass, every bundled format's export
included, against transformers' DeepseekV32ForCausalLM. index_topk (4) is below the kit's prompt
(11 tokens) so that the indexer's selection matters in every check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quantplug.testing import ArchitectureConformance, random_state, tiny_config, write_checkpoint
from quantplug.testing.reference import hf_logits
from safetensors.torch import load_file

pytest.importorskip("transformers")

# every linear input a multiple of 64 (MXFP4 / int4 groups of 32, ggml blocks of 32)
CFG = tiny_config(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", q_lora_rank=64,
                  kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, hidden_size=64,
                  intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2, index_n_heads=4,
                  index_head_dim=64, index_topk=4)


class TestDeepseekV32(ArchitectureConformance):
    architecture = "DeepseekV32ForCausalLM"

    def write_checkpoint(self, path: Path) -> None:
        write_checkpoint(path, CFG, random_state(CFG, seed=21))

    def reference_logits(self, path: Path, ids: torch.Tensor) -> torch.Tensor:
        cfg = json.loads((path / "config.json").read_text())
        state: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update({k: v.float() for k, v in load_file(str(f)).items()})
        return hf_logits(cfg, state, ids)


def test_a_bfloat16_checkpoint_matches_transformers_in_float32(tmp_path):
    """The release stores bfloat16 tensors (weights_proj among them): a bfloat16 checkpoint loaded
    in float32 equals transformers on the same (bfloat16-rounded) weights within 1e-5, prompt and
    greedy decode, with index_topk below the prompt."""
    import quantplug
    from quantplug.testing.reference import hf_model, rel_err

    state = {k: v.to(torch.bfloat16) for k, v in random_state(CFG, seed=22).items()}
    path = write_checkpoint(tmp_path / "bf16", CFG, state, dtype=torch.bfloat16)
    model = quantplug.load(path, progress=False)
    ref = hf_model(CFG, {k: v.float() for k, v in state.items()})
    ids = torch.randint(0, CFG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_err(model(ids), ref(ids).logits) <= 1e-5
    out = model.generate(ids[:1, :6], 6, eos_token_id=None)
    want = ref.generate(ids[:1, :6], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, want)
