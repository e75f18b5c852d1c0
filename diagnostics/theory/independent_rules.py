"""The independent-token rules, one per kind of site: a tensor's predicted moments from those of
its inputs (measured in local mode, predicted in global mode) and its weights.

Their formulas are the contract of :mod:`.independent` (its module doc), which applies them one
per step of the block plan: linear (:func:`_linear_fwd`, :func:`_linear_back_factor`), norm
(:func:`_norm_fwd`, :func:`_norm_back`), attention (:func:`_attention_fwd`, :func:`_attention_back`),
FFN (:func:`_ffn_fwd`, :func:`_ffn_back`), and the cross-entropy rule's premises
(:func:`_ce_validity`). :class:`_Source` says where a rule's inputs come from and holds what the
rules put.
"""

from __future__ import annotations

import math

import tinylm
from tinylm.init import declare

from ..measure.moments import ProbeStats
from .gaussian import _s2_at, activation_moments, activation_of, layernorm_moments, softmax_moments
from .prediction import Prediction


class _Source:
    """Where a rule's inputs come from: measured (local) or predicted (global)."""

    def __init__(self, model: tinylm.TransformerLM, mode: str, stats: ProbeStats | None, seq_len: int,
                 tokens: float, scheme: str | None, softmax: tuple[float, float] | None = None):
        self.model, self.mode, self.stats, self.T, self.N = model, mode, stats, seq_len, tokens
        self.softmax = softmax
        self.config = model.config
        self.plan = tinylm.plan.build(model.config)
        self.producer = self.plan.producers()
        self.out: dict[tuple[str, str], Prediction] = {}
        self.params = dict(model.named_parameters(remove_duplicate=False))  # a tied lm_head keeps its name
        if mode == "global":
            self.decl = declare(model, scheme or self.config.init)

    # inputs
    def ms(self, name: str, direction: str = "forward") -> float:
        if self.mode == "local":
            m = self.stats.tensors.get((name, direction)) if self.stats else None
            if m is None or not m.count:
                raise KeyError((name, direction))
            return m.mean_square
        return self.out[(name, direction)].mean_square

    def mean(self, name: str, direction: str = "forward") -> float:
        if self.mode == "local":
            m = self.stats.tensors.get((name, direction))
            return m.mean if m is not None and m.count else 0.0
        p = self.out.get((name, direction))
        return p.mean if p is not None else 0.0

    def var(self, name: str, direction: str = "forward") -> float:
        m = self.mean(name, direction)
        return self.ms(name, direction) - m * m

    def fwd_ms(self, name: str) -> float:
        """E[x^2] of a tensor: ``ms`` for a named one; for a residual sum no module outputs, the sum of
        its two terms' (independent at init: the branch's output weights are zero-mean)."""
        if tinylm.plan.is_sum(name):
            a, b = self.producer[name].reads
            return self.fwd_ms(a) + self.fwd_ms(b)
        return self.ms(name)

    def fwd_var(self, name: str) -> float:
        """The variance (mean square minus mean^2) of a tensor, as ``fwd_ms`` (a residual sum: its terms' sum)."""
        if tinylm.plan.is_sum(name):
            a, b = self.producer[name].reads
            return self.fwd_var(a) + self.fwd_var(b)
        return self.var(name)

    def second_moment(self, pname: str) -> float:
        """mean(w^2): actual (local) or declared E[w^2] (global)."""
        if self.mode == "local":
            return float(self.params[pname].detach().double().square().mean())
        if pname not in self.decl and pname == f"{self.plan.head}.weight":  # tied to the token embeddings
            pname = f"{self.plan.embedding}.weight"
        d = self.decl[pname]
        return d.variance + d.mean * d.mean

    # outputs
    def put(self, name: str, direction: str, ms: float, rule: str, *, mean: float | None = None,
            valid: bool = True, why: str = "") -> None:
        if mean is None:
            mean = self.mean(name, direction) if self.mode == "local" else 0.0
        self.out[(name, direction)] = Prediction(ms, mean, valid, why, rule)

    def has(self, name: str, direction: str = "forward") -> bool:
        if self.mode == "local":
            m = self.stats.tensors.get((name, direction)) if self.stats else None
            return m is not None and bool(m.count)
        return (name, direction) in self.out


def _bias2(src: _Source, name: str) -> float:
    """E[b^2] of module ``name``'s bias (0 without one): a bias adds it to every output's mean square."""
    return src.second_moment(f"{name}.bias") if f"{name}.bias" in src.params else 0.0


