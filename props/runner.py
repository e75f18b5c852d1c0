"""Run the property suite in a pytest subprocess and read back one result per property.

``run_suite()`` is what ``tinylm props`` calls: it runs ``python -m pytest <props>``
with ``TINYLM_PROPS_RESULTS`` pointing at a temporary file (written by
:class:`props.plugin.PropsPlugin`) and ``TINYLM_PROPS_IMPL`` naming the
implementation, then returns a :class:`SuiteRun`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .impl import ENV_VAR, load
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

    @property
    def ok(self) -> bool:
        return self.outcome in ("passed", "skipped", "xfailed")

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
        )


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


def read_results(path: str | os.PathLike, returncode: int, seconds: float, output_tail: str = "") -> SuiteRun:
    """Build a :class:`SuiteRun` from the plugin's JSON file (an empty run if the file is missing)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        data = {}
    return SuiteRun(
        results=[PropertyResult.from_row(r) for r in data.get("results", [])],
        seconds=seconds,
        returncode=returncode,
        impl=data.get("impl", "?"),
        impl_source=data.get("impl_source"),
        tinylm_file=data.get("tinylm_file"),
        profile=data.get("hypothesis_profile"),
        max_examples=data.get("max_examples"),
        output_tail=output_tail,
    )


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
) -> SuiteRun:
    """Run the property suite in a subprocess; see the module docstring.

    impl: "package.module:object" (None = tinylm), validated here first.
    select: a pytest ``-k`` expression. profile: hypothesis profile ("ci", "thorough").
    slow: also run properties marked slow.
    """
    if impl is not None:
        load(impl)  # a clear error now rather than a failing subprocess
    target = Path(props_dir) if props_dir is not None else PROPS_DIR
    with tempfile.TemporaryDirectory(prefix="tinylm-props-") as tmp:
        results = os.path.join(tmp, "results.json")
        run_env = dict(os.environ if env is None else env)
        run_env[RESULTS_ENV] = results
        if impl:
            run_env[ENV_VAR] = impl
        else:
            run_env.pop(ENV_VAR, None)
        if profile:
            run_env["HYPOTHESIS_PROFILE"] = profile
        cmd = [sys.executable, "-m", "pytest", str(target), "-q", "-p", "no:cacheprovider", "--no-header", "-rN"]
        cmd += ["-m", "" if slow else "not slow"]
        if select:
            cmd += ["-k", select]
        cmd += list(extra_args)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=cwd, env=run_env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            code = -9
            out = f"timed out after {timeout} s\n" + ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
        seconds = time.perf_counter() - t0
        tail = "\n".join(out.strip().splitlines()[-15:])
        return read_results(results, code, seconds, tail)
