"""Writing reports to files: JSON, CSV, HTML, SVG and PNG, each atomically.

Every writer goes through ``diagnostics.integrations.writers.write_atomic`` (write a
temporary file beside the target, then rename), so an interrupted run never leaves a
half-written report. The callers refuse output paths that are inputs
(``reports.intake.check_outputs``) before any work starts.
"""

from __future__ import annotations

import os
import re
from typing import Any

from rich.console import Console

__all__ = ["write_text", "write_json", "write_csv", "write_console", "write_figure", "free_path", "AA_CONTRAST",
           "contrast_ratio", "contrast_pairs", "accessible_html"]

#: WCAG 2 level AA: normal-size text needs at least this contrast ratio against its background.
AA_CONTRAST = 4.5


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8, newline-terminated) to ``path`` atomically."""
    from diagnostics.integrations.writers import write_atomic

    write_atomic(path, text if text.endswith("\n") else text + "\n")


def write_json(path: str | os.PathLike, result: Any) -> None:
    """The result's versioned JSON (``result.to_json()``) written atomically.

    The schema is diagnostics/API.md's; its version, ``schema_version``, is
    ``diagnostics.SCHEMA_VERSION`` (what each version changed: diagnostics/API.md, "Schema versions").
    """
    text = result.to_json()
    if not isinstance(text, str):  # a dict: serialise it the same way every time
        import json

        text = json.dumps(text, indent=2, sort_keys=True, allow_nan=False)
    write_text(path, text)


def write_csv(path: str | os.PathLike, frame: Any) -> None:
    """A tidy pandas DataFrame (the one result schema: diagnose, the watch, compare) as CSV
    (no index column; missing entries empty), written atomically."""
    from diagnostics.integrations.writers import write_atomic

    write_atomic(path, lambda tmp: frame.to_csv(tmp, index=False, lineterminator="\n"))


def write_console(path: str | os.PathLike, console: Console, kind: str, title: str = "tinylm diagnose") -> None:
    """What a ``Console(record=True)`` printed, as ``kind`` = "html" or "svg", written atomically.

    The HTML meets WCAG AA contrast: every text colour is checked against its background and,
    where it falls short of :data:`AA_CONTRAST`, darkened or lightened along its own hue until it
    reaches it (:func:`accessible_html`), so that dim captions and yellow warnings stay readable on
    the white page and white-on-red stays readable on red."""
    if kind == "html":
        text = accessible_html(console.export_html(clear=False, inline_styles=False))
    elif kind == "svg":
        text = console.export_svg(title=title, clear=False)
    else:
        raise ValueError(f"kind={kind!r}: must be 'html' or 'svg'")
    write_text(path, text)


def write_figure(path: str | os.PathLike, fig: Any, dpi: int = 120) -> None:
    """A matplotlib figure saved atomically (format from the suffix of ``path``, PNG by default)."""
    from diagnostics.integrations.writers import write_atomic

    fmt = os.path.splitext(str(path))[1].lstrip(".").lower() or "png"
    write_atomic(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=dpi, bbox_inches="tight"))


def free_path(path: str | os.PathLike) -> str:
    """A derived output's path (one the user did not name, e.g. ``report.training.png`` beside
    ``--plot report.png``): ``path`` itself when nothing is there, else the first free
    ``{stem}-2{suffix}``, ``{stem}-3{suffix}``, ... beside it, so that a derived output never
    replaces a file the user has."""
    path = str(path)
    if not os.path.lexists(path):
        return path
    stem, suffix = os.path.splitext(path)
    n = 2
    while os.path.lexists(f"{stem}-{n}{suffix}"):
        n += 1
    return f"{stem}-{n}{suffix}"


# ---------------------------------------------------------------- contrast (WCAG 2)

def _rgb(hex_colour: str) -> tuple[int, int, int]:
    h = hex_colour.strip().lstrip("#")
    if len(h) == 3:
        h = "".join(c * 2 for c in h)
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def _hex(rgb: tuple[float, float, float]) -> str:
    return "#" + "".join(f"{min(255, max(0, round(c))):02x}" for c in rgb)


def _luminance(rgb: tuple[float, float, float]) -> float:
    """WCAG 2 relative luminance of an sRGB colour (0-255 channels)."""
    def lin(c: float) -> float:
        c = c / 255.0
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast_ratio(foreground: str, background: str) -> float:
    """WCAG 2 contrast ratio (1 to 21) of two ``#rrggbb`` colours: (L1 + 0.05) / (L2 + 0.05), L1 the lighter."""
    a, b = _luminance(_rgb(foreground)), _luminance(_rgb(background))
    return (max(a, b) + 0.05) / (min(a, b) + 0.05)


_RULE = re.compile(r"(\.r\d+)\s*\{([^}]*)\}")
_BODY = re.compile(r"body\s*\{([^}]*)\}")


def _props(body: str) -> dict[str, str]:
    out = {}
    for part in body.split(";"):
        if ":" in part:
            k, v = part.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def contrast_pairs(html: str) -> list[tuple[str, str, str]]:
    """(selector, text colour, background colour) of every style in an HTML report that rich's
    ``export_html(inline_styles=False)`` wrote: the page (``body``) and each ``.rN`` class, a colour
    the class leaves out taken from the page."""
    body = _props(_BODY.search(html).group(1)) if _BODY.search(html) else {}
    fg0, bg0 = body.get("color", "#000000"), body.get("background-color", "#ffffff")
    pairs = [("body", fg0, bg0)]
    for selector, rule in _RULE.findall(html):
        p = _props(rule)
        pairs.append((selector, p.get("color", fg0), p.get("background-color", bg0)))
    return pairs


def _readable(foreground: str, background: str, minimum: float) -> str:
    """``foreground`` moved towards black or white (whichever contrasts more with ``background``), in small
    steps along its own hue, until its contrast with ``background`` is at least ``minimum``."""
    fg, bg = _rgb(foreground), _rgb(background)
    target = (0, 0, 0) if contrast_ratio("#000000", background) >= contrast_ratio("#ffffff", background) else (255, 255, 255)
    for step in range(65):
        t = step / 64
        colour = _hex(tuple(c + (e - c) * t for c, e in zip(fg, target)))
        if contrast_ratio(colour, background) >= minimum:
            return colour
    return _hex(target)


def accessible_html(html: str, minimum: float = AA_CONTRAST) -> str:
    """An HTML report whose every text/background pair (:func:`contrast_pairs`) has a contrast ratio of
    at least ``minimum`` (WCAG AA: 4.5): a text colour that falls short is moved towards black or
    white until it does; every other byte stays as it was."""
    body = _props(_BODY.search(html).group(1)) if _BODY.search(html) else {}
    fg0, bg0 = body.get("color", "#000000"), body.get("background-color", "#ffffff")

    def fix(match: re.Match) -> str:
        selector, rule = match.group(1), match.group(2)
        p = _props(rule)
        fg, bg = p.get("color", fg0), p.get("background-color", bg0)
        if contrast_ratio(fg, bg) >= minimum:
            return match.group(0)
        p["color"] = _readable(fg, bg, minimum)
        if "text-decoration-color" in p:
            p["text-decoration-color"] = p["color"]
        return f"{selector} {{{'; '.join(f'{k}: {v}' for k, v in p.items())}}}"

    return _RULE.sub(fix, html)
