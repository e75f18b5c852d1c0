"""Where a watch's steps, records and alarms go: the :class:`WatchWriter` protocol and its writers.

A writer is any object with the five methods of :class:`WatchWriter` (``open``, ``step``,
``record``, ``event``, ``close``); subclassing it gives each a default that does nothing.
The writers here:

* :class:`CSVWriter` — ``watch.csv``: tidy rows of the one result schema (columns
  :data:`diagnostics.result.COLUMNS`; the rows ``diagnostics.jobs.history.to_rows`` gives,
  written as they happen, so a run that dies leaves what it had);
* :class:`JSONLWriter` — ``watch.jsonl``: one JSON object a line, a first ``{"type": "header",
  ...}`` (the history's format, version, sites, norm, kinds, model and thresholds), ``{"type": "step", "step",
  "loss", "lr", "grad_norm"}``, ``{"type": "record", ...the history's record..., "verdicts":
  [...]}``, ``{"type": "event", ...}``, ``{"type": "alert", ...}`` and ``{"type": "forensics",
  "step", "path"}`` (the report itself in ``forensics/step_<t>.json``) (:func:`json_safe`: NaN as null, infinities as "inf"/"-inf");
* :class:`TensorBoardWriter` — TensorBoard event files through ``torch.utils.tensorboard``
  (the ``tensorboard`` package: ``pip install "tinylm[tensorboard]"``). Scalars
  ``train/loss``, ``train/lr``, ``train/grad_norm`` every step (lr and grad_norm when known);
  at each record ``watch/activation_var/<site>``, ``watch/gradient_var/<site>``,
  ``watch/max_abs/<site>``, ``watch/update_ratio/<parameter>``,
  ``watch/attention_entropy/<site>`` and ``watch/not_ok`` (how many sites are not ok); text
  ``watch/verdicts`` (each verdict other than ok), ``watch/alarms`` (spikes, non-finite losses)
  and ``watch/alerts`` (each warning or fail reported).

A whole history is written at once by :func:`write_json` and :func:`write_csv`; every file
written whole goes through :func:`write_atomic` (a temporary file in the same folder, then a
rename onto the target), so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from ..result import COLUMNS

__all__ = ["WatchWriter", "CSVWriter", "JSONLWriter", "TensorBoardWriter", "default_writers", "tensorboard_available",
           "json_safe", "write_atomic", "write_json", "write_csv"]


@runtime_checkable
class WatchWriter(Protocol):
    """Where a watch sends what it sees: any object with these five methods.

    The watch calls, in this order:

    * ``open(watch)`` once, when the :class:`diagnostics.Watch` is built (``watch.history`` is
      the history dict it fills; ``watch.step_rows`` / ``watch.record_rows`` give tidy rows);
    * ``step(t, loss, lr, grad_norm)`` after every logged step (NaN where not known);
    * ``record(record, verdicts)`` after every record: the history's record dict and its
      non-ok verdict rows ({step, site, verdict, stat, value, threshold}, as
      :func:`diagnostics.judge.over_time.verdicts` gives them);
    * ``event(event)`` on a spike or a non-finite loss (a :class:`diagnostics.WatchEvent`);
    * ``close()`` at :meth:`diagnostics.Watch.close`.

    Two more methods are called when a writer has them (they are not part of the protocol's
    check; the JSONL and TensorBoard writers have them):
    ``alert(alert)`` for each warning or fail the watch reports (a
    :class:`diagnostics.judge.precursors.Alert`, the same the loop gets from
    :meth:`diagnostics.Watch.record`), and ``forensics(report)`` on a spike or a fail, with the
    watch's last records and steps before it (:meth:`diagnostics.Watch.forensics_report`).

    Subclass it to inherit a do-nothing default for each method and override what you need,
    or write a class with all five (the watch checks for them).
    """

    def open(self, watch: Any) -> None:
        pass

    def step(self, t: int, loss: float, lr: float, grad_norm: float) -> None:
        pass

    def record(self, record: dict[str, Any], verdicts: list[dict[str, Any]]) -> None:
        pass

    def event(self, event: Any) -> None:
        pass

    def close(self) -> None:
        pass


def json_safe(x: Any) -> Any:
    """``x`` with every non-finite float made JSON-safe: NaN as None (null), infinities as the
    strings "inf" / "-inf"; dicts, lists and tuples (as lists) converted all the way down."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_atomic(path: str | os.PathLike, content: str | Callable[[str], None]) -> None:
    """Write ``path`` whole or not at all: into a temporary file in the same folder, then renamed
    onto ``path`` (``os.replace``; the folder is created if missing).

    Args:
        path: the file to write.
        content: the text (written as UTF-8, newlines as "\\n"), or a function that writes the
            file at the temporary path it is given (``df.to_csv``, ``fig.savefig``).
    """
    from tinylm.checkpoint import atomic_write

    if callable(content):
        atomic_write(path, content)
        return

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(content)

    atomic_write(path, write)


