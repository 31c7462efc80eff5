"""DeepSeek-V4's FFN-side blocks against transformers 5.25's ``modeling_deepseek_v4`` (random float32
weights copied into both): the clamped SwiGLU (``swiglu_clamp``) of the shared and routed experts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from quantplug.api import DenseScheme
from quantplug.blocks.mlp import MLP
from quantplug.layers.activation import SILU, silu_clamp_mul, swiglu_clamp
from quantplug.models.config import parse_model_config
from quantplug.testing import tiny_config

tf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, K, H, INTER, V, LIM, SCALE = 8, 3, 64, 32, 160, 1.0, 1.5


def tf_config(**kw: Any) -> DeepseekV4Config:
    """A tiny DeepSeek-V4 config: layer 0 hash-routed (``num_hash_layers`` 1), layers 1-2 learned."""
    args: dict[str, Any] = dict(
        vocab_size=V, hidden_size=H, moe_intermediate_size=INTER, num_hidden_layers=3, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1,
        routed_scaling_factor=SCALE, num_hash_layers=1, swiglu_limit=LIM, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, rms_norm_eps=1e-6)
    args.update(kw)
    return DeepseekV4Config(**args)


def qp_config() -> Any:
    """Our ModelConfig with the same MoE fields (no expert groups)."""
    return parse_model_config(tiny_config(vocab_size=V, hidden_size=H, moe_intermediate_size=INTER, n_routed_experts=E,
                                          num_experts_per_tok=K, n_shared_experts=1, n_group=1, topk_group=1,
                                          norm_topk_prob=True, routed_scaling_factor=SCALE),
                              "DeepseekV3ForCausalLM", False)


class Oracle:
    """The plan oracle a block builds itself with: dense float32 linears, stacked experts."""

    prefix = ""
    model_dtype = torch.float32
    mtp_layers = 0

    def ck(self, rel: str) -> str:
        return rel

    def scheme(self, ckpt_name: str, kind: str = "linear", shards: Any = None) -> DenseScheme:
        return DenseScheme()

    def expert_layout(self, experts_ckpt_name: str) -> str:
        return "stacked"

    def layout(self, attn_ckpt_name: str) -> Any:
        raise AssertionError("no attention here")


def put(mod: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    """Registers ``t`` (a copy) as ``mod``'s parameter ``name``, as the loader does."""
    mod.register_parameter(name, torch.nn.Parameter(t.detach().clone(), requires_grad=False))


def randomize(mod: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Every float parameter of a transformers module: normal / sqrt(fan-in) (times ``scale``)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            fan = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) * scale / fan ** 0.5)


def by_id(idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (ids, weights) ordered by expert id (topk's order is unspecified)."""
    order = idx.argsort(dim=-1)
    return idx.gather(1, order), w.gather(1, order)


# -- the clamped SwiGLU --------------------------------------------------------------------------------

def test_clamped_swiglu_matches_transformers_and_hits_the_clamp():
    cfg = tf_config()
    ref = tf.DeepseekV4MLP(cfg)
    randomize(ref, 3)
    ours = MLP(Oracle(), "layers.0.ffn.shared_experts", H, INTER, swiglu_clamp(LIM))
    for n in ("gate_proj", "up_proj", "down_proj"):
        put(getattr(ours, n), "weight", getattr(ref, n).weight)
    x = torch.randn(3, 11, H, generator=torch.Generator().manual_seed(7)) * 2
    gate, up = ref.gate_proj(x), ref.up_proj(x)
    assert (gate > LIM).any() and (up > LIM).any() and (up < -LIM).any() and (gate < -LIM).any()
    want = ref(x)
    torch.testing.assert_close(ours(x), want, rtol=0, atol=1e-5)
    # the clamp matters: plain SiLU, or a gate clamped both ways, differ
    assert (ref.down_proj(SILU(gate, up)) - want).abs().max() > 1e-2
    both = ref.down_proj(torch.nn.functional.silu(gate.clamp(-LIM, LIM)) * up.clamp(-LIM, LIM))
    assert (both - want).abs().max() > 1e-3
    # the routed experts' gate (transformers' packed gate_up), the same function
    ex = tf.DeepseekV4Experts(cfg)
    gu = torch.cat([gate, up], dim=-1)
    torch.testing.assert_close(silu_clamp_mul(gate, up, LIM), ex._apply_gate(gu), rtol=0, atol=1e-6)
    assert silu_clamp_mul(gate.bfloat16(), up.bfloat16(), LIM).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        swiglu_clamp(0.0)
