"""Measurement: the probe, the mergeable moments it records, and their merge across ranks.

* :mod:`.probe` — hooks on any ``nn.Module`` that reduce each tensor at once (forward
  activations, backward gradients, attention panels, parameters) and leave no trace;
  :mod:`.pending` — its queue: the tensors whose moments alone are asked, reduced together;
  :mod:`.attention_observer` — tinylm attention's observer and the queue that measures a pass's
  layers together (:mod:`.attention`: the statistics from q, k, v and the heads' gradient);
* :mod:`.sites` — which tensors of a model are measured (embeddings, block stack, attention,
  head, the default points), found once for every job by ``model_sites``;
* :mod:`.reducer` — ``reduce``, the one reduction of a tensor to every statistic the probe
  takes, ``Reducer`` (that reduction, remembering the tensors it just read), and the merge of
  the vectors it gives;
* :mod:`.reference` — what each of those statistics means, in plain torch (the reduction off the CPU);
* :mod:`.numba_reducer` — the numba reducer: one pass over a CPU tensor behind ``reduce``;
  :mod:`.compiled` — the compiled reducer (``torch.compile``) for other devices;
  :mod:`.reducer_choice` — ``TINYLM_REDUCER``, which overrides the choice by device;
* :mod:`.moments` — the records a probe fills (``Moments``, ``AttnMoments``, ``ParamStats``,
  ``ProbeStats``);
* :mod:`.distributed` — the all-reduce of a ``ProbeStats`` over ``torch.distributed``.
"""

from .distributed import merge_distributed
from .moments import AttnMoments, Moments, ParamStats, ProbeStats
from .probe import ProbeRun, block_index, instrument_points, probe
from .reducer import Reducer, Reduction, reduce
from .sites import Sites, model_sites

__all__ = ["probe", "ProbeRun", "instrument_points", "block_index", "Moments", "AttnMoments", "ParamStats",
           "ProbeStats", "merge_distributed", "reduce", "Reduction", "Reducer", "Sites", "model_sites"]
