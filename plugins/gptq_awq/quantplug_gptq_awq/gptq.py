"""quantplug backend ``gptq``: GPTQ checkpoints (AutoGPTQ / GPTQModel, ``quant_method: "gptq"``,
incl. ``g_idx`` act-order and GPTQModel ``dynamic``) and Intel AutoRound checkpoints in the GPTQ
layout (``quant_method: "auto-round"``, ``packing_format: "auto_round:auto_gptq"``, per-layer
``extra_config``). Weight-only int4 / int8; see kernels.py for the layout and arithmetic."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from quantplug.api import Claim, Problem, hookimpl

from . import hooks
from .config import IntConfig

__version__ = "0.1.0"
QUANTPLUG_CONTRACT = "1.4"


@hookimpl
def quantplug_detect(checkpoint: Any) -> Claim | None:
    return hooks.detect(checkpoint, "gptq")


@hookimpl
def quantplug_resolve_prefix(quant_config: IntConfig) -> str:
    return quant_config.prefix


@hookimpl
def quantplug_linear_scheme(layer_name: str, layer_kind: str, shard_names: Sequence[str], quant_config: IntConfig,
                            checkpoint: Any) -> Any:
    return hooks.linear_scheme(layer_name, layer_kind, shard_names, quant_config, checkpoint)


@hookimpl
def quantplug_validate_plan(plan: Any, quant_config: IntConfig) -> list[Problem]:
    return hooks.validate_plan(plan, quant_config, "gptq-name")


@hookimpl
def quantplug_export(model: Any, destination: Any, options: Mapping[str, Any], plan: Any) -> Any:
    from .export import export_int

    return export_int(model, plan, destination, options, "gptq")
