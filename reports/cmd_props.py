"""Run the property-based numerics suite and summarise it, one row per property.

``tinylm props`` runs every property (in a pytest subprocess) against tinylm, or,
with ``--impl module[:object]`` (a module importable or in the current directory,
or ``path/to/file.py[:object]``), against your own implementation (see
``props.impl`` for the protocol; properties needing a function or an argument it
lacks are skipped by name). It shows a live counter on stderr (a terminal only),
then each failure with the claim it breaks and hypothesis's minimal example, the
skips grouped by what is missing, and one summary line; ``--verbose`` adds the
table of every property. ``--mutate`` runs the mutation check instead. Exit code
0 when everything holds (every mutant killed), 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

import argparse

from .cli import UsageError
from .intake import report_width


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", metavar="MODULE[:OBJECT]",
                   help="implementation under test: a module (importable or in the current directory) or a "
                        "path/to/file.py, optionally :object (default: tinylm)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="the full table: every property with its claim, examples, worst error and tolerance")
    p.add_argument("--no-progress", action="store_true", help="no live counter on stderr")
    p.add_argument("--width", type=report_width, help="report width in columns (default: the terminal's)")
    p.add_argument("--profile", choices=["ci", "thorough"], help="hypothesis profile (default ci: fast, derandomized)")
    p.add_argument("-k", "--select", metavar="EXPR", help="only properties whose name matches (pytest -k)")
    p.add_argument("--slow", action="store_true", help="also run properties marked slow")
    p.add_argument("--mutate", action="store_true", help="run the mutation check: every deliberate bug must be caught")
    p.add_argument("--workers", type=int, default=None, help="with --mutate: suites run at once (default: CPU count)")
    p.add_argument("--only", action="append", metavar="MUTANT", help="with --mutate: run only this mutant (repeatable)")
    p.add_argument("--first-failure", action="store_true", help="with --mutate: stop each mutant at its first kill")


def check(args: argparse.Namespace) -> None:
    """Flag combinations, before anything is imported."""
    if args.mutate:
        if args.impl:
            raise UsageError("--mutate mutates tinylm itself; drop --impl (or drop --mutate to test your implementation)")
        if args.workers is not None and args.workers < 1:
            raise UsageError(f"--workers {args.workers}: need at least 1")
        return
    for flag in ("workers", "only"):
        if getattr(args, flag):
            raise UsageError(f"--{flag} applies to --mutate only")
    if args.first_failure:
        raise UsageError("--first-failure applies to --mutate only")


def run(args: argparse.Namespace) -> int:
    import os

    from rich.console import Console

    from props import mutate, runner

    from .props_view import render_mutation, render_suite

    check(args)
    console = Console(width=args.width)
    if args.mutate:
        mutants = mutate.select_mutants(args.only) if args.only else list(mutate.MUTANTS)
        report = mutate.run_all(
            mutants,
            workers=args.workers or os.cpu_count() or 2,
            first_failure=args.first_failure,
            on_result=lambda r: console.print(f"  {r.mutant.name}: {r.status} ({r.seconds:.0f} s)", highlight=False),
        )
        console.print(render_mutation(report))
        return 0 if report.all_killed else 1
    from .progress import progress_bar

    with progress_bar("props", enabled=False if args.no_progress else None) as update:
        def progress(done: int, total: int, name: str, outcome: str) -> None:
            update(done, total or None, f"props {name}" if name else "props")

        result = runner.run_suite(impl=args.impl, select=args.select, profile=args.profile, slow=args.slow,
                                  on_progress=progress)
    console.print(render_suite(result, verbose=args.verbose))
    return 0 if result.ok else 1
