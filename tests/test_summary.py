"""Plan text at any scale (quantplug.summary): identical layers grouped, each scheme said once."""

from __future__ import annotations

from quantplug.summary import brace, grouped_targets, plan_lines, ranges, split_layer


def test_ranges_brace_and_layer_names():
    assert ranges([7, 0, 1, 2, 5, 8, 9]) == "0-2, 5, 7-9"
    assert brace(["self_attn.q_a_proj", "self_attn.o_proj", "mlp.gate", "lm_head"]) == \
        "self_attn.{q_a_proj, o_proj}, mlp.gate, lm_head"
    assert split_layer("language_model.model.layers.12.mlp.experts") == ("language_model.model.layers", 12,
                                                                          "mlp.experts")
    assert split_layer("model.layers.3") == ("model.layers", 3, "") and split_layer("lm_head") is None


def test_plan_lines_group_identical_layers_even_when_not_adjacent():
    """Layers 0 and 2 share every decision, layer 1 differs in one projection: two groups; every
    scheme described once, the most used first; a Kimi wrapper's prefix shown."""
    schemes, layouts = {}, {}
    for i in range(3):
        layouts[f"language_model.model.layers.{i}.self_attn"] = "dense"
        for proj in ("q_a_proj", "o_proj"):
            schemes[f"language_model.model.layers.{i}.self_attn.{proj}"] = "int4 g128"
        schemes[f"language_model.model.layers.{i}.mlp.down_proj"] = "int8" if i == 1 else "int4 g128"
    schemes["language_model.lm_head"] = "dense"
    lines = plan_lines(schemes, layouts)
    assert lines == [
        "schemes (3; `--json` lists every module's):",
        "  [1] int4 g128 (8 modules)",
        "  [2] int8 (1 module)",
        "  [3] dense (1 module)",
        "layers (3 in 2 groups of identical decisions, 1 other modules):",
        "  language_model.model.layers 0, 2 (2): attention dense; [1] all 3 projections",
        "  language_model.model.layers 1: attention dense; [1] self_attn.{q_a_proj, o_proj}; [2] mlp.down_proj",
        "  language_model.lm_head: [3]",
    ]


def test_grouped_targets_fold_rows_that_differ_only_in_the_layer_index():
    rows = [("model.layers.0.mlp.gate_proj", "a"), ("model.layers.1.mlp.gate_proj", "a"),
            ("model.layers.2.mlp.gate_proj", "b"), ("model.layers.3.mlp.gate_proj", "a"), ("lm_head", "a")]
    assert grouped_targets(rows) == [("model.layers.{0-1, 3}.mlp.gate_proj", "a", 3),
                                     ("model.layers.2.mlp.gate_proj", "b", 1), ("lm_head", "a", 1)]
