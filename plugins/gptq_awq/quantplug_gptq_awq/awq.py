"""quantplug backend ``awq``: AWQ GEMM checkpoints (AutoAWQ, ``quant_method: "awq"``, ``version: "gemm"``,
``modules_to_not_convert``) and Intel AutoRound checkpoints in the AWQ
layout (``quant_method: "auto-round"``, ``packing_format: "auto_round:auto_awq"``, per-layer
``extra_config``). Weight-only int4; see kernels.py for the layout and arithmetic.

The hooks are :mod:`.hooks`' (shared with the other packing), bound to this backend's name.
"""

from .hooks import backend

globals().update(backend("awq"))
