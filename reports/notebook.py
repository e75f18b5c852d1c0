"""Results drawn in a Jupyter notebook: the HTML behind ``_repr_html_``.

:func:`html` takes a :class:`diagnostics.DiagnoseResult`, a watch history (a
:class:`diagnostics.History`, a :class:`diagnostics.Watch` or the history dict)
or a :class:`diagnostics.jobs.comparison.Comparison`, and returns one self-contained
``<div>``: the verdict in a heading, the key numbers, a table of what is not ok, and the
figure the command line would write (``reports.plots`` / ``reports.watch_view``) embedded as
a PNG. Nothing here computes a statistic or a verdict; it lays out what diagnostics measured
and judged (a watch's verdicts are its History's). diagnostics finds :func:`html` through the
``tinylm.renderers`` entry point (``pyproject.toml``).
Text is dark on light (contrast above WCAG AA's 4.5:1) and every value is HTML-escaped.
"""

from __future__ import annotations

import base64
import contextlib
import html as _html
import io
import math
from typing import Any, Iterator

from .fmt import verdict_words

__all__ = ["html", "diagnosis_html", "history_html", "comparison_html", "figure_img"]

MAX_ROWS = 20  # verdict and finding rows shown before "... and N more"
_OK, _BAD = "#0a5c0a", "#8b0000"  # green and red text on white: contrast 7.7:1 and 9.3:1
_STYLE = ("font-family: sans-serif; font-size: 13px; color: #111; background: #fff; "
          "padding: 6px; max-width: 1100px")


def _e(x: Any) -> str:
    return _html.escape(str(x), quote=True)


def _num(v: Any) -> str:
    """A number with 4 significant digits (the exponent kept); None as an en dash."""
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _e(v)
    if isinstance(v, int):
        return f"{v:,}"
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.4g}"


def _heading(title: str, verdict: str, ok: bool) -> str:
    colour = _OK if ok else _BAD
    return (f'<h3 style="margin: 4px 0">{_e(title)}: '
            f'<span class="verdict" style="color: {colour}">{_e(verdict)}</span></h3>')


def _table(columns: list[str], rows: list[list[Any]], cls: str) -> str:
    if not rows:
        return ""
    head = "".join(f'<th style="text-align: left; padding: 2px 8px">{_e(c)}</th>' for c in columns)
    body = "".join("<tr>" + "".join(f'<td style="padding: 2px 8px">{_num(v)}</td>' for v in r) + "</tr>"
                   for r in rows[:MAX_ROWS])
    more = "" if len(rows) <= MAX_ROWS else f"<p>... and {len(rows) - MAX_ROWS} more</p>"
    return f'<table class="{cls}" style="border-collapse: collapse"><tr>{head}</tr>{body}</table>{more}'


