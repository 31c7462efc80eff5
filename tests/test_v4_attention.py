"""DeepSeek-V4 attention block (core/blocks/v4_attention.py) against transformers' DeepseekV4Attention:
random float32 weights in both, one tiny config whose 48-token prompt crosses several sliding
windows and compression windows, and whose indexer keeps fewer entries than most queries see."""

from __future__ import annotations

import pytest
import torch
from quantplug.blocks.v4_attention import V4Attention, V4AttentionCache, V4AttentionConfig
from quantplug.contract.scheme import PlannedModule
from quantplug.layers.linear import DenseScheme

tfv4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

HCA_RATIO = 8
RAW = {
    "hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 24,
    "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8, "index_n_heads": 4, "index_head_dim": 16,
    "index_topk": 3, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    # the release's ratios (0 SWA, 4 CSA, other HCA), HCA scaled down to 8
    "compress_ratios": [0, 4, HCA_RATIO],
}
T = 48
#: release name (under layers.L.attn) -> transformers name (under the DeepseekV4Attention)
NAMES = {
    "wq_a.weight": "q_a_proj.weight", "q_norm.weight": "q_a_norm.weight", "wq_b.weight": "q_b_proj.weight",
    "wkv.weight": "kv_proj.weight", "kv_norm.weight": "kv_norm.weight", "wo_a.weight": "o_a_proj.weight",
    "wo_b.weight": "o_b_proj.weight", "attn_sink": "sinks",
}
COMP = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias",
        "norm.weight": "kv_norm.weight"}
for _k, _v in COMP.items():
    NAMES[f"compressor.{_k}"] = f"compressor.{_v}"
    NAMES[f"indexer.compressor.{_k}"] = f"compressor.indexer.{_v}"
NAMES["indexer.wq_b.weight"] = "compressor.indexer.q_b_proj.weight"
NAMES["indexer.weights_proj.weight"] = "compressor.indexer.scorer.weights_proj.weight"


class Oracle:
    """The plan's answers for a float32 model of dense linears, names as given."""

    prefix = ""
    model_dtype = torch.float32
    mtp_layers = 0

    def ck(self, rel: str) -> str:
        return rel

    def scheme(self, ckpt_name: str, kind: str = "linear", shards: object = None) -> DenseScheme:
        return DenseScheme()


def hf_config() -> DeepseekV4Config:
    raw = dict(RAW)
    cfg = DeepseekV4Config(
        vocab_size=32, num_hidden_layers=3, hidden_size=raw["hidden_size"],
        num_attention_heads=raw["num_attention_heads"], num_key_value_heads=1, head_dim=raw["head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"], q_lora_rank=raw["q_lora_rank"], o_groups=raw["o_groups"],
        o_lora_rank=raw["o_lora_rank"], sliding_window=raw["sliding_window"], index_n_heads=raw["index_n_heads"],
        index_head_dim=raw["index_head_dim"], index_topk=raw["index_topk"], rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=raw["rope_theta"], compress_rope_theta=raw["compress_rope_theta"],
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        compress_ratios=[0, 4, 128],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": HCA_RATIO},
    )
    cfg._attn_implementation = "eager"
    return cfg


def build(layer: int, seed: int = 0, dtype: torch.dtype = torch.float32,
          ) -> tuple[torch.nn.Module, V4Attention, DeepseekV4Config]:
    """transformers' attention of ``layer`` with random weights, and ours with the same weights
    (held as a model of ``dtype`` holds them: float32 where the block keeps float32)."""
    cfg = hf_config()
    ref = tfv4.DeepseekV4Attention(cfg, layer).float().eval()
    g = torch.Generator().manual_seed(seed + layer)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "position_bias")):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    base = f"layers.{layer}.attn"
    oracle = Oracle()
    oracle.model_dtype = dtype
    ours = V4Attention(V4AttentionConfig.from_hf(RAW, layer), base, oracle)
    tensors = {f"{base}.{rel}": params[tf] for rel, tf in NAMES.items() if tf in params}
    used = set()
    for mod in ours.modules():
        if isinstance(mod, PlannedModule):
            for local, sources in mod.qp_sources.items():
                name = sources[0].tensor
                assert tuple(sources[0].shape) == tuple(tensors[name].shape), name
                held = tensors[name].detach().to(mod.qp_target_dtype(local, "F32", dtype))
                mod.register_parameter(local, torch.nn.Parameter(held, requires_grad=False))
                used.add(name)
    assert used == set(tensors), set(tensors) ^ used
    assert len(used) == len(params), "a transformers parameter has no release name here"
    return ref, ours.eval(), cfg


