"""The one check behind every refusal property of tinylm's own modules."""

from __future__ import annotations

import pytest


def assert_refused(exc: type[Exception], message: str, fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)`` raises ``exc`` with exactly ``message`` (the whole one-line text a user reads)."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value) == message, f"message {str(info.value)!r} != {message!r}"
