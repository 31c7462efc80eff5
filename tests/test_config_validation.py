"""Config validation in the core and through ``quantplug.api.Fields`` (issue 22): every config
field a plugin reads is typed and range-checked, a failure is one line naming the file and the
key path, and no plugin sees an unvalidated value (before: raw Python errors wrapped as "plugin X
failed in quantplug_validate_plan: ValueError: ...", or a wrong-typed value silently replaced by
a default)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import VENDOR
from quantplug.errors import ConfigError, QuantplugError
from quantplug.plan import build_plan
from quantplug.testing import formats, random_state, tiny_config
from quantplug.validation import Fields

RAW = re.compile(r"failed in quantplug_|\b[A-Z]\w*(Error|Exception): |object has no attribute|cannot convert|"
                 r"invalid literal|not subscriptable|unhashable")


def _variant(src: Path, dst: Path, file: str, edit) -> Path:
    """``dst``: ``src``'s files hard-linked, ``file`` (JSON) rewritten by ``edit(doc)``."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != file:
            os.link(f, dst / f.name)
    doc = json.loads((src / file).read_text())
    edit(doc)
    (dst / file).write_text(json.dumps(doc))
    return dst


def _refused(path: Path, *patterns: str) -> str:
    with pytest.raises(QuantplugError) as exc:
        build_plan(path)
    msg = str(exc.value)
    assert isinstance(exc.value, ConfigError), msg
    assert str(path / "config.json") in msg or path.name in msg, msg
    for p in patterns:
        assert re.search(p, msg), (p, msg)
    assert not RAW.search(msg), msg
    assert "\n" not in msg
    return msg


gguf_dir = pytest.fixture(scope="module", name="gguf_dir")(lambda two_layer: two_layer("gguf"))
dense_dir = pytest.fixture(scope="module", name="dense_dir")(lambda two_layer: two_layer("dense"))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), [1], "1", -1, 1.5])
def test_num_nextn_predict_layers_is_validated_by_the_core(gguf_dir, tmp_path, value):
    path = _variant(gguf_dir, tmp_path / "c", "config.json", lambda d: d.update(num_nextn_predict_layers=value))
    _refused(path, r"config\.json: num_nextn_predict_layers = .*: expected an integer in \[0, 1024\]")


def test_num_nextn_predict_layers_reaches_the_plugin_validated(gguf_dir, tmp_path):
    path = _variant(gguf_dir, tmp_path / "c", "config.json", lambda d: d.update(num_nextn_predict_layers=1))
    plan = build_plan(path)
    assert plan.model_config.num_nextn_predict_layers == 1 and not plan.errors


@pytest.mark.parametrize("value", [[{"rope_type": "yarn"}], 3.5, "yarn", True])
def test_rope_parameters_of_the_wrong_type_are_refused(dense_dir, tmp_path, value):
    path = _variant(dense_dir, tmp_path / "c", "config.json", lambda d: d.update(rope_parameters=value))
    _refused(path, r"config\.json: rope_parameters = .*: expected an object")


def test_rope_scaling_of_the_wrong_type_is_refused(dense_dir, tmp_path):
    path = _variant(dense_dir, tmp_path / "c", "config.json", lambda d: d.update(rope_scaling=["yarn"]))
    _refused(path, r"config\.json: rope_scaling = \['yarn'\]: expected an object")


def test_a_zero_yarn_beta_is_refused_not_replaced_by_a_default(dense_dir, tmp_path):
    # before: beta_fast 0 silently became 32
    path = _variant(dense_dir, tmp_path / "c", "config.json", lambda d: d["rope_parameters"].update(beta_fast=0))
    _refused(path, r"config\.json: rope_parameters\.beta_fast = 0: expected a finite number in \[0\.001, 10000\]")


