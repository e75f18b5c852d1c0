"""The backward token-kernel theory (diagnostics.theory.backkernel): its rules against brute force, its
predictions beside measurement on a reduced grid, its validity marks and its place in predict()."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

import tinylm
from diagnostics import OptionsError, predict
from diagnostics.theory.backkernel import attention_backward, backward_kernel, norm_backward
from diagnostics.theory.tokenkernel_maps import _psd_sqrt
from kernelhelp import backward_variances

ALPHA = 1e-6  # family-wise false-alarm probability of each test's statistical checks (Bonferroni within it)


def rejects(values, claim, delta, alpha):
    """True if the (1 - alpha) t interval of mean(values) over replicates excludes [claim - delta, claim + delta]
    (a false alarm under |E[value] - claim| <= delta with probability <= alpha/2)."""
    v = np.asarray(values, dtype=float)
    half = stats.t.ppf(1 - alpha / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
    return v.mean() - half > claim + delta or v.mean() + half < claim - delta


# ---------------------------------------------------------------- the attention rule against autograd

def _brute_attention(K_in, G_o, fq, fk, fv, d_k, theta, draws, seed):
    """Per draw, by autograd through one causal head with q, k, v rows of covariance f K_in and an output
    gradient of covariance G_o: the gradients' kernels at q, k (before RoPE) and v, and the mean squares
    of the gradients at the probabilities and the scores over the causal entries."""
    T = K_in.shape[0]
    R, Rg = torch.from_numpy(_psd_sqrt(K_in)), torch.from_numpy(_psd_sqrt(G_o))
    gen = torch.Generator().manual_seed(seed)
    cos = sin = None
    if theta is not None:
        ang = tinylm.functional.rope_angles(theta, d_k, torch.arange(T))
        cos, sin = torch.cos(ang), torch.sin(ang)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    out = {"q": [], "k": [], "v": [], "probs": [], "scores": []}
    for _ in range(draws):
        q = (math.sqrt(fq) * R @ torch.randn(T, d_k, generator=gen, dtype=torch.float64)).requires_grad_()
        k = (math.sqrt(fk) * R @ torch.randn(T, d_k, generator=gen, dtype=torch.float64)).requires_grad_()
        v = (math.sqrt(fv) * R @ torch.randn(T, d_k, generator=gen, dtype=torch.float64)).requires_grad_()
        g = Rg @ torch.randn(T, d_k, generator=gen, dtype=torch.float64)
        qr, kr = (q, k) if cos is None else (tinylm.functional.apply_rope(q, cos, sin),
                                             tinylm.functional.apply_rope(k, cos, sin))
        S = (qr @ kr.T / math.sqrt(d_k)).masked_fill(~mask, -math.inf)
        S.retain_grad()
        A = torch.softmax(S, -1)
        A.retain_grad()
        ((A @ v) * g).sum().backward()
        for key, x in (("q", q), ("k", k), ("v", v)):
            out[key].append((x.grad @ x.grad.T / d_k).numpy())
        out["probs"].append(float(A.grad[mask].square().mean()))
        out["scores"].append(float(S.grad[mask].square().mean()))
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("theta", [None, 10000.0])
def test_attention_backward_matches_autograd(theta):
    """T 6, d_k 4, a correlated input kernel and output gradient: the rule's mean squares (q, k, v, probs,
    scores) and mean off-diagonal kernels (q, k, v) lie within the (1 - alpha/k) t interval of 1000 autograd
    draws, widened for the rule's own Monte Carlo (2000 draws x 4 inner: its standard error is at most
    sqrt(1000/8000) of the brute force's). Negative control: the same rule with RoPE ignored where the head
    uses it (or used where it does not) is rejected on the q and k kernels."""
    T, d_k, n = 6, 4, 1000
    rng = np.random.default_rng(0)
    B = rng.standard_normal((T, T))
    K_in = 0.5 * np.ones((T, T)) + 0.5 * (B @ B.T) / T
    C = rng.standard_normal((T, T))
    G_o = 0.3 * np.ones((T, T)) + (C @ C.T) / T
    fq, fk, fv = 1.3, 0.8, 1.1
    brute = _brute_attention(K_in, G_o, fq, fk, fv, d_k, theta, n, seed=1)
    rule = attention_backward(K_in, G_o, fq, fk, fv, d_k, rope_theta=theta, draws=2000, seed=2)
    wrong = attention_backward(K_in, G_o, fq, fk, fv, d_k, rope_theta=None if theta else 10000.0, draws=2000, seed=2)
    widen = math.sqrt(1 + n / 8000)
    off = ~np.eye(T, dtype=bool)
    checks = [(np.einsum("nii->n", brute[k]) / T, float(np.trace(rule[k])) / T, k) for k in ("q", "k", "v")]
    checks += [(brute[k][:, off].mean(1), float(rule[k][off].mean()), k + " off") for k in ("q", "k", "v")]
    checks += [(brute[k], rule[k + "_ms"], k) for k in ("probs", "scores")]
    alpha = ALPHA / (len(checks) + 2)
    for values, predicted, what in checks:
        half = stats.t.ppf(1 - alpha / 2, n - 1) * values.std(ddof=1) / math.sqrt(n) * widen
        assert abs(values.mean() - predicted) <= half, (what, values.mean(), predicted, half)
    rejected = 0
    for k in ("q", "k"):
        values = brute[k][:, off].mean(1)
        half = stats.t.ppf(1 - alpha / 2, n - 1) * values.std(ddof=1) / math.sqrt(n) * widen
        rejected += abs(values.mean() - float(wrong[k][off].mean())) > half
    assert rejected >= 1


def test_identical_tokens_have_no_softmax_gradient():
    """With every token the same vector (K = 1 1^T) the values do not differ, so the softmax passes no
    gradient: scores, q and k gradients are exactly 0, with RoPE or without. Without RoPE every score of a row
    is the same, A is uniform over the causal prefix, and the values' kernel A^T G_o A is exactly c c^T for
    G_o = 1 1^T, c = A^T 1 (c_j = sum_{i >= j} 1/(i+1))."""
    K = np.ones((8, 8))
    G = np.ones((8, 8))
    for theta in (None, 10000.0):
        res = attention_backward(K, G, 1.0, 1.0, 1.0, 4, rope_theta=theta, draws=8, seed=0)
        assert res["scores_ms"] == pytest.approx(0.0, abs=1e-12)
        assert np.abs(res["q"]).max() < 1e-12 and np.abs(res["k"]).max() < 1e-12
    c = np.array([sum(1.0 / (i + 1) for i in range(j, 8)) for j in range(8)])
    assert np.allclose(res["v"] if theta is None else
                       attention_backward(K, G, 1.0, 1.0, 1.0, 4, rope_theta=None, draws=8, seed=0)["v"],
                       np.outer(c, c), rtol=1e-6)


def test_norm_backward_is_the_independent_rule_on_the_diagonal():
    """On the diagonal the RMSNorm backward map is E[g^2] G_tt (d-1)/(d-2) / (K_tt + eps), the independent-
    token rule; off it the projection and the token norms' fluctuation change G_st by O(1/d) only."""
    d, eps = 64, 1e-5
    K = np.array([[2.0, 1.0], [1.0, 0.5]])
    G = np.array([[3.0, 0.7], [0.7, 1.0]])
    out = norm_backward(G, K, 1.0, eps, d)
    assert np.allclose(np.diag(out), np.diag(G) * (d - 1) / (d - 2) / (np.diag(K) + eps), rtol=1e-14)
    plain = G[0, 1] / math.sqrt((K[0, 0] + eps) * (K[1, 1] + eps))
    assert abs(out[0, 1] / plain - 1) < 2.0 / d


