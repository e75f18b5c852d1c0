"""How results show themselves in a notebook: ``_repr_html_`` of a diagnosis, a watch history
and a comparison hands the object to :func:`html`.

The drawing belongs to ``reports`` (diagnostics computes, reports draws), and diagnostics
never imports it by name: :func:`html` looks the renderer up at display time, under the
module name :data:`RENDERER`, so that diagnostics stays importable and testable alone and a
notebook needs no extra import. A different renderer can be set with :func:`use`.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["html", "use", "RENDERER"]

RENDERER = "reports.notebook"  # a module with html(obj) -> str
_renderer: Callable[[Any], str] | None = None


def use(renderer: Callable[[Any], str] | None) -> None:
    """Draw with ``renderer(obj) -> html`` from now on (None: back to :data:`RENDERER`)."""
    global _renderer
    _renderer = renderer


def html(obj: Any) -> str:
    """The HTML of ``obj`` (a DiagnoseResult, a watch History, a Comparison) for a notebook."""
    renderer = _renderer or importlib.import_module(RENDERER).html
    return renderer(obj)
