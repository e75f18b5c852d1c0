"""``tinylm::summaries`` on the CUDA structure: one compiled call per tensor against a few for the list.

    python benchmarks/bench_summaries.py [--pairs 15] [--threads 1]

The list a probed pass can hand the op at the launch-bound shape (``bench_launch.SHAPE``:
tinylm, d_model 64, 24 layers, T 32, batch 4): the 582 tensors its probe reduces in forward
and backward (each site's output and gradient, captured from the ``tinylm::summary`` ops of one
probed pass under ``TINYLM_REDUCER=cuda``) and the 438 parameters and gradients its exit
reduces. Under ``TINYLM_REDUCER=cuda`` (CPU tensors take the path CUDA tensors take), in one
process, interleaved pairs (order by a seeded coin) after a warm-up of each:

* ``each``: one compiled call per tensor (:func:`diagnostics.measure.reduction.each`, what
  the op's CUDA kernel ran before it reduced the list by groups);
* ``grouped``: the op as it stands (:func:`diagnostics.measure.grouped.moments`: one compiled
  call per distinct dtype and size).

Printed, for the activations, the parameters and gradients, and all of them: the median time
of each and of the within-pair ratio, in wall and in CPU time (and for all of them with each tensor cut to its first
1/1000 entries, at least one: the same calls and distinct sizes with almost no arithmetic, the
host cost a launch-bound GPU pass pays), the compiled calls and the aten ops each dispatches
outside its compiled code (counted with ``OpCount``, the compiled calls run outside its mode;
each a kernel launch or a view on a GPU), the groups, and how far the two
results are apart (counts and max |x| must be equal; mean and M2 relative).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def probe_list():
    """(activations, parameters and gradients) of one probed launch-bound tinylm pass."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import tinylm
    from bench_launch import SHAPE
    from diagnostics import probe

    s = SHAPE
    config = tinylm.preset("tiny", num_layers=s["num_layers"], context_length=s["context_length"],
                           d_model=s["d_model"], num_heads=s["num_heads"], vocab_size=s["vocab"])
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["context_length"] + 1),
                           generator=torch.Generator().manual_seed(1))
    seen = []

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.tinylm.summary.default:
                seen.append(args[0].detach().clone())
            return func(*args, **(kwargs or {}))

    def step():
        tinylm.functional.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    with probe(model), Capture():  # the probe leaves the gradients as they were: none
        step()
    step()
    params = [p.detach() for p in model.parameters()]
    return seen, params + [p.grad.detach() for p in model.parameters()]


def counted(fn, xs):
    """(compiled calls, aten ops outside them) of one ``fn(xs)`` (``fn`` a kernel: an op counter
    sees a registered op once, not what its kernel dispatches)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from diagnostics.measure import compiled, grouped
    from diagnostics.measure.opcount import OpCount

    real, calls = compiled._function, [0]

    def function(fn):  # every compiled call of both paths, run outside the counter's mode (compiled
        built = real(fn)  # code, as inside the op's kernel, where no mode is on)

        def run(*args):
            calls[0] += 1
            with _disable_current_modes():
                return built(*args)
        return run
    observed = grouped._observed
    compiled._function, grouped._observed = function, lambda: False  # its calls leave the mode
    try:
        with OpCount() as ops:
            fn(xs)
    finally:
        compiled._function, grouped._observed = real, observed
    return calls[0], ops.total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    os.environ["TINYLM_REDUCER"] = "cuda"
    import torch

    from diagnostics.measure import grouped, reduction

    torch.set_num_threads(args.threads)
    acts, pg = probe_list()
    xs = acts + pg
    print(f"threads {args.threads}, load {os.getloadavg()[0]:.1f}; {len(acts)} activations and gradients + "
          f"{len(pg)} parameters and gradients = {len(xs)} tensors, {sum(x.numel() for x in xs):,} entries")
    chunks = grouped.plan(xs)
    print(f"groups (dtype, entries): {len({(d, n) for d, n, _ in chunks})}, chunks (compiled calls) {len(chunks)}")

    def each(xs):
        with torch.no_grad(), torch._C.DisableTorchFunction():
            return reduction.each(xs, reduction.CUDA)

    def group(xs):
        return reduction.many(xs)

    def group_kernel(xs):
        with torch.no_grad():
            return reduction._many_kernel(xs, reduction.CUDA)

    t0 = time.perf_counter()
    new = group(xs)
    print(f"grouped: first call {time.perf_counter() - t0:.1f} s (compiles once per dtype)")
    old = each(xs)
    same = ["n_total", "count", "max_abs", "n_zero", "n_fp16_under", "n_fp16_over", "n_bf16_under", "n_bf16_over"]
    cols = [0, 1, 4, 5, 6, 7, 8, 9]
    print(f"exact fields ({', '.join(same)}) equal: {torch.equal(old[:, cols], new[:, cols])}; "
          f"largest relative difference of mean {_rel(old[:, 2], new[:, 2]):.1e}, of M2 {_rel(old[:, 3], new[:, 3]):.1e}")
    for name, fn in (("each", each), ("grouped", group_kernel)):
        for what, lst in (("activations", acts), ("parameters+gradients", pg), ("all", xs)):
            calls, ops = counted(fn, lst)
            print(f"  {name:8s} {what:22s}: compiled calls {calls:5d}, aten ops outside them {ops:5d}")
    cut = [x.reshape(-1)[:max(1, x.numel() // 1000)] for x in xs]  # the same sizes, distinct as they were
    for what, lst in (("activations", acts), ("parameters+gradients", pg), ("all", xs),
                      ("all, each cut to 1/1000 of its entries", cut)):
        ta, tb, ratios, cpu = timed(each, group, lst, args.pairs)
        print(f"  time, {what} ({len(lst)} tensors; median of {args.pairs} pairs): each {statistics.median(ta) * 1e3:.2f} ms, "
              f"grouped {statistics.median(tb) * 1e3:.2f} ms; each / grouped median {statistics.median(ratios):.2f} "
              f"(range {min(ratios):.2f}-{max(ratios):.2f}), in CPU time {statistics.median(cpu):.2f} "
              f"(range {min(cpu):.2f}-{max(cpu):.2f})")
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


def timed(a, b, xs, pairs: int):
    """Wall times of ``a(xs)`` and ``b(xs)`` and the ratios a / b of their wall and of their CPU
    (thread) times, in ``pairs`` interleaved pairs (order by a seeded coin). The CPU time
    counts what this thread ran, not what other jobs on the machine took from it."""
    rng, ta, tb, ratios, cpu = random.Random(0), [], [], [], []
    for _ in range(pairs):
        times = {}
        for which in (("a", "b") if rng.random() < 0.5 else ("b", "a")):
            t0, c0 = time.perf_counter(), time.thread_time()
            (a if which == "a" else b)(xs)
            times[which] = time.perf_counter() - t0, time.thread_time() - c0
        ta.append(times["a"][0])
        tb.append(times["b"][0])
        ratios.append(times["a"][0] / times["b"][0])
        cpu.append(times["a"][1] / times["b"][1])
    return ta, tb, ratios, cpu


def _rel(a, b) -> float:
    scale = a.abs().clamp(min=1e-300)
    return float(((a - b).abs() / scale).nan_to_num(0.0).max())


if __name__ == "__main__":
    sys.exit(main())
