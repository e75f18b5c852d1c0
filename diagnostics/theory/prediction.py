"""One prediction of one tensor's moments, whichever theory made it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["Prediction", "no_variance_left"]


@dataclass(frozen=True)
class Prediction:
    """Predicted moments of one tensor in one direction.

    mean_square: predicted E[x^2]; mean: the mean used (local: measured; global: predicted);
    var = mean_square - mean^2. valid/validity: whether the rule's assumptions hold here.
    rule: which rule produced it (for the report); the token-kernel theory's rules start
    with "kernel". cosine: the predicted mean cosine between different tokens of a sequence
    (the kernel theory, at the residual points; None elsewhere). independent: where the
    kernel theory made this prediction, the independent-token rule's prediction of the same
    tensor (with its own validity), kept for comparison; None otherwise.
    """

    mean_square: float
    mean: float
    valid: bool
    validity: str
    rule: str
    cosine: float | None = None
    independent: Prediction | None = None

    @property
    def var(self) -> float:
        return self.mean_square - self.mean * self.mean  # inf, never OverflowError, past the float64 range


def no_variance_left(p: Prediction) -> Prediction:
    """A valid prediction that cannot be compared with a measured variance is outside validity:
    one whose numbers left the float64 range (inf or NaN: the recursion overflowed on an absurdly
    scaled model), and one whose variance (mean square - mean^2) is not positive."""
    if p.valid and not (math.isfinite(p.mean_square) and math.isfinite(p.mean) and math.isfinite(p.var)):
        return dataclasses.replace(
            p, valid=False, validity=f"cannot be computed in double precision (mean square {p.mean_square:.3g}, "
                                     f"mean {p.mean:.3g}): the model's scale overflows the rule")
    if p.valid and not p.var > 0 and p.mean_square > 0:
        return dataclasses.replace(
            p, valid=False, validity=f"the mean ({p.mean:.3g}) exceeds the predicted root mean square "
                                     f"({math.sqrt(p.mean_square):.3g}): no variance is left to predict (local mode: "
                                     "a trained layer whose weights align with its input's mean, not a random matrix)")
    return p