def _linear_fwd(src: _Source, name: str, x: str, kind_rule: str = "linear") -> float:
    w = src.params[f"{name}.weight"]
    d_out, d_in = w.shape
    b2 = _bias2(src, name)
    ms = d_in * src.second_moment(f"{name}.weight") * src.ms(x) + b2
    src.put(name, "forward", ms, f"{kind_rule}: d_in E[w^2] E[x^2]" + (" + E[b^2]" if b2 or f"{name}.bias" in src.params
                                                                         else ""))
    return ms


def _linear_back_factor(src: _Source, name: str) -> float:
    """d_out E[w^2]: the factor from E[g_y^2] to this Linear's share of E[g_x^2]."""
    w = src.params[f"{name}.weight"]
    return w.shape[0] * src.second_moment(f"{name}.weight")


def _is_layer(src: _Source) -> bool:
    return src.config.norm_kind == "layer"


def _norm_word(src: _Source) -> str:
    return "layernorm" if _is_layer(src) else "rmsnorm"


def _norm_fwd(src: _Source, name: str, x_ms: float, out_name: str | None = None, x_var: float | None = None) -> float:
    """RMSNorm: mean(gain^2) ms/(ms + eps). LayerNorm: mean(gain^2) E[v/(v + eps)] + mean(b^2), v the
    token's variance (:func:`layernorm_moments`, from the input's variance ``x_var``, default ``x_ms``)."""
    gain2 = src.second_moment(f"{name}.weight")
    eps = src.config.eps
    if _is_layer(src):
        var = x_ms if x_var is None else x_var
        fwd, _ = layernorm_moments(round(max(var, 0.0), 12), src.config.d_model, eps)
        ms = gain2 * fwd + _bias2(src, name)
        rule = "layernorm: mean(gain^2) E[v/(v+eps)] + mean(b^2) (v ~ var chi2_{d-1}/d)"
    else:
        ms = gain2 * x_ms / (x_ms + eps) if x_ms + eps > 0 else 0.0
        rule = "rmsnorm: mean(gain^2) ms/(ms+eps)"
    src.put(out_name or name, "forward", ms, rule)
    return ms


def _norm_back(src: _Source, name: str, g_ms: float, x_ms: float, x_name: str | None = None,
               x_var: float | None = None) -> float:
    """RMSNorm: E[g_x^2] = mean(gain^2) E[g_y^2] E[1/(ms + eps)] (d-1)/d: local mode reads E[1/(ms+eps)] per
    token as measured at ``x_name``; global mode takes d/((d-2)(ms + eps)) (chi-square tokens).
    LayerNorm: mean(gain^2) E[g_y^2] E[(d - 2 + (eps/(v+eps))^2)/(d (v + eps))] (:func:`layernorm_moments`,
    from the input's variance ``x_var``, default ``x_ms``, in both modes)."""
    d = src.config.d_model
    gain2 = src.second_moment(f"{name}.weight")
    if _is_layer(src):
        var = x_ms if x_var is None else x_var
        _, back = layernorm_moments(round(max(var, 0.0), 12), d, src.config.eps)
        return gain2 * g_ms * back
    proj = (d - 1) / d if d > 1 else 1.0
    if src.mode == "local" and src.stats is not None:
        nb = src.stats.norm_back.get(name)
        if nb is not None and nb.count:  # measured per token: mean_t E_i[g_y^2]_t / (ms_t + eps)
            return gain2 * nb.mean * proj
        inv = src.stats.inv_ms.get(x_name) if x_name else None
        if inv is not None and inv.count:
            return gain2 * g_ms * inv.mean * proj
    chi = d / (d - 2) if d > 2 else 1.0
    return gain2 * g_ms / (x_ms + src.config.eps) * chi * proj if x_ms + src.config.eps > 0 else 0.0


