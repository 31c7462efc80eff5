"""The transformers bridge (integrations/transformers, quantplug-transformers): transformers' own
DeepseekV3ForCausalLM with quantplug's planned modules, on every bundled backend's tiny checkpoint
with DeepSeek's MLA dimensions (kv_lora 512 + rope 64), each written by its backend's exporter from
one bf16 dense model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

qt = pytest.importorskip("quantplug_transformers", reason="quantplug-transformers is not installed "
                         "(pip install -e integrations/transformers)")
transformers = pytest.importorskip("transformers")

import quantplug  # noqa: E402
from quantplug.api import QuantLinear  # noqa: E402
from quantplug.testing.engines import EXPORTS, export_formats  # noqa: E402

PROMPT = [1, 5, 9, 33, 100, 7]
NEW = 16


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and spares a shared CI box
    try:
        yield export_formats(tmp_path_factory.mktemp("bridge"))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("label", [row.label for row in EXPORTS])
def test_generate_equals_quantplug_generate(exports: dict[str, Path], label: str) -> None:
    """transformers' greedy generate on the bridged model = quantplug's generate (what `quantplug
    generate` runs), 16 new tokens, float32, each backend's default options."""
    if label not in exports:
        pytest.skip(f"the backend writing {label} is not installed")
    path = exports[label]
    model = qt.from_pretrained(path)
    assert type(model) is transformers.DeepseekV3ForCausalLM
    assert isinstance(model.model.layers[0].self_attn.o_proj, QuantLinear)
    got = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)[0, len(PROMPT):].tolist()
    want = quantplug.load(path, progress=False).generate(torch.tensor([PROMPT]), NEW)[0, len(PROMPT):].tolist()
    assert got == want


def test_quantized_tensors_stay_packed(exports: dict[str, Path]) -> None:
    """The bridged model holds the plan's tensors as loaded: GGUF blocks as bytes, FP8 as float8."""
    if "gguf-q4_0" not in exports or "fp8-block" not in exports:
        pytest.skip("quantplug-expert-pack or quantplug-fp8 is not installed")
    gguf = dict(qt.from_pretrained(exports["gguf-q4_0"]).named_parameters())
    assert gguf["model.layers.1.mlp.experts.gate_proj.weight"].dtype == torch.uint8
    assert gguf["model.layers.0.self_attn.kv_b_proj.k_b.weight"].dtype == torch.uint8  # split K/V, as stored
    fp8 = dict(qt.from_pretrained(exports["fp8-block"]).named_parameters())
    assert fp8["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("label", ["gguf-q4_0", "fp8-block"])
def test_routed_experts_served_from_the_checkpoint_files(exports: dict[str, Path], label: str) -> None:
    """``options={"expert_cache_mb": ...}``: transformers calls quantplug's experts, which read each
    routed expert from the checkpoint's files through the cache (no expert weights in the model);
    the tokens are quantplug's."""
    if label not in exports:
        pytest.skip(f"the backend writing {label} is not installed")
    path, options = exports[label], {"expert_cache_mb": 1}
    model = qt.from_pretrained(path, options=options)
    experts = model.model.layers[1].mlp.experts
    assert experts.qp_store is not None and not list(experts.parameters())
    got = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)[0, len(PROMPT):].tolist()
    want = quantplug.load(path, progress=False).generate(torch.tensor([PROMPT]), NEW)[0, len(PROMPT):].tolist()
    assert got == want
    stats = experts.qp_store.cache.stats()
    assert stats["misses"] > 0 and stats["bytes_read"] > 0


def _byte_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tk = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tk.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize("label", ["dense", "gguf-q8_0"])
def test_text_generation_pipeline(exports: dict[str, Path], tmp_path: Path, label: str) -> None:
    """pipeline("text-generation") on a checkpoint with a tokenizer (a byte-level BPE over the
    256-token vocabulary): the text it returns is the prompt plus quantplug's greedy tokens."""
    if label not in exports:
        pytest.skip(f"the backend writing {label} is not installed")
    path = tmp_path / label
    shutil.copytree(exports[label], path)
    _byte_tokenizer(path)
    tok = qt.tokenizer(path)
    pipe = transformers.pipeline("text-generation", model=qt.from_pretrained(path), tokenizer=tok)
    text = pipe("Hello, MLA", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    ids = tok("Hello, MLA")["input_ids"]
    want = quantplug.load(path, progress=False).generate(torch.tensor([ids]), 8)[0].tolist()
    assert text == tok.decode(want)


def test_peft_lora_on_a_quantized_linear(exports: dict[str, Path]) -> None:
    """A LoRA adapter on quantized projections (PEFT's own LoRA Linear around quantplug's
    QuantLinear, through PEFT's custom-module mapping): only adapter weights are trainable, at init
    the adapter adds nothing, a non-zero adapter changes the logits exactly by its own product, and
    disabling it gives the base model back. (Training through the quantized layers needs a backward
    the schemes do not provide yet: see docs/transformers.md.)"""
    peft = pytest.importorskip("peft")
    if "gguf-q8_0" not in exports:
        pytest.skip("quantplug-expert-pack is not installed")
    model = qt.from_pretrained(exports["gguf-q8_0"])
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        base = model(ids).logits
    pm = peft.get_peft_model(model, qt.lora_config(r=4, lora_alpha=8, target_modules=["q_b_proj"]))
    layer = pm.base_model.model.model.layers[0].self_attn.q_b_proj
    assert isinstance(layer.base_layer, QuantLinear) and layer.base_layer.weight.dtype == torch.uint8
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "q_b_proj" in n for n in trainable)
    with torch.no_grad():
        assert torch.equal(pm(ids).logits, base)  # LoRA B starts at zero
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        x = torch.randn(3, layer.base_layer.in_features)
        delta = layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]
        assert torch.allclose(layer(x), layer.base_layer(x) + delta)
        assert not torch.allclose(pm(ids).logits, base)
        with pm.disable_adapter():
            assert torch.equal(pm(ids).logits, base)


