"""The numba loop of the watch's update ratios: ||W - W_before|| / ||W_before|| of every plain CPU
float32 matrix in one call (imported on first use, as :mod:`._numba`; a module-level function, so
that numba's ``cache=True`` finds it again in the next process).

The torch formulas (:func:`diagnostics.measure.sharded.update_ratio_vector`) take the differences
in the parameters' dtype, a new tensor each, and then two float64 norms; here each pair of
tensors is read once, the difference rounded to float32 as torch rounds it and both sums of
squares kept in float64 (in eight partial sums: the figures agree with torch's to the rounding
of the order of the sums: tests/test_watch_record_cost.py holds them to 1e-12 relative).
"""

import math

import numpy as np
from numba import carray, njit

from ._numba_vectors import at

#: partial sums per tensor (a stride the compiler vectorises)
LANES = 8


@njit(cache=True)
def ratios(now, was, ns, out):
    """out[i] = ||now_i - was_i|| / ||was_i|| of the ns[i] float32 entries at addresses now[i] and
    was[i] (int64 arrays): inf where was_i is 0 and now_i is not, 0 where both are, and where an
    entry is not finite what the torch formulas give (their ``where`` on the two norms)."""
    for i in range(ns.size):
        a = carray(at(now[i]), ns[i]).view(np.float32)  # the pointer is to uint32: its bits
        b = carray(at(was[i]), ns[i]).view(np.float32)
        num = np.zeros(LANES)
        den = np.zeros(LANES)
        n = ns[i]
        full = n - n % LANES
        for j in range(0, full, LANES):
            for k in range(LANES):
                d = np.float64(np.float32(a[j + k] - b[j + k]))
                w = np.float64(b[j + k])
                num[k] += d * d
                den[k] += w * w
        for j in range(full, n):
            d = np.float64(np.float32(a[j] - b[j]))
            w = np.float64(b[j])
            num[0] += d * d
            den[0] += w * w
        top, bottom = math.sqrt(num.sum()), math.sqrt(den.sum())
        if bottom > 0:
            out[i] = top / bottom
        elif top > 0:
            out[i] = np.inf
        else:
            out[i] = 0.0
