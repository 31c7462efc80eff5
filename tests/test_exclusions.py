"""quantplug.api.Exclusions: the one resolver of exclusion / ignore lists every backend uses."""

from __future__ import annotations

import pytest
from quantplug.api import Exclusions, modules_of

TENSORS = [
    "lm_head.weight", "model.embed_tokens.weight",
    "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.1.mlp.gate.weight",
    "model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight",
    "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight_scale",
]


def ex(*entries, **kw):
    return Exclusions(tuple(entries), "cfg.ignore", **kw)


def test_modules_of_lists_every_dotted_prefix():
    assert "model.layers.1.mlp.experts.3" in modules_of(TENSORS)
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale" not in modules_of(TENSORS)


@pytest.mark.parametrize("entry, module, hit", [
    ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.gate_proj", True),
    ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", False),
    ("model.layers.1.mlp.experts", "model.layers.1.mlp.experts.3.down_proj", True),  # a parent
    ("model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.up_proj", True),  # vLLM fused name
    ("model.layers.0.self_attn.fused_qkv_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa", True),
    ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.q_a_proj", True),
    ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.kv_b_proj", False),
    ("model.layers.1.mlp.experts.3.w1", "model.layers.1.mlp.experts.3.gate_proj", True),  # Mixtral / vLLM experts
    ("model.layers.1.mlp.experts.3.w2", "model.layers.1.mlp.experts.3.down_proj", True),
    ("model.layers.1.mlp.experts.3.w3", "model.layers.1.mlp.experts.3.gate_proj", False),
    ("model.layers.0.mlp.w1", "model.layers.0.mlp.gate_proj", False),  # w1..w3 name experts only
    ("*.mlp.gate", "model.layers.1.mlp.gate", True),
    ("*.mlp.gate", "model.layers.0.mlp.gate_proj", False),
    ("model.layers.*.self_attn*", "model.layers.0.self_attn.kv_b_proj", True),
    ("re:.*experts\\.\\d+\\.(gate|up)_proj", "model.layers.1.mlp.experts.3.up_proj", True),
    ("re:.*experts\\.\\d+\\.(gate|up)_proj", "model.layers.1.mlp.experts.3.down_proj", False),
])
def test_entry_kinds(entry, module, hit):
    assert (ex(entry).excluded_by(module) == entry) is hit


def test_prefix_and_regex_modes():
    kimi = ex("lm_head", "re:model\\.layers\\.0\\..*", prefix="language_model")
    assert kimi.excluded_by("language_model.lm_head") == "lm_head"
    assert kimi.excluded_by("language_model.model.layers.0.mlp.up_proj") is not None
    full = ex("re:model\\.layers\\.0", regex="fullmatch")
    assert full.excluded_by("model.layers.0.mlp.up_proj") is not None  # fullmatch on a parent name
    assert ex("re:layers", regex="fullmatch").excluded_by("model.layers.0.mlp.up_proj") is None
    assert ex("re:layers").excluded_by("model.layers.0.mlp.up_proj") is None  # re.match is anchored at the start
    assert ex("kv_b", substring=True).excluded_by("model.layers.0.self_attn.kv_b_proj") == "kv_b"


def test_problems_name_unknown_entries_with_a_did_you_mean():
    probs = ex("model.layers.1.mlp.gates", "language_model.lm_head", "*router*").problems(TENSORS)
    msgs = {p.layer: (p.severity, p.message) for p in probs}
    assert msgs["model.layers.1.mlp.gates"][0] == "error"
    assert "did you mean 'model.layers.1.mlp.gate'?" in msgs["model.layers.1.mlp.gates"][1]
    assert msgs["language_model.lm_head"][0] == "error"
    assert "did you mean 'lm_head'?" in msgs["language_model.lm_head"][1]
    assert msgs["*router*"][0] == "warning"
    assert not ex("model.layers.0.mlp.gate_up_proj", "lm_head", "model.layers.1.mlp.experts.3.w13").problems(TENSORS)
    sub = ex("self_attn", "mlp.gates", substring=True).problems(TENSORS)
    assert [(p.layer, p.severity) for p in sub] == [("mlp.gates", "error")]
    assert "is part of no module name" in sub[0].message


def test_problems_name_quantized_tensors_under_an_excluded_module():
    probs = ex("model.layers.1.mlp.experts").problems(TENSORS, ("weight_scale", "qweight"))
    assert len(probs) == 1
    p = probs[0]
    assert p.severity == "error" and p.layer == "model.layers.1.mlp.experts.3.down_proj"
    assert "entry 'model.layers.1.mlp.experts' excludes" in p.message
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale" in p.message


def test_a_bad_regex_is_a_config_error_naming_the_entry():
    from quantplug.api import ConfigError

    with pytest.raises(ConfigError, match=r"cfg\.ignore entry 're:model.*': not a valid regular expression"):
        ex("re:model\\.(").excluded_by("model.layers.0")
