"""Judging a coordinate check: each site's width exponent against the one muP expects.

For each site and quantity the slope b of log RMS against log width is fitted by least
squares over every (width, seed) point; its 99% interval is b +- t(0.995, n - 2) se(b), the
residuals' scatter over seeds and widths giving se(b) (with one seed the scatter is the
curvature alone). Two quantities are judged: ``init`` (the RMS at init) and ``delta`` (the
RMS of the change from init, X_t - X_0, at the last step).

What muP expects (Adam or SGD, a few steps, widths growing with d_head ~ width):

============  ===========  =========================================================
kind          init  delta  why
============  ===========  =========================================================
embedding       0     0    input weights: constant init and constant learning rate
attn_logits   -1/2  -1/2   1/d_head scaling: q.k / d_head of O(1) vectors; at finite steps
              (-1/2..0)    the change of q and k is not yet correlated with them, so the
                           change of the logits shrinks like d_head^-1/2 at first; the
                           correlated Theta(1) part grows with the steps
attn_branch     0     0    hidden weights: var 1/fan_in, Adam lr 1/width
ffn_branch      0     0
residual        0     0
logits        -1/2    0    readout times 1/width: at init a sum of d uncorrelated terms
              (-1/2..0)    (d^1/2 / d); the change W_0 dx / width shrinks like width^-1/2,
                           dW x / width is Theta(1)
============  ===========  =========================================================

The standard parametrization (SP: 1/sqrt(d_head) attention, one Adam lr, no readout
multiplier), at leading order: init 0 everywhere; delta 0 at the embedding, +1 at the
branches, the residual stream and the logits (each update moves a d-term sum coherently),
about +3/2 at the attention logits.

A site departs when its slope lies more than :data:`TOLERANCE` above (:data:`TOLERANCE_BELOW`
below) muP's exponent (or range) and its 99% interval misses it. The cause is read from where and how the slopes depart:

* hidden sites (branches, residual) at init above muP: the hidden init std is fixed instead of
  proportional to 1/sqrt(fan_in);
* hidden sites' change above muP (init as expected): the hidden learning rate is not scaled
  1/width (Adam: lr / width_mult);
* the attention logits flatter than muP (hidden sites as expected): attention is scaled
  1/sqrt(d_head); muP scales it 1/d_head;
* the logits above muP (hidden sites as expected): the readout's 1/width multiplier is missing;
* the embedding's change below muP: the embedding learning rate is scaled with width; muP keeps
  it constant;
* a site downstream of departing hidden sites inherits their cause.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

__all__ = ["Fit", "CoordFinding", "fit_slopes", "judge_coord", "EXPECTED_MUP", "EXPECTED_SP", "TOLERANCE",
           "TOLERANCE_BELOW", "CONFIDENCE", "QUANTITIES", "RANGES"]

CONFIDENCE = 0.99
#: how far above muP's exponent a slope may sit before it can depart (finite widths, few steps:
#: a correct muP model's slopes lie within about 0.1 above theory's; every classic mistake but
#: one moves its site up by 1/2 or more)
TOLERANCE = 0.25
#: how far below: finite-width corrections shrink a correct muP model's changes at the small
#: widths (slopes down to about -0.3 below theory's measured here, on tinylm, a plain GPT and
#: a mup-package GPT); the one downward mistake (the embedding lr scaled 1/width) moves its site by -1
TOLERANCE_BELOW = 0.5
#: the judged quantities
QUANTITIES = ("init", "delta")
HIDDEN = ("attn_branch", "ffn_branch", "residual")

EXPECTED_MUP = {
    "init": {"embedding": 0.0, "attn_logits": -0.5, "attn_branch": 0.0, "ffn_branch": 0.0, "residual": 0.0,
             "logits": -0.5},
    "delta": {"embedding": 0.0, "attn_logits": -0.5, "attn_branch": 0.0, "ffn_branch": 0.0, "residual": 0.0,
              "logits": 0.0},
}
#: where theory allows a range at finite width and steps: the change of the logits and of the
#: attention logits mixes a part that shrinks like width^-1/2 (the change of their inputs seen
#: through weights uncorrelated with it) and a Theta(1) part that grows with the steps
RANGES = {("delta", "logits"): (-0.5, 0.0), ("delta", "attn_logits"): (-0.5, 0.0)}
EXPECTED_SP = {
    "init": {k: 0.0 for k in EXPECTED_MUP["init"]},
    "delta": {"embedding": 0.0, "attn_logits": 1.5, "attn_branch": 1.0, "ffn_branch": 1.0, "residual": 1.0,
              "logits": 1.0},
}

_CAUSES = {
    "init_std": ("hidden init std fixed instead of proportional to 1/sqrt(fan_in)",
                 "draw hidden weights with variance c / fan_in (tinylm: parametrization='mup'; mup: set_base_shapes)"),
    "hidden_lr": ("hidden learning rate not scaled 1/width",
                  "give hidden matrices lr / width_mult under Adam (tinylm.mup.param_groups; mup.MuAdam)"),
    "attention": ("attention is scaled 1/sqrt(d_head); muP scales it 1/d_head",
                  "compute the logits as q.k * sqrt(d_base_head) / d_head (equal to 1/sqrt(d_head) at the base width)"),
    "readout": ("readout multiplier missing",
                "multiply the logits by 1 / width_mult (tinylm: parametrization='mup'; mup: MuReadout)"),
    "embedding_lr": ("embedding learning rate scaled with width: muP keeps it constant",
                     "give embeddings the base lr at every width (Adam); only hidden matrices get lr / width_mult"),
    "other": ("departs from muP's width exponent", "compare this site's rule with the muP table (docs/mup.md)"),
}


@dataclass(frozen=True)
class Fit:
    """One site's slope of log RMS against log width, with its 99% interval."""

    site: str
    kind: str
    quantity: str
    step: int
    slope: float
    low: float
    high: float
    points: int
    expected: float | None
    expected_sp: float | None

    @property
    def expected_range(self) -> tuple[float, float] | None:
        """The exponents muP allows here at finite width and steps (:data:`RANGES`), or None."""
        if self.expected is None:
            return None
        return RANGES.get((self.quantity, self.kind), (self.expected, self.expected))

    @property
    def departs(self) -> bool:
        """The slope lies more than TOLERANCE above (TOLERANCE_BELOW below) muP's range and its
        interval misses the range."""
        rng = self.expected_range
        if rng is None or not math.isfinite(self.slope):
            return False
        lo, hi = rng
        far = self.slope > hi + TOLERANCE or self.slope < lo - TOLERANCE_BELOW
        return far and (self.high < lo or self.low > hi)


