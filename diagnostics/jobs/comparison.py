"""The result of :func:`diagnostics.compare`: the (tidy, summary) pair of DataFrames, named."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Comparison"]


class Comparison(NamedTuple):
    """``tidy``: the tidy frame of the one result schema; ``summary``: one row per (scheme,
    depth, width). A tuple, so ``tidy, summary = compare(...)`` reads as it always did; in a
    notebook it draws itself (the summary with its verdicts, and the variance over depth)."""

    tidy: Any
    summary: Any

    def _repr_html_(self) -> str:
        from ..display import html

        return html(self)
