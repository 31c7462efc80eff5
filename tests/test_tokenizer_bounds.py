"""Untrusted tokenizer files and chat templates (issue 22): templates rendered within bounds on time,
output size, string growth and recursion (a CheckpointError, never a raw RecursionError /
OverflowError or minutes of rendering); tokenizer_config.json / tokenizer.json through the bounded
JSON reader and the containment check; tiktoken ranks parsed directly (no shared cache, a duplicate
rank a CheckpointError, not a panic)."""

from __future__ import annotations

import base64
import json
import os
import time

import pytest
import quantplug.tokenizer as qt
from quantplug.errors import CheckpointError, ConfigError
from quantplug.tokenizer import load_tokenizer, read_tiktoken_ranks, render_bounded
from test_tokenizer import TEMPLATE, trained_bpe, write_tiktoken

MSGS = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}


def _render(template: str, **kw) -> str:
    return render_bounded(template, MSGS, "ckpt: chat template", **kw)


def test_a_recursive_macro_is_a_checkpoint_error():
    # before: RecursionError escaped the error handling
    with pytest.raises(CheckpointError, match="ckpt: chat template: recursion too deep"):
        _render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")


def test_a_huge_range_is_a_checkpoint_error():
    # before: OverflowError escaped
    with pytest.raises(CheckpointError, match="a number out of range .*Range too big"):
        _render("{% for i in range(10**9) %}{{ i }}{% endfor %}")


def test_nested_loops_stop_at_the_time_bound():
    # before: rendered for minutes
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"rendering took more than 0\.5 s"):
        _render("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}", seconds=0.5)
    assert time.monotonic() - t0 < 3


def test_the_default_time_bound_applies_to_render_chat(tmp_path, monkeypatch):
    tk = trained_bpe()
    tk.save(str(tmp_path / "tokenizer.json"))
    loops = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": loops}))
    monkeypatch.setattr(qt, "TEMPLATE_SECONDS", 0.3)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(CheckpointError, match=r"chat template: rendering took more than 0\.3 s"):
        tok.render_chat([{"role": "user", "content": "x"}])
    time.sleep(0.5)  # no late asynchronous exception reaches this thread after the refusal
    monkeypatch.setattr(qt, "TEMPLATE_SECONDS", 5.0)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert load_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}]).startswith("<|user|>x")


@pytest.mark.parametrize("template,pattern", [
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "its output passed"),
    ("{{ 'x' * 10**9 }}", "refused by the sandbox.*width / count of 1,000,000,000"),
    ("{{ ['x'] * 10**8 }}", "refused by the sandbox"),
    ("{% set ns = namespace(s='x' * 60000) %}{% for i in range(20) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
     "{{ ns.s|length }}", "refused by the sandbox.*items"),
    ("{{ 'a'|center(10**9) }}", "refused by the sandbox"),
    ("{{ 'a'.center(10**9) }}", "refused by the sandbox"),
    ("{{ 'a'.ljust(10**9) }}", "refused by the sandbox"),
    ("{{ '%0999999999d' % 1 }}", "refused by the sandbox.*%-format"),
    ("{{ '%*d' % (10**9, 1) }}", "refused by the sandbox"),
    ("{{ '{:>999999999}'.format(1) }}", "refused by the sandbox: a format with a huge width"),
    ("{{ '{:>{}}'.format(1, 10**9) }}", "refused by the sandbox: a width"),
    ("{{ lipsum(99999) }}", "refused by the sandbox: lipsum"),
    ("{{ messages|tojson(indent=10**6) }}", "tojson indent"),
    ("{{ 10**(10**8) }}", "refused by the sandbox.*power"),
    ("{{ ('x' * 5000).replace('x', 'y' * 5000) }}", "refused by the sandbox"),
    ("{{ range(20000)|list|join(',') * 10000 }}", "refused by the sandbox"),  # 109 kB x 10,000
])
def test_string_growth_is_bounded_before_the_allocation(template, pattern):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=pattern):
            _render(template)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB allocated before the refusal"


