"""The probe's compiled-torch path (diagnostics.measure.compiled) against the plain-torch reference.

Contract, as for the numba reducer: counts and max |x| identical; mean and M2 to float64
rounding; the attention panel and row mean squares to the rounding of their float64 sums.
The path sums d = x - K in float64 (K: the tensor's first entry, 0 when not finite) and forms
M2 = sum d^2 - (sum d)^2 / n, so its error is at most about n u_64 sum d^2 (a recursive
sum's bound; the compiled sums are blocked, far tighter) with sum d^2 = M2 + n (K - mean)^2,
and the mean's at most n u_64 sum |d| / n + u_64 |mean|. A negative control shows the same
check rejects M2 computed without the shift correction.

The formulas run here uncompiled (plain torch: the numbers torch.compile must reproduce), and
traced by dynamo without code generation (``backend="eager"``: whole graphs, dynamic shapes,
no graph break) in the default run; compiled by inductor (a C++ compiler on the CPU, a
minute or more cold) only under ``-m slow``.
"""

from __future__ import annotations

import math
import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnostics import probe
from diagnostics.measure import compiled, numba_reducer, reference
from diagnostics.measure.reducer import reduce
from diagnostics.measure.reference import FIELDS

U64 = torch.finfo(torch.float64).eps / 2
_SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-45, 3e-5, 6.1e-5, 6.2e-5, 65504.0, 65536.0,
            -7e4, 1.7e38, 3.4e38, 1e30, 1.0, -2.5]


def _bad(got: list[float], want: list[float], x: torch.Tensor, measured: torch.Tensor | None = None) -> list:
    """Fields where ``got`` breaks the contract against the reference ``want`` (module docstring)."""
    bad = [(n, a, b) for n, a, b in zip(FIELDS, got, want) if n not in ("mean", "m2") and a != b]
    f = x.detach().double()
    if measured is not None:
        f = f[measured.expand_as(f)]
    f = f.reshape(-1)
    first = x.detach().double().reshape(-1)[0]
    K = float(first) if math.isfinite(float(first)) else 0.0
    f = f[torch.isfinite(f)]
    if f.numel() == 0:
        return bad
    n, mean, m2 = f.numel(), float(f.mean()), float(((f - f.mean()) ** 2).sum())
    sum_d2 = m2 + n * (K - mean) ** 2
    if abs(got[3] - m2) > (n + 4) * U64 * sum_d2 + 1e-300:
        bad.append(("m2", got[3], m2))
    if abs(got[2] - mean) > (n + 4) * U64 * float((f - K).abs().mean()) + U64 * abs(mean):
        bad.append(("mean", got[2], mean))
    return bad


def _flat(x):
    """The compiled path's formula for every entry of ``x``, uncompiled."""
    return compiled._flat(x.reshape(-1, x.shape[-1]))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5_000), width=st.sampled_from([1, 7, 64]), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e4, 1e30]), offset=st.sampled_from([0.0, 1.0, -1e3]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
       specials=st.lists(st.sampled_from(_SPECIAL), max_size=6))
