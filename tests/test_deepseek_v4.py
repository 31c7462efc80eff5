"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) loaded by quantplug from a tiny release-named checkpoint
against transformers 5.25's ``DeepseekV4ForCausalLM`` with the same random float32 weights: one
layer of each kind (sliding window, CSA r=4 with the indexer, HCA r=8), a hash-routed and two
learned MoE layers, mHC, and a SwiGLU clamp that cuts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from quantplug import load, plan
from quantplug.plan import build_plan
from quantplug.testing import write_checkpoint

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from v4_models import CONFIG, LIM, H, T, V, reference_model, write_float_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    ref = reference_model()
    path = write_float_checkpoint(tmp_path_factory.mktemp("v4") / "ckpt", ref)
    return ref, path


def test_plan_is_clean_and_an_incomplete_mtp_block_is_named(v4, tmp_path):
    ref, path = v4
    assert not plan(path).problems
    # one MTP tensor stored: the block is loaded by default, so its other tensors are missing
    part = write_float_checkpoint(tmp_path / "part", ref, {"mtp.0.enorm.weight": torch.ones(H)})
    p = build_plan(part)
    assert any("mtp.0.e_proj.weight" in str(pr) and "missing" in str(pr) for pr in p.problems), p.problems
    # option mtp=false: skipped, not loaded (tests/test_deepseek_v4_mtp.py loads a whole block)
    p = plan(part, options={"mtp": False})
    assert not p.problems
    assert any(n == "mtp.0.enorm.weight" for names in p.skipped.values() for n in names)


def test_missing_tensor_is_a_plan_problem(v4, tmp_path):
    _, path = v4
    from safetensors.torch import load_file
    tensors = load_file(str(path / "model.safetensors"))
    gone = "layers.1.attn.indexer.compressor.wkv.weight"
    del tensors[gone]
    write_checkpoint(tmp_path / "m", json.loads((path / "config.json").read_text()), tensors)
    p = build_plan(tmp_path / "m")
    assert any(gone in str(pr) for pr in p.problems), p.problems


def test_logits_match_transformers(v4):
    ref, path = v4
    model = load(path)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err
    # the clamp cuts: without it the reference's logits move
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.mlp.experts.limit = 1e9
            layer.mlp.shared_experts.limit = 1e9
        loose = ref(ids).logits
        for layer in ref.model.layers:
            layer.mlp.experts.limit = LIM
            layer.mlp.shared_experts.limit = LIM
    assert (loose - want).abs().max() > 1e-3


def test_config_refusals_name_file_and_key(tmp_path):
    from quantplug.errors import ConfigError
    from quantplug.models.deepseek_v4_config import parse_deepseek_v4_config
    for key, value, says in (("compress_ratios", [0, 4], "at least num_hidden_layers"),
                             ("scoring_func", "sigmoid", "sqrtsoftplus"),
                             ("o_groups", 3, "divisor of num_attention_heads"),
                             ("swiglu_limit", 0, "finite number"),
                             ("num_hash_layers", 9, r"integer in \[0, 3\]")):
        with pytest.raises(ConfigError, match=rf"cfg\.json: {key} = .*{says}"):
            parse_deepseek_v4_config({**CONFIG, key: value}, "DeepseekV4ForCausalLM", False, "cfg.json")


def test_cached_greedy_generation_equals_recomputing(v4):
    _, path = v4
    model = load(path)
    ids = torch.randint(0, V, (1, 13), generator=torch.Generator().manual_seed(4))
    n = 20  # crosses the sliding window and several compression windows while decoding
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n)
        seq = ids
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out[:, -n:], seq[:, -n:]), (out, seq)
