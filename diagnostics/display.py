"""How results show themselves: in a notebook, ``_repr_html_`` of a diagnosis, a watch history
and a comparison hands the object to :func:`html`; ``str`` of a diagnosis (``print(result)``)
to :func:`text`.

diagnostics computes and never draws, and it knows no drawing package: a renderer registers
itself. :func:`html` draws with, in this order, the renderer set by :func:`use`, else the one
an installed distribution declares as the entry point named :data:`NAME` in the group
:data:`GROUP` (looked up through ``importlib.metadata`` when first needed, then kept), else
none: it returns None, and IPython then shows the object's ``repr``. This package declares
its own in ``pyproject.toml``::

    [project.entry-points."tinylm.renderers"]
    notebook = "<module>:<function taking the object, returning HTML>"
    text = "<module>:<function taking the object, returning the report as plain text>"

:func:`text` draws with the entry point named :data:`TEXT` likewise (or the one set by
``use(text=...)``), else gives a short summary.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Callable

__all__ = ["html", "text", "summary", "use", "renderer", "GROUP", "NAME", "TEXT"]

GROUP = "tinylm.renderers"  # the entry-point group a renderer is declared in
NAME = "notebook"  # the entry point's name: a function obj -> HTML string
TEXT = "text"  # the entry point's name: a function obj -> the report as plain text
_chosen: Callable[[Any], str] | None = None  # set by use()
_chosen_text: Callable[[Any], str] | None = None  # set by use(text=...)
_found: dict[str, Callable[[Any], str] | None] = {}  # the registered ones by name, once looked up


def use(renderer: Callable[[Any], str] | None = None, *, text: Callable[[Any], str] | None = None) -> None:
    """Draw with ``renderer(obj) -> html`` (and print with ``text(obj) -> str``) from now on (None:
    back to the registered renderer, looked up again)."""
    global _chosen, _chosen_text
    _chosen, _chosen_text = renderer, text
    _found.clear()


def _registered(name: str = NAME) -> Callable[[Any], str] | None:
    """The renderer declared under :data:`GROUP` / ``name`` by an installed distribution, or None."""
    if name not in _found:
        points = [p for p in metadata.entry_points(group=GROUP) if p.name == name]
        try:
            _found[name] = points[0].load() if points else None
        except Exception:  # noqa: BLE001 - a broken renderer leaves the object its own summary
            _found[name] = None
    return _found[name]


def renderer() -> Callable[[Any], str] | None:
    """The renderer :func:`html` draws with now (None: none is set or registered)."""
    return _chosen or _registered()


def html(obj: Any) -> str | None:
    """The HTML of ``obj`` (a DiagnoseResult, a watch History, a Comparison) for a notebook, or
    None when no renderer is set or registered."""
    draw = renderer()
    return None if draw is None else draw(obj)


def text(obj: Any) -> str:
    """The report of ``obj`` (a DiagnoseResult) as plain text, drawn by the text renderer set or
    registered; without one (or where it draws nothing), a short summary: status and each finding."""
    draw = _chosen_text or _registered(TEXT)
    drawn = None if draw is None else draw(obj)
    if drawn is not None:
        return drawn
    lines = [f"{obj.header.model_class}: {obj.status}"]
    lines += [f"{f.severity.upper()} {f.kind} {f.where}: {f.message} (cause: {f.cause})" for f in obj.findings]
    return "\n".join(lines)


def summary(obj: Any) -> str:
    """One line of a DiagnoseResult: class, status, the model's class, finding and row counts."""
    return (f"{type(obj).__name__}(status={obj.status!r}, model={obj.header.model_class}, "
            f"failures={len(obj.failures)}, warnings={len(obj.warnings)}, tensors={len(obj.tensors)}, "
            f"params={len(obj.params)}, attention={len(obj.attention)})")
