"""The ``quantplug`` command.

Exit codes: 0 ok; 1 a QuantplugError (one line on stderr, traceback only with --debug); 2 usage;
3 anything else (a bug in quantplug, a plugin or a library: one line, traceback only with --debug).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError, PlanError, QuantplugError
from .options import OptionText
from .plugins import get_plugin_manager
from .summary import explain_lines, parallel_lines, plan_lines, table


def _options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``-o KEY=VALUE`` pairs; values stay text, converted by each option's declared type when the
    plan checks them (``quantplug plugins --options`` lists the types)."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        k, sep, v = pair.partition("=")
        if not sep or not k.strip():
            raise ConfigError(f"-o {pair!r}: expected KEY=VALUE")
        if k.strip() in out:
            raise ConfigError(f"-o {k.strip()}: given twice")
        out[k.strip()] = OptionText(v)
    return out


def cmd_plugins(args: argparse.Namespace) -> int:
    if args.options:
        return _cmd_options(args)
    recs = get_plugin_manager().records()
    if args.json:
        print(json.dumps([r.as_dict() for r in recs], indent=2))
        return 0
    if not recs:
        print("no backends installed (entry-point group quantplug.backends)")
        return 0
    rows = [[r.name, r.distribution, r.version, r.status,
             ",".join(h.removeprefix("quantplug_") for h in r.hooks) or "-", r.error or ""] for r in recs]
    print(table(rows, ["NAME", "DISTRIBUTION", "VERSION", "STATUS", "HOOKS", "ERROR"]))
    return 0


def _cmd_options(args: argparse.Namespace) -> int:
    from .options import declared, rows

    pm = get_plugin_manager()
    found = rows(declared(pm, "load")) + rows(declared(pm, "export"))
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    def allowed(r: dict[str, Any]) -> str:
        if r["choices"] is not None:
            return ",".join(map(str, r["choices"]))
        return r["expected"].split(" in ", 1)[1] if r["type"] in ("int", "float") and " in " in r["expected"] else "-"
    listing = [[r["name"], r["owner"], r["scope"], r["type"], json.dumps(r["default"]), allowed(r), r["help"]]
               for r in found]
    print(table(listing, ["NAME", "OWNER", "SCOPE", "TYPE", "DEFAULT", "CHOICES", "HELP"]))
    return 0


def _options_line(d: dict[str, Any]) -> str:
    opts = d.get("options") or {}
    return "; ".join(f"{k}={json.dumps(v['value'])} ({v['owner']}, {v['source']})" for k, v in opts.items()) or "(none)"


def _print_plan(d: dict[str, Any]) -> None:
    """The plan as text: identical layers grouped, each scheme described once (``--json``: all)."""
    print(f"checkpoint:   {d['path']}")
    print(f"architecture: {d['architecture']}")
    print(f"backend:      {d['backend']} [{d['backend_plugin']}] ({d['detect_reason']})")
    print(f"prefix:       {d['prefix'] or '(none)'}")
    print(f"options:      {_options_line(d)}")
    print("packed modules: " + "; ".join(f"{k} -> {v}" for k, v in d["packed_modules"].items()))
    print(f"parameters:   {d['parameters']} from {d['tensors_used']} tensors, {d['weight_bytes']:,} bytes; "
          f"plan {d['plan_ms']} ms")
    for line in plan_lines(d["schemes"], d["attention_layouts"]):
        print(line)
    for rule, names in d["skipped"].items():
        print(f"skipped {len(names)} tensor(s) by rule {rule}")
    if d["problems"]:
        print(f"problems:     {len(d['problems'])} (on stderr)")
        _print_problems(d)
    else:
        print("problems:     none")


def _print_problems(d: dict[str, Any]) -> None:
    """A plan's problems on stderr, one line per cause (as every command's errors are)."""
    groups = d.get("problem_groups") or [f"{p['severity']}: {p['message']}" for p in d["problems"]]
    distinct = f", {len(groups)} line(s): problems sharing a cause said once" if len(groups) != len(d["problems"]) else ""
    print(f"problems ({len(d['problems'])}{distinct}):", file=sys.stderr)
    for line in groups:
        print(f"  {line}", file=sys.stderr)


def _non_negative(text: str) -> int:
    """argparse type: an integer >= 0 (a usage error naming the value otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _ckpt_options(args: argparse.Namespace) -> dict[str, Any]:
    opts = _options(args.option)
    if getattr(args, "strict_split", False):
        opts["strict_split"] = True
    return opts


def cmd_plan(args: argparse.Namespace) -> int:
    from .plan import build_plan

    if args.tp < 1:
        raise QuantplugError(f"--tp {args.tp}: expected a world size >= 1")
    p = build_plan(args.path, backend=args.backend, options=_ckpt_options(args), world_size=args.tp)
    d = p.to_dict()
    if args.json:
        print(json.dumps(d, indent=2))  # the problems are in the JSON too
        if d["problems"]:
            _print_problems(d)
    else:
        _print_plan(d)
        if p.parallel is not None:
            print("\n".join(parallel_lines(p.parallel.to_dict())))
    return 1 if p.errors else 0


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _load(args: argparse.Namespace) -> Any:
    from .loader import load

    return load(args.path, backend=args.backend, options=_ckpt_options(args))


def cmd_load(args: argparse.Namespace) -> int:
    from .loader import model_bytes

    t0 = time.perf_counter()
    model = _load(args)
    secs = time.perf_counter() - t0
    d = model.quantplug_plan.to_dict()
    d.update({"model_bytes": model_bytes(model), "seconds": round(secs, 4), "peak_rss_bytes": _rss_peak(),
              "bytes_read": model.load_report["bytes_read"]})
    if args.comm is not None:  # under torchrun: one object per rank, printed by rank 0
        from .parallel import gather_json

        mine = {"rank": args.comm.rank, "world_size": args.comm.world, "bytes_read": d["bytes_read"],
                "peak_rss": d["peak_rss_bytes"], "model_bytes": d["model_bytes"], "seconds": d["seconds"]}
        for obj in gather_json(args.comm, mine):
            print(json.dumps(obj) if args.json else
                  f"rank {obj['rank']}: read {obj['bytes_read']:,} bytes, {obj['model_bytes']:,} bytes in "
                  f"parameters/buffers, {obj['seconds']:.3f} s, peak RSS {obj['peak_rss'] / 2**20:.1f} MiB")
        return 0
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        _print_plan(d)
        print(f"loaded:       {d['model_bytes']:,} bytes in parameters/buffers, {secs:.3f} s, "
              f"peak RSS {d['peak_rss_bytes'] / 2**20:.1f} MiB")
    return 0


def cmd_forward(args: argparse.Namespace) -> int:
    import torch

    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        raise QuantplugError(f"--tokens {args.tokens!r}: expected comma-separated integers") from None
    model = _load(args)
    vocab = model.quantplug_plan.model_config.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad or not tokens:
        raise QuantplugError(f"--tokens: ids must be in [0, {vocab}); got {bad or 'none'}")
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0]
    top = logits[-1].topk(min(5, vocab))
    result = {"tokens": tokens, "shape": list(logits.shape), "argmax": logits.argmax(-1).tolist(),
              "last_top5": {"ids": top.indices.tolist(), "logits": [round(x, 6) for x in top.values.tolist()]}}
    if args.json:
        result["logits"] = logits.tolist()
        print(json.dumps(result))
    else:
        print(f"logits {tuple(logits.shape)}; argmax per position: {result['argmax']}")
        print(f"last position top-5: {result['last_top5']['ids']} {result['last_top5']['logits']}")
    return 0


