"""vLLM's engine in this process (no engine-core subprocess: the plugin, the test's exports and
the model share one process), a small CPU KV cache."""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
