"""Perplexity and KL-divergence of a loaded model over a text, scored as llama.cpp's
``llama-perplexity`` scores them (``quantplug eval``; docs/eval.md).

Scoring (llama.cpp ``tools/perplexity/perplexity.cpp``, ``perplexity()``): the text's tokens are
cut into ``n_chunk = len(tokens) // n_ctx`` non-overlapping windows of ``n_ctx`` tokens (a tail
shorter than a window is dropped); when the vocabulary adds a BOS, the first token of every window
is replaced by BOS for the forward pass; each window runs as its own sequence (no cache carried
over) and only its second half is scored: the logits at positions ``first = n_ctx // 2`` ..
``n_ctx - 2`` predict the tokens at ``first + 1`` .. ``n_ctx - 1`` (``n_ctx - 1 - first`` tokens a
window). PPL = exp(mean NLL); its standard error ``PPL * sqrt((E[nll^2] - E[nll]^2) / (count - 1))``.

Saved distributions (``--save-logits``) use llama.cpp's ``--kl-divergence-base`` file format, so
either tool reads the other's file (:class:`LogitsWriter`, :class:`LogitsReader`; little-endian)::

    "_logits_"                       8 bytes
    n_ctx, n_vocab, n_chunk          3 x int32
    tokens                           n_chunk * n_ctx x int32 (as tokenized: no BOS replacement)
    n_chunk * (n_ctx - 1 - n_ctx//2) rows of nv = 2 * ceil(n_vocab / 2) + 4 uint16:
        row[0:2] float32 scale, row[2:4] float32 min_log_prob, row[4:4 + n_vocab] q,
        log p_i = scale * q_i + min_log_prob (q_i = 0 for logits more than 16 below the max)

so ``2 * nv`` bytes per scored token (258,568 for DeepSeek-V3's 129,280 tokens), written one window
at a time. The KL-divergence statistics (:class:`KLDAccumulator`) are llama.cpp's
``kl_divergence()``: KLD(base || model) per token over the base entries with log p > -16, its mean
/ median / percentiles / max, "same top p" (the two argmaxes equal), delta p and the PPL ratio and
difference with their uncertainties.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from .errors import QuantplugError
from .memory import gc_paused

#: the logits file's magic (llama.cpp ``--kl-divergence-base``)
MAGIC = b"_logits_"
#: magic + n_ctx + n_vocab + n_chunk
HEADER_BYTES = 20
#: logits further than this below a row's max are stored as q = 0 (llama.cpp's cut)
LOG_RANGE = 16.0
#: rows per block when computing statistics (bounds the [rows, vocab] temporaries)
ROW_BLOCK = 64
#: largest n_ctx / vocabulary accepted from a logits file header
MAX_FILE_CTX = 1 << 24
MAX_FILE_VOCAB = 1 << 22


class EvalError(QuantplugError):
    """Bad evaluation arguments, an unusable text or logits file, or a reference that does not match."""


def row_values(n_vocab: int) -> int:
    """uint16 values per saved row: 4 (scale, min_log_prob) + n_vocab rounded up to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_per_window(n_ctx: int) -> int:
    """Tokens scored per window: the second half, ``n_ctx - 1 - n_ctx // 2``."""
    return n_ctx - 1 - n_ctx // 2


def logits_file_bytes(n_ctx: int, n_vocab: int, n_chunk: int) -> int:
    """Exact size of a logits file: header, tokens, ``2 * row_values(n_vocab)`` bytes per scored token."""
    return HEADER_BYTES + 4 * n_chunk * n_ctx + n_chunk * scored_per_window(n_ctx) * row_values(n_vocab) * 2


def check_ctx(n_ctx: int, limit: int | None = None) -> None:
    """``n_ctx`` scores at least one token per window (>= 3) and fits the model's context ``limit``."""
    if n_ctx < 3:
        raise EvalError(f"--ctx {n_ctx}: expected >= 3 (a window of n_ctx tokens scores its second half, "
                        f"n_ctx - 1 - n_ctx/2 tokens: {max(scored_per_window(n_ctx), 0)} here)")
    if limit is not None and n_ctx > limit:
        raise EvalError(f"--ctx {n_ctx} exceeds the model's context of {limit} tokens "
                        "(max_position_embeddings, yarn included)")


