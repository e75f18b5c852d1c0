"""FSDP2 (``fully_shard``) over gloo, two spawned CPU processes: parameter statistics of the sharded
model equal the unsharded model's (float64 rounding), and nothing raises.

Both ranks see the same batch, so the sharded model's gradients (averaged over the ranks)
are the unsharded model's; the parameter statistics come from the local shards merged over the
mesh (diagnostics.measure.sharded). Each test runs its two workers under a hard deadline: a
hung worker is killed and the test fails, so the suite cannot hang.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

import tinylm
from spawnhelp import run_in_workers

pytestmark = pytest.mark.distributed

#: vocabulary 33: the embedding and the head split unevenly (17 + 16 rows)
CFG = tinylm.ModelConfig(vocab_size=33, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
DEADLINE_S = 120.0  # a loaded machine; each test takes well under 30 s on a quiet one


def _check_in_workers(body: str, limit: float = DEADLINE_S) -> None:
    """``body(rank)`` of this module in two spawned gloo ranks, killed past ``limit`` seconds."""
    run_in_workers(__name__, body, limit)


def _models():
    """(sharded, unsharded): the same weights; the first under fully_shard (each block, then the root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2,))
    plain = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, plain


def _tokens():
    return torch.randint(0, CFG.vocab_size, (4, 9), generator=torch.Generator().manual_seed(7))


def _close(a, b, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, what
    elif math.isnan(a) or math.isnan(b):
        assert math.isnan(a) and math.isnan(b), what
    else:
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15), what


def _same_params(sharded: dict, plain: dict, spectral: bool) -> None:
    assert sharded.keys() == plain.keys()
    for name, p in plain.items():
        s = sharded[name]
        assert s.shape == p.shape, name
        for field in ("std", "grad_std", "frac_nonfinite", "grad_frac_nonfinite", "declared_std"):
            _close(getattr(s, field), getattr(p, field), f"{name}.{field}")
        if spectral and len(p.shape) == 2:  # sharded: not measured, and says so
            assert p.spectral_norm is not None and s.spectral_norm is None and s.stable_rank is None, name
            assert "not measured: needs the full matrix under sharding" in s.note, name
        else:
            _close(s.spectral_norm, p.spectral_norm, name)


def _probe_and_diagnose(rank: int) -> None:
    from diagnostics import diagnose, probe
    from diagnostics.measure.probe import param_stats
    from diagnostics.options import ProbeOptions
    from torch.distributed.tensor import DTensor
    model, plain = _models()
    assert isinstance(model.lm_head.weight, DTensor)
    x = _tokens()
    runs = []
    for m in (model, plain):
        with probe(m, ProbeOptions(params=True, spectral=True)) as run:
            torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        runs.append(run.stats)
    _same_params(runs[0].params, runs[1].params, spectral=True)
    # activations and their gradients are plain tensors on each rank (same batch: the same figures)
    assert runs[0].tensors.keys() == runs[1].tensors.keys()
    for k, mom in runs[1].tensors.items():
        _close(runs[0].tensors[k].std, mom.std, str(k))
    _same_params(param_stats(model), param_stats(plain), spectral=False)  # p.grad: a sharded gradient
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    got, want = diagnose(model, x), diagnose(plain, x)
    for a, b in zip(got.params, want.params):
        assert a.name == b.name
        for field in ("std", "grad_std", "frac_nonfinite", "drift"):
            _close(getattr(a, field), getattr(b, field), f"{a.name}.{field}")


def _meshes(rank: int) -> None:
    """Replicate counted once, a 2-D mesh over the job's ranks, Partial not measured."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from diagnostics.measure import reference, sharded
    from diagnostics.measure.reducer import reduce
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(3)) * 2 + 0.5
    want = reference.moments(x)
    one = init_device_mesh("cpu", (2,))
    two = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replica", "shard"))
    cases = [distribute_tensor(x, one, [Replicate()]), distribute_tensor(x, one, [Shard(1)]),
             distribute_tensor(x, two, [Replicate(), Shard(0)])]
    got = sharded.moments(cases + [x], lambda t: reduce(t).moments)  # one collective per mesh
    for v in got:
        assert v is not None
        assert v[[0, 1, 4, 5]].tolist() == want[[0, 1, 4, 5]].tolist()
        assert torch.allclose(v[2:4], want[2:4], rtol=1e-12, atol=0)
    partial = DTensor.from_local(x / 2, one, [Partial()])
    assert sharded.moments([partial], lambda t: reduce(t).moments) == [None]
    assert reduce(partial).measured is False


def _update_ratios(rank: int) -> None:
    """Update ratios from the local shards equal the unsharded model's."""
    from diagnostics.measure import sharded
    model, plain = _models()
    x = _tokens()
    ratios = []
    for m in (model, plain):
        params = dict(m.named_parameters())
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        before = {n: p.detach().clone() for n, p in params.items()}
        torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        ratios.append(sharded.update_ratios(params, before))
    assert ratios[0].keys() == ratios[1].keys()
    for n, r in ratios[1].items():
        assert r > 0
        _close(ratios[0][n], r, n)


def _sharded_primitives(rank: int) -> None:
    _meshes(rank)
    _update_ratios(rank)


def _watch(rank: int) -> None:
    """The watch records steps of a sharded model."""
    from diagnostics import Watch
    model, _ = _models()
    x = _tokens()
    watch = Watch(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(3):
        with watch.step(t):
            loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        watch.record(loss.item(), lr=0.1)
    assert len(watch.history["records"]) == 3
    assert all(r > 0 for r in watch.history["records"][-1]["update_ratio"].values())
    watch.close()


def _hang(rank: int) -> None:
    time.sleep(3600)


@pytest.mark.slow
def test_a_hung_worker_is_killed_at_the_deadline():
    """Negative control of the harness: workers that never finish fail the test in time."""
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish"):
        _check_in_workers("_hang", limit=20.0)
    assert time.monotonic() - start < 40.0


#: the checks, run one after another in one pair of spawned ranks (a spawn costs more than them all)
CHECKS = ("_probe_and_diagnose", "_sharded_primitives", "_watch")


def _checks(rank: int) -> None:
    """Every check of :data:`CHECKS`; each one's failure is kept and all are raised together."""
    failed = []
    for name in CHECKS:
        try:
            globals()[name](rank)
        except Exception as e:  # noqa: BLE001 - reported below, with the check's name
            failed.append(f"{name}: {type(e).__name__}: {e}")
    assert not failed, f"rank {rank}: " + " | ".join(failed)


def test_fsdp2_statistics_primitives_and_watch():
    """Parameter statistics of the sharded model equal the unsharded model's (probe and diagnose);
    the sharded moments and update ratios merge over the mesh; the watch records sharded steps."""
    _check_in_workers("_checks")


def test_one_failing_check_fails_the_run_and_is_named():
    """Negative control of :func:`_checks`: a failing check is reported by name, the others still run."""
    ran = []
    saved = {n: globals()[n] for n in CHECKS}
    try:
        globals()["_probe_and_diagnose"] = lambda rank: ran.append("a") or (_ for _ in ()).throw(ValueError("off"))
        globals()["_sharded_primitives"] = lambda rank: ran.append("b")
        globals()["_watch"] = lambda rank: ran.append("c")
        with pytest.raises(AssertionError, match="_probe_and_diagnose: ValueError: off"):
            _checks(0)
    finally:
        globals().update(saved)
    assert ran == ["a", "b", "c"]
