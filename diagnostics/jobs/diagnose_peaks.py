"""What ``diagnose`` reads off each block's output beside the probe: its peak over its median.

Internal to :mod:`diagnostics.jobs.diagnose` (its ``_measure`` stage). A block output's
peak ratio is

    peak = max |x| / median |x|        over the entries of the rows sampled (all rows up to
                                       :data:`MAX_ENTRIES` entries, else every k-th row)

the statistic of massive activations (a few entries, in fixed channels, thousands of times
the typical one); NaN where the median is 0 or the output holds a non-finite entry.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["MAX_ENTRIES", "block_peaks", "peak_ratio"]

#: the most entries of one block output the median is taken over (rows are strided beyond it)
MAX_ENTRIES = 1 << 22


def _peak(x: Tensor) -> Tensor:
    """(max |x|, median |x|) over the rows of ``x`` (..., d), at most :data:`MAX_ENTRIES` entries
    (every k-th row beyond), as a float32 tensor of 2 on ``x``'s device."""
    rows = x.detach().reshape(-1, x.shape[-1]) if x.dim() > 1 else x.detach().reshape(-1, 1)
    step = max(1, math.ceil(rows.numel() / MAX_ENTRIES))
    a = rows[::step].float().abs()
    return torch.stack([a.max(), a.median()])


def _ratio(top: float, mid: float) -> float:
    return top / mid if mid > 0 and math.isfinite(top) else math.nan


def peak_ratio(x: Tensor) -> float:
    """max |x| / median |x| over the rows of ``x`` (..., d), at most :data:`MAX_ENTRIES` entries
    (every k-th row beyond); NaN when the median is 0 or an entry is not finite."""
    with torch.no_grad():
        return _ratio(*_peak(x).tolist())


@contextmanager
def block_peaks(model: nn.Module, names: tuple[str, ...], out: dict[str, float]):
    """While open, each forward of the blocks ``names`` (module names of ``model``) measures its
    output's max |x| and median |x| on its device (a tuple output: its first tensor); on exit,
    ``out[name]`` becomes the largest :func:`peak_ratio` over the calls and any value already there
    (NaN where none is finite), read from the device once. Every hook is removed on exit."""
    modules = dict(model.named_modules())
    handles, seen = [], []

    def hook(name: str):
        def record(_module, _args, output):
            y = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(y, Tensor) and y.is_floating_point() and y.numel():
                with torch.no_grad():
                    seen.append((name, _peak(y)))
        return record

    try:
        for n in names:
            if n in modules:
                handles.append(modules[n].register_forward_hook(hook(n)))
        yield out
    finally:
        for h in handles:
            h.remove()
    if seen:
        values = torch.stack([t.to(seen[0][1].device) for _, t in seen]).tolist()  # one read of the device
        for (name, _), (top, mid) in zip(seen, values):
            r, old = _ratio(top, mid), out.get(name, math.nan)
            out[name] = r if math.isnan(old) or (math.isfinite(r) and r > old) else old
