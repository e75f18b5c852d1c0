"""Cost of ``diagnostics.precision`` against one bare forward and backward.

    python benchmarks/bench_precision.py [--threads N] [--repeats 5] [--batch 4] [--seq 256]
                                         [--d-model 256] [--layers 4] [--vocab 2048] [--preset NAME]
                                         [--recipes tensorwise,rowwise,mxfp8]

One "bare" pass: a forward and backward of the model (next-token cross-entropy in float32), no
hooks. One precision pass: ``precision(model, tokens, PrecisionOptions(recipes=...))`` on the same
batch (theory on, and again with theory off). They run in this one process, alternating, after a
warm-up each; printed: the median over --repeats of precision / bare within a pair, and that
divided by the number of recipes (target <= 4 per recipe), with the torch thread count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tinylm  # noqa: E402
from diagnostics import PrecisionOptions, precision  # noqa: E402


def bare(model, batch) -> None:
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), batch[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--preset", default=None, help="a tinylm preset (default: the model below)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--recipes", default="tensorwise,rowwise,mxfp8")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = tinylm.PRESETS[args.preset] if args.preset else tinylm.ModelConfig(
        vocab_size=args.vocab, context_length=max(args.seq, 16), d_model=args.d_model, num_layers=args.layers,
        num_heads=max(1, args.d_model // 64), d_ff=(8 * args.d_model // 3 + 63) // 64 * 64)
    model = tinylm.TransformerLM(config)
    recipes = tuple(args.recipes.split(","))
    batch = torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1),
                          generator=torch.Generator().manual_seed(0))
    runs = {"theory": PrecisionOptions(recipes=recipes, batch_size=args.batch, seq_len=args.seq),
            "no theory": PrecisionOptions(recipes=recipes, batch_size=args.batch, seq_len=args.seq, theory=False)}
    bare(model, batch)
    for o in runs.values():
        precision(model, batch, o)
    ratios: dict[str, list[float]] = {k: [] for k in runs}
    base = []
    for _ in range(args.repeats):
        for name, o in runs.items():
            b = timed(lambda: bare(model, batch))
            base.append(b)
            ratios[name].append(timed(lambda: precision(model, batch, o)) / b)
    c = model.config
    print(f"d_model {c.d_model}, {c.num_layers} layers, vocab {c.vocab_size}, {args.batch} x {args.seq} tokens, {len(recipes)} recipes ({', '.join(recipes)}), "
          f"torch threads {torch.get_num_threads()}, bare fwd+bwd median {statistics.median(base) * 1e3:.0f} ms")
    for name, r in ratios.items():
        m = statistics.median(r)
        print(f"  precision ({name}): {m:.1f}x one bare fwd+bwd = {m / len(recipes):.2f}x per recipe "
              f"(min {min(r):.1f}, max {max(r):.1f} over {len(r)})")


if __name__ == "__main__":
    main()
