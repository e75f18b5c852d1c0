"""Parameter-free operations of the model, as plain functions.

Each function states the formula it computes. Modules in ``tinylm.layers`` hold
parameters and call these; nothing here holds state.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "softmax",
    "log_softmax",
    "logsumexp",
    "cross_entropy",
    "z_loss",
    "silu",
    "gelu",
    "relu",
    "rms_norm",
    "layer_norm",
    "dropout",
    "causal_mask",
    "attention_scores",
    "scaled_dot_product_attention",
    "rope_angles",
    "apply_rope",
]


def _exp_shifted_(y: Tensor) -> Tensor:
    """exp(y) in place for a fresh, max-shifted y <= 0, with entries below ``floor`` set to exactly 0.

    floor = log(smallest normal) + 2 (-85.3 in float32, -706.4 in float64). The
    entries below it (masked -inf scores, logits far below the max) are worth less
    than 8 * finfo.tiny (1e-37 in float32), far below the ulp of the sum they join
    (>= 1). It matters for speed: CPU ``exp`` takes a slow path at and below
    log(smallest normal) and on -inf. In place, so only
    for tensors that autograd does not track (inside the Functions below).
    """
    floor = math.log(torch.finfo(torch.promote_types(y.dtype, torch.float32)).tiny) + 2.0
    small = y < floor
    return y.clamp_(min=floor).exp_().masked_fill_(small, 0.0)


class _LogSumExp(torch.autograd.Function):
    """logsumexp with its gradient written out: d lse / d x = softmax(x) = exp(x - lse)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        m = x.amax(dim=dim, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows: shift by 0
        out = m + torch.log(_exp_shifted_(x - m).sum(dim=dim, keepdim=True))
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        x, out = ctx.saved_tensors
        return g * _exp_shifted_(x - out), None


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the reductions below compute in: at least float32 (bf16/fp16 inputs are upcast)."""
    return torch.promote_types(x.dtype, torch.float32)


def logsumexp(x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    """log sum_i exp(x_i) computed as m + log sum_i exp(x_i - m), m = max_i x_i.

    Rows that are entirely -inf give -inf (not NaN). The gradient is softmax(x).
    bf16/fp16 inputs are computed in float32 and the result rounded once to the input dtype.
    """
    out = _LogSumExp.apply(x.to(_compute_dtype(x)), dim).to(x.dtype)
    return out if keepdim else out.squeeze(dim)


class _Softmax(torch.autograd.Function):
    """softmax with its vector-Jacobian product written out.

    Forward: p = exp(x - m) / sum exp(x - m). Backward: for upstream g,
    dx = p * (g - sum_j g_j p_j), since d p_i / d x_j = p_i (delta_ij - p_j).
    Only p is kept for the backward pass.
    """

    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        y = x - x.amax(dim=dim, keepdim=True)
        z = _exp_shifted_(y)
        p = z.div_(z.sum(dim=dim, keepdim=True))
        ctx.save_for_backward(p)
        ctx.dim = dim
        return p

    @staticmethod
    def backward(ctx, g: Tensor):
        (p,) = ctx.saved_tensors
        return p * (g - (g * p).sum(dim=ctx.dim, keepdim=True)), None


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m), with m = max_j x_j.

    Subtracting the max changes nothing mathematically (softmax is invariant to a
    shift) and keeps every exponent <= 0, so nothing overflows. The gradient is
    p * (g - <g, p>) (see ``_Softmax``). bf16/fp16 inputs are computed in float32 and
    the result rounded once to the input dtype.
    """
    return _Softmax.apply(x.to(_compute_dtype(x)), dim).to(x.dtype)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """log_softmax(x)_i = x_i - logsumexp(x); finite where log(softmax(x)) underflows to -inf.

    bf16/fp16 inputs are computed in float32 and the result rounded once to the input dtype.
    """
    xc = x.to(_compute_dtype(x))
    return (xc - logsumexp(xc, dim=dim, keepdim=True)).to(x.dtype)


class _CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy with its gradient written out.

    Forward, over N positions with logits z (..., C) and smoothing eps:
    loss = mean[(1 - eps)(lse - z_target) + eps (lse - mean_c z_c)], lse = logsumexp(z).
    Backward: d loss / d z = (p - q) / N, with p = softmax(z) = exp(z - lse) and
    q = (1 - eps) onehot(target) + eps / C. Only the logits and lse are kept.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, label_smoothing: float) -> Tensor:
        targets = targets.long()
        lse = logsumexp(logits, dim=-1)  # (...)
        z_target = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        nll = lse - z_target  # -log p_target
        if label_smoothing == 0.0:
            loss = nll.mean()
        else:
            uniform = lse - logits.mean(dim=-1)  # -(1/C) sum_c log p_c
            loss = ((1.0 - label_smoothing) * nll + label_smoothing * uniform).mean()
        ctx.save_for_backward(logits, lse, targets)
        ctx.label_smoothing = label_smoothing
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        logits, lse, targets = ctx.saved_tensors
        eps, C, N = ctx.label_smoothing, logits.shape[-1], targets.numel()
        grad = _exp_shifted_(logits - lse.unsqueeze(-1))  # p = softmax(z)
        if eps:
            grad.sub_(eps / C)
        minus_y = torch.full(targets.unsqueeze(-1).shape, -(1.0 - eps), dtype=grad.dtype, device=grad.device)
        grad.scatter_add_(-1, targets.unsqueeze(-1), minus_y)  # p - q
        return grad.mul_(g / N), None, None