# -- the saved rows ------------------------------------------------------------------------------


def pack_rows(logits: torch.Tensor) -> np.ndarray:
    """float32 logits [N, V] -> uint16 rows [N, row_values(V)] as llama.cpp's ``log_softmax`` with
    ``log_prob`` writes them (float32 arithmetic as its C code, BOS-free): min_logit = max(min,
    max - 16), scale = (max - min_logit) / 65535, q = round-half-even((logit - min_logit) / scale)
    for logits above min_logit, else 0."""
    lg = logits.float()
    n, v = lg.shape
    mx = lg.max(dim=1).values
    mn = torch.maximum(lg.min(dim=1).values, mx - LOG_RANGE)
    lse = torch.log(torch.exp(lg - mx[:, None]).sum(dim=1, dtype=torch.float64)).float()
    min_log_prob = (mn - mx) - lse
    scale = (mx - mn) / 65535.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(inv[:, None] * (lg - mn[:, None]))
    q = torch.where(lg > mn[:, None], q, torch.zeros_like(q)).clamp_(0, 65535)
    out = np.zeros((n, row_values(v)), dtype="<u2")
    head = torch.stack([scale, min_log_prob], dim=1).cpu().numpy().astype("<f4")
    out[:, :4] = head.view("<u2")
    out[:, 4:4 + v] = q.to(torch.int32).cpu().numpy().astype("<u2")
    return out


def unpack_rows(rows: np.ndarray, n_vocab: int) -> torch.Tensor:
    """uint16 rows [N, row_values(V)] -> float32 log-probabilities [N, V] (``scale * q + min_log_prob``)."""
    head = torch.from_numpy(np.ascontiguousarray(rows[:, :4]).view("<f4").astype(np.float32))
    q = torch.from_numpy(rows[:, 4:4 + n_vocab].astype(np.float32))
    return head[:, :1] * q + head[:, 1:2]


class LogitsWriter:
    """Streams a logits file (module docstring): header and tokens at open, then :meth:`write` one
    window's rows at a time. Written to ``path + '.part'`` and renamed on :meth:`close`, so a file
    under the final name is always complete; the disk must have room for the whole file up front."""

    def __init__(self, path: str | Path, n_ctx: int, n_vocab: int, tokens: Sequence[int]) -> None:
        self.path = Path(path)
        n_chunk = len(tokens) // n_ctx
        if n_chunk < 1 or len(tokens) != n_chunk * n_ctx:
            raise EvalError(f"{self.path}: {len(tokens)} tokens is not a whole number of {n_ctx}-token windows")
        self.n_ctx, self.n_vocab, self.n_chunk = n_ctx, n_vocab, n_chunk
        self.nbytes = logits_file_bytes(n_ctx, n_vocab, n_chunk)
        parent = self.path.parent if str(self.path.parent) else Path(".")
        if not parent.is_dir():
            raise EvalError(f"--save-logits {self.path}: directory {parent} does not exist")
        free = shutil.disk_usage(parent).free
        if free < self.nbytes:
            raise EvalError(f"--save-logits {self.path}: needs {self.nbytes:,} bytes ({n_chunk} windows x "
                            f"{scored_per_window(n_ctx)} tokens x {2 * row_values(n_vocab):,} bytes), {parent} has "
                            f"{free:,} free (fewer windows: --max-chunks)")
        self.part = self.path.with_name(self.path.name + ".part")
        try:
            self.fh: BinaryIO | None = open(self.part, "wb")  # noqa: SIM115 (closed in close / abort)
        except OSError as exc:
            raise EvalError(f"--save-logits {self.path}: cannot write ({exc.strerror})") from None
        self.fh.write(MAGIC + np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tobytes())
        self.fh.write(np.asarray(tokens, dtype="<i4").tobytes())
        self.rows = 0

    def write(self, rows: np.ndarray) -> None:
        assert self.fh is not None
        self.fh.write(np.ascontiguousarray(rows, dtype="<u2").tobytes())
        self.rows += rows.shape[0]

    def close(self) -> None:
        """Finish: every window's rows written, then the rename."""
        if self.fh is None:
            return
        self.fh.close()
        self.fh = None
        expected = self.n_chunk * scored_per_window(self.n_ctx)
        if self.rows != expected:
            self.part.unlink(missing_ok=True)
            raise EvalError(f"{self.path}: {self.rows} rows written of {expected}; not saved")
        os.replace(self.part, self.path)

    def abort(self) -> None:
        """Drop a file left incomplete (an error or interrupt mid-run)."""
        if self.fh is not None:
            self.fh.close()
            self.fh = None
            self.part.unlink(missing_ok=True)


