"""Predicted forward and gradient variance of every instrumented tensor of a tinylm model.

One recursion serves both modes; they differ only in where a layer's inputs come from:

* ``global``: purely analytic at init. Weights enter through their declared
  distributions (``tinylm.init.declare``; second moment E[w^2] = Dist.variance +
  Dist.mean^2, truncation corrected), activations through the predictions for
  the layers before. The rules below assume independent tokens (uniform random
  tokens). For a tinylm model the *forward* predictions then come from the
  token-kernel theory (:mod:`diagnostics.theory.tokenkernel`, ``forward="kernel"``, the default),
  which tracks the correlation between a sequence's tokens (accuracy: docs/theory.md);
  each of those predictions
  keeps the independent-token one in ``Prediction.independent``. So do the backward
  predictions, from the backward kernel (:mod:`diagnostics.theory.backkernel`).
* ``local``: each layer from the *measured* moments of its own input (a
  :class:`ProbeStats` of one replicate) and its *actual* weights. Works for a
  trained checkpoint, where measured/predicted shows how far training has aligned
  a layer's weights with its inputs (1 for a random matrix).

Rules (x: input, y: output, g: gradient of the loss; E[.^2] a mean square per element):

* Embedding: E[y^2] = E[w^2] (local: the mean square of the whole table).
* Linear y = W x (+ b), W (d_out, d_in): E[y^2] = ||W||_F^2 / d_out E[x^2] (+ E[b^2])  (global: d_in E[w^2] E[x^2]);
  backward E[g_x^2] = ||W||_F^2 / d_in E[g_y^2]  (global: d_out E[w^2] E[g_y^2]).
* RMSNorm y = gain x / sqrt(ms(x) + eps): E[y^2] = mean(gain^2) ms/(ms + eps); backward
  E[g_x^2] = mean(gain^2) E[g_y^2] E[1/(ms + eps)] (d-1)/d (the projection onto x removes
  1/d of the energy); local mode measures the per-token product mean_t E[g_y^2]_t/(ms_t + eps)
  (gradient and norm vary together over positions, so pooling them separately is biased
  beyond block 0), global mode takes E[g_y^2] d/((d-2)(ms + eps)) (chi-square token norms).
* LayerNorm y = g (x - mean)/sqrt(v + eps) + b, v the token's population variance (d v/var ~
  chi2_{d-1}): E[y^2] = mean(g^2) E[v/(v+eps)] + mean(b^2); backward E[g_x^2] = mean(g^2) E[g_y^2]
  E[(d - 2 + (eps/(v+eps))^2)/(d (v + eps))] (the Jacobian P - u u^T/d removes the directions 1
  and u: rank d-2), for a gradient whose direction is independent of the normalised token (a
  near-uniform softmax, as at init). :func:`layernorm_moments`; var from the input's variance
  (measured in local mode).
* SwiGLU h = silu(a) * b, a, b independent Gaussians: E[h^2] = E[silu(a)^2] E[b^2];
  backward E[g_b^2] = E[g_h^2] E[silu(a)^2], E[g_a^2] = E[g_h^2] E[b^2] E[silu'(a)^2]
  (Gaussian expectations by scipy.integrate.quad). Non-gated MLP h = f(a), f one of
  :data:`ACTIVATIONS` (SiLU, GELU exact and tanh, ReLU): E[h^2] = E[f(a)^2], mean E[f(a)],
  backward E[g_a^2] = E[g_h^2] E[f'(a)^2] (:func:`activation_moments`, any mean and variance).
* Biases: a Linear's bias adds E[b^2] to its output's mean square (0 at init for every scheme
  but torch-default); v_proj's bias passes the attention whole (rows of A sum to 1):
  E[heads^2] = (E[v^2] - E[b_v^2]) mean_t E[sum_j a_tj^2] + E[b_v^2].
* Learned positions: E[resid_in^2] = E[w_tok^2] + E[w_pos^2] (independent tables); backward,
  the token embedding's gradient is resid_in's, the position table's output (one (T, d) tensor
  broadcast over the batch) B = N/T times it (the batch's sequences' gradients are independent).
* Attention (causal, T positions, scores s ~ N(0, sigma^2) with sigma^2 = E[q^2] E[k^2]):
  row t is a softmax over n = t+1 scores; S2(n) = E[sum_j a_j^2] (Monte Carlo with a fixed
  seed, shared draws across n). Heads: E[o^2] = E[v^2] (1/T) sum_t S2(t+1); probabilities
  over the causal entries: mean 2/(T+1), E[p^2] = sum_t S2(t+1) / (T(T+1)/2). Backward:
  E[g_p^2] = d_k E[g_o^2] E[v^2]; E[g_s^2] = E[g_p^2] E[sum_j a_j^2 (1 - 2 a_j + S2)] per
  causal entry; E[g_q^2] = E[k^2] E[sum_j g_s,tj^2] / d_k, E[g_k^2] likewise with q,
  E[g_v^2] = E[g_o^2] (1/T) sum_t S2(t+1).
* Residual stream: branch variances add (pre-norm and no-norm); post-norm normalises the sum.
  Backward, an add passes its output's gradient to both terms and a residual point's gradient
  is the sum of what its readers pass back (the add, and the branch or norm that reads it).

The rules are applied one per step of the block plan (:mod:`tinylm.plan`), forward in the
plan's order and backward in reverse, so every norm placement the plan describes is covered
by the same four rules (norm, attention, FFN, residual add). Where they live: the Gaussian
expectations in :mod:`.gaussian` (re-exported here), the rule of each kind of site in
:mod:`.independent_rules`, the walk of the plan and the validity marks here.
* Cross-entropy gradient (mean over the N positions of one loss, V classes): E[g^2] =
  (E[sum_c p_c^2] - 2 E[p_y] + 1) / (V N^2), taken with E[sum p^2] = S2(V) for iid logits of
  variance sigma_l^2 and E[p_y] = 1/V (targets independent of p): a near-uniform softmax, as at
  init. N is the count of one loss even when the moments pool several batches (each gradient
  is scaled by its own loss's 1/N).

Validity: every rule here assumes independent tokens. At init, attention mixes a
component shared by all positions into the stream (tokens become correlated), so
beyond block 0 the independent-token global prediction of the attention heads/branch
and of the stream is "outside validity" (the kernel theory, which replaces them by
default, is valid there: its own validity is used, see ``KernelTheory.predictions``;
where it is outside validity and the independent-token rule is not, as in block 0
without a norm, the independent-token prediction is kept); so is, in local mode,
the heads prediction beyond block 0.
The cross-entropy rule is outside validity when the measured softmax moments (``softmax=``)
break its premises: the measured E[sum p^2] - 2 E[p_y] + 1 differs from the rule's by more
than the mode's tolerance (5% local, 10% global), as on a trained model (a peaked softmax,
predictable targets). A prediction whose variance comes out <= 0 (local mode: a measured
output mean larger than the random-matrix mean square) is outside validity too.
"""

