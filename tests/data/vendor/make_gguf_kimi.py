"""Make the Kimi-Linear / Kimi-K3 GGUF fixtures with llama.cpp's own converter and quantizer (not
run by the tests).

    python tests/data/vendor/make_gguf_kimi.py --llama-cpp LLAMA_CPP_DIR --lcpp-python LCPP/bin/python \\
        --work /tmp/kwork --out tests/data/vendor

``LLAMA_CPP_DIR`` is the llama.cpp tree vendored in the ``llama-cpp-python`` 0.3.36 source
distribution (its ``convert_hf_to_gguf.py`` machinery: ``conversion/kimi_linear.py``,
``conversion/kimi_k3.py`` and its own ``gguf-py``); ``LCPP`` a virtualenv with that
llama-cpp-python built from source (for ``llama_model_quantize``). Steps:

1. tiny Kimi-Linear and Kimi-K3 checkpoints under the release names (``tests/expert_pack/kimi_tiny.py``,
   float32 safetensors; K3 once dense and once with its routed experts in compressed-tensors
   MXFP4, the release's format);
2. llama.cpp's converter on each (``ModelBase`` subclass from ``conversion.get_model_class``, run
   unchanged in a subprocess with the tree's gguf-py first on ``sys.path``), only the vocabulary
   replaced: ``set_vocab`` writes a 320-token byte-level BPE (the tiny models have no tokenizer;
   the tensor and metadata code paths are the converter's own);
3. llama.cpp's quantizer (``llama_model_quantize``) on the converted files.

Fixtures (``<name>/model.gguf`` + ``config.json``):

- ``gguf_kimi_linear_f32``: converter ``--outtype f32``;
- ``gguf_kimi_linear_q8_0``: converter ``--outtype q8_0`` (conv, norms, 1-D tensors stay F32);
- ``gguf_kimi_linear_q4_k_m``: ``llama_model_quantize`` Q4_K_M of the F32 file (K-quants on the
  256-wide rows, legacy fallbacks on the others, llama.cpp's choices);
- ``gguf_kimi_k3_f32``: converter ``--outtype f32`` of the dense K3;
- ``gguf_kimi_k3_mxfp4_moe``: the converter on the MXFP4 K3 (``ffn_*_exps`` repacked to ggml
  MXFP4, the rest F32), then ``llama_model_quantize`` MXFP4_MOE (3-D tensors MXFP4, which for
  llama.cpp includes the MLA ``attn_k_b`` / ``attn_v_b`` stacks; the rest Q8_0 where rows allow).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "expert_pack"))  # kimi_tiny
sys.path.insert(0, str(HERE))  # make_gguf_iq (vocabulary)

#: the subprocess that runs llama.cpp's converter (argv: llama.cpp dir, model dir, out file, outtype)
CONVERT = r'''
import sys
from pathlib import Path
lcpp, src, out, outtype, vocab_dir = sys.argv[1:6]
sys.path.insert(0, str(Path(lcpp) / "gguf-py"))
sys.path.insert(0, lcpp)
sys.path.insert(0, vocab_dir)
import torch
import gguf
from conversion import ModelBase, get_model_architecture, get_model_class, ModelType
from make_gguf_iq import CALIBRATION, SPECIALS, byte_level_vocab

def set_vocab(self):
    vocab = self.hparams["vocab_size"]
    tokens, merges = byte_level_vocab(CALIBRATION, vocab - 256 - len(SPECIALS))
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-v3")
    w.add_token_list(SPECIALS + tokens)
    w.add_token_types([3, 3] + [1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

ftype = {"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
hparams = ModelBase.load_hparams(Path(src), False)
cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
cls.set_vocab = set_vocab
with torch.inference_mode():
    m = cls(Path(src), ftype, Path(out), eager=True)
    m.write()
print("converted", cls.__name__, out)
'''

#: the subprocess that runs llama.cpp's quantizer (argv: in, out, ftype number)
QUANTIZE = r'''
import sys, llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = ftype
p.nthread = 2
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
assert rc == 0, rc
print("quantized", dst)
'''
#: llama_ftype values (llama.h)
FTYPES = {"Q4_K_M": 15, "MXFP4_MOE": 38, "Q4_0": 2}


def write_source(root: Path, cfg: dict, seed: int) -> Path:
    import kimi_tiny
    from quantplug.testing import write_checkpoint

    return write_checkpoint(root, cfg, kimi_tiny.state(cfg, seed))


def convert(lcpp: Path, src: Path, out: Path, outtype: str) -> None:
    subprocess.run([sys.executable, "-c", CONVERT, str(lcpp), str(src), str(out), outtype, str(HERE)], check=True)


def quantize(python: str, src: Path, dst: Path, ftype: str) -> None:
    subprocess.run([python, "-c", QUANTIZE, str(src), str(dst), str(FTYPES[ftype])], check=True)


def fixture(out: Path, name: str, gguf: Path, cfg: dict) -> None:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(gguf, d / "model.gguf")
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    print(f"{d}: {(d / 'model.gguf').stat().st_size:,} bytes")


#: the seeds of the fixtures' source models (the tests regenerate the sources from them)
SEEDS = {"kimi_linear": 11, "kimi_k3": 13}


def main() -> None:
    import kimi_tiny

    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--lcpp-python", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    w = args.work
    w.mkdir(parents=True, exist_ok=True)

    kl = kimi_tiny.kimi_linear_config()
    src = write_source(w / "kl-src", kl, SEEDS["kimi_linear"])
    convert(args.llama_cpp, src, w / "kl-f32.gguf", "f32")
    convert(args.llama_cpp, src, w / "kl-q8_0.gguf", "q8_0")
    quantize(args.lcpp_python, w / "kl-f32.gguf", w / "kl-q4_k_m.gguf", "Q4_K_M")
    for t in ("f32", "q8_0", "q4_k_m"):
        fixture(args.out, f"gguf_kimi_linear_{t}", w / f"kl-{t}.gguf", kl)

    k3 = kimi_tiny.k3_config()
    k3q = kimi_tiny.k3_config(mxfp4=True)
    src = write_source(w / "k3-src", k3, SEEDS["kimi_k3"])
    srcq = write_source(w / "k3-mxfp4-src", k3q, SEEDS["kimi_k3"])
    convert(args.llama_cpp, src, w / "k3-f32.gguf", "f32")
    convert(args.llama_cpp, srcq, w / "k3-mxfp4.gguf", "f32")
    quantize(args.lcpp_python, w / "k3-mxfp4.gguf", w / "k3-mxfp4_moe.gguf", "MXFP4_MOE")
    fixture(args.out, "gguf_kimi_k3_f32", w / "k3-f32.gguf", k3)
    fixture(args.out, "gguf_kimi_k3_mxfp4_moe", w / "k3-mxfp4_moe.gguf", k3)  # config.json without the safetensors quantization_config


if __name__ == "__main__":
    main()
