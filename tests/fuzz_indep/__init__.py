"""An independent fuzzer of quantplug's untrusted-input layer (see docs/fuzzing.md).

Written from the public surface only (``quantplug.plan`` / ``quantplug.load``, ``quantplug.testing``,
the CLI, the vendor fixtures in ``tests/data/vendor``); it shares nothing with ``tests/fuzz``.

* :mod:`.corpus` builds the seed checkpoints into a scratch directory;
* :mod:`.mutators` turns (seed, case index) into one mutated checkpoint, deterministically;
* :mod:`.oracle` runs plan -> load -> forward (+ tokenizer, chat template, CLI) and classifies;
* :mod:`.run` drives worker processes and prints the report.
"""
