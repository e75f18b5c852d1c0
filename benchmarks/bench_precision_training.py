"""Does ``precision`` predict training? Small runs with torchao's emulated recipes on the CPU.

    python benchmarks/bench_precision_training.py [--model tinylm|llama] [--case outlier|massive|none]
        [--steps 300] [--seeds 3] [--recipe tensorwise] [--lr 3e-3] [--ablate] [--ablate-gemms]
        [--ablate-seeds 3] [--first-seed 0] [--only-ablate] [--workers 2] [--save runs.jsonl]
        [--load runs.jsonl]

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

--ablate: one Linear at a time through the recipe (its three GEMMs; the rest in high precision);
--ablate-gemms: one GEMM of one Linear at a time (the other two GEMMs kept in high precision by
torchao's own per-operand cast configs, ``ScalingType.DISABLED``; tensorwise and rowwise); both over
--ablate-seeds seeds from --first-seed, seed-major. Each unit's loss increase against float32 of the
same seed (mean +- standard error over seeds) and, per predictor, the Spearman rank correlation
with it (over the seeds' mean, with a 95% bootstrap interval over units, and per seed): the
predicted training-loss increase (``predicted_loss``, summed per module: ``harm(recipe,
by="loss")``), the noise power (``harm(recipe)``: 10^(-SQNR/10) summed) and the dB lost to the
format's ideal (the verdicts' yardstick). --save appends each run's final loss to a JSONL file as
it finishes; --load reads such a file and reports without training (``precision`` is recomputed:
it is deterministic). --only-ablate skips the everywhere and kept arms.
"""

from __future__ import annotations

import argparse
import json
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
GEMMS = ("fprop", "dgrad", "wgrad")


class TorchaoLinear(nn.Module):
    """A Linear whose GEMMs run through torchao's emulated recipe (shares the weight); ``gemms`` names
    those cast (the others stay in high precision: torchao's cast configs of both operands of a GEMM
    set to ``ScalingType.DISABLED``, which its Float8LinearConfig allows GEMM by GEMM)."""

    def __init__(self, weight: nn.Parameter, recipe: str, gemms=GEMMS):
        super().__init__()
        self.weight, self.recipe = weight, recipe
        if recipe == "mxfp8" and tuple(gemms) != GEMMS:
            raise SystemExit("mxfp8 runs its three GEMMs in one op here: one GEMM at a time needs tensorwise or rowwise")
        if recipe != "mxfp8":
            self.config = _float8_config(recipe, gemms)
            from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

            self.mm = LinearMMConfig(*(ScaledMMConfig(True, fast, False, False) for fast in (True, False, False)))

    def forward(self, x):
        if self.recipe == "mxfp8":
            from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

            return _to_mxfp8_then_scaled_mm(x, self.weight, KernelPreference.EMULATED, ScaleCalculationMode.RCEIL)
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        return matmul_with_hp_or_float8_args.apply(x, self.weight.t(), self.mm, self.config)


def _float8_config(recipe: str, gemms):
    """torchao's recipe, emulated, with the cast configs of the GEMMs not in ``gemms`` disabled."""
    import dataclasses

    from torchao.float8.config import CastConfig, Float8LinearConfig, ScalingType

    base = Float8LinearConfig.from_recipe_name(recipe)
    fields = {"fprop": ("cast_config_input", "cast_config_weight"),
              "dgrad": ("cast_config_grad_output", "cast_config_weight_for_grad_input"),
              "wgrad": ("cast_config_input_for_grad_weight", "cast_config_grad_output_for_grad_weight")}
    kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    for gm, names in fields.items():
        if gm not in gemms:
            for n in names:  # same dtype as the operand's other use (torchao checks it), no cast
                kw[n] = CastConfig(ScalingType.DISABLED, target_dtype=kw[n].target_dtype)
    return Float8LinearConfig(**{**kw, "emulate": True})


def convert(model: nn.Module, recipe: str, names, keep=(), gemms=GEMMS) -> nn.Module:
    """The linear layers named in ``names``, except ``keep``, through the recipe (``gemms`` of each), in place."""
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            full = f"{name}.{cname}" if name else cname
            if full in names and full not in keep:
                setattr(mod, cname, TorchaoLinear(child.weight, recipe, gemms))
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
    """One run: (kind, case, recipe or None, names converted, keep, seed, steps, lr, gemms) -> final loss."""
    kind, case, recipe, names, keep, seed, steps, lr, gemms = job
    torch.set_num_threads(1)
    from tinylm.data import get_batch

    data = _DATA if _DATA is not None else _data()
    model = build(kind, case)
    if recipe is not None:
        convert(model, recipe, set(names), set(keep), gemms)
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


