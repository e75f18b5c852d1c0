"""Rendering of the property suite's results and of the mutation check (rich renderables only).

Nothing here computes: the numbers come from :mod:`props.runner` and :mod:`props.mutate`.
"""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from props.mutate import MutationReport
from props.runner import PropertyResult, SuiteRun

__all__ = ["suite_table", "SuiteTable", "render_suite", "render_mutation", "RESULT_STYLE"]

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


def suite_table(run: SuiteRun, width: int = 120) -> Table:
    """One row per property: name, claim, examples, worst observed, tolerance, false-alarm rate, result.

    Laid out for ``width`` columns without cutting a number: from 120 columns a boxed table with
    a claim column; below, the claim goes under the name (dim), and under 100 columns the
    false-alarm rate, under 70 the example count, are left out (the caption says so).
    """
    wide = width >= 120
    show_alpha, show_examples = width >= 100, width >= 70
    left_out = [c for c, shown in (("alpha", show_alpha), ("ex.", show_examples)) if not shown]
    caption = f"left out at this width: {', '.join(left_out)} (see --width)" if left_out and not wide else None
    if wide:
        t = Table(title=f"Property suite: implementation {run.impl}", title_justify="left", expand=True)
        t.add_column("property", overflow="fold", ratio=2, min_width=14)
        t.add_column("claim", overflow="fold", ratio=3, min_width=14)
    else:
        t = Table(title=f"Property suite: implementation {run.impl}", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, show_edge=False, caption=caption, caption_justify="left", caption_style="dim")
        t.add_column("property (claim)", overflow="fold", ratio=1)
    if wide or show_examples:
        t.add_column("ex.", justify="right", no_wrap=True)
    t.add_column("worst", justify="right", no_wrap=True)
    t.add_column("tol.", justify="right", no_wrap=True)
    if wide or show_alpha:
        t.add_column("alpha", justify="right", no_wrap=True)
    t.add_column("result", no_wrap=True)
    for r in run.results:
        worst = _num(r.observed) + (f" {r.kind}" if r.kind and r.observed is not None else "")
        if wide:
            cells: list = [Text(r.name), Text(r.claim or "-")]  # claims hold brackets such as 1[x > 0]: never markup
        else:
            name = Text(r.name)
            if r.claim:
                name.append(f"\n  {r.claim}", style="dim")
            cells = [name]
        if wide or show_examples:
            cells.append(str(r.examples) if r.examples else "-")
        cells += [worst, _num(r.tolerance)]
        if wide or show_alpha:
            cells.append(f"{r.alpha:g}" if r.alpha else "-")
        cells.append(_result_cell(r))
        t.add_row(*cells)
    return t


class SuiteTable:
    """:func:`suite_table` laid out for the console's width."""

    def __init__(self, run: SuiteRun) -> None:
        self.run = run

    def __rich_console__(self, console, options):
        yield suite_table(self.run, options.max_width)


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


def _failure(r: PropertyResult, impl: str = "tinylm") -> Group:
    """One failing property: its name and message, the claim it breaks, hypothesis's minimal
    example, the worst number against its tolerance and the command that reruns it alone."""
    label = {"xpassed": "XPASS", "error": "ERROR"}.get(r.outcome, "FAILED")
    head = Text(f"{label} {r.name}", style="bold red")
    if r.message:
        head.append(f": {r.message}")
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    if r.claim:
        grid.add_row("  claim", Text(r.claim))
    if r.example:
        grid.add_row("  example", Text(r.example))
    if r.observed is not None and r.tolerance is not None:
        grid.add_row("  worst", Text(f"{_num(r.observed)} {r.kind} against tolerance {_num(r.tolerance)}"))
    rerun = f"tinylm props -k {r.name.split('[')[0]}" + (f" --impl {impl}" if impl and impl != "tinylm" else "")
    grid.add_row("  rerun", Text(rerun, style="dim"))
    return Group(head, grid)


def _skips(skipped: list[PropertyResult]) -> Group:
    """Skips grouped by what the implementation lacks: one line per missing function (or argument)."""
    groups: dict[str, list[str]] = {}
    for r in skipped:
        groups.setdefault(r.lacks, []).append(r.name)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, style="yellow")
    grid.add_column(overflow="fold", style="dim")
    for lacks, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = names[:3]
        grid.add_row(f"  {lacks} ({len(names)})",
                     ", ".join(shown) + (f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""))
    return Group(Text(f"skipped {len(skipped)}, by what the implementation lacks:", style="yellow"), grid)


def render_suite(run: SuiteRun, verbose: bool = False) -> Group:
    """The run as a reader needs it: each failure with the claim it breaks and hypothesis's minimal
    example, the skips grouped by the function the implementation lacks, and a summary line;
    ``verbose`` puts the full one-row-per-property table first."""
    parts: list = [SuiteTable(run)] if verbose else []
    failures = [r for r in run.results if r.outcome in ("failed", "error", "xpassed")]
    for r in failures:
        parts += [_failure(r, run.impl), Text("")]
    skipped = [r for r in run.results if r.outcome == "skipped"]
    if skipped:
        parts.append(_skips(skipped))
    if not run.results:
        parts.append(Text(f"no property ran (pytest exit code {run.returncode}):\n{run.output_tail}", style="red"))
    parts.append(_summary(run))
    if not verbose and run.results:
        parts.append(Text("(--verbose: every property with its claim, examples, worst error and tolerance)",
                          style="dim"))
    return Group(*parts)


def render_mutation(report: MutationReport) -> Group:
    """The mutation table (the report renders itself) and a one-line verdict."""
    killed = sum(r.killed and not r.error for r in report.results)
    ok = report.all_killed
    line = Text()
    line.append("EVERY MUTANT KILLED" if ok else "SOME MUTANTS SURVIVED OR ERRED", style="bold green" if ok else "bold red")
    line.append(f": {killed}/{len(report.results)} killed in {report.seconds:.0f} s")
    return Group(report, line)