def figure_img(fig: Any, alt: str) -> str:
    """A matplotlib Figure as an ``<img>`` with the PNG inline (base64); the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=72)
    finally:
        plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{_e(alt)}" style="max-width: 100%" src="data:image/png;base64,{data}"/>'


def _wrap(kind: str, parts: list[str]) -> str:
    return f'<div class="tinylm-{kind}" style="{_STYLE}">' + "".join(p for p in parts if p) + "</div>"


# --------------------------------------------------------------------------- diagnose


def diagnosis_html(result: Any) -> str:
    """A diagnosis: verdict, model and measurement, loss against ln V, findings, variance over depth."""
    from .plots import depth_figure

    h = result.header
    cfg = h.config or {}
    verdict = verdict_words(result)
    shape = ", ".join(f"{k}={cfg[k]}" for k in ("num_layers", "d_model", "num_heads", "vocab_size") if k in cfg)
    declared = getattr(h, "declared", "") or h.init
    facts = (f"{_e(h.model_class)} ({_e(shape) + ', ' if shape else ''}{h.parameter_count:,} parameters"
             f"{', declared init ' + _e(declared) if declared else ''}"
             f"); {h.tokens_measured:,} tokens from {_e(h.token_source)}, "
             f"{h.seeds} seed(s); loss <b>{_num(h.loss)}</b>"
             + (f" (ln V = {_num(h.loss_uniform)})" if h.loss_uniform is not None else ""))
    findings = _table(["kind", "where", "statistic", "value", "threshold", "message", "what to try"],
                      [[f.kind, f.where, f.statistic, f.value, f.threshold, f.message, f.suggestion]
                       for f in result.findings], "findings")
    stream = _table(["depth", "tensor", "forward var", "predicted", "backward var", "predicted"],
                    [[r.index, r.name, r.forward_var, r.forward_predicted, r.backward_var, r.backward_predicted]
                     for r in result.depth], "stream")
    parts = [_heading("diagnose", verdict, result.healthy), f"<p>{facts}</p>", findings]
    if result.depth:
        parts.append(figure_img(depth_figure(result), f"variance over depth: {verdict}"))
        parts.append(f"<details><summary>residual stream by depth</summary>{stream}</details>")
    return _wrap("diagnosis", parts)


# --------------------------------------------------------------------------- watch


def history_html(history: Any) -> str:
    """A watch history (a ``diagnostics.History`` or its dict): first verdict other than ok, loss
    over the run, verdicts, alarms, the plot."""
    from diagnostics import History

    from .watch_view import histories_figure

    h = history if isinstance(history, History) else History(history)
    data = h.data
    records = data.get("records") or []
    steps = (data.get("series") or {}).get("step") or []
    dep = h.first_departure()
    if dep is None:
        verdict = f"ok at all {len(records)} records" if records else "no records yet"
    else:
        verdict = f"{dep['verdict'].replace('_', '-')} at step {dep['step']} ({dep['site']})"
    k, first, last = h.loss_summary()
    facts = (f"{len(steps):,} steps, {len(records)} records (every {_e(data.get('watch_every'))} steps), "
             f"{len(data.get('sites') or [])} sites watched")
    if steps:
        facts += f"; loss {_num(first)} → {_num(last)} (means of the first and last {k} steps)"
    rows = h.verdicts()
    table = _table(["step", "site", "verdict", "statistic", "value", "threshold"],
                   [[r["step"], r["site"], r["verdict"], r["stat"], r["value"], r["threshold"]] for r in rows],
                   "verdicts")
    events = data.get("events") or []
    alarms = "".join(f"<li>{_e(e.get('message'))}</li>" for e in events[:MAX_ROWS])
    parts = [_heading("watch", verdict, dep is None), f"<p>{facts}</p>", table,
             f'<ul class="alarms">{alarms}</ul>' if alarms else ""]
    if records:
        parts.append(figure_img(histories_figure({"": h}, height=6.5), f"the run over steps: {verdict}"))
    return _wrap("watch", parts)


# --------------------------------------------------------------------------- compare


def comparison_html(comparison: Any) -> str:
    """A comparison: how many cells are not ok, the summary table, variance over depth per scheme."""
    from .plots import compare_figure

    tidy, summary = comparison
    bad = summary[summary["verdict"] != "ok"] if len(summary) else summary
    verdict = f"all {len(summary)} cells ok" if len(bad) == 0 else f"{len(bad)} of {len(summary)} cells not ok"
    columns = [c for c in ("scheme", "depth", "width", "verdict", "slope_forward", "slope_backward",
                           "max_min_ratio", "initial_loss", "ln_vocab", "early_loss") if c in summary.columns]
    rows = [[int(v) if c in ("depth", "width") and not _missing(v) else v for c, v in zip(columns, r)]
            for r in summary[columns].itertuples(index=False)]
    parts = [_heading("compare", verdict, len(bad) == 0),
             f"<p>{summary['scheme'].nunique() if len(summary) else 0} scheme(s); "
             f"data: {_e(summary['data'].iloc[0]) if len(summary) else '–'}</p>",
             _table(columns, rows, "summary")]
    if len(tidy):
        parts.append(figure_img(compare_figure(tidy), f"residual stream variance over depth: {verdict}"))
    return _wrap("compare", parts)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


# --------------------------------------------------------------------------- dispatch


@contextlib.contextmanager
def _keeps_backend() -> Iterator[None]:
    """The figures are drawn with Agg (reports.plots selects it); the notebook's own matplotlib
    backend (inline, widget, ...) is put back afterwards, so the user's plots still show."""
    import matplotlib

    before = matplotlib.get_backend()
    try:
        yield
    finally:
        if matplotlib.get_backend() != before:
            import matplotlib.pyplot as plt

            plt.switch_backend(before)


def html(obj: Any) -> str:
    """The HTML of a DiagnoseResult, a watch (History, Watch or history dict) or a Comparison."""
    with _keeps_backend():
        return _html_of(obj)


def _html_of(obj: Any) -> str:
    from diagnostics import DiagnoseResult, History, Watch
    from diagnostics.jobs.comparison import Comparison
    from diagnostics.jobs.runs_compare import RunsComparison

    if isinstance(obj, DiagnoseResult):
        return diagnosis_html(obj)
    if isinstance(obj, Comparison):
        return comparison_html(obj)
    if isinstance(obj, RunsComparison):
        from .runs_view import comparison_html as runs_comparison_html

        return _wrap("runs", [runs_comparison_html(obj)])
    if isinstance(obj, History) and obj.source is not None:  # read back from a log dir: the runs report
        from diagnostics.jobs.runs_compare import label_of

        from .runs_view import run_html

        return _wrap("runs", [run_html(obj, label_of(obj.source) or "run")])
    if isinstance(obj, History):
        return history_html(obj)
    if isinstance(obj, Watch):
        return history_html(History(obj.history))
    if isinstance(obj, dict) and obj.get("format") == "tinylm-watch":
        return history_html(History(obj))
    raise TypeError(f"reports.notebook.html: cannot draw a {type(obj).__name__}; pass a DiagnoseResult, a "
                    "watch History or a Comparison")
