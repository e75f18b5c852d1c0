"""Reading back what a watch wrote: a log dir (its ``watch.jsonl`` and ``forensics/``), a history
JSON (``write_json``, ``tinylm train --watch-json``) or a tinylm checkpoint, as a
:class:`~diagnostics.jobs.history.History` with the run's alerts, events and forensics.

The JSONL file is the source (:class:`~diagnostics.integrations.writers.JSONLWriter`): its header
line (sites, norm, kinds, model, thresholds), then steps, records, events, alerts and the names
of the forensics reports, in the order the watch saw them. Reading never raises on what a run
left behind:

* a last line cut short (the run was killed while writing it) is skipped and said;
* a damaged line anywhere else (not JSON, or not of the documented shape) is skipped and said,
  with its line number;
* a forensics report that is missing or does not read is said, and the rest is read.

A history JSON or a checkpoint keeps the records and alarms but not the alerts: those are
replayed from the records as the watch reported them (:mod:`diagnostics.jobs.history_replay`).

What is said is in ``History.notes``. A source that cannot be a watch's (no such path, a dir
without ``watch.jsonl``, another format) raises :class:`diagnostics.OptionsError` with one line
that says what to pass.

:class:`LogReader` reads a growing file: each :meth:`LogReader.poll` takes the complete lines
added since the last one (a line still being written waits for its newline), so a live view
redraws as records arrive from another process.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import OptionsError
from ..judge.precursors import Alert
from .history import FORMAT, VERSION, History, _record_problem, check_history

__all__ = ["read", "LogReader", "JSONL", "numbers"]

JSONL = "watch.jsonl"
_FIX = ("pass a log dir a Watch(log_dir=...) or a watch callback wrote, its watch.jsonl, a history JSON "
        "(as write_json writes it) or a tinylm checkpoint")
_ALERT_FIELDS = tuple(f.name for f in fields(Alert))
_HEADER_KEYS = ("format", "version", "watch_every", "spike_factor", "sites", "norm", "kinds", "model",
                "thresholds", "param_dims")


def numbers(x: Any) -> Any:
    """``x`` with JSON's stand-ins for non-finite floats made floats again (the inverse of
    :func:`diagnostics.integrations.writers.json_safe` on numbers): null as NaN, "inf" / "-inf" as
    infinities; dicts and lists converted all the way down, other strings kept."""
    if x is None:
        return math.nan
    if isinstance(x, str):
        return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}.get(x, x)
    if isinstance(x, dict):
        return {k: numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [numbers(v) for v in x]
    return x


def _number(x: Any) -> float:
    x = numbers(x)
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def _record(obj: dict[str, Any]) -> dict[str, Any]:
    """A record line as the history's record: numbers restored; reason and dtypes kept as written."""
    rec = {k: v for k, v in obj.items() if k not in ("type", "verdicts")}
    out = {k: (v if k in ("reason", "dtypes", "step") else numbers(v)) for k, v in rec.items()}
    return out


def _alert(obj: dict[str, Any]) -> Alert:
    kw = {k: obj.get(k) for k in _ALERT_FIELDS}
    kw["value"], kw["threshold"] = _number(kw["value"]), _number(kw["threshold"])
    kw["rising"] = int(kw["rising"] or 0)
    for k in ("cause", "fix", "ruled_out", "message", "signal", "severity"):
        kw[k] = "" if kw[k] is None else str(kw[k])
    if not isinstance(kw["step"], int):
        raise ValueError("its step is not an integer")
    return Alert(**kw)


