"""The z-loss of tinylm.functional: mean over rows of (log Z_t)^2, log Z_t = logsumexp(z_t).

z_loss >= 0, and 0 exactly when every row's log Z is 0; its gradient is 2 log Z_t softmax(z_t) / N;
adding c to a row shifts its log Z by exactly c. tinylm's own function (not part of the --impl
protocol), so these carry the ``tinylm_only`` marker.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.strategies import generator, seeds, sizes
from props.tolerances import unit_roundoff
from tinylm.functional import log_softmax, logsumexp, z_loss

pytestmark = pytest.mark.tinylm_only

U64 = unit_roundoff(torch.float64)


@st.composite
def logits(draw, max_lead: int = 2, max_c: int = 40):
    """float64 logits (..., C): N(0, 1) times 10^e (e in [-2, 2]) plus a per-row offset up to 10^3."""
    lead = tuple(draw(st.lists(sizes(1, 4), min_size=1, max_size=max_lead)))
    C = draw(sizes(1, max_c))
    g = generator(draw(seeds()))
    x = torch.randn(*lead, C, generator=g, dtype=torch.float64) * 10.0 ** draw(st.floats(-2.0, 2.0))
    return x + torch.randn(*lead, 1, generator=g, dtype=torch.float64) * 10.0 ** draw(st.floats(-3.0, 3.0))


def _lse_tol(x: torch.Tensor) -> torch.Tensor:
    """Rounding of log Z per row in float64: a few ulps of max|x| plus log C's sum."""
    C = x.shape[-1]
    return (C + 8) * U64 * (1 + x.abs().amax(-1))


@prop("z_loss = mean_t (log Z_t)^2 >= 0, and 0 where every row's log Z is 0 (rows log_softmax(z)), float64")
@given(x=logits())
def test_z_loss_is_the_mean_squared_log_partition(x):
    z = z_loss(x)
    lse = torch.logsumexp(x, -1)
    assert float(z) >= 0.0
    tol = float((2 * lse.abs() * _lse_tol(x) + _lse_tol(x) ** 2).max())
    check(abs(float(z) - float(lse.pow(2).mean())), tol, "z_loss differs from mean (log Z)^2")
    # every row normalised: log Z = 0 up to rounding, so the loss is 0 up to its square
    normalised = log_softmax(x, dim=-1)
    check(float(z_loss(normalised)), float((_lse_tol(normalised) ** 2).max()), "z_loss of normalised rows is not 0")
    # one row with log Z != 0 makes the loss at least its share (log Z_t)^2 / N
    n = lse.numel()
    worst = float(lse.pow(2).max())
    assert float(z) >= worst / n * (1 - 1e-12), "z_loss below one row's (log Z)^2 / N"


def _grad(fn, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    fn(x).backward()
    return x.grad


def _grad_err(x: torch.Tensor, formula: torch.Tensor) -> float:
    """max |grad z_loss(x) - formula| in units of the gradient's own rounding."""
    got = _grad(z_loss, x)
    n = x.numel() // x.shape[-1]
    lse = torch.logsumexp(x, -1, keepdim=True)
    scale = 2 * (lse.abs() + _lse_tol(x).unsqueeze(-1)) / n
    return float(((got - formula).abs() / (scale * (x.shape[-1] + 16) * U64 * (1 + x.abs().amax(-1, keepdim=True)))).max())


@prop("d z_loss / d z_t = 2 log Z_t softmax(z_t) / N, against the formula and torch autograd (float64)")
@given(x=logits())
def test_z_loss_gradient(x):
    n = x.numel() // x.shape[-1]
    lse = torch.logsumexp(x, -1, keepdim=True)
    check(_grad_err(x, 2 * lse * torch.softmax(x, -1) / n), 1.0, "the z-loss gradient differs from 2 log Z p / N",
          kind="err/tol")
    autograd = _grad(lambda t: torch.logsumexp(t, -1).pow(2).mean(), x)
    check(_grad_err(x, autograd), 1.0, "the z-loss gradient differs from torch autograd", kind="err/tol")


@prop("negative control: the gradient 2 log Z_t / N without the softmax is rejected")
@settings(max_examples=20)
@given(x=logits(max_c=40).filter(lambda t: t.shape[-1] >= 2))
def test_z_loss_gradient_without_softmax_is_rejected(x):
    n = x.numel() // x.shape[-1]
    lse = torch.logsumexp(x, -1, keepdim=True)
    wrong = (2 * lse / n).expand_as(x)
    err = _grad_err(x, wrong)
    check(1.0 / err, 1.0, "negative control: a gradient without the softmax passed", kind="tol/err")


@prop("log Z(z + c) = log Z(z) + c for every row and constant c (float64, to rounding)")
@given(x=logits(), c=st.floats(-1e3, 1e3, allow_nan=False))
def test_log_partition_shifts_by_the_constant(x, c):
    lse, shifted = logsumexp(x, -1), logsumexp(x + c, -1)
    tol = (x.shape[-1] + 8) * U64 * (1 + x.abs().amax(-1) + abs(c))
    check(float(((shifted - lse - c).abs() / tol).max()), 1.0, "log Z did not shift by c", kind="err/tol")
    # hence the z-loss of a row moves from (log Z)^2 to (log Z + c)^2
    row = x.reshape(-1, x.shape[-1])[:1]
    expected = float((logsumexp(row, -1) + c).pow(2))
    check(abs(float(z_loss(row + c)) - expected), float(4 * (abs(expected) ** 0.5 + 1) * tol.max()),
          "z_loss of a shifted row is not (log Z + c)^2")