def write_json(history: dict[str, Any], path: str | os.PathLike) -> None:
    """A watch history as JSON (:func:`json_safe`: NaN as null, infinities as "inf"/"-inf"), written atomically."""
    write_atomic(path, json.dumps(json_safe(history), indent=1, allow_nan=False))


def write_csv(history: dict[str, Any], path: str | os.PathLike, run: str | None = None) -> None:
    """A watch history's tidy frame (``diagnostics.jobs.history.to_frame``) as CSV (no index column),
    written atomically."""
    from ..jobs.history import to_frame

    df = to_frame(history, run)
    write_atomic(path, lambda tmp: df.to_csv(tmp, index=False, lineterminator="\n"))


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package (which torch.utils.tensorboard needs) is installed."""
    return importlib.util.find_spec("tensorboard") is not None


def default_writers(log_dir: str | os.PathLike, append: bool = False) -> list[WatchWriter]:
    """The writers of ``Watch(log_dir=...)``: CSV and JSONL in ``log_dir``, and TensorBoard there
    when its package is installed (``append``: continue existing files, as a resumed run does)."""
    from ..options import OptionsError

    d = Path(log_dir)
    if d.exists() and not d.is_dir():
        raise OptionsError(f"log_dir={str(log_dir)!r}: is a file, not a directory; pass a directory for the "
                           "watch's files (it is created if missing)")
    writers: list[WatchWriter] = [CSVWriter(d / "watch.csv", append), JSONLWriter(d / "watch.jsonl", append)]
    if tensorboard_available():
        writers.append(TensorBoardWriter(d))
    return writers


def _cell(v: Any) -> str:
    """A CSV cell as pandas writes it: empty for None and NaN, repr of a float, True/False."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return repr(v)
    return str(v)


class _File(WatchWriter):
    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.append = append
        self.f = None

    def open(self, watch: Any) -> None:
        self.watch = watch
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not (self.append and self.path.is_file())
        self.f = open(self.path, "w" if fresh else "a", encoding="utf-8", newline="")
        if fresh:
            self._header()

    def _header(self) -> None:
        pass

    def _write(self, text: str) -> None:
        if self.f is not None:
            self.f.write(text)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


class CSVWriter(_File):
    """Tidy rows (:data:`diagnostics.result.COLUMNS`) appended as the watch sees them."""

    def _header(self) -> None:
        self._write(",".join(COLUMNS) + "\n")

    def _rows(self, rows) -> None:
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        for r in rows:
            w.writerow([_cell(v) for v in r.astuple()])
        self._write(buf.getvalue())

    def step(self, t: int, loss: float, lr: float, grad_norm: float) -> None:
        self._rows(self.watch.step_rows(t, loss, lr, grad_norm))

    def record(self, record: dict[str, Any], verdicts: list[dict[str, Any]]) -> None:
        self._rows(self.watch.record_rows(record, verdicts))
        self.f.flush()

    def close(self) -> None:
        super().close()