class LogReader:
    """A watch's JSONL file read line by line, as it grows (module docstring).

    Args:
        path: the ``watch.jsonl`` file.
        folder: where ``forensics/`` is looked for (None: the file's folder).
    """

    def __init__(self, path: str | os.PathLike, folder: str | os.PathLike | None = None):
        self.path = Path(path)
        self.folder = Path(folder) if folder is not None else self.path.parent
        self.header: dict[str, Any] | None = None
        self.series: dict[str, list] = {"step": [], "loss": [], "lr": [], "grad_norm": []}
        self.records: list[dict[str, Any]] = []
        self.stored_verdicts: list[dict[str, Any]] = []  # the verdicts each record line carried
        self.events: list[dict[str, Any]] = []
        self.alerts: list[Alert] = []
        self.forensics: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self._offset = 0
        self._line_no = 0
        self._tail = b""

    def poll(self) -> int:
        """Read the complete lines added since the last call; returns how many were read."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError as e:
            raise OptionsError(f"{self.path}: cannot be read ({e.strerror or e}); {_FIX}") from None
        self._offset += len(chunk)
        data = self._tail + chunk
        *lines, self._tail = data.split(b"\n")
        for raw in lines:
            self._line_no += 1
            self._take(raw, self._line_no)
        return len(lines)

    def finish(self) -> None:
        """The end of the file: a last line without its newline is read if it is whole, else said."""
        if not self._tail.strip():
            return
        raw, self._tail = self._tail, b""
        self._line_no += 1
        try:
            json.loads(raw)
        except ValueError:
            self.notes.append(f"line {self._line_no} (the last) is cut short, {len(raw)} bytes: the run stopped "
                              "while writing it; skipped")
            return
        self._take(raw, self._line_no)

    def _take(self, raw: bytes, n: int) -> None:
        if not raw.strip():
            return
        try:
            obj = json.loads(raw)
            why = self._add(obj)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            why = f"not JSON ({e.__class__.__name__})" if isinstance(e, json.JSONDecodeError) else f"unreadable ({e})"
        if why:
            self.notes.append(f"line {n} is damaged ({why}): skipped")

    def _add(self, obj: Any) -> str | None:
        """Take one parsed line; returns what is wrong with it (None: taken)."""
        if not isinstance(obj, dict):
            return "not an object"
        kind = obj.get("type")
        if kind == "header":
            return self._take_header(obj)
        if kind == "step":
            if not isinstance(obj.get("step"), int):
                return "a step without an integer step"
            self.series["step"].append(obj["step"])
            for k in ("loss", "lr", "grad_norm"):
                self.series[k].append(_number(obj.get(k)))
        elif kind == "record":
            rec = _record(obj)
            why = _record_problem(rec, "the record")
            if why:
                return why
            self.records.append(rec)
            self.stored_verdicts += [numbers(v) | {"site": v.get("site"), "verdict": v.get("verdict"),
                                                   "stat": v.get("stat")} for v in obj.get("verdicts") or []]
        elif kind == "event":
            self.events.append({k: obj.get(k) for k in ("step", "kind", "site", "stat", "moved_at", "message")})
        elif kind == "alert":
            self.alerts.append(_alert(obj))
        elif kind == "forensics":
            self._take_forensics(obj)
        else:
            return f"unknown type {kind!r}"
        return None

    def _take_header(self, obj: dict[str, Any]) -> str | None:
        header = {k: obj[k] for k in _HEADER_KEYS if k in obj}
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise OptionsError(f"{self.path}: its header says format {header.get('format')!r} version "
                               f"{header.get('version')!r}; this tinylm reads {FORMAT!r} version {VERSION}")
        if self.header is None:  # a resumed run appends to the file: its first header stands
            self.header = header
        return None

    def _take_forensics(self, obj: dict[str, Any]) -> None:
        step, written = obj.get("step"), str(obj.get("path") or "")
        candidates = [self.folder / "forensics" / Path(written).name, Path(written)]
        found = next((p for p in candidates if written and p.is_file()), None)
        if found is None:
            self.notes.append(f"the forensics of step {step} ({written}) are missing")
            return
        try:
            report = numbers(json.loads(found.read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            self.notes.append(f"the forensics of step {step} ({found}) do not read ({e.__class__.__name__}): skipped")
            return
        if isinstance(report, dict):
            report["path"] = str(found)
            self.forensics.append(report)

    def history(self) -> History:
        """What was read so far, as a :class:`History` (with ``alerts``, ``forensics``, ``notes``)."""
        header = dict(self.header or {})
        if self.header is None:
            sites = list(dict.fromkeys(s for rec in self.records for s in rec["stats"]))
            header = {"format": FORMAT, "version": VERSION, "sites": sites, "norm": None}
            if self.records or self.series["step"]:
                self.notes.append("no header line (an older writer): the model's norm placement and the watch's "
                                  "thresholds are unknown; judged with the defaults, the residual stream included")
        data = {**header, "series": self.series, "records": self.records, "events": self.events}
        data.setdefault("watch_every", None)
        h = History(data)
        h.alerts, h.forensics, h.notes = list(self.alerts), list(self.forensics), list(self.notes)
        h.stored_verdicts = list(self.stored_verdicts)
        h.source = str(self.path)
        return h


def _from_file(path: Path) -> History:
    """A history JSON or a tinylm checkpoint with a history."""
    if path.suffix.lower() in (".pt", ".pth", ".ckpt"):
        import torch

        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is one line to the user
            raise OptionsError(f"{path}: not a checkpoint torch reads ({e.__class__.__name__}); {_FIX}") from None
        data = blob.get("history") if isinstance(blob, dict) else None
        if data is None:
            raise OptionsError(f"{path}: this checkpoint holds no watch history; {_FIX}")
    else:
        try:
            data = numbers(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise OptionsError(f"{path}: not a history JSON ({e.__class__.__name__}); {_FIX}") from None
    data = {**data, "series": {k: [int(t) for t in v] if k == "step" else v
                               for k, v in (data.get("series") or {}).items()}} if isinstance(data, dict) else data
    checked, why = check_history(data)
    if checked is None:
        raise OptionsError(f"{path}: not a watch history ({why or 'empty'}); {_FIX}")
    from .history_replay import replay_alerts

    h = History(checked)
    h.source = str(path)
    h.alerts = replay_alerts(checked, h.thresholds)  # the file keeps the records, not the alerts
    h.notes.append("alerts replayed from the records (a history JSON or checkpoint stores none)")
    return h


def read(source: str | os.PathLike) -> History:
    """The run a watch wrote at ``source`` (a log dir, its ``watch.jsonl``, a history JSON or a
    checkpoint), as a :class:`History` whose ``alerts``, ``forensics`` and ``notes`` hold what the
    files held and what reading them found (module docstring). Raises
    :class:`diagnostics.OptionsError` (one line) when ``source`` is not a watch's."""
    path = Path(os.fspath(source))
    if not path.exists():
        raise OptionsError(f"{path}: no such file or directory; {_FIX}")
    if path.is_dir():
        if not (path / JSONL).is_file():
            has_csv = (path / "watch.csv").is_file()
            raise OptionsError(f"{path}: no {JSONL} here{' (only watch.csv, which lacks the alerts)' if has_csv else ''}; "
                               f"{_FIX}")
        path = path / JSONL
    if path.suffix.lower() != ".jsonl":
        return _from_file(path)
    reader = LogReader(path)
    reader.poll()
    reader.finish()
    if reader.header is None and not reader.records and not reader.series["step"]:
        raise OptionsError(f"{path}: holds no watch line (no header, step or record); {_FIX}")
    return reader.history()

