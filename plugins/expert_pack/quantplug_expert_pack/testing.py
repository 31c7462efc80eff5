"""Helpers for tests, benchmarks and vendor test kits: random valid ggml blocks, reference weights.

``random_blocks`` fills every byte at random, then overwrites the float fields (f16 ``d`` /
``dmin`` / ``m``, the MXFP4 exponent, IQ1_M's ``d`` spread over its scales) with finite values of a chosen magnitude, so the blocks
decode to finite numbers in both gguf-py and quantplug. ``reference_state`` dequantizes a GGUF
with gguf-py alone (no quantplug code), giving transformers-ready weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from quantplug.api import ggml

BLOCKS = ggml.BLOCKS

#: byte offsets of the f16 fields of each block type
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "MXFP4": (),
    "IQ1_S": (0,), "IQ1_M": (), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}


def random_blocks(ggml_type: str, n_blocks: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """``n_blocks`` random valid blocks of ``ggml_type`` as uint8 [n_blocks, bytes_per_block]."""
    _, size = BLOCKS[ggml_type]
    b = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in F16_FIELDS[ggml_type]:
        d = (scale * rng.standard_normal(n_blocks)).astype(np.float16)
        b[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    if ggml_type == "MXFP4":  # e8m0 around 2^0 * scale
        e = int(np.clip(round(np.log2(scale)) + 127, 2, 250)) if scale > 0 else 127
        b[:, 0] = rng.integers(e - 4, e + 2, n_blocks, dtype=np.uint8)
    if ggml_type == "IQ1_M":  # d's f16 bits live in the top nibbles of the four u16 scales
        bits = (scale * rng.standard_normal(n_blocks)).astype(np.float16).view(np.uint16)
        sc = b[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        b[:, 48:56] = sc.view(np.uint8)
    return b


def random_rows(ggml_type: str, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random valid blocks for a tensor of logical ``shape`` [..., row_len] as [..., row_bytes]."""
    block, size = BLOCKS[ggml_type]
    rows = int(np.prod(shape[:-1]))
    blocks = random_blocks(ggml_type, rows * shape[-1] // block, rng, scale)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def reference_state(directory: str | Path, model_config: Any) -> dict[str, torch.Tensor]:
    """Weights of every GGUF in ``directory`` dequantized by gguf-py, under Hugging Face hub names
    (kv_b rebuilt from attn_k_b / attn_v_b, experts per expert): input for transformers."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from .export import join_kv_b
    from .names import model_to_gguf

    inv = {v: k for k, v in model_to_gguf(model_config).items()}
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.gguf")):
        for rt in GGUFReader(file).tensors:
            shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
            state[inv[rt.name]] = torch.from_numpy(np.array(dequantize(rt.data, rt.tensor_type))).float().reshape(shape)
    for k in [k for k in state if k.endswith(".k_b_proj.weight")]:
        base = k[: -len(".k_b_proj.weight")]
        state[f"{base}.kv_b_proj.weight"] = join_kv_b(state.pop(k), state.pop(f"{base}.v_b_proj.weight"))
    for k in [k for k in state if ".mlp.experts." in k and not k.split(".mlp.experts.")[1][0].isdigit()]:
        t: torch.Tensor = state.pop(k)
        base, proj, _ = k.rsplit(".", 2)
        for e in range(t.shape[0]):
            state[f"{base}.{e}.{proj}.weight"] = t[e]
    return state


def rewrite_gguf(src: str | Path, dst: str | Path, add: Callable[[Any], None]) -> None:
    """A copy of the GGUF ``src`` at ``dst`` with more metadata: every key of ``src`` (gguf-py's
    own ``GGUF.*`` / architecture keys excepted: the writer makes them), then ``add(writer)``
    (a ``gguf.GGUFWriter``) adds its own, then every tensor as stored."""
    from gguf import GGUFReader, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))  # deepseek2 / deepseek32
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    add(w)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
