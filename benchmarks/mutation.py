"""Mutation score of the property suite, measured with mutmut 3 over tinylm's source files.

    OMP_NUM_THREADS=1 python benchmarks/mutation.py [--files functional.py init.py] [--children 2] [--keep DIR]

mutmut (``pip install tinylm[mutation]``) rewrites each function of the chosen
files into many small variants (operators swapped, constants changed, arguments
dropped) and runs, for each variant, only the properties that called the
mutated function during a first full run of the suite (its per-function test
selection). A mutant is *killed* when one of those properties fails, *survives*
when all pass, and *times out* past mutmut's limit (15x the tests' own time;
counted as killed, as mutmut does).

The work happens in a scratch copy of ``tinylm/``, ``props/`` and the root
``conftest.py`` (mutmut writes its ``mutants/`` folder there and reads its
settings from a ``pyproject.toml`` of its own), so the repository is never
touched. The script prints, per file, killed / survived / timeout / other and
the score killed / (killed + survived), then every survivor's name and diff, so
that each can be classified: killed by a new property, or equivalent (no input
can tell it from the original) with the reason, in ``docs/mutation.md``.
"""

from __future__ import annotations

import argparse
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

CONFIG = """\
[tool.pytest.ini_options]
testpaths = ["props"]
markers = ["slow: thorough variants", "prop: a property"]
addopts = "-m 'not slow' -p no:cacheprovider -p no:xdist"

[tool.mutmut]
source_paths = ["tinylm"]
only_mutate = [{only}]
pytest_add_cli_args_test_selection = ["props"]
pytest_add_cli_args = ["-x", "-q", "-p", "no:randomly"]
also_copy = ["props", "conftest.py"]
use_git_change_detection = false
"""


def _scratch(files: list[str], keep: str | None) -> Path:
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="tinylm-mutmut-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in ("tinylm", "props"):
        if (work / name).exists():
            shutil.rmtree(work / name)
        shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "conftest.py", work / "conftest.py")
    only = ", ".join(f'"tinylm/{f}"' for f in files)
    (work / "pyproject.toml").write_text(CONFIG.format(only=only))
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", nargs="+", default=["functional.py"], help="files under tinylm/ to mutate")
    ap.add_argument("--children", type=int, default=2, help="mutants run at once (mutmut --max-children)")
    ap.add_argument("--keep", default=None, help="scratch directory to use and keep (default: a fresh temporary one)")
    args = ap.parse_args(argv)
    for f in args.files:
        if not (ROOT / "tinylm" / f).is_file():
            print(f"--files {f}: no such file under tinylm/; pass a name such as functional.py", file=sys.stderr)
            return 2
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print("mutmut is not installed: pip install 'tinylm[mutation]' (mutmut>=3)", file=sys.stderr)
        return 2
    work = _scratch(args.files, args.keep)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TINYLM_PROPS_NO_SHRINK="1",
               PYTHONPATH=str(work / "mutants"))
    t0 = time.time()
    for attempt in range(2):  # mutmut 3.8's first stats pass right after generating mutants can fail; a rerun resumes
        run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.children)],
                             cwd=work, env=env, capture_output=True, text=True)
        (work / f"mutmut-run-{attempt}.log").write_text(run.stdout + run.stderr)
        rows = _results(work, env)
        if any(status != "not checked" for _, status in rows):
            break
    seconds = time.time() - t0
    if not rows:
        print(f"mutmut produced no results (exit {run.returncode}); logs in {work}/mutmut-run-*.log", file=sys.stderr)
        print((run.stdout + run.stderr)[-3000:], file=sys.stderr)
        return 1
    print(f"mutmut over tinylm/{', tinylm/'.join(args.files)}: {len(rows)} mutants in {seconds / 60:.1f} min "
          f"({args.children} at once); scratch copy {work}")
    by_file: dict[str, Counter] = {}
    survivors = []
    for name, status in rows:
        module = name.split(".x")[0] if ".x" in name else name.rsplit(".", 1)[0]
        by_file.setdefault(module, Counter())[status] += 1
        if status == "survived":
            survivors.append(name)
    for module, c in sorted(by_file.items()):
        killed = c["killed"] + c["timeout"]
        score = killed / max(1, killed + c["survived"])
        other = {k: v for k, v in c.items() if k not in ("killed", "timeout", "survived")}
        print(f"  {module}: killed {c['killed']}, timeout {c['timeout']}, survived {c['survived']}, "
              f"other {other or 0}; score {100 * score:.1f}%")
    print(f"survivors ({len(survivors)}):")
    for name in survivors:
        diff = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, env=env,
                              capture_output=True, text=True).stdout
        body = [ln for ln in diff.splitlines() if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
        print(f"  {name}")
        for ln in body:
            print(f"      {ln.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
