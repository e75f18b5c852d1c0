"""The watch in a hand-written loop: its cost, and what its writers add, in one process.

Five arms train the same model (same init seed, same batches) for the same steps in a
plain PyTorch loop: no watch; ``Watch(model, every=K)`` (the history only); the same with
``log_dir`` (CSV, JSONL and, when installed, TensorBoard); recording every step without
and with ``log_dir`` (a record's own cost, and the writers' worst case). Every arm first
runs once untimed (imports, the numba reducer's loops, first calls). Then, round after round,
the arms run in an order drawn by a seeded coin (every other round: the previous order
reversed), with glibc's allocator thresholds fixed as in ``bench_train.py``. Each figure is
the median over rounds of this process's CPU seconds per step (less disturbed by other jobs
than wall time); each ratio is the median over rounds of the within-round ratio to the
no-watch arm, with its quartiles and a distribution-free 95% interval (target for
``every=K``: <= 1.05). The steps the watch does not record are also timed alone against the
plain loop's steps.

    python benchmarks/bench_watch_loop.py                 # the figure to quote
    python benchmarks/bench_watch_loop.py --rounds 15 --steps 100 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from bench_train import TARGET, load_text, loop_steps, pin_malloc, ratio_line, rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=50, help="steps per arm and round (a multiple of the interval)")
    p.add_argument("--rounds", type=int, default=9, help="rounds (6 or more give a 95%% interval)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--every", type=int, default=25, help="the watch's interval (default 25)")
    p.add_argument("--seed", type=int, default=0, help="seeds the coin that orders the arms in each round")
    p.add_argument("--system-malloc", action="store_true",
                   help="leave glibc's allocator thresholds dynamic (default: fixed, see bench_train.pin_malloc)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator = "glibc's dynamic thresholds" if args.system_malloc else pin_malloc()

    import tinylm
    from diagnostics import Watch
    from diagnostics.integrations.writers import tensorboard_available
    from tinylm.data import get_batch, stdlib_corpus

    tokens = stdlib_corpus()
    config = tinylm.preset(args.preset)

    def arm(every: int | None, log: bool, steps: int) -> tuple[float, list[tuple[bool, float]]]:
        """CPU seconds per step over the run, and each step's (recorded, CPU seconds)."""
        model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        with tempfile.TemporaryDirectory() as d:
            watch = None if every is None else Watch(model, every=every, log_dir=d if log else None)
            c0 = time.process_time()
            each = loop_steps(model, opt, lambda: get_batch(tokens, args.batch_size, config.context_length, gen), steps,
                              watch)
            per_step = [(every is not None and t % every == 0, sec) for t, sec in enumerate(each)]
            if watch is not None:
                watch.close()
            return (time.process_time() - c0) / steps, per_step

    arms = {"no watch": (None, False), f"watch every {args.every}": (args.every, False),
            f"watch every {args.every} + writers": (args.every, True), "watch every step": (1, False),
            "watch every step + writers": (1, True)}
    print(f"preset {args.preset}, batch {args.batch_size} x {config.context_length} tokens, {args.steps} steps per arm, "
          f"{args.rounds} rounds, torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs, allocator: {allocator}, tensorboard {'on' if tensorboard_available() else 'not installed'}; "
          f"at the start: {load_text()}", flush=True)
    for every, log in arms.values():  # warm-up, untimed: every arm once, records included
        arm(every, log, (every or 1) + 1)
    got = rounds(list(arms), lambda name: arm(*arms[name], args.steps), args.rounds, args.seed,
                 lambda res, order: ": " + ", ".join(f"{k} {v[-1][0] * 1e3:.1f} ms" for k, v in res.items()))
    times = {k: [per for per, _ in v] for k, v in got.items()}
    steps = {k: [each for _, each in v] for k, v in got.items()}
    print(f"at the end: {load_text()}")
    base = times["no watch"]
    for name, v in times.items():
        if name == "no watch":
            print(f"{name:32s} {statistics.median(v) * 1e3:8.2f} CPU-ms/step")
            continue
        target = TARGET if name.startswith(f"watch every {args.every}") else None
        print(ratio_line(f"{name:32s} {statistics.median(v) * 1e3:8.2f} CPU-ms/step  x", [a / b for a, b in zip(v, base)],
                         target))
    watched = f"watch every {args.every}"
    plain = [statistics.median(s for i, (_, s) in enumerate(run) if i > 0) for run in steps["no watch"]]
    quiet = [statistics.median(s for i, (rec, s) in enumerate(run) if i > 0 and not rec) for run in steps[watched]]
    print(ratio_line("a step the watch does not record / a plain step (CPU, medians per arm) = ",
                     [q / b for q, b in zip(quiet, plain)], None))
    print(ratio_line(f"RESULT {watched} / no watch, CPU time per step within a round = ",
                     [a / b for a, b in zip(times[watched], base)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
