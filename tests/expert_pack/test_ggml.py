"""ggml dequant kernels against gguf-py's numpy dequantize, bit for bit; the GGUF header reader
against gguf-py's GGUFReader."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from quantplug.checkpoint.gguf_index import SkippedArray, read_gguf_header
from quantplug.errors import CheckpointError, QuantplugError
from quantplug.models.config import parse_model_config
from quantplug.testing import random_state, tiny_config
from quantplug.kernels import ggml
from quantplug_expert_pack.export import gguf_state, write_gguf
from quantplug_expert_pack.testing import random_blocks


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("ggml_type", sorted(ggml.BLOCKS))
@pytest.mark.parametrize("scale", [1e-3, 1.0])
def test_kernel_bit_exact_on_random_valid_blocks(ggml_type, scale):
    rng = np.random.default_rng(zlib.crc32(f"{ggml_type}/{scale}".encode()))
    blocks = random_blocks(ggml_type, 3000, rng, scale).reshape(30, -1)  # 30 rows of 100 blocks
    ref = gguf_dequantize(blocks, GGMLQuantizationType[ggml_type])
    got = ggml.dequantize(torch.from_numpy(blocks), ggml_type).numpy()
    assert got.shape == ref.shape
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(_bits(got), _bits(ref))


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"])
def test_kernel_bit_exact_on_gguf_py_quantized_weights(ggml_type):
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32) * 0.02
    q = gguf_quantize(x, GGMLQuantizationType[ggml_type])
    ref = gguf_dequantize(q, GGMLQuantizationType[ggml_type])
    got = ggml.dequantize(torch.from_numpy(q), ggml_type).numpy()
    np.testing.assert_array_equal(_bits(got), _bits(ref))
    assert np.abs(got - x).max() < 0.25 * np.abs(x).max()  # and it is a real reconstruction of x


def test_kernel_handles_stacked_leading_dims_and_chunking():
    rng = np.random.default_rng(2)
    blocks = random_blocks("Q4_K", 4 * 6 * 2, rng).reshape(4, 6, 2 * 144)  # [E, rows, row_bytes]
    ref = gguf_dequantize(blocks, GGMLQuantizationType.Q4_K)
    got = ggml.dequantize(torch.from_numpy(blocks), "Q4_K", chunk_blocks=5)
    assert tuple(got.shape) == (4, 6, 512)
    np.testing.assert_array_equal(_bits(got.numpy()), _bits(ref))


def test_kernel_rejects_bad_input():
    with pytest.raises(QuantplugError, match="Q4_0: 17 bytes per row"):
        ggml.dequantize(torch.zeros(2, 17, dtype=torch.uint8), "Q4_0")
    with pytest.raises(QuantplugError, match="Q8_K has no dequantize kernel"):
        ggml.dequantize(torch.zeros(2, 292, dtype=torch.uint8), "Q8_K")


def _tiny_gguf(tmp_path, vocab=300):
    cfg = tiny_config()
    mc = parse_model_config(cfg, "DeepseekV3ForCausalLM", False)
    path = tmp_path / "model.gguf"
    write_gguf(path, gguf_state(random_state(cfg), mc), mc, default_type="Q8_0", vocab=vocab)
    return path


def test_header_reader_matches_gguf_reader(tmp_path):
    path = _tiny_gguf(tmp_path)
    header = read_gguf_header(path)
    reader = GGUFReader(path)
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.dtype == theirs.tensor_type.name
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape.tolist()))
        assert ours.offset == int(theirs.data_offset)
        assert ours.nbytes == int(theirs.n_bytes)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key.startswith("tokenizer.") and isinstance(header.metadata[key], SkippedArray):
            assert header.metadata[key].count == len(field.data)  # walked over, not decoded
            continue
        value = field.contents()
        assert header.metadata[key] == pytest.approx(value) if isinstance(value, float) else header.metadata[key] == value


def test_header_reader_errors_name_the_file(tmp_path):
    path = _tiny_gguf(tmp_path)
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(CheckpointError, match=r"bad\.gguf: not a GGUF file"):
        read_gguf_header(bad)
    bad.write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(CheckpointError, match=r"bad\.gguf: truncated GGUF header"):
        read_gguf_header(bad)
    bad.write_bytes(data[: len(data) - 1000])  # header intact, last tensor's bytes cut
    with pytest.raises(CheckpointError, match=r"bad\.gguf: tensor .* past the end of the file"):
        read_gguf_header(bad)