def test_template_errors_are_one_line_checkpoint_errors():
    with pytest.raises(CheckpointError, match=r"syntax error \(line 1\)"):
        _render("{% for %}")
    with pytest.raises(CheckpointError, match="failed: no roles"):
        _render("{{ raise_exception('no roles') }}")
    with pytest.raises(CheckpointError, match="refused by the sandbox"):
        _render("{{ messages.__class__.__mro__ }}")
    with pytest.raises(CheckpointError, match="failed while rendering"):
        _render("{{ 1 // 0 }}")
    assert _render(TEMPLATE) .startswith("<|user|>hi")


def test_tokenizer_config_is_read_bounded(tmp_path):
    tk = trained_bpe()
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    # before: RecursionError from json.loads
    with pytest.raises(CheckpointError, match="tokenizer_config.json: JSON nested deeper than 32 levels"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(CheckpointError, match="key 'a' appears twice"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": 5}')
    with pytest.raises(ConfigError, match="tokenizer_config.json: chat_template = 5: expected a string"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": 7}')  # before: silently no EOS string
    with pytest.raises(ConfigError, match="tokenizer_config.json: eos_token = 7: expected a string"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"5": {"content": 3}}}')
    with pytest.raises(ConfigError, match=r"added_tokens_decoder\.5\.content = 3: expected a string"):
        load_tokenizer(tmp_path)


def test_tokenizer_json_is_depth_checked(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(CheckpointError, match="tokenizer.json: JSON nested too deeply"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "tiktoken.model", "chat_template.jinja"])
def test_tokenizer_files_outside_the_checkpoint_are_refused(tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "ckpt"
    root.mkdir()
    if name == "tokenizer.json":
        trained_bpe().save(str(outside / name))
    elif name == "tiktoken.model":
        write_tiktoken(outside)
    elif name == "chat_template.jinja":
        (outside / name).write_text("{{ 'secret' }}")
        trained_bpe().save(str(root / "tokenizer.json"))
    else:
        (outside / name).write_text("{}")
        trained_bpe().save(str(root / "tokenizer.json"))
    os.symlink(outside / name, root / name)
    # before: the file outside was read
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_tokenizer(root)


def _tiktoken_lines(ranks: dict[bytes, int]) -> str:
    return "".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items())


def test_a_duplicate_tiktoken_rank_is_a_checkpoint_error_not_a_panic(tmp_path):
    ranks = write_tiktoken(tmp_path)
    text = _tiktoken_lines(ranks) + f"{base64.b64encode(b'zz').decode()} {ranks[b'he']}\n"
    (tmp_path / "tiktoken.model").write_text(text)
    with pytest.raises(CheckpointError, match=r"tiktoken.model: line \d+: rank 256 appears twice"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("edit,pattern", [
    (lambda r: {k: v for k, v in r.items() if k != b"a"}, "single byte"),
    (lambda r: {**r, b"zz": len(r) + 5}, "without gaps"),
    (lambda r: {**r, b"he": len(r)}, None),  # the same token twice (the file has both lines)
])
def test_tiktoken_ranks_are_checked(tmp_path, edit, pattern):
    ranks = write_tiktoken(tmp_path)
    if pattern is None:
        (tmp_path / "tiktoken.model").write_text(_tiktoken_lines(ranks) + f"{base64.b64encode(b'he').decode()} "
                                                 f"{len(ranks)}\n")
        pattern = "token b'he' appears twice"
    else:
        new = edit(ranks)
        if pattern == "single byte":  # keep ranks dense: renumber
            new = {k: i for i, k in enumerate(new)}
        (tmp_path / "tiktoken.model").write_text(_tiktoken_lines(new))
    with pytest.raises(CheckpointError, match=pattern):
        read_tiktoken_ranks(tmp_path / "tiktoken.model")
    (tmp_path / "tiktoken.model").write_text("!!!notbase64 3\n")
    with pytest.raises(CheckpointError, match="is not base64"):
        read_tiktoken_ranks(tmp_path / "tiktoken.model")


def test_tiktoken_model_is_read_directly_without_a_shared_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    root = tmp_path / "c"
    root.mkdir()
    write_tiktoken(root)
    tok = load_tokenizer(root)
    first = tok.encode("hello")
    assert list(cache.iterdir()) == []  # nothing parsed into a shared cache
    # the file edited in place (same path): the new ranks are used (before: the cached parse)
    ranks = {bytes([b]): b for b in range(256)}
    (root / "tiktoken.model").write_text(_tiktoken_lines(ranks))
    assert load_tokenizer(root).encode("hello") == list(b"hello") != first
