"""The watch's live panel: the "during training" panel of ``reports.watch_view`` redrawn as a run goes.

A :class:`diagnostics.integrations.writers.WatchWriter`, handed to a watch:
``Watch(model, every=50, writers=[LivePanel()])``.
"""

from __future__ import annotations

from typing import Any

from diagnostics import History
from diagnostics.integrations.writers import WatchWriter

from .watch_view import render_history

__all__ = ["LivePanel"]


class LivePanel(WatchWriter):
    """A watch writer that draws :func:`render_history` live in the terminal (or a notebook's
    output), redrawn at each record and alarm, with the latest step's loss below it::

        Watch(model, every=50, writers=[LivePanel()])

    ``console``: a ``rich.console.Console`` (None: a new one on standard output)."""

    def __init__(self, console: Any = None):
        self.console = console
        self.live = None
        self.watch = None
        self.history = None  # the watch's History: its verdicts judged once per record, however often drawn
        self._last = ""

    def _view(self):
        from rich.console import Group
        from rich.text import Text

        return Group(render_history(self.history), Text(self._last))

    def open(self, watch: Any) -> None:
        from rich.console import Console
        from rich.live import Live

        self.watch = watch
        self.history = History(watch.history)
        self.live = Live(self._view(), console=self.console or Console(), auto_refresh=False, transient=False)
        self.live.start()

    def step(self, t: int, loss: float, lr: float, grad_norm: float) -> None:
        self._last = f"step {t}  loss {loss:.4g}  lr {lr:.3g}  |g| {grad_norm:.3g}"

    def record(self, record: dict[str, Any], verdicts: list[dict[str, Any]]) -> None:
        self.live.update(self._view(), refresh=True)

    def event(self, event: Any) -> None:
        self.live.update(self._view(), refresh=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.update(self._view(), refresh=True)
            self.live.stop()
            self.live = None
