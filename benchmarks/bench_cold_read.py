"""The numba reducer against torch's own plain read, on tensors just made by the op that makes them.

    python benchmarks/bench_cold_read.py [--repeats 40] [--threads N]

In a hook the tensor was written by the op before it, and other work has usually pushed
it out of the caches, so the numba reducer reads it from memory. Here each tensor of the
``tinystories`` probe (batch 4 x 256) is made afresh by its op (a matmul, a masked softmax)
before every timing, then reduced either by the numba reducer (``diagnostics.measure.numba_reducer``:
the summary, and for attention probabilities the entropy panel; on causal matrices it reads the
lower triangle only) or by ``torch.sum`` over all of it (one plain pass, the cheapest read
torch offers), in alternating order. Printed per tensor: the median of each and their
ratio; a ratio near 1 means the numba reducer costs what reading the tensor costs. Both arms run
in this one process on as many threads as torch uses.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from diagnostics.measure import numba_reducer  # noqa: E402


def _makers(batch: int, seq: int):
    """(name, make, reduce): the op that makes a fresh tensor of the tinystories probe, and the
    numba reducer call the probe makes on it."""
    d, dff, heads, vocab = 512, 1344, 16, 10000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * seq, d, generator=g)
    w = torch.randn(d, d, generator=g) / d ** 0.5
    w1 = torch.randn(dff, d, generator=g) / d ** 0.5
    emb = torch.randn(vocab, d, generator=g) / d ** 0.5
    q = torch.randn(batch, heads, seq, d // heads, generator=g)
    k = torch.randn(batch, heads, seq, d // heads, generator=g)
    above = ~torch.ones(seq, seq, dtype=torch.bool).tril()

    def scores():
        return (q @ k.transpose(-1, -2)).masked_fill(above, float("-inf"))

    return [
        ("activation (B*T, d)", lambda: x @ w.T, lambda t: numba_reducer.summary(t)),
        ("FFN hidden (B*T, d_ff)", lambda: x @ w1.T, lambda t: numba_reducer.summary(t)),
        ("residual rows + cosine", lambda: (x @ w.T).view(batch, seq, d), lambda t: numba_reducer.summary_rows(t, cosine=True)),
        ("logits (B*T, V)", lambda: x @ emb.T, lambda t: numba_reducer.summary(t)),
        ("scores, causal", scores, lambda t: numba_reducer.summary(t, seq)),
        ("probs, causal + panel", lambda: torch.softmax(scores(), -1), lambda t: numba_reducer.summary(t, seq, probs=True)),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not numba_reducer.available():
        print("numba is not importable (or TINYLM_REDUCER is not auto): nothing to compare", file=sys.stderr)
        return 2
    print(f"tinystories shapes, batch {args.batch} x {args.seq}, {torch.get_num_threads()} torch thread(s), "
          f"{args.repeats} fresh tensors per arm")
    print(f"{'tensor':26s} {'entries':>10s} {'numba':>10s} {'torch.sum':>10s} {'ratio':>7s}")
    for name, make, reduce in _makers(args.batch, args.seq):
        t = make()
        reduce(t), t.sum()  # compile / warm up
        times = {"numba": [], "sum": []}
        for i in range(args.repeats):
            for arm in (("numba", "sum") if i % 2 else ("sum", "numba")):
                t = make()
                t0 = time.perf_counter()
                reduce(t) if arm == "numba" else t.sum()
                times[arm].append(time.perf_counter() - t0)
        a, b = statistics.median(times["numba"]), statistics.median(times["sum"])
        print(f"{name:26s} {t.numel():10,d} {a * 1e6:8.0f}us {b * 1e6:8.0f}us {a / b:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
