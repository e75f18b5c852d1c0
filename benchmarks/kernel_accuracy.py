"""Accuracy of the token-kernel theory (diagnostics.theory.tokenkernel) against measurement at depth 8.

    python benchmarks/kernel_accuracy.py [--arch cs336|gpt2] [--init SCHEME] [--widths 128 256] [--depth 8]
                                         [--seeds 8] [--seq 64] [--batch 8]

For each width: a pre-norm model of the chosen architecture (V = 10000) under the chosen init
scheme (default: the architecture's own) is initialised with seeds 0..n-1 and run on uniform
random tokens (B x T, one batch per seed). --arch cs336: RMSNorm, SwiGLU (d_ff = 8/3 d), RoPE,
no biases, heads = d/32, init cs336. --arch gpt2: GPT-2's block (LayerNorm with bias, tanh-GELU
MLP of width 4d, learned positions, biases, tied embeddings), heads of dimension 64, init gpt2. Per block it prints the measured variance (mean over seeds) of the attention
heads (before output_proj), the attention branch (after it) and the residual stream
(block output), each divided by the kernel prediction (with a 99% t interval over the
seeds) and by the independent-token global prediction (diagnostics.theory.predict), and
the mean cosine between tokens, measured and predicted. One thread; about a minute.
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
from diagnostics.theory.tokenkernel import kernel_theory  # noqa: E402

POINTS = ("heads", "attn", "stream")


def points(block: tinylm.BlockPlan) -> dict[str, str]:
    """{column: tensor name} of one block: the attention heads (before output_proj), the attention
    branch (after it) and the residual stream (the block output)."""
    attn = next(b for b in block.branches() if b.kind == "attn")
    return {"heads": f"{attn.name}.heads", "attn": attn.name, "stream": block.output}


def measure(config: tinylm.ModelConfig, seeds: int, batch: int, seq: int):
    """{tensor name: [variance per seed]}, {residual name: [cosine per seed]}, one model (for the global theory)."""
    var: dict[str, list[float]] = {}
    cos: dict[str, list[float]] = {}
    opts = ProbeOptions(backward=False, attention=False, params=False)
    for s in range(seeds):
        gen = torch.Generator().manual_seed(s)
        model = tinylm.TransformerLM(config, generator=gen)
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        with torch.no_grad(), probe(model, opts) as run:
            model(tokens)
        for (name, direction), m in run.stats.tensors.items():
            if direction == "forward":
                var.setdefault(name, []).append(m.var)
        for name, m in run.stats.cosine.items():
            cos.setdefault(name, []).append(m.mean)
    return var, cos, model


def ratio(values: list[float], predicted: float, level: float = 0.99) -> tuple[float, float]:
    """Mean of measured/predicted over seeds and the half-width of its t interval."""
    r = np.asarray(values) / predicted
    half = stats.t.ppf(0.5 + level / 2, r.size - 1) * r.std(ddof=1) / np.sqrt(r.size) if r.size > 1 else np.nan
    return float(r.mean()), float(half)


ARCHS = ("cs336", "gpt2")


def make_config(arch: str, width: int, depth: int, seq: int, init: str | None = None) -> tinylm.ModelConfig:
    """The benchmark's model of architecture ``arch`` (module doc) at this width, depth and context,
    under ``init`` (None: the architecture's own scheme)."""
    if arch == "cs336":
        config = tinylm.ModelConfig(vocab_size=10000, context_length=seq, d_model=width, num_layers=depth,
                                    num_heads=max(1, width // 32), d_ff=tinylm.default_d_ff(width))
    elif arch == "gpt2":
        config = tinylm.preset("gpt2").replace(vocab_size=10000, context_length=seq, d_model=width,
                                               num_layers=depth, num_heads=max(1, width // 64), d_ff=4 * width)
    else:
        raise ValueError(f"arch={arch!r}: must be one of {', '.join(ARCHS)}")
    return config if init is None else config.replace(init=init)


def report(width: int, depth: int, seeds: int, batch: int, seq: int, arch: str = "cs336",
           init: str | None = None) -> float:
    config = make_config(arch, width, depth, seq, init)
    t0 = time.perf_counter()
    kt = kernel_theory(config, seq)
    t_kernel = time.perf_counter() - t0
    var, cos, model = measure(config, seeds, batch, seq)
    indep = predict(model, "global", seq_len=seq, tokens=batch * seq, forward="independent")
    print(f"\n{arch} architecture, init {config.init}: "
          f"d_model {width}, depth {depth}, heads {config.num_heads}, T {seq}, batch {batch}, {seeds} seeds "
          f"(kernel_theory {t_kernel:.2f} s, {kt.draws} draws per block)")
    print("measured / kernel-predicted [99% t interval over seeds]   measured / independent-token-predicted")
    head = f"{'blk':>3} " + " ".join(f"{k + ' meas':>10} {k + ' kern':>10} {'ratio':>13} {'indep r':>7}" for k in POINTS)
    print(head + f" {'cos meas':>8} {'cos kern':>8}")
    worst = 0.0
    for block in tinylm.plan.build(config).blocks:
        cells = []
        for key, name in points(block).items():
            r, h = ratio(var[name], kt.var(name))
            worst = max(worst, abs(r - 1)) if key in ("attn", "stream") else worst
            cells.append(f"{np.mean(var[name]):10.4g} {kt.var(name):10.4g} {r:6.3f}+-{h:5.3f} "
                         f"{np.mean(var[name]) / indep[(name, 'forward')].var:7.3f}")
        out = block.output
        print(f"{block.index:3d} " + " ".join(cells) + f" {np.mean(cos[out]):8.3f} {kt.cosine[out]:8.3f}")
    print(f"worst |measured/kernel - 1| over the attention branch and the stream: {worst:.3f}")
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=ARCHS, default="cs336")
    ap.add_argument("--init", default=None, help="init scheme (default: the architecture's own)")
    ap.add_argument("--widths", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for width in args.widths:
        report(width, args.depth, args.seeds, args.batch, args.seq, args.arch, args.init)
    return 0


if __name__ == "__main__":
    sys.exit(main())