# -- quantplug generate (the generation loop is quantplug.generate) ----------------------------------


def cli_generate(args: Any, model: Any) -> int:
    """``quantplug generate``: stream the new text (or token ids) to stdout, or one JSON object.

    Statistics a backend exposes (``quantplug.api.expose_stats``): ``stats`` holds, per source,
    each counter's growth over the decode steps. A source counting ``expert_reads`` (the core's
    expert cache, ``expert_cache_mb``) also gives ``expert_cache_hit_rate`` = 1 - expert reads /
    routed experts used (distinct experts per MoE layer and step: the core cache's ``requests``,
    another source's counted at the routers' forward), ``pack_reads_per_expert_use`` (above 1
    when an expert is read more than once per use) and ``ssd_bytes_per_token`` (``bytes_read`` per
    decode step)."""
    import torch

    from .experts import ExpertCache
    from .generate import GenerationError
    from .stats import BYTES_READ, EXPERT_READS, stats_sources
    from .tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(args.path)
    except QuantplugError as exc:
        if args.tokens is None:
            raise
        tok = None  # ids given: the text is only for display, so generate and print ids instead
        print(f"quantplug: tokenizer not usable, printing token ids ({exc})", file=sys.stderr)
    if args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise GenerationError(f"--tokens {args.tokens!r}: expected comma-separated integers") from None
    else:
        if tok is None:
            raise GenerationError(f"{args.path}: no tokenizer (tokenizer.json, tiktoken.model or a GGUF vocabulary); "
                                  "pass --tokens")
        if args.chat:
            ids = tok.encode(tok.render_chat([{"role": "user", "content": args.prompt}]), add_special_tokens=False)
        else:
            ids = tok.encode(args.prompt)
    if not ids:
        raise GenerationError("the prompt has no tokens")
    sample = args.top_p is not None or args.top_k is not None or bool(args.temperature)
    gen = model.stream(torch.tensor([ids]), args.max_new_tokens, do_sample=sample,
                       temperature=args.temperature or 1.0, top_p=args.top_p, top_k=args.top_k,
                       generator=torch.Generator().manual_seed(args.seed) if sample else None,
                       speculative=getattr(args, "speculative", None))
    sources = stats_sources(model)
    packs = next((s for s in sources.values() if EXPERT_READS in s.stats()), None)
    before: dict[str, Mapping[str, float]] = {}
    uses = [0]  # distinct routed experts per MoE layer and step, summed over decode steps
    hooks = []
    if packs is not None:
        from .blocks.router import Router

        def count(_mod: Any, _inp: Any, out: Any) -> None:
            if before:
                uses[0] += int(torch.unique(out[0]).numel())

        hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, Router)]
    new: list[int] = []
    shown = ""
    for step, t in enumerate(gen):
        new.append(int(t[0]))
        if step == 0:
            before = {name: dict(s.stats()) for name, s in sources.items()}
        if args.json:
            continue
        if tok is None:
            print(new[-1], end=" ", flush=True)
            continue
        text = tok.decode(new, skip_special_tokens=True)
        if text.startswith(shown) and not text.endswith("\ufffd"):
            print(text[len(shown):], end="", flush=True)
            shown = text
    result: dict[str, Any] = {"tokens": new}
    if tok is not None:
        result["text"] = tok.decode(new, skip_special_tokens=True)
    result.update({"tokens_per_second": round(gen.tokens_per_second(), 3),
                   "prefill_seconds": round(gen.prefill_seconds, 6),
                   "kv_cache_bytes_per_token": gen.cache.bytes_per_token()})
    if gen.speculative is not None:
        rate = gen.acceptance_rate()
        result.update({"speculative": gen.speculative, "drafts": gen.drafts, "accepted_drafts": gen.accepted,
                       "acceptance_rate": None if rate is None else round(rate, 4),
                       "mtp_kv_cache_bytes_per_token": gen.mtp_cache.bytes_per_token() if gen.mtp_cache else 0})
    for h in hooks:
        h.remove()
    if sources:
        result["stats"] = {name: {k: v - before.get(name, {}).get(k, 0) for k, v in s.stats().items()}
                           for name, s in sources.items()}
    if packs is not None:
        # expert-level: each routed expert a decode step uses is a hit unless the pack was read for it
        # (the cache's own hits/misses count one lookup per projection)
        name = next(n for n, s in sources.items() if s is packs)
        grown, steps = result["stats"][name], max(len(new) - 1, 1)
        misses = grown[EXPERT_READS]
        # the core's cache is asked once per distinct expert of a layer and step (a decode step routes
        # on Python numbers, past the routers' forward hooks): its requests are the uses
        used = grown["requests"] if isinstance(packs, ExpertCache) else uses[0]
        result["expert_cache_hit_rate"] = round(max(0.0, 1 - misses / used), 4) if used else None
        # > 1 when experts are read more than once per use (prefetches that were not used, thrashing)
        result["pack_reads_per_expert_use"] = round(misses / used, 4) if used else None
        result["ssd_bytes_per_token"] = round(grown.get(BYTES_READ, 0) / steps, 1)
    if args.json:
        print(json.dumps(result))
        return 0
    if tok is not None and result["text"] != shown:
        print(result["text"][len(shown):] if result["text"].startswith(shown) else "", end="")
    print(flush=True)
    extra = ""
    if gen.speculative is not None:
        rate = result["acceptance_rate"]
        extra += (f", {gen.speculative} drafts {gen.drafts}, accepted {gen.accepted}"
                  f" ({'n/a' if rate is None else f'{rate:.1%}'})")
    if packs is not None:
        extra += (f", expert cache hit rate {result['expert_cache_hit_rate']}, "
                 f"{result['ssd_bytes_per_token']:,.0f} SSD bytes/token")
    print(f"[{len(new)} tokens, {result['tokens_per_second']:.2f} tok/s decode, prefill "
          f"{gen.prefill_seconds:.3f} s, KV cache {result['kv_cache_bytes_per_token']:,} bytes/token{extra}]",
          file=sys.stderr)
    return 0