# ---------------------------------------------------------------- beside measurement (reduced grid)

D, L, T, B, V, SEEDS = 128, 4, 32, 4, 1024, 16
DELTA = 0.10


def _config(norm, d=D, layers=L):
    return tinylm.ModelConfig(vocab_size=V, context_length=T, d_model=d, num_layers=layers, num_heads=d // 32,
                              d_ff=tinylm.default_d_ff(d), norm=norm)


def _measure(cfg):
    return backward_variances(cfg, SEEDS, B, T)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_valid_backward_predictions_match_measurement(norm):
    """d 128, L 4, T 32, 16 seeds: every backward prediction predict() marks valid (the backward kernel) is
    within 10% of measurement: the (1 - alpha/(2k)) t interval over seeds of measured/predicted overlaps
    [0.9, 1.1], k the number of such checks; the four controls below share the other alpha/2. Negative
    control: the independent-token prediction each keeps in ``independent`` is rejected by the same check
    at the stream gradient (resid_mid, block output) of blocks 0 and 1 (measured 0.77x of it pre-norm,
    0.67x post-norm; the kernel's within 5%)."""
    var, model = _measure(_config(norm))
    glob = predict(model, "global", seq_len=T, tokens=B * T)
    valid = [(n, p) for (n, d), p in glob.items() if d == "backward" and p.valid and n in var]
    controls = [f"layers.{i}.resid_mid" for i in (0, 1)] + [f"layers.{i}" for i in (0, 1)]
    assert len(valid) >= 40
    for name, p in valid:
        assert p.rule.startswith("kernel"), (name, p.rule)
        assert not rejects(np.asarray(var[name]) / p.var, 1.0, DELTA, ALPHA / (2 * len(valid))), \
            (name, np.mean(var[name]) / p.var)
    for name in controls:
        wrong = glob[(name, "backward")].independent
        assert rejects(np.asarray(var[name]) / wrong.var, 1.0, DELTA, ALPHA / (2 * len(controls))), \
            (name, np.mean(var[name]) / wrong.var)


