"""The CS336 norm ablations under the watch: pre-norm baseline, no norm, post-norm.

Trains the ``tinystories``-shaped model (4 blocks, 16 heads) at reduced width for
CPU, three times with the same seed, steps, batch and learning rate, changing
only the norm placement; prints for each run the loss, the watch's first verdict
other than ok, its spike/non-finite messages, and draws the three histories side
by side (``docs/ablation.png``). The data are the built-in corpus (bytes), so the
vocabulary is 256.

    python benchmarks/ablation_demo.py                   # docs/ablation.png (docs/ablations.md)
    python benchmarks/ablation_demo.py --lr 3e-2 --steps 100 -o /tmp/a.png
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--context-length", type=int, default=64)
    p.add_argument("--watch-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--norms", default="pre,none,post")
    p.add_argument("-o", "--output", default=str(ROOT / "docs" / "ablation.png"))
    p.add_argument("--save-json", metavar="DIR", help="also write each run's watch history as DIR/<norm>.json")
    args = p.parse_args(argv)

    import tinylm
    from tinylm.data import stdlib_corpus
    from tinylm.train import TrainOptions
    from diagnostics.jobs.watch import train_watched as train
    from diagnostics.integrations.writers import write_json
    from diagnostics.judge.over_time import first_departure
    from reports.watch_view import plot_histories

    tokens = stdlib_corpus()
    options = TrainOptions(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                           watch_every=args.watch_every)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"options: steps={options.steps} batch={options.batch_size} lr={options.lr} min_lr={options.floor} "
          f"warmup={options.warmup_steps} clip={options.clip} wd={options.weight_decay} seed={options.seed} "
          f"watch_every={options.watch_every}")
    histories = {}
    for norm in args.norms.split(","):
        config = tinylm.preset("tinystories", d_model=args.d_model, d_ff=tinylm.default_d_ff(args.d_model),
                               context_length=args.context_length, vocab_size=256, norm=norm)
        model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(args.seed))
        t0 = time.perf_counter()
        r = train(model, tokens, options)
        loss = r.history["series"]["loss"]
        finite = [x for x in loss if math.isfinite(x)]
        k = 10
        dep = first_departure(r.history)
        print(f"\n== norm={norm}: {model.num_parameters():,} parameters (d={config.d_model}, L={config.num_layers}, "
              f"H={config.num_heads}, d_ff={config.d_ff}, T={config.context_length}, V={config.vocab_size}); "
              f"{time.perf_counter() - t0:.0f} s")
        print(f"   loss: first {k} steps {sum(loss[:k]) / k:.3f}, last {k} steps {sum(loss[-k:]) / k:.4g}, "
              f"max {max(finite):.4g}, steps run {r.iteration}" + (f"; STOPPED: {r.stopped}" if r.stopped else ""))
        if dep is None:
            print(f"   watch: every verdict ok over {len(r.history['records'])} records")
        else:
            print(f"   watch: first verdict other than ok at step {dep['step']}: {dep['site']} {dep['verdict']} "
                  f"({dep['stat']} = {dep['value']:.3g}, threshold {dep['threshold']:.3g})")
        for ev in r.history["events"][:3]:
            print(f"   event: {ev['message']}")
        if len(r.history["events"]) > 3:
            print(f"   ... {len(r.history['events']) - 3} more events")
        peak = {s: max(rec["stats"][s]["fwd_var"] for rec in r.history["records"]
                       if math.isfinite(rec["stats"][s]["fwd_var"])) for s in ("layers.0", f"layers.{config.num_layers - 1}",
                                                                           f"layers.{config.num_layers - 1}.attn.scores")}
        print("   peak forward variance: " + ", ".join(f"{s} {v:.3g}" for s, v in peak.items()))
        label = {"pre": "pre-norm (baseline)", "none": "no norm", "post": "post-norm"}.get(norm, norm)
        histories[f"{label}, lr={args.lr:g}"] = r.history
        if args.save_json:
            write_json(r.history, str(Path(args.save_json) / f"{norm}.json"))
    plot_histories(histories, args.output)
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
