"""Does ``precision`` predict training? Small runs with torchao's emulated recipes on the CPU.

    python benchmarks/bench_precision_training.py [--steps 40] [--seeds 3] [--recipe tensorwise]
                                                  [--massive 1e6] [--ablate] [--threads 1]

The model: a small tinylm (d_model 64, 4 layers, byte vocabulary) trained on the bytes of the
standard library's sources (AdamW, lr 3e-3, batch 8 x 64). The breaking case: a massive
activation — one entry of each layer's attention input (token 0, one channel) set to
``--massive`` x 10^-i in layer i, a hook the model carries throughout (as a model with a massive
activation at its first token does) — so that the harm is graded over depth.

Runs, each from the same initial weights and batches: high precision (float32: the baseline, over
--seeds data seeds for its run-to-run spread); every Linear through torchao's emulated recipe
(``matmul_with_hp_or_float8_args`` for tensorwise / rowwise, ``_to_mxfp8_then_scaled_mm`` for
mxfp8); every Linear but those ``precision`` says to keep (``result.keep_in_bf16(recipe)``, run on
the initial model). Printed: the final loss (mean of the last 5 steps) of each, the gap to the
baseline and the baseline's spread (standard deviation over seeds).

--ablate: one Linear at a time through the recipe (the rest in high precision), its final loss
increase against the baseline of the same seed, and the Spearman rank correlation with the harm
``precision`` predicts for it (the largest dB lost over its three GEMMs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import tinylm  # noqa: E402
from diagnostics import PrecisionOptions, precision  # noqa: E402
from tinylm.data import get_batch, stdlib_corpus  # noqa: E402

CHANNEL = 5


class TorchaoLinear(nn.Module):
    """A Linear whose three GEMMs run through torchao's emulated recipe (shares the weight)."""

    def __init__(self, weight: nn.Parameter, recipe: str):
        super().__init__()
        self.weight, self.recipe = weight, recipe
        if recipe != "mxfp8":
            from torchao.float8.config import Float8LinearConfig
            from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

            base = Float8LinearConfig.from_recipe_name(recipe)
            self.config = Float8LinearConfig(**{**base.__dict__, "emulate": True})
            self.mm = LinearMMConfig(*(ScaledMMConfig(True, fast, False, False) for fast in (True, False, False)))

    def forward(self, x):
        if self.recipe == "mxfp8":
            from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

            return _to_mxfp8_then_scaled_mm(x, self.weight, KernelPreference.EMULATED, ScaleCalculationMode.RCEIL)
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        return matmul_with_hp_or_float8_args.apply(x, self.weight.t(), self.mm, self.config)


def convert(model: nn.Module, recipe: str, only=None, keep=()) -> nn.Module:
    """Every tinylm Linear (or those in ``only``), except ``keep``, through the recipe, in place."""
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            full = f"{name}.{cname}" if name else cname
            if isinstance(child, tinylm.Linear) and full not in keep and (only is None or full in only):
                setattr(mod, cname, TorchaoLinear(child.weight, recipe))
    return model


def build(massive: float) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = tinylm.TransformerLM(tinylm.ModelConfig(vocab_size=256, context_length=64, d_model=64, num_layers=4,
                                                    num_heads=4, d_ff=192))
    hooks = []
    for i, block in enumerate(model.layers):
        def hook(mod, args, out, _v=massive * 10.0 ** -i):
            out = out.clone()
            out[:, 0, CHANNEL] = _v
            return out
        hooks.append(block.ln1.register_forward_hook(hook))
    return model, hooks


def train(massive: float, steps: int, seed: int, data, recipe=None, only=None, keep=()) -> float:
    model, _ = build(massive)
    if recipe is not None:
        convert(model, recipe, only, keep)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = get_batch(data, 8, 64, gen)
        loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return statistics.fmean(losses[-5:])


def spearman(a, b) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--recipe", default="tensorwise")
    p.add_argument("--massive", type=float, default=1e6)
    p.add_argument("--ablate", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = stdlib_corpus(2_000_000)
    model, hooks = build(args.massive)
    result = precision(model, options=PrecisionOptions(recipes=(args.recipe,), batch_size=8, seq_len=64))
    keep = result.keep_in_bf16(args.recipe)
    print(f"precision ({args.recipe}, massive {args.massive:g}): {result}")
    print(f"torch threads {torch.get_num_threads()}, {args.steps} steps, seeds 0..{args.seeds - 1}")
    base = [train(args.massive, args.steps, s, data) for s in range(args.seeds)]
    full = [train(args.massive, args.steps, s, data, args.recipe) for s in range(args.seeds)]
    kept = [train(args.massive, args.steps, s, data, args.recipe, keep=set(keep)) for s in range(args.seeds)]
    spread = statistics.stdev(base) if len(base) > 1 else float("nan")
    mean = statistics.fmean
    print(f"  high precision       final loss {mean(base):.4f} (spread over seeds {spread:.4f})")
    print(f"  {args.recipe} everywhere    final loss {mean(full):.4f} (gap {mean(full) - mean(base):+.4f})")
    print(f"  {args.recipe}, {len(keep)} kept   final loss {mean(kept):.4f} (gap {mean(kept) - mean(base):+.4f}; "
          f"{abs(mean(kept) - mean(base)) / spread:.2f}x the spread)")
    for what, runs in (("everywhere", full), (f"{len(keep)} kept", kept)):
        d = [a - b for a, b in zip(runs, base)]
        sd = statistics.stdev(d) if len(d) > 1 else float("nan")
        print(f"  paired by seed, {args.recipe} {what}: gap {mean(d):+.4f} +- {sd:.4f} (sd of the per-seed gaps)")
    if not args.ablate:
        return
    harm = {}
    for r in result.rows:
        harm[r.module] = max(harm.get(r.module, -1e9), r.loss_db)
    rise = {}
    for name in result.modules:
        rise[name] = train(args.massive, args.steps, 0, data, args.recipe, only={name}) - base[0]
        print(f"    {name:28s} predicted harm {harm[name]:6.2f} dB   loss increase {rise[name]:+.4f}")
    names = list(rise)
    print(f"  Spearman(predicted harm, loss increase) = {spearman([harm[n] for n in names], [rise[n] for n in names]):.2f}"
          f" over {len(names)} modules")


if __name__ == "__main__":
    main()