def test_formulas_equal_reference(n, width, seed, scale, offset, dtype, specials):
    """Property: for any tensor, the formulas give the reference's summary (exact counts and max;
    mean and M2 to float64 rounding), whatever non-finite, subnormal or huge values it holds."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * width, generator=g, dtype=torch.float64) * scale + offset
    if specials:
        x[torch.randint(0, x.numel(), (len(specials),), generator=g)] = torch.tensor(specials, dtype=torch.float64)
    x = x.to(dtype).reshape(n, width)
    assert _bad(_flat(x).tolist(), reference.moments(x).tolist(), x) == []


def test_check_rejects_m2_without_the_shift_correction():
    """Negative control: M2 taken as sum d^2 (the shift's term not removed) is rejected."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 5.0
    x[0] = 9.0  # the shift K sits away from the mean
    good = _flat(x[None]).tolist()
    d = torch.where(torch.isfinite(x), x - 9.0, 0.0)
    wrong = good[:3] + [float((d * d).sum())] + good[4:]
    assert _bad(good, reference.moments(x).tolist(), x) == []
    assert [b[0] for b in _bad(wrong, reference.moments(x).tolist(), x)] == ["m2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_causal_and_panel_formulas_equal_reference(dtype, T):
    g = torch.Generator().manual_seed(T)
    s = torch.randn(3, 2, T, T, generator=g, dtype=torch.float64) * 4
    s[0, 0, -1, 0] = 60.0  # a saturated row
    mask = reference.causal_mask(T)
    p = torch.softmax(s.masked_fill(~mask, -math.inf), -1).to(dtype)
    p[1, 1].triu_(1).add_(0.3)  # the reducer must not read above the diagonal
    mom, pan = compiled._causal_probs(p.reshape(-1, T, T))
    assert _bad(mom.tolist(), reference.moments(p, mask).tolist(), p, mask) == []
    assert torch.equal(compiled._causal(p.reshape(-1, T, T)), mom)
    want = reference.panel(p, True)
    n_rows = p.numel() // T
    # the entropies: float64 sums of T terms per row, then over rows
    assert pan[[0, 4, 5]].tolist() == want[[0, 4, 5]].tolist()
    assert abs(float(pan[1] - want[1])) <= 4 * T * U64 * math.log(T + 1) + 1e-300
    assert abs(float(pan[2] - want[2])) <= 4 * (T + n_rows) * U64 * (float(want[2]) + n_rows * math.log(T + 1) ** 2)
    assert float(pan[3]) == pytest.approx(float(want[3]), abs=4 * T * U64 * math.log(T + 1))


@pytest.mark.parametrize("shape", [(4, 6, 5), (1, 7), (9,), (2, 1, 3)])
def test_rows_and_cosine_formulas_equal_reference(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
    mom, ms = compiled._flat_rows(x.reshape(-1, x.shape[-1]))
    assert _bad(mom.tolist(), reference.moments(x).tolist(), x) == []
    want = reference.row_mean_squares(x)
    assert torch.allclose(ms.reshape(x.shape[:-1]).float(), want, rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    if x.dim() >= 2:
        _, _, cos = compiled._flat_rows_cosine(x.reshape(-1, x.shape[-2], x.shape[-1]))
        assert torch.equal(cos, reference.cosines(x))


# -- the choice of path and the fallback --


def test_backend_by_device(monkeypatch):
    x = torch.ones(3, 4)
    monkeypatch.setenv("TINYLM_REDUCER", "auto")
    assert not compiled.takes(x) or not numba_reducer.available()  # numba, where present, has the CPU
    monkeypatch.setattr(numba_reducer, "available", lambda: False)  # a CPU without numba: compiled torch
    assert compiled.takes(x) and compiled.takes(x.double()) and not compiled.takes(torch.ones(0, 3))
    monkeypatch.setenv("TINYLM_REDUCER", "reference")  # everything to the reference
    assert not compiled.takes(x)
    monkeypatch.undo()
    monkeypatch.setenv("TINYLM_REDUCER", "compiled")  # forced on the CPU even beside numba
    assert compiled.takes(x) and not numba_reducer.available()


def test_the_old_variable_still_chooses_with_a_deprecation_warning(monkeypatch):
    """``TINYLM_FUSED`` (the name ``TINYLM_REDUCER`` replaces) is read when the new one is unset:
    0 -> reference, compiled -> compiled, else auto, each time with a DeprecationWarning naming the new."""
    from diagnostics.measure import reducer_choice

    monkeypatch.delenv("TINYLM_REDUCER", raising=False)
    for old, new in (("0", "reference"), ("compiled", "compiled"), ("1", "auto")):
        monkeypatch.setenv("TINYLM_FUSED", old)
        with pytest.warns(DeprecationWarning, match=f"TINYLM_REDUCER={new}"):
            assert reducer_choice.chosen() == new
    monkeypatch.setenv("TINYLM_FUSED", "0")
    with pytest.warns(DeprecationWarning):
        assert not compiled.available() and not numba_reducer.available()
    # the new name wins, without a warning; an unknown value reads as auto
    monkeypatch.setenv("TINYLM_REDUCER", "compiled")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reducer_choice.chosen() == "compiled"
        monkeypatch.setenv("TINYLM_REDUCER", "fast")
        assert reducer_choice.chosen() == "auto"


@pytest.fixture
def fresh(monkeypatch):
    """A compiled path with no functions built and no failure recorded, restored afterwards."""
    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(compiled, "_failed", False)
    monkeypatch.setenv("TINYLM_REDUCER", "compiled")
    torch._dynamo.reset()
    yield monkeypatch
    torch._dynamo.reset()


def test_failed_compilation_falls_back_with_one_warning(fresh):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    fresh.setattr(compiled, "BACKEND", broken)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = reduce(x)
        second = reduce(x * 2, rows=True)
    assert [str(w.message).split(" (")[0] for w in caught] == ["torch.compile could not build the probe's reductions"]
    assert "no compiler here" in str(caught[0].message)
    assert torch.equal(first.moments, reference.moments(x))  # the reference took over
    assert torch.equal(second.row_ms, reference.row_mean_squares(x * 2))
    assert not compiled.available()


def test_formulas_trace_whole_with_dynamic_shapes(fresh):
    """dynamo captures each formula as one graph (fullgraph) for tensors of several sizes, and the
    captured graphs compute the reference's numbers (backend "eager": no code generation)."""
    fresh.setattr(compiled, "BACKEND", "eager")
    g = torch.Generator().manual_seed(3)
    for shape in [(4, 6, 5), (3, 10, 12)]:
        x = torch.randn(*shape, generator=g)
        r = reduce(x, rows=True, cosine=True)
        assert _bad(r.moments.tolist(), reference.moments(x).tolist(), x) == []
        assert torch.equal(r.cosine, reference.cosines(x))
        p = torch.softmax(torch.randn(2, shape[1], shape[1], generator=g), -1)
        r = reduce(p, causal=True, probs=True)
        mask = reference.causal_mask(shape[1])
        assert _bad(r.moments.tolist(), reference.moments(p, mask).tolist(), p, mask) == []
        assert r.panel[[0, 4, 5]].tolist() == reference.panel(p)[[0, 4, 5]].tolist()
    assert not compiled._failed and set(compiled._compiled) == {"_flat_rows_cosine", "_causal_probs"}


def test_compiled_merge_equals_the_cpu_merge(fresh):
    """Vectors merged by the compiled torch merge (what a GPU probe uses; traced here with the
    "eager" backend) equal the CPU's numpy merge, and the merged moments are those of both
    tensors together."""
    from diagnostics.measure import reducer

    fresh.setattr(compiled, "BACKEND", "eager")
    g = torch.Generator().manual_seed(4)
    x1, x2 = torch.randn(300, generator=g) + 3, torch.randn(50, generator=g) * 2
    a, b = reference.moments(x1), reference.moments(x2)
    got = compiled.call(reducer._merge_torch, a, b, 1, 4, True)
    assert torch.equal(got, reducer.merge_vectors(a, b))
    both = torch.cat([x1, x2])
    assert _bad(got.tolist(), reference.moments(both).tolist(), both) == []
    pa, pb = (reference.panel(torch.softmax(torch.randn(2, 5, 5, generator=g), -1)) for _ in range(2))
    assert torch.equal(compiled.call(reducer._merge_torch, pa, pb, 0, 3, False),
                       reducer.merge_attention_vectors(pa, pb))


# -- inductor: compiled for real (slow: a C++ compiler on the CPU, a minute or more cold) --


def _cpp_compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.mark.slow
@pytest.mark.skipif(_cpp_compiler() is None, reason="no C++ compiler: inductor cannot build CPU code here")
def test_inductor_probe_equals_reference(fresh):
    """A whole probe with the inductor-compiled path gives the reference path's statistics."""
    import tinylm

    cfg = tinylm.ModelConfig(vocab_size=40, context_length=12, d_model=16, num_layers=2, num_heads=2, d_ff=24)
    model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))
    tok = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(1))

    def measure():
        with probe(model) as run:
            tinylm.functional.cross_entropy(model(tok[:, :-1]), tok[:, 1:]).backward()
        return run.stats

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch.compile could not build")  # a failed compilation
        got = measure()
    assert set(compiled._compiled) >= {"_flat", "_causal", "_causal_probs"} and not compiled._failed
    fresh.setenv("TINYLM_REDUCER", "reference")
    want = measure()
    assert got.tensors.keys() == want.tensors.keys()
    for key, m in got.tensors.items():
        w = want.tensors[key]
        assert (m.n_total, m.count, m.max_abs, m.n_zero) == (w.n_total, w.count, w.max_abs, w.n_zero), key
        assert m.mean == pytest.approx(w.mean, rel=1e-9, abs=1e-12 * math.sqrt(w.m2 / max(w.count, 1))), key
        assert m.m2 == pytest.approx(w.m2, rel=1e-9, abs=1e-300), key
    for key, a in got.attention.items():
        b = want.attention[key]
        assert a.rows == b.rows and a.rows_saturated == b.rows_saturated, key
        assert a.entropy_mean == pytest.approx(b.entropy_mean, rel=1e-12), key
    # the merge a GPU probe runs compiled (a CPU's merges run in numpy), compiled here on the CPU
    from diagnostics.measure import reducer

    fresh.setenv("TINYLM_REDUCER", "compiled")
    va, vb = reference.moments(torch.randn(40) + 2), reference.moments(torch.randn(7))
    merged = compiled.call(reducer._merge_torch, va, vb, 1, 4, True)
    assert merged is not None and not compiled._failed
    assert merged.tolist() == pytest.approx(reducer.merge_vectors(va, vb).tolist(), rel=1e-14, abs=1e-14)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run, not refuse")
def test_overhead_benchmark_refuses_cuda_without_a_device():
    """``bench_overhead.py --device cuda`` on a machine without CUDA: one line naming the problem
    and the fix, exit status 2, no traceback."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_overhead.py"), "--device", "cuda"],
                         capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("--device cuda:") and "--device cpu" in lines[0]
