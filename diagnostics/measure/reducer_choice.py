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
benchmark can switch it between calls. The name it replaces, ``TINYLM_FUSED`` (``0``:
reference, ``compiled``: compiled, anything else: auto), is still read, with a
DeprecationWarning, when ``TINYLM_REDUCER`` is not set.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["ENV", "CHOICES", "chosen"]

ENV = "TINYLM_REDUCER"
CHOICES = ("auto", "cuda", "compiled", "reference")
_OLD_ENV = "TINYLM_FUSED"
_OLD_VALUES = {"0": "reference", "compiled": "compiled"}


def chosen() -> str:
    """The reducer choice of this moment: "auto", "cuda", "compiled" or "reference" (see the module docstring)."""
    value = os.environ.get(ENV)
    if value is None:
        old = os.environ.get(_OLD_ENV)
        if old is None:
            return "auto"
        value = _OLD_VALUES.get(old, "auto")
        warnings.warn(f"{_OLD_ENV}={old} is deprecated; set {ENV}={value} instead", DeprecationWarning, stacklevel=3)
    return value if value in CHOICES else "auto"
