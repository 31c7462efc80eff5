"""``quantplug eval`` (core/eval.py): llama-perplexity's scoring, the logits file, KLD, CLI errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import quantplug
import torch
from quantplug.cli import main
from quantplug.eval import (
    HEADER_BYTES,
    EvalError,
    LogitsReader,
    LogitsWriter,
    evaluate,
    logits_file_bytes,
    pack_rows,
    row_values,
    scored_per_window,
    text_tokens,
    unpack_rows,
)
from quantplug.testing import random_state, tiny_config, write_checkpoint

BOS = 0


def _tokenizer(root, vocab: int) -> None:
    """tokenizer.json: words "w1".."w{n-1}" -> their ids, "<s>" = 0 added in front (a BOS post-processor)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tk = Tokenizer(models.WordLevel({"<s>": 0, **{f"w{i}": i for i in range(1, vocab)}}, unk_token="w1"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tk.save(str(root / "tokenizer.json"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tiny_config(num_hidden_layers=2)
    root = write_checkpoint(tmp_path_factory.mktemp("eval") / "m", cfg, random_state(cfg, seed=4))
    _tokenizer(root, cfg["vocab_size"])
    ids = torch.randint(1, cfg["vocab_size"], (61,), generator=torch.Generator().manual_seed(1)).tolist()
    text = root.parent / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in ids))
    return root, text, ids


@pytest.fixture(scope="module")
def model(ckpt):
    return quantplug.load(ckpt[0], progress=False)


def test_tokens_bos_first(ckpt):
    root, text, ids = ckpt
    tokens, bos = text_tokens(root, text.read_text())
    assert bos == BOS and tokens == [BOS, *ids]


def test_scoring_matches_a_hand_computation(ckpt, model):
    root, text, ids = ckpt
    tokens = [BOS, *ids]  # 62 tokens: 7 windows of 8, a 6-token tail dropped
    n_ctx = 8
    nll = []
    with torch.no_grad():
        for k in range(len(tokens) // n_ctx):
            win = tokens[k * n_ctx:(k + 1) * n_ctx]
            inp = torch.tensor([[BOS, *win[1:]]])  # BOS replaces every window's first token
            logp = torch.log_softmax(model(inp)[0].double(), -1)
            nll += [-float(logp[p, win[p + 1]]) for p in range(n_ctx // 2, n_ctx - 1)]  # second half only
    assert len(nll) == 7 * 3 == 7 * scored_per_window(n_ctx)
    mean = sum(nll) / len(nll)
    var = sum(x * x for x in nll) / len(nll) - mean * mean
    ppl = math.exp(mean)
    err = ppl * math.sqrt(var / (len(nll) - 1))
    for batch in (1, 3):
        r = evaluate(model, tokens, n_ctx=n_ctx, bos=BOS, batch=batch, progress=False)
        assert r is not None and r.count == 21 and r.n_chunk == 7
        assert r.ppl == pytest.approx(ppl, rel=1e-5) and r.ppl_err == pytest.approx(err, rel=1e-4)
        assert r.running[0] == pytest.approx(math.exp(sum(nll[:3]) / 3), rel=1e-5)
        assert r.running[-1] == pytest.approx(r.ppl)
    no_bos = evaluate(model, tokens, n_ctx=n_ctx, bos=None, progress=False)
    assert no_bos is not None and no_bos.ppl != pytest.approx(ppl, rel=1e-6)  # BOS does matter
    capped = evaluate(model, tokens, n_ctx=n_ctx, bos=BOS, max_chunks=2, progress=False)
    assert capped is not None and capped.n_chunk == 2 and capped.ppl == pytest.approx(math.exp(sum(nll[:6]) / 6), rel=1e-5)


def test_pack_rows_is_llama_cpp_quantization():
    logits = torch.tensor([[2.0, 1.0, -30.0, 2.0 - 16.0 + 1e-3, 0.5]])
    rows = pack_rows(logits)
    assert rows.shape == (1, row_values(5)) == (1, 10) and rows.dtype == np.dtype("<u2")
    scale, min_log_prob = rows[0, :4].view("<f4")
    lse = float(torch.logsumexp(logits[0], 0))
    assert scale == pytest.approx(16 / 65535) and min_log_prob == pytest.approx(-16 - lse + 2, abs=1e-5)
    q = rows[0, 4:9]
    assert q[0] == 65535 and q[2] == 0 and rows[0, 9] == 0  # the max; below max - 16; the even padding
    back = unpack_rows(rows, 5)[0]
    exact = torch.log_softmax(logits[0], 0)
    keep = logits[0] > 2 - 16
    assert torch.allclose(back[keep], exact[keep], atol=scale)  # within one step of the uint16 grid
    flat = pack_rows(torch.zeros(1, 4))  # all equal: scale 0, every q 0, log p = min_log_prob = -log 4
    assert flat[0, :4].view("<f4")[0] == 0 and not flat[0, 4:].any()
    assert unpack_rows(flat, 4)[0] == pytest.approx(torch.full((4,), -math.log(4)), abs=1e-6)


def test_logits_file_round_trip_and_size(ckpt, model, tmp_path):
    root, text, ids = ckpt
    tokens = [BOS, *ids]
    out = tmp_path / "base.logits"
    r = evaluate(model, tokens, n_ctx=16, bos=BOS, save_logits=out, progress=False)
    assert r is not None and r.n_chunk == 3 and r.logits_file == str(out)
    v = model.config.vocab_size
    per_token = 2 * row_values(v)
    assert per_token == 2 * v + 8  # an even vocabulary: 2 bytes a token + 8 for scale and min_log_prob
    size = HEADER_BYTES + 4 * 3 * 16 + 3 * 7 * per_token
    assert out.stat().st_size == size == logits_file_bytes(16, v, 3) == r.logits_bytes
    assert not (tmp_path / "base.logits.part").exists()
    rd = LogitsReader(out)
    assert (rd.n_ctx, rd.n_vocab, rd.n_chunk) == (16, v, 3) and rd.tokens.tolist() == tokens[:48]
    with torch.no_grad():
        win = torch.tensor([[BOS, *tokens[17:32]]])
        exact = torch.log_softmax(model(win)[0, 8:15].float(), -1)
    stored = unpack_rows(rd.window(1), v)
    scale = torch.from_numpy(rd.window(1)[:, :4].copy().view("<f4")[:, 0].astype(np.float32))
    keep = exact > exact.max(-1, keepdim=True).values - 16
    assert ((stored - exact).abs() <= scale[:, None] + 1e-6)[keep].all()
    rd.close()
    # streamed: the writer holds one window's rows at a time and refuses an incomplete file
    w = LogitsWriter(tmp_path / "part.logits", 16, v, tokens[:32])
    w.write(pack_rows(torch.zeros(7, v)))
    with pytest.raises(EvalError, match="7 rows written of 14"):
        w.close()
    assert not (tmp_path / "part.logits").exists() and not (tmp_path / "part.logits.part").exists()
    (tmp_path / "cut.logits").write_bytes(out.read_bytes()[:-1])
    with pytest.raises(EvalError, match="truncated"):
        LogitsReader(tmp_path / "cut.logits")


def test_kld_against_itself_is_zero(ckpt, model, tmp_path):
    tokens = [BOS, *ckpt[2]]
    base = tmp_path / "self.logits"
    r0 = evaluate(model, tokens, n_ctx=16, bos=BOS, save_logits=base, progress=False)
    r = evaluate(model, None, bos=BOS, reference=base, progress=False)
    assert r0 is not None and r is not None and r.kld is not None
    k = r.kld
    assert abs(k.kld_mean) < 1e-5 and abs(k.kld_max) < 1e-4 and k.same_top == 1.0 and k.count == 21
    assert r.ppl == pytest.approx(r0.ppl, rel=1e-6) and k.ppl == pytest.approx(r0.ppl, rel=1e-6)
    assert k.ppl_base == pytest.approx(r0.ppl, rel=1e-3) and abs(k.ppl_diff) < 1e-3 * r0.ppl  # base as uint16
    # another model is not at 0: KLD > 0, delta PPL its PPL minus the base's
    cfg = tiny_config(num_hidden_layers=2)
    other = write_checkpoint(tmp_path / "o", cfg, random_state(cfg, seed=5))
    r2 = evaluate(quantplug.load(other, progress=False), tokens, n_ctx=16, bos=BOS, reference=base, progress=False)
    assert r2 is not None and r2.kld is not None and r2.kld.kld_mean > 1e-3 and r2.kld.same_top < 1
    assert r2.kld.ppl_diff == pytest.approx(r2.ppl - r2.kld.ppl_base)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_cli_text_and_json(ckpt, tmp_path, capsys):
    root, text, _ = ckpt
    assert main(["eval", str(root), "--text", str(text), "--ctx", "8"]) == 0
    out = capsys.readouterr().out
    assert "Final estimate: PPL = " in out and "[1]" in out and "BOS 0" in out
    save = tmp_path / "c.logits"
    assert main(["eval", str(root), "--text", str(text), "--ctx", "8", "--json", "--save-logits", str(save)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["n_chunk"] == 7 and d["count"] == 21 and d["kld"] is None and save.exists()
    # the reference's own tokens, no --text; expert_cache_mb passes through -o as for the other commands
    assert main(["eval", str(root), "--reference", str(save), "--json", "-o", "expert_cache_mb=1"]) == 0
    k = json.loads(capsys.readouterr().out)
    assert k["ppl"] == pytest.approx(d["ppl"], rel=1e-6) and k["kld"]["same_top"] == 1.0
    assert abs(k["kld"]["kld_mean"]) < 1e-5 and "kld_p99" in k["kld"]
    assert main(["eval", str(root), "--text", str(text), "--reference-model", str(root), "--ctx", "8", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["ppl"] == pytest.approx(d["ppl"], rel=1e-6) and m["kld"]["same_top"] == 1.0


def test_cli_errors_are_one_line(ckpt, tmp_path, capsys):
    root, text, ids = ckpt
    assert main(["eval", str(root), "--text", str(tmp_path / "missing.txt")]) == 1
    assert "missing.txt: no such file" in _one_error_line(capsys)
    assert main(["eval", str(root), "--text", str(text), "--ctx", "2"]) == 1
    assert "--ctx 2: expected >= 3" in _one_error_line(capsys)
    assert main(["eval", str(root), "--text", str(text), "--ctx", "4096"]) == 1
    assert "--ctx 4096 exceeds the model's context of 1024 tokens" in _one_error_line(capsys)
    assert main(["eval", str(root)]) == 1
    assert "--text FILE is needed" in _one_error_line(capsys)
    (tmp_path / "not.logits").write_bytes(b"hello world, no header here")
    assert main(["eval", str(root), "--reference", str(tmp_path / "not.logits")]) == 1
    assert "not a logits file" in _one_error_line(capsys)


def test_reference_of_another_vocabulary_or_text_is_refused(ckpt, tmp_path, capsys):
    root, text, ids = ckpt
    v = tiny_config()["vocab_size"]
    other_vocab = tmp_path / "v.logits"
    w = LogitsWriter(other_vocab, 8, v + 2, [BOS, *ids][:56])
    for _ in range(7):
        w.write(pack_rows(torch.zeros(3, v + 2)))
    w.close()
    assert main(["eval", str(root), "--reference", str(other_vocab)]) == 1
    assert f"vocabulary of {v + 2} tokens, the model {v}" in _one_error_line(capsys)
    fewer = tmp_path / "f.logits"
    w = LogitsWriter(fewer, 8, v, [BOS, *ids][:16])
    for _ in range(2):
        w.write(pack_rows(torch.zeros(3, v)))
    w.close()
    short = tmp_path / "short.txt"
    short.write_text(" ".join(f"w{i}" for i in ids[:10]))
    assert main(["eval", str(root), "--text", str(short), "--reference", str(fewer)]) == 1
    assert "holds 16 tokens (2 windows of 8); this text gives the model 11 of them" in _one_error_line(capsys)
    changed = tmp_path / "changed.txt"
    changed.write_text(" ".join(f"w{i}" for i in [ids[0] + 1 if ids[0] < v - 1 else ids[0] - 1, *ids[1:]]))
    assert main(["eval", str(root), "--text", str(changed), "--reference", str(fewer)]) == 1
    assert "token 1 is" in _one_error_line(capsys)
    assert main(["eval", str(root), "--reference", str(fewer), "--ctx", "16"]) == 1
    assert "computed with --ctx 8, not 16" in _one_error_line(capsys)


def test_reads_a_file_llama_perplexity_wrote(tmp_path):
    """tests/data/vendor/gguf_iq4_nl_dsv3.kld-base.logits: llama-perplexity's --kl-divergence-base
    on that GGUF over make_gguf_iq's calibration text, 4 windows of 16 (its "Final estimate: PPL =
    326.8021 +/- 24.00638"). Our tokenizer gives its tokens, our file has its header and size, and
    our forward of the same file scores within 0.5% of its PPL, at KLD ~1e-5 from it."""
    import sys

    from conftest import VENDOR

    sys.path.insert(0, str(VENDOR))
    from make_gguf_iq import CALIBRATION

    base = VENDOR / "gguf_iq4_nl_dsv3.kld-base.logits"
    root = VENDOR / "gguf_iq4_nl_dsv3"
    tokens, bos = text_tokens(root, CALIBRATION)
    rd = LogitsReader(base)
    assert (rd.n_ctx, rd.n_vocab, rd.n_chunk) == (16, 320, 4) and rd.tokens.tolist() == tokens[:64] and bos == 0
    rd.close()
    model = quantplug.load(root, progress=False)
    r = evaluate(model, tokens, bos=bos, reference=base, save_logits=tmp_path / "ours.logits", progress=False)
    assert r is not None and r.kld is not None
    assert r.kld.ppl_base == pytest.approx(326.8021, rel=1e-5)  # its PPL, from its own rows
    assert r.ppl == pytest.approx(326.8021, rel=5e-3) and r.kld.kld_mean < 1e-4 and r.kld.same_top == 1.0
    ours = (tmp_path / "ours.logits").read_bytes()
    theirs = base.read_bytes()
    assert len(ours) == len(theirs) and ours[:HEADER_BYTES + 4 * 64] == theirs[:HEADER_BYTES + 4 * 64]
