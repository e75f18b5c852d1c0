"""Token-by-token kernel theory: forward variances at init that account for correlated tokens.

The independent-token ``global`` theory (:mod:`diagnostics.theory.independent`) is exact in block 0
and for every FFN tensor, but from block 1 on attention mixes a component shared by all
positions into the residual stream, the tokens of a sequence become correlated (rank
collapse) and the attention branch and the stream grow past it. This module tracks that
correlation. For every point of the forward pass it propagates the T x T kernel

    K_st = E[x_s . x_t] / d        (x_s: the vector at position s of one sequence)

analytically, in the large-width limit, with the expectation taken over the random init
(the declared distributions of ``tinylm.init``, truncation corrected) and over iid uniform
random tokens. The rules (E[w^2]: a parameter's declared second moment; d_in: a Linear's fan-in):

* Embedding: K_st = E[w^2] P_st + mean(w)^2 (1 - P_st), P_st the probability that s and t
  hold the same token (1 on the diagonal; 1/V for uniform random tokens; for given tokens
  the fraction of the measured sequences, :func:`token_coincidence`: at init the rows of
  the table are iid, so which positions share a token is all that matters).
* Learned positions: K_pos_st = E[p_s . p_t]/d = E[w^2] on the diagonal, mean(w)^2 off it (distinct
  rows of an iid table), added to the token kernel (the tables are independent). The rows are
  the same for every sequence, but over the init they are as independent as two distinct
  tokens' rows: they add to each token's norm, not to the overlap between tokens, so they
  lower the cosine between tokens at the input.
* RMSNorm: K'_st = E[g^2] K_st / sqrt((K_ss + eps)(K_tt + eps)) (token norms concentrate).
* LayerNorm: the mean removal gives K^c = (d-1)/d K (E[m_s m_t] = K_st/d for iid dimensions), each
  token is scaled to E[v/(v+eps)] (v ~ K_ss chi2_{d-1}/d), and its bias adds E[b^2] to every
  entry (:func:`layer_normalize`).
* Linear W (zero-mean iid entries): K' = d_in E[w^2] K, and different outputs are independent.
  A bias, one vector shared by every position, adds E[b^2] to every entry of K'.
* Causal attention, one head (d_k = d/H): q_t, k_t, v_t are Gaussian across positions with
  covariances Kq = d E[w_q^2] K^, Kk, Kv (K^ the normed kernel) and iid over the d_k
  dimensions; q, k and v are mutually independent. The head's output kernel is
  E[A Kv A^T], A = softmax(causal(rope(Q) rope(K)^T / sqrt(d_k))). This expectation is
  taken by Monte Carlo: seeded draws of Q = K^{1/2} Z sqrt(d E[w_q^2]) (T x d_k) and K
  likewise, so the scores are exactly those of a d_k-dimensional head given the kernel
  (finite d_k, not the Gaussian-score limit). RoPE is treated exactly (the draws are
  rotated with the model's own angles and positions 0..T-1); it changes the *covariance*
  of scores in different rows, not their variance. The v-expectation is done in closed
  form: E_v[A V V^T A^T] / d_k = (A K^{1/2})(A K^{1/2})^T d E[w_v^2].
* SwiGLU h = silu(a) * b with a = W1 x^, b = W3 x^: a and b are independent Gaussians
  across positions with Ka = d E[w1^2] K^, Kb = d E[w3^2] K^, so
  Kh_st = E[silu(a_s) silu(a_t)] Kb_st, the bivariate-Gaussian expectation by 2-D
  Gauss-Hermite quadrature (correlation Ka_st / sqrt(Ka_ss Ka_tt)). Non-gated MLP h = f(a):
  Kh = E[f(a_s) f(a_t)] for f SiLU, GELU (exact, tanh) by the same quadrature, ReLU in closed
  form (the arc-cosine kernel): :func:`act_cross_moment`. q/k biases enter the attention draws
  as one shared Gaussian vector per draw; v's bias adds E[b_v^2] to the heads' kernel.
* Residual sum: kernels add (x + f(x): the cross term E[x_s . W_o u_t] vanishes at init,
  W_o being zero-mean and independent of everything before it). Pre-, post- and no-norm
  blocks are composed from these rules by walking the block plan (:mod:`tinylm.plan`, which
  ``tests/test_plan.py`` holds to tinylm's TransformerBlock), one rule per step.

The maps of the norms, the attention and the activations are in :mod:`.tokenkernel_maps`
(re-exported here); this module walks the block plan with them, holds the result
(:class:`KernelTheory`) and caches it (:func:`cached_kernel_theory`).

What the kernel predicts for a tensor: its mean square per element, mean_t K_tt (the pooled
variance a probe measures, the mean being 0 at init except for a non-gated MLP's hidden layer),
and, at the residual points, the mean cosine between different tokens of a sequence,
mean_{s != t} K_st / sqrt(K_ss K_tt), which is what ``ProbeStats.cosine`` measures.

Accuracy: docs/theory.md (``benchmarks/kernel_accuracy.py``); ``tests/test_kernel.py`` holds
the theory to measurement within 10% per block and the mean cosine within 0.03. Without a
norm it fails: see ``KernelTheory.predictions``.

Approximations (where this theory can break): the kernel of one sequence under one init is
random at finite width and with finitely many heads (each head's attention pattern is a
random draw); the theory propagates its *expectation* through the nonlinear maps (norm,
softmax, SiLU), which is exact only as d and the number of heads grow. Token coincidences
enter through their mean over sequences (P_st) only. Dropout is ignored (eval mode). This is the
forward pass; :mod:`.backkernel` carries the gradient's kernel back through the same plan, reading
these kernels and the same attention draws (:func:`attention_samples`).

Use: ``diagnostics.predict(model, "global")`` (hence ``diagnose`` on a fresh model) takes its
forward predictions from here through :func:`cached_kernel_theory`, once per process for each
config, seq_len, scheme and coincidence matrix. Cost: the attention Monte Carlo dominates,
~4/3 T^3 float64 operations per draw and block (A K A^T over the causal lower triangle only,
a third of the dense products' 4 T^3); it grows as T^2 up to T = 256 (2^11 rows per block) and
as T^3 beyond, where the draws stay at 8 (timings: docs/theory.md).

Example::

    kt = kernel_theory(model.config, seq_len=64)
    kt.blocks[7].attn, kt.blocks[7].stream, kt.blocks[7].cosine
    predictions = kt.predictions()        # {(name, "forward"): theory.Prediction}
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

import tinylm
from tinylm.init import Dist, declare
from tinylm.validate import integer

from ..options import OptionsError
from .gaussian import activation_of
from .prediction import Prediction, qk_norm_outside
from .tokenkernel_maps import (_QUAD_NODES, WORKERS, _act_mean, act_cross_moment, attention_kernel,
                               attention_samples, layer_normalize, mean_cosine, normalize, silu_cross_moment)

# the maps of :mod:`.tokenkernel_maps` are re-exported here, beside the walk that applies them
__all__ = ["KernelTheory", "BlockKernel", "kernel_theory", "cached_kernel_theory", "clear_cache", "token_coincidence",
           "normalize", "layer_normalize", "attention_kernel", "attention_samples", "act_cross_moment",
           "silu_cross_moment", "mean_cosine"]

#: Monte Carlo draws of one attention head per block when ``draws`` is not given: about
#: 2^11 query rows in all (32 draws at T = 64, 16 at T = 128, 8 at T = 256), at least 8. The
#: v-expectation is exact, so the Monte Carlo spread is small (docs/theory.md) and falls as
#: 1/sqrt(draws). One draw costs ~4/3 T^3 float64 operations (A K A^T, causal).
_ROWS_PER_BLOCK = 2**11
_MIN_DRAWS = 8


# ---------------------------------------------------------------- results

@dataclass(frozen=True)
class BlockKernel:
    """Predictions for one block (mean square per element, averaged over the T positions).

    heads: attention output before output_proj (``layers.i.attn.heads``); attn: after it
    (``layers.i.attn``, the branch); ffn: the FFN branch (``layers.i.ffn``); resid_mid: the
    stream between the two sublayers; stream: the block output (``layers.i``). cosine /
    cosine_mid: mean cosine between different tokens at the block output / resid_mid.
    heads_independent: what the heads would be if the tokens were independent,
    E[v^2] mean_t E[sum_j a_tj^2] (the independent-token rule, with this block's kernel
    diagonal), so heads / heads_independent isolates the shared-component growth.
    """

    index: int
    heads: float
    attn: float
    ffn: float
    resid_mid: float
    stream: float
    cosine: float
    cosine_mid: float
    heads_independent: float


@dataclass
class KernelTheory:
    """Result of :func:`kernel_theory`.

    kernels: {tensor name: (T, T) kernel E[x_s . x_t]/d} at the embedding, every norm output,
    the attention heads and branch, resid_mid, the FFN hidden layer and branch, each block
    output, ln_final and the logits. mean_square / mean: per (name, "forward") for those
    and for the q/k/v/output projections, w1/w3/w2, scores and probs. cosine: {residual
    point: mean cosine between different tokens}. blocks: one :class:`BlockKernel` per block.
    """

    config: tinylm.ModelConfig
    seq_len: int
    scheme: str
    draws: int
    kernels: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    mean_square: dict[tuple[str, str], float] = field(default_factory=dict, repr=False)
    mean: dict[tuple[str, str], float] = field(default_factory=dict, repr=False)
    cosine: dict[str, float] = field(default_factory=dict, repr=False)
    blocks: list[BlockKernel] = field(default_factory=list)
    rules: dict[tuple[str, str], str] = field(default_factory=dict, repr=False)

    def var(self, name: str) -> float:
        """Predicted pooled variance (mean square minus mean^2) of a tensor's forward values."""
        key = (name, "forward")
        return self.mean_square[key] - self.mean.get(key, 0.0) ** 2

    def predictions(self, *, dropout_active: bool = True) -> dict[tuple[str, str], Prediction]:
        """Every forward prediction as a :class:`diagnostics.theory.Prediction`, keyed like
        :func:`diagnostics.theory.predict`, so it can replace the global forward entries. The
        residual points (token_embeddings, layers.i.resid_mid, layers.i) carry the predicted mean
        cosine between tokens in ``cosine``.

        valid is False without a norm (the stream grows geometrically and one sequence's kernel
        fluctuates far from its expectation) and with dropout
        when ``dropout_active`` (the kernel describes the model without dropout: pass False when
        the measurement ran in eval mode, as ``probe`` does by default); pre- and post-norm were
        checked against measurement. With qk-norm the predictions from block 0's scores on are
        outside validity (:func:`.prediction.qk_norm_outside`).
        """
        c = self.config
        valid, why = True, ""
        if c.norm == "none":
            valid, why = False, ("no norm: the stream grows geometrically and each sequence's kernel fluctuates far "
                                 "from the expected kernel this theory propagates")
        elif c.dropout > 0 and dropout_active:
            valid, why = False, f"dropout={c.dropout}: the kernel theory describes the model without dropout (eval)"
        out = {k: Prediction(ms, self.mean.get(k, 0.0), valid, why, self.rules.get(k, "kernel"),
                             cosine=self.cosine.get(k[0]))
               for k, ms in self.mean_square.items()}
        return qk_norm_outside(out, c, tinylm.plan.build(c), "global")


