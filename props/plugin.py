"""The pytest plugin of the property suite: skips by missing function, collects what each property observed.

Registered by ``props/conftest.py`` (so ``pytest props`` and ``pytest --pyargs props``
both load it). For each test marked with :func:`props.record.prop` it

* skips the test, naming the functions, when the implementation under test
  (``TINYLM_PROPS_IMPL``, see :mod:`props.impl`) lacks one it needs;
* leaves out (deselects) every test marked ``tinylm_only`` when the implementation
  under test is not tinylm: those hold tinylm's own contract (its config, checkpoints,
  data, training loop, plan, memory estimate), which says nothing about a user's code;
* opens a :class:`props.record.PropertyLog` around the call and keeps it;
* writes every property's outcome, claim, examples, worst observation and
  tolerance as JSON to the file named by ``TINYLM_PROPS_RESULTS`` at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import pytest

from . import record as _record
from .impl import current

__all__ = ["PropsPlugin", "RESULTS_ENV", "PLUGIN_NAME", "TINYLM_ONLY"]

RESULTS_ENV = "TINYLM_PROPS_RESULTS"
PLUGIN_NAME = "tinylm-props"
#: the marker of a test about tinylm itself, left out when another implementation is under test
TINYLM_ONLY = "tinylm_only"


def _prop_name(item: pytest.Item) -> str:
    name = item.name
    return name[5:] if name.startswith("test_") else name


class PropsPlugin:
    """Collects one result row per property; see the module docstring."""

    def __init__(self, results_path: str | None = None) -> None:
        self.results_path = results_path
        self.rows: dict[str, dict[str, Any]] = {}
        self.started = time.perf_counter()

    def _row(self, item_or_report: Any) -> dict[str, Any]:
        return self.rows.setdefault(item_or_report.nodeid, {"nodeid": item_or_report.nodeid})

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if current().name == "tinylm":
            return
        dropped = [item for item in items if item.get_closest_marker(TINYLM_ONLY) is not None]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if item.get_closest_marker(TINYLM_ONLY) is None]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        marker = item.get_closest_marker("prop")
        row = self._row(item)
        row.update(name=_prop_name(item), module=item.module.__name__ if item.module else "", is_property=marker is not None)
        if marker is None:
            return
        row.update(claim=marker.kwargs.get("claim", ""), needs=list(marker.kwargs.get("needs", ())))
        impl = current()
        missing = impl.missing(tuple(marker.kwargs.get("needs", ())))
        if missing:
            pytest.skip(f"implementation {impl.name!r} provides no {', '.join(missing)}")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        _record.begin(_prop_name(item))
        try:
            yield
        finally:
            log = _record.end()
            if log is not None:
                row = self._row(item)
                row["examples"] = log.examples
                row["worst"] = asdict(log.worst) if log.worst is not None else None
                row["alpha"] = log.alpha

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        row = self._row(report)
        if report.when == "call" or (report.when == "setup" and not report.passed):
            row["duration"] = row.get("duration", 0.0) + report.duration
            if hasattr(report, "wasxfail"):
                row["outcome"] = "xfailed" if report.skipped else "xpassed"
                row["message"] = str(report.wasxfail)
            elif report.skipped:
                row["outcome"] = "skipped"
                lr = report.longrepr
                row["message"] = lr[2] if isinstance(lr, tuple) else str(lr)
            elif report.failed:
                row["outcome"] = "failed" if report.when == "call" else "error"
                crash = getattr(report.longrepr, "reprcrash", None)
                row["message"] = (crash.message if crash is not None else str(report.longrepr)).strip().splitlines()[0][:300]
            else:
                row["outcome"] = "passed"
        elif report.when == "teardown" and report.failed:
            row["outcome"] = "error"

    def payload(self) -> dict[str, Any]:
        impl = current()
        tinylm_mod = sys.modules.get("tinylm")
        from hypothesis import settings

        return {
            "impl": impl.name,
            "impl_source": impl.source,
            "tinylm_file": getattr(tinylm_mod, "__file__", None),
            "hypothesis_profile": getattr(settings, "_current_profile", None),
            "max_examples": settings.default.max_examples,
            "seconds": time.perf_counter() - self.started,
            "results": [r for r in self.rows.values() if "outcome" in r],
        }

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.results_path:
            tmp = self.results_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.payload(), f, indent=1, default=str)
            os.replace(tmp, self.results_path)
