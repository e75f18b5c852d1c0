"""Backward token-kernel theory: gradient variances at init that account for correlated tokens.

The forward token-kernel theory (:mod:`.tokenkernel`) carries K_st = E[x_s . x_t]/d through the
blocks. This module carries the gradient's kernel backward through the same block plan:

    G_st = E[g_s . g_t] / d        (g_s: the loss gradient at position s of one sequence)

in the large-width limit, expectations over the random init and iid uniform random tokens,
reading the forward kernels K of the same walk. The rules (b = d_out E[w^2] of a Linear: its
backward factor; f = d_in E[w^2]: its forward factor; N positions per loss, V classes):

* Cross-entropy at the logits, g_t = (p_t - onehot(y_t)) / N with a near-uniform softmax:
  G_tt = (E[sum p^2] - 2/V + 1) / (V N^2) (the independent-token rule; its premise is checked
  as there), G_st = K^logits_st / (V^2 N^2) off the diagonal (p_s . p_t = (1 + K^logits_st)/V to
  first order in the logits, targets independent of them with coincidence 1/V).
* Linear y = W x: G_x = b G_y (W zero-mean, independent of the gradient that reaches it).
* RMSNorm y = g * x / r, r = sqrt(ms(x) + eps): the Jacobian is a projection,
  g_x = (gain * g_y - xhat (xhat . gain * g_y)/d) / r, so
  G_x,st = E[gain^2] G_y,st / sqrt((K_ss + eps)(K_tt + eps)) c_st with the finite-width factor
  c_st = (1 - (2 - rho_st^2)/d)(1 + (3 + rho_st^2)/(2d)) (rho_st = K_st / sqrt(K_ss K_tt)):
  the projection removes (2 - rho^2)/d of g_s . g_t, and E[1/(r_s r_t)] of chi-square token
  norms adds (3 + rho^2)/(2d); on the diagonal c = (d-1)/(d-2), the independent-token rule.
* LayerNorm y = gain * (x - m)/sigma + bias: the Jacobian (P - u u^T/d) gain / sigma (P = I - 1 1^T/d)
  removes 1 and u, a rank d-2 projection; off the diagonal its trace (d - 1 - rho_s - rho_t +
  rho_s rho_t rho_st^2)/d and the chi-square (d - 1 degrees of freedom) fluctuation of sigma give
  G_x,st (:func:`layer_norm_backward`), on the diagonal the independent-token rule (exact in eps).
  The bias does not enter the Jacobian.
* Residual add z = x + f(x): G_x = G_z + (the branch's input gradient); the cross term
  E[g_z . J_f^T g_z] vanishes at init (J_f^T ends in W_o^T or W_2^T, zero-mean).
* SwiGLU h = silu(a) * b (a = W1 xhat, b = W3 xhat, independent Gaussians over positions with
  Ka = f1 K, Kb = f3 K): G_b = G_h * E[silu(a_s) silu(a_t)], G_a = G_h * Kb * E[silu'(a_s) silu'(a_t)]
  (elementwise; bivariate Gauss-Hermite quadrature), G_xhat = b1 G_a + b3 G_b. Non-gated MLP h = f(a)
  (SiLU, GELU exact and tanh, ReLU): G_a = G_h * E[f'(a_s) f'(a_t)] (:func:`dact_cross_moment`;
  ReLU in closed form, P(a_s > 0, a_t > 0) = 1/4 + arcsin(rho_st)/(2 pi)).
* Biases do not change a Linear's Jacobian; they enter through the forward kernels the rules read
  (Ka = f1 K + E[b1^2], the attention draws' q and k, E[v^2] in the probabilities' gradient). What
  is predicted are gradients at module outputs; a bias's own gradient (the sum over positions of its
  output's) is only in the probe's per-parameter statistics, which no theory predicts.
* Learned positions: token + position embeddings (``resid_in``) pass their gradient to both tables'
  outputs; the position table's output is one (T, d) tensor broadcast over the batch, so its
  gradient sums the B = N/T sequences': B mean_t G_tt (different sequences' gradients are
  independent at init, their targets being independent).
* Causal attention, one head (d_k = d/H), o = A v, A = softmax(S), S = q k^T / sqrt(d_k), with the
  forward walk's Monte Carlo draws of (q, k) and A (:func:`.tokenkernel_maps.attention_samples`):
  - value path: g_v = A^T g_o, G_v = E[A^T G_o A] (closed form in g_o);
  - probabilities: g_P,ij = g_o,i . v_j, E[g_P,ij^2] = d_k G_o,ii f_v K_jj;
  - scores (the softmax Jacobian): g_S,ij = A_ij g_o,i . (v_j - sum_k A_ik v_k), so
    E[g_S,ij^2] = d_k f_v G_o,ii A_ij^2 (K_jj - 2 (K a_i)_j + a_i^T K a_i) (closed form in g_o, v);
  - queries and keys: g_q,i = sum_j g_S,ij k_j / sqrt(d_k), g_k,j = sum_i g_S,ij q_i / sqrt(d_k),
    RoPE undone on the way back; their kernels by Monte Carlo over g_o (covariance G_o) and
    v (covariance f_v K) given each draw of (q, k);
  - the input gradient G_xhat = b_q G_q + b_k G_k + b_v G_v (the three paths through independent
    weights: their cross terms vanish at init).
  The softmax path (q and k) is not neglected: at init it carries a quarter to two fifths of the
  variance of the gradient at the attention's input (docs/theory.md).

The rules are applied one per step of the block plan (:mod:`tinylm.plan`), in reverse, so pre-,
post- and no-norm blocks, RMSNorm or LayerNorm, are covered by the same four rules (norm, attention, FFN, add); a
residual point's gradient is the sum of what its readers hand back. The maps of the norms, the
activations and the attention are in :mod:`.backkernel_maps` (re-exported here); this module walks
the plan with them, marks validity and caches the result (:func:`cached_backward_kernel`).

What is predicted: for every tensor the probe measures backward, the mean square per element of
its gradient, mean_t G_tt (scores and probabilities: over the causal entries), mean 0.

Validity (:meth:`BackwardKernel.predictions`): accuracy against measurement is in docs/theory.md
(``benchmarks/backward_accuracy.py``); a prediction is inside validity only where that benchmark
shows it within 10%: see ``_validity``. The approximations are the forward theory's (the
expected kernel propagated through nonlinear maps, exact only as d and the heads grow), plus
independence of the gradient from the forward activations it multiplies (exact at large width;
at finite width the correlation is O(1/d) per block and accumulates over depth).

Example::

    bk = backward_kernel(model.config, seq_len=64, tokens=8 * 64)
    bk.mean_square[("layers.3.attn.v_proj", "backward")]
    predictions = bk.predictions()       # {(name, "backward"): theory.Prediction}
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

import tinylm
from tinylm.validate import integer

from ..options import OptionsError
from .backkernel_maps import (attention_backward, dact_cross_moment, dsilu_cross_moment, layer_norm_backward,
                              norm_backward)
from .gaussian import activation_of, ce_grad_mean_square
from .prediction import Prediction, qk_norm_not_covered, qk_norm_outside
from . import tokenkernel
from .tokenkernel import KernelTheory
from .tokenkernel_maps import act_cross_moment

# the maps of :mod:`.backkernel_maps` are re-exported here, beside the walk that applies them
__all__ = ["BackwardKernel", "backward_kernel", "cached_backward_kernel", "norm_backward", "layer_norm_backward",
           "dact_cross_moment", "dsilu_cross_moment", "not_covered", "MAX_SEQ_LEN"]

#: the longest sequence the backward kernel is computed for by :func:`.predict`: its attention
#: products grow as T^3, so at a model's full context of 1024 it would cost more than the
#: measurement it sits beside (timings: docs/theory.md); longer sequences keep the
#: independent-token rules for their gradients
MAX_SEQ_LEN = 512


def not_covered(config: tinylm.ModelConfig, seq_len: int) -> str | None:
    """Why the backward kernel does not describe ``config`` at ``seq_len`` (None: it does). Its rules
    cover RMSNorm and LayerNorm, every FFN of :data:`.gaussian.ACTIVATIONS`, biases and learned
    positions; not a per-head query/key norm (``qk_norm``), nor long sequences (the cost)."""
    qk = qk_norm_not_covered(config)
    if qk:
        return qk
    if seq_len > MAX_SEQ_LEN:
        return f"seq_len={seq_len} > {MAX_SEQ_LEN}: the backward kernel's cost grows as T^3"
    return None


# ---------------------------------------------------------------- results

@dataclass
class BackwardKernel:
    """Result of :func:`backward_kernel`: ``grads`` {tensor name: (T, T) gradient kernel} (when
    kept), ``mean_square`` / ``rules`` per (name, "backward"), the forward :class:`KernelTheory`
    it read (``forward``) and the ``tokens`` per loss it was scaled for."""

    forward: KernelTheory
    tokens: float
    grads: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    mean_square: dict[tuple[str, str], float] = field(default_factory=dict, repr=False)
    rules: dict[tuple[str, str], str] = field(default_factory=dict, repr=False)
    #: with tied embeddings, why they put the backward kernel outside validity ("" where they do not:
    #: :meth:`_BackWalk.tied_reason`)
    tied: str = ""

    def predictions(self, *, dropout_active: bool = True) -> dict[tuple[str, str], Prediction]:
        """Every backward prediction as a :class:`diagnostics.theory.Prediction` (mean 0), its
        validity from ``_validity`` (the regime ``benchmarks/backward_accuracy.py`` shows within 10%).
        With dropout in the config and ``dropout_active`` every one is outside validity (the
        theory describes the model without dropout: pass False when the measurement ran in eval
        mode, as ``probe`` does by default). With qk-norm every one is outside validity
        (:func:`.prediction.qk_norm_outside`)."""
        c = self.forward.config
        plan = tinylm.plan.build(c)
        out = {}
        for key, ms in self.mean_square.items():
            valid, why = _validity(c, plan, key[0], self.tied)
            if valid and c.dropout > 0 and dropout_active:
                valid, why = False, f"dropout={c.dropout}: the kernel theory describes the model without dropout (eval)"
            out[key] = Prediction(ms, 0.0, valid, why, self.rules[key])
        return qk_norm_outside(out, c, plan, "global")


#: gradients through the softmax of the scores: the scores' own, and the queries' and keys' it makes
_SOFTMAX_PATH = ("attn.scores", "attn.q_proj", "attn.k_proj")
#: blocks a gradient may cross downward, per d_model x num_heads, before the finite-width drift the
#: expected kernel does not carry can reach 10% (docs/theory.md: ~2/(d H) per block pre-norm,
#: ~15/(d H) post-norm, measured at d 128 and 256 by benchmarks/backward_accuracy.py)
_DEPTH_BUDGET = {"pre": 1 / 48, "post": 1 / 256}


#: heads at least this wide (GPT-2's 64) are fewer at a given d_model, and their attention patterns
#: fluctuate more from sequence to sequence: pre-norm, their depth budget is 1/64 and the values' gradient
#: and the attention's input norm's (which sums the softmax path's) are outside validity (docs/theory.md)
_WIDE_HEAD = 64
#: with tied embeddings, the largest expected softmax share of a position's own input token, and the
#: largest logit variance, at which the backward kernel stays inside validity (measured within 10% at
#: shares below 1e-3 and logit variances below 0.4: docs/theory.md)
_SELF_PROB_LIMIT = 0.01
_TIED_LOGIT_VAR = 1.0


def _validity(config: tinylm.ModelConfig, plan: tinylm.plan.ModelPlan, name: str,
              tied: str = "tied embeddings: not checked") -> tuple[bool, str]:
    """Where the backward kernel is inside validity: the regime benchmarks/backward_accuracy.py shows
    within 10% of measurement (docs/theory.md, "The backward kernel").

    * No norm: outside (the forward kernel is).
    * Tied embeddings (``tied``: the reason, "" where they are inside): each position's logit for its
      own input token is e . h ~ d E[w_E^2] gain / rms(x) = mu above the others' (its row is in the
      stream the head reads); outside where the softmax's expected share of that token,
      1 / (1 + (V-1) exp(K_logits/2 - mu)), exceeds ``_SELF_PROB_LIMIT`` or the logits' variance
      K_logits exceeds ``_TIED_LOGIT_VAR`` (the gradient at the logits, and through the head the
      stream's, then carries that row).
    * The softmax path (scores, q_proj, k_proj): outside. Its size depends on each sequence's spread
      of keys around their attention-weighted mean, whose fluctuation over sequences the expected
      kernel does not carry: measured 1.0x to 1.3x (pre-norm) and 1.0x to 1.9x (post-norm) of the rule.
      Post-norm, the probabilities' gradient too (0.6x to 1.0x).
    * Depth: a gradient that has crossed n blocks downward from the top (n = L - 1 - i at block i,
      L - 1 at the embeddings) is inside validity while n <= d_model x num_heads x budget, the
      budget 1/48 pre-norm and 1/256 post-norm: at d 128 (4 heads) 10 and 2 blocks, at d 256
      (8 heads) 42 and 8. Heads of dimension 64 or more (GPT-2's), pre-norm: the budget is 1/64
      (4 blocks at d 128 with 2 heads), and the values' gradient and the attention's input norm's are
      outside (measured up to 1.16x and 1.19x of the rule under small-init: the first is E[A^T G_o A]
      with each sequence's own pattern, the second sums the queries' and keys').
    * Grouped-query attention (H_kv < H key/value heads, G = H / H_kv): a K/V head's gradient is
      the sum of its G query heads' (G times one head's kernel, the heads uncorrelated at init),
      but their patterns on one sequence fluctuate together: the values' gradient and the
      attention's input gradient are outside (measured 1.05x to 1.16x of the rule at d 128, 8
      heads, 2 K/V heads, L 4 and 8), and the depth budget counts key/value heads,
      n <= d_model x H_kv x budget, with the budget 1/64 pre-norm (d 128, 2 K/V heads: 4 blocks;
      the stream's gradient measured 1.09x at 4 blocks crossed, 1.11x at 5, 1.12x at 7).
    """
    if config.norm == "none":
        return False, ("no norm: the forward stream's kernel fluctuates far from its expectation, and the "
                       "gradient's with it")
    if config.tie_embeddings and tied:
        return False, tied
    if name.endswith(_SOFTMAX_PATH):
        return False, ("the gradient through the softmax depends on each sequence's spread of keys, whose "
                       "fluctuation over sequences the expected kernel does not carry (measured up to 1.3x the rule "
                       "pre-norm, 1.9x post-norm)")
    if config.norm == "post" and name.endswith("attn.probs"):
        return False, ("post-norm, the probabilities' gradient (g_o,i . v_j) is measured at 0.6x to 1.0x of the rule, "
                       "which takes g_o and v independent; the shortfall is not explained")
    wide = config.head_dim >= _WIDE_HEAD and config.norm == "pre"
    if wide and (name.endswith("attn.v_proj")
                 or any(s.kind == "attention" and s.reads[0] == name for b in plan.blocks for s in b.steps)):
        return False, (f"heads of dimension {config.head_dim}: few heads, whose patterns fluctuate over sequences more "
                       "than the expected kernel carries; the values' gradient and the attention's input gradient "
                       "(which sums the queries' and keys') are measured up to 1.19x the rule")
    group = config.num_heads // config.kv_heads
    if group > 1 and (name.endswith("attn.v_proj")
                      or any(s.kind == "attention" and s.reads[0] == name for b in plan.blocks for s in b.steps)):
        return False, (f"grouped-query attention ({config.kv_heads} key/value heads for {config.num_heads}): each "
                       f"value and key gradient sums {group} query heads' patterns on the same sequence, which "
                       "fluctuate together more than the expected kernel carries; the values' gradient and the "
                       "attention's input gradient are measured up to 1.16x the rule")
    L = config.num_layers
    i = tinylm.plan.block_index(name)
    below = (plan.embedding, plan.input, plan.positions)  # beneath block 0
    crossed = L - 1 - i if i is not None else (L - 1 if name in below else 0)
    narrow = wide or (group > 1 and config.norm == "pre")  # few heads, or few K/V heads: the 1/64 budget
    limit = config.d_model * config.kv_heads * (1 / 64 if narrow else _DEPTH_BUDGET[config.norm])
    if crossed > limit:
        heads = f"{config.num_heads} heads" + (f", {config.kv_heads} key/value heads" if group > 1 else "")
        return False, (f"{crossed} blocks below the top: beyond {int(limit)} ({config.norm}-norm, d_model "
                       f"{config.d_model}, {heads}) the finite-width drift of the gradient "
                       "(O(1/(d_model heads)) per block, heads counted by key/value heads) can exceed 10%")
    return True, ""


# ---------------------------------------------------------------- the walk

class _BackWalk:
    """The backward pass of the block plan on T x T gradient kernels, reading the forward kernels."""

    def __init__(self, kt: KernelTheory, tokens: float, seed: int, nodes: int, keep: bool):
        self.kt, self.c, self.T, self.N = kt, kt.config, kt.seq_len, float(tokens)
        self.seed, self.nodes, self.keep = seed, nodes, keep
        meta = tinylm.TransformerLM(self.c, device="meta")
        self.decl = tinylm.init.declare(meta, kt.scheme)
        self.fans = {n + ".weight": (m.in_features, m.out_features) for n, m in meta.named_modules()
                     if isinstance(m, tinylm.layers.Linear)}
        self.plan = tinylm.plan.build(self.c)
        self.out = BackwardKernel(kt, float(tokens))
        self.parts: dict[str, list[np.ndarray]] = {}
        self.grad: dict[str, np.ndarray] = {}

    # parameters
    def m2(self, pname: str) -> float:
        if pname not in self.decl and pname == f"{self.plan.head}.weight":  # tied to the embeddings
            pname = f"{self.plan.embedding}.weight"
        d = self.decl[pname]
        return d.variance + d.mean**2

    def fwd(self, linear: str) -> float:
        """d_in E[w^2]: K_out = fwd K_in."""
        return self.fans[f"{linear}.weight"][0] * self.m2(f"{linear}.weight")

    def back(self, linear: str) -> float:
        """d_out E[w^2]: G_in = back G_out (a bias does not change a Linear's Jacobian)."""
        return self.fans[f"{linear}.weight"][1] * self.m2(f"{linear}.weight")

    def bias2(self, module: str) -> float:
        """E[b^2] of a module's bias (0 without one): it adds to every entry of the forward kernel."""
        return self.m2(f"{module}.bias") if f"{module}.bias" in self.decl else 0.0

    # forward kernels
    def K(self, name: str) -> np.ndarray:
        if tinylm.plan.is_sum(name):  # a post-norm sum: x + branch (the cross term vanishes at init)
            a, b = self.plan.producers()[name].reads
            return self.K(a) + self.K(b)
        return self.kt.kernels[name]

    # outputs
    def put(self, name: str, G: np.ndarray | None, rule: str, *, ms: float | None = None) -> None:
        key = (name, "backward")
        self.out.mean_square[key] = float(np.mean(np.diag(G))) if ms is None else float(ms)
        self.out.rules[key] = rule
        if self.keep and G is not None:
            self.out.grads[name] = G

    def give(self, name: str, G: np.ndarray, label: str) -> None:
        self.parts.setdefault(name, []).append((G, label))

    def finish(self, names: tuple[str, ...], rule: str | None = None) -> np.ndarray | None:
        """Sum what the readers of the tensor ``names`` handed back: its gradient kernel."""
        got = [n for n in names if n in self.parts]
        if not got:
            return None
        parts = self.parts.pop(got[0])
        G = parts[0][0] if len(parts) == 1 else sum((p[0] for p in parts[1:]), parts[0][0])
        text = rule or ("kernel " + parts[0][1] if len(parts) == 1 else "kernel residual backward: "
                        + " + ".join(p[1] for p in parts))
        for n in names:
            self.grad[n] = G
            if not tinylm.plan.is_sum(n):
                self.put(n, G, text)
        return G

    # rules
    def norm(self, module: str, x: str, G_y: np.ndarray) -> np.ndarray:
        rule = layer_norm_backward if self.c.norm_kind == "layer" else norm_backward
        return rule(G_y, self.K(x), self.m2(f"{module}.weight"), self.c.eps, self.c.d_model)

    @property
    def norm_word(self) -> str:
        return "layernorm backward" if self.c.norm_kind == "layer" else "rmsnorm backward"

    def attention(self, i: int, p: str, x: str, G: np.ndarray) -> np.ndarray:
        c = self.c
        self.put(f"{p}.output_proj", G, "kernel attention branch gradient = stream gradient")
        G_o = self.back(f"{p}.output_proj") * G
        self.put(f"{p}.heads", G_o, "kernel linear backward: d_out E[w^2] G")
        fq, fk, fv = (self.fwd(f"{p}.{n}") for n in ("q_proj", "k_proj", "v_proj"))
        res = attention_backward(self.K(x), G_o, fq, fk, fv, c.head_dim, rope_theta=c.rope_theta if c.rope else None,
                                 draws=self.kt.draws, seed=self.seed * 100003 + i, bq2=self.bias2(f"{p}.q_proj"),
                                 bk2=self.bias2(f"{p}.k_proj"), bv2=self.bias2(f"{p}.v_proj"))
        self.put(f"{p}.probs", None, "kernel probs backward: d_k G_o,ii (f_v K_jj + E[b_v^2]) over the causal entries",
                 ms=res["probs_ms"])
        self.put(f"{p}.scores", None, "kernel softmax backward: A_ij^2 g_o,i.(v_j - vbar_i) by Monte Carlo over A",
                 ms=res["scores_ms"])
        # a K/V head shared by G query heads sums their G gradients, uncorrelated at init (other
        # columns of output_proj and rows of q_proj): G times one head's kernel
        group = c.num_heads // c.kv_heads
        res["k"], res["v"] = group * res["k"], group * res["v"]
        each = f" summed over {group} query heads" if group > 1 else ""
        self.put(f"{p}.v_proj", res["v"], f"kernel value backward: E[A^T G_o A]{each}")
        self.put(f"{p}.q_proj", res["q"], "kernel query backward: sum_j g_S,ij k_j / sqrt(d_k) by Monte Carlo")
        self.put(f"{p}.k_proj", res["k"], f"kernel key backward: sum_i g_S,ij q_i / sqrt(d_k) by Monte Carlo{each}")
        return sum(self.back(f"{p}.{n}") * res[n[0]] for n in ("q_proj", "k_proj", "v_proj"))

    def ffn(self, p: str, x: str, G: np.ndarray) -> np.ndarray:
        self.put(f"{p}.w2", G, "kernel ffn branch gradient = stream gradient")
        G_h = self.back(f"{p}.w2") * G
        self.put(f"{p}.hidden", G_h, "kernel linear backward: d_out E[w^2] G")
        K = self.K(x)
        Ka = self.fwd(f"{p}.w1") * K + self.bias2(f"{p}.w1")
        act = activation_of(self.c.ffn).name
        D = dact_cross_moment(Ka, act, self.nodes)
        if self.c.ffn == "swiglu":
            Kb = self.fwd(f"{p}.w3") * K + self.bias2(f"{p}.w3")
            G_b = G_h * act_cross_moment(Ka, "silu", self.nodes)
            G_a = G_h * Kb * D
            self.put(f"{p}.w3", G_b, "kernel swiglu backward: G_h E[silu(a_s) silu(a_t)]")
            self.put(f"{p}.w1", G_a, "kernel swiglu backward: G_h Kb E[silu'(a_s) silu'(a_t)]")
            return self.back(f"{p}.w1") * G_a + self.back(f"{p}.w3") * G_b
        G_a = G_h * D
        how = "closed form" if act == "relu" else "2-D Gauss-Hermite"
        self.put(f"{p}.w1", G_a, f"kernel {act} backward: G_h E[{act}'(a_s) {act}'(a_t)] ({how})")
        return self.back(f"{p}.w1") * G_a

    def tied_reason(self) -> str:
        """With tied embeddings, why they put the predictions outside validity ("" where they do not):
        the expected softmax share of each position's own input token, 1 / (1 + (V-1) exp(K_logits/2 - mu)),
        mu = d E[w_E^2] sqrt(E[gain^2]) / rms of the stream the last norm reads (that token's row is in
        it, so its logit is e . h ~ |e|^2 / rms), above ``_SELF_PROB_LIMIT``, or the logits' variance
        above ``_TIED_LOGIT_VAR``."""
        c, plan = self.c, self.plan
        if not c.tie_embeddings or c.norm == "none":
            return ""
        if plan.final_norm is not None:
            norm, src = plan.final_norm, plan.blocks[-1].output
        else:  # post-norm: the last block's last norm
            step = [s for s in plan.blocks[-1].steps if s.kind == "norm"][-1]
            norm, src = step.module, step.reads[0]
        rms = math.sqrt(float(np.mean(np.diag(self.K(src)))))
        mu = c.d_model * self.m2(f"{plan.embedding}.weight") * math.sqrt(self.m2(f"{norm}.weight")) / rms
        kl = float(np.mean(np.diag(self.kt.kernels[plan.head])))
        share = 1.0 / (1.0 + (c.vocab_size - 1) * math.exp(min(kl / 2 - mu, 700.0)))
        if share > _SELF_PROB_LIMIT or not kl <= _TIED_LOGIT_VAR:
            return (f"tied embeddings: each position's own input token is expected to get {share:.2g} of the softmax, "
                    f"the logits' variance is {kl:.3g} (inside validity up to {_SELF_PROB_LIMIT} and "
                    f"{_TIED_LOGIT_VAR}): the logits' gradient carries the embedding rows it reaches")
        return ""

    def run(self, softmax_s2: float | None = None) -> BackwardKernel:
        c, T, V, N, plan = self.c, self.T, self.c.vocab_size, self.N, self.plan
        self.out.tied = self.tied_reason()
        Kl = self.kt.kernels[plan.head]
        diag = ce_grad_mean_square(float(np.mean(np.diag(Kl))), V, N)
        G = Kl / (V * V * N * N)
        np.fill_diagonal(G, diag)
        self.put(plan.head, G, "kernel cross-entropy: (E[sum p^2] - 2/V + 1)/(V N^2) on the diagonal, "
                               "K_logits/(V^2 N^2) off it")
        G = self.back(plan.head) * G
        last = plan.blocks[-1].output
        if plan.final_norm is not None:
            self.put(plan.final_norm, G, "kernel linear backward: d_out E[w^2] G")
            G = self.norm(plan.final_norm, last, G)
            self.give(last, G, self.norm_word)
        else:
            self.give(last, G, "linear backward")
        for block in reversed(plan.blocks):
            for step in reversed(block.steps):
                G_out = self.finish(step.writes)
                if step.kind == "norm":
                    self.give(step.reads[0], self.norm(step.module, step.reads[0], G_out), self.norm_word)
                elif step.kind == "attention":
                    self.give(step.reads[0], self.attention(block.index, step.module, step.reads[0], G_out),
                              "attention input gradient")
                elif step.kind == "ffn":
                    self.give(step.reads[0], self.ffn(step.module, step.reads[0], G_out), "ffn input gradient")
                else:  # a residual add passes its output's gradient to both terms
                    stream, branch = step.reads
                    self.give(stream, G_out, "g_out" if step.output == block.output else "g_mid")
                    self.give(branch, G_out, "stream gradient")
        if plan.positions is None:
            self.finish((plan.embedding,))
            return self.out
        G = self.finish((plan.input,))  # token + position embeddings: the sum passes its gradient to both
        self.put(plan.embedding, G, "kernel token embedding backward: the gradient at token + position embeddings")
        # the position rows are one (T, d) tensor broadcast over the batch's B = N/T sequences: its gradient
        # sums theirs, independent at init (different targets; their logits' gradients overlap only O(1/V))
        batch = N / T
        self.put(plan.positions, None, "kernel position embedding backward: B mean_t G_tt at token + position "
                                       "embeddings (summed over the batch's B sequences)",
                 ms=batch * float(np.mean(np.diag(G))))
        return self.out


def backward_kernel(config: tinylm.ModelConfig, seq_len: int, *, tokens: float, scheme: str | None = None,
                    draws: int | None = None, seed: int = 0, quad_nodes: int = 32, coincidence=None,
                    keep_kernels: bool = True, forward: KernelTheory | None = None) -> BackwardKernel:
    """Backward (gradient) predictions of the token-kernel theory for a tinylm model at init.

    Args:
        config, seq_len, scheme, draws, seed, quad_nodes, coincidence: as
            :func:`.tokenkernel.kernel_theory`, whose walk (with its T x T kernels) this one reads.
        tokens: N, positions per loss (batch x seq_len): the loss is their mean, so every gradient
            scales as 1/N^2.
        keep_kernels: keep every T x T gradient kernel in ``grads``.
        forward: a :class:`KernelTheory` of the same config, seq_len and scheme computed with
            ``keep_kernels=True`` (None: computed here).
    Returns: a :class:`BackwardKernel`.
    """
    if not isinstance(config, tinylm.ModelConfig):
        raise OptionsError(f"config={type(config).__name__}: pass a tinylm.ModelConfig (model.config)")
    if not (isinstance(tokens, (int, float)) and not isinstance(tokens, bool) and tokens > 0):
        raise OptionsError(f"tokens={tokens!r}: must be a positive number; pass batch x seq_len, the positions "
                           "per loss")
    integer("quad_nodes", quad_nodes, low=4, error=OptionsError)
    if forward is None:
        forward = tokenkernel.kernel_theory(config, seq_len, scheme=scheme, draws=draws, seed=seed,
                                            quad_nodes=quad_nodes, coincidence=coincidence, keep_kernels=True)
    elif not forward.kernels:
        raise OptionsError("forward: a KernelTheory without its kernels; pass one computed with keep_kernels=True")
    threads = torch.get_num_threads()
    try:
        if threads != 1:
            torch.set_num_threads(1)
        with torch.no_grad(), np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
            return _BackWalk(forward, tokens, seed, quad_nodes, keep_kernels).run()
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


_CACHE: "OrderedDict[tuple, BackwardKernel]" = OrderedDict()
_CACHE_SIZE = 8
tokenkernel.DEPENDENT_CACHES.append(_CACHE)  # tokenkernel.clear_cache() forgets these too


def cached_backward_kernel(config: tinylm.ModelConfig, seq_len: int, *, tokens: float, scheme: str | None = None,
                           coincidence=None) -> BackwardKernel:
    """:func:`backward_kernel` with its defaults and without the kernels, once per process for each
    (config, seq_len, scheme name and function, tokens, coincidence digest); an LRU of 8. Shared: read only."""
    if not isinstance(config, tinylm.ModelConfig):
        raise OptionsError(f"config={type(config).__name__}: pass a tinylm.ModelConfig (model.config)")
    name = scheme or config.init
    fn = tinylm.init.get(name)
    P = None if coincidence is None else np.array(coincidence, dtype=np.float64)
    digest = None if P is None else hashlib.sha256(P.tobytes()).hexdigest()
    key = (config, int(seq_len), name, fn, float(tokens), digest)
    bk = _CACHE.get(key)
    if bk is None:
        bk = backward_kernel(config, seq_len, tokens=tokens, scheme=name, coincidence=P, keep_kernels=False)
        bk.forward.kernels.clear()  # the T x T forward kernels are not needed once walked
        _CACHE[key] = bk
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return bk
