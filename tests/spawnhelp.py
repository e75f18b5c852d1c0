"""Two gloo ranks spawned for a test, bounded in time: ``run_in_workers(__name__, "body")`` runs
``body(rank)`` of the calling test module in each (its assertions are the check)."""

from __future__ import annotations

import importlib
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, module: str, body: str, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        getattr(importlib.import_module(module), body)(rank)
    finally:
        dist.destroy_process_group()


def run_in_workers(module: str, body: str, limit: float) -> None:
    """Run ``module.body(rank)`` in two spawned processes: a worker's failure is raised here; past
    ``limit`` seconds the workers are killed and the test fails."""
    ctx = mp.start_processes(_entry, args=(module, body, free_port()), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + limit
    try:
        while not ctx.join(timeout=1.0):  # raises when a worker raised
            if time.monotonic() > deadline:
                pytest.fail(f"{body}: the workers did not finish within {limit:.0f} s (killed)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