class LogitsReader:
    """A logits file (ours or llama.cpp's ``--kl-divergence-base``): the header and tokens are read
    and checked at open (magic, bounds, the file's size exactly what they imply, token ids within
    the vocabulary); :meth:`window` reads one window's rows (never the whole file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.fh: BinaryIO = open(self.path, "rb")  # noqa: SIM115 (closed in close)
        except OSError as exc:
            raise EvalError(f"--reference {self.path}: cannot open ({exc.strerror})") from None
        try:
            head = self.fh.read(HEADER_BYTES)
            if len(head) < HEADER_BYTES or head[:8] != MAGIC:
                raise EvalError(f"{self.path}: not a logits file (no '_logits_' header: write one with "
                                "quantplug eval --save-logits or llama-perplexity --kl-divergence-base)")
            n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(head, dtype="<i4", count=3, offset=8))
            if not (3 <= n_ctx <= MAX_FILE_CTX and 1 <= n_vocab <= MAX_FILE_VOCAB and n_chunk >= 1):
                raise EvalError(f"{self.path}: header n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk} out of range")
            size = os.fstat(self.fh.fileno()).st_size
            want = logits_file_bytes(n_ctx, n_vocab, n_chunk)
            if size != want:
                raise EvalError(f"{self.path}: {size:,} bytes, but n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk} "
                                f"make {want:,} (truncated or not a logits file)")
            raw = self.fh.read(4 * n_chunk * n_ctx)
            self.tokens = np.frombuffer(raw, dtype="<i4").astype(np.int64)
            bad = (self.tokens < 0) | (self.tokens >= n_vocab)
            if bad.any():
                raise EvalError(f"{self.path}: token {int(self.tokens[bad][0])} outside its vocabulary of {n_vocab}")
        except BaseException:
            self.fh.close()
            raise
        self.n_ctx, self.n_vocab, self.n_chunk = n_ctx, n_vocab, n_chunk
        self.nv = row_values(n_vocab)
        self.data_offset = HEADER_BYTES + 4 * n_chunk * n_ctx

    def window(self, i: int) -> np.ndarray:
        """Window ``i``'s rows, uint16 [n_ctx - 1 - n_ctx//2, nv]."""
        ns = scored_per_window(self.n_ctx)
        self.fh.seek(self.data_offset + i * ns * self.nv * 2)
        buf = self.fh.read(ns * self.nv * 2)
        if len(buf) != ns * self.nv * 2:
            raise EvalError(f"{self.path}: short read in window {i}")
        return np.frombuffer(buf, dtype="<u2").reshape(ns, self.nv)

    def close(self) -> None:
        self.fh.close()


# -- statistics ----------------------------------------------------------------------------------


def _mean_and_uncertainty(s: float, s2: float, count: int) -> tuple[float, float]:
    """llama.cpp's: the mean and its standard error (0 for 10 values or fewer)."""
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def _covariance(sa: float, sb: float, sab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sab / count - (sa / count) * (sb / count)) / (count - 1)