# ---------------------------------------------------------------- the recursion

def _m2(d: Dist) -> float:
    return d.variance + d.mean**2


# the two terms of each block's residual adds, as the rules name them
_TERMS = {"attn": ("K", "K_attn"), "ffn": ("K_mid", "K_ffn")}


class _Walk:
    """The forward pass of the block plan on T x T kernels."""

    def __init__(self, config: tinylm.ModelConfig, T: int, scheme: str, draws: int, seed: int, nodes: int,
                 coincidence: np.ndarray | None = None, keep_kernels: bool = True):
        self.c, self.T, self.draws, self.seed, self.nodes = config, T, draws, seed, nodes
        self.coincidence, self.keep_kernels = coincidence, keep_kernels
        meta = tinylm.TransformerLM(config, device="meta")
        self.decl = declare(meta, scheme)
        self.fans = {n + ".weight": (m.in_features, m.out_features) for n, m in meta.named_modules()
                     if isinstance(m, tinylm.layers.Linear)}
        self.out = KernelTheory(config, T, scheme, draws)
        self.plan = tinylm.plan.build(config)

    def m2(self, pname: str) -> float:
        if pname not in self.decl and pname == f"{self.plan.head}.weight":  # tied to the embeddings
            pname = f"{self.plan.embedding}.weight"
        return _m2(self.decl[pname])

    def factor(self, linear: str) -> float:
        """d_in E[w^2] of a Linear: K_out = factor K_in (+ :meth:`bias2`)."""
        return self.fans[f"{linear}.weight"][0] * self.m2(f"{linear}.weight")

    def bias2(self, module: str) -> float:
        """E[b^2] of a module's bias, 0 without one: a bias is shared by every position, so it adds
        E[b^2] to every entry of the kernel (diagonal and off it)."""
        return self.m2(f"{module}.bias") if f"{module}.bias" in self.decl else 0.0

    def linear(self, name: str, K: np.ndarray) -> np.ndarray:
        """A Linear's kernel: d_in E[w^2] K + E[b^2]."""
        return self.factor(name) * K + self.bias2(name)

    def put(self, name: str, K: np.ndarray | None, rule: str, *, ms: float | None = None, mean: float = 0.0,
            keep: bool = True) -> None:
        key = (name, "forward")
        self.out.mean_square[key] = float(np.mean(np.diag(K))) if ms is None else float(ms)
        if mean:
            self.out.mean[key] = float(mean)
        self.out.rules[key] = rule
        if keep and self.keep_kernels and K is not None:
            self.out.kernels[name] = K

    def norm(self, name: str, K: np.ndarray) -> np.ndarray:
        if self.c.norm_kind == "layer":
            Kn = layer_normalize(K, self.m2(f"{name}.weight"), self.bias2(name), self.c.eps, self.c.d_model)
            self.put(name, Kn, "kernel layernorm: E[g^2] (d-1)/d K_st r_s r_t + E[b^2], r_s^2 = E[v/(v+eps)]/K^c_ss")
            return Kn
        Kn = normalize(K, self.m2(f"{name}.weight"), self.c.eps)
        self.put(name, Kn, "kernel rmsnorm: E[g^2] K_st / sqrt((K_ss+eps)(K_tt+eps))")
        return Kn

    def linear_ms(self, name: str, K: np.ndarray) -> None:
        self.put(name, None, "kernel linear: d_in E[w^2] K + E[b^2]",
                 ms=self.factor(name) * float(np.mean(np.diag(K))) + self.bias2(name))

    def attention(self, i: int, p: str, K: np.ndarray) -> tuple[np.ndarray, float]:
        """Attention module ``p`` of block i (its index seeds the draws) reading kernel K: the branch's
        kernel and the independent-token heads' mean square (for ``BlockKernel.heads_independent``)."""
        c = self.c
        for proj in ("q_proj", "k_proj", "v_proj"):
            self.linear_ms(f"{p}.{proj}", K)
        fq, fk, fv = (self.factor(f"{p}.{n}") for n in ("q_proj", "k_proj", "v_proj"))
        res = attention_kernel(K, fq, fk, fv, c.head_dim, rope_theta=c.rope_theta if c.rope else None,
                               draws=self.draws, seed=self.seed * 100003 + i,
                               bq2=self.bias2(f"{p}.q_proj"), bk2=self.bias2(f"{p}.k_proj"))
        T = self.T
        self.put(f"{p}.scores", None, "kernel scores: E[q^2] E[k^2] over causal entries", ms=res["scores_ms"])
        self.put(f"{p}.probs", None, "kernel softmax: E[sum_j a_tj^2] by Monte Carlo over the causal entries",
                 ms=float(res["s2"].sum()) / (T * (T + 1) / 2), mean=2.0 / (T + 1))
        bv2 = self.bias2(f"{p}.v_proj")  # rows of A sum to 1: A (V + 1 b^T) = A V + 1 b^T
        Kh = res["heads"] + bv2
        self.put(f"{p}.heads", Kh, "kernel attention: E[A Kv A^T] by Monte Carlo over Gaussian q, k"
                 + (" + E[b_v^2]" if bv2 else ""))
        Ko = self.linear(f"{p}.output_proj", Kh)
        self.put(f"{p}.output_proj", Ko, "kernel linear: d_in E[w^2] K + E[b^2]", keep=False)
        self.put(p, Ko, "kernel attention branch = output_proj")
        heads_ind = fv * float(np.mean(np.diag(K) * res["s2"])) + bv2
        return Ko, heads_ind

    def ffn(self, p: str, K: np.ndarray) -> np.ndarray:
        """FFN module ``p`` reading kernel K: the branch's kernel."""
        act = activation_of(self.c.ffn).name
        Ka = self.linear(f"{p}.w1", K)
        self.put(f"{p}.w1", Ka, "kernel linear: d_in E[w^2] K + E[b^2]", keep=False)
        S = act_cross_moment(Ka, act, self.nodes)  # E[f(a_s) f(a_t)]
        if self.c.ffn == "swiglu":
            Kb = self.linear(f"{p}.w3", K)
            self.put(f"{p}.w3", Kb, "kernel linear: d_in E[w^2] K + E[b^2]", keep=False)
            Kh = S * Kb
            self.put(f"{p}.hidden", Kh, "kernel swiglu: E[silu(a_s) silu(a_t)] Kb_st (2-D Gauss-Hermite)")
        else:
            Kh = S
            how = "closed form" if act == "relu" else "2-D Gauss-Hermite"
            self.put(f"{p}.hidden", Kh, f"kernel {act}: E[{act}(a_s) {act}(a_t)] ({how})",
                     mean=float(np.mean(_act_mean(np.diag(Ka), act, self.nodes))))
        Kf = self.linear(f"{p}.w2", Kh)
        self.put(f"{p}.w2", Kf, "kernel linear: d_in E[w^2] K + E[b^2]", keep=False)
        self.put(p, Kf, "kernel ffn branch = w2")
        return Kf

    def run(self) -> KernelTheory:
        """The kernel rules, one per step of the block plan, in the plan's order."""
        c, T, o = self.c, self.T, self.out
        e = self.decl[f"{self.plan.embedding}.weight"]
        m2, mu = _m2(e), e.mean
        if self.coincidence is None:  # uniform random tokens: the same token at s and t with probability 1/V
            P = np.full((T, T), 1.0 / c.vocab_size)
            np.fill_diagonal(P, 1.0)
        else:
            P = self.coincidence
        K = m2 * P + mu * mu * (1.0 - P)  # rows of one table: the same row (P), or two iid rows (mean^2)
        self.put(self.plan.embedding, K, "kernel embedding: E[w^2] on the diagonal, E[w^2] P_st + mean^2 (1 - P_st) "
                                        "off it (P_st: the same token at s and t; 1/V for uniform random tokens)")
        o.cosine[self.plan.embedding] = mean_cosine(K)
        env = {self.plan.embedding: K}  # the kernel of every tensor the plan names
        if self.plan.positions is not None:
            # learned positions: the rows for positions 0..T-1, distinct rows of one iid table, E[w^2] on the
            # diagonal and mean^2 off it, independent of the tokens' table: the kernels add. The same rows
            # serve every sequence, but over the init they are as independent as distinct tokens' rows are
            p = self.decl[f"{self.plan.positions}.weight"]
            Kp = np.full((T, T), p.mean**2)
            np.fill_diagonal(Kp, _m2(p))
            self.put(self.plan.positions, Kp, "kernel position embedding: E[w^2] on the diagonal, mean^2 off it")
            K = K + Kp
            self.put(self.plan.input, K, "kernel token + position embeddings: K_tok + K_pos")
            o.cosine[self.plan.input] = mean_cosine(K)
            env[self.plan.input] = K
        msd = lambda A: float(np.mean(np.diag(A)))  # noqa: E731
        for block in self.plan.blocks:
            heads_ind = math.nan
            for step in block.steps:
                x = env[step.reads[0]]
                if step.kind == "norm":
                    Kout = self.norm(step.module, x)
                    for alias in step.writes[1:]:  # post-norm: the norm's output is a residual point
                        a, b = _TERMS[step.branch]
                        self.put(alias, Kout, f"kernel post-norm: {step.module.rsplit('.', 1)[-1]}({a} + {b})")
                elif step.kind == "attention":
                    Kout, heads_ind = self.attention(block.index, step.module, x)
                elif step.kind == "ffn":
                    Kout = self.ffn(step.module, x)
                else:  # residual add: kernels add (the cross term vanishes at init)
                    Kout = x + env[step.reads[1]]
                    if not tinylm.plan.is_sum(step.output):
                        a, b = _TERMS[step.branch]
                        self.put(step.output, Kout, f"kernel residual: {a} + {b}")
                for name in step.writes:
                    env[name] = Kout
            attn, ffn = block.branches()
            H, Z = env[block.mid], env[block.output]
            o.cosine[block.mid] = mean_cosine(H)
            o.cosine[block.output] = mean_cosine(Z)
            o.blocks.append(BlockKernel(block.index, o.mean_square[(f"{attn.name}.heads", "forward")], msd(env[attn.name]),
                                        msd(env[ffn.name]), msd(H), msd(Z), o.cosine[block.output], o.cosine[block.mid],
                                        heads_ind))
        K = env[self.plan.blocks[-1].output]
        if self.plan.final_norm is not None:
            K = self.norm(self.plan.final_norm, K)
        self.put(self.plan.head, self.linear(self.plan.head, K), "kernel linear: d_in E[w^2] K")
        return o