def test_quantization_config_must_be_an_object(dense_dir, tmp_path):
    path = _variant(dense_dir, tmp_path / "c", "config.json", lambda d: d.update(quantization_config=["quark"]))
    _refused(path, r"config\.json: quantization_config = \['quark'\]: expected an object")
    path = _variant(dense_dir, tmp_path / "d", "config.json",
                    lambda d: d.update(quantization_config={"quant_method": 7}))
    _refused(path, r"quantization_config\.quant_method = 7: expected a string")


# -- Quark --------------------------------------------------------------------------------------

QUARK = VENDOR / "quark_mxfp4_dsv3"


def _quark(tmp_path, edit):
    return _variant(QUARK, tmp_path / "q", "config.json", lambda d: edit(d["quantization_config"]))


def test_quark_weight_without_dtype_is_refused(tmp_path):
    # before: accepted, the layer loaded as MXFP4 with dtype None
    path = _quark(tmp_path, lambda q: q["global_quant_config"]["weight"].pop("dtype"))
    _refused(path, r"quantization_config\.global_quant_config\.weight\.dtype is missing: expected a string")


def test_quark_layer_type_quant_config_as_a_list_is_refused(tmp_path):
    path = _quark(tmp_path, lambda q: q.update(layer_type_quant_config=[{"weight": {"dtype": "fp4"}}]))
    _refused(path, r"quantization_config\.layer_type_quant_config = .*: expected an object of objects")


def test_quark_invalid_regex_names_file_and_key_path(tmp_path):
    # before: "plugin quark failed in quantplug_validate_plan: error: unterminated character set at position 0"
    path = _quark(tmp_path, lambda q: q.update(exclude=["lm_head", "re:["]))
    _refused(path, r"config\.json: quantization_config\.exclude\[1\] = '\[': expected a valid regular expression "
                   r"\(a \[ set is not closed, at position 0\)")


@pytest.mark.parametrize("key,value,pattern", [
    ("exclude", "lm_head", r"exclude = 'lm_head': expected a list of strings"),
    ("exclude", [3], r"exclude\[0\] = 3: expected a non-empty string"),
    ("export", [], r"export = \[\]: expected an object"),
    ("global_quant_config", "fp4", r"global_quant_config = 'fp4': expected an object"),
    ("layer_quant_config", {"*q_a_proj": 4}, r"layer_quant_config\.\*q_a_proj = 4: expected an object or null"),
    ("version", 13, r"version = 13: expected a string"),
])
def test_quark_fields_are_typed(tmp_path, key, value, pattern):
    path = _quark(tmp_path, lambda q: q.update({key: value}))
    _refused(path, pattern)


def test_quark_weight_fields_are_typed(tmp_path):
    path = _quark(tmp_path, lambda q: q["global_quant_config"]["weight"].update(group_size="32"))
    _refused(path, r"global_quant_config\.weight\.group_size = '32': expected an integer")


# -- compressed-tensors ---------------------------------------------------------------------------

CT = VENDOR / "ct_w4a16_experts_dsv3"


def _ct(tmp_path, edit):
    return _variant(CT, tmp_path / "ct", "config.json", lambda d: edit(d["quantization_config"]))


def _group(q):
    return next(iter(q["config_groups"].values()))


