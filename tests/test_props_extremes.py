"""The whole-finite-range properties have teeth: each kills a user implementation that is right near
N(0, 1) and wrong only at extreme magnitudes (or row lengths), which the rest of the suite passes.

The implementations are files in ``tests/props_mutants/``, one bug each, loaded as a user's
``--impl`` would be. Each is run through the property runner with a ``-k`` selecting every
property of its function, old and new: the run must fail, every failing property must be one of
the whole-range properties named for it (so every other property of the function passed: the gap
existed), and at least one other property must have passed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from props import impl as impl_mod
from props import strategies
from props.runner import run_suite
from reports import cli

MUTANTS_DIR = Path(__file__).parent / "props_mutants"

#: mutant file -> (-k selecting its function's properties, the whole-range properties that must kill it,
#: the one among them that must be among the killers)
CASES = {
    "softmax_online.py": (
        "softmax and not log_softmax", {"softmax_long_rows"}, "softmax_long_rows"),
    "log_softmax_naive_backward.py": (
        "log_softmax", {"vjp_wide_range[log_softmax]"}, "vjp_wide_range[log_softmax]"),
    "cross_entropy_log_of_softmax.py": (
        "cross_entropy", {"cross_entropy_wide_range", "cross_entropy_shift_wide", "vjp_wide_range[cross_entropy]"},
        "cross_entropy_wide_range"),
    "silu_exp_minus_x.py": (
        "silu", {"activation_derivative_asymptotes[silu]"}, "activation_derivative_asymptotes[silu]"),
    "gelu_handwritten_tanh.py": (
        "gelu and not moments",
        {"activation_wide_range[gelu_tanh]", "activation_derivative_asymptotes[gelu_tanh]"},
        "activation_wide_range[gelu_tanh]"),
    "relu_abs_mean.py": (
        "relu and not moments", {"activation_wide_range[relu]"}, "activation_wide_range[relu]"),
    "rmsnorm_eps_in_dtype.py": (
        "rmsnorm", {"rmsnorm_wide_range"}, "rmsnorm_wide_range"),
    "layer_norm_no_upcast.py": (
        "layer_norm", {"layer_norm_wide_range"}, "layer_norm_wide_range"),
}

#: run in the default test run (with the command-line test's relu below); the others carry the slow
#: marker, each being a pytest subprocess
FAST = ("softmax_online.py",)


def test_every_mutant_file_has_a_case_and_loads():
    files = sorted(p.name for p in MUTANTS_DIR.glob("*.py"))
    assert files == sorted(CASES)
    for name in files:
        impl = impl_mod.load(str(MUTANTS_DIR / name))
        assert len(impl.provided()) == 1, (name, impl.provided())


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in CASES]
)
def test_whole_range_property_kills_mutant_the_rest_passes(name):
    select, allowed, required = CASES[name]
    run = run_suite(impl=str(MUTANTS_DIR / name), select=select, env={**os.environ, "TINYLM_PROPS_NO_SHRINK": "1"})
    failed = {r.name for r in run.results if r.outcome == "failed"}
    passed = {r.name for r in run.results if r.outcome == "passed"}
    assert not run.ok and run.returncode == 1, run.output_tail
    assert required in failed, (failed, run.output_tail)
    assert failed <= allowed, f"properties outside the whole-range ones failed: {sorted(failed - allowed)}"
    assert passed, "no other property of the function ran"


def test_cli_names_the_whole_range_property(capsys):
    code = cli.main(["props", "--impl", str(MUTANTS_DIR / "relu_abs_mean.py"), "-k", "relu and not moments"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1, out
    assert "FAILED activation_wide_range[relu]: relu gave NaN/inf" in out


# -- the strategies that draw the whole finite range ------------------------------------------------


def test_finite_exponents_and_their_errors():
    lo, hi = strategies.finite_exponents(torch.float16)
    assert abs(lo - math.log10(2.0**-14)) < 1e-12 and abs(hi - math.log10(65504.0)) < 1e-12
    assert strategies.finite_exponents(torch.float32, headroom=10.0)[1] == pytest.approx(math.log10(3.4028234663852886e38) - 1)
    with pytest.raises(ValueError, match=r"^dtype=torch.int64: must be a floating-point dtype"):
        strategies.finite_exponents(torch.int64)
    with pytest.raises(ValueError, match=r"^headroom=0.5: must be >= 1"):
        strategies.finite_exponents(torch.float32, headroom=0.5)
    with pytest.raises(ValueError, match=r"^min_exp=10.0, max_exp=20.0: no exponent of torch.float16"):
        strategies.magnitudes(torch.float16, min_exp=10.0, max_exp=20.0)


@settings(max_examples=40)
@given(x=strategies.wide_tensors(headroom=4.0), m=strategies.magnitudes(torch.bfloat16, min_exp=-3.0))
def test_wide_tensors_stay_finite_within_the_headroom(x, m):
    info = torch.finfo(x.dtype)
    assert x.dim() == 2 and bool(torch.isfinite(x).all())
    assert float(x.double().abs().max()) <= info.max / 4.0
    assert 1e-3 * (1 - 1e-12) <= m <= torch.finfo(torch.bfloat16).max
