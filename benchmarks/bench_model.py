"""Forward+backward time of tinylm's TransformerLM against the same model from torch built-ins.

Usage: python benchmarks/bench_model.py [--preset tinystories] [--batch 4] [--seq 256] [--repeats 15]
                                        [--threads N] [--explicit] [--device cpu|cuda]

Both models hold the same weights (BuiltinLM loads TransformerLM's state dict); both
use the same loss (torch's F.cross_entropy) so only the model differs. Passes run in
pairs, one of each model in an order chosen by a seeded coin, after one warm-up each;
the headline is the median over pairs of tinylm / built-ins within a pair (a slow spell
of a shared machine hits both passes of a pair), with its quartiles and a
distribution-free 95% interval (target <= 1.05). The same within-pair ratio of the
process's CPU time is printed beside it: on a machine shared with other jobs, time spent
waiting for a core is not CPU time, so it moves that ratio less than the wall-clock one. Nothing observes tinylm's attention
here, so it runs its fused path; ``--explicit`` adds a third arm in every pair: the same
tinylm model with a no-op hook on each ``probs`` Tap, which makes attention take its
explicit path (scores and weights stored). ``--device cuda`` runs both models on the GPU
(each pass ends with ``torch.cuda.synchronize()`` inside its timing); without CUDA it stops
with a one-line message (exit status 2).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import tinylm
from bench_overhead import _median_interval, _quartiles
from tinylm.reference import BuiltinLM

TARGET = 1.05


def step(model, x, y):
    model.zero_grad(set_to_none=True)
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    if x.is_cuda:  # the pass is over when the device is done
        torch.cuda.synchronize()


def _observe_attention(model):
    """A no-op forward hook on every ``probs`` Tap: attention computes its weights explicitly."""
    return [m.register_forward_hook(lambda *a: None) for n, m in model.named_modules() if n.endswith("attn.probs")]


def _ratio_line(label: str, xs: list[float]) -> str:
    ci = _median_interval(xs)
    if ci is None:
        where = "too few pairs for a 95% interval"
    else:
        lo, hi, cover = ci
        verdict = "met" if hi <= TARGET else ("not met" if lo > TARGET else "not resolved by this run")
        where = f"{cover:.1%} interval {lo:.3f}-{hi:.3f}: target <= {TARGET} {verdict}"
    return f"{label}{statistics.median(xs):.3f}  median within-pair; quartiles {_quartiles(xs)}; {where}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinystories")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15, help="pairs of one tinylm and one built-ins pass")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--explicit", action="store_true",
                    help="also time tinylm with its attention observed (the explicit path)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both models run (default cpu)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; run on a machine with a GPU "
              "and a CUDA build of torch, or pass --device cpu", file=sys.stderr)
        raise SystemExit(2)
    if a.threads:
        torch.set_num_threads(a.threads)
    c = tinylm.preset(a.preset)
    ours = tinylm.TransformerLM(c, generator=torch.Generator().manual_seed(0))
    ref = BuiltinLM(c)
    ref.load_state_dict(ours.state_dict())
    ours, ref = ours.to(a.device), ref.to(a.device)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, c.vocab_size, (a.batch, a.seq), generator=g).to(a.device)
    y = torch.randint(0, c.vocab_size, (a.batch, a.seq), generator=g).to(a.device)
    with torch.no_grad():
        diff = (ours(x) - ref(x)).abs().max().item()
    arms = {"tinylm": lambda: step(ours, x, y), "builtins": lambda: step(ref, x, y)}
    if a.explicit:
        def explicit():
            handles = _observe_attention(ours)
            try:
                step(ours, x, y)
            finally:
                for h in handles:
                    h.remove()
        arms["explicit"] = explicit
    for run in arms.values():  # warm-up
        run()
    times: dict[str, list[float]] = {k: [] for k in arms}
    cpu: dict[str, list[float]] = {k: [] for k in arms}
    coin = random.Random(0)
    for _ in range(a.repeats):
        order = list(arms)
        coin.shuffle(order)
        for name in order:
            c, t = time.process_time(), time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    med = {k: statistics.median(v) for k, v in times.items()}
    where = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"preset={a.preset} batch={a.batch}x{a.seq} float32 {where} threads={torch.get_num_threads()} "
          f"torch={torch.__version__} pairs={a.repeats} max|logit diff|={diff:.2e}")
    print(f"tinylm    fwd+bwd median {med['tinylm'] * 1e3:8.1f} ms (fastest {min(times['tinylm']) * 1e3:.1f})")
    print(f"built-ins fwd+bwd median {med['builtins'] * 1e3:8.1f} ms (fastest {min(times['builtins']) * 1e3:.1f})")
    pairs = [t / b for t, b in zip(times["tinylm"], times["builtins"])]
    print(_ratio_line("ratio tinylm / built-ins   = ", pairs))
    print(f"                             ratio of medians {med['tinylm'] / med['builtins']:.3f}, "
          f"of fastest {min(times['tinylm']) / min(times['builtins']):.3f}")
    print(_ratio_line("  process CPU time         = ", [t / b for t, b in zip(cpu["tinylm"], cpu["builtins"])]))
    if a.explicit:
        ex = [e / b for e, b in zip(times["explicit"], times["builtins"])]
        print(f"tinylm observed (explicit attention) fwd+bwd median {med['explicit'] * 1e3:8.1f} ms")
        print(f"ratio observed / built-ins = {statistics.median(ex):.3f}  median within-pair; quartiles {_quartiles(ex)}")


if __name__ == "__main__":
    main()
