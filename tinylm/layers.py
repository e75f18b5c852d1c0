"""The modules of the model: each holds parameters (or buffers) and calls ``tinylm.functional``.

Names, constructor arguments and state-dict keys follow the Stanford CS336
assignment-1 reference, so a student's checkpoint loads as it is.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable

import torch
from einops import rearrange, repeat
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from . import functional as F

__all__ = [
    "Tap",
    "Linear",
    "Embedding",
    "RMSNorm",
    "LayerNorm",
    "SwiGLU",
    "MLP",
    "SiLUFFN",
    "ACTIVATIONS",
    "RotaryPositionalEmbedding",
    "MultiHeadSelfAttention",
]


class Tap(nn.Identity):
    """An identity that names a point of the forward pass (e.g. attention scores).

    It holds nothing and changes nothing; it exists so that instrumentation can
    hook a tensor that no parameterised module outputs, by the Tap's module name.
    ``observed`` says whether anything hooks it.
    """

    @property
    def observed(self) -> bool:
        """Whether a hook would see this point: a forward, forward-pre or backward hook of
        its own, or one registered for every module (``nn.modules.module.register_module_*``)."""
        own = self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks
        return bool(own) or _global_hooks()


def _global_hooks() -> bool:
    """Whether any hook is registered for every module (torch keeps those in module-level dicts)."""
    m = nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks
                or m._global_backward_hooks or m._global_backward_pre_hooks)


class Linear(nn.Module):
    """y = x W^T (+ b): a contraction of the last dimension, any leading dimensions.

    Args:
        in_features: d_in.  out_features: d_out.  bias: add a learned bias (off by default).
    Shape: x (..., d_in) -> y (..., d_out).  Parameters: ``weight`` (d_out, d_in), ``bias`` (d_out).
    Init (``reset_parameters``): the cs336 rule, N(0, 2/(d_in + d_out)) truncated at +-3 sigma; bias 0.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = math.sqrt(2.0 / (self.in_features + self.out_features))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        # The contraction einsum("... d_in, d_out d_in -> ... d_out") as a matmul: torch folds the
        # leading dims into one GEMM and writes the weight gradient in place, without the
        # permuted copies that einsum's backward makes.
        y = x @ self.weight.T
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(nn.Module):
    """Lookup table: out = weight[token_ids].

    Shape: token_ids (...) integers in [0, num_embeddings) -> (..., embedding_dim).
    Init: N(0, 1) truncated at [-3, 3].
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: Tensor) -> Tensor:
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class RMSNorm(nn.Module):
    """RMSNorm(a) = a / sqrt(mean(a^2) + eps) * g over the last dimension.

    Computes in float32 and returns the input dtype. Parameter ``weight`` (d_model,), init 1.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(d_model, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm(a) = (a - mean(a)) / sqrt(var(a) + eps) * g + b over the last dimension.

    var is the population variance. Computes in float32 and returns the input dtype.
    Parameters: ``weight`` (d_model,), init 1; ``bias`` (d_model,), init 0, only if ``bias``.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(d_model, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(d_model, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, bias={self.bias is not None}"


class SwiGLU(nn.Module):
    """out = w2(silu(w1 x) * w3 x): a gated feed-forward network.

    Shape: (..., d_model) -> hidden (..., d_ff) -> (..., d_model).
    Parameters: ``w1`` (d_ff, d), ``w3`` (d_ff, d), ``w2`` (d, d_ff); 3 d d_ff in all
    (with ``bias``, each linear also has its bias). The ``hidden`` Tap marks the gated
    product that w2 reads.
    """

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None, *, bias: bool = False):
        super().__init__()
        self.d_model, self.d_ff = d_model, d_ff
        self.w1 = Linear(d_model, d_ff, bias, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, bias, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, bias, device=device, dtype=dtype)
        self.hidden = Tap()

    def reset_parameters(self) -> None:
        for lin in (self.w1, self.w2, self.w3):
            lin.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.hidden(F.silu(self.w1(x)) * self.w3(x)))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}"


