"""The trained tiny DeepSeek-V3 (``tests/data/trained/dsv3-tiny``, made by ``bench/train_tiny.py``;
provenance in its README): it loads with its MTP layer, its held-out perplexity (``quantplug.eval``)
is far below its vocabulary, greedy decoding writes Python-looking text, and speculative decoding
with its trained MTP layer emits plain greedy's tokens while accepting most drafts."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import quantplug
import torch
from quantplug.eval import evaluate, text_tokens
from quantplug.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "data" / "trained" / "dsv3-tiny"
#: model.safetensors as bench/train_tiny.py wrote it (README.md), on an AVX2 machine
SHA256 = "fa6b4f59ff51811822a5ec2d3672266668386d6589ab1799293529f96088d97a"
#: what bench/train_tiny.py writes, by torch's CPU capability (torch.backends.cpu.get_cpu_capability()):
#: torch's CPU matmuls take other instruction paths there, so the float sums, and from the first step
#: on the whole trajectory, differ. AVX512 (AMD EPYC, torch 2.13.0): held-out PPL 121.5 against the
#: committed model's 127.9, the same tokenizer.json
REMADE_SHA256 = {"AVX2": SHA256, "AVX512": "c321f597fb9fdb5b88077f784404bf07f36ba2da8f4285d78ad89772ab8a7a9b"}
#: held-out perplexity, windows of 128 (README.md): 127.9 over all 241 windows, 103.9 over the first 24
#: (what the test scores, in 1 s); the vocabulary is 2048
PPL_CHUNKS = 24
PPL_BOUND = 115.0
#: MTP acceptance from the held-out text's first 32 tokens, 64 new tokens: 21 of 41 drafts (0.512)
ACCEPT_BOUND = 0.4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return quantplug.load(MODEL, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def heldout():
    return text_tokens(MODEL, (MODEL / "heldout.txt").read_text())


def test_committed_checkpoint(model):
    assert hashlib.sha256((MODEL / "model.safetensors").read_bytes()).hexdigest() == SHA256
    lm = model.text_lm()
    cfg = lm.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_nextn_predict_layers) == ("DeepseekV3ForCausalLM", 4, 1)
    assert len(lm.mtp) == 1
    tok = load_tokenizer(MODEL)
    assert tok is not None and tok.added_bos() == 0 and tok.chat_template
    chat = tok.render_chat([{"role": "user", "content": "def f():"}])
    assert chat == "<|bos|><|user|>def f():<|assistant|>"


def test_heldout_perplexity(model, heldout):
    tokens, bos = heldout
    r = evaluate(model, tokens, n_ctx=128, bos=bos, batch=8, max_chunks=PPL_CHUNKS, progress=False)
    vocab = model.text_lm().config.vocab_size
    assert r.ppl < PPL_BOUND < vocab / 10, (r.ppl, vocab)


def test_greedy_writes_python(model):
    tok = load_tokenizer(MODEL)
    prompt = "    def __init__(self, "
    ids = torch.tensor([tok.encode(prompt)])
    out = model.generate(ids, 48, eos_token_id=None)
    text = tok.decode(out[0, ids.shape[1]:].tolist())
    assert "self" in text and "\ufffd" not in text, text
    assert text.isascii() and sum(c.isalnum() or c in " _.,():=\n'\"[]" for c in text) / len(text) > 0.9, text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_mtp_equals_greedy(model, heldout, dtype, monkeypatch):
    """Every speculative step is one native call (verify and draft, ``qp_spec_step``) whose rows
    are one-token steps' arithmetic: the tokens are plain greedy's in bfloat16 too."""
    from quantplug.kernels import native

    m = model if dtype == "float32" else quantplug.load(MODEL, dtype=torch.bfloat16, progress=False)
    tokens, _ = heldout
    prompt = torch.tensor([tokens[:32]])
    plain = m.generate(prompt, 64, eos_token_id=None)[0, 32:].tolist()
    lib, calls = native.library(), [0]
    real = lib.qp_spec_step

    def counted(*a):
        calls[0] += 1
        return real(*a)

    monkeypatch.setattr(lib, "qp_spec_step", counted)
    g = m.stream(prompt, 64, eos_token_id=None, speculative="mtp")
    spec = [int(t[0]) for t in g]
    rate = g.acceptance_rate()
    print(f"{dtype}: MTP acceptance {g.accepted}/{g.drafts} = {rate:.3f}")
    assert spec == plain
    assert rate is not None and rate > ACCEPT_BOUND
    assert calls[0] == g.drafts > 0


@pytest.mark.slow
def test_training_script_remakes_the_checkpoint(tmp_path):
    """bench/train_tiny.py remakes model.safetensors bit for bit on an AVX2 machine (same corpus:
    CPython 3.11.2 / 3.11.7's files; torch 2.13.0), and on an AVX512 one the recorded AVX512 bytes
    (REMADE_SHA256). About 15 CPU-minutes at 2 threads on the AVX512 machine (31 min wall measured
    on a loaded one, 47% of a CPU), about 30 on the AVX2 one (43 min wall, loaded)."""
    import torch

    expected = REMADE_SHA256.get(torch.backends.cpu.get_cpu_capability())
    if expected is None:
        pytest.skip(f"no recorded weights for torch's CPU capability {torch.backends.cpu.get_cpu_capability()}")
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import train_tiny
    finally:
        sys.path.pop(0)
    root = Path(sysconfig.get_paths()["stdlib"])
    h = hashlib.sha256()
    for name in train_tiny.FILES:
        f = root / f"{name}.py"
        if not f.is_file():
            pytest.skip(f"{f}: not in this Python")
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    if h.hexdigest() != train_tiny.CORPUS_SHA256:
        pytest.skip(f"this Python's standard library ({sys.version.split()[0]}) is another corpus")
    subprocess.run([sys.executable, str(ROOT / "bench" / "train_tiny.py"), "--out", str(tmp_path)], check=True,
                   timeout=3600)
    assert hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest() == expected
    assert (tmp_path / "tokenizer.json").read_bytes() == (MODEL / "tokenizer.json").read_bytes()
