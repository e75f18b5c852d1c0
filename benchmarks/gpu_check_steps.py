"""The steps of ``benchmarks/gpu_check.sh`` that no other benchmark takes: the watch's cost on a
device, the device-to-host transfers of a watched step, and a two-rank NCCL merge.

    python benchmarks/gpu_check_steps.py watch [--device cuda] [--preset tinystories] [--every 25]
    python benchmarks/gpu_check_steps.py transfers [--device cuda] [--preset tinystories] [--every 5]
    python benchmarks/gpu_check_steps.py nccl

Each prints what it measured and, last, one line ``RESULT key=value ...`` that the script
copies into its summary. Exit status 0: measured (and, for ``transfers`` and ``nccl``, the
check held); 1: a check failed; 2: no CUDA device for ``--device cuda``; 3: skipped (the
reason on the RESULT line).

``watch``: the same training loop (AdamW, random tokens, wall time with the device
synchronised at the end of every step) without the watch and with ``Watch(model, every=K)``,
in alternating order, rounds of ``--steps`` steps; the figure is the median over rounds of
the within-round ratio of time per step (target <= 1.05 as on the CPU).

``transfers``: :class:`diagnostics.measure.transfers.TransferCounter` counts, per step of a watched
loop, the calls of ``aten._local_scalar_dense`` (``.item()``, ``float(t)``: each a device sync)
and the copies whose source is on the device and whose result is on the CPU. Reported per
recorded and per unrecorded step, against the number of blocks. The check: a step the watch
does not record makes no more transfers than the same step without the watch (the optimizer's
own, e.g. AdamW's step counts on the CPU, are in both), and a recorded step adds fewer than one
per block to it (the records move in a few packed transfers, not one per layer). While the
counter is entered, ``torch.compile``d reductions run their ops eagerly (dynamo steps aside
for an active dispatch mode; checked on torch 2.11 with CUDA): the transfers are the same.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from diagnostics.measure.transfers import TransferCounter  # noqa: E402

def _reads(c: TransferCounter, device: str) -> tuple[int, int]:
    """(scalar reads, copies to the CPU) that count on ``device``: on the CPU, where nothing
    synchronises, its scalar reads stand in for a device's."""
    return (c.on_device["item"] if device != "cpu" else c.counts["item"]), c.counts["to_cpu"]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _setup(args):
    import tinylm

    config = tinylm.preset(args.preset)
    if args.seq:
        config = config.replace(context_length=args.seq)
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0)).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)

    def batch():
        x = torch.randint(0, config.vocab_size, (args.batch, config.context_length + 1), generator=gen)
        x = x.to(args.device)
        return x[:, :-1], x[:, 1:]
    return model, opt, batch, config


def _train_step(model, opt, batch, watch=None, t: int = 0) -> None:
    from tinylm import functional as F

    x, y = batch()
    if watch is None:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        float(loss.detach())
    else:
        with watch.step(t):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        watch.record(loss, lr=1e-3)


def cmd_watch(args) -> int:
    from diagnostics import Watch

    model, opt, batch, config = _setup(args)

    def arm(watched: bool) -> float:
        watch = Watch(model, every=args.every) if watched else None
        _sync(args.device)
        t0 = time.perf_counter()
        for t in range(args.steps):
            _train_step(model, opt, batch, watch, t)
            _sync(args.device)
        took = (time.perf_counter() - t0) / args.steps
        if watch is not None:
            watch.close()
        return took

    arm(False), arm(True)  # warm-up: first calls, the probe's compiled reductions
    ratios, plain, watched = [], [], []
    coin = random.Random(0)
    for _ in range(args.rounds):
        order = [False, True] if coin.random() < 0.5 else [True, False]
        got = {w: arm(w) for w in order}
        plain.append(got[False])
        watched.append(got[True])
        ratios.append(got[True] / got[False])
    r = statistics.median(ratios)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"preset {args.preset}, batch {args.batch} x {config.context_length}, {where}, torch {torch.__version__}, "
          f"{args.rounds} rounds of {args.steps} steps, watch every {args.every}")
    print(f"step without the watch {statistics.median(plain) * 1e3:.2f} ms, "
          f"with it {statistics.median(watched) * 1e3:.2f} ms (medians); "
          f"within-round ratios {', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"RESULT every={args.every} watch_ratio={r:.3f} plain_ms={statistics.median(plain) * 1e3:.2f} "
          f"watched_ms={statistics.median(watched) * 1e3:.2f} target=1.05 {'met' if r <= 1.05 else 'not_met'}")
    return 0


