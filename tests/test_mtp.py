"""Multi-token prediction (ARCHITECTURES D): the MTP layer loads in every bundled format, its draft
logits equal an independent implementation of D3 (transformers' DeepseekV3 for the main model and
the decoder block, enorm / hnorm / eh_proj / head by hand from the raw state dict), and greedy
speculative decoding (``speculative="mtp"``) emits exactly the tokens of plain greedy decoding,
accepted drafts and rejected ones (rolled back) alike."""

from __future__ import annotations

import json

import pytest
import quantplug
import torch
from quantplug.cli import main
from quantplug.errors import PlanError
from quantplug.generate import Generation, GenerationError, LatentCache, new_mtp_cache
from quantplug.plan import build_plan
from quantplug.testing import random_state, tiny_config, to_layout, wrap_kimi, write_checkpoint
from quantplug.testing.formats import FORMATS

CFG = tiny_config(num_nextn_predict_layers=1, q_lora_rank=64)  # every linear input a multiple of 32 (quark, CT)
N = CFG["num_hidden_layers"]  # the MTP layer is model.layers.3 (MoE: 3 >= first_k_dense_replace)
STATE = random_state(CFG, seed=11, mtp=True)
PROMPT = torch.randint(0, CFG["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(4))
NEW = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("mtp") / "dense", CFG, STATE)


@pytest.fixture(scope="module")
def model(dense):
    return quantplug.load(dense, progress=False)


def _plain_and_speculative(m, prompt=PROMPT, new=NEW, **kw):
    plain = m.generate(prompt, new, eos_token_id=None, **kw)
    g = m.stream(prompt, new, eos_token_id=None, speculative="mtp", **kw)
    toks = [int(t[0]) for t in g]
    return plain[0, prompt.shape[1]:].tolist(), toks, g


# -- (a) the draft against an independent D3 ------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _hf_main_hidden(ids: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV3 on the main layers: the final hidden state after model.norm."""
    from transformers import DeepseekV3Config, DeepseekV3Model

    hc = DeepseekV3Config(**{k: v for k, v in CFG.items() if k not in ("architectures", "num_nextn_predict_layers")})
    hc._attn_implementation = "eager"
    hf = DeepseekV3Model(hc).eval()
    sd = {k.removeprefix("model."): v for k, v in to_layout(STATE, "fused").items()
          if k.startswith("model.") and not k.startswith(f"model.layers.{N}.")}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        return hf(ids).last_hidden_state


def _hf_mtp_block(u: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The MTP layer's decoder block and shared_head.norm as transformers' DeepseekV3 runs them: a
    one-layer model (first_k_dense_replace 0: MoE like layer 3) fed ``inputs_embeds`` = u, whose
    final norm is shared_head.norm."""
    from transformers import DeepseekV3Config, DeepseekV3Model

    hc = DeepseekV3Config(**{k: v for k, v in CFG.items() if k not in ("architectures", "num_nextn_predict_layers")})
    hc.num_hidden_layers, hc.first_k_dense_replace = 1, 0
    hc._attn_implementation = "eager"
    hf = DeepseekV3Model(hc).eval()
    pre = f"model.layers.{N}."
    sd = {"layers.0." + k[len(pre):]: v for k, v in to_layout(STATE, "fused").items()
          if k.startswith(pre) and not k[len(pre):].startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed"))}
    sd["norm.weight"] = STATE[f"{pre}shared_head.norm.weight"]
    sd["embed_tokens.weight"] = STATE["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        return hf(inputs_embeds=u, position_ids=positions).last_hidden_state


def test_draft_logits_match_an_independent_d3(model):
    """Rows j of the MTP prompt pass (pairs h_j, t_{j+1}; position j + 1) against D3 written out:
    e = embed(t_{j+1}); u = eh_proj(cat(enorm(e), hnorm(h_j))); block; shared_head.norm; lm_head.
    Prefilled in one call, then the last rows one by one on the MTP layer's own cache."""
    ids = PROMPT
    nxt = torch.cat([ids[:, 1:], torch.tensor([[17]])], dim=1)        # t_{j+1}, the last one "sampled"
    h = _hf_main_hidden(ids)
    eps, pre = CFG["rms_norm_eps"], f"model.layers.{N}."
    e = STATE["model.embed_tokens.weight"][nxt]
    u = torch.cat([_rms(e, STATE[pre + "enorm.weight"], eps), _rms(h, STATE[pre + "hnorm.weight"], eps)], -1)
    u = u @ STATE[pre + "eh_proj.weight"].T
    t = ids.shape[1]
    ref = _hf_mtp_block(u, torch.arange(1, t + 1).unsqueeze(0)) @ STATE["lm_head.weight"].T

    lm = model.text_lm()
    with torch.inference_mode():
        hidden = lm.model(ids)
        assert (hidden - h).abs().max() < 1e-5                       # the main model's h_n itself
        whole = lm.mtp_logits(nxt, hidden, new_mtp_cache(lm, 1, t))
        cache = new_mtp_cache(lm, 1, 1)                               # grows; chunk then steps
        parts = [lm.mtp_logits(nxt[:, :5], hidden[:, :5], cache)]
        parts += [lm.mtp_logits(nxt[:, j:j + 1], hidden[:, j:j + 1], cache) for j in range(5, t)]
    assert cache.length == t
    assert (whole - ref).abs().max() < 1e-5
    assert (torch.cat(parts, dim=1) - ref).abs().max() < 1e-5
    assert ref.abs().max() > 1e-2                                     # not a comparison of zeros


# -- (b) speculative == plain greedy, every format ---------------------------------------------

@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_formats")
    return {name: write(root / name, CFG, STATE) for name, write in FORMATS.items()}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_speculative_equals_greedy_in_every_format(formats, fmt, monkeypatch):
    """Random MTP weights accept (almost) no draft: the run is repeated with every draft forced
    right, so each format's verify forward also serves accepted drafts and bonus tokens."""
    if fmt == "expert_pack":
        pytest.importorskip("gguf")
    m = quantplug.load(formats[fmt], progress=False)
    plan = m.quantplug_plan
    assert plan.backend == fmt and len(m.text_lm().mtp) == 1
    # the MTP layer's block linears are planned like the main layers' (the format's scheme)
    schemes = plan.schemes()
    assert schemes[f"model.layers.{N}.self_attn.o_proj"] == schemes["model.layers.2.self_attn.o_proj"]
    assert f"model.layers.{N}.eh_proj" in schemes
    plain, spec, g = _plain_and_speculative(m)
    assert spec == plain and len(spec) == NEW
    assert g.drafts > 0 and 0 <= g.accepted <= g.drafts
    monkeypatch.setattr(Generation, "_pick_draft", lambda self, logits: torch.tensor([plain[_guessed(self)]]))
    _, spec, g = _plain_and_speculative(m)
    assert spec == plain and g.accepted == g.drafts == (NEW - 1) // 2


def test_kimi_wrapper_prefix(tmp_path):
    """language_model.* weights (the Kimi wrappers): the MTP layer loads under the prefix."""
    wcfg, tensors = wrap_kimi(CFG, STATE)
    m = quantplug.load(write_checkpoint(tmp_path / "kimi", wcfg, tensors), progress=False)
    assert len(m.text_lm().mtp) == 1
    skipped = [n for k, v in m.quantplug_plan.skipped.items() if k.startswith("mtp-shared-copies") for n in v]
    assert sorted(skipped) == [f"language_model.model.layers.{N}.embed_tokens.weight",
                               f"language_model.model.layers.{N}.shared_head.head.weight"]
    plain, spec, _ = _plain_and_speculative(m, new=16)
    assert spec == plain


def test_experts_from_ssd_serve_the_mtp_layer_too(dense):
    m = quantplug.load(dense, progress=False, options={"expert_cache_mb": 0.05})
    assert m.text_lm().mtp[0].block.mlp.experts.qp_store is not None
    plain, spec, g = _plain_and_speculative(m, new=24)
    assert spec == plain and g.drafts > 0


def test_native_paths_and_dense_state(model):
    """Plain greedy keeps the whole-stack native step; the MTP block has its per-module native MLA
    step; dense_state exports the MTP layer (not the skipped copies) as stored."""
    from quantplug.api import dense_state

    lm = model.text_lm()
    assert lm.model._stack_step() is not None and lm.mtp[0].block.self_attn.step is not None
    d = dense_state(model)
    copies = {f"model.layers.{N}.embed_tokens.weight", f"model.layers.{N}.shared_head.head.weight"}
    assert set(STATE) - set(d) == copies and set(d) <= set(STATE)
    assert all(torch.equal(d[k], STATE[k]) for k in d if k.startswith(f"model.layers.{N}."))


def test_expert_pack_holds_the_mtp_layer(formats, tmp_path):
    """A GGUF with the MTP block (blk.3.nextn.*): its expert pack takes layer 3's experts too (no
    'not MoE layers' warning), and the pack serves them."""
    pytest.importorskip("gguf")
    import shutil

    from quantplug_expert_pack.build import build_pack

    root = shutil.copytree(formats["expert_pack"], tmp_path / "packed")
    build_pack(root, progress=False)
    m = quantplug.load(root, progress=False, options={"expert_cache_mb": 0.1})
    assert not m.quantplug_plan.problems
    plain, spec, g = _plain_and_speculative(m, new=16)
    assert spec == plain and g.drafts > 0


# -- (c) roll-back ------------------------------------------------------------------------------

def _guessed(g: Generation) -> int:
    """Which new token the draft being picked guesses: the MTP cache holds the pairs (h_j, x_{j+1})
    for j < its length M, so the draft is x_{M+1}, new token M + 1 - prompt length."""
    assert g.mtp_cache is not None
    return g.mtp_cache.length + 1 - PROMPT.shape[1]


@pytest.fixture(params=["native", "modules"])
def spec_path(request, model, monkeypatch):
    """Which way a speculative step runs: one native call (``speculative_step``: verify and draft
    together), or the modules (the 2-token forward, then the MTP layer), as when a piece of the
    model has no native form."""
    from quantplug.models.deepseek import DeepseekV3ForCausalLM

    if request.param == "modules":
        monkeypatch.setattr(DeepseekV3ForCausalLM, "speculative_step", lambda self, *a: None)
    calls = [0]
    real = DeepseekV3ForCausalLM.speculative_step

    def counted(self, *a):
        got = real(self, *a)
        calls[0] += got is not None
        return got

    monkeypatch.setattr(DeepseekV3ForCausalLM, "speculative_step", counted)
    yield request.param, calls


def test_every_draft_rejected_rolls_back(model, monkeypatch, spec_path):
    """Drafts forced wrong: every step emits the main token and drops the draft's cache entry.
    Without the roll-back the next step would attend to the rejected token."""
    plain = model.generate(PROMPT, 32, eos_token_id=None)[0, PROMPT.shape[1]:].tolist()
    vocab = CFG["vocab_size"]
    monkeypatch.setattr(Generation, "_pick_draft", lambda self, logits: torch.tensor([(plain[_guessed(self)] + 1) % vocab]))
    _, spec, g = _plain_and_speculative(model, new=32)
    assert spec == plain
    assert g.accepted == 0 and g.drafts == 30   # 31 decode steps, the last one plain
    assert g.cache.length == PROMPT.shape[1] + 32 - 1
    assert g.acceptance_rate() == 0.0
    assert spec_path[1][0] == (30 if spec_path[0] == "native" else 0)


def test_every_draft_accepted_takes_bonus_tokens(model, monkeypatch, spec_path):
    """Drafts forced right (the greedy continuation itself): two tokens per main step."""
    plain = model.generate(PROMPT, 33, eos_token_id=None)[0, PROMPT.shape[1]:].tolist()
    monkeypatch.setattr(Generation, "_pick_draft", lambda self, logits: torch.tensor([plain[_guessed(self)]]))
    _, spec, g = _plain_and_speculative(model, new=33)
    assert spec == plain
    assert g.accepted == g.drafts == 16                     # 32 tokens in 16 steps, then none left
    assert g.cache.length == PROMPT.shape[1] + 33 - 1
    assert g.mtp_cache is not None
    if spec_path[0] == "native":
        # one call verifies and drafts: the MTP layer holds the pair of every cached main position
        assert spec_path[1][0] == 16 and g.mtp_cache.length == g.cache.length
    else:
        # one pair per cached main position; the last step's two are not run (no draft needed after it)
        assert g.mtp_cache.length == g.cache.length - 2


def test_native_speculative_step_equals_the_modules(model):
    """One native speculative step against the module path from the same state: the same picks,
    acceptance and main-model logits, the drafter's logits equal ``mtp_logits``'s last row, and
    both caches hold the same rows; once accepted (the draft set to the main model's pick), once
    rejected."""
    from quantplug.generate import new_cache

    lm = model.text_lm()
    with torch.inference_mode():
        ref_cache = new_cache(lm, 1, 32)
        hidden, logits = lm.hidden_and_logits(PROMPT, ref_cache, last_only=True)
        last = logits[:, -1].argmax(-1)
        ref_m = new_mtp_cache(lm, 1, 32)
        lm.mtp_logits(torch.cat([PROMPT[:, 1:], last[:, None]], 1), hidden, ref_m)
        base, mbase = ref_cache.length, ref_m.length
        pick = lm.hidden_and_logits(last[:, None], ref_cache)[1][0, 0].argmax().reshape(1)
        ref_cache.truncate(base)
        for draft, accepted in ((pick, True), ((pick + 1) % CFG["vocab_size"], False)):
            cache, mc = _copy_cache(ref_cache, base), _copy_cache(ref_m, mbase)
            got = lm.speculative_step(last, draft, cache, mc)
            assert got is not None
            (a, b), acc, dlogits, lg = got
            h2, l2 = lm.hidden_and_logits(torch.stack([last, draft], 1), ref_cache)
            assert acc is accepted and a == int(l2[0, 0].argmax()) and b == int(l2[0, 1].argmax())
            assert torch.equal(lg, l2[0])
            if accepted:
                pairs, hs = torch.tensor([[int(draft), b]]), h2
            else:
                ref_cache.truncate(base + 1)
                pairs, hs = torch.tensor([[a]]), h2[:, :1]
            ref_draft = lm.mtp_logits(pairs, hs, ref_m)[:, -1]
            assert (dlogits - ref_draft).abs().max() <= 1e-5 * ref_draft.abs().max()
            assert cache.length == base + 2 and mc.length == ref_m.length
            for c, r in ((cache, ref_cache), (mc, ref_m)):
                n = min(c.length, r.length)
                for x, y in zip(c.layers, r.layers):
                    assert (x.latent[:, :, :n] - y.latent[:, :, :n]).abs().max() <= 1e-5
            ref_cache.truncate(base)
            ref_m.truncate(mbase)


def _copy_cache(c, length):
    """A cache holding ``c``'s first ``length`` positions (its own tensors)."""
    import copy

    out = copy.copy(c)
    out.layers = []
    for layer in c.layers:
        n = copy.copy(layer)
        for name in type(layer).BUFFERS:
            t = getattr(layer, name, None)
            if t is not None:
                setattr(n, name, t.clone())
        out.layers.append(n)
    out.truncate(length)
    return out


def test_stops_like_greedy_at_eos_and_max_new_tokens(model):
    plain = model.generate(PROMPT, 20, eos_token_id=None)[0, PROMPT.shape[1]:].tolist()
    eos = plain[9]
    ref = model.generate(PROMPT, 20, eos_token_id=eos)
    got = model.generate(PROMPT, 20, eos_token_id=eos, speculative="mtp")
    assert got.tolist() == ref.tolist() and got.shape[1] == PROMPT.shape[1] + plain.index(eos) + 1
    ref = model.generate(PROMPT, 20, eos_token_id=eos, min_new_tokens=15)
    assert model.generate(PROMPT, 20, eos_token_id=eos, min_new_tokens=15, speculative="mtp").tolist() == ref.tolist()
    for n in (0, 1, 2, 3):
        assert model.generate(PROMPT, n, eos_token_id=None, speculative="mtp").tolist() == \
            model.generate(PROMPT, n, eos_token_id=None).tolist()


def test_truncate_only_moves_length():
    c = LatentCache(1, 4, 2, dtype=torch.float32, device=torch.device("cpu"), capacity=8, limit=8)
    c.append(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 2))
    latent = c.latent
    c.truncate(1)
    assert c.length == 1 and c.latent is latent
    lat, _ = c.append(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 2))
    assert lat.shape[2] == 2 and lat[0, 0, 1].abs().sum() == 0
    with pytest.raises(GenerationError, match="truncate"):
        c.truncate(3)


