"""quantplug against llama.cpp itself on DeepSeek-V4 (``deepseek4``) GGUFs (not run by the tests).

    python bench/compare_llama_cpp_deepseek4.py                     # stored llama.cpp logits
    python bench/compare_llama_cpp_deepseek4.py --live --work /tmp/v4c   # llama-cpp-python installed

The file is the fixture ``tests/data/vendor/gguf_deepseek4_mxfp4`` (llama.cpp's own converter on a
tiny release-format V4: MXFP4 experts, Q8_0 dense linears, BF16, F32; made and its llama.cpp
logits stored by ``tests/data/vendor/make_gguf_deepseek4.py``; 160-token prompt). Printed, per
position (||ours - theirs|| / ||theirs|| over the vocabulary): median and max, and the share of
equal argmax, for quantplug's exact kernels and ``kernels=fast`` against

- llama.cpp on the converted file, as one prompt batch and one token per ``llama_decode``;
- llama.cpp on its all-F32 copy (every tensor dequantized by gguf-py).

``--release DIR`` (the source ``make_gguf_deepseek4.py source`` writes) adds the release itself,
loaded by the fp8 backend weight-only (``activation_quant=none``), against the GGUF: what the
conversion (FP8 -> Q8_0) costs.
``--live`` (llama-cpp-python 0.3.36 built from the tree whose converter made the fixture) recomputes
those three with llama.cpp, and adds quantplug's own ``deepseek4`` export of the loaded fixture
(``quantplug_export``, the fixture's vocabulary copied in so that llama.cpp loads it): llama.cpp's
logits on it against quantplug's on it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT / "tests" / "data" / "vendor"
FIXTURE = VENDOR / "gguf_deepseek4_mxfp4"
sys.path.insert(0, str(VENDOR))


def report(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    theirs = theirs.float()
    per = ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).flatten()
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    print(f"  {name:<44} per position median {float(per.median()):.3g}, max {float(per.max()):.3g}; "
          f"argmax equal {agree:.3f}")


def with_vocab(src: Path, dst: Path) -> None:
    """``src`` (a quantplug export) with the fixture's ``tokenizer.*`` keys added."""
    import gguf
    from quantplug_expert_pack.testing import rewrite_gguf

    voc = gguf.GGUFReader(str(FIXTURE / "model.gguf"))

    def add(w) -> None:
        for key, f in voc.fields.items():
            if key.startswith("tokenizer."):
                w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)

    rewrite_gguf(src, dst, add)


def main() -> None:
    import make_gguf_deepseek4 as maker
    import quantplug
    from safetensors.torch import load_file

    ap = argparse.ArgumentParser()
    ap.add_argument("--live", action="store_true", help="run llama.cpp (llama-cpp-python) instead of the stored logits")
    ap.add_argument("--work", type=Path, default=Path("/tmp/v4-llama-compare"))
    ap.add_argument("--release", type=Path, help="the release-format source the fixture was converted from "
                                                   "(make_gguf_deepseek4.py source): loaded by the fp8 backend")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ids = maker.prompt()
    row = [int(t) for t in ids[0]]
    if args.live:
        args.work.mkdir(parents=True, exist_ok=True)
        maker.f32_copy(FIXTURE / "model.gguf", args.work / "f32.gguf")
        ref = {"llama_cpp_prompt": maker.llama_logits(FIXTURE / "model.gguf", row, len(row))[None],
               "llama_cpp_steps": maker.llama_logits(FIXTURE / "model.gguf", row, 1)[None],
               "llama_cpp_f32_prompt": maker.llama_logits(args.work / "f32.gguf", row, len(row))[None]}
    else:
        ref = load_file(str(VENDOR / "gguf_deepseek4_mxfp4.reference.safetensors"))
        assert torch.equal(ref["input_ids"], ids)
    with torch.no_grad():
        exact_model = quantplug.load(FIXTURE, progress=False)
        exact = exact_model(ids)
        fast = quantplug.load(FIXTURE, progress=False, options={"kernels": "fast"})(ids)
    print(f"{FIXTURE.name}: {len(row)} tokens ({'llama.cpp live' if args.live else 'stored llama.cpp logits'})")
    for key, what in (("llama_cpp_prompt", "converted file, prompt batch"),
                      ("llama_cpp_steps", "converted file, one token per decode"),
                      ("llama_cpp_f32_prompt", "all-F32 copy, prompt batch")):
        report(f"exact vs llama.cpp {what}", exact, ref[key])
        report(f"fast  vs llama.cpp {what}", fast, ref[key])
    if args.release is not None:  # what the conversion itself costs (FP8 linears -> Q8_0)
        with torch.no_grad():
            release = quantplug.load(args.release, progress=False, options={"activation_quant": "none"})(ids)
        report("release (fp8 backend) vs the GGUF (exact)", release, exact)
        report("release (fp8 backend) vs llama.cpp converted", release, ref["llama_cpp_prompt"])
    if args.live:
        from quantplug.plugins import get_plugin_manager

        out = get_plugin_manager().export("expert_pack", model=exact_model, destination=args.work / "export",
                                          plan=exact_model.quantplug_plan, options={"pack": False})
        plain = out[0].path
        with_vocab(plain / "model.gguf", args.work / "export.gguf")
        theirs = maker.llama_logits(args.work / "export.gguf", row, len(row))[None]
        with torch.no_grad():
            ours = quantplug.load(plain, progress=False)(ids)
        report("quantplug's export: exact vs llama.cpp", ours, theirs)
        report("quantplug's export vs the fixture (exact)", ours, exact)


if __name__ == "__main__":
    main()
