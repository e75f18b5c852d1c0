"""Mutation score of tinylm's tests, measured with mutmut 3 over tinylm's source files.

    OMP_NUM_THREADS=1 python benchmarks/mutation.py [--files functional.py config.py | --all] [--children 2] [--keep DIR]

mutmut (``pip install tinylm[mutation]``) rewrites each function of the chosen
files into many small variants (operators swapped, constants changed, arguments
dropped) and runs, for each variant, only the tests that called the mutated
function during a first full run of that file's tests (its per-function test
selection). A mutant is *killed* when one of those tests fails, *survives* when
all pass, and *times out* past mutmut's limit (counted as killed, as mutmut does).

Which tests a file is measured with (``SELECTION``, per source file):

* the numerics files (functional, layers, model, init): the property suite as
  ``tinylm props`` runs it against tinylm (``props/``, its ``tinylm_only`` tests
  included);
* the modules only tinylm has (config, validate, errors, checkpoint, data, train,
  plan, memory, reference): the ``tinylm_only`` contract properties written for
  that module (``props/test_<module>.py``) and the tests in ``tests/`` that own it.

Files with the same selection share one mutmut run. The work happens in a
scratch copy of the packages, ``tests/`` and the root ``conftest.py`` (mutmut
writes its ``mutants/`` folder there and reads its settings from a
``pyproject.toml`` of its own), so the repository is never touched. The script
prints, per file, killed / survived / timeout / no tests, the score
killed / (killed + survived) and the tests' time, the overall score, then every
survivor's name and diff, so that each can be classified in ``docs/mutation.md``:
killed by a new test, or equivalent (no input can tell it from the original) with
the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the property suite as ``tinylm props`` runs it against tinylm (its ``tinylm_only`` tests included)
PROPS = ("props",)

#: the tests each source file under tinylm/ is measured with
SELECTION: dict[str, tuple[str, ...]] = {
    "functional.py": PROPS,
    # the attention's switch between its explicit and fused paths is tinylm's own: its tests join the suite
    "layers.py": PROPS + ("tests/test_fastpath.py",),
    "model.py": PROPS,
    "init.py": PROPS,
    "config.py": ("props/test_config.py", "tests/test_validate.py"),
    "validate.py": ("props/test_config.py", "tests/test_validate.py"),
    "errors.py": ("props/test_config.py", "tests/test_validate.py"),
    # the command-line round trip starts a subprocess per mutant (minutes of the run) and kills nothing the
    # in-process tests do not
    "checkpoint.py": ("props/test_checkpoint.py", "tests/test_checkpoint.py", "--deselect",
                      "tests/test_checkpoint.py::test_cli_init_writes_a_checkpoint_load_reads_back_identically"),
    "data.py": ("props/test_data.py",),
    "train.py": ("props/test_train.py",),
    "plan.py": ("props/test_plan.py", "tests/test_plan.py"),
    "memory.py": ("props/test_memory.py",),
    "reference.py": ("props/test_reference.py",),
}

COPIED = ("tinylm", "props", "tests", "diagnostics", "reports")

CONFIG = """\
[tool.pytest.ini_options]
markers = ["slow: thorough variants", "prop: a property", "tinylm_only: tinylm's own contract",
           "distributed: spawns workers"]
addopts = "-m 'not slow' -p no:cacheprovider -p no:xdist"

[tool.mutmut]
source_paths = ["tinylm"]
only_mutate = [{only}]
pytest_add_cli_args_test_selection = [{tests}]
pytest_add_cli_args = ["-x", "-q", "-p", "no:randomly"]
also_copy = [{copy}]
use_git_change_detection = false
"""


def _quoted(items) -> str:
    return ", ".join(json.dumps(str(x)) for x in items)


def _scratch(work: Path, files: list[str], tests: tuple[str, ...]) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (work / name).exists():
            shutil.rmtree(work / name)
        shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    if (work / "mutants").exists():
        shutil.rmtree(work / "mutants")
    shutil.copy(ROOT / "conftest.py", work / "conftest.py")
    (work / "pyproject.toml").write_text(CONFIG.format(
        only=_quoted(f"tinylm/{f}" for f in files), tests=_quoted(tests),
        copy=_quoted([n for n in COPIED if n != "tinylm"] + ["conftest.py"])))
    return work


def _results(work: Path, env: dict) -> list[tuple[str, str]]:
    """(mutant name, status) for every mutant mutmut made."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work, env=env,
                         capture_output=True, text=True)
    rows = []
    for line in out.stdout.splitlines():
        m = re.match(r"\s*([\w.]+__mutmut_\d+):\s*(.+?)\s*$", line)
        if m:
            rows.append((m.group(1), m.group(2)))
    return rows


def _durations(work: Path, file: str) -> float:
    """Seconds the tests of every mutant of ``file`` ran (mutmut's own record; several at once)."""
    meta = work / "mutants" / "tinylm" / f"{file}.meta"
    try:
        return float(sum(v for v in json.loads(meta.read_text()).get("durations_by_key", {}).values() if v))
    except (OSError, ValueError):
        return float("nan")