# -- quantplug eval (the scoring is quantplug.eval) ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _reference_from_model(args: Any, load: Callable[[str], Any], text: str) -> Iterator[tuple[Path | None, list[int]]]:
    import gc
    import os
    import tempfile

    from .eval import evaluate, text_tokens
    """``--reference-model``: load it, save its distributions over the text to a temporary logits
    file (next to --save-logits, else the system's temporary directory), release it; yields the
    file (None on ranks other than 0) and its tokens; the file is removed afterwards."""
    ref = load(args.reference_model)
    tokens, bos = text_tokens(args.reference_model, text)
    rank = int(getattr(ref, "load_report", {}).get("rank", 0))
    where = Path(args.save_logits).resolve().parent if args.save_logits else None
    path: Path | None = None
    if rank == 0:
        fd, name = tempfile.mkstemp(prefix="quantplug-reference-", suffix=".logits", dir=where)
        os.close(fd)
        path = Path(name)
    try:
        res = evaluate(ref, tokens, n_ctx=args.ctx, bos=bos, batch=args.batch, max_chunks=args.max_chunks,
                       save_logits=path, progress=None)
        del ref
        gc.collect()
        if res is not None:
            print(f"reference {args.reference_model}: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f} "
                  f"({res.logits_bytes:,} bytes of logits, temporary)", file=sys.stderr)
        yield path, tokens[:len(tokens) // args.ctx * args.ctx]
    finally:
        if path is not None:
            path.unlink(missing_ok=True)


def cli_eval(args: Any, load: Callable[[str], Any]) -> int:
    """``quantplug eval``: checks the arguments before loading anything, then scores (module
    docstring); text (llama.cpp's lines) or ``--json``. ``load(path)`` loads a checkpoint with the
    command's options."""
    from .eval import EvalError, LogitsReader, check_ctx, checkpoint_bos, evaluate, read_text, text_tokens

    if args.text is None and args.reference is None:
        raise EvalError("--text FILE is needed (or --reference OUT, whose tokens are evaluated)")
    if args.reference_model is not None and args.text is None:
        raise EvalError("--reference-model needs --text FILE")
    text = read_text(args.text) if args.text is not None else None
    if args.ctx is not None:
        check_ctx(args.ctx)
    if args.batch < 1:
        raise EvalError(f"--batch {args.batch}: expected >= 1")
    if args.max_chunks is not None and args.max_chunks < 1:
        raise EvalError(f"--max-chunks {args.max_chunks}: expected >= 1")
    header: LogitsReader | None = None
    if args.reference is not None:  # checked (header, size, tokens) before the model loads
        header = LogitsReader(args.reference)
        header.close()
        if args.ctx is not None and args.ctx != header.n_ctx:
            raise EvalError(f"reference {header.path} was computed with --ctx {header.n_ctx}, not {args.ctx}")
        args.ctx = header.n_ctx
    if args.ctx is None:
        args.ctx = 512
    with contextlib.ExitStack() as stack:
        reference: Path | None = Path(args.reference) if args.reference is not None else None
        ref_tokens: list[int] | None = None
        if args.reference_model is not None:
            assert text is not None
            reference, ref_tokens = stack.enter_context(_reference_from_model(args, load, text))
        model = load(args.path)
        from .generate import max_seq_len

        check_ctx(args.ctx, max_seq_len(model.text_lm().config))
        tokens: Sequence[int] | None
        if text is not None:
            tokens, bos = text_tokens(args.path, text)
        else:
            assert header is not None
            tokens, bos = None, checkpoint_bos(model, args.path, int(header.tokens[0]))
        if ref_tokens is not None and tokens is not None and reference is None:
            tokens = ref_tokens  # ranks other than 0: the reference's tokens, checked on rank 0
        result = evaluate(model, tokens, n_ctx=args.ctx, bos=bos, batch=args.batch, max_chunks=args.max_chunks,
                          save_logits=args.save_logits, reference=reference, progress=None)
    if result is None:
        return 0
    if args.json:
        d = result.to_dict()
        d["path"] = str(args.path)
        d["reference"] = str(args.reference_model or args.reference) if (args.reference_model or args.reference) else None
        print(json.dumps(d))
    else:
        print("\n".join(result.lines()))
    return 0


# -- commands -------------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    return cli_generate(args, _load(args))


def cmd_eval(args: argparse.Namespace) -> int:
    def load(path: str) -> Any:
        from .loader import load as load_checkpoint

        backend = args.backend if path == args.path else None
        return load_checkpoint(path, backend=backend, options=_ckpt_options(args))

    return cli_eval(args, load)


def cmd_explain(args: argparse.Namespace) -> int:
    from .plan import build_plan

    p = build_plan(args.path, backend=args.backend, options=_options(args.option))
    print("\n".join(explain_lines(p, args.layer)))
    print(f"options: {_options_line(p.to_dict())}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import format_rows, run_demo

    rows = run_demo()
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
    else:
        print(format_rows(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="quantplug", description="Load quantized DeepSeek-V3 / Kimi checkpoints.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list installed backends")
    p.add_argument("--json", action="store_true")
    p.add_argument("--options", action="store_true",
                   help="list every option instead: name, owner, scope, type, default, choices, help")
    p.set_defaults(fn=cmd_plugins)

    def ckpt_cmd(name: str, help_: str, fn: Any) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help_)
        c.add_argument("path")
        c.add_argument("--backend", default=None, help="use this backend even if others claim the checkpoint")
        c.add_argument("--option", "-o", action="append", metavar="KEY=VALUE",
                       help="load option (`quantplug plugins --options` lists them), converted by its declared type")
        c.add_argument("--strict-split", action="store_true",
                       help="tensor parallel: a layer that cannot split is an error, not replicated")
        c.set_defaults(fn=fn)
        return c

    pl = ckpt_cmd("plan", "show the load plan (headers only)", cmd_plan)
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--tp", type=int, default=1, metavar="N",
                    help="show the split over N tensor-/expert-parallel ranks and each rank's bytes")
    ckpt_cmd("load", "load and report bytes, seconds, peak RSS", cmd_load).add_argument("--json", action="store_true")
    f = ckpt_cmd("forward", "load and run one forward pass", cmd_forward)
    f.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    f.add_argument("--json", action="store_true")
    g = ckpt_cmd("generate", "generate text with the MLA latent cache (greedy unless sampling is asked)", cmd_generate)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer")
    src.add_argument("--tokens", help="comma-separated prompt token ids (no tokenizer needed)")
    g.add_argument("--max-new-tokens", type=_non_negative, default=32, help="tokens to generate (>= 0)")
    g.add_argument("--temperature", type=float, default=None, help="sample at this temperature (0 or unset: greedy)")
    g.add_argument("--top-p", type=float, default=None, help="sample from the top-p nucleus")
    g.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the checkpoint's chat template")
    g.add_argument("--speculative", choices=("mtp",), default=None,
                   help="mtp: greedy speculative decoding with the checkpoint's multi-token-prediction layer "
                        "(same tokens as greedy; prints drafts and acceptance)")
    g.add_argument("--json", action="store_true", help="one JSON object: tokens, text, speed, cache bytes")
    ev = ckpt_cmd("eval", "perplexity over a text (llama-perplexity's scoring); KL-divergence against a reference",
                  cmd_eval)
    ev.add_argument("--text", metavar="FILE", help="UTF-8 text to score (tokenized with the checkpoint's tokenizer)")
    ev.add_argument("--ctx", type=int, default=None, metavar="N",
                    help="tokens per window (default 512; a --reference file's own); the second half is scored")
    ev.add_argument("--batch", type=int, default=1, metavar="B", help="windows per forward pass (default 1)")
    ev.add_argument("--max-chunks", type=int, default=None, metavar="K", help="score at most K windows")
    ev.add_argument("--save-logits", metavar="OUT",
                    help="stream the distributions to OUT (llama.cpp's --kl-divergence-base format)")
    ref = ev.add_mutually_exclusive_group()
    ref.add_argument("--reference", metavar="OUT",
                     help="a saved logits file (ours or llama-perplexity's): KLD, same top p, delta PPL against it")
    ref.add_argument("--reference-model", metavar="PATH2",
                     help="a second checkpoint as the reference (evaluated first, to a temporary logits file)")
    ev.add_argument("--json", action="store_true", help="one JSON object")
    e = ckpt_cmd("explain", "each decision for one layer or tensor: value, plugin, reason", cmd_explain)
    e.add_argument("layer")
    d = sub.add_parser("demo", help="export tiny checkpoints with every backend, load them, compare with dense")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_demo)
    pm = get_plugin_manager()
    try:
        pm.call("quantplug_cli_commands", pm.active(), subparsers=sub)
    except QuantplugError as exc:  # a broken plugin must not take the whole CLI down
        print(f"warning: {exc}; its commands are unavailable", file=sys.stderr)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 ok; 1 a QuantplugError (one line; a plan's problems listed); 2 usage; 3 anything
    else (one line). ``--debug`` shows tracebacks instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        parser = build_parser()  # loads the plugins: a strict-mode import failure stops here
        args = parser.parse_args(argv)
    except SystemExit:
        raise  # argparse: usage (2) or --help (0)
    except BaseException as exc:  # noqa: BLE001 (one line; exit code by kind)
        return _report(exc, debug)
    from .parallel import torchrun_session

    try:
        # under torchrun (WORLD_SIZE > 1): the group comes from the environment; only rank 0 prints
        with torchrun_session() as comm:
            args.comm = comm
            return int(args.fn(args))
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001
        return _report(exc, args.debug)


def _report(exc: BaseException, debug: bool) -> int:
    """One line on stderr for ``exc`` (a plan's problems: one per cause) and the exit code."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, GeneratorExit):
        raise exc
    if debug:
        raise exc
    if isinstance(exc, PlanError):
        print(str(exc), file=sys.stderr)
        return 1
    if isinstance(exc, QuantplugError):
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"error: unexpected {type(exc).__name__}: {exc}. This is a bug in quantplug, a plugin or a library; "
          "--debug shows the traceback", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
