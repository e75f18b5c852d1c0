"""A pytest plugin that reports the property suite's progress and each failure's example as it runs.

Loaded by :func:`props.runner.run_suite` (``-p props.live``) when the environment
variable ``TINYLM_PROPS_LIVE`` names a file: one JSON object per line is appended
and flushed, so the parent process can follow the run:

* ``{"event": "total", "total": N}`` once the tests are collected;
* ``{"event": "done", "nodeid", "name", "outcome", "example", "message"}`` per test,
  where ``example`` is hypothesis's minimal failing example (its "Falsifying example"
  or "Failing test case" note) and ``message`` the whole assertion message.
"""

from __future__ import annotations

import io
import json
import os
import re
from typing import Any

import pytest

__all__ = ["LIVE_ENV", "falsifying_example", "pytest_collection_finish", "pytest_runtest_logreport"]

LIVE_ENV = "TINYLM_PROPS_LIVE"

_MARKER = re.compile(r"^(?:Falsifying|Failing)(?: explicit)? (?:example|test case): ", re.M)
_DRAW = re.compile(r"^Draw \d+(?: \([^)]*\))?: (.*)$", re.M)


def falsifying_example(text: str) -> str:
    """Hypothesis's minimal example from a failure's text: ``test_x(\\n    z=...,\\n)`` reduced to
    ``z=..., c=...`` (empty when the text holds none)."""
    m = _MARKER.search(text or "")
    if m is None:
        return ""
    lines = [re.sub(r"\s+# .*$", "", line) for line in text[m.end():].splitlines()]
    lines = [line for line in lines if not line.strip().startswith("#")]
    call, body = lines[0] if lines else "", []
    if call.endswith("("):
        for line in lines[1:]:
            if line.strip() == ")":
                break
            body.append(line.strip())
        args = " ".join(body).rstrip(",")
    else:
        args = call[call.find("(") + 1:].rstrip(")") if "(" in call else call
    parts = [a for a in (p.strip() for p in re.split(r",\s(?=\w+=)", args)) if a and not a.startswith("impl=")]
    draws = _draws(text[m.end():])  # what st.data() drew, in order
    if draws:
        parts = [p for p in parts if p != "data=data(...)"] + [f"drew {d.strip()}" for d in draws]
    return ", ".join(parts)


def _draws(text: str) -> list[str]:
    """Hypothesis's "Draw N: value" notes (a value may span lines), each on one line."""
    out: list[str] = []
    for line in text.splitlines():
        m = _DRAW.match(line)
        if m:
            out.append(m.group(1).strip())
        elif out and line.strip() and not _MARKER.match(line):
            out[-1] += " " + line.strip()
        elif out and not line.strip():
            break
    return [re.sub(r"\s+", " ", d) for d in out]


#: the real ``open``, bound at import: a property may patch ``builtins.open`` (to test how a loader
#: handles unreadable files), and this plugin reports that property's outcome before its
#: monkeypatch is undone at teardown
_open = io.open


def _write(event: dict[str, Any]) -> None:
    path = os.environ.get(LIVE_ENV)
    if not path:
        return
    with _open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(event, default=str) + "\n")
        f.flush()


def pytest_collection_finish(session: pytest.Session) -> None:
    _write({"event": "total", "total": len(session.items)})


def _name(nodeid: str) -> str:
    name = nodeid.rpartition("::")[2]
    return name[5:] if name.startswith("test_") else name


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    done = report.when == "call" or (report.when == "setup" and not report.passed)
    if not done:
        return
    outcome = "failed" if report.failed and report.when == "call" else "error" if report.failed else report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
    _write({"event": "done", "nodeid": report.nodeid, "name": _name(report.nodeid), "outcome": outcome,
            "example": falsifying_example(message), "message": _headline(message)})


def _headline(message: str) -> str:
    """The assertion's own words: before hypothesis's notes, without the ``AssertionError:`` prefix."""
    head = _DRAW.split(_MARKER.split(message)[0])[0].strip()
    head = head[len("AssertionError: "):] if head.startswith("AssertionError: ") else head
    kept = []
    for line in head.splitlines():  # pytest's rewritten-assert introspection and hypothesis's notes add nothing
        if line.startswith(("assert ", " +", "(note:")):
            break
        kept.append(line.strip())
    return " ".join(kept)
