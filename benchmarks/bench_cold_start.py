"""Cold start: the first probed step of a fresh process with nothing cached, against a warm one.

    python benchmarks/bench_cold_start.py [--threads 1] [--steps 3]

Each arm is a fresh Python process that builds the launch-bound model of
``bench_launch.py`` and times its first ``--steps`` probed forward+backward passes (imports
and model building excluded): "cold" with an empty ``NUMBA_CACHE_DIR`` (a fresh install:
numba has compiled nothing), "warm" with the cache the cold arm's background process filled
(every entry point the cache check asks for: ``serial_at``, ``parallel_at``, ``many_at``).
The first cold pass measures with torch ops while numba compiles in another process
(:func:`diagnostics.measure.numba_reducer.ready`); target: first cold pass - first warm pass <= 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
sys.path.insert(0, {bench!r})
import torch
torch.set_num_threads({threads})
import bench_launch as b
nets, tokens = b.models()
model = nets["tinylm"]
times = []
for _ in range({steps}):
    t0 = time.perf_counter()
    b.probed(model, tokens)
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""


def child(cache: str, threads: int, steps: int) -> list[float]:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop("TINYLM_REDUCER", None)
    out = subprocess.run([sys.executable, "-c", CHILD.format(bench=here, threads=threads, steps=steps)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        cold = child(cache, args.threads, args.steps)
        deadline = time.time() + 600  # the background compile of the cold arm fills the cache
        while time.time() < deadline and not all(any(f.endswith(".nbi") and name in f
                                                     for _, _, files in os.walk(cache) for f in files)
                                                 for name in ("serial_at", "parallel_at", "many_at")):
            time.sleep(1)
        time.sleep(5)
        warm = child(cache, args.threads, args.steps)
    print(f"threads {args.threads}, load {os.getloadavg()[0]:.1f}")
    print("cold (empty NUMBA_CACHE_DIR): " + ", ".join(f"{t:.2f}" for t in cold) + " s")
    print("warm:                         " + ", ".join(f"{t:.2f}" for t in warm) + " s")
    print(f"first pass cold - warm: {cold[0] - warm[0]:+.2f} s (target <= 2 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