def _check_coincidence(coincidence, T: int) -> np.ndarray | None:
    if coincidence is None:
        return None
    P = np.array(coincidence, dtype=np.float64)  # a copy: the caller's array is never kept
    if P.shape != (T, T):
        raise OptionsError(f"coincidence shape {P.shape}: pass a (seq_len, seq_len) = ({T}, {T}) matrix, or None "
                           "for uniform random tokens")
    if not (np.all(np.isfinite(P)) and P.min() >= 0.0 and P.max() <= 1.0 and np.array_equal(P, P.T)
            and np.all(np.diag(P) == 1.0)):
        raise OptionsError("coincidence: must be symmetric with entries in [0, 1] and ones on the diagonal (the "
                           "fraction of sequences holding the same token at positions s and t)")
    P.flags.writeable = False
    return P


def token_coincidence(tokens) -> np.ndarray:
    """P_st: the fraction of sequences whose tokens at positions s and t are the same.

    Args: tokens: (N, T) integer token ids, N sequences. Returns: (T, T) float64, ones on the diagonal.
    At init the embedding rows are iid, so this is all the kernel theory needs to know of the tokens.
    """
    t = torch.as_tensor(tokens).cpu()  # ids on an accelerator are counted here, on the CPU
    if t.dim() != 2 or t.is_floating_point() or t.shape[0] < 1:
        raise OptionsError(f"tokens shape {tuple(t.shape)} dtype {t.dtype}: pass (N, T) integer token ids")
    P = torch.zeros(t.shape[1], t.shape[1], dtype=torch.float64)
    for lo in range(0, t.shape[0], 64):  # (64, T, T) booleans at a time
        x = t[lo:lo + 64]
        P += (x[:, :, None] == x[:, None, :]).sum(0, dtype=torch.float64)
    return (P / t.shape[0]).numpy()