@pytest.mark.parametrize("edit,pattern", [
    (lambda q: _group(q)["weights"].update(group_size="32"), r"weights\.group_size = '32': expected an integer"),
    (lambda q: _group(q)["weights"].update(num_bits=float("nan")), r"weights\.num_bits = nan: expected an integer"),
    (lambda q: _group(q)["weights"].update(symmetric="yes"), r"weights\.symmetric = 'yes': expected true or false"),
    (lambda q: _group(q)["weights"].update(type="posit"), r"weights\.type = 'posit': expected one of 'int', 'float'"),
    (lambda q: _group(q)["weights"].update(dynamic="sometimes"), r"weights\.dynamic = 'sometimes'"),
    (lambda q: _group(q)["weights"].update(block_structure=[128]), r"weights\.block_structure = \[128\]"),
    (lambda q: _group(q).update(targets=[7]), r"targets\[0\] = 7: expected a non-empty string"),
    (lambda q: _group(q).update(targets=["re:(unclosed"]), r"targets\[0\] = '\(unclosed': expected a valid regular"),
    (lambda q: q.update(ignore=["re:["]), r"quantization_config\.ignore\[0\] = '\[': expected a valid regular"),
    (lambda q: q.update(ignore="lm_head"), r"quantization_config\.ignore = 'lm_head': expected a list of strings"),
    (lambda q: q.update(config_groups=[1]), r"quantization_config\.config_groups = \[1\]: expected an object"),
    (lambda q: q.update(format=5), r"quantization_config\.format = 5: expected a string"),
    (lambda q: q.update(sparsity_config="2:4"), r"quantization_config\.sparsity_config = '2:4': expected an object"),
])
def test_compressed_tensors_fields_are_typed(tmp_path, edit, pattern):
    _refused(_ct(tmp_path, edit), pattern)


def test_compressed_tensors_group_size_minus_one_means_per_channel():
    from quantplug_compressed_tensors.config import QuantArgs

    args = QuantArgs.parse({"num_bits": 4, "group_size": -1}, "w")
    assert args.strategy == "channel" and args.group_size is None
    with pytest.raises(ConfigError, match="group_size = -1: expected a positive group size for strategy 'group'"):
        QuantArgs.parse({"num_bits": 4, "group_size": -1, "strategy": "group"}, "w")


# -- FP8 ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    cfg = tiny_config(num_hidden_layers=2)
    return formats.fp8(tmp_path_factory.mktemp("f") / "fp8", cfg, random_state(cfg))


@pytest.mark.parametrize("key,value,pattern", [
    ("weight_block_size", [128, True], r"weight_block_size = \[128, True\]: expected a list of 2 integers"),
    ("weight_block_size", [2**40, 128], r"weight_block_size = .*: expected a list of 2 integers in \[1, 65536\]"),
    ("scale_fmt", 8, r"scale_fmt = 8: expected one of 'ue8m0'"),
    ("modules_to_not_convert", "lm_head", r"modules_to_not_convert = 'lm_head': expected a list of strings"),
    ("activation_scheme", "static", r"activation_scheme = 'static': expected one of 'dynamic'"),
])
def test_fp8_fields_are_typed(fp8_dir, tmp_path, key, value, pattern):
    path = _variant(fp8_dir, tmp_path / "c", "config.json", lambda d: d["quantization_config"].update({key: value}))
    _refused(path, pattern)


# -- ModelSlim ------------------------------------------------------------------------------------

def test_modelslim_description_values_are_typed(tmp_path):
    src = VENDOR / "modelslim_w8a8_dsv3"
    doc = json.loads((src / "quant_model_description.json").read_text())
    key = next(k for k, v in doc.items() if v == "W8A8")

    def edit(d):
        d[key] = 8  # before: the tensor's entry was silently dropped

    path = _variant(src, tmp_path / "m", "quant_model_description.json", edit)
    with pytest.raises(ConfigError) as exc:
        build_plan(path)
    assert f"quant_model_description.json: {key} = 8: expected a string" in str(exc.value)
    path = _variant(src, tmp_path / "n", "quant_model_description.json", lambda d: d.update(group_size="x"))
    with pytest.raises(ConfigError, match=r"quant_model_description\.json: group_size = 'x': expected an integer"):
        build_plan(path)


# -- ModelOpt -------------------------------------------------------------------------------------

NVFP4 = VENDOR / "modelopt_nvfp4_dsv3"
MIXED = VENDOR / "modelopt_mixed_dsv3"


def _side(src, tmp_path, edit):
    return _variant(src, tmp_path / "mo", "hf_quant_config.json", edit)


