"""The conformance kit on the worked third-party example (examples/acme_quant), as a vendor runs it."""

from __future__ import annotations

import acme_quant
from quantplug.testing import BackendConformance


class TestAcme(BackendConformance):
    backend = "acme"
    plugin = acme_quant  # not pip-installed here; the kit's entry-point check installs a throwaway dist

    def write_checkpoint(self, path, config, dense_state):
        acme_quant.write_acme(path, config, dense_state)
