"""Floating-point tolerances derived from the unit roundoff, never guessed.

u(dtype) = 2^-p for a p-bit significand (float64 2^-53, float32 2^-24, bfloat16 2^-8,
float16 2^-11). A sum of n terms has relative error <= n u (Higham, Thm 3.1), a
correctly rounded operation <= u, an elementary function <= 2u (libm/SLEEF accuracy).
"""

from __future__ import annotations

import torch

__all__ = ["unit_roundoff", "ulp", "TINY", "compute_roundoff", "flush_floor"]

#: An absolute floor for comparisons of probabilities (far below any float32 normal value).
TINY = 2.0**-120


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 of ``dtype`` (the largest relative error of one correct rounding)."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype}: unit roundoff is defined for floating-point dtypes")
    return float(torch.finfo(dtype).eps) / 2.0


def ulp(x: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype`` numbers at magnitude |x| (at least the smallest normal's)."""
    x = abs(float(x))
    t = torch.tensor(x, dtype=dtype)
    nxt = torch.nextafter(t, torch.tensor(float("inf"), dtype=dtype))
    return max(float(nxt - t), float(torch.finfo(dtype).tiny))


def compute_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff of the dtype a function that upcasts computes in: float32 for bfloat16 and
    float16 inputs (at least float32), ``dtype``'s own otherwise."""
    return unit_roundoff(torch.promote_types(dtype, torch.float32))


def flush_floor(dtype: torch.dtype) -> float:
    """The absolute error allowed for a tiny result of ``dtype``: 8 times the smallest normal of the
    dtype it is computed in (at least float32), where a result may be flushed to zero, plus the
    spacing of ``dtype``'s subnormals (its final rounding). torch's vectorized CPU exp and sigmoid
    return 0 below e^-87.3 in float32 rather than a subnormal, and tinylm's softmax sets the
    exponentials below e^2 times the smallest normal to 0 (far below the ulp of the sum they join)."""
    compute = torch.promote_types(dtype, torch.float32)
    return 8.0 * float(torch.finfo(compute).tiny) + 2.0 * unit_roundoff(dtype) * float(torch.finfo(dtype).tiny)
