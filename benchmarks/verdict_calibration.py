"""The healthy models the diagnose thresholds are calibrated on, and what each measures.

For every model of the healthy set (six init schemes x depth 2-48 x width 64-1024 x sequence
length 16-1024 at init, the FFN / RoPE ablations, shallow post-norm, scaled no-norm, gpt2-small
with the gpt2 init, pre-norm models after short ordinary training, and plain nanoGPT-style
modules of 2, 4 and 6 blocks trained at lr 1e-2) it prints the numbers
each threshold of :class:`diagnostics.Thresholds` is compared with, then, per statistic, the
most extreme healthy value beside the threshold, and the findings: the false-alarm rate on
this set is the share of its models with any finding (with the 95% upper bound 3/N when none
has one). docs/verdicts.md quotes its output.

    python benchmarks/verdict_calibration.py            # the whole set (32 minutes on a shared 2-core machine)
    python benchmarks/verdict_calibration.py --quick    # the models up to width 256
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tinylm  # noqa: E402
from diagnostics import DiagnoseOptions, Thresholds, diagnose  # noqa: E402
from diagnostics.judge.evidence import evidence  # noqa: E402
from tinylm.plan import branch_stream  # noqa: E402

SCHEMES = tuple(tinylm.init.SCHEMES)


def _cfg(d, L, T, norm="pre", init="cs336", ffn="swiglu", rope=True, V=512):
    heads = max(1, d // 64) if d >= 128 else 4
    return tinylm.ModelConfig(vocab_size=V, context_length=max(T, 16), d_model=d, num_layers=L, num_heads=heads,
                              d_ff=tinylm.default_d_ff(d), norm=norm, init=init, ffn=ffn, positions="rope" if rope else "none")


def healthy_set(quick: bool):
    """(label, build, seq_len, batch_size) of every healthy model."""
    shapes = [(64, 2, 16), (64, 12, 128), (64, 48, 16), (256, 6, 1024), (256, 24, 64), (128, 8, 256)]
    if not quick:
        shapes += [(1024, 2, 128), (1024, 4, 16)]
    out = []
    for i, (d, L, T) in enumerate(shapes):
        for j, s in enumerate(SCHEMES):
            out.append((f"pre {s} d{d} L{L} T{T}", (lambda c=_cfg(d, L, T, init=s), k=10 * i + j: tinylm.TransformerLM(
                c, generator=torch.Generator().manual_seed(k))), T, 1))
    variants = [(64, 4, 64, "pre", "silu", True, "cs336"), (128, 12, 64, "pre", "swiglu", False, "cs336"),
                (128, 6, 64, "pre", "silu", False, "gpt2"), (64, 2, 16, "post", "swiglu", True, "cs336"),
                (128, 4, 64, "post", "swiglu", True, "cs336"), (128, 6, 64, "post", "swiglu", True, "gpt2"),
                (64, 6, 128, "post", "swiglu", True, "small-init"),
                (128, 6, 64, "post", "swiglu", True, "torch-default"),
                (64, 8, 32, "none", "swiglu", True, "small-init"),
                (64, 24, 32, "none", "swiglu", True, "zero-residual")]
    for (d, L, T, norm, ffn, rope, s) in variants:
        out.append((f"{norm} {ffn}{'' if rope else ' NoPE'} {s} d{d} L{L} T{T}",
                    (lambda c=_cfg(d, L, T, norm=norm, init=s, ffn=ffn, rope=rope):
                     tinylm.TransformerLM(c, generator=torch.Generator().manual_seed(7))), T, 1))
    for T in ((128,) if quick else (128, 256, 1024)):
        out.append((f"gpt2-small gpt2 T{T}", lambda: tinylm.TransformerLM(
            tinylm.config.preset("gpt2-small", init="gpt2"), generator=torch.Generator().manual_seed(0)), T, 1))
    trained = [(64, 3, 16, "swiglu", "cs336", 60, 3e-3), (128, 4, 64, "swiglu", "cs336", 150, 1e-2),
               (128, 4, 64, "silu", "gpt2", 150, 3e-3), (64, 8, 32, "swiglu", "small-init", 150, 3e-3),
               (128, 6, 32, "swiglu", "kaiming", 100, 3e-3)]
    for (d, L, T, ffn, s, steps, lr) in trained:
        def build(d=d, L=L, T=T, ffn=ffn, s=s, steps=steps, lr=lr):
            from tinylm.data import stdlib_corpus
            from tinylm.train import TrainOptions, train

            m = tinylm.TransformerLM(_cfg(d, L, T, init=s, ffn=ffn, V=256), generator=torch.Generator().manual_seed(1))
            train(m, stdlib_corpus(2_000_000), TrainOptions(steps=steps, batch_size=16, lr=lr, watch_every=0))
            return m.eval()
        out.append((f"trained pre {ffn} {s} d{d} L{L} T{T} {steps} steps lr {lr:g}", build, T, 2))
    from benchmarks.verdict_zoo import nanogpt  # plain pre-LayerNorm modules, not tinylm

    for L in (2, 4, 6):
        out.append((f"nanoGPT L{L} T64 trained 200 steps lr 0.01", nanogpt(L, 200, 1e-2), 64, 2))
    return out


def _runs(gains, n):
    """The largest value that n consecutive gains all exceed (all of them when fewer)."""
    n = min(n, len(gains))
    if len(gains) < 2:
        return math.nan
    return max(min(gains[j:j + n]) for j in range(len(gains) - n + 1))


def measure(build, T, batch):
    """Diagnose one model; the numbers each threshold reads, and its findings."""
    import importlib

    dmod = importlib.import_module("diagnostics.jobs.diagnose")  # the module (its name is shadowed by the function)
    seen = {}
    real = dmod.judge

    def spy(*a, **k):
        seen["flat"] = k.get("flat")
        return real(*a, **k)

    dmod.judge = spy
    try:
        m = build()
        r = diagnose(m, options=DiagnoseOptions(batch_size=batch, seq_len=T, batches=2, theory="none"))
    finally:
        dmod.judge = real
    th = Thresholds()
    arch = dmod._architecture(m, dmod.model_sites(m).blocks)
    ev = evidence(r.tensors, r.params, arch, seen.get("flat"), set(), r.depth, r.header.fresh)
    fwd = [d.forward_var for d in r.depth]
    bwd = [d.backward_var for d in r.depth]
    config = getattr(m, "config", None)
    if dmod._scale_invariant(m, arch):  # as diagnose judges it
        bwd = [b * f for b, f in zip(bwd, fwd)]
    fg = [b / a for a, b in zip(fwd, fwd[1:])]
    bg = [bwd[i] / bwd[i + 1] for i in range(len(bwd) - 1)]
    rows = {(t.name, t.direction): t for t in r.tensors}
    zero = getattr(config, "init", None) == "zero-residual"
    branch = [t.var / rows[(branch_stream("attn" if t.kind == "attn_branch" else "ffn", t.block), "forward")].var
              for t in r.tensors if t.direction == "forward" and t.kind in ("attn_branch", "ffn_branch") and not zero]
    top = max(p.grad_std for p in r.params if p.grad_std and len(p.shape) == 2)
    grads = [g / top for g in ev.grad_medians.values()] if not zero else []
    return {
        "fwd_run": _runs(fg, th.exploding_run), "bwd_run": _runs(bg, th.exploding_run),
        "fwd_max": max(fg), "bwd_max": max(bg),
        "shrink": min(max(g[j:j + min(th.exploding_run, len(g))]) for g in (fg, bg)
                      for j in range(len(g) - min(th.exploding_run, len(g)) + 1)),
        "branch": min(branch, default=math.nan), "grads": min(grads, default=math.nan),
        "score": max(ev.score_ratio.values(), default=math.nan), "flat": max(ev.flat.values(), default=0.0),
        "gain": ev.gain_all, "gain_inner": ev.gain_inner, "drift": ev.drift, "qk": max(ev.qk_gain.values(), default=0),
        "imbalance": ev.imbalance if getattr(config, "norm", None) == "post" else math.nan,
        "saturated": max((a.saturated_frac for a in r.attention), default=0.0),
        "fresh": ev.fresh, "findings": [f"{f.cause}/{f.severity}" for f in r.findings],
        "misscaled": [k["kind"] for k in r.header.kinds if k["state"] == "misscaled"],
    }


#: (statistic, which side is extreme, the threshold it is compared with, words)
COMPARED = [
    ("fwd_run", max, "exploding_gain", "forward: largest gain a run of exploding_run blocks all exceed"),
    ("bwd_run", max, "exploding_gain", "backward: the same (pre-norm: on Var(g) Var(x))"),
    ("fwd_max", max, None, "forward: largest single block gain (linear growth, not judged)"),
    ("bwd_max", max, None, "backward: largest single block gain (not judged)"),
    ("shrink", min, "vanishing_gain", "smallest gain a run of blocks stays under"),
    ("branch", min, "vanishing_branch", "smallest branch / stream variance"),
    ("grads", min, "vanishing_grad", "smallest block median weight-gradient std / largest"),
    ("score", max, "score_ratio", "largest E[s^2]/(E[q^2]E[k^2]) (judged at init only)"),
    ("flat", max, "dead_flat", "largest fraction of SiLU inputs below -6"),
    ("gain", max, "init_gain_high", "median std^2 fan_in of the block weights, largest"),
    ("gain_inner", min, "init_gain_low", "the same without residual outputs, smallest"),
    ("qk", max, "init_gain_high", "q/k weights' gain, largest"),
    ("drift", max, "init_drift", "median std / declared std, largest"),
    ("imbalance", max, "post_norm_imbalance", "post-norm gradient imbalance, largest"),
    ("saturated", max, "saturated_rows", "largest fraction of saturated query rows"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the models up to width 256 (a few minutes)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    models = healthy_set(args.quick)
    print(f"healthy set: {len(models)} models; torch threads {torch.get_num_threads()}")
    results = []
    t0 = time.perf_counter()
    for label, build, T, batch in models:
        s = measure(build, T, batch)
        results.append((label, s))
        print(f"{label:46s} run fwd {s['fwd_run']:5.2f} bwd {s['bwd_run']:5.2f}  score {s['score']:5.2f}  "
              f"gain {s['gain']:.3g}/{s['gain_inner']:.3g}  sat {s['saturated']:.2f}  "
              f"{', '.join(s['findings']) or 'healthy'}"
              + (f"  misscaled kinds: {', '.join(s['misscaled'])}" if s["misscaled"] else ""), flush=True)
    th = Thresholds()
    print(f"\n{'statistic':64s} {'healthy extreme':>15s}  threshold")
    for key, side, name, words in COMPARED:
        vals = [s[key] for _, s in results
                if s[key] is not None and not (isinstance(s[key], float) and math.isnan(s[key]))]
        if not vals:
            continue
        print(f"{words:64s} {side(vals):15.3g}  {'' if name is None else f'{name} = {getattr(th, name):g}'}")
    alarms = [(label, s["findings"]) for label, s in results if s["findings"]]
    misscaled = sum(bool(s["misscaled"]) for _, s in results)
    print(f"\nmodels with a weight kind called misscaled: {misscaled}/{len(results)}")
    n = len(results)
    rate = f"{len(alarms)}/{n}" + (f" (95% upper bound {3 / n:.1%}, rule of three)" if not alarms else "")
    print(f"\nfalse alarms on the healthy set: {rate}; {time.perf_counter() - t0:.0f} s")
    for label, f in alarms:
        print(f"  {label}: {', '.join(f)}")
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())
