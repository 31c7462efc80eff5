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
