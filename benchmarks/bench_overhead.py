"""Overhead of the probe: forward+backward of the tinystories preset, bare versus probed.

    python benchmarks/bench_overhead.py [--device cpu|cuda] [--batch 4] [--seq 256] [--repeats 15] [--threads N]
                                        [--torch-path] [--compiled] [--breakdown 5]

Both run in this one process on the same model and batch, after one warm-up each, in
``--repeats`` pairs (bare then probed, or probed then bare, by a seeded coin). On a shared
machine whose speed drifts by tens of percent within a minute, the headline is the median
over pairs of probed/bare within a pair (target <= 1.10); the ratio of the medians and the
ratio of the fastest runs are printed beside it. On a virtual machine the drift is mostly
*steal*: time the hypervisor gives the CPUs to other guests (the steal column of
/proc/stat). Each pass records the steal over its
duration; the headline is taken over the *quiet* pairs, those whose two passes each lost at
most ``--max-steal`` ms, when there are at least 5 of them (the median over all pairs is
printed beside it, and how many were quiet). The process's CPU time (all threads; steal is
not CPU time) gives a second within-pair ratio that the hypervisor cannot move. And the
probe times its own work (``run.seconds``: its hooks with their reductions, its exit work):
1 + that time over the bare pass of the same pair estimates the ratio from what the probe
itself spends, free of the drift between the two passes (it cannot see what the probe costs
torch indirectly, e.g. through the caches). ``--breakdown`` more probed passes then time
the numba reducer's calls apart, to split the probe's own time into the numba reducer and the
rest. The probe reduces CPU tensors with the numba reducer (diagnostics/measure/numba_reducer.py,
as many threads as torch) and GPU tensors (``--device cuda``; a CPU without numba too) with the
compiled reducer (diagnostics/measure/compiled.py, torch.compile; compiled during the warm-up
pass, whose time is printed; ``--compiled`` sends CPU tensors there too);
with ``--torch-path`` a third arm, alternating with the other two, probes with plain torch ops
instead (``TINYLM_REDUCER=reference``), so the gain of the numba or compiled reducer is measured too. On a GPU every
pass ends with ``torch.cuda.synchronize()`` inside its timing. Peak
memory: torch's CPU allocator is invisible to tracemalloc, so each kind of pass runs
in a fresh child process that samples its resident set size (/proc/self/statm) every
millisecond during one pass, after a warm-up pass; the figure is the peak growth over
the resident size before the pass (on a GPU: torch's peak of allocated device memory over
what was allocated before the pass). Linux only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time


def _model_and_batch(batch: int, seq: int, device: str = "cpu"):
    import torch

    import tinylm

    config = tinylm.preset("tinystories")
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0)).to(device)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return model, tokens.to(device)


def _step(model, tokens) -> None:
    import tinylm

    loss = tinylm.functional.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    model.zero_grad(set_to_none=True)
    if tokens.is_cuda:  # the pass is over when the device is done
        import torch

        torch.cuda.synchronize()


#: TINYLM_REDUCER for the probed arm: "auto" (the reducer chosen by device) or "compiled" (--compiled)
_REDUCER = "auto"


def _probed(model, tokens, reference: bool = False) -> float:
    """One probed pass; returns the seconds spent in the probe's own work (run.seconds and the
    conversion of its results)."""
    from diagnostics import probe

    os.environ["TINYLM_REDUCER"] = "reference" if reference else _REDUCER

    with probe(model) as run:
        _step(model, tokens)
    t = time.perf_counter()
    run.stats  # the one conversion to Python floats (one device sync) belongs to the cost
    return run.seconds + time.perf_counter() - t


def _breakdown(model, tokens, passes: int) -> tuple[float, float, int]:
    """(numba reducer seconds, the probe's own seconds, numba reducer calls) per probed pass, medians
    over ``passes`` passes run after the timed pairs, with ``diagnostics.measure.numba_reducer._run``
    (every call into the numba loops) wrapped in a timer; the wrapper's own cost lands in the numba
    reducer's share."""
    from diagnostics.measure import numba_reducer

    real, spent = numba_reducer._run, []

    def timed(*args):
        t = time.perf_counter()
        try:
            return real(*args)
        finally:
            spent.append(time.perf_counter() - t)

    reducer, own, calls = [], [], []
    numba_reducer._run = timed
    try:
        for _ in range(passes):
            spent.clear()
            own.append(_probed(model, tokens))
            reducer.append(sum(spent))
            calls.append(len(spent))
    finally:
        numba_reducer._run = real
    return statistics.median(reducer), statistics.median(own), int(statistics.median(calls))


def _quartiles(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{q[0]:.3f}-{q[2]:.3f}"


def _median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """(low, high, coverage): the distribution-free interval for the median of ``xs`` from
    order statistics, [x_(k), x_(n+1-k)] with the largest k whose coverage 1 - 2 P(B <= k - 1),
    B ~ Binomial(n, 1/2), is still at least ``level``; None when n is too small for one."""
    from scipy.stats import binom

    s, n = sorted(xs), len(xs)
    k = 0
    while binom.cdf(k, n, 0.5) <= (1 - level) / 2:
        k += 1
    if k == 0:
        return None
    return s[k - 1], s[n - k], 1 - 2 * binom.cdf(k - 1, n, 0.5)


def _interval_text(xs: list[float]) -> str:
    ci = _median_interval(xs)
    if ci is None:
        return "too few pairs for a 95% interval"
    lo, hi, cover = ci
    verdict = "met" if hi <= 1.10 else ("not met" if lo > 1.10 else "not resolved by this run")
    return f"{cover:.1%} interval for the median {lo:.3f}-{hi:.3f}: target <= 1.10 {verdict}"


def _steal_ms() -> float:
    """CPU time stolen by the hypervisor from all CPUs since boot, in ms (0 where not reported)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) * 1000.0 / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak(kind: str, batch: int, seq: int, device: str = "cpu") -> None:
    """Child: print the peak growth of resident memory (MiB) during one pass of ``kind``.

    A thread samples /proc/self/statm every millisecond; the baseline is taken after a
    warm-up pass of the same kind, so allocator caches are already in place. On a GPU:
    torch's peak of allocated device memory during the pass over what was allocated before.
    """
    import threading

    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    model, tokens = _model_and_batch(batch, seq, device)
    fn = _probed if kind == "probed" else _step
    fn(model, tokens)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
        fn(model, tokens)
        growth = torch.cuda.max_memory_allocated() / 2**20 - base
        print(json.dumps({"kind": kind, "growth_mib": max(growth, 0.0), "base_mib": base}))
        return
    base, peak, stop = _rss_mib(), [0.0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mib())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    fn(model, tokens)
    stop.set()
    t.join()
    print(json.dumps({"kind": kind, "growth_mib": max(peak[0] - base, 0.0), "base_mib": base}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs (default cpu)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15, help="pairs of one bare and one probed pass")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--max-steal", type=float, default=20.0,
                    help="ms of steal a pass may lose and still count as quiet (default 20: two clock ticks)")
    ap.add_argument("--torch-path", action="store_true", help="also time the probe with torch ops (TINYLM_REDUCER=reference)")
    ap.add_argument("--compiled", action="store_true",
                    help="probe CPU tensors with the compiled reducer (torch.compile), not the numba reducer "
                         "(TINYLM_REDUCER=compiled)")
    ap.add_argument("--breakdown", type=int, default=5,
                    help="probed passes after the pairs that time the numba reducer apart (0: none)")
    ap.add_argument("--peak-child", choices=["bare", "probed"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    global _REDUCER
    _REDUCER = "compiled" if args.compiled else "auto"
    os.environ["TINYLM_REDUCER"] = _REDUCER
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; run on a machine with a GPU "
              "and a CUDA build of torch, or pass --device cpu", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak_child:
        _peak(args.peak_child, args.batch, args.seq, args.device)
        return 0
    model, tokens = _model_and_batch(args.batch, args.seq, args.device)
    from diagnostics.measure import numba_reducer

    _step(model, tokens)
    t = time.perf_counter()
    _probed(model, tokens)
    warm = time.perf_counter() - t
    if args.torch_path:
        _probed(model, tokens, reference=True)
    bare, probed, plain, pairs, quiet, cpu, inside = [], [], [], [], [], [], []
    coin = random.Random(0)
    tty = sys.stderr.isatty()
    for i in range(args.repeats):
        if tty:  # a long run (--repeats 201 takes about 7 minutes) says where it is
            print(f"\rpair {i + 1}/{args.repeats}", end="", file=sys.stderr, flush=True)
        order = ["bare", "probed"] if coin.random() < 0.5 else ["probed", "bare"]
        if args.torch_path:
            order.append("plain")
        took, stolen, used = {}, {}, {}
        gc.collect()  # a full collection inside a timed pass would land on whichever arm it hits
        for arm in order:
            s0, c, t = _steal_ms(), time.process_time(), time.perf_counter()
            if arm == "bare":
                _step(model, tokens)
            else:
                own = _probed(model, tokens, reference=arm == "plain")
                if arm == "probed":
                    own_time = own
            took[arm] = time.perf_counter() - t
            used[arm] = time.process_time() - c
            stolen[arm] = _steal_ms() - s0
        cpu.append(used["probed"] / used["bare"])
        inside.append((own_time, own_time / took["bare"]))
        bare.append(took["bare"])
        probed.append(took["probed"])
        pairs.append(took["probed"] / took["bare"])
        if max(stolen["bare"], stolen["probed"]) <= args.max_steal:
            quiet.append(pairs[-1])
        if args.torch_path:
            plain.append(took["plain"])
    if tty:
        print("\r" + " " * 24 + "\r", end="", file=sys.stderr, flush=True)
    os.environ["TINYLM_REDUCER"] = _REDUCER
    b, p = statistics.median(bare), statistics.median(probed)
    threads = torch.get_num_threads()
    from diagnostics.measure import compiled

    if args.device == "cpu" and numba_reducer.available():
        path = f"the numba reducer (diagnostics/measure/numba_reducer.py), up to {threads} thread(s)"
    elif compiled.available():
        path = "the compiled reducer, torch.compile (diagnostics/measure/compiled.py)"
    else:
        path = ("plain torch ops (diagnostics/measure/reference.py: compilation failed or "
                "TINYLM_REDUCER=reference)")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"tinystories preset, batch {args.batch} x {args.seq}, {where}, {threads} torch thread(s), "
          f"torch {torch.__version__}, {args.repeats} pairs")
    print(f"probe reductions        : {path}; first probed pass (warm-up, compilation included) {warm:.1f} s")
    print(f"forward+backward bare   : {b * 1000:8.1f} ms (median; fastest {min(bare) * 1000:.1f})")
    print(f"forward+backward probed : {p * 1000:8.1f} ms (median; fastest {min(probed) * 1000:.1f})")
    if len(quiet) >= 5:
        print(f"ratio probed/bare       : {statistics.median(quiet):8.3f}  median over the {len(quiet)} quiet pairs "
              f"(steal <= {args.max_steal:.0f} ms per pass; target <= 1.10); quartiles {_quartiles(quiet)}")
        print(f"                          {_interval_text(quiet)}")
    elif args.repeats < 5:
        print(f"ratio probed/bare       : {args.repeats} pairs are too few for the quiet-pair headline; all pairs below")
    else:
        print(f"ratio probed/bare       : only {len(quiet)} of {args.repeats} pairs were quiet "
              f"(steal <= {args.max_steal:.0f} ms per pass): the machine is loaded; all pairs below")
    print(f"  all {args.repeats} pairs          : {statistics.median(pairs):8.3f}  median; quartiles {_quartiles(pairs)}; "
          f"ratio of medians {p / b:.3f}, of fastest {min(probed) / min(bare):.3f}")
    print(f"                          {_interval_text(pairs)}")
    print(f"  CPU time, all pairs    : {statistics.median(cpu):8.3f}  median of probed/bare process CPU time; "
          f"quartiles {_quartiles(cpu)}")
    own = statistics.median(i for i, _ in inside)
    print(f"  inside the probe       : {own * 1000:8.1f} ms per pass (median; its hooks, reductions and exit, "
          f"timed by the probe itself), 1 + that / the pair's bare pass: "
          f"{1 + statistics.median(r for _, r in inside):.3f} (quartiles {_quartiles([1 + r for _, r in inside])})")
    print(f"                          {_interval_text([1 + r for _, r in inside])}")
    if args.breakdown and numba_reducer.available() and args.device == "cpu":
        k, o, n = _breakdown(model, tokens, args.breakdown)
        print(f"  of which numba reducer : {k * 1000:8.1f} ms in {n} calls per pass, the rest "
              f"{(o - k) * 1000:.1f} ms (Python in the hooks, small torch ops, exit work; median of "
              f"{args.breakdown} more probed passes)")
    if plain:
        q = statistics.median(plain)
        print(f"probed, torch-op path   : {q * 1000:8.1f} ms (median), ratio {q / b:.3f} to bare, "
              f"{(q - b) / max(p - b, 1e-9):.1f}x the numba reducer's overhead")
    env = dict(os.environ, BENCH_THREADS=str(threads), TINYLM_REDUCER=_REDUCER)
    for kind in ("bare", "probed"):
        out = subprocess.run([sys.executable, __file__, "--peak-child", kind, "--batch", str(args.batch),
                              "--seq", str(args.seq), "--device", args.device] + (["--compiled"] if args.compiled else []),
                             capture_output=True, text=True, env=env, check=True)
        rec = json.loads(out.stdout.strip().splitlines()[-1])
        what = "peak device memory growth" if args.device == "cuda" else "peak RSS growth"
        print(f"{what} during one {kind:6s} pass: {rec['growth_mib']:8.1f} MiB "
              f"({'allocated' if args.device == 'cuda' else 'resident'} before: {rec['base_mib']:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
