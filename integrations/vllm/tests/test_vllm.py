"""vLLM runs what quantplug plans: every bundled backend's tiny checkpoint with DeepSeek's MLA
dimensions (kv_lora 512 + rope 64), exported by that backend's own exporter from one bf16 dense
model, loaded with ``load_format="quantplug"`` into vLLM's own DeepseekV3ForCausalLM.

Runs in an environment with vLLM's CPU build (``bash .ci/run`` makes one); skipped elsewhere.
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set in conftest.py)."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment (bash .ci/run makes one)")

import quantplug  # noqa: E402
import torch  # noqa: E402
from quantplug.testing.engines import EXPORTS, checkpoint_bytes, export_formats  # noqa: E402
from quantplug_vllm.loader import held_bytes  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

PROMPT = [1, 5, 9, 33, 100, 7]
NEW = 16
#: backend options both sides run with: the FP8 format weight-only (see test_fp8_activation_emulation)
OPTIONS: dict[str, dict[str, str]] = {"fp8-block": {"activation_quant": "none"}}
LABELS = [row.label for row in EXPORTS]
PACKED = {row.label for row in EXPORTS if row.packed}


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


@pytest.mark.parametrize("label", LABELS)
def test_greedy_equals_quantplug_generate(exports: dict[str, Path], label: str) -> None:
    """float32: vLLM's greedy tokens = ``quantplug generate``'s, 16 new tokens, every format."""
    if label not in exports:
        pytest.skip(f"the backend writing {label} is not installed")
    path, options = exports[label], OPTIONS.get(label, {})
    # what `quantplug generate` runs (the CLI itself: test_third_party_backend_without_vllm_code)
    model = quantplug.load(path, options=options, progress=False)
    want = model.generate(torch.tensor([PROMPT]), NEW)[0, len(PROMPT):].tolist()
    del model
    # quantization="quantplug": vLLM's config stage would otherwise judge the checkpoint by its own
    # quant_method first (it refuses float32 for "fp8", and knows nothing of "acme")
    llm = _llm(path, "float32", quantization="quantplug", model_loader_extra_config=options)
    assert _generate(llm) == want


@pytest.mark.parametrize("label", sorted(PACKED))
def test_bf16_tokens_and_weight_bytes(exports: dict[str, Path], label: str) -> None:
    """bfloat16 (the checkpoints' float type): tokens = quantplug's bfloat16 model's; the quantized
    tensors stay as the plan loaded them, so the bytes vLLM holds outside its own MLA copies
    (W_UK_T / W_UV: vLLM keeps kv_b_proj dense for every format) and its rope cache are within 1.2x
    the checkpoint's weight files."""
    if label not in exports:
        pytest.skip(f"the backend writing {label} is not installed")
    path, options = exports[label], OPTIONS.get(label, {})
    ref = quantplug.load(path, dtype=torch.bfloat16, options=options, progress=False)
    want = ref.generate(torch.tensor([PROMPT]), NEW)[0, len(PROMPT):].tolist()
    llm = _llm(path, "bfloat16", model_loader_extra_config=options)
    got = _generate(llm)
    if got != want:
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
    vllm_own = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
                   if re.search(r"\.(W_UK_T|W_UV|cos_sin_cache)$", n))
    total, ckpt = held_bytes(model), checkpoint_bytes(path)
    print(f"{label}: vLLM holds {total:,} bytes = {total / ckpt:.3f}x the checkpoint's {ckpt:,} "
          f"({vllm_own:,} of them vLLM's own W_UK_T / W_UV / rope cache)")
    assert total - vllm_own <= 1.2 * ckpt
    # nothing the plan keeps packed was widened: every quantized planned tensor is still there, in its dtype
    planned = [t for n, t in model.named_parameters() if ".quantplug." in n]
    assert any(t.dtype not in (torch.bfloat16, torch.float32) for t in planned)


def test_fp8_activation_emulation_differs_only_in_mla_decode(exports: dict[str, Path]) -> None:
    """The FP8 format under quantplug's default ``activation_quant=dynamic`` (DeepSeek's per-token
    FP8 activations): vLLM's MLA decodes with kv_b_proj dequantized and absorbed (DeepSeek's own
    reference inference does the same), quantplug's model expands K/V through the activation-
    quantized kv_b_proj at every step. The prefill (first token) is computed the same way and agrees."""
    if "fp8-block" not in exports:
        pytest.skip("quantplug-fp8 is not installed")
    want = _cli_generate(exports["fp8-block"], {})
    got = _generate(_llm(exports["fp8-block"], "float32", quantization="quantplug"))
    assert got[0] == want[0]


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


def test_quantization_without_the_loader_is_refused(exports: dict[str, Path]) -> None:
    """quantization="quantplug" with vLLM's default loader: refused with a message naming the loader."""
    with pytest.raises(Exception, match="load_format='quantplug'"):
        LLM(model=str(exports["dense"]), quantization="quantplug", skip_tokenizer_init=True, dtype="float32",
            max_model_len=128, max_num_seqs=2, enforce_eager=True)
