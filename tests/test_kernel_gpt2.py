"""The token-kernel theory on the GPT-2 family (LayerNorm with bias, GELU/ReLU MLPs, learned positions,
biases, tied embeddings): its exact identities, and its predictions beside measurement."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

import tinylm
from diagnostics import predict
from diagnostics.theory.independent import ACTIVATIONS, layernorm_moments
from diagnostics.theory.tokenkernel import act_cross_moment, kernel_theory, layer_normalize
from kernelhelp import forward_moments

ALPHA = 1e-6  # family-wise false-alarm probability of the statistical checks of each test
D, L, T, B, V, SEEDS = 128, 4, 32, 4, 1024, 20


def config(init="gpt2", d=D, layers=L, seq=T, **kw):
    """GPT-2's block (the gpt2 preset) at test size: heads of dimension 32, MLP width 4d."""
    return tinylm.preset("gpt2").replace(vocab_size=V, context_length=seq, d_model=d, num_layers=layers,
                                         num_heads=d // 32, d_ff=4 * d, init=init, **kw)


# ---------------------------------------------------------------- exact identities

@pytest.mark.parametrize("ffn", ["gelu_tanh", "gelu", "relu"])
def test_block0_equals_independent_token_theory(ffn):
    """In block 0 the tokens are independent (up to 1/V coincidences; learned positions add to the diagonal
    only): every deterministic rule of the kernel walk (LayerNorm, the MLP, biases, positions) equals the
    independent-token global rule to 1e-6 (Gauss-Hermite or closed form against quad); the softmax rules are
    Monte Carlo on both sides (each < 1.5% here)."""
    cfg = config(init="torch-default", layers=1, ffn=ffn)  # torch-default: nonzero biases everywhere
    kt = kernel_theory(cfg, T, draws=256)
    model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))
    glob = predict(model, "global", seq_len=T, tokens=B * T, forward="independent")
    mc = ("attn.probs", "attn.heads", "attn.output_proj", "layers.0.attn", "resid_mid", "layers.0", "ln2", "ffn.w1",
          "ffn.hidden", "ffn.w2", "layers.0.ffn", "ln_final", "lm_head")
    checked = 0
    for key, ms in kt.mean_square.items():
        tol = 0.015 if key[0].endswith(mc) else 1e-6
        assert ms == pytest.approx(glob[key].mean_square, rel=tol), key
        checked += 1
    assert checked == 21 and kt.rules[("layers.0.ffn.hidden", "forward")].startswith(f"kernel {ffn}")


def test_layernorm_bias_and_position_kernels():
    """LayerNorm's map: diagonal E[g^2] E[v/(v+eps)] + E[b^2], off it E[g^2] (d-1)/d K_st r_s r_t + E[b^2];
    the position table adds E[w^2] on the diagonal only; a Linear's bias adds E[b^2] to every entry."""
    rng = np.random.default_rng(0)
    G = rng.standard_normal((6, 9))
    K = G @ G.T / 9
    d, eps = 16, 0.3
    out = layer_normalize(K, 1.7, 0.2, eps, d)
    fwd = np.array([layernorm_moments(float(k), d, eps)[0] for k in np.diag(K)])
    assert np.allclose(np.diag(out), 1.7 * fwd + 0.2, rtol=1e-12)
    r = np.sqrt(fwd / (np.diag(K) * (d - 1) / d))
    assert np.allclose(out, 1.7 * K * (d - 1) / d * np.outer(r, r) + 0.2, rtol=1e-12)
    assert np.linalg.eigvalsh(out - 0.2).min() > 0  # a normalised PSD kernel stays PSD

    cfg = config(init="torch-default", layers=1)
    kt = kernel_theory(cfg, 8, draws=8)
    decl = tinylm.init.declare(tinylm.TransformerLM(cfg, device="meta"), "torch-default")
    m2 = {n: dd.variance + dd.mean**2 for n, dd in decl.items()}
    pos, tok = kt.kernels["position_embeddings"], kt.kernels["token_embeddings"]
    assert np.allclose(pos, np.eye(8) * m2["position_embeddings.weight"], rtol=1e-15, atol=0)
    assert np.allclose(kt.kernels["resid_in"], tok + pos, rtol=1e-15)
    Kin, Kh = kt.kernels["layers.0.ffn.hidden"], kt.kernels["layers.0.ffn"]
    f2 = 4 * D * m2["layers.0.ffn.w2.weight"]
    assert np.allclose(Kh, f2 * Kin + m2["layers.0.ffn.w2.bias"], rtol=1e-12)
    assert m2["layers.0.ffn.w2.bias"] == pytest.approx(1 / (3 * 4 * D), rel=1e-12)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("sd, rho", [((0.5, 1.6), -0.6), ((1.2, 1.2), 0.999)])
