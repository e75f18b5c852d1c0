"""``compare``: init schemes side by side over depth and width.

For every scheme x depth x width x seed a fresh tinylm model (pre-norm by default,
vocabulary 256, heads of width 32, d_ff = 8/3 d) is probed on one batch of tokens:
uniform random tokens, or with ``data`` (a 1-D integer token array such as
``tinylm.data.load_tokens`` returns, or a path to such a file) a random window
of it drawn with the seed (``tinylm.data.get_batch``). Out come two pandas
DataFrames:

* tidy: the rows of the one result schema (:data:`diagnostics.result.COLUMNS`, built
  by :func:`diagnostics.result.frame`), one per (scheme, depth, width, seed, tensor,
  direction, statistic): step 0 (fresh models), name the tensor, statistics "var",
  "mean", "max_abs", "frac_zero" of each measured tensor; verdict: for the residual
  stream, "ok" or the kind of the finding diagnostics.judge.verdicts made on that
  (tensor, direction) of that model; None for the logits (not judged). No predictions
  (predicted, ratio and its interval, valid: None); run: the ``run`` option.
* summary, beside it: one row per (scheme, depth, width): initial loss (mean over seeds) against
  ln(vocab); the slope of log(variance) of the residual stream over depth, forward and
  backward, with its 99% t interval over seeds (slope per block of the least-squares fit
  of ln Var against the stream index 0..L); the max/min ratio of the stream variance
  across layers; the verdict of diagnostics.judge.verdicts on the stream (worst over seeds);
  and, with ``steps`` > 0, the loss after that many AdamW steps (mean over seeds) on batches
  drawn from ``data``, or without data from the standard library's bytes. Columns: scheme,
  depth, width, seeds, data, vocab_size, initial_loss, ln_vocab, slope_forward,
  slope_forward_low, slope_forward_high, slope_backward, slope_backward_low,
  slope_backward_high, max_min_ratio, verdict, early_loss, steps. ``data`` says where the
  tokens came from (e.g. "uniform random tokens; steps on the standard library's bytes" or
  "tokens.npy (1,000,000 tokens)"); ``vocab_size`` is the vocabulary the models were built
  with and ``ln_vocab`` its logarithm, the loss of a uniform guess over it.

Vocabulary: ``vocab_size=None`` (the default) means 256 for random tokens and
max(256, largest id in ``data`` + 1) with data, so byte-level text keeps the byte
vocabulary and a BPE token file gets a vocabulary that holds every id it uses (up to
``MAX_DATA_VOCAB``; larger ids are refused as not token ids). An explicit ``vocab_size``
is used as given, and data with an id at or above it is refused with a DataError
naming the id. Data with fewer than ``seq_len + 1`` tokens is refused too.

By default only the residual stream (embedding output and each block's output) and the
logits are instrumented (``tensors="stream"``), which keeps the default comparison
(6 schemes x depths 2, 8, 32 x width 128 x 3 seeds, batch 2 x 32 tokens) to seconds per
scheme; ``tensors="all"`` probes every default point. The grid runs on one torch thread (the
caller's count is restored after it): its models are too small for a second one to pay.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator, Sequence

import numpy as np
import pandas as pd
import torch

import tinylm

from tinylm.data import DataError, get_batch, load_tokens
from tinylm.memory import check_fits
from tinylm.validate import fail
from ..judge import Thresholds, judge
from ..measure.sites import model_sites
from ..measure.intervals import t_interval
from ..measure.probe import block_index, probe
from ..options import CompareOptions, OptionsError, ProbeOptions
from ..result import DepthRow, Row, frame
from .comparison import Comparison

__all__ = ["compare", "stream_slope", "data_vocab", "SUMMARY_COLUMNS"]

#: the largest vocabulary compare sizes to data by itself (above any real tokenizer's); larger ids are refused.
MAX_DATA_VOCAB = 1 << 20
DEFAULT_VOCAB, DEFAULT_SEQ_LEN = 256, CompareOptions.seq_len
RANDOM_SOURCE = "uniform random tokens"
STDLIB_STEPS = "steps on the standard library's bytes"

#: the verdicts, worst first (a cell's summary verdict is the worst over its seeds)
_WORST_FIRST = ("non_finite", "exploding", "vanishing", "dead", "saturated", "ok")
SUMMARY_COLUMNS = ["scheme", "depth", "width", "seeds", "data", "vocab_size", "initial_loss", "ln_vocab", "slope_forward",
                   "slope_forward_low", "slope_forward_high", "slope_backward", "slope_backward_low",
                   "slope_backward_high", "max_min_ratio", "verdict", "early_loss", "steps"]


def stream_slope(variances: Sequence[float]) -> float:
    """Least-squares slope of ln(variance) against the stream index 0..n-1 (nan if undefined)."""
    v = np.asarray(variances, dtype=np.float64)
    if v.size < 2 or not np.all(np.isfinite(v)) or np.any(v <= 0):
        return math.nan
    x = np.arange(v.size, dtype=np.float64)
    return float(np.polyfit(x, np.log(v), 1)[0])


@lru_cache(maxsize=1)
def _corpus():
    from tinylm.data import stdlib_corpus

    return stdlib_corpus(max_bytes=200_000)


def _as_tokens(data, data_name: str | None) -> tuple[np.ndarray, str]:
    """``data`` (an array or a token file's path) as a 1-D integer array, and the name it goes by."""
    if isinstance(data, (str, os.PathLike)):
        return load_tokens(data), data_name or str(data)
    name = data_name or "given tokens"
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    tokens = np.asarray(data)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"data: a {tokens.ndim}-D {tokens.dtype} array; tokens must be a 1-D integer array "
                        "(as tinylm.data.load_tokens returns)")
    return tokens, name


