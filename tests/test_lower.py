"""The one lowering (quantplug.lower): it binds the blocks it knows at load, leaves a block whose
forward is its own (or whose type it does not know) to that forward, and the whole-stack step
declines a stack with such a block while every other block keeps its lowered entry point."""

from __future__ import annotations

import quantplug
import torch
from quantplug import lower
from quantplug.blocks import KDA, MLA, MLP, Experts, MoE
from quantplug.blocks.hyper import HyperConnection, HyperHead
from quantplug.blocks.v4_attention import V4Attention
from quantplug.generate import new_cache
from quantplug.testing import random_state, tiny_config, write_checkpoint
from torch import nn


class OwnMLP(MLP):
    """An architecture's MLP with its own forward (same math): the lowering leaves it alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class Unknown(nn.Module):
    """A block the lowering has no entry for, wrapping a dense MLP."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_the_table_names_each_block_kind_once():
    assert set(lower.LOWERINGS) == {MLA, MLP, Experts, MoE, KDA, HyperConnection, HyperHead, V4Attention}
    mlp = MLP.__new__(MLP)
    assert lower.lowering(mlp) is lower.LOWERINGS[MLP]
    assert lower.lowering(OwnMLP.__new__(OwnMLP)) is None  # its own forward: not lowered
    assert lower.lowering(nn.Linear(2, 2)) is None


def test_load_binds_the_known_blocks_and_an_unknown_one_runs_its_forward(tmp_path):
    cfg = tiny_config()
    path = write_checkpoint(tmp_path / "m", cfg, random_state(cfg))
    model = quantplug.load(path, progress=False)
    layers = model.model.layers
    for layer in layers:
        assert "_attend" in layer.self_attn.__dict__  # MLA's lowered entry point
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            assert "_routed" in mlp.__dict__ and "forward_step" in mlp.experts.__dict__
        else:
            assert "forward" in mlp.__dict__
    ids = torch.randint(0, cfg["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids)
        # the dense layer's MLP inside a block the lowering does not know: the same logits, per block
        layers[0].mlp = Unknown(layers[0].mlp)
        lower.accelerate(model)
        assert lower.text_stack(model.model) is None  # the whole stack declines
        got = model(ids)
        cache = new_cache(model, 1, 16)
        steps = [model.next_logits(ids[:, :5], cache)] + [model.next_logits(ids[:, t:t + 1], cache) for t in range(5, 9)]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(steps), want[0, 4:].float(), rtol=1e-4, atol=1e-5)