@pytest.mark.parametrize("edit,pattern", [
    # before: accepted, the string taken for a default or ignored (the first four), or a message
    # without the key path
    (lambda d: d.update(producer="modelopt"), r"hf_quant_config\.json: producer = 'modelopt': expected an object"),
    (lambda d: d["quantization"].update(kv_cache_quant_algo=8),
     r"hf_quant_config\.json: quantization\.kv_cache_quant_algo = 8: expected a string"),
    (lambda d: d.update(quantization=["NVFP4"]), r"hf_quant_config\.json: quantization = \['NVFP4'\]: expected an object"),
    (lambda d: d["quantization"]["exclude_modules"].append(""),
     r"quantization\.exclude_modules\[4\] = '': expected a non-empty string"),
    (lambda d: d["quantization"].update(group_size="16"),
     r"hf_quant_config\.json: quantization\.group_size = '16': expected an integer in \[1, 65536\]"),
    (lambda d: d["quantization"].update(exclude_modules="lm_head"),
     r"quantization\.exclude_modules = 'lm_head': expected a list of strings"),
    (lambda d: d["quantization"]["exclude_modules"].append("re:["),
     r"quantization\.exclude_modules\[4\] = '\[': expected a valid regular expression"),
    (lambda d: d["quantization"].update(quant_algo=4), r"quantization\.quant_algo = 4: expected a string"),
    (lambda d: d["quantization"].update(quant_algo=""), r"quantization\.quant_algo = '': expected a non-empty string"),
])
def test_modelopt_sidecar_fields_are_typed(tmp_path, edit, pattern):
    path = _side(NVFP4, tmp_path, edit)
    msg = _refused_file(path, "hf_quant_config.json", pattern)
    assert "plugin" not in msg or "modelopt" in msg


@pytest.mark.parametrize("edit,pattern", [
    (lambda q: q["quantized_layers"].update({"model.layers.0.mlp.down_proj": {"quant_algo": 7}}),
     r"quantization\.quantized_layers\.model\.layers\.0\.mlp\.down_proj\.quant_algo = 7: expected a string"),
    (lambda q: q["quantized_layers"].update({"model.layers.0.mlp.down_proj": "NVFP4"}),
     r"quantized_layers\.model\.layers\.0\.mlp\.down_proj = 'NVFP4': expected an object"),
    (lambda q: q.update(quantized_layers={}), r"quantization\.quantized_layers = \{\}: expected a non-empty map"),
    (lambda q: q["quantized_layers"]["model.layers.0.mlp.down_proj"].update(group_size=0),
     r"down_proj\.group_size = 0: expected an integer in \[1, 65536\]"),
])
def test_modelopt_mixed_precision_fields_are_typed(tmp_path, edit, pattern):
    _refused_file(_side(MIXED, tmp_path, lambda d: edit(d["quantization"])), "hf_quant_config.json", pattern)


