"""A watched run read back, drawn: the report ``tinylm runs`` prints, its figure, its single-file page.

Everything shown is read from a ``diagnostics.History`` that ``History.read`` returned (its
verdicts, first departure and first mover, kept by the History; its outcome; the alerts, events
and forensics the watch wrote) and from a ``RunsComparison`` for runs side by side; nothing here
judges. The figure reads the stored series directly (a long run's tidy frame is large), thinned
to at most :data:`MAX_POINTS` points per line, each bucket drawn by its extremes so that a spike
is never thinned away.
"""

from __future__ import annotations

import base64
import html as _html
import io
import math
from typing import Any

from .watch_view import BARS, _log_range, _spark, _thin, chart_sites

__all__ = ["run_report", "comparison_report", "runs_figure", "runs_page", "figure_png", "run_html", "alert_groups", "follow_view",
           "loss_points", "MAX_POINTS"]

MAX_POINTS = 1500  # per line of a figure
SPARK = 48  # columns of a sparkline in the terminal
_COLOUR = {"failed": "bold red", "warned": "bold yellow", "ok": "bold green", "not judged": "bold"}


def _f(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "nan"
    return f"{v:.3g}"


def outcome_line(h: Any) -> str:
    o = h.outcome()
    at = f" at step {o['step']}" if o["step"] is not None else ""
    return f"{o['status'].upper()}{at}: {o['why']}"


def describe_run(h: Any, label: str) -> str:
    """What was read, in a line: steps, records, interval, sites, the model."""
    d = h.data
    model = d.get("model") or {}
    shape = ", ".join(f"{k} {model[k]}" for k in ("scheme", "depth", "width") if model.get(k) is not None)
    every = d.get("watch_every")
    return (f"{label}: {len(d['series']['step'])} steps, {len(d['records'])} records"
            + (f" (every {every} steps)" if every else "") + f", {len(d.get('sites') or [])} sites"
            + (f"; model: {shape}" if shape else "") + (f"; read from {h.source}" if h.source else ""))


def alert_groups(alerts: list[Any]) -> list[dict[str, Any]]:
    """The alerts grouped by signal (in the order each signal first came): severity (fail if any),
    first and last step, how many, the sites, and the first alert's value, threshold, cause and fix."""
    groups: dict[str, dict[str, Any]] = {}
    for a in alerts:
        g = groups.get(a.signal)
        if g is None:
            g = groups[a.signal] = {"signal": a.signal, "severity": a.severity, "first": a.step, "last": a.step,
                                    "count": 0, "sites": [], "value": a.value, "threshold": a.threshold,
                                    "cause": a.cause, "fix": a.fix, "message": a.message}
        g["count"] += 1
        g["last"] = max(g["last"], a.step)
        if a.severity == "fail":
            g["severity"] = "fail"
        site = a.site or "model"
        if site not in g["sites"]:
            g["sites"].append(site)
    return list(groups.values())


def _sites(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n})" if len(names) > n else "")


def _departure_lines(h: Any) -> list[str]:
    from diagnostics.judge.over_time import describe_move

    dep, mover = h.first_departure(), h.first_mover()
    out = []
    if dep is None:
        out.append("first departure: none (every verdict ok at every record)" if h.data["records"]
                   else "first departure: not judged (no record)")
    else:
        out.append(f"first departure: step {dep['step']}, {dep['site']} {dep['verdict']} "
                   f"({dep['stat']} = {_f(dep['value'])}, threshold {_f(dep['threshold'])})")
    out.append("first mover: " + (describe_move(mover) if mover else "none (no watched variance rose past its "
                                                                     "move threshold)"))
    return out


def loss_points(h: Any, n: int = 8) -> list[tuple[int, float, float, float]]:
    """(step, loss, lr, grad_norm) at ``n`` evenly spaced logged steps (the first and last included)."""
    s = h.data["series"]
    k = len(s["step"])
    if k == 0:
        return []
    idx = sorted({round(i * (k - 1) / max(n - 1, 1)) for i in range(n)})
    return [(s["step"][i], s["loss"][i], s["lr"][i], s["grad_norm"][i]) for i in idx]


