"""The watch in a hand-written loop: its cost, and what its writers add, in one process.

Five arms train the same model (same init seed, same batches) for the same steps in a
plain PyTorch loop: no watch; ``Watch(model, every=K)`` (the history only); the same with
``log_dir`` (CSV, JSONL and, when installed, TensorBoard); recording every step without
and with ``log_dir`` (a record's own cost, and the writers' worst case). The arms alternate, round after round, so a
slow spell of a shared machine hits them all; each figure is the median over rounds of
this process's CPU seconds per step (less disturbed by other jobs than wall time), and
the printed ratios are against the no-watch arm, with their range over rounds.

    python benchmarks/bench_watch_loop.py
    python benchmarks/bench_watch_loop.py --rounds 5 --steps 100 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=50, help="steps per arm and round (a multiple of the interval)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--every", type=int, default=25, help="the watch's interval (default 25)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import tinylm
    from diagnostics import Watch
    from diagnostics.integrations.writers import tensorboard_available
    from tinylm import functional as F
    from tinylm.data import get_batch, stdlib_corpus

    tokens = stdlib_corpus()
    config = tinylm.preset(args.preset)

    def arm(every: int | None, log: bool) -> float:
        model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        with tempfile.TemporaryDirectory() as d:
            watch = None if every is None else Watch(model, every=every, log_dir=d if log else None)
            c0 = time.process_time()
            for t in range(args.steps):
                x, y = get_batch(tokens, args.batch_size, config.context_length, gen)
                if watch is None:
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    float(loss.detach())
                    continue
                with watch.step(t):
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                watch.record(loss, lr=1e-3)
            if watch is not None:
                watch.close()
            return (time.process_time() - c0) / args.steps

    arms = {"no watch": (None, False), f"watch every {args.every}": (args.every, False),
            f"watch every {args.every} + writers": (args.every, True), "watch every step": (1, False),
            "watch every step + writers": (1, True)}
    arm(args.every, True)  # warm-up: imports, first-call compilation
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(args.rounds):
        order = list(arms.items())
        for name, (every, log) in (order if r % 2 == 0 else order[::-1]):
            times[name].append(arm(every, log))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items()), flush=True)
    base = times["no watch"]
    print(f"preset {args.preset}, batch {args.batch_size} x {config.context_length} tokens, {args.steps} steps per arm, "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}, "
          f"tensorboard {'on' if tensorboard_available() else 'not installed'}")
    for name, v in times.items():
        ratios = [a / b for a, b in zip(v, base)]
        print(f"{name:32s} {statistics.median(v) * 1e3:8.2f} CPU-ms/step  x{statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}..{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
