"""Predicted SQNR of a GEMM cast to a low-precision recipe, from each format's rounding error and
each operand's measured values.

Model. An operand entry x, scaled to s = x m by its group's multiplier m (diagnostics.measure.quant),
is rounded to the format's grid; the error is taken as independent of every other entry's and
uniform over one step, with the step of s's binade,

    step(s) = 2^(max(floor(log2 |s|), emin) - mbits),   Var = min(step^2 / 12, s^2),

the second where the grid cannot hold s: an entry under about half the smallest step becomes 0
(error s^2, the underflow); one above the format's max saturates (error (|s| - max)^2, the overflow).
Read back in x's units the variance is divided by m^2. A GEMM out = L R^T contracted along k
(fprop: x W^T; dgrad: g W; wgrad: g^T x) with independent operand errors e_L, e_R has error power

    E ||out - out_q||^2 = sum_k  sum_i Var e_L[i,k] * sum_j R[j,k]^2  +  sum_i L[i,k]^2 * sum_j Var e_R[j,k]

(the product of the two errors, of second order, dropped), so

    predicted_sqnr_db = 10 log10( ||out||^2 / that ).

``ideal_sqnr_db`` is the same with an unbounded exponent (no underflow, no saturation, no scale): what
the format's mantissa alone allows for these values; the recipe's loss to range is ideal - measured.

Validity. The premise is an error uniform over one step and independent between entries. It fails
where an operand's values already sit on the format's grid (a weight stored in that format), or
where scaling makes the errors of a whole group move together; the measurement tells: when an
operand's measured quantization error power departs from its predicted one by more than 2x, or
when the error comes from too few entries for one draw to sit near its expectation
(:data:`MIN_ENTRIES`), the prediction is shown outside validity, with that reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..measure.quant import Cast, Scaled, scaled_groups

__all__ = ["MIN_ENTRIES", "PREMISE_FACTOR", "element_noise", "noise_sums", "ideal_noise", "unit_ideal_noise", "GemmTheory",
           "GemmPrediction", "predict_gemm", "describe_operand"]

#: an operand whose measured quantization error power departs from its prediction by more than this
#: factor (either way) voids the prediction of every GEMM it enters
PREMISE_FACTOR = 2.0
#: fewest entries the error may effectively come from: the power of n independent uniform rounding
#: errors has a relative standard deviation of about 0.894 / sqrt(n) (a squared uniform's), so 1 dB
#: (a factor 0.79) at 4.9 standard deviations (a 1e-6 false alarm) needs n >= (4.9 * 0.894 / 0.206)^2 ~ 450
MIN_ENTRIES = 500


def _binade(s: Tensor) -> Tensor:
    """2^floor(log2 |s|) of each float32 entry, read from its exponent bits (0 for 0 and subnormals)."""
    return (s.contiguous().view(torch.int32) & 0x7F800000).view(torch.float32)


def _rounding_variance(s: Tensor, mbits: int, emin: int | None, fmax: float | None, small: bool = True,
                       unit: Tensor | None = None) -> Tensor:
    """Each entry's predicted variance (module docstring) in s's units, times ``unit`` (per group, to read
    it back in x's units) where given. ``small`` False: no entry rounds to 0, so the variance is step^2 / 12."""
    p = _binade(s)
    if emin is not None:
        p = p.clamp_(min=2.0 ** emin)
    k = 2.0 ** -mbits / math.sqrt(12.0)  # step / sqrt(12) = 2^e k
    if not small and fmax is None:
        return p.mul_(k if unit is None else unit.sqrt() * k).square_()
    # step^2 / 12, or s^2 where smaller: an entry under about half a step rounds to 0 (0 stays 0)
    var = p.mul_(k).square_()
    if small:
        var = torch.minimum(var, s * s)
    if fmax is not None:
        mag = s.abs()
        var = torch.where(mag > fmax, (mag - fmax) ** 2, var)
    return var if unit is None else var.mul_(unit)


def element_noise(x: Tensor, cast: Cast, scaled: Scaled | None = None, saturates: bool = True,
                  small: bool = True) -> Tensor:
    """Predicted error variance of each entry of ``x`` (rows, K), cast along K as ``cast``, in x's units;
    ``scaled``: the operand as quantize saw it (diagnostics.measure.quant.quantize(keep_scaled=True));
    ``saturates`` False skips the saturation term (no entry exceeded the format's max), ``small`` False
    the underflow term (no entry became 0)."""
    if cast.format is None:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if scaled is None:
        g, pad, mult, reader = scaled_groups(x.to(torch.float32), cast)
        scaled = Scaled(g * mult, reader, pad, tuple(x.shape))
    fmt = cast.format
    r2 = scaled.reader * scaled.reader
    unit = r2 if cast.scale_rounding == "e4m3_nv" else 1.0 / r2
    var = _rounding_variance(scaled.scaled, fmt.mbits, fmt.emin, fmt.max if saturates else None, small, unit)
    rows, k = scaled.shape
    return var.reshape(rows, -1)[:, :k] if scaled.pad else var.reshape(rows, k)


def unit_ideal_noise(x: Tensor) -> Tensor:
    """Each entry's rounding variance with no mantissa bit and an unbounded exponent; a format with
    m mantissa bits has 4^-m times it (the ideal: module docstring)."""
    return _rounding_variance(x.to(torch.float32), 0, None, None, small=False)


def ideal_noise(x: Tensor, cast: Cast) -> Tensor:
    """The predicted variance with an unbounded exponent: the format's mantissa alone."""
    if cast.format is None:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return unit_ideal_noise(x) * 4.0 ** -cast.format.mbits


def _db(signal: float, noise: float) -> float:
    if noise <= 0:
        return math.inf
    if signal <= 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


@dataclass
class GemmPrediction:
    """Theory for one GEMM and recipe: ``sqnr_db`` predicted, ``ideal_sqnr_db`` the mantissa's alone,
    ``left_share`` the share of the predicted error power the left operand brings, ``valid`` and
    ``reason`` (why not, or "")."""

    sqnr_db: float
    ideal_sqnr_db: float
    left_share: float
    valid: bool
    reason: str


def noise_sums(var: Tensor) -> tuple[Tensor, Tensor]:
    """Of an operand's predicted error variances (rows, K), contracted along K: per k the sum over rows of
    the variance and of its square (float32: a pairwise sum, relative error ~1e-6, far below the 1 dB the
    theory is held to). What :meth:`GemmTheory.predict` needs of it."""
    return var.sum(0), (var * var).sum(0)


class GemmTheory:
    """The recipe-independent part of one GEMM out = left right^T (both (., K)): the operands' column
    powers and their unit ideal error powers; :meth:`predict` then costs one reduction per operand
    (none given its :func:`noise_sums`)."""

    def __init__(self, left: Tensor, right: Tensor, signal: float, unit_left: Tensor | None = None,
                 unit_right: Tensor | None = None):
        left, right = left.to(torch.float32), right.to(torch.float32)
        self.l2, self.r2, self.signal = left.pow(2).sum(0), right.pow(2).sum(0), signal
        ul = unit_ideal_noise(left) if unit_left is None else unit_left
        ur = unit_ideal_noise(right) if unit_right is None else unit_right
        self.ideal_units = (float(ul.sum(0) @ self.r2), float(ur.sum(0) @ self.l2))

    @classmethod
    def from_sums(cls, l2: Tensor, r2: Tensor, signal: float, unit_sums: tuple[Tensor, Tensor]) -> "GemmTheory":
        """From the operands' column powers l2, r2 (K,) and their unit ideal variances summed over rows."""
        self = cls.__new__(cls)
        self.l2, self.r2, self.signal = l2, r2, signal
        self.ideal_units = (float(unit_sums[0] @ r2), float(unit_sums[1] @ l2))
        return self

    def predict(self, casts: tuple[Cast, Cast], noise: tuple, measured: tuple[float | None, float | None] = (None, None),
                names: tuple[str, str] = ("left", "right")) -> GemmPrediction:
        """The prediction from each operand's :func:`element_noise` (or its :func:`noise_sums`) and its
        measured error power."""
        sums = [noise_sums(v) if isinstance(v, Tensor) else v for v in noise]
        (vl, ql), (vr, qr) = sums
        nl, nr = float(vl @ self.r2), float(vr @ self.l2)
        squares = float(ql @ self.r2.square()) + float(qr @ self.l2.square())
        n_eff = (nl + nr) ** 2 / squares if squares > 0 else 0.0
        ideal = sum(u * 4.0 ** -c.format.mbits for u, c in zip(self.ideal_units, casts) if c.format is not None)
        reason = ""
        if 0 < n_eff < MIN_ENTRIES:
            reason = (f"the error comes from about {n_eff:.0f} entries (< {MIN_ENTRIES}): one draw strays too far "
                      "from its mean")
        for name, (var, _), meas, cast in zip(names, sums, measured, casts):
            if reason or meas is None or cast.format is None:
                continue
            predicted = float(var.sum())
            if predicted == 0 and meas == 0:
                continue
            ratio = meas / predicted if predicted > 0 else math.inf
            if not (1 / PREMISE_FACTOR <= ratio <= PREMISE_FACTOR):
                reason = (f"{name}'s rounding error is {ratio:.2g}x the uniform-rounding prediction (values on the "
                          "format's grid, or errors that move together)")
        total = nl + nr
        return GemmPrediction(_db(self.signal, total), _db(self.signal, ideal), nl / total if total > 0 else 0.5,
                              not reason, reason)


def predict_gemm(left: Tensor, right: Tensor, casts: tuple[Cast, Cast], signal: float,
                 measured_noise: tuple[float | None, float | None] = (None, None),
                 names: tuple[str, str] = ("left", "right")) -> GemmPrediction:
    """Predicted SQNR of out = left right^T (both (., K), cast along K as ``casts``) whose exact
    output has power ``signal``. ``measured_noise``: each operand's measured quantization error power
    (sum of squares), held to its predicted one (the premise; module docstring)."""
    noise = (element_noise(left, casts[0]), element_noise(right, casts[1]))
    return GemmTheory(left, right, signal).predict(casts, noise, measured_noise, names)


def describe_operand(x: Tensor, power: Tensor | None = None, zeros: int | None = None) -> dict[str, float]:
    """What the judge reads of an operand (rows, channels): ``peak_to_median`` max|x| / median|x| (of
    the non-zero entries), ``kurtosis`` E x^4 / (E x^2)^2, ``channel_ratio`` the largest channel's
    root mean square over the median channel's, ``top_channel`` its index, ``peak_share`` the share of
    that channel's power its largest entry holds (near 1: one entry, not a feature). ``power``: the
    column powers (x^2 summed over rows) and ``zeros``: how many entries are 0, where known."""
    x = x.to(torch.float32)
    a = x.abs()
    nz = a.reshape(-1) if zeros == 0 else a[a > 0]
    if nz.numel() == 0:
        return {"peak_to_median": math.nan, "kurtosis": math.nan, "channel_ratio": math.nan, "top_channel": -1,
                "peak_share": math.nan}
    step = max(1, nz.numel() // 65536)  # the median of a strided sample: a figure, not a statistic we test
    median = float(nz[::step].median())
    sq = x * x
    power = sq.sum(0) if power is None else power
    m2 = float(power.sum()) / x.numel()
    m4 = float(sq.square_().sum(dtype=torch.float64)) / x.numel()  # x^4 summed in float32 could overflow
    rms = (power / x.shape[0]).sqrt()
    med_rms = float(rms.median())
    top = int(rms.argmax())
    share = float(a[:, top].max() ** 2 / power[top]) if power[top] > 0 else 1.0
    return {"peak_to_median": float(a.max()) / median if median > 0 else math.inf,
            "kurtosis": float(m4 / (m2 * m2)) if m2 > 0 else math.nan,
            "channel_ratio": float(rms[top]) / med_rms if med_rms > 0 else math.inf, "top_channel": top,
            "peak_share": share}
