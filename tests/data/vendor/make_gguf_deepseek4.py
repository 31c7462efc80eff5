"""Make the DeepSeek-V4 GGUF fixture with llama.cpp's own converter, and llama.cpp's logits on it
(not run by the tests).

    python tests/data/vendor/make_gguf_deepseek4.py source  --work /tmp/v4g
    python tests/data/vendor/make_gguf_deepseek4.py convert --work /tmp/v4g --llama-cpp LLAMA_CPP_DIR
    python tests/data/vendor/make_gguf_deepseek4.py llama   --work /tmp/v4g --out tests/data/vendor  # llama-cpp-python

``LLAMA_CPP_DIR`` is the llama.cpp tree vendored in the ``llama-cpp-python`` 0.3.36 source
distribution (its ``convert_hf_to_gguf.py`` machinery: ``conversion/deepseek.py``
``DeepseekV4Model``, run unchanged with the tree's own ``gguf-py`` first on ``sys.path``). Steps:

1. ``source``: a tiny DeepSeek-V4 in the release's layout (E2 / E9 of the release: FP8 E4M3 dense
   linears with E8M0 128x128 block scales, FP4 E2M1 routed experts packed two per byte with E8M0
   scales per 32, BF16 embed / head / norms / router / compressors / indexer ``weights_proj``, F32
   ``attn_sink`` / ``ape`` / ``hc_*`` / ``gate.bias``, I64 ``tid2eid``). Weights: transformers 5.25's
   ``DeepseekV4ForCausalLM`` initialised as ``tests/v4_models.py`` does, then rounded to those
   formats. One layer per attention kind llama.cpp knows (ratios 0, 4 and 128; the indexer's head
   dim 64, the smallest its Hadamard rotation takes), ``index_topk`` 6 below the CSA entries of the
   160-token prompt, so the selection matters; the prompt is longer than 128, so the HCA layer
   attends to a compressed entry;
2. ``convert``: llama.cpp's converter on it, only ``set_vocab`` replaced by the 320-token byte-level
   BPE of ``make_gguf_iq.py`` (the tiny model has no tokenizer). It repacks the FP4 experts to
   ggml MXFP4, dequantizes the FP8 linears and writes them Q8_0, keeps the BF16 matrices BF16, and
   the 1-D tensors F32; ``tid2eid`` I32;
3. ``llama``: llama-cpp-python 0.3.36 (the same tree) on the GGUF: every position's logits of the
   prompt, once as one batch and once one token per ``llama_decode``, with F32 K / V caches, saved
   with the prompt as ``gguf_deepseek4_mxfp4.reference.safetensors`` (keys ``input_ids`` [1, 160],
   ``llama_cpp_prompt``, ``llama_cpp_steps`` [1, 160, 320], stored float16); also llama.cpp's
   logits on an all-F32 copy of the same GGUF (every tensor dequantized by gguf-py,
   ``llama_cpp_f32_prompt``, float32), which has no activation rounding.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
NAME = "gguf_deepseek4_mxfp4"
V, H, E, K, INTER, LIM = 320, 64, 8, 2, 32, 0.75
SEQ, SEED = 160, 4
#: the release config.json (E1 keys), scaled down; 0 / 4 / 128: the ratios llama.cpp's deepseek4 takes
CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": V, "hidden_size": H,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
    "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32, "sliding_window": 16,
    "compress_ratios": [0, 4, 128, 0], "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "index_n_heads": 16, "index_head_dim": 64, "index_topk": 6, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "n_routed_experts": E, "num_experts_per_tok": K, "n_shared_experts": 1,
    "moe_intermediate_size": INTER, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": LIM, "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}
#: release tensors stored FP8 (E9), by name suffix
FP8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
       "attn.indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight")
#: release tensors stored F32 (E9); everything else float is BF16
F32 = ("attn_sink", ".ape", "gate.bias", "hc_")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def reference_model() -> Any:
    """transformers' V4 with ``CONFIG``'s dims, weights drawn as ``tests/v4_models.py`` draws them."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as tf
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    c = CONFIG
    cfg = DeepseekV4Config(
        vocab_size=V, hidden_size=H, num_hidden_layers=c["num_hidden_layers"], num_attention_heads=4,
        num_key_value_heads=1, head_dim=c["head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
        q_lora_rank=c["q_lora_rank"], o_groups=c["o_groups"], o_lora_rank=c["o_lora_rank"],
        sliding_window=c["sliding_window"], index_n_heads=c["index_n_heads"], index_head_dim=c["index_head_dim"],
        index_topk=c["index_topk"], rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        compress_ratios=c["compress_ratios"][:3],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1, moe_intermediate_size=INTER,
        routed_scaling_factor=1.5, num_hash_layers=1, swiglu_limit=LIM, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096)
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    ref = tf.DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "position_bias", "e_score_correction_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "bias" in name.split(".")[-1] else 1.0))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in ref.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]))
    return ref


def fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values + E8M0 scales per 128x128 block (W = fp8 * 2^(s - 127))."""
    n, k = w.shape
    bn, bk = -(-n // 128), -(-k // 128)
    pad = torch.zeros(bn * 128, bk * 128)
    pad[:n, :k] = w
    amax = pad.view(bn, 128, bk, 128).abs().amax(dim=(1, 3)).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / 448.0))
    scale = torch.exp2(e).repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    q = (w / scale).to(torch.float8_e4m3fn)
    return q, (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def fp4_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 values packed two per byte (element 2j low nibble, 2j+1 high) as I8 + E8M0 scales per 32."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / 6.0))
    x = (blocks / torch.exp2(e)).abs()
    idx = (x.unsqueeze(-1) - E2M1).abs().argmin(-1)  # nearest magnitude (ties to the smaller code)
    code = (idx | ((blocks < 0).long() << 3)).view(n, k).to(torch.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8)
    return packed, (e.squeeze(-1) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def release_state() -> dict[str, torch.Tensor]:
    """The tiny model's release-format tensors (see the module docstring)."""
    sys.path.insert(0, str(HERE.parents[1]))  # tests/: v4_models.release_names
    from v4_models import release_names

    ref = reference_model()
    import v4_models

    old = v4_models.INTER
    v4_models.INTER = INTER  # release_names splits gate_up_proj at its module constant
    try:
        float_state = release_names(ref.state_dict())
    finally:
        v4_models.INTER = old
    out: dict[str, torch.Tensor] = {}
    for name, t in float_state.items():
        base = name.removesuffix(".weight")
        if name.endswith("tid2eid"):
            out[name] = t.to(torch.int64)
        elif ".ffn.experts." in name:
            out[name], out[f"{base}.scale"] = fp4_experts(t.float())
        elif name.endswith(FP8):
            out[name], out[f"{base}.scale"] = fp8_block(t.float())
        elif any(s in name for s in F32):
            out[name] = t.float()
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def write_source(root: Path) -> Path:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG, indent=2))
    save_file(release_state(), str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


#: the subprocess that runs llama.cpp's converter (argv: llama.cpp dir, model dir, out file, vocab dir)
CONVERT = r'''
import sys
from pathlib import Path
lcpp, src, out, vocab_dir = sys.argv[1:5]
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

hparams = ModelBase.load_hparams(Path(src), False)
cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
cls.set_vocab = set_vocab
with torch.inference_mode():
    m = cls(Path(src), gguf.LlamaFileType.MOSTLY_BF16, Path(out), eager=True)
    m.write()
print("converted", cls.__name__, gguf.__file__, out)
'''


def convert(lcpp: Path, src: Path, out: Path) -> None:
    subprocess.run([sys.executable, "-c", CONVERT, str(lcpp), str(src), str(out), str(HERE)], check=True)


def f32_copy(src: Path, dst: Path) -> None:
    """``src`` with every tensor dequantized to F32 by gguf-py (metadata and vocabulary kept):
    what llama.cpp computes on it has no activation rounding."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), vt)
    for t in r.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.I32:
            w.add_tensor(t.name, np.asarray(t.data))
            continue
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, data.reshape([int(n) for n in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_logits(model: Path, ids: list[int], n_batch: int) -> torch.Tensor:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, n_batch=n_batch, n_ubatch=n_batch, logits_all=True,
                          n_threads=2, type_k=0, type_v=0, seed=0, verbose=False)
    llm.reset()
    llm.eval(ids)
    out = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    del llm
    return out


def prompt() -> torch.Tensor:
    return torch.randint(2, V, (1, SEQ), generator=torch.Generator().manual_seed(SEED + 2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=("source", "convert", "llama"))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--llama-cpp", type=Path)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    if args.step == "source":
        print(write_source(w / "src"))
    elif args.step == "convert":
        assert args.llama_cpp is not None, "--llama-cpp"
        convert(args.llama_cpp, w / "src", w / "model.gguf")
        d = args.out / NAME
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(w / "model.gguf", d / "model.gguf")
        (d / "config.json").write_text(json.dumps(CONFIG, indent=2))
        print(f"{d}: {(d / 'model.gguf').stat().st_size:,} bytes")
    else:
        from safetensors.torch import save_file

        d = args.out / NAME
        f32_copy(d / "model.gguf", w / "f32.gguf")
        ids = prompt()
        row = [int(t) for t in ids[0]]
        # float16 where the comparison is at the percent level (the fixture stays small)
        ref = {"input_ids": ids,
               "llama_cpp_prompt": llama_logits(d / "model.gguf", row, SEQ)[None].half(),
               "llama_cpp_steps": llama_logits(d / "model.gguf", row, 1)[None].half(),
               "llama_cpp_f32_prompt": llama_logits(w / "f32.gguf", row, SEQ)[None]}
        import llama_cpp

        save_file(ref, str(args.out / f"{NAME}.reference.safetensors"),
                  metadata={"llama_cpp_python": llama_cpp.__version__})
        print({k: tuple(v.shape) for k, v in ref.items()})


if __name__ == "__main__":
    main()