class JSONLWriter(_File):
    """One JSON object a line: a header, steps, records (with their verdicts) and alarms."""

    def _header(self) -> None:
        """A new file's first line: ``{"type": "header", ...}``, the history's entries other than
        its series, records and events (format, version, sites, norm, kinds, model, thresholds),
        so that a reader judges the records as the watch did."""
        h = getattr(self.watch, "history", None) or {}
        self._line({"type": "header", **{k: v for k, v in h.items() if k not in ("series", "records", "events")}})

    def _line(self, obj: dict[str, Any]) -> None:
        self._write(json.dumps(json_safe(obj), allow_nan=False) + "\n")

    def step(self, t: int, loss: float, lr: float, grad_norm: float) -> None:
        self._line({"type": "step", "step": t, "loss": loss, "lr": lr, "grad_norm": grad_norm})

    def record(self, record: dict[str, Any], verdicts: list[dict[str, Any]]) -> None:
        self._line({"type": "record", **record, "verdicts": verdicts})
        self.f.flush()

    def event(self, event: Any) -> None:
        self._line({"type": "event", **event.to_dict()})
        self.f.flush()

    def alert(self, alert: Any) -> None:
        self._line({"type": "alert", **alert.to_dict()})
        self.f.flush()

    def forensics(self, report: dict[str, Any]) -> None:
        """The report in its own file, ``forensics/step_<t>.json`` beside this one (atomic), and a
        line here that names it."""
        path = self.path.parent / "forensics" / f"step_{int(report['step']):08d}.json"
        write_atomic(path, json.dumps(json_safe(report), indent=1, allow_nan=False))
        self._line({"type": "forensics", "step": report["step"], "path": str(path)})
        self.f.flush()


class TensorBoardWriter(WatchWriter):
    """TensorBoard scalars and text (see the module docstring) in ``log_dir``."""

    def __init__(self, log_dir: str | os.PathLike):
        if not tensorboard_available():
            raise ImportError('TensorBoard logging needs the tensorboard package: pip install "tinylm[tensorboard]" '
                              "(or pip install tensorboard)")
        self.log_dir = str(log_dir)
        self.w = None

    def open(self, watch: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=self.log_dir)

    def step(self, t: int, loss: float, lr: float, grad_norm: float) -> None:
        self.w.add_scalar("train/loss", loss, t)
        for tag, v in (("train/lr", lr), ("train/grad_norm", grad_norm)):
            if not math.isnan(v):
                self.w.add_scalar(tag, v, t)

    def record(self, record: dict[str, Any], verdicts: list[dict[str, Any]]) -> None:
        t = record["step"]
        add = self.w.add_scalar
        for site, st in record["stats"].items():
            add(f"watch/activation_var/{site}", st["fwd_var"], t)
            add(f"watch/gradient_var/{site}", st["grad_var"], t)
            add(f"watch/max_abs/{site}", st["fwd_absmax"], t)
        for name, r in (record.get("update_ratio") or {}).items():
            add(f"watch/update_ratio/{name}", r, t)
        for site, a in (record.get("attention") or {}).items():
            add(f"watch/attention_entropy/{site}", a["entropy_mean"], t)
        add("watch/not_ok", len(verdicts), t)
        from ..jobs.watch_precision import precision_scalars  # Watch(precision=...): per-GEMM SQNR

        for tag, v in precision_scalars(record).items():
            add(tag, v, t)
        if verdicts:
            text = "\n\n".join(f"{v['site']}: {v['verdict']} ({v['stat']} = {v['value']:.3g}, "
                               f"threshold {v['threshold']:.3g})" for v in verdicts)
            self.w.add_text("watch/verdicts", text, t)
        self.w.flush()

    def event(self, event: Any) -> None:
        self.w.add_text("watch/alarms", event.message, event.step)
        self.w.flush()

    def alert(self, alert: Any) -> None:
        self.w.add_text("watch/alerts", f"{alert.severity}: {alert.message}", alert.step)
        self.w.flush()

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
            self.w = None
