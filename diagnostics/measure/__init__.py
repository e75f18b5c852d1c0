"""Measurement: the probe, the mergeable moments it records, and their merge across ranks.

* :mod:`.probe` — hooks on any ``nn.Module`` that reduce each tensor at once (forward
  activations, backward gradients, attention panels, parameters) and leave no trace;
* :mod:`.moments` — the mergeable moment vectors and the records built from them
  (``Moments``, ``AttnMoments``, ``ParamStats``, ``ProbeStats``) and the reduction that
  fills them;
* :mod:`.accel` — the compiled single-pass reduction (numba) behind that reduction on the CPU;
* :mod:`.distributed` — the all-reduce of a ``ProbeStats`` over ``torch.distributed``.
"""

from .distributed import merge_distributed
from .moments import AttnMoments, Moments, ParamStats, ProbeStats
from .probe import ProbeRun, block_index, instrument_points, probe

__all__ = ["probe", "ProbeRun", "instrument_points", "block_index", "Moments", "AttnMoments", "ParamStats",
           "ProbeStats", "merge_distributed"]
