"""Read back what a watch wrote: a run's outcome, first departure, alerts, forensics, loss and lr.

``tinylm runs DIR [DIR ...]`` reads each log dir (``watch.jsonl`` and ``forensics/``, as
``Watch(log_dir=...)``, the Hugging Face and Lightning callbacks write them), a ``watch.jsonl``,
a history JSON (``tinylm train --watch-json``) or a ``tinylm train`` checkpoint, and reports each
run; given several, it puts each beside the first and says where they part ways beyond their own
noise. ``--follow`` redraws the report of one growing dir as its records arrive. Exit codes: 0
(or, with ``--check``, no run failed, nor warned under ``--fail-on warned``), 1 with ``--check``
a run that failed (or warned), 2 bad input or usage (one line), 130 interrupted.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .cli import EXIT_FINDINGS, EXIT_OK, UsageError
from .intake import check_outputs, check_suffixes, report_width

SCHEMA = "tinylm-runs"
SCHEMA_VERSION = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dirs", metavar="DIR", nargs="+",
                   help="a watch's log dir (or its watch.jsonl, a history JSON, a tinylm train checkpoint); "
                        "several: each beside the first")
    g = p.add_argument_group("output")
    g.add_argument("--check", action="store_true", help="exit 1 when a run failed (see --fail-on; for CI)")
    g.add_argument("--fail-on", choices=["failed", "warned"], default="failed",
                   help="what --check exits 1 on: a failed run (default), or a run that failed or warned")
    g.add_argument("--json", metavar="PATH", help="write the runs (outcome, alerts, comparisons, tidy rows) as JSON")
    g.add_argument("--csv", metavar="PATH", help="write the tidy rows of every run (the one result schema) as CSV")
    g.add_argument("--plot", metavar="PATH",
                   help="write the figure (loss, lr, per-site variances over steps, alerts marked): .png, .svg "
                        "or .pdf; several runs: one file each, named PATH's stem + '-' + the run's name")
    g.add_argument("--html", metavar="PATH", help="write one self-contained page (report, figures, tables; offline)")
    g.add_argument("--alpha", type=float, default=1e-6, metavar="P",
                   help="false-alarm probability of a side-by-side comparison (default 1e-6)")
    g.add_argument("--width", type=report_width, help="report width in columns (default: the terminal's)")
    f = p.add_argument_group("live")
    f.add_argument("--follow", action="store_true", help="redraw the report of one log dir as records arrive "
                                                         "(Ctrl-C, --idle or --for ends it)")
    f.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between reads under --follow (default 1)")
    f.add_argument("--idle", type=float, default=0.0, metavar="S",
                   help="under --follow: stop after this many seconds without a new line (default 0: never)")
    f.add_argument("--for", dest="follow_for", type=float, default=0.0, metavar="S",
                   help="under --follow: stop after this many seconds (default 0: never)")


def check(args: argparse.Namespace) -> None:
    """Inputs exist, outputs are writable and of the right kind, numbers in range; before torch."""
    for d in args.dirs:
        path = Path(d)
        if not path.exists():
            raise UsageError(f"{d}: no such file or directory; pass a watch's log dir (Watch(log_dir=...))")
        if path.is_dir() and not (path / "watch.jsonl").is_file():
            more = " (only watch.csv, which lacks the alerts)" if (path / "watch.csv").is_file() else ""
            raise UsageError(f"{d}: no watch.jsonl in this directory{more}; pass a log dir a Watch(log_dir=...) "
                             "or a watch callback wrote")
    outputs = {"--json": args.json, "--csv": args.csv, "--plot": args.plot, "--html": args.html}
    check_outputs(outputs, {f"DIR {d}": d for d in args.dirs})
    check_suffixes(outputs)
    if not 0 < args.alpha < 0.5:
        raise UsageError(f"--alpha {args.alpha}: must be in (0, 0.5); e.g. 1e-6")
    for flag, v in (("--interval", args.interval), ("--idle", args.idle), ("--for", args.follow_for)):
        if not v >= 0 or (flag == "--interval" and v <= 0):
            raise UsageError(f"{flag} {v}: must be a positive number of seconds")
    if args.follow and len(args.dirs) != 1:
        raise UsageError(f"--follow draws one run; give one DIR, not {len(args.dirs)}")
    if args.follow and any(x is not None for x in outputs.values()):
        raise UsageError("--follow draws in the terminal; run again without --follow to write --json, --csv, "
                         "--plot or --html")


def _labels(histories: list) -> list[str]:
    from diagnostics.jobs.runs_compare import label_of

    labels = []
    for k, h in enumerate(histories):
        name = label_of(h.source) or f"run{k}"
        labels.append(name if name not in labels else f"{name}#{k}")
    return labels


def _summary(label: str, h) -> dict:
    return {"label": label, "source": h.source, "outcome": h.outcome(), "first_departure": h.first_departure(),
            "first_mover": h.first_mover(), "alerts": [a.to_dict() for a in h.alerts], "events": h.data["events"],
            "forensics": [{"step": r.get("step"), "trigger": r.get("trigger"), "path": r.get("path")}
                          for r in h.forensics], "notes": h.notes,
            "steps": len(h.data["series"]["step"]), "records": len(h.data["records"])}


def _write(args: argparse.Namespace, runs: list, comparisons: list, console) -> None:
    import json

    from diagnostics.integrations.writers import json_safe

    from . import export
    from .runs_view import figure_png, runs_figure, runs_page

    frame = None
    if args.csv or args.json:
        import pandas as pd

        frame = pd.concat([h.to_frame(run=label) for label, h in runs], ignore_index=True)
    if args.csv:
        export.write_csv(args.csv, frame)
        console.print(f"wrote the tidy rows to {args.csv}")
    if args.json:
        doc = {"schema": SCHEMA, "version": SCHEMA_VERSION, "runs": [_summary(label, h) for label, h in runs],
               "comparisons": [json.loads(c.to_json()) for c in comparisons],
               "rows": json.loads(frame.to_json(orient="records"))}
        export.write_text(args.json, json.dumps(json_safe(doc), indent=1, allow_nan=False))
        console.print(f"wrote {args.json}")
    pngs = {}
    if args.plot or args.html:
        import matplotlib.pyplot as plt

        for label, h in runs:  # each figure drawn once, for the plot and the page
            fig = runs_figure(h, label)
            if args.plot:
                base = Path(args.plot)
                path = base if len(runs) == 1 else base.with_name(f"{base.stem}-{label}{base.suffix}")
                export.write_figure(path, fig)
                console.print(f"wrote the figure to {path}")
            if args.html:
                pngs[label] = figure_png(fig, close=False)
            plt.close(fig)
    if args.html:
        export.write_text(args.html, runs_page(runs, comparisons, pngs))
        console.print(f"wrote the page to {args.html}")


def _follow(args: argparse.Namespace, console) -> int:
    """Redraw one growing log dir's report until Ctrl-C, --idle seconds without a line or --for seconds."""
    from rich.live import Live

    from diagnostics.jobs.history_read import LogReader
    from diagnostics.jobs.runs_compare import label_of

    from .runs_view import follow_view

    path = Path(args.dirs[0])
    path = path / "watch.jsonl" if path.is_dir() else path
    reader = LogReader(path)
    label = label_of(str(path)) or "run"
    start = last_new = time.monotonic()
    lines = reader.poll()
    with Live(follow_view(reader.history(), label, lines), console=console, auto_refresh=False) as live:
        try:
            while True:
                now = time.monotonic()
                if (args.idle and now - last_new >= args.idle) or (args.follow_for and now - start >= args.follow_for):
                    break
                time.sleep(args.interval)
                got = reader.poll()
                if got:
                    lines += got
                    last_new = time.monotonic()
                    live.update(follow_view(reader.history(), label, lines), refresh=True)
        except KeyboardInterrupt:
            pass
        reader.finish()
        h = reader.history()
        live.update(follow_view(h, label, lines), refresh=True)
    return _exit(args, [h])


def _exit(args: argparse.Namespace, histories: list) -> int:
    if not args.check:
        return EXIT_OK
    bad = {"failed"} if args.fail_on == "failed" else {"failed", "warned"}
    return EXIT_FINDINGS if any(h.outcome()["status"] in bad for h in histories) else EXIT_OK


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.rule import Rule

    from diagnostics import History

    from .runs_view import comparison_report, run_report

    console = Console(width=args.width, highlight=False, soft_wrap=False)
    if args.follow:
        return _follow(args, console)
    histories = [History.read(d) for d in args.dirs]
    labels = _labels(histories)
    runs = list(zip(labels, histories))
    comparisons = [History.compare(histories[0], h, labels=(labels[0], label), alpha=args.alpha)
                   for label, h in runs[1:]]
    for k, (label, h) in enumerate(runs):
        if k:
            console.print(Rule())
        console.print(run_report(h, label))
    for c in comparisons:
        console.print(Rule())
        console.print(comparison_report(c))
    _write(args, runs, comparisons, console)
    return _exit(args, histories)