def _attention_fwd(src: _Source, i: int, p: str, x: str) -> None:
    """Attention module ``p`` of block i reading tensor ``x``: q, k, v, scores, probs, heads, output_proj."""
    T = src.T
    outside = (False, "tokens are correlated beyond block 0 (attention mixes a shared component into the "
                      "stream); the independent-token rule underestimates")
    for proj in ("q_proj", "k_proj", "v_proj"):
        _linear_fwd(src, f"{p}.{proj}", x)
    s_var = src.ms(f"{p}.q_proj") * src.ms(f"{p}.k_proj")
    src.put(f"{p}.scores", "forward", s_var, "scores: E[q^2] E[k^2]")
    sigma = math.sqrt(max(src.var(f"{p}.scores") if src.mode == "local" else s_var, 0.0))
    mc = softmax_moments(round(sigma, 6), T)
    npairs = T * (T + 1) / 2
    p_ms = float(mc["s2"][:T].sum()) / npairs
    pvalid, pwhy = (True, "") if i == 0 else (False, "beyond block 0 the scores of different keys are correlated "
                                                      "(tokens share a component); the iid-score softmax overestimates")
    src.put(f"{p}.probs", "forward", p_ms, "softmax of Gaussian scores, S2(t+1) by Monte Carlo",
            mean=2.0 / (T + 1), valid=pvalid, why=pwhy)
    a2 = (src.ms(f"{p}.probs") * npairs / T) if src.mode == "local" else float(mc["s2"][:T].mean())
    valid, why = (True, "") if i == 0 else outside
    bv2 = _bias2(src, f"{p}.v_proj")  # rows of A sum to 1: A (V + 1 b^T) = A V + 1 b^T
    src.put(f"{p}.heads", "forward", (src.ms(f"{p}.v_proj") - bv2) * a2 + bv2,
            "heads: E[v^2] mean_t E[sum_j a_tj^2]" + (" (v's bias passes whole: + E[b_v^2])" if bv2 else ""),
            valid=valid, why=why)
    ms = _linear_fwd(src, f"{p}.output_proj", f"{p}.heads")
    gvalid, gwhy = (True, "") if (i == 0 or src.mode == "local") else outside
    src.put(f"{p}.output_proj", "forward", ms, "linear: d_in E[w^2] E[x^2]", valid=gvalid, why=gwhy)
    src.put(p, "forward", ms, "attention branch = output_proj", valid=gvalid, why=gwhy)


def _ffn_fwd(src: _Source, p: str, x: str) -> None:
    """FFN module ``p`` reading tensor ``x``: w1, [w3], hidden, w2 (the activation from :data:`ACTIVATIONS`)."""
    _linear_fwd(src, f"{p}.w1", x)
    a_mean, a_var = src.mean(f"{p}.w1"), max(src.var(f"{p}.w1"), 0.0)
    act = activation_of(src.config.ffn)
    m1, m2, _ = activation_moments(act.name, round(a_mean, 9), round(math.sqrt(a_var), 9))
    if src.config.ffn == "swiglu":
        _linear_fwd(src, f"{p}.w3", x)
        src.put(f"{p}.hidden", "forward", m2 * src.ms(f"{p}.w3"), "swiglu: E[silu(a)^2] E[b^2]",
                mean=None if src.mode == "local" else 0.0)
    else:
        src.put(f"{p}.hidden", "forward", m2, f"{act.name}: E[{act.name}(a)^2]", mean=None if src.mode == "local" else m1)
    ms = _linear_fwd(src, f"{p}.w2", f"{p}.hidden")
    src.put(p, "forward", ms, "ffn branch = w2")


def _attention_back(src: _Source, p: str, g_branch: float) -> float:
    """Gradients inside attention module ``p`` given E[g^2] at its output; returns E[g^2] at its input (all of q, k, v)."""
    c, T = src.config, src.T
    dk = c.d_model // c.num_heads
    src.put(f"{p}.output_proj", "backward", g_branch, "attention branch gradient = stream gradient")
    g_o = _linear_back_factor(src, f"{p}.output_proj") * g_branch
    src.put(f"{p}.heads", "backward", g_o, "linear backward: d_out E[w^2] E[g_y^2]")
    g_o = src.ms(f"{p}.heads", "backward")
    npairs = T * (T + 1) / 2
    g_p = dk * g_o * src.ms(f"{p}.v_proj")
    src.put(f"{p}.probs", "backward", g_p, "probs gradient: d_k E[g_o^2] E[v^2]")
    sigma = math.sqrt(max(src.var(f"{p}.scores"), 0.0))
    mc = softmax_moments(round(sigma, 6), T)
    shape = float((mc["s2"][:T] - 2 * mc["s3"][:T] + mc["s2sq"][:T]).sum()) / npairs
    src.put(f"{p}.scores", "backward", src.ms(f"{p}.probs", "backward") * shape,
            "softmax backward: E[g_p^2] E[sum a^2 (1 - 2a + S2)]")
    g_s_row = src.ms(f"{p}.scores", "backward") * npairs / T  # E[sum_j g_s,tj^2], averaged over t
    src.put(f"{p}.q_proj", "backward", src.ms(f"{p}.k_proj") * g_s_row / dk, "q gradient: E[k^2] E[sum_j g_s^2]/d_k")
    # a K/V head shared by G query heads (grouped-query attention) sums their G gradients, uncorrelated
    # at init (other rows of q_proj, other columns of output_proj): G times one head's
    group = c.num_heads // c.kv_heads
    each = f", summed over {group} query heads" if group > 1 else ""
    src.put(f"{p}.k_proj", "backward", group * src.ms(f"{p}.q_proj") * g_s_row / dk,
            f"k gradient: E[q^2] E[sum_t g_s^2]/d_k{each}")
    a2 = (src.ms(f"{p}.probs") * npairs / T) if src.mode == "local" else float(mc["s2"][:T].mean())
    src.put(f"{p}.v_proj", "backward", group * g_o * a2, f"v gradient: E[g_o^2] mean_j E[sum_t a_tj^2]{each}")
    return sum(_linear_back_factor(src, f"{p}.{n}") * src.ms(f"{p}.{n}", "backward")
               for n in ("q_proj", "k_proj", "v_proj"))