def cmd_transfers(args) -> int:
    from diagnostics import Watch

    model, opt, batch, config = _setup(args)
    layers = config.num_layers
    for t in range(2):  # warm-up outside the counter: first calls and compiled reductions
        _train_step(model, opt, batch)
    warm = Watch(model, every=1)
    _train_step(model, opt, batch, warm, 0)
    warm.close()
    plain = TransferCounter()
    with plain:
        _train_step(model, opt, batch)
    watch = Watch(model, every=args.every)
    recorded, unrecorded = [], []
    for t in range(2 * args.every):
        counter = TransferCounter()
        with counter:
            _train_step(model, opt, batch, watch, t)
        (recorded if t % args.every == 0 else unrecorded).append(_reads(counter, args.device))
    watch.close()
    base = sum(_reads(plain, args.device))
    rec = max(recorded, key=sum)
    unrec = max(unrecorded, key=sum)
    extra_rec, extra_unrec = sum(rec) - base, sum(unrec) - base  # the watch's own
    ok_unrec = extra_unrec <= 0
    ok_rec = extra_rec < layers
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"preset {args.preset} ({layers} blocks), batch {args.batch} x {config.context_length}, {where}, "
          f"watch every {args.every}")
    print(f"plain step: {plain.on_device['item']} scalar reads of device tensors, {plain.counts['to_cpu']} "
          f"device-to-host copies, {plain.counts['item'] - plain.on_device['item']} scalar reads of CPU tensors")
    print(f"recorded steps (scalar reads, copies): {recorded}")
    print(f"unrecorded steps (scalar reads, copies): {unrecorded}")
    print(f"RESULT layers={layers} plain={base} recorded_scalars={rec[0]} recorded_copies={rec[1]} "
          f"unrecorded_scalars={unrec[0]} unrecorded_copies={unrec[1]} watch_extra_recorded={extra_rec} "
          f"watch_extra_unrecorded={extra_unrec} unrecorded_le_plain={'yes' if ok_unrec else 'no'} "
          f"recorded_extra_lt_layers={'yes' if ok_rec else 'no'}")
    return 0 if ok_unrec and ok_rec else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    import tinylm
    from diagnostics import merge_distributed, probe

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        cfg = tinylm.ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)
        model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0)).cuda(rank)
        x = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(7))[2 * rank: 2 * rank + 2].cuda(rank)
        with probe(model) as run:
            model(x[:, :-1]).sum().backward()
        torch.save(merge_distributed(run.stats).to_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def cmd_nccl(args) -> int:
    import tempfile

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from diagnostics import ProbeStats

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2 or not dist.is_available() or not dist.is_nccl_available():
        why = f"{n} CUDA device(s)" if n < 2 else "this torch has no NCCL"
        print(f"RESULT skipped reason=\"{why}; the two-rank NCCL merge needs two GPUs\"")
        return 3
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_nccl_worker, args=(_free_port(), d), nprocs=2, join=True)
        r0 = ProbeStats.from_dict(torch.load(os.path.join(d, "rank0.pt"), weights_only=False))
        r1 = ProbeStats.from_dict(torch.load(os.path.join(d, "rank1.pt"), weights_only=False))
    same = r0.tensors == r1.tensors and len(r0.tensors) > 0
    print(f"RESULT ranks=2 same_on_every_rank={'yes' if same else 'no'} sites={len(r0.tensors)}")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, every, steps in (("watch", 25, 50), ("transfers", 5, 0)):
        s = sub.add_parser(name)
        s.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
        s.add_argument("--preset", default="tinystories")
        s.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's context)")
        s.add_argument("--batch", type=int, default=8)
        s.add_argument("--every", type=int, default=every)
        s.add_argument("--threads", type=int, default=None)
        if name == "watch":
            s.add_argument("--steps", type=int, default=steps, help="steps per arm and round")
            s.add_argument("--rounds", type=int, default=5)
    sub.add_parser("nccl")
    args = p.parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; pass --device cpu",
              file=sys.stderr)
        return 2
    return {"watch": cmd_watch, "transfers": cmd_transfers, "nccl": cmd_nccl}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
