"""Which code reduces a tensor: the environment variable ``TINYLM_REDUCER``.

``reduce`` (:mod:`.reducer`) picks, per tensor, one of three reducers that compute the same
numbers: the numba reducer (:mod:`.numba_reducer`, CPU tensors), the compiled reducer
(:mod:`.compiled`, ``torch.compile``: other devices, or a CPU without numba) and the reference
(:mod:`.reference`, plain torch: what neither takes). ``TINYLM_REDUCER`` overrides that:

======================  =================================================================
``auto`` (or unset)     by device, as above
``cuda``                CPU tensors take exactly the path CUDA tensors take: the same
                        registered op (:mod:`.reduction`) with its CUDA-structure kernel
                        (the compiled reducer), the same ops dispatched, in the same
                        number (to measure a GPU's launch-bound cost on a CPU)
``compiled``            the same as ``cuda`` (its older name)
``reference``           the reference for every tensor
======================  =================================================================

Any other value reads as ``auto``. The variable is read on every call, so a test or a
benchmark can switch it between calls, except inside :func:`pinned` (a probe holds it there
while it is on: one read per probe, not one per tensor; the choice is process-wide, so a
probe in another thread sees the same pin). The name it replaces, ``TINYLM_FUSED`` (``0``:
reference, ``compiled``: compiled, anything else: auto), is still read, with a
DeprecationWarning, when ``TINYLM_REDUCER`` is not set.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Iterator

__all__ = ["ENV", "CHOICES", "chosen", "pinned"]

ENV = "TINYLM_REDUCER"
CHOICES = ("auto", "cuda", "compiled", "reference")
_OLD_ENV = "TINYLM_FUSED"
_OLD_VALUES = {"0": "reference", "compiled": "compiled"}
_pinned: str | None = None


@contextmanager
def pinned() -> Iterator[str]:
    """The choice of this moment, held (and yielded) until the context exits: :func:`chosen`
    returns it without reading the environment. Nested pins keep the outermost choice."""
    global _pinned
    before = _pinned
    _pinned = chosen()
    try:
        yield _pinned
    finally:
        _pinned = before


def chosen() -> str:
    """The reducer choice of this moment: "auto", "cuda", "compiled" or "reference" (see the module docstring)."""
    if _pinned is not None:
        return _pinned
    value = os.environ.get(ENV)
    if value is None:
        old = os.environ.get(_OLD_ENV)
        if old is None:
            return "auto"
        value = _OLD_VALUES.get(old, "auto")
        warnings.warn(f"{_OLD_ENV}={old} is deprecated; set {ENV}={value} instead", DeprecationWarning, stacklevel=3)
    return value if value in CHOICES else "auto"