def _forensics_rows(h: Any) -> list[dict[str, Any]]:
    from diagnostics.judge.runs import what_moved

    out = []
    for rep in h.forensics:
        trig = rep.get("trigger") or {}
        what = trig.get("message") or f"{trig.get('kind') or trig.get('signal')}"
        steps = rep.get("steps") or []
        losses = [s.get("loss") for s in steps]
        span = (f"loss {_f(losses[0])} -> {_f(losses[-1])} over steps {steps[0]['step']}..{steps[-1]['step']}"
                if steps else "no step logged before it")
        moved = [f"{m['site']} {m['stat']} x{_f(m['rise'])}" for m in what_moved(rep)]
        out.append({"step": rep.get("step"), "trigger": what, "span": span, "moved": moved,
                    "records": len(rep.get("records") or []), "path": rep.get("path")})
    return out


def run_report(h: Any, label: str):
    """The report of one run (a rich renderable): what was read, the outcome, the first departure and
    first mover, the alerts by signal with cause and fix, the forensics, the loss and lr over steps."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    o = h.outcome()
    parts: list[Any] = [Text(describe_run(h, label), style="bold"),
                        Text("outcome: " + outcome_line(h), style=_COLOUR[o["status"]])]
    parts += [Text(f"reading: {n}", style="yellow") for n in h.notes]
    parts += [Text(line) for line in _departure_lines(h)]
    groups = alert_groups(h.alerts)
    if groups:
        t = Table(title=f"alerts by signal ({len(h.alerts)} in all)", title_justify="left", show_lines=False)
        for col in ("signal", "severity", "steps", "n", "sites", "value / threshold", "cause", "fix"):
            t.add_column(col, overflow="fold")
        for g in groups:
            steps = str(g["first"]) if g["first"] == g["last"] else f"{g['first']}..{g['last']}"
            t.add_row(g["signal"], g["severity"], steps, str(g["count"]), _sites(g["sites"]),
                      f"{_f(g['value'])} / {_f(g['threshold'])}", g["cause"], g["fix"])
        parts.append(t)
    else:
        parts.append(Text("alerts: none reported"))
    for row in _forensics_rows(h):
        parts.append(Text(f"forensics of step {row['step']}: {row['trigger']}", style="bold"))
        parts.append(Text(f"  {row['span']}; {row['records']} records before it; moved most: "
                          f"{'; '.join(row['moved']) or 'nothing measured'}"))
    parts += _series_lines(h)
    return Group(*parts)


def _series_lines(h: Any) -> list[Any]:
    from rich.table import Table
    from rich.text import Text

    s = h.data["series"]
    if not s["step"]:
        return [Text("loss and lr: no step logged")]
    out: list[Any] = []
    for name in ("loss", "lr"):
        vals = _thin([float(v) for v in s[name]], SPARK)
        lo, hi = _log_range([vals])
        out.append(Text(f"{name:>4} {_spark(vals, lo, hi)}  (log scale {BARS[0]} {10 ** lo:.3g} .. "
                        f"{BARS[-1]} {10 ** hi:.3g}; steps {s['step'][0]}..{s['step'][-1]})"))
    t = Table(title="loss and lr over steps", title_justify="left")
    for col in ("step", "loss", "lr", "grad_norm"):
        t.add_column(col, justify="right")
    for step, loss, lr, g in loss_points(h):
        t.add_row(str(step), _f(loss), _f(lr), _f(g))
    out.append(t)
    return out


def comparison_report(c: Any):
    """Runs side by side (a ``RunsComparison``), as rich text."""
    from rich.text import Text

    return Text(f"side by side: {c.labels[0]} vs {c.labels[1]}\n" + str(c)
                + (f"\n({noise_words(c)})" if not c.parting["why"] else ""))


def noise_words(c: Any) -> str:
    """How a comparison judged, in a line: its tests, threshold, noise and false-alarm probability."""
    p = c.parting
    first = "the first aligned record" if p["early"] == 1 else f"the first {p['early']} aligned records"
    return (f"{p['compared']} signals over {p['steps']} aligned records, {p.get('tests', 0)} tests; offset at "
            f"{first}, noise from each run's own record-to-record scatter; threshold "
            f"z >= {p['threshold']:.3g}; false-alarm probability {c.alpha:g}")


def follow_view(h: Any, label: str, lines_read: int):
    """The live panel of ``--follow``: the outcome so far, the last step, the alerts so far."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    s = h.data["series"]
    o = h.outcome()
    last = (f"step {s['step'][-1]}  loss {_f(s['loss'][-1])}  lr {_f(s['lr'][-1])}  |g| {_f(s['grad_norm'][-1])}"
            if s["step"] else "no step yet")
    parts = [Text(describe_run(h, label)), Text(f"so far: {outcome_line(h)}", style=_COLOUR[o["status"]]),
             Text(last)]
    parts += [Text(f"  step {a.step}: {a.severity} {a.signal} at {a.site or 'the model'}") for a in h.alerts[-5:]]
    parts += [Text(f"reading: {n}", style="yellow") for n in h.notes[-3:]]
    parts += _series_lines(h)[:2]
    return Panel(Group(*parts), title=f"tinylm runs --follow ({lines_read} lines read)", expand=False)


