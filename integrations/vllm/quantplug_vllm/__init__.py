"""quantplug-vllm: vLLM loads any checkpoint an installed quantplug backend claims.

``vllm.LLM(model=PATH, load_format="quantplug")`` (``vllm serve PATH --load-format quantplug``):
quantplug's plan decides how every tensor is read and computed; vLLM's own DeepSeek-V3 model runs,
each projection through the planned module quantplug loaded for it (see :mod:`.loader`,
:mod:`.method`). :func:`register` is the ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """Register the load format and the quantization method ``quantplug`` with vLLM.

    vLLM calls this in every process it starts (the engine core, each worker), possibly more than
    once in one process: registration happens once per process, later calls do nothing."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.model_loader import register_model_loader

    from .loader import QuantplugModelLoader
    from .method import NAME, QuantplugConfig

    register_model_loader(NAME)(QuantplugModelLoader)
    register_quantization_config(NAME)(QuantplugConfig)
    _registered = True