def _percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's linear interpolation between sorted ``values`` (float32 arithmetic)."""
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = np.float32(fraction) * np.float32(len(values) - 1)
    ip = int(p)
    p = np.float32(p - np.float32(ip))
    return float((np.float32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def _median(values: np.ndarray) -> float:
    n = len(values)
    return float(np.float32(0.5) * (values[n // 2] + values[n // 2 - 1])) if n % 2 == 0 else float(values[n // 2])


#: the percentiles reported, as llama.cpp prints them
KLD_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)
DP_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001)


@dataclass
class KLDAccumulator:
    """llama.cpp's ``kl_divergence_result`` sums and the per-token KLD and delta-p values."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list[np.ndarray] = field(default_factory=list)
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: torch.Tensor, targets: torch.Tensor, base_rows: np.ndarray) -> None:
        """One block: float32 ``logits`` [n, V] of the model, the tokens they predict [n], and the
        base's saved rows [n, nv] (llama.cpp's ``log_softmax(..., base_log_prob, tok, kld)``)."""
        lg = logits.float()
        v = lg.shape[1]
        base = unpack_rows(base_rows, v).to(lg.device)
        tg = targets.to(lg.device).long()[:, None]
        mx = lg.max(dim=1).values
        imax = lg.argmax(dim=1)
        lse = torch.log(torch.exp(lg - mx[:, None]).sum(dim=1, dtype=torch.float64)).float()
        top = mx + lse
        nll = top - lg.gather(1, tg)[:, 0]
        nll_base = -base.gather(1, tg)[:, 0]
        terms = torch.exp(base) * ((base - lg) + top[:, None])
        kld = torch.where(base > -LOG_RANGE, terms, torch.zeros_like(terms)).sum(dim=1, dtype=torch.float64)
        same = imax == base.argmax(dim=1)
        p_diff = torch.exp(-nll) - torch.exp(-nll_base)
        d = torch.float64
        self.sum_nll += float(nll.sum(dtype=d))
        self.sum_nll2 += float((nll * nll).sum(dtype=d))
        self.sum_nll_base += float(nll_base.sum(dtype=d))
        self.sum_nll_base2 += float((nll_base * nll_base).sum(dtype=d))
        self.sum_nll_nll_base += float((nll * nll_base).sum(dtype=d))
        self.sum_kld += float(kld.sum())
        self.sum_kld2 += float((kld * kld).sum())
        p2 = (p_diff * p_diff).double()
        self.sum_p_diff += float(p_diff.sum(dtype=d))
        self.sum_p_diff2 += float(p2.sum())
        self.sum_p_diff4 += float((p2 * p2).sum())
        self.max_p_diff = max(self.max_p_diff, float(p_diff.abs().max()))
        self.n_same_top += int(same.sum())
        self.count += lg.shape[0]
        self.kld_values.append(kld.float().cpu().numpy())
        self.p_diff_values.append(p_diff.cpu().numpy())

    def report(self) -> KLDReport:
        """The figures llama.cpp prints after ``--kl-divergence``."""
        n = self.count
        log_ppl = _mean_and_uncertainty(self.sum_nll, self.sum_nll2, n)
        log_base = _mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, n)
        ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_base[0])
        ppl_unc, base_unc = ppl * log_ppl[1], ppl_base * log_base[1]
        cov = _covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, n)
        cor = cov / (log_ppl[1] * log_base[1]) if log_ppl[1] * log_base[1] > 0 else float("nan")
        ratio_log = log_ppl[0] - log_base[0]
        ratio_log_unc = math.sqrt(max(log_ppl[1] ** 2 + log_base[1] ** 2 - 2 * cov, 0.0))
        ratio = math.exp(ratio_log)
        diff_unc = math.sqrt(max(ppl_unc ** 2 + base_unc ** 2 - 2 * ppl * ppl_base * cov, 0.0))
        kld = _mean_and_uncertainty(self.sum_kld, self.sum_kld2, n)
        kv = np.sort(np.concatenate(self.kld_values)) if self.kld_values else np.zeros(1, np.float32)
        pv = np.sort(np.concatenate(self.p_diff_values)) if self.p_diff_values else np.zeros(1, np.float32)
        mse = _mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, n)
        rms = math.sqrt(mse[0])
        p_diff = _mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, n)
        same = self.n_same_top / n if n else 0.0
        return KLDReport(
            count=n, ppl=ppl, ppl_unc=ppl_unc, ppl_base=ppl_base, ppl_base_unc=base_unc, cor=cor,
            ln_ratio=ratio_log, ln_ratio_unc=ratio_log_unc, ratio=ratio, ratio_unc=ratio * ratio_log_unc,
            ppl_diff=ppl - ppl_base, ppl_diff_unc=diff_unc, kld_mean=kld[0], kld_mean_unc=kld[1],
            kld_max=float(kv[-1]), kld_median=_median(kv), kld_min=float(kv[0]),
            kld_percentiles={f"{100 * f:.1f}": _percentile(kv, f) for f in KLD_PERCENTILES},
            dp_mean=p_diff[0], dp_mean_unc=p_diff[1], dp_max=float(pv[-1]), dp_median=_median(pv),
            dp_min=float(pv[0]), dp_percentiles={f"{100 * f:.1f}": _percentile(pv, f) for f in DP_PERCENTILES},
            dp_rms=rms, dp_rms_unc=0.5 / rms * mse[1] if rms > 0 else 0.0, same_top=same,
            same_top_unc=math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0)


@dataclass
class KLDReport:
    """KL-divergence of the model against a reference (base), as llama.cpp's ``--kl-divergence``
    reports it: ``ppl`` PPL(Q) of the model, ``ppl_base`` PPL of the base from its saved (uint16)
    log-probabilities, ``ratio`` / ``ln_ratio`` / ``ppl_diff`` with uncertainties, KLD(base ||
    model) per token (mean, median, max, min, percentiles keyed "99.0" etc.), delta p = p_model -
    p_base of the correct token (mean, RMS, percentiles), ``same_top`` the fraction of tokens whose
    argmax agrees ("same top p")."""

    count: int
    ppl: float
    ppl_unc: float
    ppl_base: float
    ppl_base_unc: float
    cor: float
    ln_ratio: float
    ln_ratio_unc: float
    ratio: float
    ratio_unc: float
    ppl_diff: float
    ppl_diff_unc: float
    kld_mean: float
    kld_mean_unc: float
    kld_max: float
    kld_median: float
    kld_min: float
    kld_percentiles: dict[str, float]
    dp_mean: float
    dp_mean_unc: float
    dp_max: float
    dp_median: float
    dp_min: float
    dp_percentiles: dict[str, float]
    dp_rms: float
    dp_rms_unc: float
    same_top: float
    same_top_unc: float

    @property
    def kld_p99(self) -> float:
        return self.kld_percentiles["99.0"]

    def lines(self) -> list[str]:
        """llama.cpp's summary, same labels."""
        k, d = self.kld_percentiles, self.dp_percentiles
        return [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {self.ppl:10.6f} ± {self.ppl_unc:10.6f}",
            f"Mean PPL(base)                : {self.ppl_base:10.6f} ± {self.ppl_base_unc:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * self.cor:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {self.ln_ratio:10.6f} ± {self.ln_ratio_unc:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {self.ratio:10.6f} ± {self.ratio_unc:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {self.ppl_diff:10.6f} ± {self.ppl_diff_unc:10.6f}",
            "",
            "====== KL divergence statistics ======",
            f"Mean    KLD: {self.kld_mean:10.6f} ± {self.kld_mean_unc:10.6f}",
            f"Maximum KLD: {self.kld_max:10.6f}",
            *(f"{p + '%':>5}   KLD: {k[p]:10.6f}" for p in ("99.9", "99.0", "95.0", "90.0")),
            f"Median  KLD: {self.kld_median:10.6f}",
            *(f"{p + '%':>5}   KLD: {k[p]:10.6f}" for p in ("10.0", "5.0", "1.0", "0.1")),
            f"Minimum KLD: {self.kld_min:10.6f}",
            "",
            "====== Token probability statistics ======",
            f"Mean    Δp: {100 * self.dp_mean:6.3f} ± {100 * self.dp_mean_unc:5.3f} %",
            f"Maximum Δp: {100 * self.dp_max:6.3f}%",
            *(f"{p + '%':>5}   Δp: {100 * d[p]:6.3f}%" for p in ("99.9", "99.0", "95.0", "90.0", "75.0")),
            f"Median  Δp: {100 * self.dp_median:6.3f}%",
            *(f"{p + '%':>5}   Δp: {100 * d[p]:6.3f}%" for p in ("25.0", "10.0", "5.0", "1.0", "0.1")),
            f"Minimum Δp: {100 * self.dp_min:6.3f}%",
            f"RMS Δp    : {100 * self.dp_rms:6.3f} ± {100 * self.dp_rms_unc:5.3f} %",
            f"Same top p: {100 * self.same_top:6.3f} ± {100 * self.same_top_unc:5.3f} %",
        ]


@dataclass
class EvalResult:
    """One evaluation: ``ppl`` ± ``ppl_err`` (standard error, llama.cpp's "Final estimate") over
    ``count`` scored tokens in ``n_chunk`` windows of ``n_ctx``; ``running`` the estimate after each
    window (llama.cpp's ``[i]ppl,`` line); ``bos`` the id put at each window's start (None: none);
    ``logits_file`` / ``logits_bytes`` what ``save_logits`` wrote; ``kld`` the comparison with a
    reference, when one was given."""

    n_ctx: int
    n_vocab: int
    n_chunk: int
    count: int
    ppl: float
    ppl_err: float
    nll: float
    running: list[float]
    bos: int | None
    seconds: float
    logits_file: str | None = None
    logits_bytes: int = 0
    kld: KLDReport | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.kld is not None:
            d["kld"]["kld_p99"] = self.kld.kld_p99
        return d

    def lines(self) -> list[str]:
        out = [f"perplexity: {self.n_chunk} windows of {self.n_ctx} tokens, {scored_per_window(self.n_ctx)} scored "
               f"each ({self.count} tokens), vocabulary {self.n_vocab}, "
               f"{'BOS ' + str(self.bos) if self.bos is not None else 'no BOS'} at each window's start, "
               f"{self.seconds:.2f} s",
               "".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(self.running)),
               f"Final estimate: PPL = {self.ppl:.4f} +/- {self.ppl_err:.5f}"]
        if self.logits_file:
            out.append(f"saved logits: {self.logits_file} ({self.logits_bytes:,} bytes)")
        if self.kld is not None:
            out += ["", *self.kld.lines()]
        return out


# -- evaluation ----------------------------------------------------------------------------------


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """float64 negative log-likelihood [n] of ``targets`` [n] under float32 ``logits`` [n, V]."""
    mx = logits.max(dim=1).values
    se = torch.exp(logits - mx[:, None]).sum(dim=1, dtype=torch.float64)
    picked = logits.gather(1, targets[:, None].long())[:, 0]
    return (mx - picked).double() + torch.log(se)


def _device(lm: Any) -> torch.device:
    return next(iter(lm.model.embed_tokens.parameters())).device


def evaluate(model: Any, tokens: Sequence[int] | np.ndarray | None = None, *, n_ctx: int | None = None,
             bos: int | None = None, batch: int = 1, max_chunks: int | None = None,
             save_logits: str | Path | None = None, reference: str | Path | LogitsReader | None = None,
             progress: bool | None = None) -> EvalResult | None:
    """Perplexity of the loaded ``model`` over ``tokens`` in windows of ``n_ctx`` (module docstring).

    ``bos``: the id put at each window's start (:func:`text_tokens` gives it; None: the windows are
    scored as they are). ``batch`` windows run per forward pass; ``max_chunks`` caps the windows.
    ``save_logits`` streams the distributions to a logits file. ``reference``: a logits file (path
    or open :class:`LogitsReader`) of a base model; the result's ``kld`` compares against it. Its
    tokens are evaluated when ``tokens`` is None, else ``tokens`` must equal them, and its ``n_ctx``
    is used (``n_ctx``, if given, must equal it). A vocabulary other than the model's is refused.

    Tensor / expert parallel (a model loaded over a group): every rank calls this with the same
    arguments; rank 0 scores, writes ``save_logits`` and reads ``reference`` (the others only run
    the forward passes, and read the reference's tokens when ``tokens`` is None) and returns the
    result; the others return None.
    """
    lm = model.text_lm() if hasattr(model, "text_lm") else model
    from .generate import max_seq_len

    vocab = int(lm.config.vocab_size)
    rank = int(getattr(model, "load_report", {}).get("rank", 0))
    lead = rank == 0
    if batch < 1:
        raise EvalError(f"--batch {batch}: expected >= 1")
    if max_chunks is not None and max_chunks < 1:
        raise EvalError(f"--max-chunks {max_chunks}: expected >= 1")
    reader: LogitsReader | None = None
    own_reader = False
    try:
        if reference is not None and (lead or tokens is None):
            reader = reference if isinstance(reference, LogitsReader) else LogitsReader(reference)
            own_reader = not isinstance(reference, LogitsReader)
            if reader.n_vocab != vocab:
                raise EvalError(f"reference {reader.path} has a vocabulary of {reader.n_vocab} tokens, the model "
                                f"{vocab}: not the same model's distributions")
            if n_ctx is not None and n_ctx != reader.n_ctx:
                raise EvalError(f"reference {reader.path} was computed with --ctx {reader.n_ctx}, not {n_ctx}")
            n_ctx = reader.n_ctx
            if tokens is None:
                tokens = reader.tokens
            else:
                mine = np.asarray(tokens, dtype=np.int64)[:reader.n_chunk * reader.n_ctx]
                if len(mine) != len(reader.tokens):
                    raise EvalError(f"reference {reader.path} holds {len(reader.tokens)} tokens ({reader.n_chunk} "
                                    f"windows of {reader.n_ctx}); this text gives the model {len(mine)} of them: "
                                    "another text or tokenizer")
                diff = np.nonzero(mine != reader.tokens)[0]
                if len(diff):
                    j = int(diff[0])
                    raise EvalError(f"reference {reader.path} token {j} is {int(reader.tokens[j])}, this text "
                                    f"gives the model {int(mine[j])}: another text or tokenizer")
        if tokens is None or n_ctx is None:
            raise EvalError("evaluate needs tokens and n_ctx (or a reference file holding them)")
        check_ctx(n_ctx, max_seq_len(lm.config))
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise EvalError(f"token ids must be in [0, {vocab}); got {int(ids.min())}..{int(ids.max())}")
        if bos is not None and not 0 <= bos < vocab:
            raise EvalError(f"BOS id {bos} outside the vocabulary of {vocab}")
        n_chunk = len(ids) // n_ctx
        if reader is not None:
            n_chunk = min(n_chunk, reader.n_chunk)
        if max_chunks is not None:
            n_chunk = min(n_chunk, max_chunks)
        if n_chunk < 1:
            raise EvalError(f"the text gives {len(ids)} tokens: at least one window of --ctx {n_ctx} is needed")
        return _run(model, lm, ids[:n_chunk * n_ctx].view(n_chunk, n_ctx), vocab, bos, batch, lead,
                    save_logits if lead else None, reader if lead else None, progress)
    finally:
        if own_reader and reader is not None:
            reader.close()


def _run(model: Any, lm: Any, windows: torch.Tensor, vocab: int, bos: int | None, batch: int, lead: bool,
         save_logits: str | Path | None, reader: LogitsReader | None, progress: bool | None) -> EvalResult | None:
    n_chunk, n_ctx = windows.shape
    first = n_ctx // 2
    dev = _device(lm)
    writer = LogitsWriter(save_logits, n_ctx, vocab, windows.reshape(-1).tolist()) if save_logits else None
    acc = KLDAccumulator() if reader is not None else None
    show = lead and (sys.stderr.isatty() if progress is None else progress)
    bar: Any = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=n_chunk, unit="window", desc="eval", file=sys.stderr)
    nll_sum = nll2_sum = 0.0
    count = 0
    running: list[float] = []
    t0 = time.perf_counter()
    try:
        for i in range(0, n_chunk, batch):
            rows = windows[i:i + batch]
            inp = rows.clone()
            if bos is not None:
                inp[:, 0] = bos  # llama.cpp: BOS replaces each window's first token
            with torch.inference_mode(), gc_paused():
                hidden = lm.model(inp.to(dev))
                logits = lm.lm_head(hidden[:, first:n_ctx - 1]).float()
            if not lead:
                continue
            targets = rows[:, first + 1:].to(logits.device)
            for s in range(rows.shape[0]):
                base = reader.window(i + s) if reader is not None else None
                for b in range(0, logits.shape[1], ROW_BLOCK):
                    lg, tg = logits[s, b:b + ROW_BLOCK], targets[s, b:b + ROW_BLOCK]
                    nll = _nll(lg, tg)
                    nll_sum += float(nll.sum())
                    nll2_sum += float((nll * nll).sum())
                    count += lg.shape[0]
                    if writer is not None:
                        writer.write(pack_rows(lg))
                    if acc is not None and base is not None:
                        acc.add(lg, tg, base[b:b + ROW_BLOCK])
                running.append(math.exp(nll_sum / count))
            if bar is not None:
                mean = nll_sum / count
                var = nll2_sum / count - mean * mean
                err = math.sqrt(var / (count - 1)) * running[-1] if var > 0 and count > 1 else 0.0
                bar.set_postfix_str(f"PPL {running[-1]:.4f} ± {err:.4f}")
                bar.update(rows.shape[0])
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    if not lead:
        return None
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = math.exp(mean)
    return EvalResult(n_ctx=n_ctx, n_vocab=vocab, n_chunk=n_chunk, count=count, ppl=ppl,
                      ppl_err=math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0, nll=mean,
                      running=running, bos=bos, seconds=round(time.perf_counter() - t0, 3),
                      logits_file=str(save_logits) if writer is not None else None,
                      logits_bytes=writer.nbytes if writer is not None else 0,
                      kld=acc.report() if acc is not None else None)


