"""The token-kernel theory's causal (panelled) products equal the dense products they replace.

``attention_kernel`` sums A K A^T over its Monte Carlo draws using only the lower block triangle
that causal attention leaves non-zero. The reference below is the dense computation (A R)(A R)^T
with R R^T = K, fed the very same draws (same seed, same sampling code), so the two must agree
to float64 rounding: the tolerance is 1e-12 relative to the largest entry (about 1e4 ulp; the sums
have at most T^2 terms). Negative control: another sample (seed + 1) differs by more than 1e-4 of
the largest entry, so the check rejects a kernel from other draws.
"""

import math

import numpy as np
import pytest
import torch

import tinylm
from diagnostics.theory import tokenkernel_maps as tk

TOL = 1e-12


def dense_reference(K_in, fq, fk, fv, d_k, *, rope_theta, draws, seed):
    """The attention kernel by dense products, drawing exactly as ``attention_kernel`` does."""
    T = K_in.shape[0]
    R = tk._sqrt_factor(K_in)
    sample = torch.float32 if math.sqrt(fq * fk) * float(np.abs(np.diag(K_in)).max()) < 1e15 else torch.float64
    Rs = R.to(sample)
    gen = torch.Generator().manual_seed(int(seed))
    causal = torch.zeros(T, T, dtype=sample).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    cos, sin = tk._rope_tables(rope_theta, d_k, T) if rope_theta is not None else (None, None)
    if cos is not None:
        cos, sin = cos.to(sample), sin.to(sample)
    acc = torch.zeros(T, T, dtype=torch.float64)
    scale = math.sqrt(fq * fk / d_k)
    chunk = max(1, min(draws, int(2**22 // (T * T))))
    done = 0
    while done < draws:
        b = min(chunk, draws - done)
        Q = Rs @ torch.randn(b, T, d_k, generator=gen, dtype=sample)
        Kk = Rs @ torch.randn(b, T, d_k, generator=gen, dtype=sample)
        if cos is not None:
            Q, Kk = tinylm.functional.apply_rope(Q, cos, sin), tinylm.functional.apply_rope(Kk, cos, sin)
        A = torch.softmax(torch.baddbmm(causal.expand(b, T, T), Q, Kk.transpose(-1, -2), alpha=scale), dim=-1).double()
        A /= A.sum(-1, keepdim=True)
        M = (A @ R).transpose(0, 1).reshape(T, b * T)  # (T, b T): sum_b A K A^T = M M^T
        acc += M @ M.T
        done += b
    heads = fv * (acc / draws).numpy()
    return 0.5 * (heads + heads.T)


def kernel(T: int, seed: int, *, singular: bool = False) -> np.ndarray:
    """A kernel like a normed stream's: positive diagonal, positive correlations; singular with
    repeated tokens (then the square root comes from the eigendecomposition, not Cholesky)."""
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((T, 2 * T)) / math.sqrt(2 * T)
    if singular:
        G[1::3] = G[0::3][: len(G[1::3])]  # every third position repeats the one before it
    return G @ G.T + 0.25


@pytest.mark.parametrize("T", [1, 5, 64, 65, 150])
@pytest.mark.parametrize("rope_theta", [None, 10000.0])
def test_causal_products_equal_the_dense_products(T, rope_theta):
    """Panels of 64 rows: T 64 is one panel, 65 and 150 end in a partial panel, 1 and 5 are within one."""
    K = kernel(T, T)
    fast = tk.attention_kernel(K, 1.1, 0.9, 0.6, 16, rope_theta=rope_theta, draws=5, seed=7)["heads"]
    ref = dense_reference(K, 1.1, 0.9, 0.6, 16, rope_theta=rope_theta, draws=5, seed=7)
    assert np.abs(fast - ref).max() <= TOL * np.abs(ref).max()
    assert np.array_equal(fast, fast.T)


def test_causal_products_equal_the_dense_products_for_a_singular_kernel():
    K = kernel(100, 3, singular=True)
    assert np.linalg.matrix_rank(K) < 100
    fast = tk.attention_kernel(K, 1.0, 1.0, 1.0, 32, rope_theta=10000.0, draws=3, seed=1)["heads"]
    ref = dense_reference(K, 1.0, 1.0, 1.0, 32, rope_theta=10000.0, draws=3, seed=1)
    assert np.abs(fast - ref).max() <= TOL * np.abs(ref).max()


def test_negative_control_another_sample_is_far_outside_the_tolerance():
    K = kernel(150, 150)
    a = tk.attention_kernel(K, 1.1, 0.9, 0.6, 16, rope_theta=10000.0, draws=5, seed=7)["heads"]
    b = dense_reference(K, 1.1, 0.9, 0.6, 16, rope_theta=10000.0, draws=5, seed=8)
    assert np.abs(a - b).max() > 1e-4 * np.abs(b).max()


def test_the_panel_size_does_not_change_the_result(monkeypatch):
    """Panels of 7 rows (many partial panels) against one panel holding every row."""
    K = kernel(40, 40)
    monkeypatch.setattr(tk, "_PANEL", 7)
    small = tk.attention_kernel(K, 1.0, 1.0, 1.0, 8, rope_theta=None, draws=4, seed=2)["heads"]
    monkeypatch.setattr(tk, "_PANEL", 1000)
    whole = tk.attention_kernel(K, 1.0, 1.0, 1.0, 8, rope_theta=None, draws=4, seed=2)["heads"]
    assert np.abs(small - whole).max() <= TOL * np.abs(whole).max()


def test_the_panels_on_several_threads_give_the_same_bits(monkeypatch):
    """The causal products' panels spread over threads (the walk's caller's count) are each the same
    ops on any thread: the same bits as one thread. The spy proves the threads were used; the
    negative control above (another sample) shows the comparison sees a change."""
    K = kernel(40, 40)
    monkeypatch.setattr(tk, "_PANEL", 7)
    pools = []
    real = tk.ThreadPoolExecutor

    def spy(workers):
        pools.append(workers)
        return real(workers)
    monkeypatch.setattr(tk, "ThreadPoolExecutor", spy)
    got = {}
    for workers in (1, 3):
        token = tk.WORKERS.set(workers)
        try:
            got[workers] = tk.attention_kernel(K, 1.0, 1.0, 1.0, 8, rope_theta=None, draws=4, seed=2)["heads"]
        finally:
            tk.WORKERS.reset(token)
    assert pools and set(pools) == {3}
    assert np.array_equal(got[1], got[3])
