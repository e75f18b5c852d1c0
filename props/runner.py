"""Run the property suite in a pytest subprocess and read back one result per property.

``run_suite()`` is what ``tinylm props`` calls: it runs ``python -m pytest <props>``
with ``TINYLM_PROPS_RESULTS`` pointing at a temporary file (written by
:class:`props.plugin.PropsPlugin`) and ``TINYLM_PROPS_IMPL`` naming the
implementation, then returns a :class:`SuiteRun`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .impl import ENV_VAR, load
from .live import LIVE_ENV
from .plugin import RESULTS_ENV

__all__ = ["PropertyResult", "SuiteRun", "run_suite", "PROPS_DIR", "read_results"]

PROPS_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class PropertyResult:
    """One property's row: what it claims and what the run observed."""

    name: str
    module: str
    claim: str
    outcome: str  # passed, failed, error, skipped, xfailed, xpassed
    examples: int = 0
    observed: float | None = None
    tolerance: float | None = None
    kind: str = ""
    alpha: float | None = None
    message: str = ""
    nodeid: str = ""
    example: str = ""  # hypothesis's minimal failing example (arguments), for a failed property
    missing: tuple[str, ...] = ()  # for a skip: what the implementation lacks (a function, or "f(arg)")

    @property
    def ok(self) -> bool:
        return self.outcome in ("passed", "skipped", "xfailed")

    @property
    def lacks(self) -> str:
        """What a skipped property waits for, as one label (``rmsnorm``, ``cross_entropy(label_smoothing)``)."""
        return ", ".join(self.missing) if self.missing else (self.message or "skipped")

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "PropertyResult":
        worst = row.get("worst") or {}
        return cls(
            name=row.get("name", row.get("nodeid", "?")),
            module=str(row.get("module", "")).rpartition(".")[2],
            claim=row.get("claim", ""),
            outcome=row.get("outcome", "error"),
            examples=int(row.get("examples") or 0),
            observed=worst.get("observed"),
            tolerance=worst.get("tolerance"),
            kind=worst.get("kind", ""),
            alpha=row.get("alpha"),
            message=row.get("message", "") or "",
            nodeid=row.get("nodeid", ""),
            example=row.get("example", "") or "",
            missing=missing_of(row.get("message", "") or "") if row.get("outcome") == "skipped" else (),
        )


_PROVIDES_NO = re.compile(r"provides no (.+)$")
_TAKES_NO = re.compile(r"(\w+)\([^)]*\) takes no (\w+) argument")


def missing_of(message: str) -> tuple[str, ...]:
    """From a skip's reason, what the implementation lacks: the functions of "provides no a, b",
    or ``f(arg)`` for a signature without an argument a property passes."""
    if m := _TAKES_NO.search(message):
        return (f"{m.group(1)}({m.group(2)})",)
    if m := _PROVIDES_NO.search(message.strip()):
        return tuple(sorted(x.strip() for x in m.group(1).split(",")))
    return ()


@dataclass
class SuiteRun:
    """The outcome of one run of the suite."""

    results: list[PropertyResult]
    seconds: float
    returncode: int
    impl: str = "tinylm"
    impl_source: str | None = None
    tinylm_file: str | None = None
    profile: str | None = None
    max_examples: int | None = None
    output_tail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[PropertyResult]:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        """True when pytest succeeded and no property failed."""
        return self.returncode == 0 and not self.failed and bool(self.results)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.outcome] = out.get(r.outcome, 0) + 1
        return out


def read_results(path: str | os.PathLike, returncode: int, seconds: float, output_tail: str = "",
                 live: str | os.PathLike | None = None) -> SuiteRun:
    """Build a :class:`SuiteRun` from the plugin's JSON file (an empty run if the file is missing);
    ``live``: the file :mod:`props.live` wrote, whose failing examples and whole messages are added."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        data = {}
    details = {e["nodeid"]: e for e in _read_live(live) if e.get("event") == "done"} if live else {}
    rows = []
    for row in data.get("results", []):
        extra = details.get(row.get("nodeid"), {})
        if extra.get("example"):
            row = {**row, "example": extra["example"]}
        if extra.get("message") and row.get("outcome") in ("failed", "error"):
            row = {**row, "message": extra["message"]}
        rows.append(row)
    return SuiteRun(
        results=[PropertyResult.from_row(r) for r in rows],
        seconds=seconds,
        returncode=returncode,
        impl=data.get("impl", "?"),
        impl_source=data.get("impl_source"),
        tinylm_file=data.get("tinylm_file"),
        profile=data.get("hypothesis_profile"),
        max_examples=data.get("max_examples"),
        output_tail=output_tail,
    )


def _read_live(path: str | os.PathLike, start: int = 0) -> list[dict[str, Any]]:
    """The complete JSON lines of the live file from byte ``start`` (a line still being written is left)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            chunk = f.read()
    except OSError:
        return []
    events = []
    for line in chunk.split(b"\n")[:-1]:
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events


