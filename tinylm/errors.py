"""Errors a user can cause, each saying what is wrong and how to fix it.

Every error here subclasses :class:`TinyLMError` (itself a ``ValueError``), so
the command line can turn any of them into a one-line message and exit code 2
without catching our own bugs by mistake.
"""

from __future__ import annotations

__all__ = ["TinyLMError", "ConfigError", "CheckpointError", "MissingOptionError", "UnsafeCheckpointError"]


class TinyLMError(ValueError):
    """Base class for mistakes in what the user gave us (never for our bugs).

    ``argument``: the name of the Python argument (or config field) the error is about, as
    the caller passed it; None when it is about no one argument.
    """

    argument: str | None = None


class ConfigError(TinyLMError):
    """A ``ModelConfig`` field breaks a rule; the message names field, value and rule."""


class CheckpointError(TinyLMError):
    """A checkpoint cannot be read as a model; the message says why and what to do."""


class MissingOptionError(CheckpointError):
    """The checkpoint lacks a setting that must come from the caller (e.g. ``num_heads``)."""

    def __init__(self, field: str, why: str) -> None:
        self.field = self.argument = field
        super().__init__(f"{why}; pass {field}=N")


class UnsafeCheckpointError(CheckpointError):
    """The file holds pickled Python objects that a safe load refuses to execute."""
