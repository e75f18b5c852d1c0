"""Argument validation: one place, one message pattern.

Every check raises the caller's error class (a :class:`tinylm.errors.TinyLMError`
subclass, so the command line turns it into one line and exit code 2) with the
message

    name=value: must <rule>[; pass <fix>]

``name`` is the Python argument (or config field) as the caller passed it, ``value``
its ``repr``, ``rule`` what a valid value is, and ``fix`` (optional) how to give one,
written as the caller writes it: ``seq_len=N``. Placeholders are upper case (``N`` an
integer, ``X`` a real number, ``PATH``, ``MODE``). The library never names a
command-line flag; the command line (``reports.cli``) translates ``name=N`` into its
flag. Checks return the value, so a caller can write
``n = integer("batches", n, low=1, error=OptionsError)``.

A refusal that is not about one argument's value (a file that cannot be read, a batch
that does not fit in memory) goes through :func:`refuse`, in the same shape:
``<what is wrong>[; <fix>]``. Every error raised here records ``argument``: the name
of the argument it is about (None when none).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any, NoReturn

from .errors import TinyLMError

__all__ = ["refuse", "fail", "integer", "number", "choice", "boolean", "check", "check_type", "file_error"]


def refuse(what: str, fix: str | None = None, *, error: type[Exception] = TinyLMError,
           argument: str | None = None) -> NoReturn:
    """Raise ``error("what; fix")`` (no exception chained), recording ``argument`` on it."""
    exc = error(what + (f"; {fix}" if fix else ""))
    exc.argument = argument
    raise exc from None


def fail(name: str, value: Any, rule: str, fix: str | None = None, *,
         error: type[Exception] = TinyLMError) -> NoReturn:
    """Raise ``error("name=value: must rule; pass fix")``."""
    refuse(f"{name}={value!r}: must {rule}", f"pass {fix}" if fix else None, error=error, argument=name)


def file_error(path: Any, problem: str, fix: str | None = None, *,
               error: type[Exception] = TinyLMError) -> NoReturn:
    """Raise ``error("path: problem; fix")``: a file the caller named (argument ``path``) is unusable."""
    refuse(f"{path}: {problem}", fix, error=error, argument="path")


def _bounds(low: float | None, high: float | None, strict_low: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if strict_low else '['}{low}, {high}]"
    if low is not None:
        return f" {'>' if strict_low else '>='} {low}"
    if high is not None:
        return f" <= {high}"
    return ""


def integer(name: str, value: Any, *, low: int | None = None, high: int | None = None,
            fix: str | None = None, error: type[Exception] = TinyLMError) -> int:
    """``value`` as an int: a Python or numpy integer (never a bool) within [low, high]."""
    ok = not isinstance(value, bool) and hasattr(value, "__index__") and not isinstance(value, float)
    if ok:
        value = int(value.__index__())
        ok = (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        fail(name, value, "be an integer" + _bounds(low, high, False), fix, error=error)
    return value


def number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
           strict_low: bool = False, fix: str | None = None, error: type[Exception] = TinyLMError) -> float:
    """``value`` as a float: a finite real number (never a bool) above ``low`` (strictly when
    ``strict_low``) and at most ``high``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (low is None or (value > low if strict_low else value >= low)) and (high is None or value <= high)
    if not ok:
        fail(name, value, "be a finite number" + _bounds(low, high, strict_low), fix, error=error)
    return float(value)


def choice(name: str, value: Any, choices: Collection[Any], *, fix: str | None = None,
           error: type[Exception] = TinyLMError) -> Any:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        fail(name, value, "be one of " + ", ".join(map(str, choices)), fix, error=error)
    return value


def boolean(name: str, value: Any, *, fix: str | None = None, error: type[Exception] = TinyLMError) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        fail(name, value, "be True or False", fix, error=error)
    return value


def check(name: str, value: Any, ok: Callable[[Any], bool], rule: str, *, fix: str | None = None,
          error: type[Exception] = TinyLMError) -> Any:
    """``value`` if ``ok(value)``; otherwise the pattern's error with ``rule``."""
    if not ok(value):
        fail(name, value, rule, fix, error=error)
    return value


def check_type(name: str, value: Any, types: type | tuple[type, ...], what: str, *, fix: str | None = None,
               error: type[Exception] = TinyLMError) -> Any:
    """``value`` if it is an instance of ``types``; otherwise ``name=<its type>: must be <what>``
    (the type's name, not the value's repr: an object of the wrong type may print at length)."""
    if not isinstance(value, types):
        refuse(f"{name}={type(value).__name__}: must be {what}", f"pass {fix}" if fix else None, error=error,
               argument=name)
    return value