# ---------------------------------------------------------------- validity and wiring

def test_validity_marks_and_wiring():
    """No norm: every backward kernel prediction is outside validity with its reason (the logits' gradient
    keeps the independent-token rule, which is exact there); pre-norm: the stream gradients are the kernel's,
    inside validity within the depth budget, each keeping the independent-token one; the softmax path is
    outside; backward="independent" keeps the independent-token rules."""
    cfg = tinylm.ModelConfig(vocab_size=64, context_length=8, d_model=32, num_layers=2, num_heads=1, d_ff=64,
                             norm="none")
    model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))
    glob = predict(model, "global", seq_len=8, tokens=16)
    for (name, d), p in glob.items():
        if d == "backward" and name != "lm_head":
            assert not p.valid and p.validity, name
    model = tinylm.TransformerLM(_config("pre", d=32, layers=2), generator=torch.Generator().manual_seed(0))
    glob = predict(model, "global", seq_len=8, tokens=16)
    p = glob[("layers.1", "backward")]
    assert p.valid and p.rule.startswith("kernel") and p.independent is not None
    # d 32 with one head: the depth budget (d_model x heads / 48 blocks) is 0, so block 0 is outside
    below = glob[("layers.0", "backward")]
    assert not below.valid and "blocks below the top" in below.validity
    assert not glob[("layers.1.attn.q_proj", "backward")].valid
    old = predict(model, "global", seq_len=8, tokens=16, backward="independent")
    assert not old[("layers.1", "backward")].rule.startswith("kernel")
    with pytest.raises(OptionsError, match="backward="):
        predict(model, "global", seq_len=8, tokens=16, backward="nope")
    with pytest.raises(OptionsError, match="tokens="):
        backward_kernel(model.config, 8, tokens=0)


def test_dsilu_cross_moment_against_scipy_and_its_fast_path():
    """E[silu'(a) silu'(b)] for a bivariate normal, Gauss-Hermite against scipy.integrate.dblquad; a normed
    input (equal diagonal) takes the Chebyshev-in-rho path, which equals the pairwise quadrature."""
    from scipy import integrate

    from diagnostics.theory.backkernel import dsilu_cross_moment

    def dsilu(u):
        sg = 1 / (1 + math.exp(-u)) if u > -700 else 0.0
        return sg * (1 + u * (1 - sg))

    dens = lambda z: math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731
    s1, s2, rho = 0.6, 1.4, 0.35
    Ka = np.array([[s1 * s1, rho * s1 * s2], [rho * s1 * s2, s2 * s2]])
    ref, _ = integrate.dblquad(
        lambda z2, z1: dsilu(s1 * z1) * dsilu(s2 * (rho * z1 + math.sqrt(1 - rho * rho) * z2)) * dens(z1) * dens(z2),
        -10, 10, -10, 10, epsabs=1e-12, epsrel=1e-10)
    assert dsilu_cross_moment(Ka)[0, 1] == pytest.approx(ref, rel=1e-7)
    rng = np.random.default_rng(0)
    G = rng.standard_normal((24, 5))
    G[1] = G[0] + 1e-3 * G[1]  # a nearly collinear pair: rho near 1
    K = G @ G.T
    r = 1 / np.sqrt(np.diag(K))
    K = 0.8 * K * r[:, None] * r[None, :]
    assert np.allclose(dsilu_cross_moment(K)[:16, :16], dsilu_cross_moment(K[:16, :16]), rtol=1e-10, atol=1e-14)