def _jobs(args, names, keep) -> list[tuple[dict, tuple]]:
    """(label, job) of every run, seed-major for the ablations (a stopped run leaves whole seeds)."""
    common, tail = (args.model, args.case), (args.steps, args.lr)
    out = [({"arm": "float32", "seed": s}, (*common, None, names, (), s, *tail, GEMMS)) for s in range(args.seeds)]
    if not args.only_ablate:
        out += [({"arm": "everywhere", "seed": s}, (*common, args.recipe, names, (), s, *tail, GEMMS))
                for s in range(args.seeds)]
        out += [({"arm": "kept", "seed": s}, (*common, args.recipe, names, keep, s, *tail, GEMMS))
                for s in range(args.seeds)]
    for s in range(args.first_seed, args.first_seed + args.ablate_seeds):
        for n in names:
            if args.ablate:
                out.append(({"arm": "module", "module": n, "gemm": "all", "seed": s},
                            (*common, args.recipe, (n,), (), s, *tail, GEMMS)))
            for gm in GEMMS if args.ablate_gemms else ():
                out.append(({"arm": "gemm", "module": n, "gemm": gm, "seed": s},
                            (*common, args.recipe, (n,), (), s, *tail, (gm,))))
    return out


def _run_all(args, names, keep) -> list[dict]:
    jobs = _jobs(args, names, keep)
    records = []
    sink = open(args.save, "a") if args.save else None
    with mp.get_context("fork").Pool(args.workers, initializer=_init_worker) as pool:
        for (label, _), loss in zip(jobs, pool.imap(train, [j for _, j in jobs], chunksize=1)):
            records.append({**label, "loss": loss, "steps": args.steps, "model": args.model, "case": args.case,
                            "recipe": args.recipe, "lr": args.lr})
            if sink is not None:
                sink.write(json.dumps(records[-1]) + "\n")
                sink.flush()
    if sink is not None:
        sink.close()
    return records


def _arms(records, recipe: str, keep) -> dict[int, float]:
    base = {r["seed"]: r["loss"] for r in records if r["arm"] == "float32"}
    vals = list(base.values())
    spread = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    print(f"  high precision (float32) final loss {statistics.fmean(vals):.4f}, spread over seeds (sd) {spread:.4f}")
    for arm, what in (("everywhere", f"{recipe} everywhere"), ("kept", f"{recipe}, {len(keep)} kept")):
        runs = {r["seed"]: r["loss"] for r in records if r["arm"] == arm}
        if runs:
            m, se = _mean_se([runs[s] - base[s] for s in runs])
            print(f"  {what:26s} final loss {statistics.fmean(runs.values()):.4f}, gap paired by seed {m:+.4f} "
                  f"+- {se:.4f} (se); |gap| = {abs(m) / spread:.2f}x the spread")
    return base


def _increases(records, base, arm: str) -> dict[tuple[str, str], list[float]]:
    """(module, gemm) -> the loss increase over float32 of the same seed, per seed measured."""
    out: dict[tuple[str, str], list[float]] = {}
    for r in records:
        if r["arm"] == arm and r["seed"] in base:
            out.setdefault((r["module"], r["gemm"]), []).append(r["loss"] - base[r["seed"]])
    return out


def _predictors(result, recipe: str, arm: str) -> dict[str, dict[tuple[str, str], float]]:
    """Per ablated unit ((module, "all") or (module, gemm)) each predictor's figure."""
    rows = [r for r in result.rows if r.recipe == recipe]
    noise = {(r.module, r.gemm): 10.0 ** (-min(r.sqnr_db, r.row_sqnr_db) / 10) for r in rows}
    lost = {(r.module, r.gemm): r.loss_db for r in rows}
    loss = {(r.module, r.gemm): r.predicted_loss for r in rows}
    if arm == "gemm":
        return {"predicted_loss": loss, "noise power": noise, "dB lost": lost}
    by_loss, by_noise = result.harm(recipe, by="loss"), result.harm(recipe)
    worst = {}
    for (m, _), v in lost.items():
        worst[m] = max(worst.get(m, -math.inf), v)
    return {"predicted_loss": {(m, "all"): v for m, v in by_loss.items()},
            "noise power (harm)": {(m, "all"): v for m, v in by_noise.items()},
            "largest dB lost": {(m, "all"): v for m, v in worst.items()}}


def _bootstrap(pred, rise, keys, draws: int = 2000) -> tuple[float, float]:
    """95% interval of Spearman over units resampled with replacement (each unit's mean over seeds)."""
    import random

    gen, out = random.Random(0), []
    for _ in range(draws):
        pick = [keys[gen.randrange(len(keys))] for _ in keys]
        a, b = [pred[k] for k in pick], [statistics.fmean(rise[k]) for k in pick]
        if len(set(a)) > 1 and len(set(b)) > 1:
            out.append(spearman(a, b))
    out.sort()
    return out[int(0.025 * len(out))], out[int(0.975 * len(out)) - 1]


