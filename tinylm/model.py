"""The Transformer block and the decoder-only language model."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import functional as F
from .config import ModelConfig
from .errors import ConfigError
from .memory import check_model_fits
from .layers import Embedding, Linear, MultiHeadSelfAttention, RMSNorm, RotaryPositionalEmbedding, SiLUFFN, SwiGLU, Tap

__all__ = ["TransformerBlock", "TransformerLM"]


class TransformerBlock(nn.Module):
    """One Transformer block; the norm placement is an ablation switch.

    pre  (default): h = x + attn(ln1(x));       z = h + ffn(ln2(h))
    post          : h = ln1(x + attn(x));       z = ln2(h + ffn(h))
    none          : h = x + attn(x);            z = h + ffn(h)

    Branch outputs pass through inverted dropout (p = ``dropout``) before they
    are added. Shape: (..., T, d_model) -> (..., T, d_model). The Tap
    ``resid_mid`` marks h, the residual stream between the two sublayers.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        max_seq_len: int,
        theta: float | None,
        eps: float = 1e-5,
        norm: str = "pre",
        ffn: str = "swiglu",
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if norm not in ("pre", "post", "none"):
            raise ValueError(f"norm={norm!r}: must be 'pre', 'post' or 'none'")
        if ffn not in ("swiglu", "silu"):
            raise ValueError(f"ffn={ffn!r}: must be 'swiglu' or 'silu'")
        self.norm, self.dropout = norm, dropout
        kw = dict(device=device, dtype=dtype)
        if norm != "none":
            self.ln1 = RMSNorm(d_model, eps, **kw)
        self.attn = MultiHeadSelfAttention(d_model, num_heads, max_seq_len, theta, dropout=dropout, **kw)
        if norm != "none":
            self.ln2 = RMSNorm(d_model, eps, **kw)
        self.ffn = (SwiGLU if ffn == "swiglu" else SiLUFFN)(d_model, d_ff, **kw)
        self.resid_mid = Tap()

    def _branch(self, f: nn.Module, x: Tensor, *args) -> Tensor:
        return F.dropout(f(x, *args), self.dropout, self.training)

    def forward(self, x: Tensor, token_positions: Tensor | None = None) -> Tensor:
        if self.norm == "pre":
            h = self.resid_mid(x + self._branch(self.attn, self.ln1(x), token_positions))
            return h + self._branch(self.ffn, self.ln2(h))
        if self.norm == "post":
            h = self.resid_mid(self.ln1(x + self._branch(self.attn, x, token_positions)))
            return self.ln2(h + self._branch(self.ffn, h))
        h = self.resid_mid(x + self._branch(self.attn, x, token_positions))
        return h + self._branch(self.ffn, h)

    def extra_repr(self) -> str:
        return f"norm={self.norm!r}, dropout={self.dropout}"


class TransformerLM(nn.Module):
    """Decoder-only language model: token_embeddings -> layers -> ln_final -> lm_head.

    ``ln_final`` exists for pre-norm only (a post-norm block already ends in a
    norm; a no-norm model has none). With ``tie_embeddings`` the lm_head's weight
    is the token embedding matrix itself, so logits = h E^T.

    Shape: token_ids (..., T) integers, T <= context_length -> logits (..., T, vocab_size).
    A fresh model is initialised by the scheme ``config.init`` (see ``tinylm.init``),
    drawing from ``generator`` when one is given. ``device="meta"`` builds the
    structure only (no memory, no init), as loading a checkpoint does.
    """

    def __init__(self, config: ModelConfig, generator: torch.Generator | None = None, device=None, dtype=None):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"config must be a tinylm.ModelConfig, got {type(config).__name__}")
        check_model_fits(config, dtype, device)  # sizes from a file or a flag: refuse before building
        self.config = config
        # Build on the meta device (no memory, no init), then allocate and initialise once below.
        c, kw = config, dict(device="meta", dtype=dtype)
        self.token_embeddings = Embedding(c.vocab_size, c.d_model, **kw)
        theta = c.rope_theta if c.rope else None
        self.layers = nn.ModuleList(
            TransformerBlock(c.d_model, c.num_heads, c.d_ff, c.context_length, theta, c.eps, c.norm, c.ffn, c.dropout, **kw)
            for _ in range(c.num_layers)
        )
        self.ln_final = RMSNorm(c.d_model, c.eps, **kw) if c.norm == "pre" else None
        self.lm_head = Linear(c.d_model, c.vocab_size, **kw)
        if c.tie_embeddings:
            self.lm_head.weight = self.token_embeddings.weight
        device = torch.device("cpu" if device is None else device)
        if device.type != "meta":
            self.materialize(device)
            from . import init  # the registry imports the layer types; import here to keep the graph acyclic

            init.apply(self, c.init, generator=generator)

    def materialize(self, device: torch.device | str = "cpu") -> "TransformerLM":
        """Allocate a meta-built model's storage on ``device`` (values uninitialised).

        Recomputes the RoPE tables (buffers, not learned) and re-ties lm_head to the
        embeddings, which ``to_empty`` would otherwise split into two parameters.
        """
        self.to_empty(device=device)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.token_embeddings.weight
        for mod in self.modules():
            if isinstance(mod, RotaryPositionalEmbedding):
                mod.reset_parameters()
        return self

    def forward(self, token_ids: Tensor, token_positions: Tensor | None = None) -> Tensor:
        T = token_ids.shape[-1]
        if T > self.config.context_length:
            raise ValueError(
                f"sequence length {T} > context_length={self.config.context_length}: "
                "pass at most context_length tokens (or build the model with a longer context)"
            )
        x = self.token_embeddings(token_ids)  # (..., T, d)
        for block in self.layers:
            x = block(x, token_positions)
        if self.ln_final is not None:
            x = self.ln_final(x)
        return self.lm_head(x)  # (..., T, V)

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        c = self.config
        return f"V={c.vocab_size}, T={c.context_length}, d={c.d_model}, L={c.num_layers}, H={c.num_heads}, d_ff={c.d_ff}"
