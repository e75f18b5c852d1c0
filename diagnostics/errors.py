"""The error a diagnostics option or argument raises (a :class:`tinylm.errors.TinyLMError`)."""

from __future__ import annotations

from tinylm.errors import TinyLMError

__all__ = ["OptionsError"]


class OptionsError(TinyLMError):
    """An option value that cannot work; the message names it and the fix."""
