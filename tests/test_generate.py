"""Generation with the MLA latent cache: greedy = transformers' greedy generate on dense models,
cached decode = full recompute (argmax every step, logits within 1e-4) for every bundled
backend, sampling processors = transformers' warpers, EOS / min_new_tokens semantics, the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import quantplug
import torch
from conftest import VENDOR, rel_err
from quantplug.cli import main
from quantplug.generate import GenerationError, new_cache, process_logits
from quantplug.models.config import parse_model_config
from quantplug.testing import (
    hub_rope_spelling,
    random_state,
    tiny_config,
    to_layout,
    wrap_kimi,
    write_checkpoint,
)

IDS = torch.randint(0, 160, (2, 7), generator=torch.Generator().manual_seed(3))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_model(cfg: dict, state: dict):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hc = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    hc._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hc).eval()
    sd = dict(to_layout(state, "fused"))
    if cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    return model


def check_cached_equals_recompute(model, ids: torch.Tensor, steps: int = 6, chunks: tuple[int, ...] = (3,),
                                  tol: float = 1e-4) -> None:
    """Prefill ``ids`` in chunks (the first ``chunks`` tokens, then the rest: exercises attention
    of several new tokens on a non-empty cache), then decode greedily; at every step the cached
    logits equal a full forward over the whole sequence."""
    lm = model.text_lm()
    cache = new_cache(lm, ids.shape[0], 1)  # capacity 1: forces the chunked growth path too
    with torch.no_grad():
        start = 0
        for end in (*chunks, ids.shape[1]):
            logits = lm(ids[:, start:end], cache=cache)
            ref = model(ids[:, :end])[:, start:end]
            assert rel_err(logits, ref) <= tol, (start, end, rel_err(logits, ref))
            start = end
        seq = ids
        step_logits = logits[:, -1]
        for _ in range(steps):
            ref = model(seq)[:, -1]
            assert rel_err(step_logits, ref) <= tol, rel_err(step_logits, ref)
            assert torch.equal(step_logits.argmax(-1), ref.argmax(-1))
            nxt = ref.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            step_logits = lm(nxt, cache=cache)[:, -1]
    assert cache.length == seq.shape[1]


DENSE_CASES = {
    "hub_yarn": dict(),
    "default_rope_tied_no_q_lora": dict(q_lora_rank=None, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_greedy_equals_transformers_and_cache_equals_recompute(tmp_path, case):
    cfg = tiny_config(**DENSE_CASES[case])
    state = random_state(cfg, seed=5)
    path = write_checkpoint(tmp_path / case, hub_rope_spelling(cfg) if case == "hub_yarn" else cfg, state)
    model = quantplug.load(path, progress=False)
    out = model.generate(IDS, 12, eos_token_id=None)
    ref = hf_model(cfg, state).generate(IDS, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, ref)
    check_cached_equals_recompute(model, IDS)


def test_kimi_wrapper_greedy_equals_transformers(tmp_path):
    cfg = tiny_config()
    state = random_state(cfg, seed=6)
    wrapped, tensors = wrap_kimi(hub_rope_spelling(cfg), state)
    model = quantplug.load(write_checkpoint(tmp_path / "kimi", wrapped, tensors), progress=False)
    out = model.generate(IDS, 10, eos_token_id=None)
    ref = hf_model(cfg, state).generate(IDS, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, ref)
    check_cached_equals_recompute(model, IDS, steps=3)


def test_kimi_k3_output_gate_cache_equals_recompute(tmp_path):
    cfg = tiny_config(mla_use_output_gate=True)
    wrapped, tensors = wrap_kimi(cfg, random_state(cfg, seed=7), "KimiK25ForConditionalGeneration")
    model = quantplug.load(write_checkpoint(tmp_path / "k3", wrapped, tensors), progress=False)
    check_cached_equals_recompute(model, IDS)
    out = model.generate(IDS, 6, eos_token_id=None)
    with torch.no_grad():  # greedy = argmax of a full forward at each generated position
        assert torch.equal(model(out)[:, IDS.shape[1] - 1:-1].argmax(-1), out[:, IDS.shape[1]:])


@pytest.mark.parametrize("fixture", ["quark_mxfp4_dsv3", "modelslim_w8a8_dsv3", "ct_fp8_block_dsv3",
                                     "ct_w4a16_experts_dsv3"])
def test_vendor_fixtures_cache_equals_recompute(fixture):
    model = quantplug.load(VENDOR / fixture, progress=False)
    ids = torch.randint(0, model.text_lm().config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    check_cached_equals_recompute(model, ids, steps=4)


def test_modelslim_kv_b_quantizes_activations_so_decode_expands_from_the_latent():
    model = quantplug.load(VENDOR / "modelslim_w8a8_dsv3", progress=False)
    attn = model.model.layers[0].self_attn
    assert attn.layout.kind == "dense" and not attn.kv_b_proj.scheme.weight_only
    check_cached_equals_recompute(model, IDS[:, :5] % model.config.vocab_size, steps=2)
    assert attn._kv_b_heads is None  # never absorbed: W8A8 activations make the absorbed form inexact


def test_dense_absorbed_kv_b_is_views_of_the_weight(tmp_path):
    cfg = tiny_config()
    model = quantplug.load(write_checkpoint(tmp_path / "d", cfg, random_state(cfg)), progress=False)
    model.generate(IDS, 2, eos_token_id=None)
    attn = model.model.layers[1].self_attn
    w_uk, w_uv_t = attn._kv_b_heads
    assert w_uk.untyped_storage().data_ptr() == attn.kv_b_proj.weight.untyped_storage().data_ptr()
    assert tuple(w_uk.shape) == (4, 32, 32) and tuple(w_uv_t.shape) == (4, 32, 32)


def _gguf(tmp_path: Path, *, split_kv: bool, pack: bool = False) -> Path:
    from quantplug_expert_pack.build import build_pack
    from quantplug_expert_pack.export import gguf_state, write_gguf

    cfg = tiny_config(q_lora_rank=64)
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    root = tmp_path / f"gguf-{split_kv}-{pack}"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg))
    types = {"attn_k_b": "Q4_0", "attn_v_b": "Q8_0", "attn_kv_b": "Q8_0", "ffn_up_exps": "Q4_1"}
    write_gguf(root / "model.gguf", gguf_state(random_state(cfg, seed=2), mc, split_kv=split_kv), mc,
               default_type="Q8_0", types=types, vocab=cfg["vocab_size"])
    if pack:
        build_pack(root, progress=False)
    return root


@pytest.mark.parametrize("split_kv", [True, False], ids=["split_kv", "legacy_kv_b"])
def test_gguf_cache_equals_recompute(tmp_path, split_kv):
    model = quantplug.load(_gguf(tmp_path, split_kv=split_kv), progress=False)
    assert model.model.layers[0].self_attn.layout.kind == ("split_kv" if split_kv else "dense")
    check_cached_equals_recompute(model, IDS, steps=4)


def test_expert_pack_cache_equals_recompute_and_cli_reports_ssd_reads(tmp_path, capsys):
    root = _gguf(tmp_path, split_kv=True, pack=True)
    model = quantplug.load(root, progress=False, options={"expert_cache_mb": 1})
    check_cached_equals_recompute(model, IDS, steps=4)
    capsys.readouterr()
    assert main(["generate", str(root), "--tokens", "1,2,3,4", "--max-new-tokens", "5", "--json",
                 "-o", "expert_cache_mb=1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["tokens"]) == 5 and d["kv_cache_bytes_per_token"] == (32 + 16) * 3 * 4
    assert d["text"] == "".join(f"<tok{t}>" for t in d["tokens"])  # the GGUF's own vocabulary, read lazily
    from quantplug import experts
    from quantplug_expert_pack.pack import PACK_NAME, ROLES, ExpertPack

    pack = ExpertPack(root / PACK_NAME)
    span = sum(pack.entry(1, 0, r).size for r in ROLES)  # one expert's payloads, as the core cache reads them
    # 1 MB holds all 16 experts: decode reads only experts the prompt did not route to, once each;
    # 4 decode steps x 2 experts x 2 MoE layers = 16 expert uses
    rate = d["expert_cache_hit_rate"]
    assert 0.5 <= rate <= 1 and d["ssd_bytes_per_token"] == pytest.approx((1 - rate) * 16 * span / 4)
    # a budget of exactly one step of one layer (prefetch off): each layer's step evicts the other
    # layer's experts, so every routed expert of every decode step is read from the pack
    step = experts.step_bytes(quantplug.plan(root))
    assert main(["generate", str(root), "--tokens", "1,2,3,4", "--max-new-tokens", "5", "--json",
                 "-o", f"expert_cache_mb={step / 2**20}", "-o", "expert_prefetch=false"]) == 0
    d = json.loads(capsys.readouterr().out)
    reads = d["pack_reads_per_expert_use"]
    assert d["expert_cache_hit_rate"] == 0.0 and reads >= 1 and d["ssd_bytes_per_token"] == reads * 4 * span
    # the counters arrive through the declared protocol (quantplug.api.expose_stats), per source
    assert d["stats"]["expert_cache"]["expert_reads"] == reads * 16 and d["stats"]["expert_cache"]["hits"] >= 0


def test_cli_reports_the_hit_rate_of_experts_served_by_the_core_cache(tmp_path, capsys):
    """Served experts (``expert_cache_mb``) are routed on Python numbers in a decode step, past the
    routers' forward hooks: the hit rate comes from the core cache's own requests (one per
    distinct expert of a layer and step), for every format (here DeepSeek FP8)."""
    from quantplug.testing import formats, random_state, tiny_config

    cfg = tiny_config()
    path = formats.fp8(tmp_path / "fp8", cfg, random_state(cfg))
    assert main(["generate", str(path), "--tokens", "1,2,3,4", "--max-new-tokens", "5", "--json",
                 "-o", "expert_cache_mb=1", "-o", "expert_prefetch=false"]) == 0
    d = json.loads(capsys.readouterr().out)
    grown = d["stats"]["expert_cache"]
    assert grown["requests"] == 4 * 2 * 2  # 4 decode steps x 2 MoE layers x top-2 (distinct per layer and step)
    assert d["expert_cache_hit_rate"] == round(1 - grown["expert_reads"] / grown["requests"], 4)
    assert d["pack_reads_per_expert_use"] == round(grown["expert_reads"] / grown["requests"], 4)


class _Counter:
    """A run-time statistics source (quantplug.api.StatsSource): counts the forwards it saw."""

    def __init__(self) -> None:
        self.forwards = 0

    def stats(self):
        return {"forwards": self.forwards, "bytes_read": 10 * self.forwards}


def test_generate_reports_any_backends_statistics_and_reads_no_model_attribute(tmp_path, capsys, monkeypatch):
    """Backend statistics reach ``quantplug generate`` through ``expose_stats`` (contract 1.5), for a
    third-party backend too; a backend's attribute on the model (the expert pack once set
    ``model.expert_cache``, which the CLI read) is not consulted."""
    from quantplug import hookimpl
    from quantplug.api import Claim, expose_stats, stats_sources
    from quantplug.plugins import PluginManager

    counter = _Counter()

    class Counting:
        QUANTPLUG_CONTRACT = "1.5"

        @hookimpl
        def quantplug_detect(self, checkpoint):
            return Claim("counting", None, "claims everything")

        @hookimpl
        def quantplug_process_after_loading(self, model):
            from quantplug.api import Embedding

            for m in model.modules():
                if isinstance(m, Embedding):  # one lookup per forward
                    m.register_forward_pre_hook(lambda *_: setattr(counter, "forwards", counter.forwards + 1))
            expose_stats(model, "counting", counter)
            model.expert_cache = "not a statistics source"  # an attribute: never read

    pm = PluginManager(entry_points=False, env={})
    pm.register(Counting(), "counting")
    monkeypatch.setattr("quantplug.plugins._default", pm)  # the process-wide manager the CLI uses
    cfg = tiny_config()
    root = write_checkpoint(tmp_path / "c", cfg, random_state(cfg))
    assert main(["generate", str(root), "--tokens", "1,2,3", "--max-new-tokens", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stats"] == {"counting": {"forwards": 3, "bytes_read": 30}}  # 3 decode steps after the first token
    assert "expert_cache_hit_rate" not in d  # no source counts expert_reads
    with pytest.raises(quantplug.errors.QuantplugError, match=r"expose_stats\('x'\): str has no stats\(\) method"):
        expose_stats(torch.nn.Module(), "x", "text")  # type: ignore[arg-type]
    m = torch.nn.Module()
    expose_stats(m, "a", counter)
    with pytest.raises(quantplug.errors.QuantplugError, match="already exposed by another source"):
        expose_stats(m, "a", _Counter())
    assert stats_sources(m) == {"a": counter} and stats_sources(torch.nn.Module()) == {}


def test_eos_stops_rows_and_pads_like_transformers(tmp_path):
    cfg = tiny_config()
    state = random_state(cfg, seed=5)
    model = quantplug.load(write_checkpoint(tmp_path / "d", cfg, state), progress=False)
    free = model.generate(IDS, 12, eos_token_id=None)
    eos = int(free[0, IDS.shape[1] + 2])  # row 0's third new token
    assert eos not in free[1, IDS.shape[1]:IDS.shape[1] + 4].tolist()
    out = model.generate(IDS, 12, eos_token_id=eos)
    ref = hf_model(cfg, state).generate(IDS, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(out, ref)
    assert (out[0, IDS.shape[1] + 2:] == eos).all()
    # min_new_tokens masks EOS until that many tokens exist
    later = model.generate(IDS[:1], 4, eos_token_id=eos, min_new_tokens=4)
    assert eos not in later[0, IDS.shape[1]:].tolist()
    one = model.generate(IDS[:1], 12, eos_token_id=eos)
    assert one.shape[1] == IDS.shape[1] + 3  # a single row stops at its EOS


def test_eos_default_comes_from_generation_config(tmp_path):
    cfg = tiny_config(eos_token_id=1)
    path = write_checkpoint(tmp_path / "d", cfg, random_state(cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    from quantplug.generate import checkpoint_eos

    assert checkpoint_eos(quantplug.load(path, progress=False)) == (7, 9)
    (path / "generation_config.json").unlink()
    assert checkpoint_eos(quantplug.load(path, progress=False)) == (1,)


def test_sampling_processors_equal_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    ours = process_logits(logits, step=5, eos=(), min_new_tokens=0, do_sample=True, temperature=0.7, top_k=20,
                          top_p=0.8)
    ref = logits
    for w in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        ref = w(None, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.allclose(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_sampling_is_reproducible_with_a_generator(tmp_path):
    cfg = tiny_config()
    model = quantplug.load(write_checkpoint(tmp_path / "d", cfg, random_state(cfg)), progress=False)
    kw = dict(do_sample=True, temperature=1.5, top_p=0.9, eos_token_id=None)
    a = model.generate(IDS, 8, generator=torch.Generator().manual_seed(1), **kw)
    b = model.generate(IDS, 8, generator=torch.Generator().manual_seed(1), **kw)
    greedy = model.generate(IDS, 8, eos_token_id=None)
    assert torch.equal(a, b) and not torch.equal(a, greedy)


def test_bad_arguments_and_context_limit(tmp_path):
    cfg = tiny_config(max_position_embeddings=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    model = quantplug.load(write_checkpoint(tmp_path / "d", cfg, random_state(cfg)), progress=False)
    with pytest.raises(GenerationError, match="exceeds the model's context of 16"):
        model.generate(IDS, 10)
    with pytest.raises(GenerationError, match="temperature"):
        model.generate(IDS, 2, do_sample=True, temperature=0)
    with pytest.raises(GenerationError, match=r"input_ids must be in \[0, 160\)"):
        model.generate(IDS + 200, 2)
    lm = model.text_lm()
    cache = new_cache(lm, 2, 4)
    with torch.no_grad(), pytest.raises(GenerationError, match="sequence of 17 tokens exceeds"):
        lm(torch.zeros(2, 17, dtype=torch.long), cache=cache)


def test_cli_generate_tokens_json_and_stream(tmp_path, capsys):
    cfg = tiny_config()
    path = write_checkpoint(tmp_path / "d", cfg, random_state(cfg))
    model = quantplug.load(path, progress=False)
    expect = model.generate(torch.tensor([[5, 6, 7]]), 4, eos_token_id=None)[0, 3:].tolist()
    assert main(["generate", str(path), "--tokens", "5,6,7", "--max-new-tokens", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tokens"] == expect and "text" not in d
    assert d["kv_cache_bytes_per_token"] == (32 + 16) * 3 * 4
    assert d["tokens_per_second"] > 0 and d["prefill_seconds"] > 0
    assert main(["generate", str(path), "--tokens", "5,6,7", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in expect]
    assert main(["generate", str(path), "--prompt", "hi"]) == 1
    assert "no tokenizer" in capsys.readouterr().err


def test_cli_generate_prints_text_with_a_tokenizer(tmp_path, capsys):
    from test_tokenizer import write_wordlevel_tokenizer

    cfg = tiny_config()
    path = write_checkpoint(tmp_path / "d", cfg, random_state(cfg))
    write_wordlevel_tokenizer(path, cfg["vocab_size"])
    assert main(["generate", str(path), "--prompt", "w1 w2 w3", "--max-new-tokens", "5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["tokens"]) == 5 and d["text"] == " ".join(f"w{t}" for t in d["tokens"])
    assert main(["generate", str(path), "--prompt", "w1 w2 w3", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip() == d["text"]
    # --chat: the prompt goes through tokenizer_config.json's template first
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}w7 {{ m['content'] }} w8{% endfor %}{% if add_generation_prompt %}"
                          " w9{% endif %}"}))
    assert main(["generate", str(path), "--prompt", "w1", "--chat", "--max-new-tokens", "3", "--json"]) == 0
    chat = json.loads(capsys.readouterr().out)
    model = quantplug.load(path, progress=False)
    assert chat["tokens"] == model.generate(torch.tensor([[7, 1, 8, 9]]), 3, eos_token_id=None)[0, 4:].tolist()
    shutil.rmtree(path)


def test_torchrun_generate_equals_single_process(tmp_path):
    """Two tensor-parallel ranks (gloo): MLA heads split, the latent cache on every rank; rank 0
    prints the same greedy tokens as one process."""
    import os
    import subprocess
    import sys

    cfg = tiny_config()
    path = write_checkpoint(tmp_path / "d", cfg, random_state(cfg))
    expect = quantplug.load(path, progress=False).generate(torch.tensor([[3, 14, 15, 92]]), 6, eos_token_id=None)
    multi = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "quantplug", "generate", str(path), "--tokens", "3,14,15,92", "--max-new-tokens",
                            "6", "--json"], capture_output=True, text=True, timeout=240,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert multi.returncode == 0, multi.stderr[-2000:]
    lines = [ln for ln in multi.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    assert json.loads(lines[0])["tokens"] == expect[0, 4:].tolist()


#: fp8 emulates DeepSeek's per-token fp8 activation quantization by default: a decode token's
#: activations, computed alone, differ from the batched recompute's by ~1e-7, which can move one
#: value across an fp8 rounding boundary (observed once: 1.05e-4 at one step, argmax equal);
#: weight-only (activation_quant=none) the same check holds at 1e-4 (observed 5e-7)
LOAD_CASES = {"fp8": [({}, 1e-3), ({"activation_quant": "none"}, 1e-4)]}


def test_every_exporting_backend_cache_equals_recompute(tmp_path):
    """Each installed backend that can export (the demo's path: quark, modelslim, expert_pack, fp8,
    ...) writes a tiny model in its format; cached decode equals full recompute on each."""
    from quantplug.plugins import get_plugin_manager

    cfg = tiny_config(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                      n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    dense = quantplug.load(write_checkpoint(tmp_path / "dense", hub_rope_spelling(cfg), random_state(cfg)),
                           progress=False)
    pm = get_plugin_manager()
    done = []
    for rec in pm.records():
        if not pm.implements(rec.name, "quantplug_export"):
            continue
        for res in pm.export(rec.name, model=dense, destination=tmp_path / rec.name, plan=dense.quantplug_plan):
            for options, tol in LOAD_CASES.get(rec.name, [({}, 1e-4)]):
                model = quantplug.load(res.path, backend=rec.name, progress=False, options=options)
                check_cached_equals_recompute(model, IDS, steps=3, tol=tol)
            done.append(rec.name)
    assert {"quark", "modelslim", "expert_pack"} <= set(done)


def test_cli_generate_with_an_unusable_gguf_vocabulary(tmp_path, capsys):
    """--tokens: the vocabulary only prints text, so a broken one is reported and ids are printed;
    --prompt needs it: a one-line error naming the file and the merge, no traceback."""
    from quantplug_expert_pack.export import gguf_state, write_gguf
    from quantplug_expert_pack.testing import rewrite_gguf

    cfg = tiny_config()
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    (tmp_path / "src").mkdir()
    write_gguf(tmp_path / "src" / "model.gguf", gguf_state(random_state(cfg), mc), mc, default_type="Q8_0", vocab=cfg["vocab_size"])
    root = tmp_path / "bad"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg))
    # "<tok1><tok2>" is no token
    rewrite_gguf(tmp_path / "src" / "model.gguf", root / "model.gguf", lambda w: w.add_token_merges(["<tok1> <tok2>"]))
    assert main(["generate", str(root), "--tokens", "5,6,7", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr()
    assert len(out.out.split()) == 3 and "tokenizer not usable" in out.err and "merges[0]" in out.err
    assert main(["generate", str(root), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "model.gguf: tokenizer.ggml.merges[0]" in err and "Traceback" not in err


def test_cli_turns_an_unexpected_exception_into_one_line(tmp_path, capsys, monkeypatch):
    import quantplug.generate as gen

    cfg = tiny_config()
    path = write_checkpoint(tmp_path / "d", cfg, random_state(cfg))

    class Panic(BaseException):  # what a Rust library's panic looks like from Python
        pass

    def boom(*a, **k):
        raise Panic("range end index 12 out of range")

    monkeypatch.setattr(gen, "max_seq_len", boom)
    assert main(["generate", str(path), "--tokens", "5,6", "--max-new-tokens", "2"]) == 3
    err = capsys.readouterr().err
    assert "unexpected Panic: range end index 12" in err and "--debug" in err and "Traceback" not in err
    with pytest.raises(Panic):
        main(["--debug", "generate", str(path), "--tokens", "5,6", "--max-new-tokens", "2"])