#: ``on_progress(done, total, name, outcome)``: called after each property (total 0 until collected)
Progress = Callable[[int, int, str, str], None]


def run_suite(
    impl: str | None = None,
    *,
    select: str | None = None,
    profile: str | None = None,
    slow: bool = False,
    props_dir: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
    timeout: float | None = None,
    on_progress: Progress | None = None,
) -> SuiteRun:
    """Run the property suite in a subprocess; see the module docstring.

    impl: "package.module:object", "path/to/file.py:object" (None = tinylm), validated here first;
    a module is found on sys.path or in the current directory (see :func:`props.impl.load`).
    select: a pytest ``-k`` expression. profile: hypothesis profile ("ci", "thorough").
    slow: also run properties marked slow. on_progress: called as each property finishes.
    """
    shown = impl
    if impl is not None:
        impl = load(impl).spec  # a clear error now rather than a failing subprocess; the spec as resolved
    target = Path(props_dir) if props_dir is not None else PROPS_DIR
    with tempfile.TemporaryDirectory(prefix="tinylm-props-") as tmp:
        results = os.path.join(tmp, "results.json")
        live = os.path.join(tmp, "live.jsonl")
        run_env = dict(os.environ if env is None else env)
        run_env[RESULTS_ENV] = results
        run_env[LIVE_ENV] = live
        if impl:
            run_env[ENV_VAR] = impl
        else:
            run_env.pop(ENV_VAR, None)
        if profile:
            run_env["HYPOTHESIS_PROFILE"] = profile
        cmd = [sys.executable, "-m", "pytest", str(target), "-q", "-p", "no:cacheprovider", "--no-header", "-rN",
               "-p", "props.live"]
        cmd += ["-m", "" if slow else "not slow"]
        if select:
            cmd += ["-k", select]
        cmd += list(extra_args)
        t0 = time.perf_counter()
        with tempfile.TemporaryFile(mode="w+") as log:
            proc = subprocess.Popen(cmd, cwd=cwd, env=run_env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                    stdin=subprocess.DEVNULL)
            code = _follow(proc, live, on_progress, timeout, t0)
            log.seek(0)
            out = log.read()
        if code == -9:
            out = f"timed out after {timeout} s\n" + out
        seconds = time.perf_counter() - t0
        tail = "\n".join(out.strip().splitlines()[-15:])
        run = read_results(results, code, seconds, tail, live=live)
        if shown:
            run.impl = shown  # as the user named it (the subprocess may have loaded it by its file)
        return run


def _follow(proc: subprocess.Popen, live: str, on_progress: Progress | None, timeout: float | None,
            t0: float) -> int:
    """Wait for ``proc``, calling ``on_progress`` as the live file grows; -9 after ``timeout`` seconds."""
    offset, done, total = 0, 0, 0
    while True:
        try:
            code = proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            code = None
        if on_progress is not None and os.path.exists(live):
            size = os.path.getsize(live)
            if size > offset:
                with open(live, "rb") as f:
                    f.seek(offset)
                    chunk = f.read(size - offset)
                complete = chunk[:chunk.rfind(b"\n") + 1]
                offset += len(complete)
                for line in complete.splitlines():
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if event.get("event") == "total":
                        total = int(event.get("total") or 0)
                        on_progress(done, total, "", "")
                    elif event.get("event") == "done":
                        done += 1
                        on_progress(done, total, str(event.get("name", "")), str(event.get("outcome", "")))
        if code is not None:
            return code
        if timeout is not None and time.perf_counter() - t0 > timeout:
            proc.kill()
            proc.wait()
            return -9
