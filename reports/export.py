"""Writing reports to files: JSON, CSV, HTML, SVG and PNG, each atomically.

Every writer goes through ``tinylm.checkpoint.atomic_write`` (write a temporary
file beside the target, then rename), so an interrupted run never leaves a
half-written report. The callers refuse output paths that are inputs
(``reports.intake.check_outputs``) before any work starts.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console

__all__ = ["write_text", "write_json", "write_csv", "write_console", "write_figure"]


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8, newline-terminated) to ``path`` atomically."""
    from tinylm.checkpoint import atomic_write

    if not text.endswith("\n"):
        text += "\n"

    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)

    atomic_write(path, _write)


def write_json(path: str | os.PathLike, result: Any) -> None:
    """The result's versioned JSON (``result.to_json()``) written atomically.

    The schema is diagnostics/API.md's; its version, ``schema_version``, is
    ``diagnostics.SCHEMA_VERSION`` ("4": the per-tensor numbers as the tidy rows of
    ``diagnostics.result.COLUMNS``, findings with severity and cause; the versions are listed in
    :mod:`diagnostics.result`).
    """
    text = result.to_json()
    if not isinstance(text, str):  # a dict: serialise it the same way every time
        import json

        text = json.dumps(text, indent=2, sort_keys=True, allow_nan=False)
    write_text(path, text)


def write_csv(path: str | os.PathLike, frame: Any) -> None:
    """A tidy pandas DataFrame (the one result schema: diagnose, the watch, compare) as CSV
    (no index column; missing entries empty), written atomically."""
    from tinylm.checkpoint import atomic_write

    atomic_write(path, lambda tmp: frame.to_csv(tmp, index=False, lineterminator="\n"))


def write_console(path: str | os.PathLike, console: Console, kind: str, title: str = "tinylm diagnose") -> None:
    """What a ``Console(record=True)`` printed, as ``kind`` = "html" or "svg", written atomically."""
    if kind == "html":
        text = console.export_html(clear=False)
    elif kind == "svg":
        text = console.export_svg(title=title, clear=False)
    else:
        raise ValueError(f"kind={kind!r}: must be 'html' or 'svg'")
    write_text(path, text)


def write_figure(path: str | os.PathLike, fig: Any, dpi: int = 120) -> None:
    """A matplotlib figure saved atomically (format from the suffix of ``path``, PNG by default)."""
    from tinylm.checkpoint import atomic_write

    fmt = os.path.splitext(str(path))[1].lstrip(".").lower() or "png"
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=dpi, bbox_inches="tight"))