def test_cross_moment_against_scipy(act, sd, rho):
    """E[f(a) f(b)] for a bivariate normal: Gauss-Hermite (GELU) against scipy.integrate.dblquad; the
    arc-cosine closed form (ReLU) against a 1-D quad over a > 0 of relu(a) E[relu(b) | a]
    (b | z1 ~ N(m, s^2): E[relu(b)] = m Phi(m/s) + s phi(m/s))."""
    s1, s2 = sd
    Ka = np.array([[s1 * s1, rho * s1 * s2], [rho * s1 * s2, s2 * s2]])
    dens = lambda z: math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731
    if act == "relu":
        m, s = (lambda z1: s2 * rho * z1), s2 * math.sqrt(1 - rho * rho)
        ref, _ = integrate.quad(lambda z1: s1 * z1 * (m(z1) * stats.norm.cdf(m(z1) / s) + s * dens(m(z1) / s))
                                * dens(z1), 0, 12, epsabs=1e-13, epsrel=1e-11)
    else:
        f = ACTIVATIONS[act].f
        ref, _ = integrate.dblquad(
            lambda z2, z1: float(f(s1 * z1)) * float(f(s2 * (rho * z1 + math.sqrt(1 - rho * rho) * z2))) * dens(z1)
            * dens(z2), -10, 10, -10, 10, epsabs=1e-12, epsrel=1e-10)
    assert act_cross_moment(Ka, act)[0, 1] == pytest.approx(ref, rel=1e-6, abs=1e-10)


def test_gelu_fast_path_equals_pairwise():
    """A normed input (equal diagonal) takes the Chebyshev-in-rho path for GELU too; it equals the pairwise quadrature."""
    rng = np.random.default_rng(1)
    G = rng.standard_normal((24, 5))
    K = G @ G.T
    r = 1 / np.sqrt(np.diag(K))
    K = 0.9 * K * r[:, None] * r[None, :]
    assert np.allclose(act_cross_moment(K, "gelu_tanh")[:16, :16], act_cross_moment(K[:16, :16], "gelu_tanh"),
                       rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------- beside measurement

DELTA, COS_DELTA = 0.10, 0.03  # the claim: measured/predicted within 10%, cosine within 0.03
CHECKED = ("attn.heads", "attn", "resid_mid", "ffn", "")  # "" = the block output (the residual stream)


def rejects(values, claim, delta, alpha):
    """True if the (1 - alpha) t interval of mean(values) over replicates excludes [claim - delta, claim + delta]
    (a false alarm with probability <= alpha/2 when |E[value] - claim| <= delta)."""
    v = np.asarray(values, dtype=float)
    half = stats.t.ppf(1 - alpha / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
    return v.mean() - half > claim + delta or v.mean() + half < claim - delta


def measure(cfg):
    """Per seed (fresh init and uniform random tokens): forward variance per tensor, cosine per residual point."""
    return forward_moments(cfg, SEEDS, B, T)


@pytest.mark.parametrize("init", ["cs336", "gpt2"])
def test_kernel_predictions_match_measurement(init):
    """GPT-2's block, d 128, L 4, T 32, 20 seeds, under its own init and under cs336's: attention heads and
    branch, resid_mid, MLP and the stream at every block within 10% of the kernel theory (reached through
    predict, "global"), the mean cosine between tokens within 0.03. Negative control (cs336 init, where the
    tokens correlate strongly): the independent-token prediction of the attention heads and branch, which
    each prediction keeps in ``independent``, is rejected by the same check at every block >= 2 (1.6x and
    more; at block 1, 1.25x, 20 seeds do not resolve it from 1.1 at this alpha).
    Each check has false-alarm probability alpha/k (Bonferroni: the k checks together alpha = 1e-6)."""
    cfg = config(init=init)
    var, cos, model = measure(cfg)
    glob = predict(model, "global", seq_len=T, tokens=B * T)
    k = L * (len(CHECKED) + 1) + 2 * (L - 2) + 2
    for i in range(L):
        for point in CHECKED:
            name = f"layers.{i}" + (f".{point}" if point else "")
            p = glob[(name, "forward")]
            assert p.valid and p.rule.startswith("kernel"), (name, p.rule)
            assert not rejects(np.asarray(var[name]) / p.var, 1.0, DELTA, ALPHA / k), (name, np.mean(var[name]) / p.var)
            if init == "cs336" and i >= 2 and point in ("attn.heads", "attn"):
                wrong = np.asarray(var[name]) / p.independent.var
                assert rejects(wrong, 1.0, DELTA, ALPHA / k), ("negative control", name, wrong.mean())
        name = f"layers.{i}"
        assert not rejects(cos[name], glob[(name, "forward")].cosine, COS_DELTA, ALPHA / k), (name, np.mean(cos[name]))
    for name in ("resid_in", "position_embeddings"):
        assert not rejects(np.asarray(var[name]) / glob[(name, "forward")].var, 1.0, DELTA, ALPHA / k), name
