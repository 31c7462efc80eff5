"""Train a tiny DeepSeek-V3 (MLA, sigmoid-routed MoE with a shared expert, one MTP layer) on
Python standard-library sources, deterministically, and write it in the release layout quantplug
loads (config.json, bf16 safetensors, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json); then check that quantplug's logits and MTP draft logits equal this
script's own model on the saved weights.

    python bench/train_tiny.py --out tests/data/trained/dsv3-tiny

The corpus: the 115 top-level ``.py`` files of the standard library that are byte-identical in
CPython 3.11.2 and 3.11.7 (:data:`FILES`, sorted), read from ``sysconfig.get_paths()["stdlib"]``;
:data:`HELD_OUT` of them are kept out of training (the evaluation text, written next to the
checkpoint as ``heldout.txt``). The corpus's sha256 is checked against :data:`CORPUS_SHA256`: another
Python whose files differ gives another model (``--any-corpus`` trains on it anyway).

The model is plain torch, written here (no transformers): DeepSeek-V3's forward as quantplug and
transformers compute it (MLA with q-LoRA, compressed KV and an interleaved rope / nope split;
layer 0 dense, the others MoE with DeepSeek-V3's sigmoid router, ``e_score_correction_bias``
updated auxiliary-loss-free by the sign of each expert's load, a shared expert) and one MTP layer
as DeepSeek-V3 trains it (ARCHITECTURES D3): ``eh_proj(cat(enorm(Embed(t+1)), hnorm(h_t)))``, a
full decoder block, the shared head; its loss predicts token t+2 and is added with weight
``--mtp-weight`` (0.3).

Determinism: seeds fixed (tokenizer training, initialisation, batch order), ``torch.set_num_threads``
(``--threads``, 2), ``torch.use_deterministic_algorithms(True)``. Two runs on one machine write the
same bytes (the script prints the sha256 of model.safetensors; checked with two 6-step runs); a CPU with other vector units or
another torch build may round differently (another hash, the same figures within noise).

Never pickle: every file written is JSON, text or safetensors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

#: top-level standard-library modules whose sources are byte-identical in CPython 3.11.2 and 3.11.7
FILES = sorted("""
__future__ __hello__ _aix_support _bootsubprocess _collections_abc _compat_pickle _compression
_markupbase _osx_support _py_abc _pydecimal _pyio _sitebuiltins _strptime _threading_local _weakrefset
aifc antigravity asynchat asyncore bisect bz2 cgi cgitb chunk cmd code compileall contextvars copy
copyreg crypt csv decimal difflib filecmp fnmatch fractions ftplib functools genericpath getopt getpass
glob graphlib gzip hashlib heapq hmac imaplib imghdr imp keyword linecache lzma mailbox mailcap
mimetypes modulefinder netrc nntplib nturl2path numbers opcode operator optparse os pickle pickletools
pipes poplib posixpath pprint pstats pyclbr queue random reprlib rlcompleter runpy sched secrets shelve
shlex signal smtpd smtplib sndhdr socketserver sre_compile sre_constants sre_parse stat statistics
string stringprep struct sunau symtable tabnanny telnetlib textwrap this token tokenize tracemalloc tty
types uuid warnings weakref webbrowser xdrlib zipapp zipimport
""".split())  # noqa: SIM905
#: evaluation text: never trained on
HELD_OUT = ("fnmatch", "glob", "heapq", "numbers", "queue", "sched", "shlex", "textwrap")
#: sha256 over (name, NUL, content, NUL) of every file in :data:`FILES` order (CPython 3.11.2 / 3.11.7)
CORPUS_SHA256 = "630333476e9ce9f945096cb6e5a6e1db6d60b7aecee37ac4b2722f8fa9a1ff3a"

SPECIALS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def model_config(vocab: int) -> dict:
    """config.json (transformers 5 spelling, default rope), the model trained here."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024, "rope_interleave": True, "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "bfloat16", "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


# -- corpus and tokenizer -------------------------------------------------------------------------

