"""Kernel tests' shared builds: the C library compiled for an older x86 level once per session."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from quantplug.kernels import native


@pytest.fixture(scope="session")
def march_build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """``march_build(march)``: the kernel library built with ``QUANTPLUG_NATIVE_MARCH=march`` in a
    cache of the session's own (a full compile each: the AVX2 and portable builds are shared by
    tests/kernels/test_native.py and test_kda_step.py instead of compiled by each)."""
    built: dict[str, Any] = {}

    def get(march: str) -> Any:
        if march not in built:
            saved = {k: os.environ.get(k) for k in ("QUANTPLUG_NATIVE_MARCH", "QUANTPLUG_CACHE")}
            os.environ["QUANTPLUG_NATIVE_MARCH"] = march
            os.environ["QUANTPLUG_CACHE"] = str(tmp_path_factory.mktemp(f"kernels-{march}"))
            try:
                built[march] = native._build()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return built[march]

    return get
