"""quantplug backends ``gptq`` and ``awq`` (one distribution, quantplug-gptq-awq): GPTQ, AWQ GEMM and
Intel AutoRound int4 / int8 checkpoints. The entry points are the modules :mod:`.gptq` and
:mod:`.awq`; the layouts and arithmetic are in :mod:`.kernels`, the configs in :mod:`.config`."""

__version__ = "0.1.0"
