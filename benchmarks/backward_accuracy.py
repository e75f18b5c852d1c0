"""Accuracy of the backward token-kernel theory (diagnostics.theory.backkernel) against measurement.

    python benchmarks/backward_accuracy.py [--arch cs336|gpt2] [--untied] [--widths 128 256] [--depths 2 8 24]
        [--norms pre post none] [--schemes-at 128 8] [--seeds 8] [--seq 64] [--batch 8] [--rows]

For each norm placement, width and depth: a model of the chosen architecture (V = 10000) is
initialised with seeds 0..n-1 and run forward and backward on uniform random tokens (one batch
of B x (T+1) per seed, next-token cross-entropy as ``diagnose`` computes it). Every gradient the
probe measures is divided by the prediction of ``diagnostics.predict(model, "global")`` (the
backward kernel, with its validity mark; the cross-entropy rule's premise checked against the measured
softmax, as ``diagnose`` does), averaged over the seeds with a 99% t interval. Then every
registered init scheme at one size (``--schemes-at WIDTH DEPTH``, pre-norm).

--arch cs336 (default): RMSNorm, SwiGLU (d_ff = 8/3 d), RoPE, no biases, heads = d/32, init cs336.
--arch gpt2: GPT-2's block (LayerNorm with bias, tanh-GELU MLP of width 4d, learned positions,
biases, tied embeddings), heads of dimension 64, init gpt2; ``--untied`` unties its embeddings.

Per block it prints one line: measured/predicted for each tensor (``*`` marks a prediction outside
validity), and per configuration the counts: valid and within 10% (|mean ratio - 1| <= 0.10), valid
and outside 10% (the claim is that there are none), invalid and yet within 10%, invalid and outside,
and exact zeros (predicted 0, measured 0: a zero-residual branch). ``--rows`` prints one line per
(block, tensor) with its interval instead. One thread; prints its run time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scipy import stats  # noqa: E402

import tinylm  # noqa: E402
from diagnostics import ProbeOptions, predict, probe  # noqa: E402

#: the tensors of a block, as the columns print them (branch outputs stand for output_proj and w2)
COLUMNS = ("ln1", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.scores", "attn.probs", "attn.heads", "attn",
           "resid_mid", "ln2", "ffn.w1", "ffn.w3", "ffn.hidden", "ffn", "")
SHORT = {"ln1": "ln1", "attn.q_proj": "q", "attn.k_proj": "k", "attn.v_proj": "v", "attn.scores": "scores",
         "attn.probs": "probs", "attn.heads": "heads", "attn": "attn", "resid_mid": "mid", "ln2": "ln2",
         "ffn.w1": "w1", "ffn.w3": "w3", "ffn.hidden": "hidden", "ffn": "ffn", "": "out"}
DELTA = 0.10


ARCHS = ("cs336", "gpt2")


def config(width: int, depth: int, seq: int, norm: str = "pre", scheme: str | None = None, arch: str = "cs336",
           untied: bool = False) -> tinylm.ModelConfig:
    """The benchmark's model of architecture ``arch`` (module doc); ``scheme`` None: the architecture's own."""
    if arch == "gpt2":
        cfg = tinylm.preset("gpt2").replace(vocab_size=10000, context_length=seq, d_model=width, num_layers=depth,
                                            num_heads=max(1, width // 64), d_ff=4 * width, norm=norm,
                                            tie_embeddings=not untied)
    else:
        cfg = tinylm.ModelConfig(vocab_size=10000, context_length=seq, d_model=width, num_layers=depth,
                                 num_heads=max(1, width // 32), d_ff=tinylm.default_d_ff(width), norm=norm)
    return cfg if scheme is None else cfg.replace(init=scheme)


def measure(cfg: tinylm.ModelConfig, seeds: int, batch: int, seq: int):
    """{tensor name: [gradient variance per seed]}, the last model and the softmax's (E[sum_c p_c^2], E[p_y])
    over every position and seed (the cross-entropy rule's premise, checked as ``diagnose`` does)."""
    var: dict[str, list[float]] = {}
    s2, py = [], []
    opts = ProbeOptions(backward=True, attention=False, params=False, cosine=False)
    for s in range(seeds):
        gen = torch.Generator().manual_seed(s)
        model = tinylm.TransformerLM(cfg, generator=gen)
        data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
        with probe(model, opts) as run:
            logits = model(data[:, :-1])
            tinylm.functional.cross_entropy(logits.float(), data[:, 1:]).backward()
        p = torch.softmax(logits.detach().double(), dim=-1)
        s2.append(float((p * p).sum(-1).mean()))
        py.append(float(p.gather(-1, data[:, 1:, None]).mean()))
        for (name, direction), m in run.stats.tensors.items():
            if direction == "backward":
                var.setdefault(name, []).append(m.var)
    return var, model, (float(np.mean(s2)), float(np.mean(py)))


def ratio(values: list[float], predicted: float, level: float = 0.99) -> tuple[float, float]:
    """Mean of measured/predicted over seeds and the half-width of its t interval."""
    r = np.asarray(values) / predicted
    half = stats.t.ppf(0.5 + level / 2, r.size - 1) * r.std(ddof=1) / np.sqrt(r.size) if r.size > 1 else np.nan
    return float(r.mean()), float(half)


def names(block: tinylm.BlockPlan) -> dict[str, str]:
    return {col: f"{block.name}.{col}" if col else block.output for col in COLUMNS}


def report(cfg: tinylm.ModelConfig, seeds: int, batch: int, seq: int, rows: bool) -> dict[str, int]:
    t0 = time.perf_counter()
    var, model, softmax = measure(cfg, seeds, batch, seq)
    t1 = time.perf_counter()
    pred = predict(model, "global", seq_len=seq, tokens=batch * seq, softmax=softmax)
    t2 = time.perf_counter()
    tied = " tied" if cfg.tie_embeddings else ""
    print(f"\n{cfg.norm}-norm {cfg.norm_kind}-norm {cfg.ffn} {cfg.init}{tied}, d_model {cfg.d_model}, "
          f"depth {cfg.num_layers}, heads {cfg.num_heads}, "
          f"T {seq}, batch {batch}, {seeds} seeds (measure {t1 - t0:.1f} s, predict {t2 - t1:.1f} s)")
    counts = dict.fromkeys(("valid_in", "valid_out", "invalid_in", "invalid_out", "zero"), 0)
    indep: list[float] = []
    worst_valid = 0.0
    seen: set[str] = set()

    def cell(name: str) -> str:
        nonlocal worst_valid
        p = pred.get((name, "backward"))
        if p is None or name not in var or name in seen:
            return f"{'':>9}"
        seen.add(name)
        m = float(np.mean(var[name]))
        if p.var == 0 and max(abs(v) for v in var[name]) == 0:
            counts["zero"] += 1
            return f"{'0=0':>9}"
        r, h = ratio(var[name], p.var)
        inside = abs(r - 1) <= DELTA
        counts[("valid_" if p.valid else "invalid_") + ("in" if inside else "out")] += 1
        if p.valid:
            worst_valid = max(worst_valid, abs(r - 1))
        if p.independent is not None and p.independent.var > 0:
            indep.append(m / p.independent.var)
        if rows:
            print(f"  {name:28s} {m:10.4g} {p.var:10.4g} {r:7.3f} +- {h:5.3f} {'' if p.valid else 'outside validity'}")
        return f"{r:8.3f}{' ' if p.valid else '*'}"

    if not rows:
        print(f"{'blk':>3} " + "".join(f"{SHORT[c]:>9}" for c in COLUMNS))
    for extra in ("lm_head", "ln_final"):
        line = cell(extra)
        if not rows and line.strip():
            print(f"{extra:>12}{line}")
    for block in reversed(tinylm.plan.build(cfg).blocks):
        cells = [cell(n) for n in names(block).values()]
        if not rows:
            print(f"{block.index:3d} " + "".join(cells))
    plan = tinylm.plan.build(cfg)
    for extra in (plan.input, plan.positions, plan.embedding):
        line = cell(extra) if extra else ""
        if not rows and line.strip():
            print(f"{extra[:18]:>18}{line}")
    total = sum(counts.values())
    print(f"{total} backward tensors: valid within 10% {counts['valid_in']}, valid outside 10% {counts['valid_out']}, "
          f"invalid within 10% {counts['invalid_in']}, invalid outside 10% {counts['invalid_out']}, exact zeros "
          f"{counts['zero']}; worst valid |ratio - 1| {worst_valid:.3f}"
          + (f"; independent-token rules: measured/predicted {min(indep):.3g} to {max(indep):.3g}" if indep else ""))
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=ARCHS, default="cs336")
    ap.add_argument("--untied", action="store_true", help="gpt2: untie the embeddings")
    ap.add_argument("--widths", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 8, 24])
    ap.add_argument("--norms", nargs="+", default=["pre", "post", "none"], choices=["pre", "post", "none"])
    ap.add_argument("--schemes-at", type=int, nargs=2, default=[128, 8], metavar=("WIDTH", "DEPTH"),
                    help="the size at which every registered init scheme is run (pre-norm); 0 0 skips")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rows", action="store_true", help="one line per (block, tensor) with its 99%% interval")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread")
    total = dict.fromkeys(("valid_in", "valid_out", "invalid_in", "invalid_out", "zero"), 0)
    own = config(8, 1, 8, arch=args.arch).init
    grid = [(n, w, L, None) for n in args.norms for w in args.widths for L in args.depths]
    if args.schemes_at[0] > 0:
        grid += [("pre", args.schemes_at[0], args.schemes_at[1], s) for s in tinylm.init.SCHEMES if s != own]
    for norm, width, depth, scheme in grid:
        counts = report(config(width, depth, args.seq, norm, scheme, args.arch, args.untied), args.seeds, args.batch,
                        args.seq, args.rows)
        for k, v in counts.items():
            total[k] += v
    print(f"\nall: valid within 10% {total['valid_in']}, valid outside 10% {total['valid_out']}, invalid within 10% "
          f"{total['invalid_in']}, invalid outside 10% {total['invalid_out']}, exact zeros {total['zero']}; "
          f"{time.perf_counter() - t0:.0f} s on one thread")
    return 1 if total["valid_out"] else 0


if __name__ == "__main__":
    sys.exit(main())