def reference(ref: torch.nn.Module, cfg: DeepseekV4Config, x: torch.Tensor) -> torch.Tensor:
    """transformers' output as DeepseekV4Model.forward feeds the layer: position embeddings of both
    rope types, the sliding-window causal mask."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    pos = torch.arange(x.shape[1]).unsqueeze(0)
    rot = tfv4.DeepseekV4RotaryEmbedding(cfg)
    pe = {"main": rot(x, position_ids=pos, layer_type="main"), "compress": rot(x, position_ids=pos, layer_type="compress")}
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
                                             position_ids=pos)
    return ref(x, position_embeddings=pe, position_ids=pos, attention_mask=mask)[0]


def prompt(seed: int = 7, t: int = T) -> torch.Tensor:
    return torch.randn(2, t, RAW["hidden_size"], generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("t", [T, T - 2, 5])
@pytest.mark.parametrize("layer,kind", [(0, "swa"), (1, "csa"), (2, "hca")])
def test_prompt_matches_transformers(layer: int, kind: str, t: int) -> None:
    """Prompts ending on a window boundary, inside one (its tokens pend), and shorter than any."""
    ref, ours, cfg = build(layer)
    assert ours.cfg.kind == kind
    x = prompt(t=t)
    with torch.no_grad():
        want, got = reference(ref, cfg, x), ours(x)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * max(1.0, want.abs().max().item()), err


def test_csa_indexer_drops_entries() -> None:
    """The CSA case is a real selection: later queries see more entries than index_topk, keep
    exactly index_topk of them, and never a future entry."""
    _, ours, _ = build(1)
    x = prompt()
    ix = ours.indexer
    assert ix is not None
    seen = {}

    def hook(_m: torch.nn.Module, _a: object, out: torch.Tensor) -> None:
        seen["keep"] = out

    ix.register_forward_hook(hook)
    with torch.no_grad():
        ours(x)
    keep = seen["keep"]                       # [b, t, n]
    visible = (torch.arange(keep.shape[-1]) < ((torch.arange(T) + 1) // 4)[:, None])
    assert int(visible[-1].sum()) > RAW["index_topk"]
    assert bool((keep.sum(-1)[:, -1] == RAW["index_topk"]).all())
    assert bool((keep & ~visible).sum() == 0)


#: chunk sizes of a cached run over the T-token prompt: a prefill that ends inside a sliding
#: window and a compression window, single decode steps across window / compression boundaries
#: (new CSA and HCA entries appear during decode), a multi-token chunk, then steps to the end
CHUNKS = [13, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 9] + [1] * (T - 39)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_cached_decode_equals_recompute(layer: int) -> None:
    assert sum(CHUNKS) == T
    _, ours, _ = build(layer)
    x = prompt()
    cache = V4AttentionCache()
    outs = []
    with torch.no_grad():
        full = ours(x)
        at = 0
        for n in CHUNKS:
            outs.append(ours(x[:, at:at + n], cache))
            at += n
    got = torch.cat(outs, dim=1)
    assert cache.length == T
    assert cache.window is not None and cache.window.shape[1] == RAW["sliding_window"] - 1
    if ours.compressor is not None:
        assert cache.compressor.count == T // ours.cfg.compress_ratio
    if ours.indexer is not None:
        assert cache.indexer.count == T // 4
    err = (got - full).abs().max().item()
    assert err <= 1e-5 * max(1.0, full.abs().max().item()), err


def window_mask(past: int, n: int, b: int) -> torch.Tensor:
    """The additive sliding-window mask of n queries after ``past`` tokens over transformers'
    cached keys (its last W - 1 rows, then the n new ones). Built here: the model's own mask
    sizes itself from layer 0's cache, which a lone layer > 0 does not advance."""
    w = RAW["sliding_window"]
    kv_len = min(past, w - 1) + n
    kpos = torch.arange(past + n - kv_len, past + n)
    p = torch.arange(past, past + n)[:, None]
    ok = (kpos <= p) & (kpos > p - w)
    return torch.zeros(b, 1, n, kv_len).masked_fill(~ok, float("-inf"))


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_cached_decode_matches_transformers_cache(layer: int) -> None:
    """The same chunked run through transformers' DynamicCache (DeepseekV4CSACache /
    DeepseekV4HCACache: buffered windows, overlap state, indexer keys) and through ours."""
    from transformers.cache_utils import DynamicCache

    ref, ours, cfg = build(layer)
    x = prompt()
    tf_cache, cache = DynamicCache(config=cfg), V4AttentionCache()
    rot = tfv4.DeepseekV4RotaryEmbedding(cfg)
    want, got = [], []
    with torch.no_grad():
        at = 0
        for n in CHUNKS:
            xs, pos = x[:, at:at + n], torch.arange(at, at + n).unsqueeze(0)
            pe = {k: rot(xs, position_ids=pos, layer_type=k) for k in ("main", "compress")}
            want.append(ref(xs, position_embeddings=pe, position_ids=pos, attention_mask=window_mask(at, n, x.shape[0]),
                            cache=tf_cache)[0])
            got.append(ours(xs, cache))
            at += n
    w, g = torch.cat(want, dim=1), torch.cat(got, dim=1)
    err = (g - w).abs().max().item()
    assert err <= 1e-5 * max(1.0, w.abs().max().item()), err


class ActivationScheme(DenseScheme):
    """Dense storage, but said not to be weight-only (as a scheme quantizing activations): the
    grouped ``wo_a`` then runs the whole linear per group and keeps each group's block."""

    weight_only = False