def data_vocab(tokens: np.ndarray, vocab_size: int | None = None, source: str = "data",
               name: str = "vocab_size") -> int:
    """The vocabulary compare builds its models with for ``tokens`` (rule in the module doc).

    Raises DataError for no tokens, a negative id, an id at or above an explicit ``vocab_size``,
    or (sizing to the data) an id of ``MAX_DATA_VOCAB`` or more. ``source`` names the tokens and
    ``name`` the vocabulary option in the message (the CLI passes ``--vocab-size``).
    """
    if len(tokens) == 0:
        raise DataError(f"{source}: no tokens; pass data with tokens in it")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0:
        raise DataError(f"{source}: token id {lo} is negative; token ids must be integers 0, 1, 2, ...")
    if vocab_size is not None:
        if hi >= vocab_size:
            raise DataError(f"{source}: token id {hi} is outside the vocabulary [0, {vocab_size}) ({name} "
                            f"{vocab_size}); use {name} {hi + 1} or more, or leave {name} out to size the "
                            "vocabulary to the data")
        return vocab_size
    if hi >= MAX_DATA_VOCAB:
        raise DataError(f"{source}: token id {hi:,} would need a vocabulary of {hi + 1:,}, above the "
                        f"{MAX_DATA_VOCAB:,} compare sizes to data; these do not look like token ids "
                        "(check the file's format: .bin is raw uint16)")
    return max(DEFAULT_VOCAB, hi + 1)


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread inside the block, the caller's thread count restored after it. The grid's
    models see a few dozen tokens at a time: their ops are too small for a second thread to pay for
    waking it, and on a busy machine each op then waits for a descheduled thread."""
    threads = torch.get_num_threads()
    try:
        if threads != 1:
            torch.set_num_threads(1)
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _train_steps(model: tinylm.TransformerLM, steps: int, batch_size: int, seq_len: int, seed: int,
                 lr: float, tokens: np.ndarray | None = None) -> float:
    corpus = _corpus() if tokens is None else tokens
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(math.nan)
    for _ in range(steps):
        x, y = get_batch(corpus, batch_size, seq_len, gen)
        loss = tinylm.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())


def _config(vocab_size: int, seq_len: int, width: int, depth: int, norm: str, scheme: str) -> tinylm.ModelConfig:
    """The model of one grid cell: heads of 32 dimensions where the width allows, else one head."""
    heads = max(1, width // 32) if width % max(1, width // 32) == 0 else 1
    return tinylm.ModelConfig(vocab_size=vocab_size, context_length=seq_len, d_model=width, num_layers=depth,
                              num_heads=heads, d_ff=tinylm.default_d_ff(width), norm=norm, init=scheme)


def compare(options: CompareOptions | None = None) -> Comparison:
    """Measure every scheme at every depth and width; returns (tidy, summary) DataFrames (see module doc).

    Args:
        options: a :class:`diagnostics.CompareOptions` (None: the defaults). Seeds are seed,
            seed+1, ...: seed s initialises the model and draws its batch (random tokens, or a
            window of ``data``) and the batches of its ``steps`` training steps.
    Returns: a :class:`Comparison` (tidy, summary).
    Raises: OptionsError for an argument that is not CompareOptions; DataError for data that
        cannot be read as tokens (module doc); MemoryLimitError when the grid's largest model does not fit.
    """
    options = CompareOptions() if options is None else options
    if not isinstance(options, CompareOptions):
        fail("options", options, "be a diagnostics.CompareOptions",
             "compare(CompareOptions(schemes=[...], depths=(2, 8, 32), ...))", error=OptionsError)
    grid = _grid(options)
    total, done = len(grid.schemes) * len(options.depths) * len(options.widths) * options.seeds, 0
    tidy: list[Row] = []
    summary: list[dict] = []
    with _one_thread():
        for scheme in grid.schemes:
            for depth in options.depths:
                for width in options.widths:
                    config = _config(grid.vocab_size, options.seq_len, width, depth, options.norm, scheme)
                    cell = _Cell(scheme, depth, width, config, list(tinylm.plan.build(config).block_outputs()))
                    for s in range(options.seed, options.seed + options.seeds):
                        tidy += _measure_seed(cell, s, grid, options)
                        done += 1
                        if options.progress:
                            options.progress(done, total, f"{scheme} L={depth} d={width} seed {s}")
                    summary.append(_summary_row(cell, grid, options))
    return Comparison(frame(tidy), pd.DataFrame.from_records(summary, columns=SUMMARY_COLUMNS))


@dataclass(frozen=True)
class _Grid:
    """What every cell shares: the schemes, the tokens (None: uniform random), the vocabulary the
    models are built with, the words for where the tokens came from, and the thresholds."""

    schemes: tuple[str, ...]
    tokens: np.ndarray | None
    vocab_size: int
    source: str
    thresholds: Thresholds


@dataclass
class _Cell:
    """One (scheme, depth, width): its config, its residual stream's points, the model its seeds
    reuse, and each seed's readings."""

    scheme: str
    depth: int
    width: int
    config: tinylm.ModelConfig
    stream: list[str] = field(default_factory=list)
    model: tinylm.TransformerLM | None = None
    losses: list[float] = field(default_factory=list)
    early: list[float] = field(default_factory=list)
    fslopes: list[float] = field(default_factory=list)
    bslopes: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)


