"""DeepSeek-V4 through the architecture conformance kit (quantplug.testing.ArchitectureConformance),
with transformers 5.25's DeepseekV4ForCausalLM as the reference, and every bundled exporter but
FP8's and GGUF's writing the tiny model in the release's names and loading it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from quantplug.testing import ArchitectureConformance, write_checkpoint
from safetensors.torch import load_file

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from v4_models import CONFIG, INTER, reference_model, release_names  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: q_lora_rank a multiple of the exporters' groups (32; NVFP4's 16): every V4 linear's input width is
Q_LORA = 32


def load_reference(path: Path) -> torch.nn.Module:
    """transformers' model holding the checkpoint at ``path`` (release names mapped back)."""
    ref = reference_model(Q_LORA)
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
    #: with E8M0 ``.scale``, FP4 routed experts). The kit's other fixture writers
    #: (quantplug.testing.formats) quantize the linears their pattern ``LINEAR`` names, all under
    #: ``model.layers.`` (V3 / Kimi module names): a V4 checkpoint in the release's names holds none of
    #: them; the bundled exporters below write V4 instead (GGUF's in llama.cpp's ``deepseek4`` layout)
    formats = ("fp8",)
    #: each backend's own quantplug_export of the loaded float model, loaded back (the release's BF16
    #: linears: compressors' wkv / wgate, the indexer's weights_proj, the router, the head: float)
    exporters = ("compressed-tensors-w4a16", "modelslim-w4a8", "modelslim-w8a8", "quark-mxfp4",
                 "modelopt-w4a16-nvfp4", "modelopt-nvfp4", "modelopt-fp8", "gptq-int4", "awq-int4",
                 "fp8-block", "gguf-q8_0", "gguf-q4_0", "gguf-q8_0-expert-pack")

    def write_checkpoint(self, path: Path) -> None:
        tensors = release_names(reference_model(Q_LORA).state_dict())
        write_checkpoint(path, {**CONFIG, "q_lora_rank": Q_LORA},
                         {k: (v.to(torch.int32) if k.endswith("tid2eid") else v) for k, v in tensors.items()})

    def reference_logits(self, path: Path, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return load_reference(path)(ids).logits

    def check_export(self, label: str, model: Any) -> None:
        """The release's BF16 linears (compressors' wkv / wgate, the indexer's weights_proj, the
        router, the head) load float from every export; the exporter's own choice of quantized
        linears (compressed-tensors W4A16: routed experts only, Kimi's recipe) loads quantized.
        Equality with the reference on the loaded weights is the kit's check."""
        modules = dict(model.named_modules())

        def scheme(name: str) -> str:
            sch = getattr(modules[name], "scheme", None)
            if getattr(sch, "ggml_type", None) in ("F32", "F16", "BF16"):
                return "DenseScheme"  # a GGUF float tensor: the ggml scheme of a float type
            return type(sch).__name__

        for name in ("layers.1.attn.compressor.wkv", "layers.1.attn.compressor.wgate",
                     "layers.1.attn.indexer.compressor.wkv", "layers.2.attn.compressor.wgate", "head"):
            assert scheme(name) == "DenseScheme", (label, name, scheme(name))
        assert isinstance(modules["layers.1.attn.indexer.weights_proj"].weight, torch.Tensor)
        assert modules["layers.0.ffn.gate"].tid2eid.dtype in (torch.int32, torch.int64)
        # routed experts: float where the recipe keeps them so (msModelSlim W8A8's; amd-quark quantizes no
        # 3-D expert parameter, as transformers holds them)
        experts = scheme("layers.1.ffn.experts.gate_proj")
        assert (experts == "DenseScheme") == (label in ("modelslim-w8a8", "quark-mxfp4")), (label, experts)
        if label != "compressed-tensors-w4a16":
            for name in ("layers.0.attn.wq_a", "layers.1.attn.wo_a", "layers.1.attn.indexer.wq_b",
                         "layers.2.ffn.shared_experts.down_proj"):
                assert scheme(name) != "DenseScheme", (label, name)
