"""The spectral figures of many matrices from one transfer to the host: batched by shape, the same
figures as each matrix alone, NaN where they cannot be computed.

On a GPU each host read is a sync; ``param_stats(spectral=True)`` (every ``diagnose``) used three
per matrix. Counted exactly with :class:`diagnostics.measure.opcount.OpCount` (CPU tensors
standing in); the negative control, one matrix at a time, reads once per matrix."""

from __future__ import annotations

import math

import torch

from diagnostics.measure import params
from diagnostics.measure.opcount import OpCount


def _mats(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(*shape, generator=g) * scale for shape in [(16, 16), (40, 8), (8, 40), (16, 16), (1, 5)]
           for scale in (1.0, 3e-3, 5e4)]
    bad = torch.randn(6, 6, generator=g)
    bad[2, 3] = math.inf
    return out + [torch.zeros(3, 4), bad, torch.randn(6, 6, generator=g, dtype=torch.float64)]


def _same(a, b) -> bool:
    return a == b or (math.isnan(a[0]) and math.isnan(b[0]) and math.isnan(a[1]) and math.isnan(b[1]))


def test_many_matrices_one_host_read_and_each_ones_figures():
    mats = _mats()
    with OpCount() as ops:
        got = params.spectral_many(mats)
    assert ops.host_reads == 1
    with OpCount() as each:
        alone = [params.spectral_stats(w) for w in mats]
    assert each.host_reads == len(mats)  # negative control: one matrix at a time
    assert all(_same(a, b) for a, b in zip(got, alone))
    assert got[-3] == (0.0, 0.0) and math.isnan(got[-2][0])


def test_figures_agree_with_svdvals_at_any_scale():
    for w in _mats(1)[:-3]:
        top, rank = params.spectral_many([w])[0]
        sv = torch.linalg.svdvals(w.double())
        assert math.isclose(top, float(sv[0]), rel_tol=1e-6)
        assert math.isclose(rank, float((sv ** 2).sum() / sv[0] ** 2), rel_tol=1e-5)
    top, _ = params.spectral_many([torch.full((4, 4), 2.0 ** 100)])[0]
    assert math.isclose(top, 4 * 2.0 ** 100, rel_tol=1e-6)  # would overflow float32 unscaled


def test_a_solver_failure_costs_only_its_matrix(monkeypatch):
    real = torch.linalg.eigvalsh
    target = torch.full((5, 5), 7.0)

    def picky(a, *args, **kwargs):
        if a.dim() == 3 or bool((a == a.flatten()[0]).all()):  # the batch, then the constant matrix alone
            raise torch.linalg.LinAlgError("no convergence")
        return real(a, *args, **kwargs)
    monkeypatch.setattr(torch.linalg, "eigvalsh", picky)
    g = torch.Generator().manual_seed(2)
    others = [torch.randn(5, 5, generator=g) for _ in range(3)]
    got = params.spectral_many([others[0], target, others[1], others[2]])
    assert math.isnan(got[1][0]) and math.isnan(got[1][1])
    monkeypatch.setattr(torch.linalg, "eigvalsh", real)
    assert [got[0], got[2], got[3]] == [params.spectral_stats(w) for w in others]
