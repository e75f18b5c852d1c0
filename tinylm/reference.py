"""An independent reference of tinylm's pre-norm architectures built from torch built-ins.

``BuiltinLM`` uses ``nn.Linear``, ``nn.Embedding``, ``F.rms_norm`` / ``nn.LayerNorm``,
``F.scaled_dot_product_attention(is_causal=True)`` and ``F.silu`` / ``F.gelu`` /
``F.relu`` and has the same state-dict keys as :class:`tinylm.TransformerLM`, so one
model's weights load into the other. It serves two purposes: a check that tinylm
computes the same function (tests), and the speed baseline of ``benchmarks/bench_model.py``.
Covered: pre-norm with RMSNorm or LayerNorm, SwiGLU or any non-gated MLP activation,
RoPE, learned (``nn.Embedding``) or no positions, biases, tied embeddings, qk-norm
(``F.rms_norm`` / ``F.layer_norm`` of each head's q and k before RoPE), no dropout.
RoPE here is written as multiplication by complex phases, a different route to
the same rotation of adjacent pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .errors import ConfigError

__all__ = ["BuiltinLM"]


class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        up = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(up), (x.shape[-1],), self.weight.to(up), self.eps).to(x.dtype)


class _LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in (at least) float32, the input dtype returned."""

    def forward(self, x):
        up = torch.promote_types(x.dtype, torch.float32)
        w, b = self.weight.to(up), self.bias.to(up) if self.bias is not None else None
        return F.layer_norm(x.to(up), self.normalized_shape, w, b, self.eps).to(x.dtype)


def _norm(c: ModelConfig) -> nn.Module:
    return _RMSNorm(c.d_model, c.eps) if c.norm_kind == "rms" else _LayerNorm(c.d_model, c.eps, bias=c.bias)


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        d = c.d_model
        self.h = c.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (nn.Linear(d, d, bias=c.bias) for _ in range(4))
        if c.qk_norm == "rms":
            self.q_norm, self.k_norm = _RMSNorm(c.head_dim, c.eps), _RMSNorm(c.head_dim, c.eps)
        elif c.qk_norm == "layer":
            self.q_norm, self.k_norm = _LayerNorm(c.head_dim, c.eps), _LayerNorm(c.head_dim, c.eps)
        else:
            self.q_norm = self.k_norm = None
        if c.rope:
            inv = c.rope_theta ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
            ang = torch.arange(c.context_length, dtype=torch.float64)[:, None] * inv  # (T, d_k/2)
            self.register_buffer("phase", torch.polar(torch.ones_like(ang), ang), persistent=False)
        else:
            self.phase = None

    def _rope(self, x):  # x (B, H, T, d_k)
        z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())  # pairs -> complex
        return torch.view_as_real(z * self.phase[: x.shape[-2]]).flatten(-2).to(x.dtype)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = (p(x).view(B, T, self.h, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.phase is not None:
            q, k = self._rope(q), self._rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, d_k)
        return self.output_proj(y.transpose(1, 2).reshape(B, T, d))


class _FFN(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(c.d_model, c.d_ff, bias=c.bias)
        self.w2 = nn.Linear(c.d_ff, c.d_model, bias=c.bias)
        self.w3 = nn.Linear(c.d_model, c.d_ff, bias=c.bias) if c.ffn == "swiglu" else None
        self.act = F.silu if c.ffn == "swiglu" else _ACTIVATIONS[c.ffn]

    def forward(self, x):
        h = self.act(self.w1(x))
        return self.w2(h * self.w3(x) if self.w3 is not None else h)


class _Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.ln1, self.ln2 = _norm(c), _norm(c)
        self.attn, self.ffn = _Attention(c), _FFN(c)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class BuiltinLM(nn.Module):
    """tinylm's pre-norm architectures from torch built-ins; same state-dict keys as TransformerLM."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.norm != "pre" or config.dropout:
            raise ConfigError(f"BuiltinLM covers pre-norm without dropout; got norm={config.norm!r}, dropout={config.dropout}")
        if config.kv_heads != config.num_heads or config.sliding_window is not None:
            raise ConfigError(f"BuiltinLM covers full causal multi-head attention; got num_kv_heads={config.num_kv_heads}, "
                              f"sliding_window={config.sliding_window}")
        self.config = config
        self.token_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        if config.positions == "learned":
            self.position_embeddings = nn.Embedding(config.context_length, config.d_model)
        else:
            self.position_embeddings = None
        self.layers = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.ln_final = _norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embeddings.weight

    def forward(self, token_ids):
        x = self.token_embeddings(token_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(token_ids.shape[-1], device=token_ids.device))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_final(x))