def test_refusals(model, tmp_path):
    with pytest.raises(GenerationError, match="greedily only"):
        model.generate(PROMPT, 4, do_sample=True, speculative="mtp")
    with pytest.raises(GenerationError, match="batch of 2"):
        model.generate(PROMPT.repeat(2, 1), 4, speculative="mtp")
    with pytest.raises(GenerationError, match="expected None or one of mtp"):
        model.generate(PROMPT, 4, speculative="eagle")
    plain = write_checkpoint(tmp_path / "nomtp", tiny_config(), random_state(tiny_config(), seed=1))
    with pytest.raises(GenerationError, match="num_nextn_predict_layers = 0"):
        quantplug.load(plain, progress=False).generate(PROMPT, 4, speculative="mtp")


# -- (d) the plan -----------------------------------------------------------------------------

def test_plan_lists_the_mtp_tensors(dense):
    p = build_plan(dense)
    assert not p.errors
    used = {info.name for pp in p.params for _, info in pp.sources}
    own = [n for n in STATE if n.startswith(f"model.layers.{N}.")]
    copies = {f"model.layers.{N}.embed_tokens.weight", f"model.layers.{N}.shared_head.head.weight"}
    assert set(own) - copies <= used and not copies & used
    (rule, names), = p.skipped.items()
    assert rule.startswith("mtp-shared-copies") and set(names) == copies
    d = [x for x in p.decisions if x.hook == "mtp_layers"]
    assert len(d) == 1 and d[0].value == 1
    assert p.to_dict()["options"]["mtp"] == {"value": True, "source": "default", "owner": "core"}


