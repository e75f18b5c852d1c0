"""The Transformer block and the decoder-only language model."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import functional as F
from .config import ModelConfig
from .errors import ConfigError
from .memory import check_model_fits
from .layers import (ACTIVATIONS, MLP, Embedding, LayerNorm, Linear, MultiHeadSelfAttention, RMSNorm,
                     RotaryPositionalEmbedding, SwiGLU, Tap)

__all__ = ["TransformerBlock", "TransformerLM"]


def make_norm(norm_kind: str, d_model: int, eps: float, bias: bool, **kw) -> nn.Module:
    """The norm a config names: RMSNorm ("rms") or LayerNorm ("layer", with a bias iff ``bias``)."""
    if norm_kind == "rms":
        return RMSNorm(d_model, eps, **kw)
    if norm_kind == "layer":
        return LayerNorm(d_model, eps, bias, **kw)
    raise ValueError(f"norm_kind={norm_kind!r}: must be 'rms' or 'layer'")


def make_ffn(ffn: str, d_model: int, d_ff: int, bias: bool, **kw) -> nn.Module:
    """The FFN a config names: SwiGLU ("swiglu") or the non-gated MLP w2(act(w1 x)) of that activation."""
    if ffn == "swiglu":
        return SwiGLU(d_model, d_ff, bias=bias, **kw)
    if ffn in ACTIVATIONS:
        return MLP(d_model, d_ff, ffn, bias, **kw)
    raise ValueError(f"ffn={ffn!r}: must be 'swiglu' or one of {', '.join(ACTIVATIONS)}")


class TransformerBlock(nn.Module):
    """One Transformer block; the norm placement is an ablation switch.

    pre  (default): h = x + attn(ln1(x));       z = h + ffn(ln2(h))
    post          : h = ln1(x + attn(x));       z = ln2(h + ffn(h))
    none          : h = x + attn(x);            z = h + ffn(h)

    ln1/ln2 are RMSNorm (``norm_kind="rms"``) or LayerNorm (``"layer"``); the FFN is
    SwiGLU or a non-gated MLP (``ffn``); ``bias`` gives the attention and FFN linears
    (and LayerNorm) biases; ``qk_norm`` normalises each attention head's queries and keys
    (see :class:`MultiHeadSelfAttention`). Branch outputs pass through inverted dropout (p = ``dropout``)
    before they are added. Shape: (..., T, d_model) -> (..., T, d_model). The Tap
    ``resid_mid`` marks h, the residual stream between the two sublayers.
    """

    branch_multiplier: float = 1.0  # each branch times this before it is added (depth-muP sets L_base / L)

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
        *,
        norm_kind: str = "rms",
        bias: bool = False,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        qk_norm: str = "none",
    ):
        super().__init__()
        if norm not in ("pre", "post", "none"):
            raise ValueError(f"norm={norm!r}: must be 'pre', 'post' or 'none'")
        self.norm, self.dropout = norm, dropout
        kw = dict(device=device, dtype=dtype)
        ffn_module = make_ffn(ffn, d_model, d_ff, bias, **kw)  # checks ffn before anything else is built
        if norm != "none":
            self.ln1 = make_norm(norm_kind, d_model, eps, bias, **kw)
        self.attn = MultiHeadSelfAttention(d_model, num_heads, max_seq_len, theta, dropout=dropout, bias=bias,
                                           num_kv_heads=num_kv_heads, sliding_window=sliding_window,
                                           qk_norm=qk_norm, eps=eps, **kw)
        if norm != "none":
            self.ln2 = make_norm(norm_kind, d_model, eps, bias, **kw)
        self.ffn = ffn_module
        self.resid_mid = Tap()

    def _branch(self, f: nn.Module, x: Tensor, *args) -> Tensor:
        out = F.dropout(f(x, *args), self.dropout, self.training)
        return out if self.branch_multiplier == 1.0 else out * self.branch_multiplier

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
    """Decoder-only language model: token_embeddings [+ position_embeddings] -> layers -> ln_final -> lm_head.

    With ``positions="learned"`` the block stack reads token_embeddings(ids) +
    position_embeddings(positions), marked by the Tap ``resid_in``; positions default to
    0 .. T-1 and must lie in [0, context_length). ``ln_final`` exists for pre-norm only (a
    post-norm block already ends in a norm; a no-norm model has none). With
    ``tie_embeddings`` the lm_head's weight is the token embedding matrix itself, so
    logits = h E^T. The lm_head never has a bias.

    Shape: token_ids (..., T) integers, T <= context_length -> logits (..., T, vocab_size).
    Under ``parametrization="mup"`` (see :mod:`tinylm.mup`) the logits are lm_head's output times
    ``output_multiplier`` (1 / width_mult), each query is multiplied by the config's
    ``attention_multiplier`` and, with ``mup_base_depth``, each residual branch by its
    ``branch_multiplier``; all three are 1 under "sp" and at the base width and depth.
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
        if c.positions == "learned":
            self.position_embeddings = Embedding(c.context_length, c.d_model, **kw)
            self.resid_in = Tap()
        else:
            self.position_embeddings = None
        theta = c.rope_theta if c.rope else None
        self.layers = nn.ModuleList(
            TransformerBlock(c.d_model, c.num_heads, c.d_ff, c.context_length, theta, c.eps, c.norm, c.ffn, c.dropout,
                             norm_kind=c.norm_kind, bias=c.bias, num_kv_heads=c.num_kv_heads,
                             sliding_window=c.sliding_window, qk_norm=c.qk_norm, **kw)
            for _ in range(c.num_layers)
        )
        self.ln_final = make_norm(c.norm_kind, c.d_model, c.eps, c.bias, **kw) if c.norm == "pre" else None
        self.lm_head = Linear(c.d_model, c.vocab_size, **kw)  # never a bias (GPT-2 has none either)
        if c.tie_embeddings:
            self.lm_head.weight = self.token_embeddings.weight
        self.output_multiplier = c.output_multiplier  # muP: logits = lm_head(x) / width_mult (1.0 under SP)
        for block in self.layers:
            block.attn.query_multiplier, block.branch_multiplier = c.attention_multiplier, c.branch_multiplier
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
        if self.position_embeddings is not None:
            x = self.resid_in(x + self.position_embeddings(self._positions(T, token_positions, token_ids.device)))
        for block in self.layers:
            x = block(x, token_positions)
        if self.ln_final is not None:
            x = self.ln_final(x)
        logits = self.lm_head(x)  # (..., T, V)
        return logits if self.output_multiplier == 1.0 else logits * self.output_multiplier

    def _positions(self, T: int, token_positions: Tensor | None, device) -> Tensor:
        """The rows of the learned position table to add: ``token_positions`` or 0 .. T-1, checked."""
        if token_positions is None:
            return torch.arange(T, device=device)
        if token_positions.numel() and (int(token_positions.min()) < 0
                                        or int(token_positions.max()) >= self.config.context_length):
            raise ValueError(
                f"token positions span [{int(token_positions.min())}, {int(token_positions.max())}] but the learned "
                f"position table has context_length={self.config.context_length} rows: pass positions in "
                f"[0, {self.config.context_length})"
            )
        return token_positions

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        c = self.config
        kv = f", H_kv={c.kv_heads}" if c.kv_heads != c.num_heads else ""
        return (f"V={c.vocab_size}, T={c.context_length}, d={c.d_model}, L={c.num_layers}, H={c.num_heads}{kv}, "
                f"d_ff={c.d_ff}")
