"""The watch's precision trend: what ``Watch(precision="tensorwise")`` adds to a watched loop.

Three arms train the same model (same init seed, same batches) for the same steps in a plain
PyTorch loop (AdamW): no watch; ``Watch(model, every=K)``; ``Watch(model, every=K,
precision=RECIPE)`` (every linear layer's three GEMMs measured in the recipe from the recorded
step's own operands). Every arm first runs once untimed (imports, first calls, a record). Then,
round after round, the arms run in an order drawn by a seeded coin (every other round: the
previous order reversed), with glibc's allocator thresholds fixed as in ``bench_train.py``.

Printed: each arm's median CPU seconds per step; the within-round CPU-time ratios to the no-watch
arm (median over rounds, quartiles, a distribution-free 95% interval; target for the arm with the
precision trend: <= 1.05) and of the two watched arms to each other; and, from each step's own CPU
time, what one recorded step costs beyond a plain one with and without the trend, as a share of
K plain steps (the extra at ``every=K`` the records alone make: less disturbed by the load than the
arms' ratio, since it compares medians of single steps).

    python benchmarks/bench_watch_precision.py                       # the figure to quote
    python benchmarks/bench_watch_precision.py --rounds 9 --steps 100 --every 50 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench_train import TARGET, load_text, loop_steps, pin_malloc, ratio_line, rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=100, help="steps per arm and round (a multiple of the interval)")
    p.add_argument("--rounds", type=int, default=9, help="rounds (6 or more give a 95%% interval)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--every", type=int, default=50, help="the watch's interval (default 50)")
    p.add_argument("--recipe", default="tensorwise", help="the precision trend's recipe (default tensorwise)")
    p.add_argument("--seed", type=int, default=0, help="seeds the coin that orders the arms in each round")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator = pin_malloc()

    import tinylm
    from diagnostics import Watch
    from tinylm.data import get_batch, stdlib_corpus

    tokens = stdlib_corpus()
    config = tinylm.preset(args.preset)

    def arm(precision: str | None, watched: bool, steps: int) -> tuple[float, list[float]]:
        """CPU seconds per step over the run, and each step's CPU seconds."""
        model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        watch = Watch(model, every=args.every, precision=precision) if watched else None
        c0 = time.process_time()
        per_step = loop_steps(model, opt, lambda: get_batch(tokens, args.batch_size, config.context_length, gen), steps,
                              watch)
        if watch is not None:
            watch.close()
        return (time.process_time() - c0) / steps, per_step

    plain, watch_k, trend = "no watch", f"watch every {args.every}", f"watch every {args.every} + precision"
    arms = {plain: (None, False), watch_k: (None, True), trend: (args.recipe, True)}
    n_linear = sum(1 for m in tinylm.TransformerLM(config).modules() if isinstance(m, tinylm.Linear))
    print(f"preset {args.preset} ({n_linear} linear layers), batch {args.batch_size} x {config.context_length} tokens, "
          f"{args.steps} steps per arm, {args.rounds} rounds, precision={args.recipe!r}, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, allocator: {allocator}; "
          f"at the start: {load_text()}", flush=True)
    for precision, watched in arms.values():  # warm-up, untimed: every arm once, a record included
        arm(precision, watched, 2)
    got = rounds(list(arms), lambda name: arm(*arms[name], args.steps), args.rounds, args.seed,
                 lambda res, order: ": " + ", ".join(f"{k} {v[-1][0] * 1e3:.1f} ms" for k, v in res.items()))
    times = {k: [per for per, _ in v] for k, v in got.items()}
    steps = {k: [each for _, each in v] for k, v in got.items()}
    print(f"at the end: {load_text()}")
    for name, v in times.items():
        head = f"{name:34s} {statistics.median(v) * 1e3:8.2f} CPU-ms/step"
        if name == plain:
            print(head)
            continue
        print(ratio_line(f"{head}  x", [a / b for a, b in zip(v, times[plain])], TARGET if name == trend else None))
    print(ratio_line(f"{trend} / {watch_k}, CPU time per step within a round = ",
                     [a / b for a, b in zip(times[trend], times[watch_k])], None))
    every = args.every
    base = statistics.median(s for run in steps[plain] for s in run[1:])
    for name in (watch_k, trend):
        rec = statistics.median(s for run in steps[name] for t, s in enumerate(run) if t % every == 0)
        quiet = statistics.median(s for run in steps[name] for t, s in enumerate(run) if t % every and t > 0)
        print(f"{name}: a recorded step {rec * 1e3:.1f} CPU-ms, a quiet one {quiet * 1e3:.1f}, a plain one "
              f"{base * 1e3:.1f}: the records' extra at every={every} = (recorded - plain) / ({every} x plain) = "
              f"{(rec - base) / (every * base):.2%}")
    print(ratio_line(f"RESULT {trend} / no watch, CPU time per step within a round = ",
                     [a / b for a, b in zip(times[trend], times[plain])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
