"""The watch's host transfers per step, on the GPU when there is one (else the CPU).

For tinylm models of 1 and 4 blocks, a loop of two steps (step 0 recorded, step 1 not) is run
with ``Watch(model, every=2)`` and without a watch, each step inside a
:class:`diagnostics.measure.transfers.TransferCounter`; printed: the counts with the watch,
without it, and the difference (the watch's own), by kind. The watch's own should be 1 at a
recorded step whatever the depth (the loss, every site's moments and the update ratios in
one vector), and at a step not recorded 1 for a loss given as a tensor (its read), 0 for a
float. Counts, not timings: meaningful on any machine.

    python benchmarks/bench_transfers.py [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter

import torch
import torch.nn.functional as F


def _loop(layers: int, watched: bool, device: str, tensor_loss: bool) -> list[Counter]:
    import tinylm
    from diagnostics import Watch
    from diagnostics.measure.transfers import TransferCounter

    cfg = tinylm.ModelConfig(vocab_size=256, context_length=64, d_model=128, num_layers=layers, num_heads=4,
                             d_ff=512)
    model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0)).to(device)
    watch = Watch(model, every=2) if watched else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for t in range(2):
        x = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(t)).to(device)
        with TransferCounter() as c:
            with watch.step(t) if watch is not None else contextlib.nullcontext():
                loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
            if watch is not None:
                watch.record(loss if tensor_loss else 1.0)
        out.append(c.counts)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    print(f"device {args.device}" + (f" ({torch.cuda.get_device_name(0)})" if args.device.startswith("cuda") else ""))
    for layers in (1, 4):
        for tensor_loss in (True, False):
            _loop(layers, True, args.device, tensor_loss)  # untimed first calls (kernels, compiled reductions)
            with_watch = _loop(layers, True, args.device, tensor_loss)
            without = _loop(layers, False, args.device, tensor_loss)
            for t, what in enumerate(("recorded", "not recorded")):
                own = with_watch[t].copy()
                own.subtract(without[t])
                print(f"  {layers} block(s), loss as {'tensor' if tensor_loss else 'float '}, step {what:<12}: "
                      f"with watch {dict(with_watch[t])}, without {dict(without[t])}, "
                      f"the watch's own {sum(own.values())} {dict(+own)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