def test_grouped_wo_a_without_dequantize() -> None:
    ref, ours, cfg = build(2)
    ours.wo_a.scheme = ActivationScheme()
    x = prompt()
    with torch.no_grad():
        want, got = reference(ref, cfg, x), ours(x)
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * max(1.0, want.abs().max().item()), err


def test_release_rope_frequencies() -> None:
    """Flash's compressed-layer rope (E3): base 160000, YaRN over the 64 rope dims with ramp
    lo = 15, hi = 25, factor 16; sliding layers plain base 10000."""
    raw = {**RAW, "hidden_size": 4096, "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
           "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
           "compress_ratios": [0, 0, 4, 128], "rope_scaling": {"type": "yarn", "factor": 16,
                                                             "original_max_position_embeddings": 65536,
                                                             "beta_fast": 32, "beta_slow": 1}}
    from quantplug.blocks.v4_compressor import V4Rope

    kinds = [V4AttentionConfig.from_hf(raw, i).kind for i in range(4)]
    assert kinds == ["swa", "swa", "csa", "hca"]
    cfg = V4AttentionConfig.from_hf(raw, 3)
    i = torch.arange(32, dtype=torch.float64)
    theta = 160000.0 ** (-2 * i / 64)
    rho = ((i - 15) / (25 - 15)).clamp(0, 1)
    want = theta * (1 - rho) + theta / 16 * rho
    got = V4Rope(cfg.compress_rope, 64).inv_freq.double()
    assert torch.allclose(got, want, rtol=1e-6)
    plain = V4Rope(cfg.rope, 64).inv_freq.double()
    assert torch.allclose(plain, 10000.0 ** (-2 * i / 64), rtol=1e-6)


def test_bfloat16_close_to_float32() -> None:
    """A bf16 model (float32 sink, ape, indexer weights) runs every layer kind, prompt and cached,
    and stays near the float32 result."""
    for layer in (0, 1, 2):
        _, ours, _ = build(layer)
        _, half, _ = build(layer, dtype=torch.bfloat16)
        assert half.attn_sink.weight.dtype == torch.float32 and half.wq_a.weight.dtype == torch.bfloat16
        x = prompt()
        with torch.no_grad():
            want = ours(x)
            ours = half
            got = ours(x.bfloat16())
            cache = V4AttentionCache()
            stepped = torch.cat([ours(x[:, i:i + 1].bfloat16(), cache) for i in range(T)], dim=1)
        assert got.dtype == torch.bfloat16
        scale = want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= 0.05 * scale
        assert (stepped.float() - want).abs().max().item() <= 0.05 * scale


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_query_blocks(layer: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt is attended (and indexed) a block of queries at a time: with tiny byte budgets
    (blocks of 6 to 15 queries, not aligned to windows) the prompt still equals transformers and
    a chunked cached run still equals the prompt."""
    import quantplug.blocks.v4_attention as va
    import quantplug.blocks.v4_compressor as vc

    ref, ours, cfg = build(layer)
    x = prompt()
    with torch.no_grad():
        want = reference(ref, cfg, x)
        monkeypatch.setattr(va, "ATTN_SCORE_BYTES", 4000)
        monkeypatch.setattr(vc, "INDEX_SCORE_BYTES", 4000)
        got = ours(x)
        cache = V4AttentionCache()
        chunked = torch.cat([ours(x[:, i:i + 20], cache) for i in range(0, T, 20)], dim=1)
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= 1e-5 * scale
    assert (chunked - want).abs().max().item() <= 1e-5 * scale


def test_csa_topk_boundary_untied() -> None:
    """The test config's indexer scores leave a margin between each query's index_topk-th and next
    visible entry (ReLU makes exact ties possible; E4), so the matches above do not hang on rounding."""
    _, ours, _ = build(1)
    ix = ours.indexer
    assert ix is not None
    x, k = prompt(), RAW["index_topk"]
    with torch.no_grad():
        qr = ours.q_norm(ours.wq_a(x))
        keys = ix.compressor(x)
        pos = torch.arange(T)
        cos, sin = ix.rope[0].cos_sin(pos)
        q = ix.rope[0].rotate(ix.wq_b(qr).view(2, T, ix.n_heads, ix.head_dim).transpose(1, 2), cos, sin).float()
        w = ix.weights_proj(x) * ix.n_heads ** -0.5
        scores = (torch.relu(q @ keys.float().transpose(-1, -2).unsqueeze(1)) * ix.head_dim ** -0.5
                  * w.transpose(1, 2).unsqueeze(-1)).sum(1)                 # [b, t, n]
    visible = torch.arange(keys.shape[1]) < ((pos + 1) // 4)[:, None]
    gaps = [(v[k - 1] - v[k]).item() for bi in range(2) for p in range(T)
            if (v := scores[bi, p][visible[p]].sort(descending=True).values).numel() > k]
    assert len(gaps) > 40 and min(gaps) > 1e-4, min(gaps)