def _run_group(work: Path, files: list[str], tests: tuple[str, ...], children: int) -> tuple[list, float]:
    _scratch(work, files, tests)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TINYLM_PROPS_NO_SHRINK="1",
               PYTHONPATH=str(work / "mutants"))
    env.pop("TINYLM_PROPS_IMPL", None)
    t0 = time.time()
    rows: list = []
    for attempt in range(2):  # mutmut 3.8's first stats pass right after generating mutants can fail; a rerun resumes
        run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(children)],
                             cwd=work, env=env, capture_output=True, text=True)
        (work / f"mutmut-run-{attempt}.log").write_text(run.stdout + run.stderr)
        rows = _results(work, env)
        if any(status != "not checked" for _, status in rows):
            break
    if not rows:
        print(f"mutmut produced no results for {', '.join(files)} (exit {run.returncode}); "
              f"logs in {work}/mutmut-run-*.log", file=sys.stderr)
        print((run.stdout + run.stderr)[-3000:], file=sys.stderr)
    return rows, time.time() - t0


def _diff(work: Path, name: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(work / "mutants"))
    for _ in range(3):  # mutmut show now and then prints nothing on a loaded machine; ask again
        diff = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, env=env,
                              capture_output=True, text=True).stdout
        body = [ln for ln in diff.splitlines() if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
        if body:
            return body
    return [f"(no diff: run `mutmut show {name}` in {work})"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", nargs="+", default=None, help="files under tinylm/ to mutate (default: functional.py)")
    ap.add_argument("--all", action="store_true", help="every file of SELECTION")
    ap.add_argument("--children", type=int, default=2, help="mutants run at once (mutmut --max-children)")
    ap.add_argument("--keep", default=None, help="scratch directory to use and keep (default: a fresh temporary one)")
    args = ap.parse_args(argv)
    files = list(SELECTION) if args.all else (args.files or ["functional.py"])
    for f in files:
        if f not in SELECTION:
            known = ", ".join(SELECTION)
            print(f"--files {f}: not a measured file under tinylm/; pass one of {known}", file=sys.stderr)
            return 2
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print("mutmut is not installed: pip install 'tinylm[mutation]' (mutmut>=3)", file=sys.stderr)
        return 2
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tinylm-mutmut-"))
    groups: dict[tuple[str, ...], list[str]] = {}
    for f in files:
        groups.setdefault(SELECTION[f], []).append(f)
    t_all = time.time()
    table = []  # (file, Counter, test seconds, group wall seconds)
    survivors: list[tuple[Path, str]] = []
    failed = False
    for n, (tests, group) in enumerate(groups.items()):
        work = base / f"group{n}-{group[0].removesuffix('.py')}"
        rows, wall = _run_group(work, group, tests, args.children)
        failed |= not rows
        print(f"mutmut over tinylm/{', tinylm/'.join(group)} with {' '.join(tests)}: {len(rows)} mutants in "
              f"{wall / 60:.1f} min ({args.children} at once); scratch copy {work}", flush=True)
        counts = {f: Counter() for f in group}
        for name, status in rows:
            module = name.split(".x")[0] if ".x" in name else name.rsplit(".", 1)[0]
            f = module.removeprefix("tinylm.") + ".py"
            counts.setdefault(f, Counter())[status] += 1
            if status == "survived":
                survivors.append((work, name))
        for f in group:
            table.append((f, counts[f], _durations(work, f), wall))
    total_wall = time.time() - t_all

    def score(c: Counter) -> str:
        killed = c["killed"] + c["timeout"]
        return f"{100 * killed / max(1, killed + c['survived']):.1f}%"

    print(f"\nmutation score per file (killed = killed + timeout; score = killed / (killed + survived)); "
          f"total {total_wall / 60:.1f} min")
    print(f"  {'file':16} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} {'no tests':>8} "
          f"{'score':>6} {'tests s':>8} {'group min':>9}")
    total = Counter()
    for f, c, secs, wall in table:
        total.update(c)
        print(f"  {f:16} {sum(c.values()):7d} {c['killed']:6d} {c['timeout']:7d} {c['survived']:8d} "
              f"{c['no tests']:8d} {score(c):>6} {secs:8.0f} {wall / 60:9.1f}")
        other = {k: v for k, v in c.items() if k not in ("killed", "timeout", "survived", "no tests")}
        if other:
            print(f"  {'':16} other: {other}")
    print(f"  {'all':16} {sum(total.values()):7d} {total['killed']:6d} {total['timeout']:7d} {total['survived']:8d} "
          f"{total['no tests']:8d} {score(total):>6}")
    print(f"survivors ({len(survivors)}):")
    for work, name in survivors:
        print(f"  {name}")
        for ln in _diff(work, name):
            print(f"      {ln.strip()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
