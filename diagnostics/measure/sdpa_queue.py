"""The SDPA calls of a pass, measured together: :class:`SDPAQueue`.

A probe measures each ``scaled_dot_product_attention`` call of a model on its sampled query
rows (:mod:`.sdpa`). Measured in the call, that is a product, a softmax and the statistics per
layer: on the CPU a dozen small ops and the Python around them (about 0.3 ms a call at the
launch-bound shape, 24 calls a GPT-2 pass), on a GPU a dozen launches. Here a call is kept as
(name, q, k, mask, is_causal, scale, their versions) and :meth:`SDPAQueue.flush` measures the
calls that share their shapes, dtypes, device, mask, ``is_causal`` and ``scale`` (a model's
layers) with one stacked product (:func:`.sdpa.summaries`: one op for the group, each call's
figures those it gets alone), then reports each call in the order the calls came.

Memory: autograd keeps a call's q and k for its backward anyway; where it does not (a pass
without gradients), :data:`MAX_BYTES` bounds what waits here, past which :meth:`SDPAQueue.add`
asks for a flush. Changed in place: a call whose q, k or mask has a ``_version`` other than the
one it had when it was queued is not reported (not measured, never a wrong figure) and counts
in :attr:`SDPAQueue.stale`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from . import sdpa

__all__ = ["SDPAQueue", "MAX_BYTES"]

_PLAIN = (Tensor, torch.nn.Parameter)

#: bytes of queued q and k past which :meth:`SDPAQueue.add` asks for a flush
MAX_BYTES = 16 << 20


def _version(t: Tensor | None) -> int:
    return -1 if t is None else t._version


class SDPAQueue:
    """The calls waiting (module docstring); ``report(name, moments, panel, vec)`` receives each
    measured call at the flush, ``signal`` whether the signal vector is asked for, ``waiting()``
    (if given) is called as each call is queued (the owner's cue to flush before the backward)."""

    def __init__(self, report: Callable, signal: bool, waiting: Callable[[], None] | None = None,
                 max_bytes: int = MAX_BYTES):
        self.report, self.signal, self.waiting, self.max_bytes = report, signal, waiting, max_bytes
        self.stale = 0
        self._calls: list[tuple] = []
        self._bytes = 0

    @staticmethod
    def takes(q, k, mask) -> bool:
        """Whether a call can wait here: plain tensors (a subclass is measured in its call)."""
        return type(q) in _PLAIN and type(k) in _PLAIN and (mask is None or type(mask) in _PLAIN)

    def clear(self) -> None:
        """Drop every call waiting (a pass that raised: none is reported)."""
        self._calls, self._bytes = [], 0

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, name: str, q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, scale) -> bool:
        """Queue one call; True when the queue is now past its bound (the caller flushes)."""
        self._calls.append((name, q, k, mask, bool(is_causal), scale,
                            (q._version, k._version, _version(mask))))
        self._bytes += q.numel() * q.element_size() + k.numel() * k.element_size()
        if self.waiting is not None:
            self.waiting()
        return self._bytes > self.max_bytes

    def flush(self) -> int:
        """Measure every call queued, by groups, and report each in the order they came (a call
        whose tensors changed in place since: not reported). Returns the calls reported."""
        calls, self._calls, self._bytes = self._calls, [], 0
        live = [c for c in calls if (c[1]._version, c[2]._version, _version(c[3])) == c[6]]
        self.stale += len(calls) - len(live)
        groups: dict = {}
        for i, (_, q, k, mask, causal, scale, _) in enumerate(live):
            key = (q.shape, k.shape, q.dtype, k.dtype, q.device, id(mask) if mask is not None else None,
                   causal, scale)
            groups.setdefault(key, []).append(i)
        got: list = [None] * len(live)
        for idx in groups.values():
            first = live[idx[0]]
            figures = sdpa.summaries([live[i][1] for i in idx], [live[i][2] for i in idx], first[3], first[4],
                                     first[5], self.signal)
            for i, fig in zip(idx, figures):
                got[i] = fig
        for (name, *_), (moments, panel, vec) in zip(live, got):
            self.report(name, moments, panel, vec)
        return len(live)
