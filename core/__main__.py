"""``python -m quantplug``: the CLI (also under ``torchrun -m quantplug``)."""

import sys

from .cli import main

sys.exit(main())
