"""Whether a step ran twice reproduced: the verdict of a replay, as a small explicit protocol.

A replay runs one step twice (the first execution is the real one, the second the rerun) and
compares them site by site (:mod:`diagnostics.judge.departure`). Its protocol has named states
and the transitions between them, so that what a verdict means is said once, here:

    pending --first()--> first run --rerun()--> rerunning --judge(rows)--> judged

and a judged replay holds one of four verdicts:

    identical     every site, every parameter gradient and the loss equal bit for bit;
    roundoff      some differ, all within what rounding explains (a kernel that sums in
                  another order on each call: atomics, split reductions; another thread count);
    departs       some site differs beyond its roundoff tolerance: the first such site, in the
                  order the two executions ran (forward, then backward from the loss), is where
                  they part ways;
    not measured  nothing could be paired (no site of the model was seen by both executions).

Each verdict carries what it means and what to do (:data:`VERDICTS`). The judge only judges:
the job (:mod:`diagnostics.jobs.replay`) runs the step and hands it the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .departure import first_departure

__all__ = ["STATES", "VERDICTS", "Verdict", "ReplayProtocol", "ProtocolError", "judge_rows"]

#: the protocol's states, in the order a replay passes through them
STATES = ("pending", "first run", "rerunning", "judged")
#: the allowed transitions: (from, event) -> to
_TRANSITIONS = {("pending", "first"): "first run", ("first run", "rerun"): "rerunning",
                ("rerunning", "judge"): "judged"}


@dataclass(frozen=True)
class Verdict:
    """One verdict of a replay: ``name``, whether the step ``reproduced`` (None: not measured),
    ``meaning`` (what the two executions showed) and ``action`` (what to do next)."""

    name: str
    reproduced: bool | None
    meaning: str
    action: str


#: every verdict a replay can reach, by name
VERDICTS = {
    "identical": Verdict(
        "identical", True, "reproduced bit for bit: every site, every parameter gradient and the loss",
        "the step is deterministic here: a spike or a non-finite loss at it comes from the data or the "
        "numerics (look at the batch, the learning rate, the layer the watch names), not the machine"),
    "roundoff": Verdict(
        "roundoff", True, "reproduced within roundoff: the executions differ only as much as summing in "
        "another order explains (a non-deterministic kernel, another thread count)",
        "the step reproduces; its outcome is the data's or the numerics', as for identical"),
    "departs": Verdict(
        "departs", False, "not reproducible: the executions part ways beyond roundoff at the first site named",
        "suspect the hardware (rerun the step on another device; a flipped bit in one GPU's arithmetic or "
        "memory is a known cause of spikes), or a kernel that is not deterministic beyond roundoff at that "
        "site (atomics in a scatter or an embedding backward, an approximate kernel)"),
    "not measured": Verdict(
        "not measured", None, "no site was paired: the two executions could not be compared",
        "give replay a model with a block stack (or that outputs logits) and a step that calls it"),
}


def judge_rows(ratios: Sequence[float], departures: Sequence[float], bitwise: bool) -> tuple[Verdict, int | None]:
    """The verdict of a replay's rows, in judging order: ``ratios`` departure / tolerance,
    ``departures`` the departures themselves, ``bitwise`` whether everything compared equal bit
    for bit (sketches, moments, parameter gradients, loss). Returns (verdict, index of the first
    departing row or None)."""
    if not ratios:
        return VERDICTS["not measured"], None
    first = first_departure(ratios)
    if first is not None:
        return VERDICTS["departs"], first
    if bitwise and all(d == 0.0 for d in departures):
        return VERDICTS["identical"], None
    return VERDICTS["roundoff"], None


class ProtocolError(RuntimeError):
    """A transition the replay protocol does not allow (our invariant, not a user's mistake)."""


class ReplayProtocol:
    """The state of one replay (module docstring): ``state`` one of :data:`STATES`; ``verdict``
    None until judged. Each transition is a method; one out of order raises ProtocolError."""

    def __init__(self) -> None:
        self.state = "pending"
        self.verdict: Verdict | None = None
        self.first_index: int | None = None

    def _go(self, event: str) -> None:
        to = _TRANSITIONS.get((self.state, event))
        if to is None:
            raise ProtocolError(f"replay: {event!r} is not allowed in state {self.state!r}")
        self.state = to

    def first(self) -> None:
        """The real step is about to run, under the fingerprint hooks."""
        self._go("first")

    def rerun(self) -> None:
        """The first execution is done and put aside; the rerun is about to start from the same state."""
        self._go("rerun")

    def judge(self, ratios: Sequence[float], departures: Sequence[float], bitwise: bool) -> Verdict:
        """Both executions are done: judge their rows (:func:`judge_rows`)."""
        self._go("judge")
        self.verdict, self.first_index = judge_rows(ratios, departures, bitwise)
        return self.verdict
