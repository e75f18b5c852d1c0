"""How results show themselves in a notebook: ``_repr_html_`` of a diagnosis, a watch history
and a comparison hands the object to :func:`html`.

diagnostics computes and never draws, and it knows no drawing package: a renderer registers
itself. :func:`html` draws with, in this order, the renderer set by :func:`use`, else the one
an installed distribution declares as the entry point named :data:`NAME` in the group
:data:`GROUP` (looked up through ``importlib.metadata`` when first needed, then kept), else
none: it returns None, and IPython then shows the object's ``repr``. This package declares
its own in ``pyproject.toml``::

    [project.entry-points."tinylm.renderers"]
    notebook = "<module>:<function taking the object, returning HTML>"
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Callable

__all__ = ["html", "use", "renderer", "GROUP", "NAME"]

GROUP = "tinylm.renderers"  # the entry-point group a renderer is declared in
NAME = "notebook"  # the entry point's name: a function obj -> HTML string
_chosen: Callable[[Any], str] | None = None  # set by use()
_found: list[Callable[[Any], str] | None] = []  # the registered one, once looked up ([None]: none)


def use(renderer: Callable[[Any], str] | None) -> None:
    """Draw with ``renderer(obj) -> html`` from now on (None: back to the registered renderer,
    looked up again)."""
    global _chosen
    _chosen = renderer
    _found.clear()


def _registered() -> Callable[[Any], str] | None:
    """The renderer declared under :data:`GROUP` / :data:`NAME` by an installed distribution, or None."""
    if not _found:
        points = [p for p in metadata.entry_points(group=GROUP) if p.name == NAME]
        _found.append(points[0].load() if points else None)
    return _found[0]


def renderer() -> Callable[[Any], str] | None:
    """The renderer :func:`html` draws with now (None: none is set or registered)."""
    return _chosen or _registered()


def html(obj: Any) -> str | None:
    """The HTML of ``obj`` (a DiagnoseResult, a watch History, a Comparison) for a notebook, or
    None when no renderer is set or registered."""
    draw = renderer()
    return None if draw is None else draw(obj)