# -- text ----------------------------------------------------------------------------------------


def read_text(path: str | Path) -> str:
    """The text file to score (UTF-8), or an EvalError naming it."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"--text {p}: no such file")
    try:
        return p.read_text(encoding="utf-8")
    except OSError as exc:
        raise EvalError(f"--text {p}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise EvalError(f"--text {p}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def text_tokens(checkpoint: str | Path, text: str) -> tuple[list[int], int | None]:
    """``text`` tokenized with the checkpoint's tokenizer as llama.cpp's ``common_tokenize(ctx,
    text, add_special=true)`` does: BOS first when the vocabulary adds one (no EOS), and that BOS
    id (None when it adds none) for the start of every window. Special-token strings inside the
    text become their ids (llama.cpp, parsing no specials there, would spell them out)."""
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(checkpoint)
    if tok is None:
        raise EvalError(f"{checkpoint}: no tokenizer (tokenizer.json, tiktoken.model or a GGUF vocabulary) to "
                        "tokenize --text with")
    bos = tok.added_bos()
    ids = tok.encode(text, add_special_tokens=False)
    return ([bos] if bos is not None else []) + ids, bos


def checkpoint_bos(model: Any, checkpoint: str | Path, first_token: int | None) -> int | None:
    """The BOS for a reference's tokens evaluated without --text: the tokenizer's (``added_bos``),
    or, with no tokenizer, config.json's ``bos_token_id`` when the reference's first token is it
    (its run added BOS)."""
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(checkpoint)
    if tok is not None:
        return tok.added_bos()
    raw = getattr(model.text_lm().config, "raw", None)
    bos = raw.get("bos_token_id") if isinstance(raw, dict) else None
    return bos if type(bos) is int and bos == first_token else None
