"""Text generation: the MLA latent KV cache, sampling, ``generate`` and its streaming form.

The cache keeps, per MLA layer and token, exactly what attention reads from the past: the normed
compressed latent ``c_kv`` (``kv_lora_rank`` values) and the roped shared key ``k_pe``
(``qk_rope_head_dim`` values), in the model dtype. For DeepSeek-V3 that is (512 + 64) x 61 layers
per token, where an expanded per-head cache (transformers' ``DynamicCache``) holds
128 heads x (192 + 128) = 40,960 values per layer: 71x more. Decode attends on the latent
directly (the absorbed form, see :class:`quantplug.blocks.mla.MLA`).

``generate`` follows transformers' argument names and meanings (greedy by default; a row that
emits an end-of-sequence id stops and is padded with the first EOS id; ``min_new_tokens`` masks
EOS; sampling applies temperature, then top-k, then top-p). ``stream`` yields the new tokens
step by step and records timings for the CLI. ``speculative="mtp"`` decodes greedily with the
checkpoint's multi-token-prediction layer as the drafter (:meth:`Generation._run_mtp`): the same
tokens, up to two per main-model forward; a rejected draft is rolled back with
:meth:`LatentCache.truncate`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

# the caches live with the blocks (quantplug.blocks.cache); their names stay importable from here
from .blocks.cache import CHUNK as CHUNK
from .blocks.cache import GenerationError as GenerationError
from .blocks.cache import HybridCache as HybridCache
from .blocks.cache import KDAState as KDAState
from .blocks.cache import LatentCache as LatentCache
from .blocks.cache import MLACache as MLACache
from .blocks.cache import layer_cache as layer_cache
from .memory import gc_paused

if TYPE_CHECKING:
    from .contract.config import ModelConfig


def max_seq_len(cfg: ModelConfig) -> int:
    """Longest sequence the config allows: ``max_position_embeddings``, or with yarn at least
    ``factor x original_max_position_embeddings`` (yarn's extended context)."""
    n = cfg.max_position_embeddings
    if cfg.rope.type == "yarn":
        n = max(n, int(cfg.rope.factor * cfg.rope.original_max_position_embeddings))
    return n


def new_cache(lm: Any, batch: int, capacity: int) -> Any:
    """An empty cache for the text model ``lm``, room for ``capacity`` tokens: the one its
    architecture declares (``lm.qp_new_cache(batch, capacity, limit)``, ``limit`` the longest
    sequence its config allows), else an :class:`MLACache` of one :func:`layer_cache` per
    ``lm.model.layers[i].self_attn``. Generation uses a cache's ``length`` and ``truncate``."""
    limit = max_seq_len(lm.config)
    make = getattr(lm, "qp_new_cache", None)
    if make is not None:
        return make(batch, capacity, limit)
    emb = lm.model.embed_tokens
    device = next(iter(emb.parameters())).device
    return MLACache([layer_cache(layer.self_attn, batch, capacity, limit, dtype=emb.model_dtype, device=device)
                     for layer in lm.model.layers])


def new_mtp_cache(lm: Any, batch: int, capacity: int) -> Any:
    """An empty one-layer cache for ``lm``'s first MTP layer (its own latent, apart from the main
    model's, with its indexer keys on DeepSeek-V3.2), room for ``capacity`` tokens; the one its
    architecture declares (``lm.qp_new_mtp_cache(batch, capacity, limit)``) where it has one."""
    make = getattr(lm, "qp_new_mtp_cache", None)
    if make is not None:
        return make(batch, capacity, max_seq_len(lm.config))
    emb = lm.model.embed_tokens
    device = next(iter(emb.parameters())).device
    return MLACache([layer_cache(lm.mtp[0].block.self_attn, batch, capacity, max_seq_len(lm.config),
                                 dtype=emb.model_dtype, device=device)])


def checkpoint_eos(model: Any) -> tuple[int, ...]:
    """End-of-sequence ids of the loaded checkpoint: ``generation_config.json``'s ``eos_token_id``,
    else config.json's (text config, then the wrapper's); an int or a list; () if none. A value of
    another type is a ConfigError naming the file and key (never skipped)."""
    from .contract.config import MAX_VOCAB
    from .validation import Fields

    def read(f: Fields) -> tuple[int, ...] | None:
        v = f.raw("eos_token_id")
        if v is None:
            return None
        if isinstance(v, list):
            ids = f.int_list("eos_token_id", 0, MAX_VOCAB - 1)
            return ids or ()
        return (f.get_int("eos_token_id", 0, MAX_VOCAB - 1),)

    plan = getattr(model, "quantplug_plan", None)
    if plan is not None:
        root = plan.checkpoint.path
        gen = plan.checkpoint.sidecar("generation_config.json")
        if gen is not None:
            found = read(Fields(gen, str(root / "generation_config.json")))
            if found is not None:
                return found
        top = Fields(plan.checkpoint.config, str(root / "config.json"))
        text = top.get_obj("text_config")
        for f in (text, top):
            found = read(f) if f is not None else None
            if found is not None:
                return found
        return ()
    found = read(Fields(model.text_lm().config.raw, "config.json"))
    return found if found is not None else ()


def _eos_ids(model: Any, eos_token_id: Any) -> tuple[int, ...]:
    if eos_token_id == "checkpoint":
        return checkpoint_eos(model)
    if eos_token_id is None:
        return ()
    return tuple(int(x) for x in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]))