def test_missing_eh_proj_is_a_plan_error(tmp_path):
    state = {k: v for k, v in STATE.items() if k != f"model.layers.{N}.eh_proj.weight"}
    path = write_checkpoint(tmp_path / "no_eh", CFG, state)
    with pytest.raises(PlanError, match=rf"model\.layers\.{N}\.eh_proj\.weight"):
        quantplug.plan(path)


def test_mtp_false_restores_the_skip(dense):
    p = build_plan(dense, options={"mtp": False})
    assert not p.errors and not len(p.model.mtp)
    (rule, names), = p.skipped.items()
    assert rule.startswith("mtp-layers") and sorted(names) == sorted(n for n in STATE if n.startswith(f"model.layers.{N}."))
    m = quantplug.load(dense, progress=False, options={"mtp": False})
    with pytest.raises(GenerationError, match="mtp=false"):
        m.generate(PROMPT, 4, speculative="mtp")


def test_config_declares_mtp_but_checkpoint_stores_none(tmp_path):
    """Many conversions drop the MTP layer: by default that loads without it (a decision says so);
    given mtp=true it is a plan error."""
    path = write_checkpoint(tmp_path / "dropped", CFG, random_state(CFG, seed=11))
    p = build_plan(path)
    assert not p.errors and not len(p.model.mtp)
    assert [d.value for d in p.decisions if d.hook == "mtp_layers"] == [0]
    with pytest.raises(PlanError, match="option mtp=true, but the checkpoint stores no tensor"):
        quantplug.plan(path, options={"mtp": True})