def cross_entropy(logits: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean over all leading positions of -sum_c q_c log p_c, with p = softmax(logits).

    Shape: logits (..., C), targets (...) integer class ids; returns a scalar.
    Without smoothing q = onehot(target), so the loss is logsumexp(z) - z_target.
    With smoothing eps, q = (1 - eps) onehot + eps / C (the uniform part covers all
    C classes, the target included, as in ``torch.nn.functional.cross_entropy``).
    The gradient with respect to the logits is (p - q) / N for N positions
    (written out in ``_CrossEntropy``). bf16/fp16 logits are computed in float32; the
    loss is returned in the logits' dtype.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 1]")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} and targets shape {tuple(targets.shape)}: "
            "targets must have the logits' shape without the last (class) dimension"
        )
    return _CrossEntropy.apply(logits.to(_compute_dtype(logits)), targets, float(label_smoothing)).to(logits.dtype)


def z_loss(logits: Tensor) -> Tensor:
    """The auxiliary z-loss: mean over all leading positions of (log Z_t)^2, log Z_t = logsumexp(z_t).

    Shape: logits (..., C); returns a scalar. log Z is computed in at least float32 (bf16/fp16
    logits are upcast) and the mean returned in that dtype. The loss is >= 0 and is 0 exactly when
    every row's log Z is 0 (its softmax needs no normaliser). Its gradient with respect to row t is
    2 log Z_t softmax(z_t) / N for N rows, so it pulls every log Z towards 0 without changing any
    softmax: shifting a row by c shifts its log Z by exactly c. Added to the cross-entropy with a
    small coefficient (1e-4 in PaLM, Chowdhery et al. 2022; Wortsman et al. 2023) it keeps the
    output logits from drifting to large magnitudes, where float32/bf16 softmax loses precision.
    """
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits shape {tuple(logits.shape)}: must have a last (class) dimension of size >= 1")
    lse = logsumexp(logits.to(_compute_dtype(logits)), dim=-1)  # (...)
    return lse.pow(2).mean()


def silu(x: Tensor) -> Tensor:
    """silu(x) = x * sigmoid(x)."""
    return x * torch.sigmoid(x)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """gelu(x) = x Phi(x), Phi the standard normal CDF: 0.5 x (1 + erf(x / sqrt(2))).

    ``approximate="tanh"``: GPT-2's approximation ("gelu_new"),
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); it differs from the exact GELU by
    less than 5e-4 everywhere.
    """
    if approximate == "none":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    raise ValueError(f"approximate={approximate!r}: must be 'none' or 'tanh'")


