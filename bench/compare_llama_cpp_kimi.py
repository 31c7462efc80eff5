"""quantplug against llama.cpp itself on the Kimi-Linear / Kimi-K3 GGUF fixtures (not run by the tests).

    LCPP/bin/python bench/compare_llama_cpp_kimi.py llama   --work /tmp/kcmp   # llama-cpp-python
    python          bench/compare_llama_cpp_kimi.py compare --work /tmp/kcmp   # quantplug's venv

``LCPP`` is a virtualenv with ``llama-cpp-python`` 0.3.36 built from source (CPU; its vendored
llama.cpp made the fixtures: ``tests/data/vendor/make_gguf_kimi.py``, and its
``src/models/kimi-linear.cpp`` / ``kimi-k3.cpp`` run them); that step needs only numpy and
llama_cpp. Files: ``tests/data/vendor/gguf_kimi_{linear,k3}_{f32,...}`` (``--fixtures`` to choose).

1. ``llama``: for each file and each of two prompts (40 and 70 tokens: the second crosses a KDA
   chunk of 64), llama.cpp's logits at every prompt position (one batch), then ``STEPS`` greedy
   decode steps (one token per ``llama_decode``: the recurrent KDA path and the MLA cache), with
   the tokens it chose;
2. ``compare``: quantplug's logits of the same file on the same tokens, once as one forward of
   prompt + chosen tokens and once as the prompt then cached one-token steps; the max relative
   difference (``max |a - b| / max |b|``) per part, whether quantplug's greedy choices agree, and
   the same with quantplug's KDA L2 norm taking llama.cpp's epsilon (``x / sqrt(sum x^2 +
   rms_norm_eps)``, ``build_gdn_l2_norm``) instead of FLA's 1e-6, and then also MLA's
   ``q_a_layernorm`` / ``kv_a_layernorm`` at llama.cpp's ``rms_norm_eps`` instead of the 1e-6 of
   transformers' and the official code: those differences quantified.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT / "tests" / "data" / "vendor"
FIXTURES = ("gguf_kimi_linear_f32", "gguf_kimi_k3_f32", "gguf_kimi_linear_q8_0", "gguf_kimi_k3_mxfp4_moe")
PROMPTS = (40, 70)
STEPS = 8
VOCAB = 320


def prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(2, VOCAB, n).astype(np.int64) for n in PROMPTS]


def llama(work: Path, fixtures: list[str]) -> None:
    import llama_cpp

    for name in fixtures:
        out = {}
        for p, ids in enumerate(prompts()):
            llm = llama_cpp.Llama(model_path=str(VENDOR / name / "model.gguf"), n_ctx=128, n_batch=128,
                                  n_ubatch=128, logits_all=True, n_threads=2, type_k=0, type_v=0, seed=0,
                                  verbose=False)
            llm.reset()
            llm.eval([int(t) for t in ids])
            logits = [np.array(llm.scores[i], dtype=np.float32) for i in range(len(ids))]
            chosen = []
            for _ in range(STEPS):
                nxt = int(np.argmax(logits[-1]))
                chosen.append(nxt)
                llm.eval([nxt])
                logits.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
            out[f"ids{p}"] = np.concatenate([ids, np.array(chosen, dtype=np.int64)])
            out[f"logits{p}"] = np.stack(logits)  # [prompt + STEPS, vocab]: the last is after every chosen token
            del llm
        np.savez(work / f"{name}.npz", **out)
        print(f"llama.cpp {llama_cpp.__version__}: {name} saved")


def compare(work: Path, fixtures: list[str]) -> None:
    import quantplug
    import torch
    from quantplug.generate import new_cache
    from quantplug.models import kimi
    from quantplug.testing.reference import rel_err

    torch.set_num_threads(1)
    fla_l2 = kimi.l2norm
    for name in fixtures:
        lc = np.load(work / f"{name}.npz")
        model = quantplug.load(VENDOR / name, progress=False)
        lm = model.text_lm()
        eps = lm.config.rms_norm_eps
        mla = [layer.self_attn for layer in lm.model.layers if not layer.kda]
        for label, l2, norm_eps in (("quantplug: FLA l2 eps 1e-6, q_a / kv_a norm eps 1e-6", fla_l2, 1e-6),
                                    (f"l2 eps {eps:g} as llama.cpp", lambda x, eps=eps: fla_l2(x, eps), 1e-6),
                                    (f"l2 and q_a / kv_a norm eps {eps:g} as llama.cpp",
                                     lambda x, eps=eps: fla_l2(x, eps), eps)):
            kimi.l2norm = l2
            for a in mla:
                for norm in (getattr(a, "q_a_layernorm", None), a.kv_a_layernorm):
                    if norm is not None:
                        norm.eps = norm_eps
            for p, n in enumerate(PROMPTS):
                ids = torch.from_numpy(lc[f"ids{p}"])[None]            # prompt + STEPS chosen tokens
                theirs = torch.from_numpy(lc[f"logits{p}"])            # [n + STEPS, vocab]
                with torch.no_grad():
                    full = lm(ids)[0]                                  # logits after each token
                    cache = new_cache(lm, 1, n + STEPS + 1)
                    steps = [lm(ids[:, :n], None, cache)[0]]
                    for t in range(n, n + STEPS):
                        steps.append(lm(ids[:, t:t + 1], None, cache)[0])
                    steps = torch.cat(steps)
                greedy = bool((full[n - 1:n + STEPS - 1].argmax(-1) == ids[0, n:]).all())
                print(f"{name} [{label}] prompt {n}: prompt rel {rel_err(full[:n], theirs[:n]):.3g}, "
                      f"decode steps rel {rel_err(steps[n:], theirs[n:]):.3g} (quantplug one forward: "
                      f"{rel_err(full[n:], theirs[n:]):.3g}), all rel {rel_err(full, theirs):.3g}, "
                      f"greedy tokens agree {greedy}")
    kimi.l2norm = fla_l2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=("llama", "compare"))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--fixtures", nargs="*", default=list(FIXTURES))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    {"llama": llama, "compare": compare}[args.step](args.work, args.fixtures)


if __name__ == "__main__":
    main()