def _grid(options: CompareOptions) -> _Grid:
    """The schemes, the tokens and their vocabulary; the largest model of the grid must fit, with its
    batch, before any is built."""
    schemes = options.schemes if options.schemes is not None else tuple(tinylm.init.SCHEMES)
    vocab_size, steps = options.vocab_size, options.steps
    tokens = None
    if options.data is None:
        vocab_size = DEFAULT_VOCAB if vocab_size is None else vocab_size
        source = RANDOM_SOURCE + (f"; {STDLIB_STEPS}" if steps else "")
    else:
        tokens, label = _as_tokens(options.data, options.data_name)
        vocab_size = data_vocab(tokens, vocab_size, label)
        if len(tokens) < options.seq_len + 1:
            raise DataError(f"{label}: {len(tokens)} tokens are fewer than seq_len + 1 = {options.seq_len + 1}; "
                            "use more data or a smaller seq_len")
        source = f"{label} ({len(tokens):,} tokens)"
    for depth in options.depths:
        for width in options.widths:
            check_fits(_config(vocab_size, options.seq_len, width, depth, options.norm, schemes[0]),
                       options.batch_size, options.seq_len)
    return _Grid(schemes, tokens, vocab_size, source, options.thresholds or Thresholds())


def _measure_seed(cell: _Cell, s: int, grid: _Grid, options: CompareOptions) -> list[Row]:
    """Seed ``s`` of the cell: the model initialised from it, probed on one batch (its readings kept
    in the cell), judged over depth, then trained ``steps`` steps; returns its tidy rows."""
    gen = torch.Generator().manual_seed(s)
    if cell.model is None:
        cell.model = tinylm.TransformerLM(cell.config, generator=gen)
    else:  # the cell's model, initialised afresh: the same values a new model from gen holds
        tinylm.init.apply(cell.model, cell.scheme, generator=gen)
        cell.model.zero_grad(set_to_none=True)
    if grid.tokens is None:
        batch = torch.randint(0, grid.vocab_size, (options.batch_size, options.seq_len + 1), generator=gen)
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    else:
        x, y = get_batch(grid.tokens, options.batch_size, options.seq_len, gen)
    stream = cell.stream
    opts = ProbeOptions(modules=tuple(stream + [model_sites(cell.model).head]) if options.tensors == "stream" else None,
                        attention=options.tensors == "all", params=False)
    with probe(cell.model, opts) as measured:
        loss = tinylm.functional.cross_entropy(cell.model(x), y)
        loss.backward()
    stats = measured.stats
    cell.losses.append(float(loss.detach()))
    found = _stream_verdicts(cell, stats, stream, grid, options)
    rows = _tidy_rows(cell, s, stats, stream, found, options)
    if options.steps:
        cell.early.append(_train_steps(cell.model, options.steps, options.batch_size, options.seq_len, s,
                                       options.lr, grid.tokens))
    return rows