def relu(x: Tensor) -> Tensor:
    """relu(x) = max(x, 0); its derivative is 1 for x > 0 and 0 for x <= 0 (as torch's). NaN stays NaN."""
    return torch.where(x <= 0, torch.zeros_like(x), x)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x / sqrt(mean(x^2 over the last dim) + eps) * weight, computed in float32.

    The input is upcast to float32 (at least) so that squares of large bf16/fp16
    values cannot overflow; the result is cast back to the input dtype.
    """
    in_dtype = x.dtype
    xf = x.to(torch.promote_types(in_dtype, torch.float32))
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # 1 / rms: one op, not sqrt then divide
    out = xf * inv_rms
    if weight is not None:
        out = out * weight.to(out.dtype)
    return out.to(in_dtype)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """(x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last dim, computed in float32.

    var is the biased (population) variance mean((x - mean(x))^2). Like :func:`rms_norm`,
    the input is upcast to float32 (at least) and the result cast back to the input dtype.
    ``weight`` / ``bias`` None: no gain / no shift.
    """
    xf = x.to(_compute_dtype(x))
    centered = xf - xf.mean(dim=-1, keepdim=True)
    y = centered / torch.sqrt(centered.pow(2).mean(dim=-1, keepdim=True) + eps)  # mean 0, mean square ~1
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def dropout(x: Tensor, p: float, training: bool = True, generator: torch.Generator | None = None) -> Tensor:
    """Inverted dropout: y = x * m / (1 - p), m_i ~ Bernoulli(1 - p); identity when not training.

    E[y] = x and Var(y) = p / (1 - p) x^2.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p={p}: dropout probability must be in [0, 1)")
    if not training or p == 0.0:
        return x
    keep = torch.rand(x.shape, generator=generator, device=x.device) >= p
    return x * keep.to(x.dtype) / (1.0 - p)


def causal_mask(seq_len: int, device: torch.device | None = None) -> Tensor:
    """(T, T) boolean mask, True where query i may attend to key j, i.e. j <= i."""
    idx = torch.arange(seq_len, device=device)
    return idx[:, None] >= idx[None, :]


def attention_scores(Q: Tensor, K: Tensor, mask: Tensor | None = None) -> Tensor:
    """Scaled scores S = Q K^T / sqrt(d_k), with -inf where ``mask`` is False.

    Shape: Q (..., T_q, d_k), K (..., T_k, d_k), mask broadcastable to (..., T_q, T_k).
    """
    d_k = Q.shape[-1]
    scores = (Q / math.sqrt(d_k)) @ K.transpose(-2, -1)  # (..., T_q, T_k); scale the smaller tensor
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))  # in place: scores is a fresh tensor
    return scores


def scaled_dot_product_attention(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax(Q K^T / sqrt(d_k), masked) V.

    Shape: Q (..., T_q, d_k), K (..., T_k, d_k), V (..., T_k, d_v), any leading
    dimensions; mask (True = may attend) broadcastable to (..., T_q, T_k).
    Returns (..., T_q, d_v). Masked positions get exactly zero weight.
    """
    probs = softmax(attention_scores(Q, K, mask), dim=-1)
    return probs @ V  # (..., T_q, T_k) @ (..., T_k, d_v)


def rope_angles(theta: float, d_k: int, positions: Tensor) -> Tensor:
    """Angles position * theta^(-2k/d_k) for k = 0 .. d_k/2 - 1; shape (*positions.shape, d_k/2)."""
    if d_k % 2:
        raise ValueError(f"d_k={d_k}: RoPE rotates pairs of dimensions, so d_k must be even")
    inv_freq = theta ** (-torch.arange(0, d_k, 2, dtype=torch.float64) / d_k)  # (d_k/2,)
    return positions.to(torch.float64)[..., None] * inv_freq


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs (x_{2k}, x_{2k+1}) by the angle whose cos/sin are given.

    Shape: x (..., T, d_k); cos, sin broadcastable to (..., T, d_k/2).
    out_{2k} = x_{2k} cos - x_{2k+1} sin;  out_{2k+1} = x_{2k} sin + x_{2k+1} cos.
    Computed on the pairs as (x_{2k}, x_{2k+1}) cos + (x_{2k+1}, x_{2k}) (-sin, sin): the same
    products and sums as the formula, so the same roundings, in a few whole-tensor ops.
    """
    pairs = x.unflatten(-1, (-1, 2))  # (..., T, d_k/2, 2): (x_{2k}, x_{2k+1})
    swapped = pairs.flip(-1)  # (x_{2k+1}, x_{2k})
    signed_sin = torch.stack((-sin, sin), dim=-1)  # (..., T, d_k/2, 2)
    return (pairs * cos.unsqueeze(-1) + swapped * signed_sin).flatten(-2)  # (..., T, d_k)