@dataclass(frozen=True)
class CoordFinding:
    """A site whose width exponent departs from muP's: where, what was measured, why, the fix."""

    site: str
    kind: str
    quantity: str
    slope: float
    interval: tuple[float, float]
    expected: float
    allowed: tuple[float, float]
    expected_sp: float | None
    severity: str
    cause: str
    fix: str

    @property
    def message(self) -> str:
        what = "RMS at init" if self.quantity == "init" else "change from init"
        return (f"{self.site} ({self.kind}): {what} scales as width^{self.slope:+.2f} "
                f"[{self.interval[0]:+.2f}, {self.interval[1]:+.2f}] where muP expects {self._expects}: "
                f"{self.cause}; fix: {self.fix}")

    @property
    def _expects(self) -> str:
        lo, hi = self.allowed
        return f"{self.expected:+.2f}" if lo == hi else f"{lo:+.2f} to {hi:+.2f}"

    def to_dict(self) -> dict:
        return {**asdict(self), "interval": list(self.interval), "allowed": list(self.allowed),
                "message": self.message}


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """(slope, low, high) of the least-squares line of y on x with its CONFIDENCE interval."""
    n = len(x)
    if n < 2 or np.ptp(x) == 0:
        return math.nan, math.nan, math.nan
    xc = x - x.mean()
    slope = float((xc * (y - y.mean())).sum() / (xc * xc).sum())
    if n < 3:
        return slope, -math.inf, math.inf
    resid = y - y.mean() - slope * xc
    se = math.sqrt(float((resid * resid).sum()) / (n - 2) / float((xc * xc).sum()))
    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 2)) * se
    return slope, slope - half, slope + half


def fit_slopes(points: dict[tuple[str, str, str, int], list[tuple[int, float]]]) -> list[Fit]:
    """A :class:`Fit` per (site, kind, quantity, step) from its (width, value) points; values that
    are zero or not finite (a zero-initialised site at init) are left out."""
    fits = []
    for (site, kind, quantity, step), pts in points.items():
        kept = [(w, v) for w, v in pts if v > 0 and math.isfinite(v)]
        x = np.log([w for w, _ in kept]) if kept else np.zeros(0)
        y = np.log([v for _, v in kept]) if kept else np.zeros(0)
        slope, low, high = _fit(x, y)
        fits.append(Fit(site, kind, quantity, step, slope, low, high, len(kept),
                        EXPECTED_MUP.get(quantity, {}).get(kind), EXPECTED_SP.get(quantity, {}).get(kind)))
    return fits


def _cause(fit: Fit, hidden_init: bool, hidden_delta: bool) -> str:
    """The key of :data:`_CAUSES` the departure of ``fit`` points to (module docstring)."""
    up = fit.slope > fit.expected_range[1]
    if fit.kind in HIDDEN:
        if hidden_init and up:
            return "init_std"
        return "hidden_lr" if fit.quantity == "delta" and up else "other"
    if hidden_init:  # downstream of hidden weights drawn too large (or small): at init and after
        return "init_std"
    if hidden_delta and fit.quantity == "delta":
        return "hidden_lr"
    if fit.kind == "attn_logits" and up:
        return "attention"
    if fit.kind == "logits" and up:
        return "readout"
    if fit.kind == "embedding" and fit.quantity == "delta" and not up:
        return "embedding_lr"
    return "other"


def judge_coord(fits: list[Fit]) -> list[CoordFinding]:
    """The findings of the judged fits (``init`` at step 0, ``delta`` at the last step): one per
    departing site and quantity, upstream causes first (module docstring)."""
    judged = [f for f in fits if f.quantity in QUANTITIES and f.expected is not None]
    departing = [f for f in judged if f.departs]
    hidden_init = any(f.kind in HIDDEN and f.quantity == "init" and f.slope > f.expected for f in departing)
    hidden_delta = any(f.kind in HIDDEN and f.quantity == "delta" and f.slope > f.expected for f in departing)
    out = []
    for f in departing:
        cause, fix = _CAUSES[_cause(f, hidden_init, hidden_delta)]
        out.append(CoordFinding(f.site, f.kind, f.quantity, f.slope, (f.low, f.high), f.expected, f.expected_range,
                                f.expected_sp, "fail", cause, fix))
    return out
