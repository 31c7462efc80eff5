"""quantplug backend ``gptq``: GPTQ checkpoints (AutoGPTQ / GPTQModel, ``quant_method: "gptq"``,
incl. ``g_idx`` act-order and GPTQModel ``dynamic``) and Intel AutoRound checkpoints in the GPTQ
layout (``quant_method: "auto-round"``, ``packing_format: "auto_round:auto_gptq"``, per-layer
``extra_config``). Weight-only int4 / int8; see kernels.py for the layout and arithmetic.

The hooks are :mod:`.hooks`' (shared with the other packing), bound to this backend's name.
"""

from .hooks import backend

globals().update(backend("gptq"))
