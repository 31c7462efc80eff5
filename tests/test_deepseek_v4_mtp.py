"""DeepSeek-V4's MTP block (``mtp.0.*``) and speculative decoding, and the V4 cache's roll-back, on the
tiny model of tests/v4_models.py (sliding window 8, CSA r=4 with the indexer, HCA r=8) plus random
``mtp.0.*`` weights.

- The draft logits against an independent MTP written here from DeepSeek-V4's ``MTPBlock``
  (inference/model.py): transformers 5.25's ``DeepseekV4DecoderLayer`` for the block itself (it has
  no V4 MTP), plain torch for ``e_proj`` / ``h_proj`` / ``enorm`` / ``hnorm`` / ``hc_head`` / ``norm``
  / the head, and the main streams before ``hc_head`` taken from transformers' own model.
- Speculative greedy decoding = plain greedy over 30 new tokens (window and compression windows
  crossed), with the MTP block's own drafts and with drafts right on some steps only.
- ``DeepseekV4Cache.truncate(n)`` then continuing = a cache that never saw the rolled-back tokens.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from quantplug import load, plan
from quantplug.errors import PlanError
from quantplug.generate import Generation, GenerationError

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as tf  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402
from v4_models import (  # noqa: E402
    FP8_LINEARS,
    HCA,
    H,
    V,
    quantize_fp4_experts,
    quantize_fp8_blocks,
    reference_model,
    release_names,
    set_release_weights,
    write_float_checkpoint,
    write_v4_release,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EPS, HC, NEW = 1e-6, 4, 30
PROMPT = torch.tensor([[5, 17, 33, 2, 71]])


def _mtp_layer(ref: Any) -> Any:
    """The MTP block as transformers' decoder layer: sliding window only (the extra
    ``compress_ratios`` entry, 0) and a learned router with a bias (layer index past the hash
    layers), the main config's dims; random weights drawn as tests/v4_models.py draws them."""
    own = {k: v for k, v in ref.config.to_dict().items() if k not in ("layer_types", "mlp_layer_types")}
    cfg = DeepseekV4Config(**{**own, "num_hidden_layers": 1, "compress_ratios": [0], "num_hash_layers": 0})
    cfg._attn_implementation = "eager"
    layer = tf.DeepseekV4DecoderLayer(cfg, 0).float().eval()
    assert layer.self_attn.compressor is None and not layer.mlp.is_hash
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "e_score_correction_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if name.endswith("bias") else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return layer


def _mtp_tensors(layer: Any) -> dict[str, torch.Tensor]:
    """``mtp.0.*`` in the release's names: the block's (transformers' names mapped as a main layer's)
    and the MTP's own e_proj, h_proj, enorm, hnorm, norm, hc_head_{fn,base,scale}."""
    block = release_names({f"model.layers.0.{k}": v for k, v in layer.state_dict().items()})
    out = {f"mtp.0.{k.removeprefix('layers.0.')}": v for k, v in block.items()}
    g = torch.Generator().manual_seed(8)
    out.update({
        "mtp.0.e_proj.weight": torch.randn(H, H, generator=g) * H ** -0.5,
        "mtp.0.h_proj.weight": torch.randn(H, H, generator=g) * H ** -0.5,
        "mtp.0.enorm.weight": 1 + 0.2 * torch.randn(H, generator=g),
        "mtp.0.hnorm.weight": 1 + 0.2 * torch.randn(H, generator=g),
        "mtp.0.norm.weight": 1 + 0.2 * torch.randn(H, generator=g),
        "mtp.0.hc_head_fn": torch.randn(HC, HC * H, generator=g) * (HC * H) ** -0.5,
        "mtp.0.hc_head_base": torch.randn(HC, generator=g) * 0.3,
        "mtp.0.hc_head_scale": torch.rand(1, generator=g) + 0.5,
    })
    return out


