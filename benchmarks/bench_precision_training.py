"""Does ``precision`` predict training? Small runs with torchao's emulated recipes on the CPU.

    python benchmarks/bench_precision_training.py [--model tinylm|llama] [--case outlier|massive|none]
        [--steps 300] [--seeds 3] [--recipe tensorwise] [--lr 3e-3] [--ablate] [--ablate-seeds 3]
        [--workers 2]

The models: a tinylm and a Hugging Face Llama built from a config (no download), both d_model 64,
4 layers, 4 heads, d_ff 192, byte vocabulary, trained on the bytes of the standard library's
sources (AdamW, batch 8 x 64). Every run is one thread; ``--workers`` runs that many at once.

The breaking cases (hooks the model carries from its first step, in every run alike):

- ``outlier`` (an outlier feature): channel 5 of each norm's output that feeds a linear layer
  (attention input, MLP input, head input) multiplied by F_j = 10^(6 - 0.3125 j), j = 0, 1, ... in
  forward order (10^6 down to 10^3.5), and the weight column that reads that channel in each linear
  layer it feeds set to zero and frozen. In high precision the channel carries nothing the model
  uses, so the case costs nothing there; a scale per tensor (or per token row) is set by the
  outlier, and the other channels underflow in E4M3 by an amount graded with F.
- ``massive``: one entry (token 0, channel 5) of each layer's attention input set to 10^(6 - i) in
  layer i, the reading weights left as they are (so high precision is broken by it too).
- ``none``: the plain model (what the recipe costs by itself).

Arms, each from the same initial weights and batches per seed: high precision (float32: the
baseline, over --seeds seeds for its run-to-run spread); every Linear through torchao's emulated
recipe (``matmul_with_hp_or_float8_args`` for tensorwise / rowwise, ``_to_mxfp8_then_scaled_mm``
for mxfp8); every Linear but those ``precision`` keeps (``result.keep_in_bf16(recipe)``, on the
initial model). Printed: the final loss (mean of the last 20 steps) of each arm, the gap to the
baseline paired by seed (mean ± standard error over seeds) and the baseline's spread (standard
deviation over seeds).

--ablate: one Linear at a time through the recipe (the rest in high precision) over
--ablate-seeds seeds; its loss increase against the baseline of the same seed (mean ± standard
error), and the Spearman rank correlation with the harm ``precision`` predicts for the module
(``PrecisionResult.harm``: the noise power its three GEMMs inject, relative to their outputs'), and
with the largest dB lost to the format's ideal (the verdicts' yardstick) for comparison.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

CHANNEL = 5
BATCH, SEQ = 8, 64


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


def convert(model: nn.Module, recipe: str, names, keep=()) -> nn.Module:
    """The linear layers named in ``names``, except ``keep``, through the recipe, in place."""
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            full = f"{name}.{cname}" if name else cname
            if full in names and full not in keep:
                setattr(mod, cname, TorchaoLinear(child.weight, recipe))
    return model


def _sites(model: nn.Module, kind: str) -> list[tuple[nn.Module, list[nn.Module]]]:
    """(norm, the linear layers reading its output), in forward order."""
    if kind == "tinylm":
        out = []
        for b in model.layers:
            out += [(b.ln1, [b.attn.q_proj, b.attn.k_proj, b.attn.v_proj]), (b.ln2, [b.ffn.w1, b.ffn.w3])]
        return out + [(model.ln_final, [model.lm_head])]
    out = []
    for b in model.model.layers:
        out += [(b.input_layernorm, [b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj]),
                (b.post_attention_layernorm, [b.mlp.gate_proj, b.mlp.up_proj])]
    return out + [(model.model.norm, [model.lm_head])]


def _set_channel(value: float, token: int | None = None):
    def hook(mod, args, out):
        out = out.clone()
        if token is None:
            out[..., CHANNEL] = out[..., CHANNEL] * value
        else:
            out[:, token, CHANNEL] = value
        return out
    return hook


def _freeze_column(linear: nn.Module) -> None:
    with torch.no_grad():
        linear.weight[:, CHANNEL] = 0.0
    mask = torch.ones_like(linear.weight)
    mask[:, CHANNEL] = 0.0
    linear.weight.register_hook(lambda g: g * mask)


def build(kind: str, case: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "tinylm":
        import tinylm

        model = tinylm.TransformerLM(tinylm.ModelConfig(vocab_size=256, context_length=SEQ, d_model=64,
                                                        num_layers=4, num_heads=4, d_ff=192))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                             max_position_embeddings=SEQ, tie_word_embeddings=False))
    sites = _sites(model, kind)
    if case == "outlier":
        for j, (norm, linears) in enumerate(sites):
            norm.register_forward_hook(_set_channel(10.0 ** (6 - 0.3125 * j)))
            for lin in linears:
                _freeze_column(lin)
    elif case == "massive":
        for i, (norm, _) in enumerate(sites[0:-1:2]):
            norm.register_forward_hook(_set_channel(10.0 ** (6 - i), token=0))
    return model


def logits_of(model: nn.Module, x):
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _data():
    from tinylm.data import stdlib_corpus

    return stdlib_corpus(2_000_000)


def train(job: tuple) -> float:
    """One run: (kind, case, recipe or None, names converted, keep, seed, steps, lr) -> final loss."""
    kind, case, recipe, names, keep, seed, steps, lr = job
    torch.set_num_threads(1)
    from tinylm.data import get_batch

    data = _DATA if _DATA is not None else _data()
    model = build(kind, case)
    if recipe is not None:
        convert(model, recipe, set(names), set(keep))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = get_batch(data, BATCH, SEQ, gen)
        loss = nn.functional.cross_entropy(logits_of(model, x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    final = statistics.fmean(losses[-20:])
    return final if math.isfinite(final) else float("inf")


_DATA = None


def _init_worker():
    global _DATA
    torch.set_num_threads(1)
    _DATA = _data()


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


def _mean_se(v) -> tuple[float, float]:
    m = statistics.fmean(v)
    return m, (statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else float("nan"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tinylm", "llama"), default="tinylm")
    p.add_argument("--case", choices=("outlier", "massive", "none"), default="outlier")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--recipe", default="tensorwise")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ablate", action="store_true")
    p.add_argument("--ablate-seeds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from diagnostics import PrecisionOptions, precision

    result = precision(build(args.model, args.case),
                       options=PrecisionOptions(recipes=(args.recipe,), batch_size=BATCH, seq_len=SEQ))
    names, keep = tuple(result.modules), tuple(result.keep_in_bf16(args.recipe))
    print(f"precision ({args.model}, case {args.case}, {args.recipe}): {result}")
    print(f"1 thread per run, {args.workers} workers, {args.steps} steps, lr {args.lr:g}, seeds 0..{args.seeds - 1}",
          flush=True)
    common = (args.model, args.case)
    jobs = [(*common, None, names, (), s, args.steps, args.lr) for s in range(args.seeds)]
    jobs += [(*common, args.recipe, names, (), s, args.steps, args.lr) for s in range(args.seeds)]
    jobs += [(*common, args.recipe, names, keep, s, args.steps, args.lr) for s in range(args.seeds)]
    abl = names if args.ablate else ()
    jobs += [(*common, args.recipe, (n,), (), s, args.steps, args.lr) for n in abl for s in range(args.ablate_seeds)]
    with mp.get_context("fork").Pool(args.workers, initializer=_init_worker) as pool:
        out = pool.map(train, jobs, chunksize=1)
    k = args.seeds
    base, full, kept, rest = out[:k], out[k:2 * k], out[2 * k:3 * k], out[3 * k:]
    spread = statistics.stdev(base) if k > 1 else float("nan")
    print(f"  high precision (float32) final loss {statistics.fmean(base):.4f}, spread over seeds (sd) {spread:.4f}")
    print("  per seed: float32 " + " ".join(f"{v:.4f}" for v in base) + f"; {args.recipe} everywhere "
          + " ".join(f"{v:.4f}" for v in full) + "; kept " + " ".join(f"{v:.4f}" for v in kept))
    for what, runs in ((f"{args.recipe} everywhere", full), (f"{args.recipe}, {len(keep)} kept", kept)):
        m, se = _mean_se([a - b for a, b in zip(runs, base)])
        print(f"  {what:26s} final loss {statistics.fmean(runs):.4f}, gap paired by seed {m:+.4f} +- {se:.4f} (se); "
              f"|gap| = {abs(m) / spread:.2f}x the spread")
    if not args.ablate:
        return
    harm, lost = result.harm(args.recipe), {}
    for r in result.rows:
        lost[r.module] = max(lost.get(r.module, -math.inf), r.loss_db)
    rise, ses = {}, []
    for i, n in enumerate(names):
        d = [rest[i * args.ablate_seeds + s] - base[s] for s in range(args.ablate_seeds)]
        rise[n], se = _mean_se(d)
        ses.append(se)
        print(f"    {n:28s} harm {harm[n]:9.3g}  dB lost {lost[n]:6.2f}  loss increase {rise[n]:+.4f} +- {se:.4f}")
    print(f"  median standard error of a loss increase {statistics.median(ses):.4f} ({args.ablate_seeds} seeds)")
    for label, pred in (("harm (noise power)", harm), ("largest dB lost", lost)):
        rho = spearman([pred[n] for n in names], [rise[n] for n in names])
        print(f"  Spearman({label}, loss increase) = {rho:.2f} over {len(names)} modules")


if __name__ == "__main__":
    main()
