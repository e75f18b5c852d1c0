"""Training throughput with the watch at its default interval against without it, in one process.

Both arms train the same model (same init seed, same batches) for the same steps;
the arms alternate, round after round, so that a slow spell of a shared machine
hits both; each arm's figure is its median over the rounds, and the time ratio
with/without the watch is also given within each round, with its spread. Two clocks: wall
time (tokens/s) and this process's CPU time (tokens per CPU-second, which a
machine shared with other jobs disturbs far less). Target: the watch costs <= 5%.
A third arm records every step: its extra cost per step, divided by the interval,
estimates the overhead with K times the signal of the direct comparison.

    python benchmarks/bench_train.py                    # tiny preset, built-in corpus
    python benchmarks/bench_train.py --rounds 5 --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=100, help="steps per arm and round (a multiple of the interval)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--watch-every", type=int, default=25, help="the watch's interval (default: the CLI's default, 25)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import tinylm
    from tinylm.data import stdlib_corpus
    from tinylm.train import TrainOptions
    from diagnostics.judge.watch import train_watched as train

    tokens = stdlib_corpus()
    config = tinylm.preset(args.preset)

    def arm(every: int) -> tuple[float, float]:
        model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
        r = train(model, tokens, TrainOptions(steps=args.steps, batch_size=args.batch_size, watch_every=every))
        assert len(r.history["records"]) == (0 if every == 0 else -(-args.steps // every))
        return r.tokens_per_s, r.tokens / r.cpu_seconds

    arm(0)  # warm-up: imports, allocator, first-call costs
    off, on, every1 = [], [], []
    for k in range(args.rounds):
        order = [(0, off), (args.watch_every, on), (1, every1)]
        for every, sink in (order if k % 2 == 0 else order[::-1]):
            sink.append(arm(every))
        print(f"round {k + 1}: without watch {off[-1][0]:,.0f} tok/s ({off[-1][1]:,.0f} tok/CPU-s), "
              f"with watch (every {args.watch_every}) {on[-1][0]:,.0f} tok/s ({on[-1][1]:,.0f} tok/CPU-s), "
              f"watch on every step {every1[-1][0]:,.0f} tok/s ({every1[-1][1]:,.0f} tok/CPU-s)", flush=True)
    print(f"preset {args.preset}, batch {args.batch_size} x {config.context_length} tokens, {args.steps} steps per arm, "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}")
    for i, clock in ((0, "tokens/s (wall)"), (1, "tokens per CPU-second")):
        m_off, m_on = statistics.median(x[i] for x in off), statistics.median(x[i] for x in on)
        m_1 = statistics.median(x[i] for x in every1)
        # a recorded step costs (1/m_1 - 1/m_off) more per token; at 1 record in K steps that is
        # (1/m_1 - 1/m_off) / K over 1/m_off: the overhead estimated with K times the signal
        per_record = m_off / m_1 - 1.0
        print(f"median {clock}: without watch {m_off:,.0f}; with watch every {args.watch_every} steps {m_on:,.0f}; "
              f"ratio with/without {m_on / m_off:.3f} ({100 * (1 - m_on / m_off):+.1f}% slower; target <= 5%)")
        print(f"   watch on every step {m_1:,.0f}: a recorded step costs {100 * per_record:.0f}% more than a plain one, "
              f"so 1 in {args.watch_every} costs {100 * per_record / args.watch_every:.1f}% (target <= 5%)")
        # time with the watch over time without it, within each round (both arms of a round ran back to back)
        within = [a[i] / b[i] for a, b in zip(off, on)]
        print(f"   time with/without the watch within a round: median {statistics.median(within):.3f}, "
              f"spread {min(within):.3f}-{max(within):.3f} over {len(within)} rounds (target <= 1.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
