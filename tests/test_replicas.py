"""check_replicas over gloo, two spawned CPU processes under a hard deadline: after a DDP step (its
forward and backward replayed on both ranks: identical) and
an FSDP2 (HSDP: a replicated mesh dimension) step the replicas agree; one exponent bit (or the last
mantissa bit) of one element flipped on rank 1 is found, at that parameter, on both ranks."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import tinylm
from diagnostics.jobs.replay import replay
from diagnostics.jobs.replicas import check_replicas
from diagnostics.measure.bits import flip_exponent_bit
from diagnostics.measure.wrappers import unwrap
from spawnhelp import run_in_workers

pytestmark = pytest.mark.distributed

CFG = tinylm.ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
DEADLINE_S = 150.0
TARGET = "layers.1.ffn.w1.weight"


def _check_in_workers(body: str, limit: float = DEADLINE_S) -> None:
    """``body(rank)`` of this module in two spawned gloo ranks, killed past ``limit`` seconds."""
    run_in_workers(__name__, body, limit)


def _step(model, rank, replayed=False):
    """One SGD step on rank's batch; ``replayed``: its forward and backward through replay first
    (both ranks replay: DDP's all-reduce runs in both executions), which must be identical."""
    x = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank))

    def fn():
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        return loss
    if replayed:
        r = replay(model, fn)
        assert r.verdict == "identical", str(r)
    else:
        fn()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.1)


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _flip_and_check(model, rank, how):
    """Rank 1 corrupts one element of TARGET; both ranks must name rank 1 and TARGET."""
    if rank == 1:
        with torch.no_grad():
            t = _local(dict(unwrap(model).named_parameters())[TARGET])
            if how == "exponent":
                flip_exponent_bit(t, 3, 0)
            else:  # the last mantissa bit: one ulp
                ints = t.view(torch.int32).reshape(-1)
                ints[3] ^= 1
    r = check_replicas(model, step=1)
    assert r.verdict == "departs", str(r)
    assert [(d.rank, d.parameter) for d in r.departures] == [(1, TARGET)], str(r)
    assert str(r).startswith("step 1: rank 1 departs from rank 0 at " + TARGET)


def ddp_body(rank):
    model = torch.nn.parallel.DistributedDataParallel(
        tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0)))
    _step(model, rank, replayed=True)
    r = check_replicas(model)
    assert r.verdict == "agree" and r.ranks == 2 and r.parameters == len(list(model.parameters())), str(r)
    _flip_and_check(model, rank, "exponent")
    with torch.no_grad():  # undo: the replicas agree again, then one ulp
        t = _local(dict(model.module.named_parameters())[TARGET])
        if rank == 1:
            flip_exponent_bit(t, 3, 0)
    assert check_replicas(model).verdict == "agree"
    _flip_and_check(model.module, rank, "ulp")


def hsdp_body(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _step(model, rank)
    r = check_replicas(model)
    assert r.verdict == "agree" and r.ranks == 2 and not r.skipped, str(r)
    _flip_and_check(model, rank, "exponent")
    # fully sharded (no replicated dimension): nothing is held twice; not measured, never "agree"
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    r = check_replicas(model)
    assert r.verdict == "not measured" and r.agree is None and len(r.skipped) > 0, str(r)


def both_body(rank):
    ddp_body(rank)
    hsdp_body(rank)


def test_ddp_and_hsdp_replicas_agree_and_a_flipped_bit_is_named_fully_sharded_is_not_measured():
    _check_in_workers("both_body")  # one pair of interpreters for both: starting them is most of the time


def test_one_process_is_not_measured():
    r = check_replicas(tinylm.TransformerLM(CFG))
    assert r.verdict == "not measured" and "not measured" in str(r)
