"""Load option ``mmap`` (issue 22): ``mmap=False`` copies weights into private memory, so a file
truncated after the load cannot SIGBUS the process; the default keeps zero-copy views."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import quantplug
import torch
from quantplug.testing import formats, random_state, tiny_config, write_checkpoint

CHILD = textwrap.dedent("""
    import os, sys, torch, quantplug
    path, mmap = sys.argv[1], sys.argv[2] == "true"
    model = quantplug.load(path, options={"mmap": mmap}, progress=False)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(ids)
    for f in os.listdir(path):
        if f.endswith((".safetensors", ".gguf")):
            os.truncate(os.path.join(path, f), 0)  # the file shrinks under the loaded model
    with torch.no_grad():
        after = model(ids)
    print("same" if torch.equal(before, after) else "differ")
""")


def _run(path, mmap: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(path), "true" if mmap else "false"],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def f32_dense(tmp_path):
    cfg = tiny_config(num_hidden_layers=2)
    state = {k: v.float() for k, v in random_state(cfg).items()}  # stored as the model dtype: zero-copy
    return write_checkpoint(tmp_path / "c", cfg, state)


def test_mmap_false_survives_a_truncated_file(f32_dense):
    r = _run(f32_dense, mmap=False)
    assert r.returncode == 0 and r.stdout.strip() == "same", r.stderr[-2000:]


def test_mmap_default_is_zero_copy_and_a_truncated_file_is_sigbus(f32_dense):
    """The trade-off the option exists for: with the default zero-copy views the same truncation
    kills the process (SIGBUS), as safetensors' own loader does."""
    r = _run(f32_dense, mmap=True)
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stderr[-2000:])


def test_mmap_false_gives_the_same_logits_and_owned_parameters(tmp_path, f32_dense):
    ids = torch.tensor([[5, 6, 7]])
    mapped = quantplug.load(f32_dense, progress=False)
    private = quantplug.load(f32_dense, options={"mmap": False}, progress=False)
    with torch.no_grad():
        assert torch.equal(mapped(ids), private(ids))
    assert mapped.quantplug_plan.checkpoint._maps  # the files are mapped, parameters view them
    assert not private.quantplug_plan.checkpoint._maps  # no file was mapped at all
    # GGUF quantized blocks (zero-copy uint8 views by default) too
    cfg = tiny_config(num_hidden_layers=2)
    g = formats.gguf(tmp_path / "g", cfg, random_state(cfg))
    mg, pg = quantplug.load(g, progress=False), quantplug.load(g, options={"mmap": False}, progress=False)
    with torch.no_grad():
        assert torch.equal(mg(ids), pg(ids))
    assert mg.quantplug_plan.checkpoint._maps and not pg.quantplug_plan.checkpoint._maps