#: the activations of the non-gated MLP, by ``ModelConfig.ffn`` name
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    """out = w2(act(w1 x)): the non-gated feed-forward network.

    act is one of ``ACTIVATIONS``: "silu", "gelu" (exact), "gelu_tanh" (GPT-2's) or "relu".
    Shape: (..., d_model) -> hidden (..., d_ff) -> (..., d_model).
    Parameters: ``w1`` (d_ff, d), ``w2`` (d, d_ff), and their biases with ``bias``.
    The ``hidden`` Tap marks act(w1 x), the tensor w2 reads.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = False, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: must be one of {', '.join(ACTIVATIONS)}")
        self.d_model, self.d_ff, self.activation = d_model, d_ff, activation
        self.w1 = Linear(d_model, d_ff, bias, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, bias, device=device, dtype=dtype)
        self.hidden = Tap()

    def reset_parameters(self) -> None:
        self.w1.reset_parameters()
        self.w2.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.hidden(ACTIVATIONS[self.activation](self.w1(x))))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation!r}"


class SiLUFFN(MLP):
    """out = w2(silu(w1 x)): the ungated ablation of SwiGLU (an :class:`MLP` with activation "silu").

    Parameters: ``w1`` (d_ff, d), ``w2`` (d, d_ff).
    """

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None, *, bias: bool = False):
        super().__init__(d_model, d_ff, "silu", bias, device=device, dtype=dtype)


class RotaryPositionalEmbedding(nn.Module):
    """Rotary position embedding: rotates adjacent pairs (x_{2k}, x_{2k+1}) of each
    position-i vector by the angle i * theta^(-2k/d_k).

    A rotation preserves norms, and q_i . k_j after rotation depends on i - j only.
    cos/sin tables (max_seq_len, d_k/2) live in non-persistent buffers of this
    module (no module-level cache), so they never enter the state dict.

    forward(x, token_positions): x (..., T, d_k), token_positions (..., T) integer
    positions (leading dims broadcast against x's).
    """

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None):
        super().__init__()
        if d_k % 2:
            raise ValueError(f"d_k={d_k}: RoPE rotates pairs of dimensions, so d_k must be even")
        self.theta, self.d_k, self.max_seq_len = theta, d_k, max_seq_len
        # float64 tables (a few KiB), cast to the input's dtype at use: exact to float64 precision.
        table = dict(device=device, dtype=torch.float64)
        self.register_buffer("cos", torch.empty(max_seq_len, d_k // 2, **table), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, d_k // 2, **table), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        angles = F.rope_angles(self.theta, self.d_k, torch.arange(self.max_seq_len))  # (T_max, d_k/2), float64
        self.cos.copy_(torch.cos(angles))
        self.sin.copy_(torch.sin(angles))

    def forward(self, x: Tensor, token_positions: Tensor) -> Tensor:
        self.check(token_positions)
        return self.rotate(x, token_positions)

    def check(self, token_positions: Tensor) -> None:
        """Refuse a position past the table (reads the largest position: one device sync)."""
        if token_positions.numel() and int(token_positions.max()) >= self.max_seq_len:
            self.refuse(int(token_positions.max()))

    def refuse(self, position: int) -> None:
        raise ValueError(f"token position {position} >= max_seq_len={self.max_seq_len}: "
                         "the sequence is longer than the RoPE table")

    def rotate(self, x: Tensor, token_positions: Tensor | None) -> Tensor:
        """The rotation of ``forward`` for positions already known to be inside the table
        (None: 0 .. T-1, T = x.shape[-2])."""
        return F.apply_rope(x, *self.tables(token_positions, x.shape[-2], x.dtype))

    def tables(self, token_positions: Tensor | None, T: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin (..., T, d_k/2) in ``dtype`` at ``token_positions`` (inside the table), or
        at 0 .. T-1 when None (the table's first T rows, read without an index)."""
        if token_positions is None:
            cos, sin = self.cos[:T], self.sin[:T]  # (T, d_k/2)
        else:
            cos, sin = self.cos[token_positions], self.sin[token_positions]  # (..., T, d_k/2)
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"


class MultiHeadSelfAttention(nn.Module):
    """Causal multi-head self-attention.

    out = output_proj(concat_h softmax(Q_h K_h^T / sqrt(d_k) + causal) V_h), with
    Q = q_proj(x) etc. split into heads along the feature dimension (heads are
    stacked along the rows of each projection's weight). RoPE rotates Q and K when
    ``theta`` is given. ``bias``: the four projections add a learned bias.

    Grouped-query attention: ``num_kv_heads`` (H_kv, dividing H; default H) key/value heads,
    so k_proj and v_proj have H_kv d_k output features; K/V head g serves the G = H / H_kv
    consecutive query heads g G .. g G + G - 1 (each K/V head repeated G times, in place:
    ``repeat(k, "... g t d -> ... (g r) t d", r=G)``, as Llama's ``repeat_kv``). With H_kv = H
    this is multi-head attention. ``sliding_window`` (W): query i attends to key j iff
    0 <= i - j < W (None: every j <= i).

    QK-norm (``qk_norm`` "rms" or "layer"; default "none"): each head's query and key vectors
    pass through ``q_norm`` / ``k_norm`` over d_k after the projections and before RoPE,
    q_hat = RMSNorm(q) (or LayerNorm(q)) with a gain of size d_k shared by the heads (LayerNorm:
    and a bias), epsilon ``eps``. So with RMSNorm and gains g_q, g_k every score satisfies
    |s| <= sqrt(d_k) max|g_q| max|g_k| (Cauchy-Schwarz; RoPE preserves norms), whatever the
    scale of W_q and W_k (Dehghani et al. 2023; Wortsman et al. 2023).

    Shape: x (..., T, d_model) -> (..., T, d_model). Taps: ``scores`` (pre-softmax,
    masked entries -inf) and ``probs`` (attention weights), each (..., H, T, T).

    The forward below computes the scores and weights explicitly, as the formula
    reads. When nothing needs them (``weights_needed()`` is False: no hook on either
    Tap, ``explicit`` off, no attention dropout drawing in training) the same heads
    come from torch's fused kernel instead
    (``torch.nn.functional.scaled_dot_product_attention``, causal), which never stores
    the (..., H, T, T) matrices; the two agree to rounding (tests/test_fastpath.py).
    ``explicit`` (False) asks for the explicit path with no hook.

    ``register_observer(fn)`` adds a hook point that does not change the path:
    ``fn(q, k, v, heads, weights)`` is called after each forward with the heads' inputs
    (q, k after qk-norm and RoPE; each (..., H, T, d_k)) and output (..., H, T, d_k), and ``weights``
    = (scores, probs) when the explicit path formed them, else None. Instrumentation
    (the diagnostics probe) uses it to measure the attention without the T x T matrices.
    """

    query_multiplier: float = 1.0  # each query times this after RoPE (muP: sqrt(d_base / d_k); 1: the formula above)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        max_seq_len: int | None = None,
        theta: float | None = None,
        dropout: float = 0.0,
        device=None,
        dtype=None,
        *,
        bias: bool = False,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        qk_norm: str = "none",
        eps: float = 1e-5,
    ):
        super().__init__()
        if qk_norm not in ("none", "rms", "layer"):
            raise ValueError(f"qk_norm={qk_norm!r}: must be one of none, rms, layer")
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model}, num_heads={num_heads}: d_model must be divisible by num_heads")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads}, num_heads={num_heads}: num_kv_heads must divide num_heads")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window}: must be a positive integer; pass None for no window")
        self.d_model, self.num_heads, self.d_k = d_model, num_heads, d_model // num_heads
        self.num_kv_heads, self.sliding_window = num_kv_heads, sliding_window
        self.dropout = dropout
        d_kv = num_kv_heads * self.d_k
        self.q_proj = Linear(d_model, d_model, bias, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_kv, bias, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_kv, bias, device=device, dtype=dtype)
        self.qk_norm = qk_norm
        if qk_norm == "rms":
            self.q_norm = RMSNorm(self.d_k, eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(self.d_k, eps, device=device, dtype=dtype)
        elif qk_norm == "layer":
            self.q_norm = LayerNorm(self.d_k, eps, True, device=device, dtype=dtype)
            self.k_norm = LayerNorm(self.d_k, eps, True, device=device, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.output_proj = Linear(d_model, d_model, bias, device=device, dtype=dtype)
        if theta is not None:
            if max_seq_len is None:
                raise ValueError("theta given without max_seq_len: RoPE needs max_seq_len for its tables")
            self.rope = RotaryPositionalEmbedding(theta, self.d_k, max_seq_len, device=device)
        else:
            self.rope = None
        self.scores = Tap()
        self.probs = Tap()
        self.explicit = False
        self._observers: OrderedDict[int, Callable] = OrderedDict()

    def register_observer(self, fn: Callable) -> RemovableHandle:
        """Call ``fn(q, k, v, heads, weights)`` after each forward (see the class docstring);
        returns a handle whose ``remove()`` takes it off. Observers do not choose the path."""
        observers = self.__dict__.setdefault("_observers", OrderedDict())  # a module pickled before observers existed
        handle = RemovableHandle(observers)
        observers[handle.id] = fn
        return handle

    def reset_parameters(self) -> None:
        for mod in (self.q_proj, self.k_proj, self.v_proj, self.q_norm, self.k_norm, self.output_proj):
            if mod is not None:
                mod.reset_parameters()

    def forward(self, x: Tensor, token_positions: Tensor | None = None) -> Tensor:
        T = x.shape[-2]
        split = "... t (h d) -> ... h t d"
        q = rearrange(self.q_proj(x), split, h=self.num_heads)  # (..., H, T, d_k)
        k = rearrange(self.k_proj(x), split, h=self.num_kv_heads)  # (..., H_kv, T, d_k)
        v = rearrange(self.v_proj(x), split, h=self.num_kv_heads)
        q_norm = getattr(self, "q_norm", None)  # None: no qk-norm (or a module pickled before it existed)
        if q_norm is not None:  # per head over d_k, before RoPE
            q, k = q_norm(q), self.k_norm(k)
        if self.rope is not None:
            if token_positions is None:  # 0 .. T-1: checked from the shape, no device sync
                if T > self.rope.max_seq_len:
                    self.rope.refuse(T - 1)
                pos = None
            else:
                self.rope.check(token_positions)  # once for q and k
                pos = token_positions.unsqueeze(-2) if token_positions.dim() > 1 else token_positions  # (..., 1, T)
            cos, sin = self.rope.tables(pos, T, q.dtype)  # (..., T, d_k/2), read once for q and k
            q, k = F.apply_rope(q, cos, sin), F.apply_rope(k, cos, sin)
        if self.query_multiplier != 1.0:  # muP: logits q.k sqrt(d_base) / d_k (ModelConfig.attention_multiplier)
            q = q * self.query_multiplier
        k, v = self.repeat_kv(k), self.repeat_kv(v)  # (..., H, T, d_k): K/V head g for query heads g G .. g G + G - 1
        if self.weights_needed():
            scores = self.scores(F.attention_scores(q, k, self.mask(T, x.device)))  # (..., H, T, T)
            probs = self.probs(F.softmax(scores, dim=-1))
            weights = (scores, probs)
            probs = F.dropout(probs, self.dropout, self.training)
            heads = probs @ v  # (..., H, T, T) @ (..., H, T, d_k) -> (..., H, T, d_k)
        else:  # fast path: the same heads from torch's fused kernel, scores and weights never stored
            weights = None
            mask = None if self.sliding_window is None else self.mask(T, x.device)
            heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                     is_causal=mask is None)  # (..., H, T, d_k)
        for fn in tuple(self.__dict__.get("_observers", {}).values()):
            fn(q, k, v, heads, weights)
        return self.output_proj(rearrange(heads, "... h t d -> ... t (h d)"))

    def repeat_kv(self, kv: Tensor) -> Tensor:
        """(..., H_kv, T, d_k) -> (..., H, T, d_k): each K/V head repeated for its G = H / H_kv
        consecutive query heads (the identity when H_kv = H)."""
        groups = self.num_heads // self.num_kv_heads
        return kv if groups == 1 else repeat(kv, "... g t d -> ... (g r) t d", r=groups)

    def mask(self, T: int, device=None) -> Tensor:
        """(T, T) boolean, True where query i may attend to key j: j <= i, and i - j < W with a window W."""
        causal = F.causal_mask(T, device=device)
        if self.sliding_window is None:
            return causal
        idx = torch.arange(T, device=device)
        return causal & (idx[:, None] - idx[None, :] < self.sliding_window)

    def weights_needed(self) -> bool:
        """Whether this forward must compute the scores and weights explicitly: ``explicit`` is
        set, a hook observes the ``scores`` or ``probs`` Tap (or either was replaced by another
        module), or dropout draws on the weights (training with ``dropout`` > 0; the explicit
        path draws exactly as :func:`tinylm.functional.dropout` does, so a seeded run replays), or
        an observer is registered on a windowed attention (observers read the weights of a causal
        mask; with a window they are given the weights the explicit path formed)."""
        if self.explicit or any(type(t) is not Tap or t.observed for t in (self.scores, self.probs)):
            return True
        if self.sliding_window is not None and self.__dict__.get("_observers"):
            return True
        return self.training and self.dropout > 0.0

    def extra_repr(self) -> str:
        extra = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        extra += f", sliding_window={self.sliding_window}" if self.sliding_window is not None else ""
        extra += f", qk_norm={self.qk_norm!r}" if getattr(self, "q_norm", None) is not None else ""
        rope = self.rope is not None
        return f"d_model={self.d_model}, num_heads={self.num_heads}, d_k={self.d_k}, rope={rope}{extra}"
