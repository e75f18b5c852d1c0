"""Rendering of the property suite's results and of the mutation check (rich renderables only).

Nothing here computes: the numbers come from :mod:`props.runner` and :mod:`props.mutate`.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from props.mutate import MutationReport
from props.runner import PropertyResult, SuiteRun

__all__ = ["suite_table", "render_suite", "render_mutation", "RESULT_STYLE"]

RESULT_STYLE = {
    "passed": "green",
    "failed": "bold red",
    "error": "bold red",
    "skipped": "yellow",
    "xfailed": "yellow",
    "xpassed": "bold red",
}


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.3g}"


def _result_cell(r: PropertyResult) -> Text:
    label = {"xfailed": "xfail (known bug)", "xpassed": "XPASS"}.get(r.outcome, r.outcome)
    return Text(label, style=RESULT_STYLE.get(r.outcome, ""))


def suite_table(run: SuiteRun) -> Table:
    """One row per property: name, claim, examples, worst observed, tolerance, false-alarm rate, result."""
    t = Table(title=f"Property suite: implementation {run.impl}", title_justify="left", expand=True)
    t.add_column("property", overflow="fold", ratio=2, min_width=14)
    t.add_column("claim", overflow="fold", ratio=3, min_width=20)
    t.add_column("ex.", justify="right")
    t.add_column("worst", justify="right", no_wrap=True)
    t.add_column("tol.", justify="right", no_wrap=True)
    t.add_column("alpha", justify="right", no_wrap=True)
    t.add_column("result", no_wrap=True)
    for r in run.results:
        worst = _num(r.observed) + (f" {r.kind}" if r.kind and r.observed is not None else "")
        t.add_row(
            Text(r.name),
            Text(r.claim or "-"),  # claims hold brackets such as 1[x > 0]: plain text, never markup
            str(r.examples) if r.examples else "-",
            worst,
            _num(r.tolerance),
            f"{r.alpha:g}" if r.alpha else "-",
            _result_cell(r),
        )
    return t


def _summary(run: SuiteRun) -> Text:
    counts = run.counts()
    parts = [f"{n} {k}" for k, n in sorted(counts.items())]
    verdict = "ALL HOLD" if run.ok else "FAILURES"
    style = "bold green" if run.ok else "bold red"
    line = Text()
    line.append(f"{verdict}: ", style=style)
    line.append(f"{len(run.results)} properties ({', '.join(parts) or 'none ran'}) in {run.seconds:.1f} s")
    if run.profile:
        line.append(f"; hypothesis profile {run.profile}, up to {run.max_examples} examples each")
    if run.impl_source:
        line.append(f"; implementation from {run.impl_source}")
    return line


def render_suite(run: SuiteRun) -> Group:
    """The table, the failing properties' messages, the skipped ones' reasons, and a summary line."""
    parts: list = [suite_table(run)]
    for r in run.results:
        if r.outcome in ("failed", "error", "xpassed"):
            parts.append(Text(f"FAILED {r.name}: {r.message}", style="red"))  # Text: no markup parsing
    skipped = [r for r in run.results if r.outcome == "skipped"]
    if skipped:
        parts.append(Text(f"skipped {len(skipped)}: " + "; ".join(f"{r.name} ({r.message})" for r in skipped), style="yellow"))
    if not run.results:
        parts.append(Text(f"no property ran (pytest exit code {run.returncode}):\n{run.output_tail}", style="red"))
    parts.append(_summary(run))
    return Group(*parts)


def render_mutation(report: MutationReport) -> Group:
    """The mutation table (the report renders itself) and a one-line verdict."""
    killed = sum(r.killed and not r.error for r in report.results)
    ok = report.all_killed
    line = Text()
    line.append("EVERY MUTANT KILLED" if ok else "SOME MUTANTS SURVIVED OR ERRED", style="bold green" if ok else "bold red")
    line.append(f": {killed}/{len(report.results)} killed in {report.seconds:.0f} s")
    return Group(report, line)
