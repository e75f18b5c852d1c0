"""The probe's requests queued (:mod:`.pending`): the moments alone, or with the rows a site asks for.

:class:`Queued` is the part of :class:`.probe.ProbeRun` that hands a hook's requests to its queue:
a plain request (the moments), a forward site's figures with its rows (a residual point's
cosine and inverse row mean squares, a gate's count below :data:`FLAT_EDGE`), and a norm's
per-token factor, which the queue's flush makes (a :class:`~.pending.Later`) and the norm
output's gradient then reads (:meth:`Queued._factor`).
"""

from __future__ import annotations

import math

from torch import Tensor

from .pending import Later

__all__ = ["Queued", "FLAT_EDGE"]

#: SiLU's flat region: inputs x < FLAT_EDGE, where silu(x) = x sigmoid(x) passes under 0.25% of x
#: and its slope |silu'(x)| is under 1.3% of the linear side's 1. A tinylm FFN's gate input (the
#: output of its ``w1``) is counted there; a unit whose inputs all sit there is dead.
FLAT_EDGE = -6.0


class Queued:
    """The queueing half of :class:`.probe.ProbeRun` (its ``queue``, ``flush``, ``model`` and
    ``_forward_waits``)."""

    def _queue(self, key, t: Tensor) -> None:
        self._queued(self.queue.add(key, t), key[1] == "forward")

    def _queued(self, over: bool, forward: bool) -> None:
        if over:
            self.flush()
        elif forward:
            self._forward_waits = True

    def forward_waits(self) -> None:
        """A forward's request waits in another queue (an SDPA call's): flush at the first gradient."""
        self._forward_waits = True

    def _factor(self, inv) -> Tensor | None:
        """A norm's per-token factor: the tensor, or the queue's :class:`~.pending.Later` (flushed
        now if it has not come: the forward's flush before the first gradient fills it)."""
        if isinstance(inv, Later):
            if not inv.done:
                self.flush()
            return inv.value
        return inv

    def _queue_site(self, name: str, kind: str, out: Tensor, rows: bool, gate: bool) -> None:
        """:meth:`_reduce_site` (but a panel) queued: its figures reduced with the others later."""
        cosine = rows and kind != "resid_mid" and out.dim() >= 3
        parts = [(None, (name, "forward"), "moments")] + ([("cos", name, "cosine")] if cosine else []) \
            + ([("inv", name, "vector")] if rows else []) + ([("flat", name, "below")] if gate else [])
        self._queued(self.queue.add_rows(out, parts, rows, cosine, FLAT_EDGE if gate else math.nan,
                                         float(self.model.config.eps) if rows else -1.0)[0], True)
