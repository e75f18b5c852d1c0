"""The token-kernel theory (diagnostics.theory.tokenkernel): its exact identities, and its predictions beside measurement."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

import tinylm
from diagnostics import OptionsError, predict
from diagnostics.theory.tokenkernel import attention_kernel, kernel_theory, mean_cosine, normalize, silu_cross_moment
from diagnostics.theory import silu_moments
from kernelhelp import forward_moments

ALPHA = 1e-6  # family-wise false-alarm probability of the statistical checks below
D, L, T, B, V, SEEDS = 128, 4, 32, 4, 1024, 32


def config(d=D, layers=L, seq=T, **kw):
    return tinylm.ModelConfig(vocab_size=V, context_length=seq, d_model=d, num_layers=layers, num_heads=d // 32,
                              d_ff=tinylm.default_d_ff(d), **kw)


@pytest.fixture(scope="module")
def kt():
    return kernel_theory(config(), T, draws=1024)


@pytest.fixture(scope="module")
def measured():
    """Per seed (fresh init and fresh uniform random tokens): forward variance per tensor, cosine per residual point."""
    return forward_moments(config(), SEEDS, B, T)


# ---------------------------------------------------------------- exact identities

def test_block0_equals_independent_token_theory(kt):
    """In block 0 the tokens are independent (up to 1/V coincidences): every rule reduces to the
    independent-token global theory. Deterministic rules agree to 1e-6 (quad vs Gauss-Hermite, the
    1/V off-diagonal); the softmax rules are Monte Carlo on both sides (each < 0.5% here)."""
    model = tinylm.TransformerLM(config(), generator=torch.Generator().manual_seed(0))
    glob = predict(model, "global", seq_len=T, tokens=B * T, forward="independent")
    mc = ("attn.probs", "attn.heads", "attn.output_proj", "layers.0.attn", "resid_mid", "layers.0")
    checked = 0
    for key, ms in kt.mean_square.items():
        if not key[0].startswith(("token_embeddings", "layers.0")):
            continue
        tol = 0.015 if key[0].endswith(mc) else 1e-6
        assert ms == pytest.approx(glob[key].mean_square, rel=tol), key
        checked += 1
    assert checked == 18


def test_kernels_are_psd_with_the_right_diagonals(kt):
    c = kt.config
    for name, K in kt.kernels.items():
        assert np.allclose(K, K.T, rtol=0, atol=1e-12 * np.abs(K).max()), name
        assert np.linalg.eigvalsh(K).min() >= -1e-9 * np.abs(K).max(), name
        assert kt.mean_square[(name, "forward")] == pytest.approx(float(np.mean(np.diag(K))), rel=1e-12)
    emb = kt.kernels["token_embeddings"]
    m2 = tinylm.init.truncnorm_variance(1.0, -3.0, 3.0)
    assert np.allclose(np.diag(emb), m2, rtol=1e-12) and np.allclose(emb[0, 1], m2 / V, rtol=1e-12)
    for i in range(c.num_layers):
        x = kt.kernels["token_embeddings" if i == 0 else f"layers.{i - 1}"]
        ln1 = kt.kernels[f"layers.{i}.ln1"]
        assert np.allclose(np.diag(ln1), np.diag(x) / (np.diag(x) + c.eps), rtol=1e-12)
        # row 0 of causal attention attends to itself only: E[o_0 . o_0]/d = d E[w_v^2] K^_00 exactly
        fv = D * tinylm.init.truncnorm_variance(math.sqrt(2 / (2 * D)), -3 * math.sqrt(1 / D), 3 * math.sqrt(1 / D))
        assert kt.kernels[f"layers.{i}.attn.heads"][0, 0] == pytest.approx(fv * ln1[0, 0], rel=1e-12)
        # the FFN is tokenwise: its diagonal is the independent-token SwiGLU rule
        ka = D * tinylm.init.truncnorm_variance(math.sqrt(2 / (D + c.d_ff)), -3 * math.sqrt(2 / (D + c.d_ff)),
                                                3 * math.sqrt(2 / (D + c.d_ff)))
        ln2 = np.diag(kt.kernels[f"layers.{i}.ln2"])
        _, m2_silu, _ = silu_moments(0.0, math.sqrt(ka * ln2[0]))
        assert kt.kernels[f"layers.{i}.ffn.hidden"][0, 0] == pytest.approx(m2_silu * ka * ln2[0], rel=1e-6)
    stream = [kt.blocks[i].stream for i in range(c.num_layers)]
    cosine = [kt.cosine["token_embeddings"]] + [kt.blocks[i].cosine for i in range(c.num_layers)]
    assert all(b > a for a, b in zip(stream, stream[1:])) and all(b > a for a, b in zip(cosine, cosine[1:]))
    assert -1 < cosine[0] < cosine[-1] < 1


def test_identical_tokens_pass_attention_unchanged():
    """If every token is the same vector (K = 1 1^T), any row-stochastic A gives A K A^T = K: the heads'
    kernel is exactly d E[w_v^2] K, with RoPE or without."""
    K = np.ones((12, 12))
    for theta in (None, 10000.0):
        out = attention_kernel(K, 1.3, 0.7, 0.5, 8, rope_theta=theta, draws=16, seed=0)
        assert np.allclose(out["heads"], 0.5 * K, rtol=1e-12, atol=0)


def test_normalize_and_cosine():
    K = np.array([[4.0, 1.0], [1.0, 1.0]])
    assert np.allclose(normalize(K, 2.0, 0.0), 2.0 * np.array([[1.0, 0.5], [0.5, 1.0]]), rtol=1e-15)
    assert mean_cosine(K) == pytest.approx(0.5, rel=1e-15)


@pytest.mark.parametrize("sd", [(0.7, 0.7), (0.5, 1.6)])
@pytest.mark.parametrize("rho", [-0.6, 0.0, 0.35, 0.999])
def test_silu_cross_moment_against_scipy(sd, rho):
    """E[silu(a) silu(b)] for a bivariate normal, Gauss-Hermite against scipy.integrate.dblquad."""
    s1, s2 = sd
    Ka = np.array([[s1 * s1, rho * s1 * s2], [rho * s1 * s2, s2 * s2]])
    silu = lambda u: u / (1 + math.exp(-u)) if u > -700 else 0.0  # noqa: E731
    dens = lambda z: math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731
    ref, _ = integrate.dblquad(
        lambda z2, z1: silu(s1 * z1) * silu(s2 * (rho * z1 + math.sqrt(1 - rho * rho) * z2)) * dens(z1) * dens(z2),
        -10, 10, -10, 10, epsabs=1e-12, epsrel=1e-10)
    assert silu_cross_moment(Ka)[0, 1] == pytest.approx(ref, rel=1e-7, abs=1e-10)


def test_silu_cross_moment_fast_path_equals_pairwise():
    """A normed input (equal diagonal) takes the Chebyshev-in-rho path; it equals the pairwise quadrature."""
    rng = np.random.default_rng(0)
    G = rng.standard_normal((24, 5))
    G[1] = G[0] + 1e-3 * G[1]  # a nearly collinear pair: rho near 1
    K = G @ G.T
    r = 1 / np.sqrt(np.diag(K))
    K = 0.6 * K * r[:, None] * r[None, :]
    fast = silu_cross_moment(K)
    slow = silu_cross_moment(K[:16, :16])  # T <= 16 always takes the pairwise path
    assert np.allclose(fast[:16, :16], slow, rtol=1e-10, atol=1e-14)


def test_arguments_are_validated():
    with pytest.raises(OptionsError, match="seq_len=64"):
        kernel_theory(config(), 64)
    with pytest.raises(OptionsError, match="draws=0"):
        kernel_theory(config(), T, draws=0)
    with pytest.raises(Exception, match="nope"):
        kernel_theory(config(), T, scheme="nope")


# ---------------------------------------------------------------- beside measurement

DELTA = 0.10  # the claim: measured/predicted within 10%, cosine within 0.03
COS_DELTA = 0.03
CHECKED = ("attn.heads", "attn", "resid_mid", "ffn", "")  # "" = the block output (the residual stream)


def rejects(values, claim, delta, alpha):
    """True if the (1 - alpha) t interval of mean(values) over replicates excludes [claim - delta, claim + delta].

    Under the claim |E[value] - claim| <= delta this happens with probability <= alpha/2: a
    false alarm. The threshold is the t quantile times the replicates' standard error.
    """
    v = np.asarray(values, dtype=float)
    half = stats.t.ppf(1 - alpha / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
    return v.mean() - half > claim + delta or v.mean() + half < claim - delta


def _name(i, point):
    return f"layers.{i}" + (f".{point}" if point else "")


def test_kernel_predictions_match_measurement(kt, measured):
    """d 128, L 4, T 32, 32 seeds: attention heads and branch, resid_mid, FFN and the stream at every
    block within 10% of the kernel theory, the mean cosine between tokens within 0.03. Each check has
    false-alarm probability alpha/k (Bonferroni: the k checks together alpha = 1e-6)."""
    var, cos, _ = measured
    k = L * (len(CHECKED) + 1)
    for i in range(L):
        for point in CHECKED:
            name = _name(i, point)
            ratios = np.asarray(var[name]) / kt.var(name)
            assert not rejects(ratios, 1.0, DELTA, ALPHA / k), (name, ratios.mean())
        name = f"layers.{i}"
        assert not rejects(cos[name], kt.cosine[name], COS_DELTA, ALPHA / k), (name, np.mean(cos[name]))


def test_negative_control_independent_token_theory_is_rejected(kt, measured):
    """The same check rejects the independent-token global prediction of the attention (heads and
    branch) at every block >= 1 (1.3x at block 1, 2x at block 3), while it accepts it in block 0 (where it holds)."""
    var, _, model = measured
    glob = predict(model, "global", seq_len=T, tokens=B * T, forward="independent")
    k = 2 * L
    for i in range(L):
        for point in ("attn.heads", "attn"):
            name = _name(i, point)
            ratios = np.asarray(var[name]) / glob[(name, "forward")].var
            assert rejects(ratios, 1.0, DELTA, ALPHA / k) == (i >= 1), (name, ratios.mean())


# ---------------------------------------------------------------- wired into predict (global mode)

def test_predict_global_takes_the_kernel_beyond_block_0(measured):
    """predict(model, "global") (the default forward="kernel"), d 128, L 4, T 32, 32 seeds: at every
    block >= 1 the forward predictions of the attention heads and branch, resid_mid and the stream
    are the kernel theory's, inside validity, and within 10% of measurement; the predicted token
    cosine within 0.03. The check is `rejects` above: a (1 - alpha/k) t interval over the seeds of
    measured/predicted must overlap [0.9, 1.1], k the number of checks, alpha = 1e-6 in all.
    Negative control: the independent-token prediction each one keeps in ``independent`` (outside
    validity there) fails the same check for the attention heads and branch at every block >= 1."""
    var, cos, model = measured
    glob = predict(model, "global", seq_len=T, tokens=B * T)
    k = (L - 1) * 7  # per block: 4 predictions, 2 negative controls, 1 cosine
    for i in range(1, L):
        for point in ("attn.heads", "attn", "resid_mid", ""):
            name = _name(i, point)
            p = glob[(name, "forward")]
            assert p.valid and p.rule.startswith("kernel"), (name, p.rule, p.validity)
            ratios = np.asarray(var[name]) / p.var
            assert not rejects(ratios, 1.0, DELTA, ALPHA / k), (name, ratios.mean())
            assert p.independent is not None and not p.independent.valid, name
            if point in ("attn.heads", "attn"):
                wrong = np.asarray(var[name]) / p.independent.var
                assert rejects(wrong, 1.0, DELTA, ALPHA / k), ("negative control", name, wrong.mean())
        name = f"layers.{i}"
        assert not rejects(cos[name], glob[(name, "forward")].cosine, COS_DELTA, ALPHA / k), (name, np.mean(cos[name]))
    # the backward predictions come from the backward kernel (tests/test_backward_kernel.py), each keeping
    # the independent-token one
    assert glob[("layers.1", "backward")].rule.startswith("kernel")
    assert glob[("layers.1", "backward")].independent is not None


def test_token_coincidence_and_the_embedding_kernel():
    """P_st counts the sequences with the same token at s and t; the embedding kernel is E[w^2] P
    (cs336 embeddings have mean 0), so the predicted embedding cosine is the mean of P off the diagonal."""
    from diagnostics.theory.tokenkernel import token_coincidence

    P = token_coincidence(torch.tensor([[1, 2, 1], [3, 3, 3]]))
    assert np.array_equal(P, [[1.0, 0.5, 1.0], [0.5, 1.0, 0.5], [1.0, 0.5, 1.0]])
    cfg = config(d=32, layers=1, seq=3)
    kt = kernel_theory(cfg, 3, coincidence=P, draws=4)
    m2 = tinylm.init.truncnorm_variance(1.0, -3.0, 3.0)
    assert np.allclose(kt.kernels["token_embeddings"], m2 * P, rtol=1e-15, atol=0)
    assert kt.cosine["token_embeddings"] == pytest.approx((0.5 + 1.0 + 0.5) / 3, rel=1e-15)
    for bad in (np.ones((2, 2)), 0.5 * np.ones((3, 3)), P + np.triu(np.full((3, 3), 0.1), 1)):
        with pytest.raises(OptionsError, match="coincidence"):
            kernel_theory(cfg, 3, coincidence=bad)


def test_cached_kernel_theory_is_keyed_on_everything_it_depends_on():
    """One computation per (config, seq_len, scheme name and function, coincidences); equal to
    kernel_theory's predictions with the same defaults, without the T x T kernels."""
    from dataclasses import replace

    from diagnostics.theory.tokenkernel import cached_kernel_theory, clear_cache

    clear_cache()
    cfg = config(d=32, layers=1, seq=8)
    a = cached_kernel_theory(cfg, 8)
    assert cached_kernel_theory(cfg, 8) is a and a.kernels == {}
    assert a.mean_square == kernel_theory(cfg, 8).mean_square
    assert cached_kernel_theory(cfg, 7) is not a
    assert cached_kernel_theory(replace(cfg, eps=1e-6), 8) is not a
    assert cached_kernel_theory(cfg, 8, scheme="kaiming") is not a
    P = np.eye(8)
    b = cached_kernel_theory(cfg, 8, coincidence=P)
    assert b is not a and cached_kernel_theory(cfg, 8, coincidence=P.copy()) is b
    # a scheme re-registered under the same name is a new function: a new entry, not the stale one
    tinylm.init.register("test-kernel-cache", tinylm.init.get("cs336"))
    try:
        c = cached_kernel_theory(cfg, 8, scheme="test-kernel-cache")
        assert c.mean_square == a.mean_square
        tinylm.init.register("test-kernel-cache", tinylm.init.get("kaiming"), overwrite=True)
        d = cached_kernel_theory(cfg, 8, scheme="test-kernel-cache")
        assert d is not c and d.mean_square == cached_kernel_theory(cfg, 8, scheme="kaiming").mean_square
    finally:
        tinylm.init.SCHEMES.pop("test-kernel-cache", None)
        clear_cache()


def test_kernel_theory_runs_on_one_thread_and_restores_the_callers():
    """The walk runs on one torch thread (many medium-sized ops; and sums that do not depend on the
    thread count): the predictions are the same whatever the caller's setting, which is put back."""
    cfg = config(d=32, layers=2, seq=16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernel_theory(cfg, 16, draws=4)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        one = kernel_theory(cfg, 16, draws=4)
    finally:
        torch.set_num_threads(before)
    assert two.mean_square == one.mean_square and two.cosine == one.cosine
