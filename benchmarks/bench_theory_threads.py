"""The token-kernel theory on one thread against the caller's threads, interleaved in one process.

    python benchmarks/bench_theory_threads.py [--preset gpt2-small] [--seq-len 1024] [--threads 2] [--pairs 3]

The walk runs torch on one thread (its sums must not depend on the caller's setting) and spreads
the causal products' panels (``tokenkernel_maps._add_causal_sandwich``, the theory's largest
piece at long contexts) over the caller's threads, each panel the same ops on any thread. This
times ``kernel_theory`` with ``torch.set_num_threads(1)`` and with ``--threads``, in pairs whose
order alternates (after one untimed walk that fills the quadrature caches), checks that both
give the same predictions bit for bit, and prints each pair's times, the median ratio and the
machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--pairs", type=int, default=3)
    args = p.parse_args(argv)
    if args.threads < 1 or args.pairs < 1:
        print("--threads and --pairs: at least 1", file=sys.stderr)
        return 2

    import torch

    import tinylm
    from diagnostics.theory.tokenkernel import kernel_theory

    config = tinylm.preset(args.preset)
    if not 1 <= args.seq_len <= config.context_length:
        print(f"--seq-len {args.seq_len}: give 1 to {config.context_length} ({args.preset}'s context)", file=sys.stderr)
        return 2

    def walk(threads: int):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        kt = kernel_theory(config, args.seq_len, keep_kernels=False)
        return time.perf_counter() - t0, kt

    walk(1)
    ratios, same = [], True
    print(f"{args.preset}, T {args.seq_len}: one thread against {args.threads}, load "
          f"{os.getloadavg()[0]:.1f}")
    for i in range(args.pairs):
        order = (1, args.threads) if i % 2 == 0 else (args.threads, 1)
        got = {n: walk(n) for n in order}
        (t1, one), (tn, many) = got[1], got[args.threads]
        same = same and one.mean_square == many.mean_square and one.cosine == many.cosine
        ratios.append(tn / t1)
        print(f"  pair {i + 1}: {t1:.2f} s on 1 thread, {tn:.2f} s on {args.threads} (ratio {tn / t1:.3f})")
    print(f"median ratio {statistics.median(ratios):.3f} over {args.pairs} pairs; the same predictions: {same}; "
          f"load {os.getloadavg()[0]:.1f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
