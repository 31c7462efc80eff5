"""Kimi-K3 and Kimi-Linear through the architecture conformance kit
(quantplug.testing.ArchitectureConformance), every bundled format's export included.

Kimi-Linear's reference is transformers' ``KimiLinearForCausalLM`` (its torch fallback kernels).
transformers has no Kimi-K3 class and no other independent K3 implementation runs here, so K3's
reference is quantplug itself on the float32 checkpoint of the weights in question: the format
checks then compare each export's load with the same architecture on its dequantized weights
written as float32 (the kit's "reference on the weights the load holds"); K3's forward against an
independent implementation is left to quantplug.testing.kimi's reference.

GGUF (the ``expert_pack`` backend) reads llama.cpp ``deepseek2`` files, which have no names for
KDA's tensors: its export of either model must be refused at plan time, naming one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import quantplug
import torch
from kimi_models import k3_config, kimi_linear_config, kimi_state, transformers_kimi_linear
from quantplug.testing import ArchitectureConformance, write_checkpoint
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _state(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.float() for k, v in load_file(str(f)).items()})
    return out


#: every token takes every expert in the kit's models: routing cannot flip under the activation
#: quantization of the fp8 / ModelSlim exports (with top-2 of 8, a flipped choice moved the max logit
#: error to 0.5-0.9 where a K3 without MoE layers stays at 0.19), so the kit's sanity bound sees the
#: formats' numerics; tensor parallelism (tests/parallel/test_parallel_kimi.py) keeps top-2
K3 = k3_config(num_experts_per_token=8)
KL = kimi_linear_config(num_experts_per_token=8)

#: the first KDA tensor a deepseek2 GGUF has no name for (layer 0 is KDA in both configs)
GGUF_REFUSAL = "model.layers.0.self_attn.q_conv1d.weight"


class TestKimiK3(ArchitectureConformance):
    architecture = "KimiK3ForConditionalGeneration"
    refusals = {"expert_pack": GGUF_REFUSAL}
    #: e4m3 activations (the fp8 export) move this tiny K3's logits by 0.64 (its attention residuals'
    #: depth softmax amplifies them); the weight-only formats stay at the kit's 1e-5
    act_quant_rtol = 1.0

    def write_checkpoint(self, path: Path) -> None:
        write_checkpoint(path, K3, kimi_state(K3, seed=41))

    def reference_logits(self, path: Path, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return quantplug.load(path, progress=False)(ids)


class TestKimiLinear(ArchitectureConformance):
    architecture = "KimiLinearForCausalLM"
    refusals = {"expert_pack": GGUF_REFUSAL}

    def write_checkpoint(self, path: Path) -> None:
        write_checkpoint(path, KL, kimi_state(KL, seed=42))

    def reference_logits(self, path: Path, ids: torch.Tensor) -> torch.Tensor:
        pytest.importorskip("transformers")
        cfg = json.loads((path / "config.json").read_text())
        with torch.no_grad():
            return transformers_kimi_linear(cfg, _state(path))(ids).logits