def kernel_theory(config: tinylm.ModelConfig, seq_len: int, *, scheme: str | None = None, draws: int | None = None,
                  seed: int = 0, quad_nodes: int = _QUAD_NODES, coincidence=None,
                  keep_kernels: bool = True) -> KernelTheory:
    """Forward predictions of the token-kernel theory for a tinylm model at init.

    Args:
        config: the model's :class:`tinylm.ModelConfig` (only it and the init declarations are used).
        seq_len: T, the number of positions of each sequence (<= config.context_length).
        scheme: init scheme whose declared distributions to use (default ``config.init``).
        draws: Monte Carlo draws of one attention head per block (default: about 2^11 / T,
            at least 8). The relative error of the heads' mean square is about 1/sqrt(draws T).
        seed: seeds the Monte Carlo draws (block i uses seed * 100003 + i): deterministic.
        quad_nodes: Gauss-Hermite nodes per dimension for the SiLU expectations.
        coincidence: (T, T) P_st, the probability that positions s and t hold the same token
            (:func:`token_coincidence` of the measured tokens), or None for uniform random tokens
            (1/V off the diagonal). At init the embedding rows are iid, so nothing else about
            the tokens matters to the expected kernel.
        keep_kernels: keep every T x T kernel in ``kernels`` (False: only the scalar predictions,
            ~110 fewer T x T arrays for gpt2-small, 55 MB at T = 256).
    Returns:
        a :class:`KernelTheory`: per-block :class:`BlockKernel` rows, T x T kernels, per-tensor
        mean squares (``predictions()`` gives them as ``theory.Prediction``) and cosines.
    """
    if not isinstance(config, tinylm.ModelConfig):
        raise OptionsError(f"config={type(config).__name__}: pass a tinylm.ModelConfig (model.config)")
    integer("seq_len", seq_len, low=1, high=config.context_length, fix="a length within the context", error=OptionsError)
    coincidence = _check_coincidence(coincidence, seq_len)
    if draws is None:
        draws = max(_MIN_DRAWS, _ROWS_PER_BLOCK // seq_len)
    integer("draws", draws, low=1, error=OptionsError)
    integer("quad_nodes", quad_nodes, low=4, error=OptionsError)
    scheme = scheme or config.init
    tinylm.init.get(scheme)  # raises naming the scheme if unknown
    # One torch thread: the walk is many medium-sized ops, where waking a pool of threads costs more
    # than it saves; and one thread makes
    # the Monte Carlo sums, hence the predictions, independent of the caller's thread count.
    threads = torch.get_num_threads()
    token = WORKERS.set(threads)  # the causal products' panels, one torch thread each, on the caller's threads
    try:
        if threads != 1:
            torch.set_num_threads(1)
        with torch.no_grad():
            return _Walk(config, seq_len, scheme, draws, seed, quad_nodes, coincidence, keep_kernels).run()
    finally:
        WORKERS.reset(token)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


_CACHE: "OrderedDict[tuple, KernelTheory]" = OrderedDict()
_CACHE_SIZE = 16
#: caches of results built on this theory (the backward kernel's), which :func:`clear_cache` empties too
DEPENDENT_CACHES: list = []


def cached_kernel_theory(config: tinylm.ModelConfig, seq_len: int, *, scheme: str | None = None,
                         coincidence=None) -> KernelTheory:
    """:func:`kernel_theory` with its default draws, seed and quadrature and without the T x T
    kernels, computed once per process for each distinct input (an LRU of 16), so multi-seed
    and repeated diagnoses pay for it once.

    Keyed on everything the result depends on: the whole (frozen) config, seq_len, the scheme's
    name *and* its function (re-registering a name under ``tinylm.init.register(...,
    overwrite=True)`` gives a new function, hence a new entry), and the coincidence matrix
    (by a SHA-256 of its bytes). The returned object is shared: read it, do not modify it.
    """
    if not isinstance(config, tinylm.ModelConfig):
        raise OptionsError(f"config={type(config).__name__}: pass a tinylm.ModelConfig (model.config)")
    integer("seq_len", seq_len, low=1, high=config.context_length, fix="a length within the context", error=OptionsError)
    name = scheme or config.init
    fn = tinylm.init.get(name)  # raises naming the scheme if unknown
    P = _check_coincidence(coincidence, seq_len)
    digest = None if P is None else hashlib.sha256(P.tobytes()).hexdigest()
    key = (config, seq_len, name, fn, digest)
    kt = _CACHE.get(key)
    if kt is None:
        kt = kernel_theory(config, seq_len, scheme=name, coincidence=P, keep_kernels=False)
        _CACHE[key] = kt
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return kt


def clear_cache() -> None:
    """Forget every :func:`cached_kernel_theory` result, and every cached result built on one."""
    _CACHE.clear()
    for cache in DEPENDENT_CACHES:
        cache.clear()
