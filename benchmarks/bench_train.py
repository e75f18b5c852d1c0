"""Training with the watch at its default interval against training without it, in one process.

Both arms train the same model (same init seed, same batches) for the same steps with
``tinylm.train.train``. Every kind of arm first runs once untimed (imports, the numba
reducer loaded, the first explicit attention: costs a process pays once, which would
otherwise land on whichever watched arm ran first). Then, round after round, the arms run
in an order drawn by a seeded coin (every other round: the previous order reversed), so
that neither always follows the other. The headline is the median over rounds of the
within-round ratio time with the watch / time without it, in this process's CPU time (a
machine shared with other jobs disturbs it far less than wall time), with its quartiles and
a distribution-free 95% interval; the same in wall time beside it. Target: <= 1.05.

glibc's allocator thresholds are fixed first (:func:`pin_malloc`; ``--system-malloc``
leaves them dynamic): with them dynamic, how much memory a step gives back to the system
and faults in again drifts with the process's allocation history, moving an arm's time by
several percent either way whatever the watch does.

Each step's CPU time is also taken (from the loop's per-step callback), which splits the
watch's cost into what a recorded step adds and what a step it does not record adds (that
should be nothing: such a step runs the fused attention and the same tensor work as a step
without a watch, see ``tests/test_watch_fast.py``). ``--every-step`` adds a third arm that
records every step. The load average at the start and the end is printed with the figures.

    python benchmarks/bench_train.py                       # the figure to quote
    python benchmarks/bench_train.py --threads 2 --rounds 15 --every-step
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import statistics
import sys
import time

import torch

from bench_overhead import _median_interval, _quartiles

TARGET = 1.05


def ratio_line(label: str, xs: list[float], target: float | None = TARGET) -> str:
    """The median of within-round ratios with quartiles, its distribution-free interval and
    whether that interval settles ``ratio <= target`` (None: no target)."""
    ci = _median_interval(xs)
    if ci is None:
        where = "too few rounds for a 95% interval"
    else:
        lo, hi, cover = ci
        where = f"{cover:.1%} interval {lo:.3f}-{hi:.3f}"
        if target is not None:
            verdict = "met" if hi <= target else ("not met" if lo > target else "not resolved by this run")
            where += f": target <= {target} {verdict}"
    return f"{label}{statistics.median(xs):.3f} median over {len(xs)} rounds; quartiles {_quartiles(xs)}; {where}"


def pin_malloc() -> str:
    """Fix glibc's mmap and trim thresholds (``mallopt``) so that freed memory stays with the
    process: by default glibc moves both thresholds as the process frees large blocks, and on
    the ``tiny`` preset it hands some 40 MB back to the system and faults it in again on most
    steps (about a tenth of a step's CPU time), by an amount that drifts with the allocation
    history: a noise that a slow arm carries into the next. Returns what was done, in words."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30)
    except (OSError, AttributeError):
        ok = False
    return "glibc thresholds fixed (mmap 32 MiB, trim 1 GiB)" if ok else "not glibc: allocator left as it is"


def arm_order(previous: list[str], k: int, coin: random.Random) -> list[str]:
    """The order of the arms in round k: drawn by the seeded coin in even rounds, the previous
    round's reversed in odd ones, so that over each pair of rounds every arm runs first and
    last equally often (a coin alone can put one arm first in most rounds of a short run)."""
    if k % 2:
        return previous[::-1]
    order = sorted(previous)
    coin.shuffle(order)
    return order


def load_text() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


def rounds(names: list[str], run, n: int, seed: int, line) -> dict[str, list]:
    """``n`` rounds of every arm, in :func:`arm_order` (a coin seeded with ``seed``): {name: [run(name)
    of each round]}; after each round one line, ``"round k"`` + ``line(results, order)`` and the load."""
    out: dict[str, list] = {k: [] for k in names}
    coin, order = random.Random(seed), list(names)
    for k in range(n):
        order = arm_order(order, k, coin)
        for name in order:
            out[name].append(run(name))
        print(f"round {k + 1}{line(out, order)}; {load_text()}", flush=True)
    return out


def loop_steps(model, opt, batch, steps: int, watch=None) -> list[float]:
    """A hand-written training loop (cross-entropy, ``opt``; ``batch()`` gives (x, y)) of ``steps``
    steps, under ``watch`` when given (its step context and one record per step, lr 1e-3): each
    step's process CPU seconds."""
    from tinylm import functional as F

    per_step = []
    for t in range(steps):
        s0 = time.process_time()
        x, y = batch()
        with watch.step(t) if watch is not None else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        if watch is not None:
            watch.record(loss, lr=1e-3)
        else:
            float(loss.detach())
        per_step.append(time.process_time() - s0)
    return per_step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=100, help="steps per arm and round (a multiple of the interval)")
    p.add_argument("--rounds", type=int, default=9, help="rounds (6 or more give a 95%% interval)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--watch-every", type=int, default=25, help="the watch's interval (default: the CLI's default, 25)")
    p.add_argument("--every-step", action="store_true", help="also time an arm that records every step")
    p.add_argument("--seed", type=int, default=0, help="seeds the coin that orders the arms in each round")
    p.add_argument("--system-malloc", action="store_true",
                   help="leave glibc's allocator thresholds dynamic (default: fixed, see pin_malloc)")
    args = p.parse_args(argv)
    if args.steps < 2 * args.watch_every:
        p.error(f"--steps {args.steps}: must be at least twice --watch-every ({args.watch_every}), so that a step "
                "other than the first is recorded")
    torch.set_num_threads(args.threads)
    allocator = "glibc's dynamic thresholds" if args.system_malloc else pin_malloc()

    import tinylm
    from diagnostics.jobs.watch import train_watched
    from tinylm.data import stdlib_corpus
    from tinylm.train import TrainOptions

    tokens = stdlib_corpus()
    config = tinylm.preset(args.preset)

    def arm(every: int, steps: int) -> dict:
        """One training run; its wall and CPU seconds and each step's (recorded, CPU seconds,
        minor page faults)."""
        model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
        per_step: list[tuple[bool, float, int]] = []
        last = [time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt]

        def on_step(info) -> None:
            now, faults = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            per_step.append((info.recorded, now - last[0], faults - last[1]))
            last[:] = [now, faults]

        r = train_watched(model, tokens, TrainOptions(steps=steps, batch_size=args.batch_size, watch_every=every),
                          on_step=on_step)
        assert len(r.history["records"]) == (0 if every == 0 else -(-steps // every))
        return {"wall": r.seconds, "cpu": r.cpu_seconds, "tokens": r.tokens, "steps": per_step}

    arms = {"no watch": 0, f"watch every {args.watch_every}": args.watch_every}
    if args.every_step:
        arms["watch every step"] = 1
    off, on = list(arms)[:2]
    print(f"preset {args.preset}, batch {args.batch_size} x {config.context_length} tokens, {args.steps} steps per arm, "
          f"{args.rounds} rounds, torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs, allocator: {allocator}; at the start: {load_text()}", flush=True)
    for every in arms.values():  # warm-up, untimed: every kind of arm once, records included
        arm(every, max(every, 1) + 1)
    runs = rounds(list(arms), lambda name: arm(arms[name], args.steps), args.rounds, args.seed,
                  lambda got, order: f" ({' > '.join(order)}): " + ", ".join(
                      f"{name} {got[name][-1]['cpu']:.2f} CPU-s ({got[name][-1]['tokens'] / got[name][-1]['wall']:,.0f} tok/s)"
                      for name in got))

    print(f"at the end: {load_text()}")
    for name in arms:
        print(f"{name:22s} median {statistics.median(r['tokens'] / r['wall'] for r in runs[name]):8,.0f} tokens/s, "
              f"{statistics.median(r['tokens'] / r['cpu'] for r in runs[name]):8,.0f} tokens per CPU-second")

    # where the time goes, from each step's CPU time (step 0 also holds the loop's setup: left out)
    def step_median(runs_: list[dict], recorded: bool, what: int = 1) -> list[float]:
        return [statistics.median(s[what] for i, s in enumerate(r["steps"]) if i > 0 and s[0] == recorded)
                for r in runs_]

    plain, quiet, recorded = step_median(runs[off], False), step_median(runs[on], False), step_median(runs[on], True)
    between = [q / p for q, p in zip(quiet, plain)]
    extra = [r / p - 1 for r, p in zip(recorded, plain)]
    faults = [statistics.median(step_median(runs[off], False, 2)), statistics.median(step_median(runs[on], False, 2))]
    print(f"per step (CPU, medians): without the watch {statistics.median(plain) * 1e3:.1f} ms; with it, a step it "
          f"does not record {statistics.median(quiet) * 1e3:.1f} ms, a recorded step {statistics.median(recorded) * 1e3:.1f} ms; "
          f"minor page faults per step {faults[0]:,.0f} without, {faults[1]:,.0f} on a step not recorded")
    print(ratio_line("   a step the watch does not record / a step without the watch = ", between, None))
    print(f"   a recorded step costs {100 * statistics.median(extra):.0f}% more than a plain one (quartiles "
          f"{_quartiles([100 * e for e in extra])} %): at 1 record in {args.watch_every} steps, "
          f"{100 * statistics.median(extra) / args.watch_every:.1f}%")
    if args.every_step:
        every1 = [a["cpu"] / b["cpu"] for a, b in zip(runs["watch every step"], runs[off])]
        print(ratio_line("   recording every step / without the watch (CPU) = ", every1, target=None))
    print(ratio_line("wall time with/without the watch, within a round        = ",
                     [a["wall"] / b["wall"] for a, b in zip(runs[on], runs[off])]))
    print(ratio_line(f"RESULT watch every {args.watch_every} / no watch, CPU time within a round = ",
                     [a["cpu"] / b["cpu"] for a, b in zip(runs[on], runs[off])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