def _release_mtp(mtp: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``mtp.0.*`` as the release stores it (E7 / E9: tests/v4_models.py's quantizers): FP8 with E8M0
    block scales for ``e_proj`` / ``h_proj`` and the block's dense linears, FP4 routed experts,
    float32 ``hc_*`` / ``attn_sink`` / ``gate.bias``, BF16 the rest; and the float32 values the
    stored tensors stand for (the quantizers' own dequantization)."""
    out: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    fp8 = tuple(f".{lin}.weight" for lin in (*FP8_LINEARS, "e_proj", "h_proj"))
    for name, t in mtp.items():
        base = name.removesuffix(".weight")
        if name.endswith(fp8):
            out[name], out[f"{base}.scale"], values[name] = quantize_fp8_blocks(t)
        elif ".ffn.experts." in name:
            out[name], out[f"{base}.scale"], values[name] = quantize_fp4_experts(t)
        elif ".hc_" in name or name.endswith(("attn_sink", "gate.bias")):
            out[name] = values[name] = t.float().contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
            values[name] = out[name].float()
    return out, values


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, dict[str, torch.Tensor], Path, Any]:
    ref = reference_model()
    layer = _mtp_layer(ref)
    mtp = _mtp_tensors(layer)
    path = write_float_checkpoint(tmp_path_factory.mktemp("v4mtp") / "ckpt", ref, mtp)
    return ref, layer, mtp, path, load(path, progress=False)


# -- the independent MTP ----------------------------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    return y if w is None else w * y


def _main_streams(ref: Any, ids: torch.Tensor) -> torch.Tensor:
    """transformers' streams after its last layer, before ``hc_head`` [b, t, 4, H]."""
    got: list[torch.Tensor] = []
    hook = ref.model.hc_head.register_forward_pre_hook(lambda _m, args: got.append(args[0]))
    try:
        ref(ids, use_cache=False)
    finally:
        hook.remove()
    return got[0]


def _reference_draft(ref: Any, layer: Any, w: dict[str, torch.Tensor], x: torch.Tensor, next_ids: torch.Tensor,
                     alter: str = "") -> torch.Tensor:
    """DeepSeek-V4 ``MTPBlock.forward`` at positions 0.. (the main model's: pair p = (X_p, t_{p+1})):
    e = enorm(embed(t)); U_k = e_proj(e) + h_proj(hnorm(X_k)); the block; hc_head; norm; head."""
    sd = ref.state_dict()
    e = _rms(sd["model.embed_tokens.weight"][next_ids], w["mtp.0.enorm.weight"])
    if alter == "post_head_hidden":   # DeepSeek-V3's MTP input: the normed state after hc_head, in every stream
        x = ref.model.norm(ref.model.hc_head(x)).unsqueeze(2).expand_as(x)
    h = _rms(x, w["mtp.0.hnorm.weight"])
    ew, hw = w["mtp.0.e_proj.weight"], w["mtp.0.h_proj.weight"]
    if alter == "swap_projections":
        ew, hw = hw, ew
    u = (e @ ew.T).unsqueeze(2) + h @ hw.T
    pos = torch.arange(u.shape[1]).unsqueeze(0)
    emb = torch.zeros(u.shape[0], u.shape[1], H)
    mask = create_sliding_window_causal_mask(config=layer.self_attn.config, inputs_embeds=emb, attention_mask=None,
                                             cache=None, position_ids=pos)
    rope = {"main": ref.model.rotary_emb(emb, position_ids=pos, layer_type="main"),
            "compress": ref.model.rotary_emb(emb, position_ids=pos, layer_type="compress")}
    y = layer(u, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=next_ids, cache=None)
    flat = y.flatten(2)
    mix = _rms(flat, None) @ w["mtp.0.hc_head_fn"].T
    pre = torch.sigmoid(mix * w["mtp.0.hc_head_scale"] + w["mtp.0.hc_head_base"]) + 1e-6
    out = (pre.unsqueeze(-1) * y).sum(dim=2)
    return _rms(out, w["mtp.0.norm.weight"]) @ sd["lm_head.weight"].T


def test_plan_loads_the_mtp_block_and_skips_stored_copies(v4, tmp_path):
    ref, _, mtp, path, model = v4
    p = plan(path)
    assert not p.problems
    d = [x for x in p.decisions if x.hook == "mtp_layers"]
    assert d and d[0].value == 1 and d[0].target == "mtp.0", d
    assert "mtp.0.e_proj" in p.schemes() and len(model.mtp) == 1
    # copies of the embedding / head in the MTP block (vLLM maps them): skipped, the main ones serve
    copies = {"mtp.0.emb.tok_emb.weight": torch.zeros(V, H), "mtp.0.head.weight": torch.zeros(V, H)}
    p = plan(write_float_checkpoint(tmp_path / "copies", ref, {**mtp, **copies}))
    assert not p.problems
    assert sorted(n for why, names in p.skipped.items() if why.startswith("mtp-copies") for n in names) == \
        sorted(copies)
    # a mis-shaped MTP tensor is a plan problem naming it, from the headers
    bad = write_float_checkpoint(tmp_path / "bad", ref, {**mtp, "mtp.0.h_proj.weight": torch.zeros(H, H + 1)})
    with pytest.raises(PlanError, match=rf"mtp\.0\.h_proj\.weight, file model\.safetensors: shape \[{H}, {H + 1}\], "
                                        rf"expected \[{H}, {H}\]"):
        plan(bad)
    # option mtp=false: not built, every mtp.0.* skipped; speculative decoding then says why
    off = load(path, options={"mtp": False}, progress=False)
    assert len(off.mtp) == 0
    assert sum(len(n) for why, n in off.quantplug_plan.skipped.items() if why.startswith("mtp:")) == len(mtp)
    with pytest.raises(GenerationError, match="mtp=false"):
        off.generate(PROMPT, 4, speculative="mtp")


def test_draft_logits_match_an_independent_mtp(v4):
    ref, layer, w, _, model = v4
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(5))
    x_ref = _main_streams(ref, ids[:, :-1])
    with torch.no_grad():
        cache = model.qp_new_cache(2, 32, 4096)
        x, _ = model.hidden_and_logits(ids[:, :-1], cache)
        assert (x - x_ref).abs().max() < 1e-5      # the streams the MTP block reads: transformers' own
        got = model.mtp_logits(ids[:, 1:], x, model.qp_new_mtp_cache(2, 32, 4096))
        want = _reference_draft(ref, layer, w, x_ref, ids[:, 1:])
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, err
        for alter in ("post_head_hidden", "swap_projections"):   # the test tells these apart
            other = _reference_draft(ref, layer, w, x_ref, ids[:, 1:], alter)
            assert (other - want).abs().max() / want.abs().max() > 1e-3, alter
        # its own cache: the same draft rows in steps of 1, 2 and the rest (the window of 8 crossed)
        mcache = model.qp_new_mtp_cache(2, 32, 4096)
        rows = [model.mtp_logits(ids[:, 1 + a:1 + b], x[:, a:b], mcache) for a, b in ((0, 1), (1, 3), (3, 23))]
    err = ((torch.cat(rows, dim=1) - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err
    assert mcache.length == 23


def _guessed(g: Generation) -> int:
    """Which new token the draft being picked guesses (the MTP cache holds pairs p < its length M:
    the draft is token M + 1, new token M + 1 - prompt length)."""
    assert g.mtp_cache is not None
    return g.mtp_cache.length + 1 - PROMPT.shape[1]


def _spec(model: Any) -> tuple[list[int], Generation]:
    g = model.stream(PROMPT, NEW, eos_token_id=None, speculative="mtp")
    return [int(t[0]) for t in g], g


@pytest.fixture(scope="module")
def release(v4: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, dict[str, torch.Tensor],
                                                                         dict[str, torch.Tensor]]:
    """The same model in DeepSeek-V4's FP8 + FP4 release format (``mtp.0.*`` included), loaded; its
    path; the float32 values of the main model's and of the MTP block's stored tensors."""
    ref, _, mtp, _, _ = v4
    path = tmp_path_factory.mktemp("v4mtp-release") / "ckpt"
    stored, mtp_values = _release_mtp(mtp)
    values = write_v4_release(path, ref, extra=stored)
    return load(path, progress=False), path, values, mtp_values


def test_release_draft_logits_match_the_independent_mtp(v4, release):
    """The release format, weight-only (``activation_quant=none``): the draft logits within 1e-5 of
    the independent MTP holding the values the stored FP8 / FP4 / BF16 tensors stand for."""
    ref, layer, _, _, _ = v4
    _, path, values, mtp_values = release
    model = load(path, options={"activation_quant": "none"}, progress=False)
    assert "fp4" in model.quantplug_plan.schemes()["mtp.0.ffn.experts.gate_proj"]
    ref_q = set_release_weights(ref, values)
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList([layer])
    layer_q = set_release_weights(holder, {f"layers.0.{k.removeprefix('mtp.0.')}": v
                                           for k, v in mtp_values.items()}).model.layers[0]
    ids = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        x_ref = _main_streams(ref_q, ids[:, :-1])
        want = _reference_draft(ref_q, layer_q, mtp_values, x_ref, ids[:, 1:])
        x, _ = model.hidden_and_logits(ids[:, :-1], model.qp_new_cache(1, 32, 4096))
        got = model.mtp_logits(ids[:, 1:], x, model.qp_new_mtp_cache(1, 32, 4096))
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err
    # the float MTP weights (not what the release stores) miss it
    float_draft = _reference_draft(ref_q, layer, v4[2], x_ref, ids[:, 1:])
    assert (float_draft - want).abs().max() / want.abs().max() > 1e-3


@pytest.mark.parametrize("fmt", ["float", "release"])
def test_speculative_equals_greedy(v4, release, fmt, monkeypatch):
    """Every bundled format of V4: the float checkpoint and the FP8 + FP4 release (fp8 backend)."""
    model = v4[-1] if fmt == "float" else release[0]
    if fmt == "release":
        p = model.quantplug_plan
        assert p.backend == "fp8" and not p.problems
        schemes = p.schemes()
        assert schemes["mtp.0.e_proj"] == schemes["layers.0.attn.wq_a"] != "dense"
        assert schemes["mtp.0.ffn.experts.gate_proj"] == schemes["layers.2.ffn.experts.gate_proj"]
    plain = model.generate(PROMPT, NEW, eos_token_id=None)[0, PROMPT.shape[1]:].tolist()
    # the MTP block's own drafts (random weights: mostly rejected, each rejection rolled back)
    spec, g = _spec(model)
    assert spec == plain and g.drafts > 0
    # drafts right on two steps of three: accepted ones take a bonus token, the others roll back
    right = {i for i in range(NEW) if i % 3}
    monkeypatch.setattr(Generation, "_pick_draft", lambda self, logits: torch.tensor(
        [plain[_guessed(self)] if _guessed(self) in right else (plain[_guessed(self)] + 1) % V]))
    spec, g = _spec(model)
    assert spec == plain
    assert 0 < g.accepted < g.drafts, (g.accepted, g.drafts)
    assert g.cache.length == PROMPT.shape[1] + NEW - 1 and g.cache.length > 3 * HCA
    # one sequence at a time: a batch is refused, naming why
    with pytest.raises(GenerationError, match="one sequence at a time"):
        model.generate(PROMPT.repeat(2, 1), 4, speculative="mtp")


# -- the cache's roll-back ----------------------------------------------------------------------------

def _states(cache: Any) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for c in cache.layers:
        out.append(c.window)
        for st in (c.compressor, c.indexer):
            out += [st.kv, st.gate, st.prev_kv, st.prev_gate, st.entries]
    return out


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    def norm(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None or t.numel() == 0 else t
    return all((x is None and y is None) or (x is not None and y is not None and x.shape == y.shape
               and bool((x - y).abs().max() < 1e-5)) for x, y in zip(map(norm, a), map(norm, b)))


def _clone(cache: Any) -> Any:
    """A copy of a DeepseekV4Cache: its states are replaced by each forward, never written in place,
    so copying the per-layer records is enough."""
    out = copy.copy(cache)
    out.layers = [dataclasses.replace(c, compressor=dataclasses.replace(c.compressor),
                                      indexer=dataclasses.replace(c.indexer)) for c in cache.layers]
    return out


def test_truncate_then_continue_equals_never_seen(v4):
    """n across a 27-token sequence (window 8, CSA r=4, HCA r=8: every boundary kind), fed as a
    5-token prompt and then one token a step: truncated to n and continued by 6 tokens gives the
    logits and the cache state of a cache that only ever saw the first n tokens."""
    *_, model = v4
    from quantplug.models.deepseek_v4 import DeepseekV4Cache
    seq = torch.randint(0, V, (2, 27), generator=torch.Generator().manual_seed(6))
    more = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(7))
    attn = [layer.attn for layer in model.layers]
    with torch.no_grad():
        seen = {}   # n -> a cache that only ever saw seq[:, :n], fed as the truncated one was
        for n in range(5):
            seen[n] = DeepseekV4Cache(attn, rollback=None)
            if n:
                model(seq[:, :n], cache=seen[n])
        cache = _clone(seen[0])
        model(seq[:, :5], cache=cache)
        for i in range(5, 27):
            seen[i] = _clone(cache)
            model(seq[:, i:i + 1], cache=cache)
        seen[27] = cache
        unrolled = model(more, cache=_clone(cache))
        chain = _clone(seen[27])
        for n in (26, 24, 23, 17, 16, 15, 9, 8, 7, 4, 3, 0):
            c = chain if n >= 23 else _clone(seen[27])   # one truncation after another, and from the full length
            c.truncate(n)
            assert c.length == n and _same(_states(c), _states(seen[n])), n
            got, want = model(more, cache=_clone(c)), model(more, cache=_clone(seen[n]))
            assert (got - want).abs().max() < 1e-5, n
            assert (unrolled - want).abs().max() > 1e-3, n   # the rolled-back tokens do change what follows


def test_bounded_rollback(v4):
    """A generation cache keeps the raw rows of ``rollback`` tokens back only: deeper truncation is a
    GenerationError naming the layer and what it keeps; within the bound it is exact."""
    *_, model = v4
    from quantplug.models.deepseek_v4 import DeepseekV4Cache
    seq = torch.randint(0, V, (1, 40), generator=torch.Generator().manual_seed(9))
    attn = [layer.attn for layer in model.layers]
    with torch.no_grad():
        cache = DeepseekV4Cache(attn, rollback=3)
        model(seq[:, :20], cache=cache)
        for i in range(20, 40):
            model(seq[:, i:i + 1], cache=cache)
        for c, a in zip(cache.layers, attn):
            assert c.log is not None and c.log.shape[1] <= 7 + 3
            if a.compressor is not None:
                assert c.compressor.log_kv is not None and c.compressor.log_kv.shape[1] <= 2 * a.compressor.ratio + 3
        with pytest.raises(GenerationError, match=r"layers\.0\.attn: cannot roll .* from 40 to 36 tokens.*rollback=3"):
            cache.truncate(36)
        cache.truncate(37)
        fresh = DeepseekV4Cache(attn, rollback=None)
        model(seq[:, :37], cache=fresh)
        assert (model(seq[:, 37:], cache=cache) - model(seq[:, 37:], cache=fresh)).abs().max() < 1e-5
        off = DeepseekV4Cache(attn, rollback=0)
        model(seq[:, :3], cache=off)
        with pytest.raises(GenerationError, match="keeps no roll-back log"):
            off.truncate(2)


# -- every bundled exporter -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, list[int]]:
    """The float model with its MTP block at q_lora_rank 32 (the group-32 / 16 formats' widths), loaded;
    a scratch root; its plain greedy tokens."""
    from v4_models import CONFIG

    ref = reference_model(32)
    mtp = _mtp_tensors(_mtp_layer(ref))
    root = tmp_path_factory.mktemp("v4mtp-export")
    path = write_float_checkpoint(root / "ckpt", ref, mtp, config={**CONFIG, "q_lora_rank": 32})
    model = load(path, progress=False)
    return model, root, model.generate(PROMPT, 12, eos_token_id=None)[0, PROMPT.shape[1]:].tolist()


def _exports() -> list[Any]:
    from quantplug.testing.engines import EXPORTS

    return [pytest.param(row, id=row.label) for row in EXPORTS if row.backend is not None]


@pytest.mark.parametrize("row", _exports())
def test_every_exporter_keeps_the_mtp_block_speculative_equals_greedy(exported_source, row):
    """Each bundled exporter writes ``mtp.0.*`` in its format (the fp8 one as the release does: FP8
    ``e_proj`` / ``h_proj``, FP4 experts) and the export's speculative greedy equals its plain greedy;
    GGUF leaves the MTP block out as llama.cpp's converter does, and speculative decoding says so."""
    from quantplug.testing.engines import installed_backends
    from quantplug.testing.probes import isolated_plugin_manager

    source, root, _ = exported_source
    backends = installed_backends()
    if row.backend not in backends:
        pytest.skip(f"backend {row.backend!r} is not installed")
    pm = isolated_plugin_manager({row.backend: backends[row.backend]})
    res = pm.export(row.backend, model=source, destination=root / row.label, plan=source.quantplug_plan,
                    options=row.options)[row.pick]
    model = load(res.path, plugin_manager=pm, progress=False)
    if row.backend == "expert_pack":
        assert len(model.mtp) == 0
        with pytest.raises(GenerationError):
            model.generate(PROMPT, 4, speculative="mtp")
        return
    assert len(model.mtp) == 1
    if row.backend == "fp8":
        schemes = model.quantplug_plan.schemes()
        assert "fp4" in schemes["mtp.0.ffn.experts.gate_proj"] and schemes["mtp.0.e_proj"] != "dense"
    plain = model.generate(PROMPT, 12, eos_token_id=None)[0, PROMPT.shape[1]:].tolist()
    spec = [int(t[0]) for t in model.stream(PROMPT, 12, eos_token_id=None, speculative="mtp")]
    assert spec == plain
