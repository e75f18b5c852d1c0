"""Forward+backward time of tinylm's TransformerLM against the same model from torch built-ins.

Usage: python benchmarks/bench_model.py [--preset tinystories] [--batch 4] [--seq 256] [--repeats 7] [--threads N]

Both models hold the same weights (BuiltinLM loads TransformerLM's state dict); both
use the same loss (torch's F.cross_entropy) so only the model differs. Runs
alternate between the two, and the median of each is compared. Prints the ratio
tinylm / built-ins (target <= 1.10).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import tinylm
from tinylm.reference import BuiltinLM


def step(model, x, y):
    model.zero_grad(set_to_none=True)
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tinystories")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    c = tinylm.preset(a.preset)
    ours = tinylm.TransformerLM(c, generator=torch.Generator().manual_seed(0))
    ref = BuiltinLM(c)
    ref.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, c.vocab_size, (a.batch, a.seq), generator=g)
    y = torch.randint(0, c.vocab_size, (a.batch, a.seq), generator=g)
    with torch.no_grad():
        diff = (ours(x) - ref(x)).abs().max().item()
    for m in (ours, ref):  # warm-up
        step(m, x, y)
    times = {"tinylm": [], "builtins": []}
    for _ in range(a.repeats):
        for name, m in (("tinylm", ours), ("builtins", ref)):
            t = time.perf_counter()
            step(m, x, y)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"preset={a.preset} batch={a.batch}x{a.seq} float32 cpu threads={torch.get_num_threads()} "
          f"torch={torch.__version__} repeats={a.repeats} max|logit diff|={diff:.2e}")
    print(f"tinylm    fwd+bwd median {med['tinylm'] * 1e3:8.1f} ms")
    print(f"built-ins fwd+bwd median {med['builtins'] * 1e3:8.1f} ms")
    print(f"ratio tinylm / built-ins = {med['tinylm'] / med['builtins']:.3f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
