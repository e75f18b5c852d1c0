"""The probe's fixed costs per pass at the launch-bound shape, each against the way it is not done.

    python benchmarks/bench_probe_fixed.py [--repeats 41] [--threads 1]

The models of ``bench_launch.models()`` (d_model 64, 24 layers, T 32, batch 4). Each line is
two things done in one process, interleaved (order by a seeded coin), the median of the
within-pair ratios and the medians of each, in ms:

* ``walk``: ``sites.model_walk`` (the sites, modules and parameters from one pass over what was
  recorded) against walking the model for them (``named_modules`` twice, ``named_parameters``);
* ``hooks``: the probe's hooks on every point put on and taken off by ``measure.hooks.Hooks``
  against ``register_forward_hook`` and ``handle.remove()`` each;
* ``rows``: one SDPA call's sampled rows (GPT-2's shape, 4 x 4 x 32 x 32) by ``sdpa.rows_of``
  (numba's loop) against ``sdpa.row_statistics`` (torch ops);
* ``watch``: a probed GPT-2 forward+backward with the attention watch (``attention=True``, on
  only inside the attention modules) against one without it (``attention=False``): the watch's
  whole cost per pass, SDPA statistics included;
* ``scope``: that probed pass against the same under a pass-through ``TorchFunctionMode`` over
  the whole step (what a watch on for the whole pass would intercept besides), and the calls
  each intercepts in one probed pass;
* ``entry``, ``exit``: entering and leaving ``probe`` around a pass, tinylm and GPT-2, and a
  bare pass beside them (medians, ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pair(a, b, n: int, seed: int = 0) -> tuple[float, float, float]:
    """(median of b/a, median a in ms, median b in ms) over ``n`` interleaved pairs, after a warm-up."""
    from bench_launch import timed_pairs

    ratios, ta, tb = timed_pairs(a, b, n, seed)
    return statistics.median(ratios), statistics.median(ta) * 1e3, statistics.median(tb) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    import bench_launch as bl
    from diagnostics import probe
    from diagnostics.measure import numba_reducer, sdpa
    from diagnostics.measure import sites as S
    from diagnostics.measure.hooks import Hooks
    from diagnostics.options import ProbeOptions

    torch.set_num_threads(args.threads)
    while not numba_reducer.ready():  # a cold cache is filled in the background: wait for it
        time.sleep(0.5)
    nets, tokens = bl.models()
    n = args.repeats
    print(f"threads {args.threads}, repeats {n}, load {os.getloadavg()[0]:.1f}")

    def show(what, got):
        print(f"  {what}: ratio {got[0]:.3f} (median {got[1]:.3f} ms against {got[2]:.3f} ms)")

    for name in ("tinylm", "gpt2"):
        model = nets[name]
        print(name)
        show("walk, fresh walks -> model_walk", pair(
            lambda: (dict(model.named_modules()), dict(model.named_modules()), list(model.named_parameters())),
            lambda: S.model_walk(model), n))
        walk = S.model_walk(model)
        targets = [walk.named[p] for p in walk.sites.points if p in walk.named]

        def handles():
            for h in [m.register_forward_hook(bl.step) for m in targets]:
                h.remove()

        def bulk():
            hooks = Hooks()
            for m in targets:
                hooks.forward(m, bl.step)
            hooks.remove()
        show(f"hooks ({len(targets)}), handles -> Hooks", pair(handles, bulk, n))

        parts = {"bare": [], "entry": [], "exit": []}
        for _ in range(max(5, n // 4)):
            t0 = time.perf_counter()
            bl.step(model, tokens)
            t1 = time.perf_counter()
            cm = probe(model)
            cm.__enter__()
            t2 = time.perf_counter()
            bl.step(model, tokens)
            t3 = time.perf_counter()
            cm.__exit__(None, None, None)
            t4 = time.perf_counter()
            for k, v in (("bare", t1 - t0), ("entry", t2 - t1), ("exit", t4 - t3)):
                parts[k].append(v * 1e3)
        print("  " + ", ".join(f"{k} {statistics.median(v):.2f} ms" for k, v in parts.items()))

    q, k = (torch.randn(4, 4, 32, 16, generator=torch.Generator().manual_seed(i)) for i in range(2))
    s, allowed = sdpa._logits(q, k, None, True, None, sdpa.ROWS)
    show("rows, row_statistics -> rows_of", pair(lambda: sdpa.row_statistics(s, allowed),
                                                  lambda: sdpa.rows_of(s, allowed), n))
    gpt2 = nets["gpt2"]

    def probed(options):
        def run():
            with probe(gpt2, options):
                bl.step(gpt2, tokens)
        return run
    show("watch, GPT-2 probed pass without -> with the attention watch",
         pair(probed(ProbeOptions(attention=False)), probed(ProbeOptions()), max(9, n // 4)))
    from torch.overrides import TorchFunctionMode

    calls = {"watch": 0, "whole": 0}

    class PassThrough(TorchFunctionMode):  # what a watch on for the whole pass intercepts
        probe_own = True

        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls["whole"] += 1
            return func(*args, **kwargs) if kwargs else func(*args)

    from diagnostics.measure.eager_attention import EagerAttentionWatch
    seen = EagerAttentionWatch.__torch_function__

    def counted(self, *a, **k):
        calls["watch"] += 1
        return seen(self, *a, **k)
    EagerAttentionWatch.__torch_function__ = counted
    with probe(gpt2):
        bl.step(gpt2, tokens)
    EagerAttentionWatch.__torch_function__ = seen
    with probe(gpt2), PassThrough():
        bl.step(gpt2, tokens)
    print(f"  calls intercepted per GPT-2 probed pass: the watch {calls['watch']}, "
          f"a mode over the whole step {calls['whole']}")

    def whole():
        with probe(gpt2), PassThrough():
            bl.step(gpt2, tokens)
    show("scope, GPT-2 probed pass -> with a pass-through mode over the whole step",
         pair(probed(ProbeOptions()), whole, max(9, n // 4)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