from __future__ import annotations

import torch
from torch import nn

import tinylm

from ..measure.moments import ProbeStats
from .gaussian import (ACTIVATIONS, Activation, activation_moments, activation_of, ce_grad_mean_square,
                       layernorm_factors, layernorm_moments, silu_moments, softmax_moments)
from .independent_rules import (_attention_back, _attention_fwd, _ce_validity, _ffn_back, _ffn_fwd, _linear_back_factor,
                                _linear_fwd, _norm_back, _norm_fwd, _norm_word, _Source)
from .prediction import Prediction, no_variance_left

# the Gaussian expectations of :mod:`.gaussian` are re-exported here, beside the rules that use them
__all__ = [
    "independent_predictions",
    "ACTIVATIONS",
    "Activation",
    "activation_of",
    "activation_moments",
    "silu_moments",
    "layernorm_moments",
    "layernorm_factors",
    "softmax_moments",
    "ce_grad_mean_square",
]


# the two terms of each block's residual adds, as the rules name them
_TERMS = {"attn": ("x", "attn"), "ffn": ("h", "ffn")}
_OUTSIDE = "the stream carries the attention's shared component from block 1 on; independent-token sums underestimate"


def _norm_step_fwd(src: _Source, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    _norm_fwd(src, step.module, src.fwd_ms(step.reads[0]), x_var=src.fwd_var(step.reads[0]))
    for alias in step.writes[1:]:  # post-norm: the norm's output is a residual point
        a, b = _TERMS[step.branch]
        src.put(alias, "forward", src.out[(step.output, "forward")].mean_square,
                f"post-norm: {step.module.rsplit('.', 1)[-1]}({a} + {b})")


def _attention_step_fwd(src: _Source, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    _attention_fwd(src, block.index, step.module, step.reads[0])


def _ffn_step_fwd(src: _Source, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    _ffn_fwd(src, step.module, step.reads[0])


def _add_step_fwd(src: _Source, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    """Residual add: branch variances add (the branch's output weights are zero-mean at init). A sum
    no module outputs (post-norm) is not predicted: its norm reads it through ``fwd_ms``."""
    if tinylm.plan.is_sum(step.output):
        return
    stream, branch = step.reads
    gvalid = src.mode == "local" or block.index == 0
    a, b = _TERMS[step.branch]
    src.put(step.output, "forward", src.ms(stream) + src.ms(branch), f"residual: Var({a}) + Var({b})",
            valid=gvalid, why="" if gvalid else _OUTSIDE)


_FORWARD = {"norm": _norm_step_fwd, "attention": _attention_step_fwd, "ffn": _ffn_step_fwd, "add": _add_step_fwd}


def _forward(src: _Source) -> None:
    """The forward rules, one per step of the block plan, in the plan's order."""
    plan = src.plan
    src.put(plan.embedding, "forward", src.second_moment(f"{plan.embedding}.weight"), "embedding: E[w^2]")
    if plan.positions is not None:  # learned positions: an independent table, added
        src.put(plan.positions, "forward", src.second_moment(f"{plan.positions}.weight"), "position embedding: E[w^2]")
        src.put(plan.input, "forward", src.ms(plan.embedding) + src.ms(plan.positions),
                "token + position embeddings: E[w_tok^2] + E[w_pos^2]")
    for block in plan.blocks:
        for step in block.steps:
            _FORWARD[step.kind](src, block, step)
    head_in = plan.blocks[-1].output
    if plan.final_norm is not None and (src.mode == "global" or src.has(plan.final_norm)):
        _norm_fwd(src, plan.final_norm, src.ms(head_in), x_var=src.var(head_in))
        head_in = plan.final_norm
    _linear_fwd(src, plan.head, head_in)


def _backward(src: _Source) -> None:
    """The backward rules: cross-entropy at the logits, then one rule per step of the block plan in reverse."""
    plan, V = src.plan, src.config.vocab_size
    head = plan.head
    if src.N > 0:
        n_tokens = src.N  # the positions of one loss, also when the stats pool several batches
    else:
        n_tokens = src.stats.tensors[(head, "forward")].n_total / V
    logit_var = src.var(head)
    valid, why = _ce_validity(src, logit_var)
    src.put(head, "backward", ce_grad_mean_square(logit_var, V, n_tokens),
            "cross-entropy: (E[sum p^2] - 2/V + 1)/(V N^2)", mean=0.0, valid=valid, why=why)
    g_head_in = _linear_back_factor(src, head) * src.ms(head, "backward")
    last = plan.blocks[-1].output
    if plan.final_norm is not None and src.has(plan.final_norm):
        fn = plan.final_norm
        src.put(fn, "backward", g_head_in, "linear backward: d_out E[w^2] E[g_y^2]")
        src.put(last, "backward", _norm_back(src, fn, src.ms(fn, "backward"), src.ms(last), last, src.var(last)),
                f"{_norm_word(src)} backward")
    else:
        src.put(last, "backward", g_head_in, "linear backward: d_out E[w^2] E[g_y^2]")
    walk = _BackWalk(src)
    for block in reversed(plan.blocks):
        for step in reversed(block.steps):
            walk.finish(block, step.writes)
            _BACKWARD[step.kind](walk, block, step)
    if plan.positions is None:
        walk.finish(None, (plan.embedding,))
        return
    walk.finish(None, (plan.input,))  # the sum passes its gradient to both tables' outputs
    src.put(plan.embedding, "backward", src.ms(plan.input, "backward"), "g_in (token + position embeddings)")
    # the position rows are one (T, d) tensor broadcast over the batch: its gradient sums the batch's B = N/T
    # sequences, whose gradients are independent at init (different targets)
    batch = src.N / src.T if src.N > 0 else 1.0
    src.put(plan.positions, "backward", batch * src.ms(plan.input, "backward"),
            "position embedding: B E[g_in^2] (summed over the batch's B sequences)",
            valid=src.mode == "global", why="" if src.mode == "global" else
            "local mode does not know how many sequences the measured gradient summed")


class _BackWalk:
    """The backward rules walk the plan's steps in reverse. Each step hands the tensors it read a
    contribution to their gradient: (value, label, rule). A value is a number, or a tensor name
    whose gradient (measured in local mode, predicted in global) it is, read when the contributions
    are summed. A tensor's gradient is put once every step that reads it has contributed, i.e. when
    the walk reaches the step that wrote it: alone, a contribution keeps its own rule; several
    (a residual point: the add passes the gradient through, the branch or its norm adds its input
    gradient) make "residual backward: a + b" of their labels."""

    def __init__(self, src: _Source):
        self.src = src
        self.parts: dict[str, list[tuple[float | str, str, str]]] = {}
        self.sums: dict[str, float] = {}  # gradients of residual sums no module outputs

    def give(self, name: str, value: float | str, label: str, rule: str = "") -> None:
        self.parts.setdefault(name, []).append((value, label, rule))

    def grad(self, name: str) -> float:
        return self.sums[name] if tinylm.plan.is_sum(name) else self.src.ms(name, "backward")

    def finish(self, block: tinylm.plan.BlockPlan | None, names: tuple[str, ...]) -> None:
        src = self.src
        got = [n for n in names if n in self.parts]
        assert len(got) <= 1, f"{names}: one tensor, read under one name"
        for name in got:
            parts = self.parts.pop(name)
            values = [src.ms(v, "backward") if isinstance(v, str) else v for v, _, _ in parts]
            total = values[0] if len(values) == 1 else sum(values[1:], values[0])
            if tinylm.plan.is_sum(name):
                self.sums[name] = total
            else:
                rule = parts[0][2] if len(parts) == 1 else "residual backward: " + " + ".join(p[1] for p in parts)
                src.put(name, "backward", total, rule)
        primary = names[-1]  # a step that writes two names: its module's output is the residual point's alias
        for alias in names[:-1]:
            if block is not None and primary == block.output:
                rule = "block output"
            else:
                rule = f"{alias.rsplit('.', 1)[-1]} output = {primary.rsplit('.', 1)[-1]}"
            src.put(alias, "backward", src.ms(primary, "backward"), rule)


def _norm_step_back(walk: _BackWalk, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    src, x = walk.src, step.reads[0]
    g = _norm_back(src, step.module, src.ms(step.writes[-1], "backward"), src.fwd_ms(x), 
                   None if tinylm.plan.is_sum(x) else x, x_var=src.fwd_var(x))
    walk.give(x, g, f"{_norm_word(src)} backward")


def _branch_step_back(walk: _BackWalk, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    """A branch's backward starts from the gradient at its output (local mode: as measured there, which
    inverted dropout scales against the stream's) and hands its input the gradient it passes back."""
    src = walk.src
    back, what = (_attention_back, "attention") if step.kind == "attention" else (_ffn_back, "ffn")
    g_in = back(src, step.module, src.ms(step.output, "backward"))
    walk.give(step.reads[0], g_in, f"{what} input gradient", "linear backward into the norm output")


def _add_step_back(walk: _BackWalk, block: tinylm.plan.BlockPlan, step: tinylm.plan.Step) -> None:
    """An add passes its output's gradient to both terms. Where the output is a sum no module
    outputs (post-norm), the branch gets the gradient through the norm that reads the sum, and
    the stream the branch's gradient (equal to the sum's; measured in local mode)."""
    stream, branch = step.reads
    what = "attention" if step.branch == "attn" else "ffn"
    out = step.output
    if tinylm.plan.is_sum(out):
        norm = next(s.module for s in block.steps if s.kind == "norm" and s.reads == (out,))
        walk.give(stream, branch, "g_sum")
        walk.give(branch, walk.grad(out), "g_sum", f"post-norm: {_norm_word(walk.src)} backward of {norm.rsplit('.', 1)[-1]}")
    else:
        walk.give(stream, out, "g_out" if out == block.output else "g_mid")
        walk.give(branch, out, "", f"{what} branch gradient = stream gradient")


_BACKWARD = {"norm": _norm_step_back, "attention": _branch_step_back, "ffn": _branch_step_back, "add": _add_step_back}


def independent_predictions(model: nn.Module, mode: str, stats: ProbeStats | None, *, seq_len: int,
                            tokens: float, scheme: str | None, softmax: tuple[float, float] | None
                            ) -> dict[tuple[str, str], Prediction]:
    """Every prediction the independent-token rules make for a tinylm model, validity marked
    (arguments as :func:`diagnostics.theory.predict`, already checked there)."""
    src = _Source(model, mode, stats, int(seq_len), float(tokens or 0.0), scheme, softmax)
    with torch.no_grad():
        try:
            _forward(src)
        except KeyError:
            pass  # local mode on a partial probe: predict what the measured inputs allow
        try:
            _backward(src)
        except KeyError:
            pass
    return _mark_validity(src.out, src.plan, mode)


_ATTN_INTERNAL = ("attn.probs", "attn.scores", "attn.q_proj", "attn.k_proj", "attn.v_proj")


def _mark_validity(out: dict[tuple[str, str], Prediction], plan: tinylm.plan.ModelPlan, mode: str
                   ) -> dict[tuple[str, str], Prediction]:
    """Flag the backward predictions whose independence assumptions fail (see the module doc).

    * Inside attention (probs, scores, q, k, v gradients) the rules need independent
      tokens forward (block 0) and independent gradients backward (the last block, below
      which every attention layer sums gradients over positions): valid only when L = 1.
    * Global backward below the final norm divides by the stream variance the
      independent-token theory underestimates beyond block 0: valid only when L = 1.
    * No norm: the FFN reads the raw stream, whose scale varies over tokens, so the activation
      rules (local), the FFN products and block outputs (global) and
      every global forward prediction beyond block 0 are outside validity.
    * Any prediction whose variance (mean square - mean^2) is not positive: there is
      nothing to compare the measured variance with.
    """
    num_layers, norm = len(plan.blocks), plan.config.norm
    block_outputs = {b.output for b in plan.blocks}
    marked = {}
    for (name, direction), p in out.items():
        p = no_variance_left(p)
        blk = tinylm.plan.block_index(name)
        if norm == "none" and p.valid:
            unnormalised = "without a norm the FFN reads the raw stream, whose scale varies from token to token"
            if name.endswith(("ffn.hidden", "ffn.w1", "ffn.w3")) and (direction == "backward" or name.endswith("hidden")) \
                    and mode == "local":
                p = Prediction(p.mean_square, p.mean, False, unnormalised + ": the activation's Gaussian moments do not apply",
                               p.rule)
            elif mode == "global" and direction == "forward" and (
                    (num_layers > 1 and ((blk is not None and blk != 0) or name == plan.head))
                    or name.endswith(("ffn.hidden", "ffn.w2", "ffn")) or name in block_outputs):
                p = Prediction(p.mean_square, p.mean, False, unnormalised + " and tokens correlate beyond block 0",
                               p.rule)
        if direction == "backward" and p.valid:
            if num_layers > 1 and name.endswith(_ATTN_INTERNAL):
                p = Prediction(p.mean_square, p.mean, False,
                               "gradients inside attention assume independent tokens forward and backward "
                               "(true only for a single block)", p.rule)
            elif mode == "global" and num_layers > 1 and name not in (plan.head, plan.final_norm):
                p = Prediction(p.mean_square, p.mean, False,
                               "the gradient passes the stream's norms, whose input variance the independent-token "
                               "theory underestimates beyond block 0", p.rule)
        marked[(name, direction)] = p
    return marked
