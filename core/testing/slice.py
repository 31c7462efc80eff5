"""Random-weight DeepSeek-V3-dimension checkpoints, streamed to disk: DeepSeek FP8 block format
(safetensors shards) and the same weights as a llama.cpp deepseek2 GGUF in Q4_0.

Nothing is built in memory: each tensor is generated in chunks of rows and written at once
(:class:`~quantplug.testing.scale.ShardWriter`), so peak memory is a few chunks whatever the
model (``bench/make_dsv3_slice.py`` measures it).

The weights (deterministic in ``seed``; every tensor has its own random stream, keyed by the
seed and the tensor's name, so a tensor's values do not depend on what is written before it,
and the GGUF file holds exactly the FP8 checkpoint's weights):

* FP8 linears: each ``weight`` byte is an FP8 E4M3 code drawn directly, never quantized from
  floats (which would cost ~10x more): one random byte per element picks the sign (bit 7) and
  one of 128 equiprobable magnitudes (bits 0-6), the half-normal quantiles at (i + 0.5) / 128
  scaled so the largest is 448 (E4M3's maximum), rounded to E4M3. So codes follow a Gaussian
  of ~155 code units cut at 2.9 sigma, and every 128 x 128 block reaches 448, as a block
  quantized with amax / 448 does. ``weight_scale_inv`` is s0 * 2**(u - 0.5) per block, u uniform
  in [0, 1), with s0 chosen so the dequantized weights have standard deviation ``std``
  (default 0.02); neighbouring blocks differ by up to 2x, so a scale applied to the wrong block
  changes results.
* BF16 tensors (embeddings, lm_head, router ``mlp.gate.weight``, MTP ``eh_proj``): Gaussian,
  standard deviation ``std``, from a 65536-entry quantile table (one random uint16 per value,
  tails cut at 4.3 sigma). Norm weights: 1.0. Router ``e_score_correction_bias``: 0 (so the
  random router alone picks experts: sigmoid scores of ~N(0, 1.7) logits). Kimi-K2's stored
  ``rotary_emb.inv_freq``: 0 (no loader reads it).
* GGUF Q4_0: each FP8 weight dequantized exactly (fp8 value * block scale, float32), each BF16
  tensor widened to float32, then quantized as gguf-py's ``gguf.quants.quantize`` does, bit for
  bit (:func:`q4_0`, a faster copy of its arithmetic; tests compare the two) (Q4_0 for
  every matrix, ``token_embd`` and ``output`` included; norms, router and its bias F32); MLA
  ``kv_b_proj`` split into ``attn_k_b`` / ``attn_v_b`` and routed experts stacked into
  ``ffn_*_exps`` as llama.cpp's converter does (``convert_hf_to_gguf.py``, ``DeepseekV2Model``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .scale import (
    BLOCK,
    ITEMSIZE,
    ShardWriter,
    StoredTensor,
    check_free_disk,
    release_tensors,
    safetensors_header,
    shard_layout,
    write_index,
)

__all__ = ["WeightSource", "SliceResult", "write_fp8_checkpoint", "write_gguf_q4_0", "fp8_plan", "gguf_plan",
           "q4_0", "q4_0_nbytes", "V4_FLASH_CONFIG", "v4_flash_slice_config", "V4Tensor", "v4_release_tensors",
           "V4WeightSource", "v4_plan", "write_v4_checkpoint"]

#: elements generated per step (bounds memory: ~5 bytes of temporaries per element)
CHUNK_ELEMS = 1 << 23
#: target bytes per safetensors shard (the hub releases use ~4.3 GB)
SHARD_BYTES = 4_300_000_000
Progress = Callable[[str, int], None]


# ---------------------------------------------------------------------------------------------
# value tables
# ---------------------------------------------------------------------------------------------

def _fp8_tables() -> tuple[np.ndarray, np.ndarray, float]:
    """(byte -> E4M3 code [256] uint8, E4M3 code -> value [256] float32, std of the codes' values)."""
    nd = statistics.NormalDist()
    z = np.array([nd.inv_cdf(0.5 + (i + 0.5) / 256) for i in range(128)])
    mags = torch.from_numpy(z * (448.0 / z[-1])).to(torch.float32).to(torch.float8_e4m3fn)
    mag_codes = mags.view(torch.uint8).numpy()
    codes = np.concatenate([mag_codes, mag_codes | 0x80]).astype(np.uint8)  # bit 7 of the random byte: sign
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    std = float(np.sqrt(np.mean(values[mag_codes].astype(np.float64) ** 2)))
    return codes, values.astype(np.float32), std


def _pair_table(byte_table: np.ndarray) -> np.ndarray:
    """uint16 -> two table lookups at once (little-endian: low byte first): half the gathers."""
    u = np.arange(65536, dtype=np.uint32)
    return (byte_table[u & 0xFF].astype(np.uint16) | (byte_table[u >> 8].astype(np.uint16) << 8)).astype(np.uint16)


def _bf16_normal_table(std: float) -> np.ndarray:
    """uint16 -> bf16 bits of std * Phi^-1((u + 0.5) / 65536)."""
    nd = statistics.NormalDist()
    z = np.array([nd.inv_cdf((u + 0.5) / 65536) for u in range(65536)]) * std
    return torch.from_numpy(z).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()


_FP8_CODES, FP8_VALUES, _CODE_STD = _fp8_tables()
_FP8_PAIRS = _pair_table(_FP8_CODES)
_NP_FLOATS = {"F32": np.float32, "F16": np.float16}
#: E[4 ** (u - 0.5)] for u uniform in [0, 1): the mean square of the per-block scale factor
_SCALE_MS = 1.5 / math.log(4.0)


class _Stream:
    """The random bytes of one tensor: SFC64 seeded from (seed, sha256(name)), read in order;
    the same bytes whatever the chunk sizes."""

    def __init__(self, seed: int, name: str) -> None:
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        self._bits = np.random.SFC64(np.random.SeedSequence([seed, key]))
        self._rest = np.empty(0, np.uint8)

    def take(self, n: int) -> np.ndarray:
        if n <= len(self._rest):
            out, self._rest = self._rest[:n], self._rest[n:]
            return out
        need = n - len(self._rest)
        fresh = self._bits.random_raw((need + 7) // 8).view(np.uint8)  # little-endian words
        out = np.concatenate([self._rest, fresh[:need]]) if len(self._rest) else fresh[:need]
        self._rest = fresh[need:].copy()
        return out


@dataclass
class WeightSource:
    """The random weights of a checkpoint (see the module docstring), tensor by tensor."""

    seed: int = 0
    std: float = 0.02
    _bf16: np.ndarray | None = field(default=None, repr=False)

    @property
    def scale_base(self) -> float:
        return self.std / (_CODE_STD * math.sqrt(_SCALE_MS))

    def _bf16_table(self) -> np.ndarray:
        if self._bf16 is None:
            self._bf16 = _bf16_normal_table(self.std)
        return self._bf16

    def kind(self, t: StoredTensor) -> str:
        if t.dtype == "F8_E4M3":
            return "fp8"
        if t.name.endswith("weight_scale_inv"):
            return "scale"
        if "norm" in t.name.rsplit(".", 2)[-2]:
            return "ones"
        if t.name.endswith(("e_score_correction_bias", "inv_freq")):
            return "zeros"
        if t.dtype == "BF16":
            return "normal"
        raise ValueError(f"{t.name}: no random content defined for {t.dtype}")

    def chunks(self, t: StoredTensor) -> Iterator[np.ndarray]:
        """The stored bytes of ``t`` (as numpy arrays of its element type), whole rows at a time."""
        rows = t.shape[0] if t.shape else 1
        cols = t.numel // max(rows, 1)
        step = max(1, CHUNK_ELEMS // max(cols, 1))
        kind = self.kind(t)
        stream = _Stream(self.seed, t.name) if kind in ("fp8", "scale", "normal") else None
        for r0 in range(0, rows, step):
            n = (min(rows, r0 + step) - r0) * cols
            if kind == "fp8":
                assert stream is not None
                raw = stream.take(n)
                yield (_FP8_PAIRS[raw.view(np.uint16)].view(np.uint8) if n % 2 == 0 else _FP8_CODES[raw])
            elif kind == "normal":
                assert stream is not None
                yield self._bf16_table()[stream.take(2 * n).view(np.uint16)]
            elif kind == "scale":
                assert stream is not None
                u = (stream.take(8 * n).view(np.uint64) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
                yield (self.scale_base * np.exp2(u - 0.5)).astype(np.float32)
            elif t.dtype == "BF16":
                yield np.full(n, 0x3F80 if kind == "ones" else 0, dtype=np.uint16)  # bf16 1.0 / 0.0
            else:
                yield np.full(n, 1.0 if kind == "ones" else 0.0, dtype=_NP_FLOATS[t.dtype])

    def tensor(self, t: StoredTensor) -> np.ndarray:
        """The whole stored tensor (small tensors only)."""
        return np.concatenate(list(self.chunks(t))).reshape(t.shape)

    def dense(self, t: StoredTensor, scale: StoredTensor | None = None) -> Iterator[np.ndarray]:
        """``t``'s values as float32 rows [r, cols], chunk by chunk: FP8 weights dequantized
        exactly (code value * block scale, one float32 rounding, as quantplug's fp8 kernel), BF16
        widened exactly."""
        if t.dtype == "F8_E4M3":
            if scale is None:
                raise ValueError(f"{t.name}: an FP8 weight needs its weight_scale_inv to be dequantized")
            out_f, in_f = t.shape
            s = self.tensor(scale)
            per_col = np.repeat(s, BLOCK[1], axis=1)[:, :in_f]  # [ceil(out/128), in]
            r0 = 0
            for codes in self.chunks(t):
                r1 = r0 + codes.size // in_f
                rows = np.arange(r0, r1) // BLOCK[0]
                yield FP8_VALUES[codes.reshape(r1 - r0, in_f)] * per_col[rows]
                r0 = r1
            return
        width = t.numel // t.shape[0] if t.shape else 1
        for c in self.chunks(t):
            if t.dtype == "BF16":
                yield (c.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(-1, width)
            else:
                yield c.astype(np.float32).reshape(-1, width)


def ahead(items: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """``items``, produced by a background thread up to ``depth`` ahead: generating the next
    chunk (numpy, GIL released) overlaps writing this one (``os.write``, GIL released), which on
    this project's 2-core machine measured 0.39 GB/s generating and 0.51 GB/s writing alone."""
    q: queue.Queue[tuple[bool, Any]] = queue.Queue(depth)
    stop = threading.Event()

    def run() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put((True, item))
            q.put((False, None))
        except BaseException as exc:  # re-raised in the consumer
            q.put((False, exc))

    th = threading.Thread(target=run, name="quantplug-slice-gen", daemon=True)
    th.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        stop.set()
        while th.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                th.join(0.01)


# ---------------------------------------------------------------------------------------------
# FP8 safetensors
# ---------------------------------------------------------------------------------------------

@dataclass
class SliceResult:
    path: Path
    files: list[Path]
    bytes_written: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes_written / max(self.seconds, 1e-9) / 1e9


def fp8_plan(cfg: Mapping[str, Any], shard_bytes: int = SHARD_BYTES) -> dict[str, list[StoredTensor]]:
    """Shard file name -> tensors, for the FP8 release layout of ``cfg``."""
    tensors = release_tensors(cfg)
    total = sum(t.nbytes for t in tensors)
    return shard_layout(tensors, max(1, math.ceil(total / shard_bytes)), by="bytes", style="hub")


def _check_empty(root: Path) -> None:
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root}: exists and is not empty; choose a new directory (nothing was written)")


def _write_layout(root: Path, cfg: Mapping[str, Any], layout: Mapping[str, Sequence[Any]], source: Any,
                  reserve: int, progress: Progress | None) -> SliceResult:
    """config.json, the shards of ``layout`` (each tensor's chunks from ``source``, the next generated on
    a second thread while this one is written) and the index, after checking free disk space."""
    need = sum(len(safetensors_header(g)) + sum(t.nbytes for t in g) for g in layout.values())
    check_free_disk(root, need, reserve)
    _check_empty(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(dict(cfg), indent=2))
    t0 = time.perf_counter()
    written = 0
    for fname, group in layout.items():
        with ShardWriter(root / fname, group) as w:
            for tensor, chunk in ahead((t, c) for t in group for c in source.chunks(t)):
                w.write(tensor.name, chunk)
                written += chunk.nbytes
                if progress is not None and w.current is not tensor:
                    progress(tensor.name, written)
    write_index(root, layout)
    return SliceResult(root, [root / f for f in layout], written, time.perf_counter() - t0)


def write_fp8_checkpoint(path: str | Path, cfg: Mapping[str, Any], source: WeightSource | None = None, *,
                         shard_bytes: int = SHARD_BYTES, reserve: int = 2 << 30,
                         progress: Progress | None = None) -> SliceResult:
    """Write ``cfg``'s FP8 release layout with random weights into the new directory ``path``:
    config.json, model.safetensors.index.json and the shards, tensor by tensor. Checks free disk
    space first (:class:`~quantplug.testing.scale.DiskSpaceError` naming the numbers)."""
    source = source or WeightSource()
    root = Path(path)
    layout = fp8_plan(cfg, shard_bytes)
    return _write_layout(root, cfg, layout, source, reserve, progress)


# ---------------------------------------------------------------------------------------------
# GGUF Q4_0
# ---------------------------------------------------------------------------------------------

_GGUF_ATTN = {"input_layernorm": "attn_norm", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_proj": "attn_q",
              "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
              "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
              "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
              "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
Q4_0_BLOCK = (32, 18)


#: 32-element blocks quantized per step of :func:`q4_0`: small enough that every pass stays in
#: cache (measured 1.6-1.8x gguf-py's quantize on [2048, 7168] float32; whole-chunk passes: 0.8x)
Q4_0_STEP_BLOCKS = 2048


def q4_0_nbytes(shape: Sequence[int]) -> int:
    """Bytes of a Q4_0 tensor: 18 per 32 elements of each row."""
    return math.prod(shape) // Q4_0_BLOCK[0] * Q4_0_BLOCK[1]


def q4_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] (n % 32 == 0) -> Q4_0 blocks uint8 [..., n / 32 * 18], bit-identical to
    gguf-py's ``gguf.quants.quantize(x, Q4_0)`` (same float32 operations in the same order:
    d = x[argmax |x|] / -8 (first maximum), q = trunc(x * (1 / d) + 8.5) clipped to 15, fp16 d,
    element j in the low nibble and j + 16 in the high nibble), in cache-sized steps."""
    b = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, Q4_0_BLOCK[0])
    out = np.empty((b.shape[0], Q4_0_BLOCK[1]), np.uint8)
    for i in range(0, b.shape[0], Q4_0_STEP_BLOCKS):
        blk, o = b[i:i + Q4_0_STEP_BLOCKS], out[i:i + Q4_0_STEP_BLOCKS]
        imax = np.abs(blk).argmax(axis=1)
        d = np.take_along_axis(blk, imax[:, None], axis=1)[:, 0] / np.float32(-8)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        q = blk * inv[:, None]
        q += np.float32(8.5)
        np.trunc(q, out=q)
        qi = q.astype(np.uint8)
        np.minimum(qi, 15, out=qi)
        o[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        np.bitwise_or(qi[:, :16], qi[:, 16:] << 4, out=o[:, 2:])
    return out.reshape(*x.shape[:-1], -1)


@dataclass
class _GGUFTensor:
    name: str
    ggml_type: str  # "Q4_0" or "F32"
    shape: tuple[int, ...]  # numpy order
    produce: Callable[[], Iterator[np.ndarray]]  # float32 rows, in order

    @property
    def nbytes(self) -> int:
        return q4_0_nbytes(self.shape) if self.ggml_type == "Q4_0" else 4 * math.prod(self.shape)

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The shape of the Q4_0 bytes: rows of 18-byte blocks."""
        return (*self.shape[:-1], self.shape[-1] // Q4_0_BLOCK[0] * Q4_0_BLOCK[1])


def gguf_plan(cfg: Mapping[str, Any], source: WeightSource | None = None) -> list[_GGUFTensor]:
    """The GGUF tensors of ``cfg`` (names, types, numpy shapes) and how each is produced."""
    source = source or WeightSource()
    stored = {t.name: t for t in release_tensors(cfg)}
    nh, nope, vd, kl = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"])

    def dense(name: str) -> Callable[[], Iterator[np.ndarray]]:
        t = stored[name]
        return lambda: source.dense(t, stored.get(name[: -len("weight")] + "weight_scale_inv"))

    def one(name: str, gguf_name: str) -> _GGUFTensor:
        t = stored[name]
        typ = "F32" if len(t.shape) == 1 or name.endswith("mlp.gate.weight") else "Q4_0"
        return _GGUFTensor(gguf_name, typ, t.shape, dense(name))

    def kv_b(layer: int, part: str) -> _GGUFTensor:
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"

        def produce() -> Iterator[np.ndarray]:
            w = np.concatenate(list(dense(name)())).reshape(nh, nope + vd, kl)
            if part == "k":  # [n_head, kv_lora, nope]
                yield np.ascontiguousarray(w[:, :nope, :].transpose(0, 2, 1)).reshape(-1, nope)
            else:  # [n_head, v, kv_lora]
                yield np.ascontiguousarray(w[:, nope:, :]).reshape(-1, kl)

        shape = (nh, kl, nope) if part == "k" else (nh, vd, kl)
        return _GGUFTensor(f"blk.{layer}.attn_{part}_b.weight", "Q4_0", shape, produce)

    def experts(layer: int, proj: str) -> _GGUFTensor:
        names = [f"model.layers.{layer}.mlp.experts.{k}.{proj}_proj.weight" for k in range(cfg["n_routed_experts"])]

        def produce() -> Iterator[np.ndarray]:
            for n in names:
                yield from dense(n)()

        return _GGUFTensor(f"blk.{layer}.ffn_{proj}_exps.weight", "Q4_0", (len(names), *stored[names[0]].shape),
                           produce)

    out = [one("model.embed_tokens.weight", "token_embd.weight")]
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}"
        for part, g in _GGUF_ATTN.items():
            if f"{b}.{part}.weight" not in stored:
                continue
            if part == "post_attention_layernorm":  # llama.cpp's order: attention, then the FFN
                out += [kv_b(i, "k"), kv_b(i, "v")]
            out.append(one(f"{b}.{part}.weight", f"blk.{i}.{g}.weight"))
            if part == "mlp.gate":
                out.append(_GGUFTensor(f"blk.{i}.exp_probs_b.bias", "F32", (cfg["n_routed_experts"],),
                                       dense(f"{b}.mlp.gate.e_score_correction_bias")))
                out += [experts(i, p) for p in ("gate", "up", "down")]
    out.append(one("model.norm.weight", "output_norm.weight"))
    out.append(one("lm_head.weight", "output.weight"))
    return out


def _gguf_metadata(w: Any, cfg: Mapping[str, Any]) -> None:
    """The deepseek2 keys llama.cpp's converter writes for an MLA model (``convert_hf_to_gguf.py``)."""
    from gguf.constants import ExpertGatingFuncType, RopeScalingType

    rope = cfg.get("rope_scaling") or {}
    w.add_name("quantplug random slice")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1)
    w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    w.add_value_length(cfg["kv_lora_rank"])
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    if rope.get("type", rope.get("rope_type")) == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def write_gguf_q4_0(path: str | Path, cfg: Mapping[str, Any], source: WeightSource | None = None, *,
                    reserve: int = 2 << 30, progress: Progress | None = None,
                    drop_cache_every: int = 1 << 30) -> SliceResult:
    """Write the same random weights as :func:`write_fp8_checkpoint` (same ``source``) as a
    llama.cpp deepseek2 GGUF in Q4_0 into the new directory ``path`` (config.json without
    ``quantization_config``, model.gguf), streaming: one chunk of rows in memory at a time."""
    from gguf import GGMLQuantizationType, GGUFWriter

    source = source or WeightSource()
    root = Path(path)
    tensors = gguf_plan(cfg, source)
    need = sum(t.nbytes + 32 for t in tensors) + (16 << 20)
    check_free_disk(root, need, reserve)
    _check_empty(root)
    root.mkdir(parents=True, exist_ok=True)
    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    (root / "config.json").write_text(json.dumps(plain, indent=2))
    file = root / "model.gguf"
    w = GGUFWriter(str(file), "deepseek2")
    _gguf_metadata(w, cfg)
    for t in tensors:
        if t.ggml_type == "F32":
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes)
        else:
            w.add_tensor_info(t.name, t.byte_shape, np.dtype(np.uint8), t.nbytes, GGMLQuantizationType[t.ggml_type])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    fh = w.fout[0]
    align = w.data_alignment
    t0 = time.perf_counter()
    written = synced = 0
    def encoded(t: _GGUFTensor) -> Iterator[np.ndarray]:
        for rows in t.produce():
            yield q4_0(rows) if t.ggml_type == "Q4_0" else np.ascontiguousarray(rows)

    for t in tensors:
        fh.write(b"\0" * (-fh.tell() % align))
        n = 0
        for data in ahead(encoded(t)):
            fh.write(memoryview(data).cast("B"))
            n += data.nbytes
        if n != t.nbytes:
            raise AssertionError(f"{t.name}: wrote {n} bytes, its tensor info says {t.nbytes}")
        fh.write(b"\0" * (-n % align))
        written += n
        if written - synced >= drop_cache_every:
            fh.flush()
            os.fdatasync(fh.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            synced = written
        if progress is not None:
            progress(t.name, written)
    fh.flush()
    os.fdatasync(fh.fileno())
    w.close()
    return SliceResult(root, [file], written, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4 release format: FP8 dense linears with E8M0 block scales, FP4 routed experts
# ---------------------------------------------------------------------------------------------

#: DeepSeek-V4-Flash's release ``config.json`` (DeepSeek-V4's inference code and release): 43 layers (0-1 sliding window only,
#: even 2-42 CSA ratio 4 with the indexer, odd 3-41 HCA ratio 128; the last ``compress_ratios`` entry is the
#: MTP block's), layers 0-2 hash-routed, FP8 dense linears with ue8m0 scales, FP4 routed experts
V4_FLASH_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)] + [0],
    "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "moe_intermediate_size": 2048, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "expert_dtype": "fp4",
}


def v4_flash_slice_config(ratios: Sequence[int] = (4, 128), hash_layers: int = 1) -> dict[str, Any]:
    """:data:`V4_FLASH_CONFIG` cut to ``len(ratios)`` decoder layers with these compression ratios, the first
    ``hash_layers`` hash-routed, no MTP block. The default, one CSA layer (ratio 4, with the indexer) and one
    HCA layer (ratio 128) with ``num_hash_layers`` 1, is Flash's layers 2 and 3 (the first CSA layer, still
    hash-routed, and the first HCA layer, with the learned router)."""
    cfg = json.loads(json.dumps(V4_FLASH_CONFIG))
    cfg.update(num_hidden_layers=len(ratios), compress_ratios=list(ratios), num_hash_layers=hash_layers,
               num_nextn_predict_layers=0)
    return cfg


#: bytes per element, with DeepSeek-V4's E8M0 scale bytes
_V4_ITEMSIZE = {**ITEMSIZE, "F8_E8M0": 1}
_V4_LAYER = re.compile(r"^layers\.(\d+)\.")
#: E2M1 magnitudes of the 3-bit code (bit 3 of a nibble is the sign)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
#: FP4 elements per E8M0 scale of a routed expert
FP4_GROUP = 32


@dataclass(frozen=True)
class V4Tensor(StoredTensor):
    """A tensor of the V4 release: :class:`StoredTensor` with ``F8_E8M0`` and the release's ``layers.N.`` names."""

    @cached_property
    def nbytes(self) -> int:
        return self.numel * _V4_ITEMSIZE[self.dtype]

    @cached_property
    def layer(self) -> int | None:
        m = _V4_LAYER.match(self.name)
        return int(m.group(1)) if m else None


def _v4_fp8(name: str, out: int, inp: int, block: Sequence[int]) -> list[V4Tensor]:
    return [V4Tensor(f"{name}.weight", "F8_E4M3", (out, inp)),
            V4Tensor(f"{name}.scale", "F8_E8M0", (-(-out // block[0]), -(-inp // block[1])))]


def _v4_fp4(name: str, out: int, inp: int) -> list[V4Tensor]:
    if inp % FP4_GROUP:
        raise ValueError(f"{name}: {inp} inputs is not a multiple of the FP4 group ({FP4_GROUP})")
    return [V4Tensor(f"{name}.weight", "I8", (out, inp // 2)), V4Tensor(f"{name}.scale", "F8_E8M0", (out, inp // FP4_GROUP))]


def v4_release_tensors(cfg: Mapping[str, Any]) -> list[V4Tensor]:
    """Every tensor of a DeepSeek-V4 release with this ``config.json`` (the release's names and dtypes, as
    docs/architectures/deepseek-v4.md tabulates them),
    in module order: ``embed``, each layer (``hc_attn_*``, ``attn_norm``, ``attn.*`` with the compressor on
    layers of ratio > 0 and the indexer on ratio 4, ``hc_ffn_*``, ``ffn_norm``, ``ffn.gate`` with ``tid2eid`` I64
    on the first ``num_hash_layers`` layers and ``bias`` F32 after, the routed experts, the shared expert),
    then ``norm``, ``hc_head_*`` and ``head``. FP8 linears: ``X.weight`` F8_E4M3 + ``X.scale`` F8_E8M0 per
    ``weight_block_size`` block; routed experts by ``expert_dtype`` (default ``fp4``: ``X.weight`` I8 [N, K/2] +
    ``X.scale`` F8_E8M0 [N, K/32]; ``fp8``: as the dense linears). No ``mtp.*`` tensors."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    nh, hd, ql = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    groups, rank = cfg["o_groups"], cfg["o_lora_rank"]
    hc = cfg.get("hc_mult", 4)
    mix = (2 + hc) * hc
    n_exp, k_act, mi = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    si = mi * cfg.get("n_shared_experts", 1)
    block = (cfg.get("quantization_config") or {}).get("weight_block_size", list(BLOCK))
    expert_dtype = cfg.get("expert_dtype") or (cfg.get("quantization_config") or {}).get("expert_dtype") or "fp4"
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype {expert_dtype!r}: expected 'fp4' or 'fp8'")

    def fp8(name: str, out: int, inp: int) -> list[V4Tensor]:
        return _v4_fp8(name, out, inp, block)

    def expert(name: str, out: int, inp: int) -> list[V4Tensor]:
        return _v4_fp4(name, out, inp) if expert_dtype == "fp4" else fp8(name, out, inp)

    def bf16(name: str, *shape: int) -> V4Tensor:
        return V4Tensor(name, "BF16", tuple(shape))

    def f32(name: str, *shape: int) -> V4Tensor:
        return V4Tensor(name, "F32", tuple(shape))

    out = [bf16("embed.weight", v, h)]
    for i in range(cfg["num_hidden_layers"]):
        b = f"layers.{i}"
        ratio = cfg["compress_ratios"][i]
        out += [f32(f"{b}.hc_attn_fn", mix, hc * h), f32(f"{b}.hc_attn_base", mix), f32(f"{b}.hc_attn_scale", 3),
                bf16(f"{b}.attn_norm.weight", h)]
        a = f"{b}.attn"
        out += [*fp8(f"{a}.wq_a", ql, h), bf16(f"{a}.q_norm.weight", ql), *fp8(f"{a}.wq_b", nh * hd, ql),
                *fp8(f"{a}.wkv", hd, h), bf16(f"{a}.kv_norm.weight", hd),
                *fp8(f"{a}.wo_a", groups * rank, nh * hd // groups), *fp8(f"{a}.wo_b", h, groups * rank),
                f32(f"{a}.attn_sink", nh)]
        if ratio:
            width = hd * (2 if ratio == 4 else 1)  # CSA's overlapping windows: two halves
            c = f"{a}.compressor"
            out += [bf16(f"{c}.wkv.weight", width, h), bf16(f"{c}.wgate.weight", width, h),
                    f32(f"{c}.ape", ratio, width), bf16(f"{c}.norm.weight", hd)]
            if ratio == 4:
                ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
                x = f"{a}.indexer"
                out += [*fp8(f"{x}.wq_b", ih * idim, ql), bf16(f"{x}.weights_proj.weight", ih, h),
                        bf16(f"{x}.compressor.wkv.weight", 2 * idim, h),
                        bf16(f"{x}.compressor.wgate.weight", 2 * idim, h),
                        f32(f"{x}.compressor.ape", 4, 2 * idim), bf16(f"{x}.compressor.norm.weight", idim)]
        out += [f32(f"{b}.hc_ffn_fn", mix, hc * h), f32(f"{b}.hc_ffn_base", mix), f32(f"{b}.hc_ffn_scale", 3),
                bf16(f"{b}.ffn_norm.weight", h)]
        f = f"{b}.ffn"
        out.append(bf16(f"{f}.gate.weight", n_exp, h))
        out.append(V4Tensor(f"{f}.gate.tid2eid", "I64", (v, k_act)) if i < cfg.get("num_hash_layers", 0)
                   else f32(f"{f}.gate.bias", n_exp))
        for e in range(n_exp):
            out += [*expert(f"{f}.experts.{e}.w1", mi, h), *expert(f"{f}.experts.{e}.w3", mi, h),
                    *expert(f"{f}.experts.{e}.w2", h, mi)]
        out += [*fp8(f"{f}.shared_experts.w1", si, h), *fp8(f"{f}.shared_experts.w3", si, h),
                *fp8(f"{f}.shared_experts.w2", h, si)]
    out += [bf16("norm.weight", h), f32("hc_head_fn", hc, hc * h), f32("hc_head_base", hc), f32("hc_head_scale", 1),
            bf16("head.weight", v, h)]
    return out


def _normal_f32() -> np.ndarray:
    """uint16 -> Phi^-1((u + 0.5) / 65536) as float32 (a standard normal cut at 4.3 sigma)."""
    nd = statistics.NormalDist()
    return np.array([nd.inv_cdf((u + 0.5) / 65536) for u in range(65536)], np.float32)


#: E[4 ** b] for b uniform in {0, 1}: the mean square of a scale whose exponent is base or base + 1
_EXP_MS = 2.5
#: root mean square of an FP4 E2M1 value from a uniformly random nibble
_E2M1_RMS = float(np.sqrt(np.mean(E2M1_VALUES.astype(np.float64) ** 2)))


@dataclass
class V4WeightSource:
    """The random weights of a DeepSeek-V4 release-format checkpoint, tensor by tensor, deterministic in
    ``seed`` (each tensor its own stream, keyed by the seed and its name, as :class:`WeightSource`).

    Scaled so a forward stays finite and tokens vary: every linear's weights have standard deviation
    1 / sqrt(in) (so each projection of a unit-RMS input is ~unit RMS; the head's logits ~N(0, 1)).

    * FP8 ``X.weight``: random E4M3 codes (:class:`WeightSource`'s Gaussian code table, every block reaching
      448); ``X.scale`` E8M0 bytes ``127 + b + u``, u a random bit per block, b chosen so the dequantized
      weights' standard deviation is ~1 / sqrt(in) (neighbouring blocks differ by 2x, so a scale applied to the
      wrong block shows).
    * FP4 experts: ``X.weight`` random bytes (two uniformly random E2M1 codes each), ``X.scale`` E8M0 per 32
      inputs chosen the same way.
    * BF16: norms 1.0; ``embed`` N(0, 1); the other matrices (``head``, router ``gate.weight``, compressors,
      ``indexer.weights_proj``) N(0, 1 / in).
    * F32: ``hc_*_fn`` N(0, 1 / in) (the mix of a unit-RMS state ~N(0, 1)), ``hc_*_base`` and ``hc_*_scale``
      N(0, 0.25), ``attn_sink`` and the compressors' ``ape`` N(0, 1), router ``gate.bias`` 0 (the random
      router alone picks experts).
    * I64 ``gate.tid2eid``: per token ``num_experts_per_tok`` distinct experts, uniformly random.

    ``tensors``: the checkpoint's inventory (:func:`v4_release_tensors`), which a ``.scale`` needs to find
    its weight's input width."""

    tensors: Mapping[str, StoredTensor]
    seed: int = 0
    _tables: dict[float, np.ndarray] = field(default_factory=dict, repr=False)
    _normal: np.ndarray | None = field(default=None, repr=False)

    def _norm_table(self) -> np.ndarray:
        if self._normal is None:
            self._normal = _normal_f32()
        return self._normal

    def _bf16_table(self, std: float) -> np.ndarray:
        if std not in self._tables:
            t = torch.from_numpy(self._norm_table() * np.float32(std)).to(torch.bfloat16)
            self._tables[std] = t.view(torch.int16).numpy().view(np.uint16).copy()
        return self._tables[std]

    def in_features(self, weight: StoredTensor) -> int:
        """The input width of a stored linear weight (an I8 FP4 row packs two inputs per byte)."""
        return weight.shape[1] * (2 if weight.dtype == "I8" else 1)

    def scale_base(self, weight: StoredTensor) -> int:
        """The E8M0 exponent byte b (a block's byte is b or b + 1) that gives ``weight`` std ~1 / sqrt(in)."""
        rms = _E2M1_RMS if weight.dtype == "I8" else _CODE_STD
        std = 1.0 / math.sqrt(self.in_features(weight))
        return 127 + round(math.log2(std / (rms * math.sqrt(_EXP_MS))))

    def kind(self, t: StoredTensor) -> str:
        n = t.name
        if t.dtype == "F8_E4M3":
            return "fp8"
        if t.dtype == "I8":
            return "bytes"
        if t.dtype == "F8_E8M0":
            return "scale"
        if t.dtype == "I64":
            return "tid2eid"
        if n.endswith("norm.weight"):
            return "ones"
        if n.endswith("gate.bias"):
            return "zeros"
        if t.dtype in ("BF16", "F32"):
            return "normal"
        raise ValueError(f"{n}: no random content defined for {t.dtype}")

    def std(self, t: StoredTensor) -> float:
        """The standard deviation of a BF16 / F32 tensor drawn from a normal."""
        n = t.name
        if n == "embed.weight" or n.endswith(("attn_sink", "ape")):
            return 1.0
        if n.endswith(("_base", "_scale")):
            return 0.5
        return 1.0 / math.sqrt(t.shape[-1])

    def chunks(self, t: StoredTensor) -> Iterator[np.ndarray]:
        """The stored bytes of ``t`` (numpy arrays of its element type), whole rows at a time."""
        rows = t.shape[0] if t.shape else 1
        cols = t.numel // max(rows, 1)
        kind = self.kind(t)
        n_exp = self._n_experts(t) if kind == "tid2eid" else 0
        step = max(1, CHUNK_ELEMS // max(n_exp or cols, 1))  # tid2eid draws a key per expert and token
        stream = _Stream(self.seed, t.name)
        base = self.scale_base(self.tensors[t.name[: -len("scale")] + "weight"]) if kind == "scale" else 0
        std = self.std(t) if kind == "normal" else 0.0
        for r0 in range(0, rows, step):
            r = min(rows, r0 + step) - r0
            n = r * cols
            if kind == "fp8":
                raw = stream.take(n)
                yield (_FP8_PAIRS[raw.view(np.uint16)].view(np.uint8) if n % 2 == 0 else _FP8_CODES[raw])
            elif kind == "bytes":
                yield stream.take(n)
            elif kind == "scale":
                yield (base + (stream.take(n) & 1)).astype(np.uint8)
            elif kind == "tid2eid":
                keys = stream.take(2 * r * n_exp).view(np.uint16).reshape(r, n_exp)
                yield np.argsort(keys, axis=1, kind="stable")[:, :cols].astype(np.int64)
            elif kind == "normal" and t.dtype == "BF16":
                yield self._bf16_table(std)[stream.take(2 * n).view(np.uint16)]
            elif kind == "normal":
                yield self._norm_table()[stream.take(2 * n).view(np.uint16)] * np.float32(std)
            elif t.dtype == "BF16":
                yield np.full(n, 0x3F80 if kind == "ones" else 0, dtype=np.uint16)  # bf16 1.0 / 0.0
            else:
                yield np.full(n, 1.0 if kind == "ones" else 0.0, dtype=np.float32)

    def _n_experts(self, t: StoredTensor) -> int:
        gate = self.tensors[t.name[: -len("tid2eid")] + "weight"]
        return gate.shape[0]

    def tensor(self, t: StoredTensor) -> np.ndarray:
        """The whole stored tensor (small tensors only)."""
        return np.concatenate([c.reshape(-1) for c in self.chunks(t)]).reshape(t.shape)


def v4_plan(cfg: Mapping[str, Any], shard_bytes: int = SHARD_BYTES) -> dict[str, list[StoredTensor]]:
    """Shard file name -> tensors of ``cfg``'s V4 release layout: hub-style names
    (``model-00001-of-000003.safetensors``), equal byte shares of about ``shard_bytes``."""
    tensors: list[StoredTensor] = list(v4_release_tensors(cfg))
    total = sum(t.nbytes for t in tensors)
    return shard_layout(tensors, max(1, math.ceil(total / shard_bytes)), by="bytes", style="hub")


def write_v4_checkpoint(path: str | Path, cfg: Mapping[str, Any], *, seed: int = 0,
                        shard_bytes: int = SHARD_BYTES, reserve: int = 2 << 30,
                        progress: Progress | None = None) -> SliceResult:
    """Write ``cfg``'s DeepSeek-V4 release layout (:func:`v4_release_tensors`) with random weights
    (:class:`V4WeightSource`) into the new directory ``path``: config.json, model.safetensors.index.json and
    the shards, streamed chunk by chunk (the next chunk generated on a second thread while this one is
    written; written pages dropped from the page cache every GiB). Checks free disk space first
    (:class:`~quantplug.testing.scale.DiskSpaceError` naming the numbers)."""
    root = Path(path)
    layout = v4_plan(cfg, shard_bytes)
    source = V4WeightSource({t.name: t for g in layout.values() for t in g}, seed)
    return _write_layout(root, cfg, layout, source, reserve, progress)
