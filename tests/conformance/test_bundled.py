"""Every bundled backend passes the conformance kit, each writing its checkpoints with its own
exporter. Adding a backend here is one five-line class."""

from __future__ import annotations

import importlib.metadata as md

import pytest
from quantplug.plugins import ENTRY_POINT_GROUP
from quantplug.testing import BackendConformance

INSTALLED = {ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP)}


def bundled(name: str):
    return pytest.mark.skipif(name not in INSTALLED, reason=f"bundled backend {name!r} is not installed")


class ExportedCheckpoint(BackendConformance):
    """write_checkpoint through the backend's own quantplug_export."""

    write_options: dict = {}

    def write_checkpoint(self, path, config, dense_state):
        self.export_checkpoint(path, config, dense_state, options=self.write_options or None)


@bundled("quark")
class TestQuark(ExportedCheckpoint):
    backend = "quark"


@bundled("modelslim")
class TestModelSlim(ExportedCheckpoint):
    backend = "modelslim"
    write_options = export_options = {"recipes": ["w4a8"]}  # int4 experts, W8A8 attention, FLOAT kv_b
    # W8A8 / W8A8_DYNAMIC / W4A8_DYNAMIC quantize activations to int8 in forward, by design (the
    # Ascend kernels do), and have no weight-only mode: forward and apply differ from float matmuls
    # on the dequantized weights by that rounding. Measured on the kit's model: forward <= 3e-2, one
    # layer's apply (static per-tensor activation scale) up to 4.6e-2; skipped scales give ~1.
    forward_rtol = 0.1


@bundled("expert_pack")
class TestExpertPack(ExportedCheckpoint):
    backend = "expert_pack"
    write_options = {"pack": False}  # the plain GGUF; the round trip also checks the expert-pack variant


@bundled("compressed_tensors")
class TestCompressedTensors(ExportedCheckpoint):
    backend = "compressed_tensors"
    options = {"activation_quant": "none"}


@bundled("fp8")
class TestFP8(ExportedCheckpoint):
    backend = "fp8"
    options = {"activation_quant": "none"}  # weight-only (default: DeepSeek's fp8 activation emulation)


@bundled("expert_pack")
class TestExpertPackFastKernels(ExportedCheckpoint):
    """The GGUF backend under kernels="fast": every projection through torch's int4 kernel, and
    sibling projections fused (LinearScheme.fuse), which needs rows in multiples of the kernel's
    row block (64 on x86): the model's widths are set so that gate+up and q_a+kv_a fuse."""

    backend = "expert_pack"
    write_options = {"pack": False}
    options = {"kernels": "fast"}
    config_overrides = {"moe_intermediate_size": 64, "intermediate_size": 128, "q_lora_rank": 64, "kv_lora_rank": 48,
                        "qk_rope_head_dim": 16}
    # bfloat16 activations, scales and outputs (the int4 kernel's fast path): measured on the kit's
    # model (Q8_0 as two int4 halves), forward 4.2e-3 against transformers on the exactly
    # dequantized weights, apply vs dequantize + matmul <= 4.6e-3; fused = separate bit for bit
    forward_rtol = 3e-2


@bundled("modelopt")
class TestModelOpt(ExportedCheckpoint):
    backend = "modelopt"  # W4A16_NVFP4 (weight-only NVFP4): the exporter's default


@bundled("modelopt")
class TestModelOptFP8(ExportedCheckpoint):
    """FP8 per tensor with static input scales; the kit runs it weight-only."""

    backend = "modelopt"
    write_options = {"algo": "FP8"}
    options = {"activation_quant": "none"}


@bundled("gptq")
class TestGPTQ(ExportedCheckpoint):
    backend = "gptq"  # int4 group 32 with zero points (stored - 1), g_idx = k // group


@bundled("awq")
class TestAWQ(ExportedCheckpoint):
    backend = "awq"  # AWQ GEMM int4 group 32, interleaved word order
