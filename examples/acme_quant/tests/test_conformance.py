"""All the testing a backend needs to start with: quantplug's conformance kit."""

from acme_quant import write_acme
from quantplug.testing import BackendConformance


class TestAcme(BackendConformance):
    backend = "acme"

    def write_checkpoint(self, path, config, dense_state):
        write_acme(path, config, dense_state)