def test_modelopt_config_json_form_fields_are_typed(tmp_path):
    """Without hf_quant_config.json, config.json's quantization_config is read through the same Fields."""
    root = tmp_path / "c"
    root.mkdir()
    for f in NVFP4.iterdir():
        if f.name not in ("hf_quant_config.json", "config.json"):
            os.link(f, root / f.name)
    cfg = json.loads((NVFP4 / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = "lm_head"
    (root / "config.json").write_text(json.dumps(cfg))
    _refused(root, r"config\.json: quantization_config\.ignore = 'lm_head': expected a list of strings")


# -- GPTQ / AWQ / AutoRound -----------------------------------------------------------------------

GPTQ = VENDOR / "gptq_autoround_dsv3"
AWQ = VENDOR / "awq_autoround_dsv3"
AUTOROUND = VENDOR / "autoround_gptq_dsv3"


@pytest.mark.parametrize("src,edit,pattern", [
    # before: bool("false") is True: a symmetric load of an asymmetric checkpoint
    (GPTQ, lambda q: q.update(sym="false"), r"quantization_config\.sym = 'false': expected true or false"),
    (GPTQ, lambda q: q.update(desc_act=1), r"quantization_config\.desc_act = 1: expected true or false"),
    (GPTQ, lambda q: q.update(lm_head="no"), r"quantization_config\.lm_head = 'no': expected true or false"),
    # before: any other checkpoint_format was read as "gptq" (zero points stored minus one)
    (GPTQ, lambda q: q.update(checkpoint_format="marlin"),
     r"quantization_config\.checkpoint_format = 'marlin': expected one of 'gptq', 'gptq_v2'"),
    (GPTQ, lambda q: q["dynamic"].update({"-:[": {}}), r"quantization_config\.dynamic\.-:\[ = '\[': expected a valid "
                                                      r"regular expression"),
    (GPTQ, lambda q: q["dynamic"].update({"+:.*down_proj": {"bits": "8"}}),
     r"quantization_config\.dynamic\.\+:\.\*down_proj\.bits = '8': expected an integer"),
    (GPTQ, lambda q: q.update(dynamic=["-:.*gate"]), r"quantization_config\.dynamic = .*: expected an object"),
    (GPTQ, lambda q: q.update(group_size="128"), r"quantization_config\.group_size = '128': expected an integer"),
    (GPTQ, lambda q: q.update(group_size=0), r"quantization_config\.group_size = 0: expected a positive group size"),
    (GPTQ, lambda q: q.update(data_type=4), r"quantization_config\.data_type = 4: expected a string"),
    (AWQ, lambda q: q.update(zero_point="false"), r"quantization_config\.zero_point = 'false': expected true or false"),
    (AWQ, lambda q: q.update(version="gemv"), r"quantization_config\.version = 'gemv': expected 'gemm': only AWQ GEMM"),
    (AWQ, lambda q: q.update(bits=3), r"quantization_config\.bits = 3: expected one of the supported bit widths: 4, 8"),
    (AWQ, lambda q: q["modules_to_not_convert"].append(""),
     r"quantization_config\.modules_to_not_convert\[6\] = '': expected a non-empty string"),
    (AUTOROUND, lambda q: q.update(packing_format="auto_round:marlin"),
     r"quantization_config\.packing_format = 'auto_round:marlin': expected one of 'auto_round:auto_gptq'"),
    (AUTOROUND, lambda q: q["extra_config"].update({"model.layers.0.mlp.down_proj": {"group_size": True}}),
     r"extra_config\.model\.layers\.0\.mlp\.down_proj\.group_size = True: expected an integer"),
    (AUTOROUND, lambda q: q["extra_config"].update({"(": {"bits": 16}}),
     r"quantization_config\.extra_config\.\( = '\.\*\(\?:\(\)': expected a valid regular expression"),
    (AUTOROUND, lambda q: q.update(extra_config={"model.layers.0.mlp.down_proj": 16}),
     r"extra_config\.model\.layers\.0\.mlp\.down_proj = 16: expected an object"),
])
def test_gptq_awq_autoround_fields_are_typed(tmp_path, src, edit, pattern):
    _refused(_variant(src, tmp_path / "g", "config.json", lambda d: edit(d["quantization_config"])), pattern)


# -- where quantization_config lives ----------------------------------------------------------------

def test_quantization_config_in_both_places_must_agree(fp8_dir, tmp_path):
    """One finder (``quantplug.api.quant_config_fields``) for every backend: Kimi releases repeat the
    config under text_config; two different ones are refused (before: fp8, quark and ModelOpt took
    the top-level one silently; compressed-tensors refused; GPTQ's detect refused it for every
    checkpoint, fp8 ones included, in its own name)."""
    qc = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    same = _variant(fp8_dir, tmp_path / "s", "config.json", lambda d: d.update(text_config={"quantization_config": qc}))
    assert build_plan(same).backend == "fp8"
    other = dict(qc, weight_block_size=[64, 64])
    path = _variant(fp8_dir, tmp_path / "d", "config.json", lambda d: d.update(text_config={"quantization_config": other}))
    msg = _refused(path, r"config\.json: quantization_config and text_config\.quantization_config differ")
    assert "plugin" not in msg, msg  # before: "plugin gptq ... in quantplug_detect", for an fp8 checkpoint
    path = _variant(fp8_dir, tmp_path / "l", "config.json", lambda d: d.update(text_config={"quantization_config": [1]}))
    _refused(path, r"config\.json: text_config\.quantization_config = \[1\]: expected an object")


def _refused_file(path: Path, file: str, *patterns: str) -> str:
    with pytest.raises(ConfigError) as exc:
        build_plan(path)
    msg = str(exc.value)
    assert str(path / file) in msg, msg
    for p in patterns:
        assert re.search(p, msg), (p, msg)
    assert not RAW.search(msg) and "\n" not in msg, msg
    return msg


# -- Fields --------------------------------------------------------------------------------------

def test_fields_readers_name_file_and_key_path():
    f = Fields({"a": {"b": ["y", 3], "c": {"d": None}}, "s": "re:("}, "/x/config.json")
    a = f.get_obj("a")
    assert a is not None and a.sub("b") == "a.b"
    with pytest.raises(ConfigError, match=r"^/x/config\.json: a\.b\[1\] = 3: expected a non-empty string$"):
        a.str_list("b")
    with pytest.raises(ConfigError, match=r"a\.c\.d = None: expected an object$"):
        a.entries("c")
    assert a.entries("c", nullable=True) == [("d", None)]
    with pytest.raises(ConfigError, match=r"/x/config\.json: s = '\(': expected a valid regular expression"):
        f.regex("s", f.data["s"][3:])
    with pytest.raises(ConfigError, match=r"a = .*: expected an object or a non-empty list of objects"):
        Fields({"a": []}, "f").obj_or_list("a")
    assert Fields({"a": "x"}, "f").str_list("a", single=True) == ("x",)
    with pytest.raises(ConfigError, match=r"^f: \(top level\): expected an object, got a list$"):
        Fields([], "f")  # type: ignore[arg-type]


@pytest.mark.parametrize("file,value,pattern", [
    ("generation_config.json", "two", r"generation_config\.json: eos_token_id = 'two': expected an integer"),
    ("generation_config.json", [1, float("nan")], r"generation_config\.json: eos_token_id = .*: expected a list of"),
    ("config.json", -3, r"config\.json: eos_token_id = -3: expected an integer"),
])
def test_eos_ids_are_typed(dense_dir, tmp_path, file, value, pattern):
    import quantplug
    import torch

    root = tmp_path / "c"
    root.mkdir()
    for f in dense_dir.iterdir():
        os.link(f, root / f.name)
    if file == "generation_config.json":
        (root / file).write_text(json.dumps({"eos_token_id": value}))
    else:
        (root / file).unlink()
        doc = json.loads((dense_dir / file).read_text())
        doc["eos_token_id"] = value
        (root / file).write_text(json.dumps(doc))
    model = quantplug.load(root, progress=False)
    # before: int('two') / int(nan) raised a raw ValueError from generate
    with pytest.raises(ConfigError, match=pattern):
        model.generate(torch.tensor([[1, 2]]), 2)


@pytest.mark.parametrize("pattern", ["[", "(a", "a)", "*", "a**", r"\q", "[z-a]", "(?<=a+)b", "(?x", "(?P<>a)",
                                     r"(?P=nope)"])
def test_regex_errors_are_said_in_our_words(pattern):
    """Every regular-expression error names the key and position in quantplug's words, none of the
    regex compiler's own text."""
    import re

    from quantplug.validation import Fields

    with pytest.raises(re.error) as compiler:
        re.compile(pattern)
    with pytest.raises(ConfigError) as ours:
        Fields({"x": pattern}, "/c/config.json").regex("x", pattern)
    text = str(ours.value)
    assert text.startswith("/c/config.json: x = ") and "expected a valid regular expression (" in text
    assert compiler.value.msg not in text and "malformed" not in text, text
