"""How long a user waits for a usage error, against how long importing torch takes.

Two arms, interleaved, each a fresh interpreter (as a shell runs the command):

* ``error``: ``tinylm diagnose --plot r.txt`` (a bad output suffix, refused before any work);
* ``torch``: ``python -c "import torch"``, the floor any command that imports torch pays.

Prints the median wall time of each arm with its interquartile range and the ratio of the
medians (with the spread of per-pair ratios). The target: a usage error in well under
0.5 s, a small fraction of the torch import.

    OMP_NUM_THREADS=1 python benchmarks/bench_cli_errors.py --repeats 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "error": [sys.executable, "-c", "import sys; from reports.cli import main; sys.exit(main(['diagnose', '--plot', 'r.txt']))"],
    "torch": [sys.executable, "-c", "import torch"],
}


def _time(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):  # interleaved: both arms see the same machine load
        for arm, cmd in ARMS.items():
            times[arm].append(_time(cmd, env))
    print(f"python {sys.version.split()[0]}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
          f"{os.cpu_count()} CPUs; {args.repeats} interleaved repeats")
    for arm, xs in times.items():
        lo, med, hi = _quartiles(xs)
        print(f"{arm:>5}: median {med * 1000:.0f} ms (IQR {lo * 1000:.0f}-{hi * 1000:.0f} ms)")
    ratios = [e / t for e, t in zip(times["error"], times["torch"])]
    lo, med, hi = _quartiles(ratios)
    print(f"error / torch import: {med:.2f} (IQR {lo:.2f}-{hi:.2f} over pairs)")


if __name__ == "__main__":
    main()
