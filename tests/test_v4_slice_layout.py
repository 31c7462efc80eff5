"""The DeepSeek-V4 slice writer (``quantplug.testing.slice.write_v4_checkpoint``, used at V4-Flash's real
dimensions by ``bench/make_v4_slice.py``) at tiny dimensions: the files it writes hold the release's tensors
(the release's names, shapes and dtypes, docs/architectures/deepseek-v4.md) as the safetensors library reads them, the same tensor set
as transformers' V4 model in the release's names, random values at the intended scales, and a plan."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from quantplug import load, plan
from quantplug.testing.slice import (
    E2M1_VALUES,
    V4_FLASH_CONFIG,
    v4_flash_slice_config,
    v4_release_tensors,
    write_v4_checkpoint,
)
from safetensors import safe_open

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from v4_models import CONFIG, reference_model, release_names  # noqa: E402
from v4_models import release_tensors as quantized_reference  # noqa: E402

#: the tiny release config: tests/v4_models.py's (one SWA, one CSA, one HCA layer; the first hash-routed) with
#: the release's quantization_config and FP4 experts
TINY = {**CONFIG, "quantization_config": dict(V4_FLASH_CONFIG["quantization_config"]), "expert_dtype": "fp4"}
FP8 = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "indexer.wq_b", "shared_experts.w1", "shared_experts.w3",
       "shared_experts.w2")


def _read(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[k] = h.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("v4slice") / "ckpt"
    write_v4_checkpoint(root, TINY, seed=3, shard_bytes=120_000, reserve=0)
    return root, _read(root)


def _expected(name: str, cfg: dict) -> tuple[torch.dtype, tuple[int, ...]]:
    """The release's rules, restated: the dtype and shape of ``name`` (scales from their weight)."""
    h, v, nh, hd, ql = (cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["head_dim"],
                        cfg["q_lora_rank"])
    g, r, e, k, mi = cfg["o_groups"], cfg["o_lora_rank"], cfg["n_routed_experts"], cfg["num_experts_per_tok"], \
        cfg["moe_intermediate_size"]
    ih, idim, hc = cfg["index_n_heads"], cfg["index_head_dim"], cfg["hc_mult"]
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    rest = m.group(2) if m else name
    ratio = cfg["compress_ratios"][int(m.group(1))] if m else 0
    wide = hd * (2 if ratio == 4 else 1)
    linears = {"attn.wq_a": (ql, h), "attn.wq_b": (nh * hd, ql), "attn.wkv": (hd, h),
               "attn.wo_a": (g * r, nh * hd // g), "attn.wo_b": (h, g * r), "attn.indexer.wq_b": (ih * idim, ql),
               "ffn.shared_experts.w1": (mi, h), "ffn.shared_experts.w3": (mi, h), "ffn.shared_experts.w2": (h, mi)}
    base, _, leaf = rest.rpartition(".")
    ex = re.fullmatch(r"ffn\.experts\.\d+\.(w[123])", base)
    if ex:  # FP4: I8 [N, K/2] + E8M0 [N, K/32]
        n_, k_ = (mi, h) if ex.group(1) != "w2" else (h, mi)
        return (torch.int8, (n_, k_ // 2)) if leaf == "weight" else (torch.float8_e8m0fnu, (n_, k_ // 32))
    if base in linears:  # FP8 + E8M0 per 128 x 128
        n_, k_ = linears[base]
        return (torch.float8_e4m3fn, (n_, k_)) if leaf == "weight" else \
            (torch.float8_e8m0fnu, (math.ceil(n_ / 128), math.ceil(k_ / 128)))
    f32 = {"hc_attn_fn": (24, hc * h), "hc_attn_base": (24,), "hc_attn_scale": (3,), "hc_ffn_fn": (24, hc * h),
           "hc_ffn_base": (24,), "hc_ffn_scale": (3,), "hc_head_fn": (hc, hc * h), "hc_head_base": (hc,),
           "hc_head_scale": (1,), "attn.attn_sink": (nh,), "attn.compressor.ape": (ratio, wide),
           "attn.indexer.compressor.ape": (4, 2 * idim), "ffn.gate.bias": (e,)}
    if rest in f32:
        return torch.float32, f32[rest]
    if rest == "ffn.gate.tid2eid":
        return torch.int64, (v, k)
    bf16 = {"embed.weight": (v, h), "head.weight": (v, h), "norm.weight": (h,), "attn_norm.weight": (h,),
            "ffn_norm.weight": (h,), "attn.q_norm.weight": (ql,), "attn.kv_norm.weight": (hd,),
            "attn.compressor.wkv.weight": (wide, h), "attn.compressor.wgate.weight": (wide, h),
            "attn.compressor.norm.weight": (hd,), "attn.indexer.weights_proj.weight": (ih, h),
            "attn.indexer.compressor.wkv.weight": (2 * idim, h), "attn.indexer.compressor.wgate.weight": (2 * idim, h),
            "attn.indexer.compressor.norm.weight": (idim,), "ffn.gate.weight": (e, h)}
    if rest in bf16:
        return torch.bfloat16, bf16[rest]
    raise AssertionError(f"{name}: not a DeepSeek-V4 release tensor")


def test_every_tensor_has_the_release_dtype_and_shape(written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, tensors = written
    for name, t in tensors.items():
        assert (t.dtype, tuple(t.shape)) == _expected(name, TINY), name
    # every FP8 / FP4 weight has its scale and nothing else has one
    weights = {n[: -len(".weight")] for n, t in tensors.items() if t.dtype in (torch.float8_e4m3fn, torch.int8)}
    assert weights == {n[: -len(".scale")] for n in tensors if n.endswith(".scale")}
    assert sum(n.endswith("tid2eid") for n in tensors) == CONFIG["num_hash_layers"] == 1
    assert sum(n.endswith("gate.bias") for n in tensors) == CONFIG["num_hidden_layers"] - 1
    assert {n for n in tensors if ".indexer." in n} == {n for n in tensors if n.startswith("layers.1.attn.indexer.")}
    assert not any(n.startswith("layers.0.attn.compressor") for n in tensors)  # ratio 0: sliding window only
    index = json.loads((root / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, fname in index["weight_map"].items():
        with safe_open(root / fname, "pt") as h:
            assert name in h.keys()  # noqa: SIM118


def test_tensor_set_is_the_reference_models(written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """transformers' V4 model, renamed to the release's names (tests/v4_models.py), has exactly these weights,
    of these logical shapes (an FP4 row holds two inputs per byte)."""
    _, tensors = written
    ref = release_names(reference_model().state_dict())
    assert set(ref) == {n for n in tensors if not n.endswith(".scale")}
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        shape = list(t.shape)
        if t.dtype == torch.int8:
            shape[-1] *= 2
        assert tuple(shape) == tuple(ref[name].shape), name


def test_dtypes_and_shapes_equal_the_reference_quantizer(written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """tests/v4_models.py quantizes transformers' tiny V4 into the release layout on its own (FP8 + E8M0 scales,
    FP4 experts): the same tensors, dtypes and shapes as the slice writer's."""
    _, tensors = written
    stored, _ = quantized_reference(reference_model(), "fp4")
    assert {n: (t.dtype, tuple(t.shape)) for n, t in stored.items()} == \
        {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}


def test_plans_cleanly(written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """The fp8 backend claims the slice as DeepSeek-V4's release (FP8 dense, FP4 routed experts): no problem,
    in memory and with the experts served from the files."""
    root, tensors = written
    for options in ({}, {"expert_cache_mb": 1}):
        p = plan(root, options=options)
        assert p.problems == [] and p.backend == "fp8" and p.architecture == "DeepseekV4ForCausalLM"
        schemes = {d.target: d.value for d in p.decisions if d.hook == "quantplug_linear_scheme"}
        assert schemes["layers.2.ffn.experts.gate_proj"].startswith("fp4 e2m1")
        assert schemes["layers.1.attn.indexer.wq_b"].startswith("fp8 e4m3")
        assert schemes["layers.1.attn.compressor.wkv"] == "dense"
        planned = {src.tensor for pp in p.params for src, _ in pp.sources}
        assert planned == set(tensors)


def test_loads_and_generates_with_experts_from_the_files(written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """The slice loads and generates: finite logits that vary, the same with the routed experts served from the
    files through a cache as with every weight in memory (float32: bitwise; a bfloat16 model rounds the two
    paths' sums in different places once experts see one token each, as at 256 experts), and a bfloat16 model
    (as the real-dimension bench runs it) generates from the files too."""
    from quantplug.api import stats_sources

    root, _ = written
    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 60, 21]])
    out = {}
    for dtype, cache_mb in ((torch.float32, 0), (torch.float32, 0.05), (torch.bfloat16, 0.05)):
        model = load(root, dtype=dtype, options={"expert_cache_mb": cache_mb} if cache_mb else {}, progress=False)
        with torch.inference_mode():
            logits = model(ids).float()
            gen = model.generate(ids, 8)
        assert bool(torch.isfinite(logits).all()) and float(logits.std()) > 0.1
        assert len(set(gen[0, ids.shape[1]:].tolist())) > 1  # tokens vary
        if cache_mb:
            stats = stats_sources(model)["expert_cache"].stats()
            assert stats["requests"] > stats["hits"] > 0  # served, and some read back after eviction
        out[dtype, cache_mb] = (logits, gen)
    (l0, g0), (l1, g1) = out[torch.float32, 0], out[torch.float32, 0.05]
    assert torch.equal(l0, l1) and torch.equal(g0, g1)
    lb = out[torch.bfloat16, 0.05][0]
    assert float((lb - l0).abs().max()) < 0.1 * float(l0.abs().max())


def test_inventory_at_flash_dimensions() -> None:
    """The real-dimension slice's inventory (no data written): the release's Flash shapes for the CSA / HCA layers."""
    cfg = v4_flash_slice_config()
    assert cfg["compress_ratios"] == [4, 128] and cfg["num_hash_layers"] == 1
    inv = {t.name: t for t in v4_release_tensors(cfg)}
    for name, t in inv.items():
        dtype, shape = _expected(name, cfg)
        assert t.shape == shape, name
        assert str(dtype).endswith({"F8_E4M3": "e4m3fn", "F8_E8M0": "e8m0fnu", "I8": "int8", "I64": "int64",
                                    "F32": "float32", "BF16": "bfloat16"}[t.dtype]), name
    assert inv["layers.0.attn.wo_a.scale"].shape == (64, 32)
    assert inv["layers.0.attn.compressor.ape"].shape == (4, 1024)
    assert inv["layers.1.attn.compressor.ape"].shape == (128, 512)
    assert inv["layers.0.ffn.experts.255.w1.weight"].shape == (2048, 2048)
    assert inv["layers.1.ffn.experts.0.w2.scale"].shape == (4096, 64)
    assert "layers.0.ffn.gate.tid2eid" in inv and "layers.1.ffn.gate.bias" in inv
    assert not any(n.startswith("layers.1.attn.indexer") for n in inv)
    assert 9.0e9 < sum(t.nbytes for t in inv.values()) < 9.5e9


def _e8m0(t: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, t.view(torch.uint8).double() - 127)


def _fp4(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    b = w.view(torch.uint8).numpy()
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)  # element 2j low nibble, 2j+1 high
    vals = E2M1_VALUES[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    return torch.from_numpy(vals).double() * _e8m0(s).repeat_interleave(32, dim=1)


def test_values_are_well_scaled(written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    _, tensors = written
    for name, t in tensors.items():
        base = name[: -len(".weight")]
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[f"{base}.scale"]
            w = t.double() * _e8m0(s).repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]
        elif t.dtype == torch.int8:
            w = _fp4(t, tensors[f"{base}.scale"])
        else:
            continue
        ratio = float(w.std()) * math.sqrt(w.shape[1])
        assert 0.5 < ratio < 2.0, (name, ratio)  # std ~ 1 / sqrt(in)
        exps = tensors[f"{base}.scale"].view(torch.uint8)
        assert int(exps.max()) - int(exps.min()) <= 1, name  # exponents b or b + 1
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            assert bool((t == 1).all()), name
        elif name.endswith("gate.bias"):
            assert bool((t == 0).all()), name
        elif name.endswith("tid2eid"):
            assert int(t.min()) >= 0 and int(t.max()) < CONFIG["n_routed_experts"]
            assert all(len(set(row)) == CONFIG["num_experts_per_tok"] for row in t.tolist())
            # tokens route differently: of the 56 ordered pairs of 8 experts, 96 uniform draws hit ~46
            assert len({tuple(row) for row in t.tolist()}) >= 30
            assert set(t.flatten().tolist()) == set(range(CONFIG["n_routed_experts"]))
        elif t.dtype in (torch.bfloat16, torch.float32) and t.numel() >= 256:
            assert float(t.float().std()) > 0 and bool(torch.isfinite(t.float()).all()), name
    # both scale exponents occur, so a scale applied to the wrong block changes results
    s = tensors["layers.1.ffn.experts.0.w1.scale"].view(torch.uint8)
    assert s.unique().numel() == 2


def test_deterministic_in_the_seed(tmp_path: Path, written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    _, tensors = written
    cfg = {**TINY, "num_hidden_layers": 1, "compress_ratios": [0]}
    a = _read(write_v4_checkpoint(tmp_path / "a", cfg, seed=3, reserve=0).path)
    b = _read(write_v4_checkpoint(tmp_path / "b", cfg, seed=4, reserve=0).path)
    assert set(a) == set(b) and set(a) < set(tensors)
    # each tensor its own stream: its bytes depend on the seed and its name only, not on the layers after it or
    # on the sharding (one shard here, several in ``written``)
    assert all(torch.equal(a[n].view(torch.uint8), tensors[n].view(torch.uint8)) for n in a)
    varied = [n for n in a if a[n].numel() > 1 and not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))]
    assert set(varied) == {n for n in a if a[n].numel() > 1 and not n.endswith(("norm.weight", "gate.bias"))}


def test_refuses_a_full_directory_and_a_full_disk(tmp_path: Path) -> None:
    from quantplug.testing.scale import DiskSpaceError

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        write_v4_checkpoint(tmp_path / "x", TINY, reserve=0)
    with pytest.raises(DiskSpaceError, match="need"):
        write_v4_checkpoint(tmp_path / "y", TINY, reserve=1 << 60)
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("hash_layers", [1, 2])
def test_decode_prefetches_the_next_layers_experts(tmp_path: Path, hash_layers: int) -> None:
    """With the routed experts served from the files, a decode step starts reading the next MoE layer's
    experts: a learned next router by its scores on this layer's input, a hash-routed next layer exactly
    the token's experts (``tid2eid``); the same requests and tokens as without prefetch."""
    from quantplug.api import stats_sources

    root = tmp_path / "ckpt"
    write_v4_checkpoint(root, {**TINY, "num_hash_layers": hash_layers}, seed=3, shard_bytes=120_000, reserve=0)
    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 60, 21]])
    runs = {}
    for prefetch in (True, False):
        model = load(root, options={"expert_cache_mb": 0.05, "expert_prefetch": prefetch}, progress=False)
        with torch.inference_mode():
            gen = model.generate(ids, 6)
        runs[prefetch] = gen, stats_sources(model)["expert_cache"].stats()
    (g_on, s_on), (g_off, s_off) = runs[True], runs[False]
    assert torch.equal(g_on, g_off)
    assert s_off["prefetched"] == 0 and s_on["prefetched"] > 0
    assert s_on["requests"] == s_off["requests"]
    if hash_layers == 2:  # layer 1 routes by token id: every expert prefetched for it is one it uses
        assert s_on["prefetch_hits"] > 0
