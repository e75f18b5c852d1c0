"""Does the learning rate transfer across width? tinylm in muP and in SP, an lr sweep per width.

For each width (d_model 64 -> 512; 2 blocks, 4 heads, d_ff 8/3 d, V = 256 bytes) and each
learning rate on a log2 grid, train ``--steps`` Adam steps (a linear warmup over the first
tenth, then constant) on the standard library's source as bytes (the same batches for every
run) and report the mean training loss of the last ``--tail`` steps (each batch seen once, so
it is a held-out loss). muP: ``parametrization="mup"`` with base width 64 and
``tinylm.mup.param_groups``; SP: the same models in "sp" with one Adam lr. Prints a table of
the loss per (parametrization, width, lr), each width's optimal lr, and writes the table as
JSON and a plot (loss against log2 lr, one line per width).

    OMP_NUM_THREADS=1 python benchmarks/mup_transfer.py --out docs/mup_transfer
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import tinylm
from tinylm import ModelConfig, TransformerLM
from tinylm.data import stdlib_corpus


def config(width: int, parametrization: str, base: int) -> ModelConfig:
    return ModelConfig(vocab_size=256, context_length=64, d_model=width, num_layers=2, num_heads=4,
                       d_ff=tinylm.default_d_ff(width), parametrization=parametrization,
                       mup_base_width=base if parametrization == "mup" else None)


def run(width: int, parametrization: str, lr: float, batches: list[torch.Tensor], args) -> float:
    torch.manual_seed(args.seed)
    model = TransformerLM(config(width, parametrization, args.base))
    groups = tinylm.mup.param_groups(model, lr, "adam")
    opt = torch.optim.Adam(groups, lr=lr)
    warmup = max(1, args.steps // 10)
    losses = []
    for t, batch in enumerate(batches):
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_scale"] * min(1.0, (t + 1) / warmup)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item() if math.isfinite(loss.item()) else math.inf)
    tail = losses[-args.tail:]
    return sum(tail) / len(tail)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="64,128,256,512")
    p.add_argument("--log2-lrs", default="-12,-11,-10,-9,-8,-7,-6,-5")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--tail", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--base", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.png")
    args = p.parse_args()
    torch.set_num_threads(1)
    widths = [int(w) for w in args.widths.split(",")]
    exps = [int(e) for e in args.log2_lrs.split(",")]
    data = torch.from_numpy(stdlib_corpus()[: args.steps * args.batch_size * (args.seq_len + 1)].astype("int64"))
    batches = list(data.view(args.steps, args.batch_size, args.seq_len + 1))
    table: dict[str, dict[int, dict[int, float]]] = {"mup": {}, "sp": {}}
    start = time.time()
    for width in widths:
        for param in ("mup", "sp"):
            table[param][width] = {e: run(width, param, 2.0 ** e, batches, args) for e in exps}
            best = min(table[param][width], key=table[param][width].get)
            print(f"{param:3s} d={width:4d}: " + " ".join(f"{table[param][width][e]:.3f}" for e in exps)
                  + f"  best lr 2^{best}  ({time.time() - start:.0f}s)", flush=True)
    optimal = {param: {w: min(table[param][w], key=table[param][w].get) for w in widths} for param in table}
    for param in table:
        moves = max(optimal[param].values()) - min(optimal[param].values())
        print(f"{param}: optimal log2 lr by width {optimal[param]}; moves {moves} log2 steps")
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"args": vars(args), "loss": {p: {str(w): {str(e): v for e, v in r.items()} for w, r in t.items()}
                                                   for p, t in table.items()},
                       "optimal_log2_lr": {p: {str(w): e for w, e in o.items()} for p, o in optimal.items()}}, f,
                      indent=1)
        plot(table, widths, exps, args.out + ".png")


def plot(table, widths, exps, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, param in zip(axes, ("sp", "mup")):
        for w in widths:
            ys = [min(table[param][w][e], 10.0) for e in exps]
            ax.plot(exps, ys, marker="o", label=f"d={w}")
        ax.set_title({"sp": "standard parametrization", "mup": "muP (base width 64)"}[param])
        ax.set_xlabel("log2 learning rate")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss, last steps")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
