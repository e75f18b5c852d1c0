"""tinylm's attention statistics for all the layers of a pass: one call against one per layer.

    python benchmarks/bench_attention_batch.py [--rounds 40] [--layers 24] [--threads 1] [--stages]

The launch-bound shape's attention tensors (24 layers of q, k (4, 4, 32, 16) and v and the heads'
gradient as tinylm hands them: (4, 32, 4, 16) transposed): ``attention.statistics`` once per
layer against ``attention.statistics_many`` once for all, interleaved rounds (the order flipped
every round), medians of each arm's thread CPU time (the machine is shared: CPU time, not wall
time), and their ratio; the two give the same bits (checked first). ``--stages``: where the
batched call's time goes (joining the layers' tensors, the two GEMMs, the causal mask, the
softmax, its backward, the causal reductions and the merges), each stage's mean CPU time over
the rounds, from the module's own steps run in its order.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from diagnostics.measure import attention as A


def tensors(layers: int) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 4, 32, 16, generator=g), torch.randn(4, 4, 32, 16, generator=g),
             torch.randn(4, 32, 4, 16, generator=g).transpose(1, 2),
             torch.randn(4, 32, 4, 16, generator=g).transpose(1, 2)) for _ in range(layers)]


def stages(items: list[tuple], clock: dict) -> None:
    """``statistics_many`` (float32 CPU, the figures a probe asks) step by step, clocked."""
    T, d, dev = items[0][0].shape[-2], items[0][0].shape[-1], items[0][0].device
    t = time.thread_time()

    def tick(name: str, t0: float) -> float:
        t1 = time.thread_time()
        clock[name] = clock.get(name, 0.0) + t1 - t0
        return t1
    want = A._wanted(True, True, True, True, True)
    outs = [dict.fromkeys(want) for _ in items]
    groups = A._groups(A._pieces(items, True, T, dev), max(1, A.GROUP // (T * T)))
    m = max(sum(p[1] for p in group) for group in groups)
    S, P, G, D = (torch.empty(m, T, T) for _ in range(4))
    above, room = A._above_bits(T, dev, torch.float32), {"most": m}
    t = tick("setup", t)
    for group in groups:
        n = sum(p[1] for p in group)
        s_, p_, g_, d_ = (b[:n] if n < m else b for b in (S, P, G, D))
        qj, own = A._joined(group, 0, T, room)
        qs = qj.div_(math.sqrt(d)) if own else qj / math.sqrt(d)
        k, grad, v = (A._joined(group, i, T, room)[0] for i in (1, 3, 2))
        t = tick("join", t)
        torch.matmul(qs, k.transpose(-2, -1), out=s_)
        torch.matmul(grad, v.transpose(-2, -1), out=g_)
        t = tick("GEMMs", t)
        s = A._scores(s_, 0, T, above)
        t = tick("mask", t)
        p = A._softmax(s, p_)
        t = tick("softmax", t)
        A._score_grad(g_, p, d_)
        t = tick("softmax backward", t)
        A._add(outs, want, group, s_, p_, g_, d_)
        t = tick("reductions and merges", t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stages", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    items = tensors(args.layers)
    alone = [A.statistics(*it) for it in items]
    together = A.statistics_many(items)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(alone, together) for k in a if a[k] is not None)
    arms = {"per layer": lambda: [A.statistics(*it) for it in items], "batched": lambda: A.statistics_many(items)}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(args.rounds):
        for name, fn in (list(arms.items()) if r % 2 == 0 else list(arms.items())[::-1]):
            t0 = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{args.layers} layers, threads {args.threads}, load {os.getloadavg()[0]:.1f}, {args.rounds} rounds "
          f"(thread CPU time, ms): per layer {med['per layer']:.2f}, batched {med['batched']:.2f}, "
          f"ratio {med['per layer'] / med['batched']:.2f}")
    if args.stages:
        clock: dict[str, float] = {}
        for _ in range(args.rounds):
            stages(items, clock)
        print("  batched, by stage (mean ms): " + ", ".join(f"{k} {v / args.rounds * 1e3:.2f}" for k, v in clock.items()))


if __name__ == "__main__":
    main()