def _stream_verdicts(cell: _Cell, stats, stream: list[str], grid: _Grid, options: CompareOptions
                     ) -> dict[tuple[str, str], str]:
    """The residual stream's slopes, max/min ratio and verdict of one seed (kept in the cell), and the
    worst verdict of each (tensor, direction) the findings name."""
    fwd = [stats.tensors[(n, "forward")].var for n in stream]
    bwd = [stats.tensors[(n, "backward")].var for n in stream if (n, "backward") in stats.tensors]
    cell.fslopes.append(stream_slope(fwd))
    cell.bslopes.append(stream_slope(bwd) if len(bwd) == len(fwd) else math.nan)
    finite = [v for v in fwd if math.isfinite(v) and v > 0]
    cell.ratios.append(max(finite) / min(finite) if finite else math.nan)
    depth_rows = [DepthRow(index=k, name=n, forward_var=fwd[k], forward_predicted=None,
                           backward_var=bwd[k] if len(bwd) == len(fwd) else None,
                           backward_predicted=None, cosine=math.nan) for k, n in enumerate(stream)]
    findings = judge([], [], [], depth_rows, stream, grid.thresholds, scale_invariant=options.norm == "pre")[0]
    cell.verdicts.append(findings[0].kind if findings else "ok")
    found: dict[tuple[str, str], str] = {}
    for f in findings:
        for d in ((f.direction,) if f.direction else ("forward", "backward")):
            key = (f.where, d)
            found[key] = min(found.get(key, "ok"), f.kind, key=_WORST_FIRST.index)
    return found


def _tidy_rows(cell: _Cell, s: int, stats, stream: list[str], found: dict[tuple[str, str], str],
               options: CompareOptions) -> list[Row]:
    """The tidy rows of one seed: four statistics of every measured tensor and direction."""
    rows = []
    for (name, direction), m in stats.tensors.items():
        kind = stats.kinds.get(name, "module")
        if options.tensors == "stream":
            kind = "embedding" if name == "token_embeddings" else ("logits" if kind == "logits" else "residual")
        verdict = found.get((name, direction), "ok") if name in stream else None
        for stat, value in (("var", m.var), ("mean", m.mean), ("max_abs", m.max_abs), ("frac_zero", m.frac_zero)):
            rows.append(Row(run=options.run, step=0, seed=s, scheme=cell.scheme, depth=cell.depth, width=cell.width,
                            name=name, kind=kind, block=block_index(name), direction=direction, statistic=stat,
                            value=value, verdict=verdict))
    return rows


def _summary_row(cell: _Cell, grid: _Grid, options: CompareOptions) -> dict:
    """The cell's summary row (module doc): means and 99% t intervals over its seeds, the worst verdict."""
    f, flo, fhi = t_interval(cell.fslopes)
    b, blo, bhi = t_interval(cell.bslopes)
    return {
        "scheme": cell.scheme, "depth": cell.depth, "width": cell.width, "seeds": options.seeds, "data": grid.source,
        "vocab_size": grid.vocab_size,
        "initial_loss": float(np.mean(cell.losses)), "ln_vocab": math.log(grid.vocab_size),
        "slope_forward": f, "slope_forward_low": flo, "slope_forward_high": fhi,
        "slope_backward": b, "slope_backward_low": blo, "slope_backward_high": bhi,
        "max_min_ratio": float(np.nanmax(cell.ratios)) if not all(math.isnan(r) for r in cell.ratios) else math.nan,
        "verdict": min(cell.verdicts, key=_WORST_FIRST.index),
        "early_loss": float(np.mean(cell.early)) if cell.early else None, "steps": options.steps,
    }
