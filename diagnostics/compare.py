"""``compare``: init schemes side by side over depth and width.

For every scheme x depth x width x seed a fresh tinylm model (pre-norm by default,
vocabulary 256, heads of width 32, d_ff = 8/3 d) is probed on one batch of uniform
random tokens. Out come two pandas DataFrames:

* tidy: one row per (scheme, depth, width, seed, tensor, direction, statistic) with
  columns scheme, depth, width, seed, tensor, kind, block, direction, statistic, value.
  Statistics: "var", "mean", "max_abs", "frac_zero" of each measured tensor.
* summary: one row per (scheme, depth, width): initial loss (mean over seeds) against
  ln(vocab); the slope of log(variance) of the residual stream over depth, forward and
  backward, with its 99% t interval over seeds (slope per block of the least-squares fit
  of ln Var against the stream index 0..L); the max/min ratio of the stream variance
  across layers; the verdict of diagnostics.verdicts on the stream (worst over seeds);
  and, with ``steps`` > 0, the loss after that many AdamW steps on the standard library's
  bytes (mean over seeds).

By default only the residual stream (embedding output and each block's output) and the
logits are instrumented (``tensors="stream"``), which keeps the default comparison
(6 schemes x depths 2, 8, 32 x width 128 x 3 seeds, batch 2 x 32 tokens) to seconds per
scheme; ``tensors="all"`` probes every default point.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import numpy as np
import pandas as pd
import torch

import tinylm

from .diagnose import t_interval
from .options import OptionsError, Progress, ProbeOptions
from .probe import block_index, probe
from .result import DepthRow
from .verdicts import Thresholds, judge

__all__ = ["compare", "stream_slope"]

TIDY_COLUMNS = ["scheme", "depth", "width", "seed", "tensor", "kind", "block", "direction", "statistic", "value"]
SUMMARY_COLUMNS = ["scheme", "depth", "width", "seeds", "initial_loss", "ln_vocab", "slope_forward",
                   "slope_forward_low", "slope_forward_high", "slope_backward", "slope_backward_low",
                   "slope_backward_high", "max_min_ratio", "verdict", "early_loss", "steps"]


def stream_slope(variances: Sequence[float]) -> float:
    """Least-squares slope of ln(variance) against the stream index 0..n-1 (nan if undefined)."""
    v = np.asarray(variances, dtype=np.float64)
    if v.size < 2 or not np.all(np.isfinite(v)) or np.any(v <= 0):
        return math.nan
    x = np.arange(v.size, dtype=np.float64)
    return float(np.polyfit(x, np.log(v), 1)[0])


def _check(name: str, values, kind=int) -> tuple:
    values = tuple(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, kind) or v <= 0 for v in values):
        raise OptionsError(f"{name}={values!r}: must be a non-empty list of positive integers")
    return values


@lru_cache(maxsize=1)
def _corpus():
    from .data import stdlib_corpus

    return stdlib_corpus(max_bytes=200_000)


def _train_steps(model: tinylm.TransformerLM, steps: int, batch_size: int, seq_len: int, seed: int,
                 lr: float) -> float:
    from .data import get_batch

    corpus = _corpus()
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


def compare(schemes: Sequence[str] | None = None, depths: Sequence[int] = (2, 8, 32), widths: Sequence[int] = (128,),
            seeds: int = 3, steps: int = 0, *, vocab_size: int = 256, seq_len: int = 32, batch_size: int = 2,
            norm: str = "pre", tensors: str = "stream", lr: float = 1e-3, seed: int = 0,
            thresholds: Thresholds | None = None, progress: Progress | None = None
            ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measure every scheme at every depth and width; returns (tidy, summary) DataFrames (see module doc).

    Seeds are seed, seed+1, ...: seed s initialises the model and draws its batch.
    """
    schemes = tuple(schemes) if schemes is not None else tuple(tinylm.init.SCHEMES)
    for s in schemes:
        tinylm.init.get(s)
    depths, widths = _check("depths", depths), _check("widths", widths)
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise OptionsError(f"seeds={seeds!r}: must be an integer >= 1")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise OptionsError(f"steps={steps!r}: must be an integer >= 0")
    if tensors not in ("stream", "all"):
        raise OptionsError(f"tensors={tensors!r}: choose 'stream' or 'all'")
    if progress is not None and not callable(progress):
        raise OptionsError(f"progress={progress!r}: must be a callable (done, total, description)")
    thresholds = thresholds or Thresholds()
    total, done = len(schemes) * len(depths) * len(widths) * seeds, 0
    tidy: list[tuple] = []
    summary: list[dict] = []
    for scheme in schemes:
        for depth in depths:
            for width in widths:
                heads = max(1, width // 32) if width % max(1, width // 32) == 0 else 1
                config = tinylm.ModelConfig(vocab_size=vocab_size, context_length=seq_len, d_model=width,
                                            num_layers=depth, num_heads=heads, d_ff=tinylm.default_d_ff(width),
                                            norm=norm, init=scheme)
                losses, early, fslopes, bslopes, ratios, verdicts = [], [], [], [], [], []
                for s in range(seed, seed + seeds):
                    gen = torch.Generator().manual_seed(s)
                    model = tinylm.TransformerLM(config, generator=gen)
                    batch = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
                    stream = ["token_embeddings"] + [f"layers.{i}" for i in range(depth)]
                    opts = ProbeOptions(modules=tuple(stream + ["lm_head"]) if tensors == "stream" else None,
                                        attention=tensors == "all", params=False)
                    with probe(model, opts) as run:
                        loss = tinylm.functional.cross_entropy(model(batch[:, :-1]), batch[:, 1:])
                        loss.backward()
                    stats = run.stats
                    losses.append(float(loss.detach()))
                    for (name, direction), m in stats.tensors.items():
                        kind = stats.kinds.get(name, "module")
                        if tensors == "stream":
                            kind = "embedding" if name == "token_embeddings" else ("logits" if name == "lm_head" else "residual")
                        for stat, value in (("var", m.var), ("mean", m.mean), ("max_abs", m.max_abs),
                                            ("frac_zero", m.frac_zero)):
                            tidy.append((scheme, depth, width, s, name, kind, block_index(name), direction, stat, value))
                    fwd = [stats.tensors[(n, "forward")].var for n in stream]
                    bwd = [stats.tensors[(n, "backward")].var for n in stream if (n, "backward") in stats.tensors]
                    fslopes.append(stream_slope(fwd))
                    bslopes.append(stream_slope(bwd) if len(bwd) == len(fwd) else math.nan)
                    finite = [v for v in fwd if math.isfinite(v) and v > 0]
                    ratios.append(max(finite) / min(finite) if finite else math.nan)
                    depth_rows = [DepthRow(index=k, name=n, forward_var=fwd[k], forward_predicted=None,
                                           backward_var=bwd[k] if len(bwd) == len(fwd) else None,
                                           backward_predicted=None, cosine=math.nan) for k, n in enumerate(stream)]
                    findings = judge([], [], [], depth_rows, stream, thresholds, scale_invariant=norm == "pre")[0]
                    verdicts.append(findings[0].kind if findings else "ok")
                    if steps:
                        early.append(_train_steps(model, steps, batch_size, seq_len, s, lr))
                    done += 1
                    if progress:
                        progress(done, total, f"{scheme} L={depth} d={width} seed {s}")
                f, flo, fhi = t_interval(fslopes)
                b, blo, bhi = t_interval(bslopes)
                order = ("non_finite", "exploding", "vanishing", "dead", "saturated", "ok")
                summary.append({
                    "scheme": scheme, "depth": depth, "width": width, "seeds": seeds,
                    "initial_loss": float(np.mean(losses)), "ln_vocab": math.log(vocab_size),
                    "slope_forward": f, "slope_forward_low": flo, "slope_forward_high": fhi,
                    "slope_backward": b, "slope_backward_low": blo, "slope_backward_high": bhi,
                    "max_min_ratio": float(np.nanmax(ratios)) if not all(math.isnan(r) for r in ratios) else math.nan,
                    "verdict": min(verdicts, key=order.index),
                    "early_loss": float(np.mean(early)) if early else None, "steps": steps,
                })
    return pd.DataFrame.from_records(tidy, columns=TIDY_COLUMNS), pd.DataFrame.from_records(summary, columns=SUMMARY_COLUMNS)
