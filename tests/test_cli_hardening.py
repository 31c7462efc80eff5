"""The CLI exposes the issue-22 features without raw tracebacks (exit codes: 0 ok, 1 QuantplugError,
2 usage, 3 anything else; one line on stderr)."""

from __future__ import annotations

import json

import pytest
from quantplug.cli import main
from quantplug.testing import random_state, tiny_config, write_checkpoint
from test_plugins import _cli, _make_dist
from test_tokenizer import trained_bpe


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    cfg = tiny_config(num_hidden_layers=2)
    return write_checkpoint(tmp_path_factory.mktemp("d") / "c", cfg, random_state(cfg))


def _one_line(err: str) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_plugin_whose_import_panics_is_listed_failed(tmp_path):
    # before: the BaseException escaped load_entry_points: a raw traceback from every command
    site = tmp_path / "site"
    site.mkdir()
    _make_dist(site, "panicky-quant", "0.1", "panicky_quant", """
        class PanicException(BaseException):
            pass
        raise PanicException("called `Option::unwrap()` on a `None` value")
        """, "panicky")
    r = _cli(site, "plugins", "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    rec = {p["name"]: p for p in json.loads(r.stdout)}["panicky"]
    assert rec["status"] == "failed" and "PanicException: called `Option::unwrap()`" in rec["error"]


def test_options_through_the_cli(dense, capsys):
    assert main(["load", str(dense), "-o", "mmap=false", "-o", "tp_timeout_s=5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["options"]["mmap"]["value"] is False and d["options"]["tp_timeout_s"]["value"] == 5.0
    assert main(["plan", str(dense), "-o", "tp_timeout_s=soon"]) == 1
    err = capsys.readouterr().err
    _one_line(err)
    assert "option tp_timeout_s='soon': expected a number in [0.001, 1e+06]" in err
    assert main(["plan", str(dense), "-o", "mmap"]) == 1
    err = capsys.readouterr().err
    _one_line(err)
    assert "-o 'mmap': expected KEY=VALUE" in err
    assert main(["plugins", "--options"]) == 0


def test_a_hostile_chat_template_through_generate(dense, tmp_path, capsys):
    import shutil

    root = tmp_path / "t"
    shutil.copytree(dense, root)
    trained_bpe().save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"}))
    assert main(["generate", str(root), "--prompt", "hi", "--chat", "--max-new-tokens", "1"]) == 1
    err = capsys.readouterr().err
    _one_line(err)
    assert "chat template: recursion too deep" in err


def test_an_unexpected_error_while_building_the_parser_is_exit_3(monkeypatch, capsys):
    import quantplug.cli as cli

    class Panic(BaseException):
        pass

    def boom():
        raise Panic("native panic at startup")

    monkeypatch.setattr(cli, "build_parser", boom)
    assert main(["plugins"]) == 3
    err = capsys.readouterr().err
    _one_line(err)
    assert "unexpected Panic: native panic at startup" in err


def test_plan_problems_go_to_stderr(dense, tmp_path, capsys):
    """docs/cli.md: the plan on stdout, its problems on stderr (one line per cause), exit 1."""
    import shutil

    from quantplug.testing.probes import rename_stored_tensor

    work = tmp_path / "broken"
    shutil.copytree(dense, work)
    rename_stored_tensor(next(work.glob("*.safetensors")), "model.layers.0.self_attn.o_proj.weight")
    assert main(["plan", str(work)]) == 1
    out, err = capsys.readouterr()
    assert "architecture: DeepseekV3ForCausalLM" in out and "o_proj.weight" not in out
    assert "problems (" in err and "model.layers.0.self_attn.o_proj.weight" in err
    assert main(["plan", str(work), "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["problems"] and "model.layers.0.self_attn.o_proj.weight" in err
    assert main(["plan", str(dense)]) == 0
    out, err = capsys.readouterr()
    assert "problems:     none" in out and not err


def test_negative_max_new_tokens_is_a_usage_error_naming_the_flag(dense, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", str(dense), "--tokens", "1,2", "--max-new-tokens", "-1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens" in err and "expected an integer >= 0, got -1" in err and "min_new_tokens" not in err
