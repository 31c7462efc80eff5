"""Per-layer hidden states of llama.cpp's graph against quantplug's on one window (not run by the tests).

    python bench/compare_llama_layers.py --src LLAMA_CPP_TREE --bin /tmp/lcpp-build/bin \\
        --model /tmp/q8kld-bench/dsv3-q8_0 --logits /tmp/q8kld-bench/llama-f32.logits --kernels fast

Where ``compare_llama_perplexity.py`` shows the two engines' distributions apart, this shows
where: a small C++ program (compiled here against ``--bin``'s libraries and ``--src``'s headers:
the same llama.cpp tree) runs one ``llama_decode`` of the window's tokens (the first window of a
``llama-perplexity`` logits file, BOS first, as the perplexity run feeds it) with an F32 KV cache,
flash attention off and a ``cb_eval`` callback that writes every F32 tensor of the graph; quantplug
runs the same tokens with forward hooks on its decoder layers. Per layer: the relative difference
of the layer's output (``l_out``), over the whole window and per token (median, and how many tokens
are more than 1e-2 apart). llama.cpp computes the last layer's output for the window's last token
only (the one whose logits it returns), so that layer compares that row.
"""

from __future__ import annotations

import argparse
import glob
import subprocess
from pathlib import Path

import numpy as np

DUMP = r"""
// every F32 tensor of one llama_decode of the given token ids (ggml's CPU backend), one file each
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
static std::string outdir;
static int counter = 0;
static bool cb(struct ggml_tensor * t, bool ask, void *) {
    if (ask || t->type != GGML_TYPE_F32) return true;
    std::vector<char> buf(ggml_nbytes(t));
    ggml_backend_tensor_get(t, buf.data(), 0, buf.size());
    std::string name = t->name;
    for (char & c : name) if (c == '/' || c == ' ') c = '_';
    char path[1024];
    snprintf(path, sizeof path, "%s/%05d_%s.bin", outdir.c_str(), counter++, name.c_str());
    FILE * f = fopen(path, "wb");
    if (!f) return false;
    int64_t hdr[8] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3], (int64_t) t->nb[0], (int64_t) t->nb[1], (int64_t) t->nb[2], (int64_t) t->nb[3]};
    fwrite(hdr, sizeof hdr, 1, f);
    fwrite(buf.data(), 1, buf.size(), f);
    fclose(f);
    return true;
}
int main(int argc, char ** argv) {  // model tokens.txt outdir threads
    if (argc != 5) return 2;
    outdir = argv[3];
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return 1;
    std::vector<llama_token> toks;
    FILE * f = fopen(argv[2], "r");
    int v;
    while (fscanf(f, "%d", &v) == 1) toks.push_back(v);
    fclose(f);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (uint32_t) toks.size();
    cp.n_threads = cp.n_threads_batch = atoi(argv[4]);
    cp.type_k = cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.cb_eval = cb;
    llama_context * ctx = llama_init_from_model(model, cp);
    int rc = llama_decode(ctx, llama_batch_get_one(toks.data(), (int32_t) toks.size()));
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return rc;
}
"""


def read_dump(work: Path, name: str) -> np.ndarray:
    """The last tensor the graph named ``name`` (ggml's [ne3, ne2, ne1, ne0] order, contiguous)."""
    files = sorted(glob.glob(str(work / f"*_{name}.bin")))
    if not files:
        raise SystemExit(f"no tensor {name!r} in the dump")
    b = Path(files[-1]).read_bytes()
    h = np.frombuffer(b[:64], dtype=np.int64)
    raw = np.frombuffer(b[64:], dtype=np.float32)
    return np.ascontiguousarray(np.lib.stride_tricks.as_strided(raw, shape=tuple(h[:4][::-1]), strides=tuple(h[4:][::-1])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="the llama.cpp tree --bin was built from (its headers)")
    ap.add_argument("--bin", type=Path, required=True, help="directory holding libllama.so / libggml*.so")
    ap.add_argument("--model", type=Path, required=True, help="a directory holding model.gguf and config.json")
    ap.add_argument("--logits", type=Path, required=True, help="a llama-perplexity logits file: its first window")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qp-llama-layers"))
    ap.add_argument("--kernels", choices=("exact", "fast"), default="fast")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    exe = args.work / "llama_tensor_dump"
    (args.work / "llama_tensor_dump.cpp").write_text(DUMP)
    subprocess.run(["c++", "-std=c++17", "-O1", "-I", str(args.src / "include"), "-I", str(args.src / "ggml" / "include"),
                    str(args.work / "llama_tensor_dump.cpp"), "-o", str(exe), f"-L{args.bin}", "-lllama", "-lggml",
                    "-lggml-base", f"-Wl,-rpath,{args.bin}"], check=True)
    raw = args.logits.read_bytes()
    n_ctx = int(np.frombuffer(raw[8:12], dtype=np.int32)[0])  # "_logits_", n_ctx, n_vocab, n_chunk, tokens
    tokens = np.frombuffer(raw[20:20 + 4 * n_ctx], dtype=np.int32).copy()
    dump = args.work / "dump"
    dump.mkdir(exist_ok=True)
    for f in dump.glob("*.bin"):
        f.unlink()

    import quantplug
    import torch

    from quantplug.eval import checkpoint_bos

    model = quantplug.load(args.model, progress=False, options={"kernels": args.kernels})
    bos = checkpoint_bos(model, args.model, int(tokens[0]))
    if bos is not None:
        tokens[0] = bos  # llama-perplexity's BOS in place of each window's first token
    (args.work / "tokens.txt").write_text(" ".join(map(str, tokens.tolist())))
    subprocess.run([str(exe), str(args.model / "model.gguf"), str(args.work / "tokens.txt"), str(dump), str(args.threads)],
                   check=True, capture_output=True)
    outs: dict[int, np.ndarray] = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda mod, a, o, i=i: outs.__setitem__(
            i, (o if torch.is_tensor(o) else o[0])[0].float().numpy().copy()))
    with torch.inference_mode():
        model.model(torch.from_numpy(tokens).long().unsqueeze(0))
    print(f"{args.model.name}, kernels={args.kernels}, {len(tokens)} tokens (llama.cpp: F32 KV cache, -fa off)")
    print("| layer | l_out relative difference | per token: median | tokens > 1e-2 |")
    print("|---|---|---|---|")
    for i in sorted(outs):
        ours = outs[i].astype(np.float64)
        theirs = read_dump(dump, f"l_out-{i}").reshape(-1, ours.shape[-1]).astype(np.float64)
        if theirs.shape[0] != ours.shape[0]:
            ours = ours[-theirs.shape[0]:]  # the last layer: the returned token's row only
        tok = np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)
        print(f"| {i} | {np.linalg.norm(ours - theirs) / np.linalg.norm(theirs):.2e} | {np.median(tok):.1e} | "
              f"{int((tok > 1e-2).sum())} / {len(tok)} |")


if __name__ == "__main__":
    main()