def test_tensor_parallel_plan_splits_the_mtp_block(dense):
    p = build_plan(dense, world_size=2, rank=0)
    assert not p.errors
    shapes = {pp.param: pp.shape for pp in p.params}
    full = {pp.param: pp.shape for pp in build_plan(dense).params}
    o = next(k for k in shapes if k.startswith("mtp.0.block.self_attn.o_proj"))
    assert shapes[o][1] * 2 == full[o][1]                                  # row-split like the main layers
    eh = next(k for k in shapes if k.startswith("mtp.0.eh_proj"))
    assert shapes[eh] == full[eh]                                          # replicated


def test_tensor_parallel_ranks_draft_and_speculate_as_one_process(dense, model, tmp_path):
    """Two gloo ranks (tests/parallel/worker.py): the MTP layer loads split (heads, experts, vocab),
    its draft logits equal the single process's, and speculative decoding emits plain greedy's tokens."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import save_file

    ids = torch.randint(0, CFG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(4))
    lm = model.text_lm()
    nxt = torch.tensor([[17]])
    with torch.inference_mode():
        logits = model(ids)
        draft = lm.mtp_logits(torch.cat([ids[:1, 1:], nxt], 1), lm.model(ids[:1]), new_mtp_cache(lm, 1, 8))
    plain = model.generate(ids[:1], 16, eos_token_id=None)[0, 8:].tolist()
    save_file({"ids": ids, "logits": logits.contiguous(), "next": nxt, "mtp_logits": draft.contiguous()},
              str(tmp_path / "ref.safetensors"))
    (tmp_path / "cases.json").write_text(json.dumps([{"name": "mtp", "path": str(dense), "speculative": 16,
                                                      "ref": str(tmp_path / "ref.safetensors")}]))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = Path(__file__).parent / "parallel" / "worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(tmp_path / "cases.json"), str(tmp_path)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r}: {logs[r][-2000:]}"
        (rec,) = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "error" not in rec and "crash" not in rec, rec
        assert rec["parallel"]["world_size"] == 2 and rec["rel_err"] <= 1e-5
        split = {d["target"]: d["value"] for d in rec["parallel"]["decisions"]}
        assert split[f"model.layers.{N}.self_attn.o_proj"] == "row-parallel"
        assert split[f"model.layers.{N}.mlp.experts"] == "expert-parallel"
        assert rec["mtp_rel_err"] <= 1e-5
        assert rec["spec_tokens"] == plain and rec["drafts"] > 0


# -- (e) the CLI --------------------------------------------------------------------------------

def test_cli_speculative_prints_acceptance(dense, capsys):
    args = ["generate", str(dense), "--tokens", ",".join(map(str, PROMPT[0].tolist())), "--max-new-tokens", "12"]
    assert main(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--json", "--speculative", "mtp"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"] and spec["speculative"] == "mtp"
    assert spec["drafts"] > 0 and spec["acceptance_rate"] == round(spec["accepted_drafts"] / spec["drafts"], 4)
    assert spec["mtp_kv_cache_bytes_per_token"] == (CFG["kv_lora_rank"] + CFG["qk_rope_head_dim"]) * 4  # float32
    assert main(args + ["--speculative", "mtp"]) == 0
    err = capsys.readouterr().err
    assert f"mtp drafts {spec['drafts']}, accepted {spec['accepted_drafts']}" in err
    assert main(args + ["--speculative", "mtp", "--temperature", "0.7"]) == 1
    assert "greedily only" in capsys.readouterr().err


# -- DeepSeek-V3.2: the MTP layer is a DSA block (its own indexer keys, rolled back with its latent) --

def test_deepseek_v32_mtp_layer_speculates_like_greedy(tmp_path, monkeypatch):
    """V3.2 ships layer 61 too (ARCHITECTURES.md D1 / D2): the MTP block carries a lightning
    indexer, its cache holds indexer keys, and index_topk < the sequence so that selection matters
    in both the main layers and the MTP block. Greedy speculative = plain greedy with the drafts
    forced wrong (every draft's indexer key rolled back) and forced right (bonus tokens)."""
    cfg = tiny_config(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", q_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=4,
                      num_nextn_predict_layers=1)
    state = random_state(cfg, seed=12, mtp=True)
    assert f"model.layers.{cfg['num_hidden_layers']}.self_attn.indexer.wk.weight" in state
    m = quantplug.load(write_checkpoint(tmp_path / "v32", cfg, state), progress=False)
    assert m.mtp[0].block.self_attn.indexer is not None
    plain = m.generate(PROMPT, 24, eos_token_id=None)[0, PROMPT.shape[1]:].tolist()
    vocab = cfg["vocab_size"]
    for wrong, accepted in ((1, 0), (0, 11)):
        monkeypatch.setattr(Generation, "_pick_draft",
                            lambda self, logits, w=wrong: torch.tensor([(plain[_guessed(self)] + w) % vocab]))
        _, spec, g = _plain_and_speculative(m, new=24)
        assert spec == plain
        assert g.accepted == accepted
        assert g.mtp_cache is not None and g.mtp_cache.layers[0].index_keys().shape[-1] == 32
