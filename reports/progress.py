"""A rich progress bar on stderr for long runs (silent when stderr is not a terminal, unless forced)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["progress_bar"]


@contextlib.contextmanager
def progress_bar(description: str, total: int | None = None, *, enabled: bool | None = None,
                 console: Console | None = None) -> Iterator[Callable[..., None]]:
    """Yield ``update(done, total=None, description=None)`` that moves a bar on stderr.

    ``enabled=None`` shows the bar only when stderr is a terminal, so pipes and
    test captures stay clean; the bar is removed when the block ends.
    """
    console = console or Console(stderr=True)
    if enabled is None:
        enabled = console.is_terminal
    if not enabled:
        yield lambda done, total=None, description=None: None
        return
    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)

        def update(done: int, total: int | None = None, description: str | None = None) -> None:
            kw = {"completed": done}
            if total is not None:
                kw["total"] = total
            if description is not None:
                kw["description"] = description
            progress.update(task, **kw)

        yield update
