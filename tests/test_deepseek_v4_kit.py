"""DeepSeek-V4 through the architecture conformance kit (quantplug.testing.ArchitectureConformance),
with transformers 5.25's DeepseekV4ForCausalLM as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quantplug.testing import ArchitectureConformance, write_checkpoint
from safetensors.torch import load_file

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from v4_models import CONFIG, INTER, reference_model, release_names  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load_reference(path: Path) -> torch.nn.Module:
    """transformers' model holding the checkpoint at ``path`` (release names mapped back)."""
    ref = reference_model()
    stored = {}
    for f in sorted(path.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    sd = ref.state_dict()
    with torch.no_grad():
        for name, t in sd.items():
            names = release_names({name: t})
            if name.endswith("gate_up_proj"):
                e = t.shape[0]
                base = next(iter(names)).split(".experts.")[0]
                t.copy_(torch.stack([torch.cat([stored[f"{base}.experts.{k}.w1.weight"],
                                                stored[f"{base}.experts.{k}.w3.weight"]]) for k in range(e)]))
            elif name.endswith("experts.down_proj"):
                base = next(iter(names)).split(".experts.")[0]
                t.copy_(torch.stack([stored[f"{base}.experts.{k}.w2.weight"] for k in range(t.shape[0])]))
            else:
                (rel,) = names
                t.copy_(stored[rel].to(t.dtype))
    assert INTER
    return ref


class TestDeepseekV4(ArchitectureConformance):
    architecture = "DeepseekV4ForCausalLM"
    #: fp8: the kit's writer puts a V4 config into the release layout (FP8 attention / shared expert
    #: with E8M0 ``.scale``, FP4 routed experts). The other formats are left out: the kit's exporters
    #: (quantplug.testing.formats) quantize the linears their pattern ``LINEAR`` names, all under
    #: ``model.layers.`` (V3 / Kimi module names), so a V4 export in release names holds no quantized
    #: tensor: quark's and compressed_tensors' configs (every linear quantized) then plan with every
    #: V4 linear missing its packed form, modelslim would load all-float (a vacuous pass), and the
    #: GGUF writer (expert_pack) has no DeepSeek-V4 layout (its plan refuses: no layer 2 under
    #: model.layers / blk). The tiny model's q_lora_rank 24 also fits no group-32 format.
    formats = ("fp8",)

    def write_checkpoint(self, path: Path) -> None:
        tensors = release_names(reference_model().state_dict())
        write_checkpoint(path, CONFIG, {k: (v.to(torch.int32) if k.endswith("tid2eid") else v)
                                        for k, v in tensors.items()})

    def reference_logits(self, path: Path, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return load_reference(path)(ids).logits