def read_corpus(any_corpus: bool) -> dict[str, str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, h = {}, hashlib.sha256()
    for name in FILES:
        data = (root / f"{name}.py").read_bytes()
        h.update(name.encode() + b"\0" + data + b"\0")
        texts[name] = data.decode("utf-8")
    got = h.hexdigest()
    if CORPUS_SHA256 is not None and got != CORPUS_SHA256:
        msg = (f"corpus sha256 {got} under {root} (Python {sys.version.split()[0]}) is not the recorded "
               f"{CORPUS_SHA256} (CPython 3.11.2 / 3.11.7)")
        if not any_corpus:
            raise SystemExit(msg + ": another model would result; --any-corpus trains on it anyway")
        print("warning:", msg, flush=True)
    print(f"corpus: {len(FILES)} files ({len(HELD_OUT)} held out), {sum(map(len, texts.values())):,} characters, "
          f"sha256 {got}", flush=True)
    return texts


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", 0)])
    assert tok.token_to_id("<|bos|>") == 0 and tok.token_to_id("<|eos|>") == 1
    return tok


# -- the model ------------------------------------------------------------------------------------

def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rope as transformers / quantplug apply it: pairs (2i, 2i+1), output
    de-interleaved (halves). x [B, heads, T, d]; cos / sin [T, d/2]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Tiny(nn.Module):
    """Parameters named as the checkpoint names them (``.`` -> ``__`` inside this module)."""

    def __init__(self, cfg: dict, gen: torch.Generator) -> None:
        super().__init__()
        self.cfg = cfg
        self.p = nn.ParameterDict()
        self.bias: dict[str, torch.Tensor] = {}   # e_score_correction_bias: not trained by gradient
        self.shapes = shapes(cfg)
        for name, shape in self.shapes.items():
            if name.endswith("e_score_correction_bias"):
                self.bias[name] = torch.zeros(shape)
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                t = torch.ones(shape)
            else:
                std = 0.02
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std = 0.02 / math.sqrt(2 * (cfg["num_hidden_layers"] + 1))
                t = torch.randn(shape, generator=gen) * std
            self.p[name.replace(".", "__")] = nn.Parameter(t)
        h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
        d = cfg["qk_rope_head_dim"]
        self.inv_freq = 1.0 / (cfg["rope_parameters"]["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.scale = (cfg["qk_nope_head_dim"] + d) ** -0.5
        self.h, self.nh = h, nh

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "__")]

    def cos_sin(self, t: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(start, start + t).float()[:, None] * self.inv_freq
        return freqs.cos(), freqs.sin()

    def attn(self, b: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.w
        bsz, t, _ = x.shape
        nh, nope, rope, v, kl = self.nh, c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        q = F.linear(rms(F.linear(x, w(f"{b}.q_a_proj.weight")), w(f"{b}.q_a_layernorm.weight")), w(f"{b}.q_b_proj.weight"))
        q = q.view(bsz, t, nh, nope + rope).transpose(1, 2)
        q_pass, q_rot = q.split([nope, rope], dim=-1)
        ckv = F.linear(x, w(f"{b}.kv_a_proj_with_mqa.weight"))
        lat, k_rot = ckv.split([kl, rope], dim=-1)
        kv = F.linear(rms(lat, w(f"{b}.kv_a_layernorm.weight")), w(f"{b}.kv_b_proj.weight"))
        kv = kv.view(bsz, t, nh, nope + v).transpose(1, 2)
        k_nope, val = kv.split([nope, v], dim=-1)
        q_rot = rope_interleaved(q_rot, cos, sin)
        k_rot = rope_interleaved(k_rot.view(bsz, 1, t, rope), cos, sin)
        qs = torch.cat([q_pass, q_rot], dim=-1)
        ks = torch.cat([k_nope, k_rot.expand(-1, nh, -1, -1)], dim=-1)
        out = F.scaled_dot_product_attention(qs, ks, val, is_causal=True, scale=self.scale)
        return F.linear(out.transpose(1, 2).reshape(bsz, t, nh * v), w(f"{b}.o_proj.weight"))

    def mlp(self, b: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return F.linear(F.silu(F.linear(x, w(f"{b}.gate_proj.weight"))) * F.linear(x, w(f"{b}.up_proj.weight")),
                        w(f"{b}.down_proj.weight"))

    def moe(self, b: str, x: torch.Tensor, loads: dict[str, torch.Tensor] | None) -> torch.Tensor:
        c, w = self.cfg, self.w
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        e, k = c["n_routed_experts"], c["num_experts_per_tok"]
        scores = F.linear(x, w(f"{b}.gate.weight")).sigmoid()
        bias = self.bias[f"{b}.gate.e_score_correction_bias"]
        idx = torch.topk(scores.detach() + bias, k, dim=-1).indices          # noaux_tc, n_group 1
        wts = scores.gather(1, idx)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * c["routed_scaling_factor"]
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=e)
        if loads is not None:
            loads[f"{b}.gate.e_score_correction_bias"] = counts
        order = torch.argsort(flat, stable=True)
        tok = order // k
        xs = x.index_select(0, tok)
        ws = wts.reshape(-1).index_select(0, order).unsqueeze(-1)
        outs, lo = [], 0
        for j, n in enumerate(counts.tolist()):
            if n:
                xe = xs[lo:lo + n]
                he = F.silu(F.linear(xe, w(f"{b}.experts.{j}.gate_proj.weight"))) * F.linear(xe, w(f"{b}.experts.{j}.up_proj.weight"))
                outs.append(F.linear(he, w(f"{b}.experts.{j}.down_proj.weight")))
            lo += n
        routed = torch.zeros_like(x).index_add(0, tok, torch.cat(outs) * ws)
        return (routed + self.mlp(f"{b}.shared_experts", x)).view(shape)

    def block(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, loads) -> torch.Tensor:
        b = f"model.layers.{i}"
        x = x + self.attn(f"{b}.self_attn", rms(x, self.w(f"{b}.input_layernorm.weight")), cos, sin)
        y = rms(x, self.w(f"{b}.post_attention_layernorm.weight"))
        y = self.mlp(f"{b}.mlp", y) if i < self.cfg["first_k_dense_replace"] else self.moe(f"{b}.mlp", y, loads)
        return x + y

    def hidden(self, ids: torch.Tensor, loads=None) -> torch.Tensor:
        """The main model's normed final hidden states [B, T, H] (the LM head's input)."""
        x = F.embedding(ids, self.w("model.embed_tokens.weight"))
        cos, sin = self.cos_sin(ids.shape[1])
        for i in range(self.cfg["num_hidden_layers"]):
            x = self.block(i, x, cos, sin, loads)
        return rms(x, self.w("model.norm.weight"))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.w("lm_head.weight"))

    def mtp_hidden(self, next_ids: torch.Tensor, hidden: torch.Tensor, loads=None) -> torch.Tensor:
        """MTP (ARCHITECTURES D3): row j from h_j and token t_{j+1}; its head predicts t_{j+2}.
        Positions j + 1 (quantplug's choice; relative rope makes any consistent one equal)."""
        i = self.cfg["num_hidden_layers"]
        b = f"model.layers.{i}"
        e = F.embedding(next_ids, self.w("model.embed_tokens.weight"))
        u = F.linear(torch.cat([rms(e, self.w(f"{b}.enorm.weight")), rms(hidden, self.w(f"{b}.hnorm.weight"))], -1),
                     self.w(f"{b}.eh_proj.weight"))
        cos, sin = self.cos_sin(next_ids.shape[1], 1)
        return rms(self.block(i, u, cos, sin, loads), self.w(f"{b}.shared_head.norm.weight"))

    def state(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (the MTP layer's embed_tokens / shared_head.head: copies)."""
        out = {}
        n = self.cfg["num_hidden_layers"]
        for name in self.shapes:
            if name.endswith("e_score_correction_bias"):
                out[name] = self.bias[name].clone()
            elif name == f"model.layers.{n}.embed_tokens.weight":
                out[name] = self.w("model.embed_tokens.weight").detach().clone()
            elif name == f"model.layers.{n}.shared_head.head.weight":
                out[name] = self.w("lm_head.weight").detach().clone()
            else:
                out[name] = self.w(name).detach().clone()
        return out


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint (quantplug.testing.text_names with the MTP layer), minus the
    MTP layer's copies of the embedding and head, which training shares (added by ``state``)."""
    from quantplug.testing import text_names

    n = cfg["num_hidden_layers"]
    names = text_names(cfg, mtp=True)
    return {k: s for k, s in names.items()
            if k not in (f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight")} | {
        f"model.layers.{n}.embed_tokens.weight": names[f"model.layers.{n}.embed_tokens.weight"],
        f"model.layers.{n}.shared_head.head.weight": names[f"model.layers.{n}.shared_head.head.weight"]}


# -- training -------------------------------------------------------------------------------------

def losses(model: Tiny, batch: torch.Tensor, loads) -> tuple[torch.Tensor, torch.Tensor]:
    """Main loss (t+1 from positions 0..T-2) and MTP loss (t+2 from h_j and t_{j+1}, j = 0..T-3)."""
    h = model.hidden(batch, loads)
    main = F.cross_entropy(model.logits(h[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    u = model.mtp_hidden(batch[:, 1:-1], h[:, :-2], loads)
    mtp = F.cross_entropy(model.logits(u).flatten(0, 1), batch[:, 2:].flatten())
    return main, mtp


def train(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = read_corpus(args.any_corpus)
    train_names = [n for n in FILES if n not in HELD_OUT]
    tok = train_tokenizer([texts[n] for n in train_names], args.vocab)
    vocab = tok.get_vocab_size()
    cfg = model_config(vocab)
    eos = tok.token_to_id("<|eos|>")
    stream: list[int] = []
    for n in train_names:   # each file: BOS, its tokens, EOS
        stream += tok.encode(texts[n]).ids + [eos]
    data = torch.tensor(stream, dtype=torch.long)
    heldout = "".join(texts[n] for n in HELD_OUT)
    held = torch.tensor(tok.encode(heldout).ids, dtype=torch.long)
    print(f"tokenizer: vocab {vocab}; train {len(data):,} tokens ({sum(len(texts[n]) for n in train_names) / len(data):.2f} "
          f"chars/token), held out {len(held):,} tokens; {time.perf_counter() - t_start:.1f} s", flush=True)

    gen = torch.Generator().manual_seed(args.seed)
    model = Tiny(cfg, gen)
    n_params = sum(p.numel() for p in model.p.values())
    print(f"model: {n_params / 1e6:.2f}M trained parameters; {sum(math.prod(s) for s in model.shapes.values()) / 1e6:.2f}M "
          "stored", flush=True)
    decay = [p for k, p in model.p.items() if p.dim() >= 2]
    rest = [p for k, p in model.p.items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    warm = max(1, args.steps // 20)

    def lr_at(s: int) -> float:
        if s < warm:
            return args.lr * (s + 1) / warm
        frac = (s - warm) / max(1, args.steps - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    seq, bsz = args.seq, args.batch
    t_train = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - seq, (bsz,), generator=gen)
        batch = torch.stack([data[s:s + seq] for s in starts.tolist()])
        loads: dict[str, torch.Tensor] = {}
        main, mtp = losses(model, batch, loads)
        loss = main + args.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.p.values()), 1.0, foreach=False)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
        with torch.no_grad():   # auxiliary-loss-free balancing (DeepSeek-V3 section 2.1.2)
            for name, c in loads.items():
                c = c.float()
                model.bias[name] += args.bias_rate * torch.sign(c.mean() - c)
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.perf_counter() - t_train
            print(f"step {step:5d}  loss {main.item():.4f}  mtp {mtp.item():.4f}  lr {lr_at(step):.2e}  "
                  f"{el:.0f} s", flush=True)
    train_seconds = time.perf_counter() - t_train
    cpu = time.process_time()
    print(f"trained {args.steps} steps of {bsz}x{seq} tokens in {train_seconds:.1f} s (process CPU time so far "
          f"{cpu:.1f} s; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})", flush=True)

    # -- write ------------------------------------------------------------------------------------
    from safetensors.torch import save_file

    state = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(model.state().items())}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "add_bos_token": True, "add_eos_token": False, "model_max_length": cfg["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2) + "\n")
    (out / "heldout.txt").write_text(heldout)
    sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    tok_sha = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()

    # -- check against quantplug --------------------------------------------------------------------
    with torch.no_grad():
        for k, v in state.items():       # this model on the saved (bf16-rounded) weights, float32
            if k.endswith("e_score_correction_bias"):
                model.bias[k] = v.float()
            elif k.replace(".", "__") in model.p:
                model.p[k.replace(".", "__")].copy_(v.float())
        figures = verify(model, out, held, args)
    figures.update(train_seconds=round(train_seconds, 1), cpu_seconds_at_train_end=round(cpu, 1), total_seconds=round(time.perf_counter() - t_start, 1),
                   sha256=sha, tokenizer_sha256=tok_sha, steps=args.steps, batch=bsz, seq=seq, threads=args.threads,
                   python=sys.version.split()[0], torch=torch.__version__, vocab=vocab, params=n_params)
    print(json.dumps(figures, indent=2))
    print(f"model.safetensors sha256 {sha}")


def verify(model: Tiny, out: Path, held: torch.Tensor, args: argparse.Namespace) -> dict:
    """quantplug's logits and MTP draft logits equal this model's (float32); held-out perplexity
    (quantplug.eval) and MTP acceptance over a greedy generation."""
    import quantplug
    from quantplug.eval import evaluate, text_tokens
    from quantplug.generate import new_cache, new_mtp_cache

    qm = quantplug.load(out, dtype=torch.float32, progress=False)
    lm = qm.text_lm()
    ids = held[:200].unsqueeze(0)
    h = model.hidden(ids)
    mine = model.logits(h)
    mine_mtp = model.logits(model.mtp_hidden(ids[:, 1:], h[:, :-1]))
    cache = new_cache(lm, 1, ids.shape[1])
    qh, theirs = lm.hidden_and_logits(ids, cache)
    theirs_mtp = lm.mtp_logits(ids[:, 1:], qh[:, :-1], new_mtp_cache(lm, 1, ids.shape[1]))
    err = ((theirs - mine).abs().max() / mine.abs().max()).item()
    err_mtp = ((theirs_mtp - mine_mtp).abs().max() / mine_mtp.abs().max()).item()
    print(f"quantplug vs this model (float32, 200 tokens): logits rel {err:.2e}, MTP draft logits rel {err_mtp:.2e}")
    if err > 1e-4 or err_mtp > 1e-4:
        raise SystemExit("quantplug's logits differ from the trained model's")
    tokens, bos = text_tokens(out, (out / "heldout.txt").read_text())
    res = {}
    r = evaluate(qm, tokens, n_ctx=args.eval_ctx, bos=bos, batch=8, max_chunks=args.eval_chunks, progress=False)
    res.update(heldout_ppl=round(r.ppl, 3), heldout_ppl_err=round(r.ppl_err, 3), heldout_tokens_scored=r.count,
               eval_ctx=args.eval_ctx)
    prompt = torch.tensor([tok_ids for tok_ids in tokens[:24]]).unsqueeze(0)
    g = qm.stream(prompt, 64, eos_token_id=None, speculative="mtp")
    spec = [int(t[0]) for t in g]
    plain = qm.generate(prompt, 64, eos_token_id=None)[0, prompt.shape[1]:].tolist()
    res.update(logits_rel_err=err, mtp_logits_rel_err=err_mtp, mtp_acceptance=round(g.acceptance_rate() or 0.0, 4),
               mtp_drafts=g.drafts, speculative_equals_greedy=spec == plain)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="e_score_correction_bias update speed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-ctx", type=int, default=128)
    ap.add_argument("--eval-chunks", type=int, default=None, help="held-out windows to score (default: all)")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--any-corpus", action="store_true", help="train even if the stdlib files differ from the recorded ones")
    train(ap.parse_args())


if __name__ == "__main__":
    main()
