"""A header-only checkpoint at DeepSeek-V3's real dimensions (two layers: one dense, one MoE of 256
FP8 experts) with one routed expert's tensor corrupted: a wrong shape, a wrong dtype, or the tensor
left out. However the plan checks a stack of experts (in bulk, one stack at a time), the problem
names that one expert tensor and its file, at plan time, and only it."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from quantplug.plan import build_plan
from quantplug.testing.scale import (
    StoredTensor,
    release_tensors,
    safetensors_header,
    shard_layout,
    slice_config,
    write_index,
)

SERVED = {"expert_cache_mb": 4096}
E = "model.layers.1.mlp.experts"


def _write(root: Path, tensors: list[StoredTensor]) -> Path:
    import json

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(slice_config(2)))
    layout = shard_layout(tensors, 4)
    for fname, group in layout.items():
        header = safetensors_header(group)
        (root / fname).write_bytes(header)
        os.truncate(root / fname, len(header) + sum(t.nbytes for t in group))
    write_index(root, layout)
    return root


def _where(tensors: list[StoredTensor], name: str) -> str:
    layout = shard_layout(tensors, 4)
    return next(f for f, group in layout.items() if any(t.name == name for t in group))


@pytest.mark.parametrize(("case", "name"), [
    ("shape", f"{E}.131.down_proj.weight"),
    ("dtype", f"{E}.7.up_proj.weight"),
    ("missing", f"{E}.200.gate_proj.weight_scale_inv"),
    ("shape", f"{E}.255.gate_proj.weight_scale_inv"),
])
def test_one_corrupt_expert_tensor_is_named_with_its_file(tmp_path, case, name):
    tensors = release_tensors(slice_config(2))
    assert sum(t.name.startswith(f"{E}.") for t in tensors) == 256 * 3 * 2
    i = next(k for k, t in enumerate(tensors) if t.name == name)
    t = tensors[i]
    if case == "shape":
        tensors[i] = replace(t, shape=(t.shape[0], t.shape[1] - 1))
    elif case == "dtype":
        tensors[i] = replace(t, dtype="BF16")
    else:
        del tensors[i]
    root = _write(tmp_path / "ckpt", tensors)
    p = build_plan(root, options=SERVED)
    assert p.problems, "the corrupt expert tensor went unnoticed"
    problems = p.problems
    if case == "dtype":
        # one BF16 expert among FP8 ones: the backend refuses the stack naming it, and the stack's
        # scales are then unused; the dtype problem names the outlier, not the stack's first tensor
        refused = [q for q in problems if q.kind == "refused"]
        assert len(refused) == 1 and name.removesuffix(".weight") + " is BF16" in refused[0].message
        unused = {q.tensor for q in problems if q.kind == "unexpected"}
        assert unused == {f"{E}.{k}.up_proj.weight_scale_inv" for k in range(256)}
        problems = [q for q in problems if q.kind not in ("refused", "unexpected")]
        assert "(1 of 256" not in problems[0].message and "F8_E4M3" in problems[0].message
    assert {q.kind for q in problems} == {case}, [q.describe() for q in problems][:5]
    assert [q.tensor for q in problems] == [name], [q.describe() for q in problems][:5]
    q = problems[0]
    if case == "missing":
        assert q.file == str(root)
    else:
        assert q.file == _where(tensors, name)
        assert (str(list(tensors[i].shape)) if case == "shape" else "BF16") in q.message
    assert name in q.describe()