def ablation_report(result, records, base, recipe: str) -> None:
    """Per ablated unit the loss increase (mean +- se over seeds), and per predictor the Spearman
    correlation with it: over the seeds' mean (95% bootstrap interval over units) and per seed."""
    for arm in ("module", "gemm"):
        rise = _increases(records, base, arm)
        if not rise:
            continue
        preds = _predictors(result, recipe, arm)
        seeds = sorted({r["seed"] for r in records if r["arm"] == arm})
        keys = [k for k in rise if len(rise[k]) == len(seeds)]
        ses = []
        for k in keys:
            m, se = _mean_se(rise[k])
            ses.append(se)
            print(f"    {k[0]:28s} {k[1]:5s} predicted {preds['predicted_loss'][k]:9.3g}  "
                  f"noise {preds[list(preds)[1]][k]:9.3g}  dB lost {preds[list(preds)[2]][k]:6.2f}  "
                  f"loss increase {m:+.4f} +- {se:.4f}")
        print(f"  {arm} at a time: {len(keys)} units, seeds {seeds}; median standard error of an increase "
              f"{statistics.median(ses):.4f}")
        mean = [statistics.fmean(rise[k]) for k in keys]
        for label, pred in preds.items():
            rho = spearman([pred[k] for k in keys], mean)
            lo, hi = _bootstrap(pred, rise, keys)
            per = " ".join(f"seed {s}: {spearman([pred[k] for k in keys], [rise[k][i] for k in keys]):.2f}"
                           for i, s in enumerate(seeds))
            print(f"  Spearman({label}, loss increase) = {rho:.2f} (95% bootstrap over units {lo:.2f}..{hi:.2f}); {per}")


def keep_report(result, records, base, recipe: str) -> None:
    """The keep list against the module ablation, and the modules' increases against their GEMMs' sum."""
    rise = {k[0]: statistics.fmean(v) for k, v in _increases(records, base, "module").items()}
    if not rise:
        return
    keep = set(result.keep_in_bf16(recipe))
    kept, rest = [v for m, v in rise.items() if m in keep], [v for m, v in rise.items() if m not in keep]
    total = sum(rise.values())
    pairs = [a > b for a in kept for b in rest]
    print(f"  the {len(kept)} kept carry {sum(kept) / total:.0%} of the summed single-module increases (mean "
          f"{statistics.fmean(kept):+.4f} against {statistics.fmean(rest):+.4f}); a kept module's increase exceeds "
          f"an unkept one's in {sum(pairs) / max(len(pairs), 1):.0%} of pairs")
    per_gemm = _increases(records, base, "gemm")
    summed = {m: sum(statistics.fmean(v) for (n, _), v in per_gemm.items() if n == m) for m in rise}
    both = [m for m in rise if sum(1 for n, _ in per_gemm if n == m) == 3]
    if len(both) > 2:
        print(f"  module increase against the sum of its three GEMMs' (additivity): Spearman "
              f"{spearman([rise[m] for m in both], [summed[m] for m in both]):.2f}, slope "
              f"{sum(rise[m] for m in both) / sum(summed[m] for m in both):.2f} over {len(both)} modules")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tinylm", "llama"), default="tinylm")
    p.add_argument("--case", choices=("outlier", "massive", "none"), default="outlier")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--recipe", default="tensorwise")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ablate", action="store_true", help="one module (its three GEMMs) at a time")
    p.add_argument("--ablate-gemms", action="store_true", help="one GEMM of one module at a time")
    p.add_argument("--ablate-seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="the ablations' seeds start here")
    p.add_argument("--only-ablate", action="store_true", help="float32 and the ablations only")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--save", default=None, help="append each run's final loss to this JSONL file")
    p.add_argument("--load", default=None, help="read the runs from this JSONL file instead of training")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from diagnostics import PrecisionOptions, precision

    result = precision(build(args.model, args.case),
                       options=PrecisionOptions(recipes=(args.recipe,), batch_size=BATCH, seq_len=SEQ))
    names, keep = tuple(result.modules), tuple(result.keep_in_bf16(args.recipe))
    print(f"precision ({args.model}, case {args.case}, {args.recipe}): {result}")
    if args.load:
        with open(args.load) as f:
            records = [r for r in map(json.loads, f) if r["model"] == args.model and r["case"] == args.case
                       and r["recipe"] == args.recipe and r["steps"] == args.steps]
        print(f"{len(records)} runs read from {args.load}")
    else:
        print(f"1 thread per run, {args.workers} workers, {args.steps} steps, lr {args.lr:g}, "
              f"seeds 0..{args.seeds - 1}", flush=True)
        records = _run_all(args, names, keep)
    base = _arms(records, args.recipe, keep)
    ablation_report(result, records, base, args.recipe)
    keep_report(result, records, base, args.recipe)


if __name__ == "__main__":
    main()