def _ffn_back(src: _Source, p: str, g_branch: float) -> float:
    """Gradients inside FFN module ``p`` given E[g^2] at its output; returns E[g^2] at its input."""
    src.put(f"{p}.w2", "backward", g_branch, "ffn branch gradient")
    src.put(f"{p}.hidden", "backward", _linear_back_factor(src, f"{p}.w2") * g_branch,
            "linear backward: d_out E[w^2] E[g_y^2]")
    g_h = src.ms(f"{p}.hidden", "backward")
    a_mean, a_var = src.mean(f"{p}.w1"), max(src.var(f"{p}.w1"), 0.0)
    act = activation_of(src.config.ffn)
    _, m2, d2 = activation_moments(act.name, round(a_mean, 9), round(math.sqrt(a_var), 9))
    if src.config.ffn == "swiglu":
        src.put(f"{p}.w3", "backward", g_h * m2, "swiglu backward: E[g_h^2] E[silu(a)^2]")
        src.put(f"{p}.w1", "backward", g_h * src.ms(f"{p}.w3") * d2, "swiglu backward: E[g_h^2] E[b^2] E[silu'(a)^2]")
        return (_linear_back_factor(src, f"{p}.w1") * src.ms(f"{p}.w1", "backward")
                + _linear_back_factor(src, f"{p}.w3") * src.ms(f"{p}.w3", "backward"))
    src.put(f"{p}.w1", "backward", g_h * d2, f"{act.name} backward: E[g_h^2] E[{act.name}'(a)^2]")
    return _linear_back_factor(src, f"{p}.w1") * src.ms(f"{p}.w1", "backward")


def _ce_validity(src: _Source, logit_var: float) -> tuple[bool, str]:
    """Whether the measured softmax moments keep the cross-entropy rule's premises (module doc)."""
    if src.softmax is None:
        return True, ""
    V = src.config.vocab_size
    s2_m, py_m = src.softmax
    s2 = _s2_at(round(math.sqrt(max(logit_var, 0.0)), 6), V)
    assumed, actual = s2 - 2.0 / V + 1.0, s2_m - 2.0 * py_m + 1.0
    tol = 0.05 if src.mode == "local" else 0.10
    if not (math.isfinite(actual) and math.isfinite(assumed)):
        return False, "the softmax of the logits is not finite"
    if abs(actual / assumed - 1.0) <= tol:
        return True, ""
    # name the premise(s) behind the gap, the larger first (a term under a quarter of the other is left out)
    terms = [(abs(s2_m - s2), f"E[sum p^2] = {s2_m:.3g} where iid logits of the measured variance give {s2:.3g} "
                              f"({'a more peaked' if s2_m > s2 else 'a flatter'} softmax)"),
             (2.0 * abs(py_m - 1.0 / V), f"E[p_y] = {py_m:.3g} where targets independent of p give 1/V = {1.0 / V:.3g} "
                                         f"({'the model predicts its targets' if py_m > 1.0 / V else 'the targets get less than a uniform share'})")]
    terms.sort(key=lambda t: -t[0])
    named = [text for size, text in terms if size >= 0.25 * terms[0][0]]
    return False, ("the rule assumes a near-uniform softmax independent of the targets (as at init); measured "
                   + " and ".join(named) + f", so E[sum_c (p_c - y_c)^2] is {actual / assumed:.3g}x the rule's")
