"""What a property observed, for the report: examples run, worst error or z-score, tolerance.

A property calls :func:`record` once per example with the one number it checked
(an error, a |z|, a -log10 p-value) and the tolerance it was held to;
:func:`check` records and asserts in one step. The pytest plugin in
:mod:`props.plugin` opens a :class:`PropertyLog` around each property and
collects it. Outside such a run, :func:`record` does nothing, so the checks can
be used from any script.

A property is declared with the :func:`prop` marker::

    @prop("softmax(z + c) = softmax(z)", needs=("softmax",))
    @given(...)
    def test_softmax_shift(impl, ...): ...

``needs`` names the functions of the implementation under test it calls
(see :mod:`props.impl`); a property whose needs the implementation lacks is
skipped by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

__all__ = ["Observation", "PropertyLog", "record", "check", "prop", "begin", "end", "current"]


@dataclass(frozen=True)
class Observation:
    """One checked number: ``observed`` held to ``tolerance`` (at false-alarm rate ``alpha`` if statistical)."""

    observed: float
    tolerance: float
    alpha: float | None = None
    kind: str = "error"

    @property
    def ratio(self) -> float:
        """observed / tolerance (inf when the tolerance is 0 and something was observed)."""
        if not math.isfinite(self.observed):
            return math.inf
        if self.tolerance > 0:
            return self.observed / self.tolerance
        return 0.0 if self.observed == 0 else math.inf


@dataclass
class PropertyLog:
    """All the observations of one property run; ``worst`` is the one closest to (or past) its tolerance."""

    name: str
    examples: int = 0
    worst: Observation | None = None
    alpha: float | None = None
    observations: int = field(default=0)

    def add(self, obs: Observation) -> None:
        self.examples += 1
        self.observations += 1
        if obs.alpha is not None:
            self.alpha = obs.alpha if self.alpha is None else max(self.alpha, obs.alpha)
        if self.worst is None or obs.ratio > self.worst.ratio:
            self.worst = obs


_current: PropertyLog | None = None


def begin(name: str) -> PropertyLog:
    """Start collecting for property ``name`` (used by the plugin)."""
    global _current
    _current = PropertyLog(name)
    return _current


def end() -> PropertyLog | None:
    """Stop collecting and return what was collected (used by the plugin)."""
    global _current
    log, _current = _current, None
    return log


def current() -> PropertyLog | None:
    """The log being collected, if a property is running."""
    return _current


def record(observed: float, tolerance: float, *, alpha: float | None = None, kind: str = "error") -> None:
    """Note one example's checked number; does nothing outside a property run."""
    if _current is not None:
        _current.add(Observation(float(observed), float(tolerance), alpha, kind))


def check(observed: float, tolerance: float, what: str, *, alpha: float | None = None, kind: str = "error") -> None:
    """Record ``observed`` against ``tolerance`` and assert observed <= tolerance (NaN fails)."""
    record(observed, tolerance, alpha=alpha, kind=kind)
    if not observed <= tolerance:
        raise AssertionError(f"{what}: {kind} {observed:.6g} > tolerance {tolerance:.6g}")


def prop(claim: str, needs: tuple[str, ...] = (), alpha: float | None = None) -> pytest.MarkDecorator:
    """Mark a test as a property: ``claim`` is its formula, ``needs`` the implementation functions it calls."""
    if not isinstance(needs, tuple):
        raise ValueError(f"needs={needs!r}: must be a tuple of function names, e.g. ('softmax',)")
    return pytest.mark.prop(claim=claim, needs=needs, alpha=alpha)
