"""The watch in a DistributedDataParallel loop: its cost, and the collectives it adds.

Two ranks (spawned CPU processes on gloo, one torch thread each) train the same model in a
plain DDP loop (AdamW, random tokens, each rank its own batches) in two arms: no watch, and
``Watch(ddp, every=K)``. Both arms first run once untimed. Then, round after round, the arms
run in an order drawn by a seeded coin (the same on both ranks); each round times each arm's
steps in wall seconds on rank 0 (a DDP step waits for the slower rank, so wall time is what a
run pays). Printed by rank 0 alone: wall ms per step per arm (medians over rounds), the median
within-round ratio of the watched arm to the plain one with its range (target <= 1.05).

Then, for models of 1, 2 and 4 blocks, one recorded step and one step not recorded with the
collectives of ``torch.distributed`` counted (the watch's ``all_gather`` calls, and the bytes
each rank sends), against the number of watched sites. DDP's own gradient all-reduce runs
in C++ and is not counted.

    python benchmarks/bench_watch_ddp.py                          # the figure to quote
    python benchmarks/bench_watch_ddp.py --steps 10 --rounds 2 --every 5    # a quick check
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _loop(ddp, opt, watch, steps: int, rank: int, config, seed: int) -> float:
    """Wall seconds of ``steps`` steps of the DDP loop (with ``watch`` when not None)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    dist.barrier()
    t0 = time.perf_counter()
    for t in range(steps):
        x = torch.randint(0, config.vocab_size, (8, 17), generator=gen)
        if watch is None:
            loss = F.cross_entropy(ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            continue
        with watch.step(t):
            loss = F.cross_entropy(ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        watch.record(loss, lr=1e-3)
    dist.barrier()
    return time.perf_counter() - t0


def _arm(watched: bool, config, args, rank: int, steps: int, seed: int) -> float:
    import tinylm
    from diagnostics import Watch

    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    watch = Watch(ddp, every=args.every) if watched else None
    try:
        return _loop(ddp, opt, watch, steps, rank, config, seed) / steps
    finally:
        if watch is not None:
            watch.close()


def _collectives(layers: int, rank: int) -> tuple[int, list[int], list[int]]:
    """(sites, [calls, bytes sent by this rank] at a recorded step, the same at a step not recorded)."""
    import tinylm
    from diagnostics import Watch

    config = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=32, num_layers=layers, num_heads=4,
                                d_ff=64)
    ddp = torch.nn.parallel.DistributedDataParallel(tinylm.TransformerLM(config))
    watch = Watch(ddp, every=2)
    seen = [0, 0]
    original = dist.all_gather

    def counting(tensor_list, tensor, *a, **k):
        seen[0] += 1
        seen[1] += tensor.numel() * tensor.element_size()
        return original(tensor_list, tensor, *a, **k)

    dist.all_gather = counting
    out = []
    try:
        for t in range(2):
            seen[:] = [0, 0]
            x = torch.randint(0, 256, (2, 17))
            with watch.step(t):
                F.cross_entropy(ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
            watch.record(1.0)
            out.append(list(seen))
    finally:
        dist.all_gather = original
        watch.close()
    return len(watch.sites), out[0], out[1]


def _rank(rank: int, port: int, args) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    try:
        import tinylm

        config = tinylm.preset(args.preset)
        for watched in (False, True):  # untimed: imports, first calls
            _arm(watched, config, args, rank, args.every, 0)
        times: dict[bool, list[float]] = {False: [], True: []}
        ratios = []
        coin = random.Random(args.seed)
        for r in range(args.rounds):
            order = [False, True] if coin.random() < 0.5 else [True, False]
            got = {w: _arm(w, config, args, rank, args.steps, r + 1) for w in order}
            for w, s in got.items():
                times[w].append(s)
            ratios.append(got[True] / got[False])
        counts = [_collectives(layers, rank) for layers in (1, 2, 4)]
        if rank == 0:
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"2 ranks, gloo, {args.threads} thread(s) each, preset {args.preset}, batch 8 x 16 per rank, "
                  f"{args.steps} steps x {args.rounds} rounds; {os.cpu_count()} CPUs, load average {load}")
            for w, label in ((False, "no watch"), (True, f"every={args.every}")):
                print(f"  {label:<12} {1e3 * statistics.median(times[w]):8.1f} ms/step (wall, rank 0, median)")
            print(f"  ratio every={args.every} / no watch: {statistics.median(ratios):.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f} over {len(ratios)} rounds; target <= 1.05)")
            print("  collectives of the watch per step (all_gather calls, bytes sent per rank):")
            for sites, rec, plain in counts:
                print(f"    {sites:3d} sites: recorded step {rec[0]} call, {rec[1]:,} B; "
                      f"step not recorded {plain[0]} call, {plain[1]:,} B")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=50, help="steps per arm and round (a multiple of --every)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
