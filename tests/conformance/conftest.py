"""The worked example distribution (examples/acme_quant) is importable in these tests without
being installed; test_example_distribution.py installs a built wheel of it to check the real path."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "acme_quant"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))
