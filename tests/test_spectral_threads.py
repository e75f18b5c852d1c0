"""The spectral statistics run their eigenproblem on one thread and leave the caller's thread count as it was."""

import math

import pytest
import torch

from diagnostics.measure.probe import spectral_stats


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_spectral_stats_restore_the_thread_count(two_threads):
    w = torch.randn(40, 30, generator=torch.Generator().manual_seed(0))
    top, _ = spectral_stats(w)
    assert torch.get_num_threads() == 2
    assert math.isclose(top, float(torch.linalg.matrix_norm(w.double(), ord=2)), rel_tol=1e-6)


def test_spectral_stats_restore_the_thread_count_when_the_solver_fails(two_threads, monkeypatch):
    """An eigensolver that raises gives NaN figures and the caller's threads back.
    Negative control: the solver really ran on one thread."""
    seen = []

    def failing(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise torch.linalg.LinAlgError("no convergence")

    monkeypatch.setattr(torch.linalg, "eigvalsh", failing)
    top, rank = spectral_stats(torch.ones(5, 4))
    assert math.isnan(top) and math.isnan(rank)
    assert seen == [1] and torch.get_num_threads() == 2