def test_plan_error_before_any_weight(exports: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint missing a tensor: quantplug's PlanError, naming the tensor, from the one call."""
    from quantplug.errors import PlanError
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(exports["dense"] / "config.json", bad / "config.json")
    tensors = load_file(str(exports["dense"] / "model.safetensors"))
    del tensors["model.layers.2.self_attn.o_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(PlanError, match="model.layers.2.self_attn.o_proj.weight"):
        qt.from_pretrained(bad)


@pytest.mark.parametrize("label", [row.label for row in EXPORTS])
def test_paged_decode_on_an_engines_cache_equals_quantplugs_own_step(exports: dict[str, Path], label: str) -> None:
    """``quantplug.bridge.paged_decode`` (how the vLLM plugin decodes) on an engine-shaped paged
    cache: vLLM's MLA layout (slots of latent ‖ roped key, blocks of 16 out of order, keys in the
    checkpoint's interleaved pair layout) gives quantplug's own one-call step's output, float32,
    every format (every product has a native form; latents quantized on read where kv_b_proj
    quantizes its input, as quantplug's own step does); it writes the new token's rows as the
    engine holds them."""
    from quantplug.bridge import paged_decode
    from quantplug.generate import new_cache

    if label not in exports:
        pytest.skip(f"the backend writing {label} is not installed")
    model = quantplug.load(exports[label], progress=False)
    pd = paged_decode(model)
    assert pd is not None and pd.perm is not None
    st, n = pd.step, len(PROMPT)
    kl, rope = st.mla_steps[0].kv_lora, st.rope
    kv = [torch.randn(4 * 16, kl + rope) for _ in range(st.n)]
    rows = (torch.tensor([2, 0])[:, None] * 16 + torch.arange(16)).flatten()[None]
    with torch.inference_mode():
        cache = new_cache(model, 1, 32)
        model.next_logits(torch.tensor([PROMPT]), cache)
        for i, c in enumerate(cache.layers):
            kv[i][rows[0, :n], :kl] = c.latent[0, 0, :n]
            kv[i][rows[0, :n], kl:] = c.k_rope[0, 0, :n][:, pd.perm]
        x = model.model.embed_tokens(torch.tensor([[77]]))
        ref = st(x, model.model.rotary.step_rotation(n, torch.float32), cache.layers)
        out = pd(x[:, 0], torch.tensor([n]), kv, rows)
    assert out is not None and pd.calls == 1
    assert (out[0] - ref[0, 0]).abs().max() <= 1e-5 * ref.abs().max()
    for i, c in enumerate(cache.layers):  # the rows written: the latent and key, as the engine holds them
        tol = 0.0 if i == 0 else 1e-5
        assert (kv[i][rows[0, n], :kl] - c.latent[0, 0, n]).abs().max() <= tol * c.latent[0, 0, n].abs().max()
        assert (kv[i][rows[0, n], kl:] - c.k_rope[0, 0, n][pd.perm]).abs().max() <= tol * c.k_rope[0, 0, n].abs().max()


# -- Kimi-Linear: transformers' own KimiLinearForCausalLM -------------------------------------------

VENDOR = Path(__file__).parents[1] / "data" / "vendor"
#: a 70-token prompt: the chunked KDA form crosses a chunk (64 tokens)
LONG = torch.randint(2, 250, (1, 70), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A tiny Kimi-Linear checkpoint (release names) and transformers' float32 eager
    KimiLinearForCausalLM holding the same weights."""
    from quantplug.testing.kimi import kimi_linear_hf_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield kimi_linear_hf_checkpoint(tmp_path_factory.mktemp("kimi") / "kimi-linear")
    finally:
        torch.set_num_threads(threads)


def _greedy(model: object, path: Path, ids: torch.Tensor) -> tuple[list[int], list[int]]:
    got = model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()  # type: ignore[attr-defined]
    want = quantplug.load(path, progress=False).generate(ids, NEW)[0, ids.shape[1]:].tolist()
    return got, want


def test_kimi_linear_is_transformers_kimi_linear(kimi: tuple[Path, object]) -> None:
    """A Kimi-Linear checkpoint gives transformers' own KimiLinearForCausalLM with quantplug's planned
    modules (KDA and MLA projections QuantLinear, the forget gate's under ``forget_gate``, the routed
    experts quantplug's under ``mlp.experts``) and the release's float tensors mapped as transformers
    maps them (q / k / v convolutions as one ``conv1d``): its float32 logits on a 70-token prompt
    equal transformers' own model on the same weights within 1e-5 (relative to the largest logit), and
    transformers' greedy generate (its cache: KDA states, MLA latents) gives quantplug's tokens."""
    path, ref = kimi
    model = qt.from_pretrained(path)
    assert type(model) is transformers.KimiLinearForCausalLM
    kda, mla = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert isinstance(kda, transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention)
    assert all(isinstance(m, QuantLinear) for m in (kda.q_proj, kda.forget_gate.f_a_proj, kda.o_proj, mla.kv_b_proj))
    assert type(model.model.layers[1].mlp.experts).__module__.startswith("quantplug.")
    with torch.no_grad():
        got, want = model(LONG).logits, ref(LONG).logits  # type: ignore[operator]
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    tokens, quantplugs = _greedy(model, path, torch.tensor([PROMPT]))
    assert tokens == quantplugs


@pytest.mark.parametrize("label", ["gguf_kimi_linear_q8_0", "gguf_kimi_linear_q4_k_m", "fp8"])
def test_kimi_linear_quantized_generate_equals_quantplug_generate(kimi: tuple[Path, object], tmp_path: Path,
                                                                 label: str) -> None:
    """Quantized Kimi-Linear through the bridge: llama.cpp's own GGUFs (tests/data/vendor: Q8_0,
    Q4_K_M; split K/V, folded ``A``, [1, C, 1, W] convolutions) and DeepSeek block FP8 of the tiny
    model: transformers' greedy tokens = quantplug generate's, and the quantized tensors stay packed
    (GGUF blocks uint8, FP8 float8)."""
    if label == "fp8":
        pytest.importorskip("quantplug_fp8", reason="quantplug-fp8 is not installed")
        from quantplug.testing.formats import fp8
        from quantplug.testing.kimi import kimi_linear_config, kimi_linear_state

        cfg = kimi_linear_config()
        path, packed = fp8(tmp_path / "fp8", cfg, kimi_linear_state(cfg)), torch.float8_e4m3fn
    else:
        pytest.importorskip("quantplug_expert_pack", reason="quantplug-expert-pack is not installed")
        path, packed = VENDOR / label, torch.uint8
    model = qt.from_pretrained(path)
    assert type(model) is transformers.KimiLinearForCausalLM
    params = dict(model.named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.forget_gate.f_b_proj.weight",
                 "model.layers.1.mlp.experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight"):
        assert params[name].dtype == packed, name
    if label != "fp8":  # llama.cpp stores MLA's K/V split: served as stored
        assert params["model.layers.1.self_attn.kv_b_proj.k_b.weight"].dtype == torch.uint8
    got, want = _greedy(model, Path(path), torch.tensor([PROMPT]))
    assert got == want


@pytest.mark.parametrize("case", ["k3", "k3-feature"])
def test_kimi_k3_is_refused_naming_why(tmp_path: Path, case: str) -> None:
    """The released Kimi-K3 has no transformers class: refused before any tensor data is read, naming
    why; a Kimi-Linear checkpoint enabling a K3 feature transformers' KimiLinearForCausalLM lacks is
    refused naming the feature (its config would silently drop it)."""
    from quantplug.testing.kimi import (
        kimi_k3_config,
        kimi_k3_state,
        kimi_linear_config,
        kimi_linear_state,
        write_kimi_checkpoint,
    )
    from quantplug.testing.probes import forbid_data_reads

    if case == "k3":
        cfg = kimi_k3_config()
        path = write_kimi_checkpoint(tmp_path / case, cfg, kimi_k3_state(cfg))
        why = ("KimiK3ForConditionalGeneration: the released Kimi-K3 (attention residuals, latent MoE, SiTU, "
               "full-rank KDA output gate, bounded forget gate, MLA output gate) has no model class in transformers "
               "or vLLM to bridge into; run it with quantplug.load / generate")
    else:
        cfg = kimi_linear_config(attn_res_block_size=2)
        path = write_kimi_checkpoint(tmp_path / case, cfg, kimi_linear_state(cfg))
        why = ("KimiLinearForCausalLM: transformers' KimiLinearForCausalLM has no attention residuals "
               "(attn_res_block_size) (Kimi-K3's features); run it with quantplug.load / generate")
    with forbid_data_reads(path) as reads, pytest.raises(qt.BridgeError) as info:
        qt.from_pretrained(path)
    assert str(info.value) == f"{path}: {why}"
    assert not reads.events
