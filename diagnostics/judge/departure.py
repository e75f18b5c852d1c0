"""Whether two executions of one model part ways at a site: departure against what rounding explains.

The departure of a candidate tensor a from the reference b is the relative distance

    departure = ||a - b||_F / ||b||_F,

estimated from their sketches (:func:`relative_departure`). It is judged against

    tolerance = c_dir * (u_store + u_acc * sqrt(w)) * (1 + a * l)

    u_store   the unit roundoff of the coarser dtype the two tensors are stored in
              (float64 2^-53, float32 2^-24, bfloat16 2^-8, float16 2^-11): one rounding of each
              element, and of every intermediate of that dtype;
    u_acc     the unit roundoff sums accumulate in: 2^-53 when both sides are float64, else
              2^-24 (bfloat16 and float16 products accumulate in float32);
    sqrt(w)   the growth of a length-w sum's rounding error (random-walk), w the stream's width;
    l         the number of blocks the error has passed through: in the forward, 0 at the stream
              entering the blocks, i + 1 at block i's sites, L + 1 at the final norm and logits;
              backward, the whole forward (L + 1) plus the blocks from the loss down to the site,
              L + 2 at the logits' gradient to 2L + 3 at the embedding's;
    c_dir, a  constants calibrated on pairs of executions that are equivalent in exact arithmetic
              (docs/diff.md): the largest departure/tolerance measured there is a fraction of 1.

A site departs when departure > tolerance; a non-finite count that differs between the two sides
is an infinite departure. :func:`first_departure` names the first one, in forward order and then
backward from the loss.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

__all__ = ["UNIT_ROUNDOFF", "Tolerance", "unit_roundoff", "relative_departure", "sketch_error", "first_departure"]

#: unit roundoff u = 2^-p of each floating dtype (p = significand bits, counting the implicit one)
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def unit_roundoff(dtype: str) -> float:
    """u of a dtype name ("float32", "torch.bfloat16", ...); an unknown one is treated as float32."""
    return UNIT_ROUNDOFF.get(str(dtype).removeprefix("torch."), UNIT_ROUNDOFF["float32"])


@dataclass(frozen=True)
class Tolerance:
    """The constants of the tolerance formula (module docstring).

    forward, backward: c for forward tensors and for gradients.
    growth: a, the growth per block passed through.
    """

    forward: float = 4.0
    backward: float = 2.0
    growth: float = 0.5

    def __call__(self, dtypes: Sequence[str], width: int, depth: int, direction: str) -> float:
        """The tolerance of one site: ``dtypes`` the two sides' dtypes, ``width`` w, ``depth`` l."""
        u_store = max(unit_roundoff(d) for d in dtypes)
        u_acc = UNIT_ROUNDOFF["float64"] if all(unit_roundoff(d) <= UNIT_ROUNDOFF["float64"] for d in dtypes) \
            else UNIT_ROUNDOFF["float32"]
        c = self.forward if direction == "forward" else self.backward
        return c * (u_store + u_acc * math.sqrt(max(width, 1))) * (1.0 + self.growth * depth)

    def to_dict(self) -> dict:
        return asdict(self)


def relative_departure(candidate: np.ndarray, reference: np.ndarray) -> float:
    """||S_a - S_b||_F / ||S_b||_F of two sketches: 0 when both are zero, inf when only b is.

    For sketches S = G^T X H / k with independent standard Gaussian G, H, ||S||_F^2 is an unbiased
    estimate of ||X||_F^2, so the ratio estimates ||a - b|| / ||b||; its relative error is about
    :func:`sketch_error`."""
    a, b = np.asarray(candidate, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    num, den = float(np.linalg.norm(a - b)), float(np.linalg.norm(b))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def sketch_error(k: int) -> tuple[float, float]:
    """The relative standard error of a sketched norm ||S||_F as an estimate of ||X||_F, as
    (diffuse, rank one): 1 / (sqrt(2) k) for a difference spread over many directions (||S||^2 is
    then about a chi-square of k^2 degrees of freedom over k^2), 1 / sqrt(k) for a rank-one
    difference (the product of two chi-squares of k degrees of freedom)."""
    return 1.0 / (math.sqrt(2.0) * k), 1.0 / math.sqrt(k)


def first_departure(ratios: Sequence[float]) -> int | None:
    """The index of the first ratio departure/tolerance above 1 (NaN counts as departing), else None.
    The caller gives the ratios in judging order: forward in forward order, then backward from the loss."""
    for i, r in enumerate(ratios):
        if not (r <= 1.0):
            return i
    return None