# --------------------------------------------------------------------------- figure


def _envelope(steps: list[int], values: list[float]) -> tuple[list[float], list[float]]:
    """At most MAX_POINTS points: each bucket of consecutive points as its lowest and highest value."""
    if len(values) <= MAX_POINTS:
        return [float(t) for t in steps], [float(v) for v in values]
    k = math.ceil(len(values) / (MAX_POINTS // 2))
    xs, ys = [], []
    for i in range(0, len(values), k):
        b = [v for v in values[i:i + k] if v is not None and math.isfinite(v)]
        if not b:
            xs.append(float(steps[i]))
            ys.append(math.nan)
            continue
        xs += [float(steps[i]), float(steps[min(i + k, len(steps)) - 1])]
        ys += [min(b), max(b)]
    return xs, ys


def _positive(values: list[float]) -> list[float]:
    return [v if (v is not None and math.isfinite(v) and v > 0) else math.nan for v in values]


def runs_figure(h: Any, label: str):
    """A matplotlib figure of one run: loss and lr over steps; activation and gradient variance of the
    charted sites (embeddings, each block's output, the head) over the records; every alert marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = h.data
    s, records = d["series"], d["records"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    fig.subplots_adjust(left=0.09, right=0.9, top=0.95, bottom=0.06, hspace=0.08)
    ax = axes[0]
    ax.plot(*_envelope(s["step"], _positive(s["loss"])), color="#1f3b73", lw=1, label="loss")
    ax.set_yscale("log")
    ax.set_ylabel("loss")
    if any(v is not None and math.isfinite(v) and v > 0 for v in s["lr"]):
        lr_ax = ax.twinx()
        lr_ax.plot(*_envelope(s["step"], _positive(s["lr"])), color="#8a5a00", lw=1, ls="--", label="lr")
        lr_ax.set_ylabel("lr (dashed)")
    sites = chart_sites(d)
    cmap = plt.get_cmap("viridis")
    steps = [r["step"] for r in records]
    for ax, key, what in ((axes[1], "fwd_var", "activation variance"), (axes[2], "grad_var", "gradient variance")):
        for k, site in enumerate(sites):
            vals = _positive([(r["stats"].get(site) or {}).get(key) for r in records])
            ax.plot(*_envelope(steps, vals), color=cmap(k / max(len(sites) - 1, 1)), lw=1,
                    label=site if len(sites) <= 16 else None)
        ax.set_yscale("log")
        ax.set_ylabel(what)
    axes[1].legend(fontsize=6, ncol=4, loc="upper left")
    axes[-1].set_xlabel("step")
    for a in {(a.step, a.severity) for a in h.alerts}:
        for ax in axes:
            ax.axvline(a[0], color="#b00020" if a[1] == "fail" else "#d08000", lw=0.8, alpha=0.6)
    dep = h.first_departure()
    title = f"{label}: {outcome_line(h)}"
    if dep is not None:
        axes[1].axvline(dep["step"], color="black", lw=1, ls=":")
    axes[0].set_title(title if len(title) < 110 else title[:107] + "...", fontsize=9)
    return fig


def figure_png(fig: Any, close: bool = True) -> str:
    """A figure as base64 PNG (80 dpi), for a data URI; closed unless ``close`` is False."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=80)
    finally:
        if close:
            plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# --------------------------------------------------------------------------- the page


def _e(x: Any) -> str:
    return _html.escape(str(x), quote=True)


def _table(columns: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_e(_f(v) if isinstance(v, float) else v)}</td>" for v in r) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


_CSS = ("body{font-family:sans-serif;font-size:14px;color:#111;background:#fff;max-width:1100px;margin:16px auto;"
        "padding:0 12px}table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:left;vertical-align:top}th{background:#eef}.failed{color:#8b0000}.warned{color:#7a4a00}"
        ".ok{color:#0a5c0a}.note{color:#7a4a00}img{max-width:100%;border:1px solid #ddd}h2{margin-top:28px}")


def run_html(h: Any, label: str, figure: bool = True, png: str | None = None) -> str:
    """One run's section of the page (also the notebook's ``_repr_html_`` of a History read back);
    ``png``: its figure already drawn (:func:`figure_png`), else drawn here."""
    o = h.outcome()
    parts = [f"<h2>{_e(label)}</h2>", f"<p>{_e(describe_run(h, label))}</p>",
             f'<p class="outcome {o["status"].replace(" ", "-")}"><b>outcome: {_e(outcome_line(h))}</b></p>']
    parts += [f'<p class="note">reading: {_e(n)}</p>' for n in h.notes]
    parts += [f"<p>{_e(line)}</p>" for line in _departure_lines(h)]
    groups = alert_groups(h.alerts)
    if groups:
        parts.append(f"<h3>alerts by signal ({len(h.alerts)} in all)</h3>")
        parts.append(_table(["signal", "severity", "first step", "last step", "n", "sites", "value", "threshold",
                             "cause", "fix"],
                            [[g["signal"], g["severity"], g["first"], g["last"], g["count"], _sites(g["sites"], 8),
                              g["value"], g["threshold"], g["cause"], g["fix"]] for g in groups]))
    for row in _forensics_rows(h):
        parts.append(f"<h3>forensics of step {_e(row['step'])}</h3><p>{_e(row['trigger'])}</p>"
                     f"<p>{_e(row['span'])}; {row['records']} records before it; moved most: "
                     f"{_e('; '.join(row['moved']) or 'nothing measured')}</p>")
    if figure and (h.data["series"]["step"] or h.data["records"]):
        parts.append(f'<img class="figure" alt="{_e(label)}: loss, lr and per-site variances over steps" '
                     f'src="data:image/png;base64,{png or figure_png(runs_figure(h, label))}"/>')
    parts.append("<h3>loss and lr over steps</h3>")
    parts.append(_table(["step", "loss", "lr", "grad_norm"], [list(p) for p in loss_points(h, 12)]))
    return "".join(parts)


def comparison_html(c: Any) -> str:
    from diagnostics.jobs.runs_compare import describe_departure

    p = c.parting
    parts = [f"<h2>side by side: {_e(c.labels[0])} vs {_e(c.labels[1])}</h2>"]
    if p["why"]:
        parts.append(f"<p>not judged: {_e(p['why'])}</p>")
    elif p["first"] is None:
        parts.append(f"<p>no departure beyond the runs' own noise over {p['steps']} aligned records "
                     f"(false-alarm probability {c.alpha:g})</p>")
    else:
        parts.append(f"<p><b>first departure: {_e(describe_departure(p['first'], c.labels))}</b></p>")
        rows = [[d["step"], d["signal"], d["site"] or "model", d["a"], d["b"], d["ratio"], d["z"]]
                for d in p["departures"][:20]]
        parts.append(_table(["step", "signal", "site", c.labels[0], c.labels[1], "ratio beyond offset", "z"], rows))
        parts.append(f"<p>{_e(noise_words(c))}</p>")
    rows = [[r["run"], r["step"], r["severity"], r["signal"], r["site"] or "model",
             "–" if r["departed_at"] is None else r["departed_at"],
             r["departure_signal"] or ("not parted" if r["compared"] else "not compared")]
            for r in c.alert_departures()]
    if rows:
        parts.append("<h3>each alert, and when its site parted from the other run</h3>")
        parts.append(_table(["run", "step", "severity", "signal", "site", "parted at", "by"], rows))
    return "".join(parts)


def runs_page(runs: list[tuple[str, Any]], comparisons: list[Any], pngs: dict[str, str] | None = None) -> str:
    """The single-file page: every run's section and every comparison; the figures inline as PNG data
    URIs (``pngs``: {label: base64 PNG} already drawn); no script, no link to anything outside the file."""
    title = "tinylm runs: " + ", ".join(label for label, _ in runs)
    body = "".join(comparison_html(c) for c in comparisons) + "".join(
        run_html(h, label, png=(pngs or {}).get(label)) for label, h in runs)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>{body}</body></html>\n")