def process_logits(logits: torch.Tensor, *, step: int, eos: Sequence[int], min_new_tokens: int, do_sample: bool,
                   temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """transformers' processors, in its order: min_new_tokens (EOS masked), then, when sampling,
    temperature, top-k and top-p (filtered entries become -inf). ``logits`` [B, V] float32."""
    if step < min_new_tokens and eos:
        logits = logits.clone()
        logits[:, list(eos)] = float("-inf")
    if not do_sample:
        return logits
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # transformers' TopPLogitsWarper: drop the low tail whose cumulative probability <= 1 - top_p,
        # always keeping the most likely token
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


def _check_args(max_new_tokens: int, min_new_tokens: int, do_sample: bool, temperature: float,
                top_k: int | None, top_p: float | None) -> None:
    for name, value in (("max_new_tokens", max_new_tokens), ("min_new_tokens", min_new_tokens)):
        if value < 0:  # only the argument that is wrong (the CLI has --max-new-tokens, not min_new_tokens)
            raise GenerationError(f"{name} must be >= 0, got {value}")
    if do_sample and not temperature > 0:
        raise GenerationError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k is not None and top_k < 1:
        raise GenerationError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise GenerationError(f"top_p must be in (0, 1], got {top_p}")


#: the values of ``generate(..., speculative=...)`` besides None
SPECULATIVE = ("mtp",)


class Generation:
    """An iterator over new tokens (LongTensor [B] per step) for ``input_ids`` [B, T].

    After (or during) iteration: ``tokens`` (the steps so far), ``prefill_seconds`` (prompt
    forward + first token), ``decode_seconds`` (every later step; model and sampling time only,
    not the consumer's), ``cache`` (the :class:`MLACache`).

    ``speculative="mtp"``: greedy speculative decoding with the checkpoint's first MTP layer
    (:meth:`_run_mtp`); ``drafts`` / ``accepted`` count its drafts and the accepted ones
    (:meth:`acceptance_rate`), ``mtp_cache`` is the MTP layer's own cache.
    """

    def __init__(self, model: Any, input_ids: torch.Tensor, max_new_tokens: int, *, min_new_tokens: int = 0,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: Any = "checkpoint",
                 generator: torch.Generator | None = None, speculative: str | None = None) -> None:
        _check_args(max_new_tokens, min_new_tokens, do_sample, temperature, top_k, top_p)
        if speculative is not None and speculative not in SPECULATIVE:
            raise GenerationError(f"speculative={speculative!r}: expected None or one of {', '.join(SPECULATIVE)}")
        if speculative is not None and do_sample:
            raise GenerationError(f"speculative={speculative!r} decodes greedily only (it accepts a draft when it "
                                  "equals the main model's argmax; rejection sampling is not implemented): drop "
                                  "do_sample / temperature / top_k / top_p, or speculative")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1 or input_ids.dtype not in (torch.int64, torch.int32):
            raise GenerationError(f"input_ids must be an integer tensor [batch, tokens >= 1], got "
                                  f"{input_ids.dtype} {list(input_ids.shape)}")
        self.lm = model.text_lm()
        vocab = self.lm.config.vocab_size
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise GenerationError(f"input_ids must be in [0, {vocab}); got values {int(input_ids.min())}.."
                                  f"{int(input_ids.max())}")
        self.input_ids = input_ids.long()
        self.max_new_tokens = max_new_tokens
        self.eos = _eos_ids(model, eos_token_id)
        self.settings: dict[str, Any] = {"min_new_tokens": min_new_tokens, "do_sample": do_sample, "temperature": temperature,
                         "top_k": top_k, "top_p": top_p}
        self.generator = generator
        self.tokens: list[torch.Tensor] = []
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        b, t = self.input_ids.shape
        limit = max_seq_len(self.lm.config)
        if t + max_new_tokens > limit:
            raise GenerationError(f"prompt of {t} tokens + max_new_tokens {max_new_tokens} exceeds the model's "
                                  f"context of {limit} tokens (max_position_embeddings, yarn included)")
        self.speculative = speculative
        #: MTP drafts made / accepted (``speculative="mtp"``)
        self.drafts = 0
        self.accepted = 0
        self.mtp_cache: MLACache | None = None
        if speculative is not None:
            self._check_speculative(model, b)
        with torch.inference_mode():
            self.cache = new_cache(self.lm, b, t + max_new_tokens)
            if speculative is not None:
                self.mtp_cache = new_mtp_cache(self.lm, b, t + max_new_tokens)
        #: speculative state: the last emitted token (not yet in the main cache) and the MTP draft after it
        self._last: torch.Tensor | None = None
        self._draft: torch.Tensor | None = None
        self._it = self._run_mtp() if speculative is not None else self._run()

    def _check_speculative(self, model: Any, batch: int) -> None:
        """What ``speculative="mtp"`` needs: batch 1, MTP layers loaded. Tensor / expert parallel
        ranks run it in step: every decision (acceptance, the bonus token, the draft) is made on
        logits the ranks hold alike (the LM head gathers them), so they run the same forwards."""
        if batch != 1:
            raise GenerationError(f"speculative='mtp' decodes one sequence at a time, got a batch of {batch}: rows "
                                  "accept drafts independently, which one shared cache length cannot follow; "
                                  "generate the rows one by one, or without speculative")
        if not len(getattr(self.lm, "mtp", ())):
            k = self.lm.config.num_nextn_predict_layers
            why = ("the checkpoint declares none (num_nextn_predict_layers = 0)" if not k else
                   f"num_nextn_predict_layers = {k}, but they were not loaded (load option mtp=false, or the "
                   "checkpoint stores none of their tensors: see the plan's mtp_layers decision)")
            raise GenerationError(f"speculative='mtp' needs the checkpoint's MTP layers: {why}")

    def acceptance_rate(self) -> float | None:
        """Accepted drafts over drafts made; None when no draft was made."""
        return self.accepted / self.drafts if self.drafts else None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        return next(self._it)

    def _next(self, ids: torch.Tensor, step: int) -> torch.Tensor:
        """The next token of every sequence after ``ids``: a greedy pick that no processor changes
        (not sampling; EOS not masked at this step) comes with the logits from the model's
        ``next_tokens`` (one native call per decode step), anything else from :meth:`_pick`."""
        s = self.settings
        greedy = not s["do_sample"] and not (step < s["min_new_tokens"] and self.eos)
        next_tokens = getattr(self.lm, "next_tokens", None) if greedy else None
        if next_tokens is not None:
            return next_tokens(ids, self.cache)[1]
        return self._pick(self.lm.next_logits(ids, self.cache), step)

    def _pick(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        scores = process_logits(logits, step=step, eos=self.eos, **self.settings)
        if not self.settings["do_sample"]:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)

    def _run(self) -> Iterator[torch.Tensor]:
        if self.max_new_tokens == 0:
            return
        b = self.input_ids.shape[0]
        eos = torch.tensor(self.eos, dtype=torch.long, device=self.input_ids.device)
        finished = torch.zeros(b, dtype=torch.bool, device=self.input_ids.device)
        t0 = time.perf_counter()
        with torch.inference_mode(), gc_paused():
            tok = self._next(self.input_ids, 0)
        self.prefill_seconds = time.perf_counter() - t0
        for step in range(self.max_new_tokens):
            if step:
                t0 = time.perf_counter()
                with torch.inference_mode(), gc_paused():
                    tok = self._next(tok.unsqueeze(1), step)
            if len(self.eos):
                tok = torch.where(finished, eos[0], tok)
                finished = finished | torch.isin(tok, eos)
            if step:
                self.decode_seconds += time.perf_counter() - t0
            self.tokens.append(tok)
            yield tok
            if len(self.eos) and bool(finished.all()):
                return

    def _greedy(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """The greedy pick [B] of float32 ``logits`` [B, V] at new-token ``step`` (EOS masked before
        ``min_new_tokens``), as plain greedy decoding picks it."""
        return process_logits(logits, step=step, eos=self.eos, **self.settings).argmax(dim=-1)

    def _pick_draft(self, logits: torch.Tensor) -> torch.Tensor:
        """The MTP layer's draft [B] from its float32 ``logits`` [B, V]: greedy."""
        return logits.argmax(dim=-1)

    def _run_mtp(self) -> Iterator[torch.Tensor]:
        """Greedy speculative decoding with the first MTP layer (ARCHITECTURES D3 / D4), batch 1.

        State before a step: the main cache holds positions 0..L-1, ``_last`` is x_L (emitted, not
        yet cached), the MTP cache holds the pairs (h_j, x_{j+1}) for j < L (h: the main model's
        normed final hidden state) and ``_draft`` d is its guess for x_{L+1}. A step runs the main
        model once on [x_L, d] (positions L, L+1): a = its pick at L. d == a: d is accepted and the
        pick at L+1 is a bonus token (two tokens this step). Otherwise a is emitted and d's entry
        is rolled back in the main cache (:meth:`MLACache.truncate`). Then the MTP layer runs on the
        pairs of the accepted positions only (h_L with x_{L+1}, and h_{L+1} with the bonus), so its
        cache never holds a rejected token and needs no roll-back; its last row drafts the next d.
        Every emitted token is the main model's greedy pick given the tokens before it, so the
        output is plain greedy decoding's (up to float rounding between a 2-token forward and a
        1-token step). The last token before ``max_new_tokens`` is a plain step; EOS and
        ``max_new_tokens`` stop exactly where plain greedy stops (a bonus token past either is dropped).
        """
        if self.max_new_tokens == 0:
            return
        lm, mtp_cache = self.lm, self.mtp_cache
        assert mtp_cache is not None
        eos = torch.tensor(self.eos, dtype=torch.long, device=self.input_ids.device)
        finished = torch.zeros(self.input_ids.shape[0], dtype=torch.bool, device=self.input_ids.device)
        t0 = time.perf_counter()
        with torch.inference_mode(), gc_paused():
            hidden, logits = lm.hidden_and_logits(self.input_ids, self.cache, last_only=True)
            tok = self._greedy(logits[:, -1], 0)
            if self.max_new_tokens > 1:
                # the MTP layer over the prompt: pairs (h_j, x_{j+1}), the last one with the new token
                nxt = torch.cat([self.input_ids[:, 1:], tok.unsqueeze(1)], dim=1)
                self._draft = self._pick_draft(lm.mtp_logits(nxt, hidden, mtp_cache)[:, -1])
        self.prefill_seconds = time.perf_counter() - t0
        pending, step = [tok], 0
        while True:
            for t in pending:
                if len(self.eos):
                    t = torch.where(finished, eos[0], t)
                    finished = finished | torch.isin(t, eos)
                self.tokens.append(t)
                yield t
                step += 1
                if step >= self.max_new_tokens or (len(self.eos) and bool(finished.all())):
                    return
            self._last = pending[-1]
            t0 = time.perf_counter()
            with torch.inference_mode(), gc_paused():
                pending = self._mtp_step(step)
            self.decode_seconds += time.perf_counter() - t0

    def _mtp_step(self, step: int) -> list[torch.Tensor]:
        """One speculative step (see :meth:`_run_mtp`) from new-token ``step``: the tokens it emits."""
        lm, last, d = self.lm, self._last, self._draft
        assert last is not None and self.mtp_cache is not None
        if self.max_new_tokens - step == 1 or d is None:
            return [self._next(last.unsqueeze(1), step)]  # one token left: a plain step
        self.drafts += 1
        start = self.cache.length
        native = self._native_spec_step(step)
        if native is not None:
            return native
        hidden, logits = lm.hidden_and_logits(torch.stack([last, d], dim=1), self.cache)
        a = self._greedy(logits[:, 0], step)
        if bool((a == d).all()):
            self.accepted += 1
            out = [d, self._greedy(logits[:, 1], step + 1)]
        else:
            self.cache.truncate(start + 1)   # roll back d's entry in every layer
            out, hidden = [a], hidden[:, :1]
        if step + len(out) >= self.max_new_tokens or any(int(t[0]) in self.eos for t in out):
            self._draft = None  # generation ends with these tokens (batch 1): no draft needed
            return out
        self._draft = self._pick_draft(lm.mtp_logits(torch.stack(out, dim=1), hidden, self.mtp_cache)[:, -1])
        return out

    def _native_spec_step(self, step: int) -> list[torch.Tensor] | None:
        """:meth:`_mtp_step`'s verify and draft in one native call (the model's
        ``speculative_step``) when its picks are plain argmaxes (EOS not masked at either step); the
        same tokens, acceptance and caches as the module path. None: the module path runs."""
        spec = getattr(self.lm, "speculative_step", None)
        if spec is None or (step + 1 < self.settings["min_new_tokens"] and self.eos):
            return None
        assert self._last is not None and self._draft is not None and self.mtp_cache is not None
        start = self.cache.length
        got = spec(self._last, self._draft, self.cache, self.mtp_cache)
        if got is None:
            return None
        (a, b), acc, dlogits, _ = got
        dev = self._last.device
        if acc:
            self.accepted += 1
            out = [self._draft, torch.tensor([b], device=dev)]
        else:
            self.cache.truncate(start + 1)  # roll back the draft's entry in every layer
            out = [torch.tensor([a], device=dev)]
        ends = step + len(out) >= self.max_new_tokens or any(int(t[0]) in self.eos for t in out)
        self._draft = None if ends else self._pick_draft(dlogits)
        return out

    def sequences(self) -> torch.Tensor:
        """The prompt and every token generated so far, [B, T + n]."""
        if not self.tokens:
            return self.input_ids
        return torch.cat([self.input_ids, torch.stack(self.tokens, dim=1)], dim=1)

    def tokens_per_second(self) -> float:
        """Decode rate: tokens after the first over the time spent producing them."""
        n = len(self.tokens) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


class GenerationMixin:
    """``generate`` and ``stream`` for the causal-LM classes; they provide ``text_lm()``. Also the
    fields :func:`quantplug.load` fills on the model it returns (declared here, so a loaded
    model's state is declared fields, not attributes the loader adds)."""

    #: the plan the model was loaded by (:class:`quantplug.api.LoadPlan`: headers, options, decisions)
    quantplug_plan: Any = None
    #: ``quantplug_plan.decisions``: each hook's answer and who gave it
    decisions: Any = None
    #: rank, world_size, bytes_read, experts_on_demand_bytes (the routed experts left in the files)
    load_report: dict[str, Any] | None = None
    #: wall seconds of plan and load
    load_seconds: float | None = None
    #: the statistics sources by name (:func:`quantplug.stats.expose_stats`; ``quantplug.stats(model)``)
    quantplug_stats: dict[str, Any] | None = None

    def text_lm(self) -> Any:
        """The DeepseekV3ForCausalLM that generates (itself, or a wrapper's ``language_model``):
        every class mixing this in overrides it."""
        raise NotImplementedError(f"{type(self).__name__} mixes in GenerationMixin but does not say which "
                                  "module is its text model (override text_lm)")

    def stream(self, input_ids: torch.Tensor, max_new_tokens: int = 20, **kwargs: Any) -> Generation:
        """Iterator over new tokens, one LongTensor [B] per step (see :class:`Generation`);
        keyword arguments as :meth:`generate`."""
        return Generation(self, input_ids, max_new_tokens, **kwargs)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 20, *, min_new_tokens: int = 0,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: Any = "checkpoint",
                 generator: torch.Generator | None = None, speculative: str | None = None) -> torch.Tensor:
        """Prompt ``input_ids`` [B, T] plus up to ``max_new_tokens`` new tokens: LongTensor [B, T + n].

        Greedy unless ``do_sample``; sampling applies ``temperature``, ``top_k``, ``top_p`` in that
        order and draws with ``generator``. ``eos_token_id``: an id or list of ids, None for none,
        default the checkpoint's (generation_config.json, then config.json). A row that emits EOS
        is finished and padded with the first EOS id; generation stops when every row is finished
        (n < max_new_tokens then). EOS cannot be chosen before ``min_new_tokens`` new tokens.

        ``speculative="mtp"``: greedy speculative decoding with the checkpoint's MTP layer (same
        tokens as greedy, up to two per main-model step; batch 1, no sampling; see
        :meth:`Generation._run_mtp` and docs/generation.md).
        """
        g = Generation(self, input_ids, max_new_tokens, min_new_tokens=min_new_tokens, do_sample=do_sample,
                       temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                       generator=generator, speculative=speculative)
        for _ in g:
            pass
        return g.sequences()
