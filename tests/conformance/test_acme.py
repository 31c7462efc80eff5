"""The conformance kit on the worked third-party example (examples/acme_quant), as a vendor runs it."""

from __future__ import annotations

import sys
from pathlib import Path

# the worked example is importable here without being installed (test_example_distribution.py
# installs a pip-built wheel of it to check the real path)
EXAMPLE = Path(__file__).parents[2] / "examples" / "acme_quant"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

import acme_quant  # noqa: E402
from quantplug.testing import BackendConformance  # noqa: E402


class TestAcme(BackendConformance):
    backend = "acme"
    plugin = acme_quant  # not pip-installed here; the kit's entry-point check installs a throwaway dist

    def write_checkpoint(self, path, config, dense_state):
        acme_quant.write_acme(path, config, dense_state)
