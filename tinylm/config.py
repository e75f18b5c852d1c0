"""``ModelConfig``: the single source of truth for a model's shape and variant.

A checkpoint stores it as a plain dict (``to_dict``) and loading rebuilds the
model from it (``from_dict``). Construction validates every field, so an
invalid model cannot be described, let alone built.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigError
from .validate import boolean, check, check_type, choice, fail, integer, number, refuse

__all__ = ["ModelConfig", "default_d_ff", "PRESETS", "preset"]

NORMS = ("pre", "post", "none")
NORM_KINDS = ("rms", "layer")
FFNS = ("swiglu", "silu", "gelu", "gelu_tanh", "relu")
POSITIONS = ("rope", "learned", "none")
QK_NORMS = ("none", "rms", "layer")
PARAMETRIZATIONS = ("sp", "mup")


def default_d_ff(d_model: int, multiple_of: int = 64) -> int:
    """The SwiGLU hidden size 8/3 * d_model, rounded up to a multiple of ``multiple_of``.

    With three matrices of d_model x d_ff, 8/3 d_model keeps the parameter count
    at 8 d_model^2, the same as a ReLU FFN of width 4 d_model.
    """
    if d_model <= 0 or multiple_of <= 0:
        refuse(f"d_model={d_model}, multiple_of={multiple_of}: both must be positive", error=ConfigError)
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and architectural choices of a :class:`tinylm.TransformerLM`.

    One config describes the CS336 block (the defaults: pre-norm RMSNorm, SwiGLU, RoPE, no
    biases), Llama-style models (the same block) and GPT-2 (pre-norm LayerNorm with bias, a
    tanh-GELU MLP, learned absolute positions, biases, tied embeddings; preset "gpt2").

    Args:
        vocab_size: number of token ids V.
        context_length: longest sequence the model accepts (RoPE tables and the learned
            position table are this long).
        d_model: width of the residual stream d.
        num_layers: number of Transformer blocks L.
        num_heads: attention heads H; d_model must be divisible by H.
        num_kv_heads: key/value heads H_kv (grouped-query attention): each K/V head serves
            H / H_kv consecutive query heads; None means H (multi-head attention). H_kv must
            divide H; k_proj and v_proj have H_kv * d_k output features.
        d_ff: hidden width of the feed-forward network.
        rope_theta: RoPE base theta (angles are position * theta^(-2k/d_head)).
        eps: norm epsilon, added to the mean square (RMSNorm) or the variance (LayerNorm)
            inside the square root.
        norm: where the norms sit: "pre" (x + f(norm(x))), "post" (norm(x + f(x))) or "none".
        norm_kind: which norm: "rms" (RMSNorm, a gain) or "layer" (LayerNorm: mean removed,
            a gain, and a bias iff ``bias``).
        ffn: "swiglu" (w2(silu(w1 x) * w3 x)), or a non-gated MLP w2(act(w1 x)) with act
            "silu", "gelu" (exact, x Phi(x)), "gelu_tanh" (GPT-2's tanh approximation) or "relu".
        positions: "rope" (rotary, in attention), "learned" (an absolute table
            ``position_embeddings`` (context_length, d_model) added to the token embedding)
            or "none" (NoPE).
        bias: biases on q/k/v/output_proj, on the FFN's linears and on LayerNorm; the
            lm_head never has one.
        tie_embeddings: lm_head shares the token embedding matrix.
        dropout: residual and attention dropout probability (0 disables).
        init: name of the init scheme a fresh model gets (see ``tinylm.init``).
        sliding_window: None (attend to every earlier position) or W >= 1: query i attends to
            key j iff 0 <= i - j < W (Mistral's convention).
        qk_norm: "none", or a norm of each head's query and key vectors over d_k, after the
            q/k projections and before RoPE: "rms" (RMSNorm with a gain ``q_norm.weight`` /
            ``k_norm.weight`` of size d_k shared by the heads) or "layer" (LayerNorm, a gain
            and a bias), with epsilon ``eps``. With RMSNorm and unit gains every score
            |q_hat . k_hat| / sqrt(d_k) is at most sqrt(d_k), whatever the weights.
        parametrization: "sp" (standard) or "mup" (the Maximal Update Parametrization, see
            :mod:`tinylm.mup`): with width_mult m = d_model / mup_base_width, hidden weights'
            init variance is the scheme's at the base width times 1/m (so proportional to
            1/fan_in), the logits are lm_head's output times 1/m, and attention logits are
            q.k sqrt(d_base_head) / d_head (1/d_head scaling; exactly 1/sqrt(d_head) at the base
            width). At m = 1 the model equals the standard one exactly.
        mup_base_width: the base d_model of a "mup" model (required there; None under "sp").
        mup_base_head_dim: the base head dimension (default d_head / m: heads fixed, d_head
            growing with width; set it to d_head when width grows by adding heads).
        mup_readout_zero_init: a "mup" model's lm_head starts at zero (untied heads only).
        mup_query_zero_init: a "mup" model's q_proj weights start at zero.
        mup_base_depth: None, or the base depth L_base of depth-muP (CompleteP, alpha = 1):
            every residual branch is multiplied by L_base / num_layers.
    """

    vocab_size: int
    context_length: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    rope_theta: float = 10000.0
    eps: float = 1e-5
    norm: str = "pre"
    ffn: str = "swiglu"
    positions: str = "rope"
    tie_embeddings: bool = False
    dropout: float = 0.0
    init: str = "cs336"
    norm_kind: str = "rms"
    bias: bool = False
    num_kv_heads: int | None = None
    sliding_window: int | None = None
    qk_norm: str = "none"
    parametrization: str = "sp"
    mup_base_width: int | None = None
    mup_base_head_dim: int | None = None
    mup_readout_zero_init: bool = False
    mup_query_zero_init: bool = False
    mup_base_depth: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            integer(name, getattr(self, name), low=1, error=ConfigError)
        if self.d_model % self.num_heads:
            refuse(f"d_model={self.d_model}, num_heads={self.num_heads}: d_model must be divisible by num_heads",
                   error=ConfigError, argument="num_heads")
        if self.rope and self.head_dim % 2:
            refuse(f"head dimension d_model/num_heads={self.head_dim} is odd: RoPE rotates pairs, so it must be even "
                   "(change num_heads, or set positions='learned' or 'none')", error=ConfigError, argument="num_heads")
        if self.num_kv_heads is not None:
            integer("num_kv_heads", self.num_kv_heads, low=1, error=ConfigError)
            if self.num_heads % self.num_kv_heads:
                divisors = ", ".join(str(k) for k in range(1, self.num_heads + 1) if self.num_heads % k == 0)
                refuse(f"num_kv_heads={self.num_kv_heads}: must divide num_heads={self.num_heads} (each key/value "
                       f"head serves a whole group of query heads)", f"pass one of {divisors}", error=ConfigError,
                       argument="num_kv_heads")
        if self.sliding_window is not None:
            integer("sliding_window", self.sliding_window, low=1, error=ConfigError)
        number("rope_theta", self.rope_theta, low=0.0, strict_low=True, error=ConfigError)
        number("eps", self.eps, low=0.0, error=ConfigError)
        choice("norm", self.norm, NORMS, error=ConfigError)
        choice("norm_kind", self.norm_kind, NORM_KINDS, error=ConfigError)
        choice("ffn", self.ffn, FFNS, error=ConfigError)
        choice("positions", self.positions, POSITIONS, error=ConfigError)
        choice("qk_norm", self.qk_norm, QK_NORMS, error=ConfigError)
        boolean("bias", self.bias, error=ConfigError)
        boolean("tie_embeddings", self.tie_embeddings, error=ConfigError)
        check("dropout", self.dropout, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
              and 0.0 <= v < 1.0, "be a number in [0, 1)", error=ConfigError)
        self._check_parametrization()
        if not isinstance(self.init, str) or not self.init:
            fail("init", self.init, "name an init scheme", "one of tinylm.init.SCHEMES", error=ConfigError)

    def _check_parametrization(self) -> None:
        choice("parametrization", self.parametrization, PARAMETRIZATIONS, error=ConfigError)
        boolean("mup_readout_zero_init", self.mup_readout_zero_init, error=ConfigError)
        boolean("mup_query_zero_init", self.mup_query_zero_init, error=ConfigError)
        mup_fields = ("mup_base_width", "mup_base_head_dim", "mup_base_depth")
        if self.parametrization == "sp":
            for name in (*mup_fields, "mup_readout_zero_init", "mup_query_zero_init"):
                if getattr(self, name) not in (None, False):
                    refuse(f"{name}={getattr(self, name)!r} with parametrization='sp': the muP fields apply to "
                           "parametrization='mup' only", "pass parametrization='mup', or drop the field",
                           error=ConfigError, argument=name)
            return
        if self.mup_base_width is None:
            fail("mup_base_width", None, "be the base width (a positive integer) of a muP model",
                 "mup_base_width=N (the d_model the hyperparameters were tuned at)", error=ConfigError)
        for name in mup_fields:
            if getattr(self, name) is not None:
                integer(name, getattr(self, name), low=1, error=ConfigError)
        if self.mup_readout_zero_init and self.tie_embeddings:
            refuse("mup_readout_zero_init=True with tie_embeddings=True: a tied lm_head is the embedding table, "
                   "which must not start at zero", "untie the embeddings, or drop mup_readout_zero_init",
                   error=ConfigError, argument="mup_readout_zero_init")

    @property
    def width_mult(self) -> float:
        """m = d_model / mup_base_width under "mup"; 1.0 under "sp"."""
        return self.d_model / self.mup_base_width if self.parametrization == "mup" else 1.0

    @property
    def output_multiplier(self) -> float:
        """What the logits are: lm_head's output times this (1/m under "mup", 1 under "sp")."""
        return 1.0 / self.width_mult

    @property
    def attention_multiplier(self) -> float:
        """The factor on each query so that the logits are q.k sqrt(d_base_head) / d_head under "mup"
        (sqrt(d_base_head / d_head); exactly 1.0 at the base width and under "sp")."""
        if self.parametrization != "mup":
            return 1.0
        base = self.mup_base_head_dim if self.mup_base_head_dim is not None else self.head_dim / self.width_mult
        return 1.0 if base == self.head_dim else math.sqrt(base / self.head_dim)

    @property
    def branch_multiplier(self) -> float:
        """Depth-muP (CompleteP, alpha = 1): each residual branch times L_base / L (1.0 without it)."""
        if self.parametrization != "mup" or self.mup_base_depth is None:
            return 1.0
        return self.mup_base_depth / self.num_layers

    @property
    def rope(self) -> bool:
        """Whether attention rotates q and k (``positions == "rope"``); read-only."""
        return self.positions == "rope"

    @property
    def head_dim(self) -> int:
        """d_k = d_model / num_heads."""
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """H_kv, the number of key/value heads (``num_kv_heads``, or ``num_heads`` when None)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """Build from a dict, naming any key that is not a field.

        A legacy boolean ``"rope"`` key (configs stored before ``positions`` existed) maps to
        ``positions``: True -> "rope", False -> "none".
        """
        check_type("data", data, dict, "a dict of config fields", error=ConfigError)
        if "rope" in data:
            data = dict(data)
            rope = boolean("rope", data.pop("rope"), fix="True or False (the legacy field; use positions=)",
                           error=ConfigError)
            if "positions" in data and data["positions"] != ("rope" if rope else "none"):
                refuse(f"rope={rope} and positions={data['positions']!r} disagree", "drop the legacy 'rope' key",
                       error=ConfigError, argument="rope")
            data.setdefault("positions", "rope" if rope else "none")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            refuse(f"unknown config field(s) {', '.join(map(repr, unknown))}", f"known: {', '.join(sorted(known))}",
                   error=ConfigError)
        missing = sorted(f.name for f in fields(cls) if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            refuse(f"config lacks field(s) {', '.join(missing)}", error=ConfigError)
        return cls(**data)


# GPT-2 small itself: pre-norm LayerNorm with bias, tanh-GELU MLP of width 4d, learned positions,
# biases, tied embeddings, GPT-2 init (the architecture of Hugging Face's "gpt2").
_GPT2 = ModelConfig(
    vocab_size=50257, context_length=1024, d_model=768, num_layers=12, num_heads=12, d_ff=3072,
    eps=1e-5, norm="pre", norm_kind="layer", ffn="gelu_tanh", positions="learned", bias=True,
    tie_embeddings=True, init="gpt2",
)

PRESETS: dict[str, ModelConfig] = {
    # CS336 block (pre-norm RMSNorm, SwiGLU, RoPE, no biases) at the shape of the assignment-1 test fixture.
    "tiny": ModelConfig(vocab_size=10000, context_length=16, d_model=64, num_layers=3, num_heads=4, d_ff=128),
    # CS336 block: the TinyStories model.
    "tinystories": ModelConfig(
        vocab_size=10000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344
    ),
    # CS336 block at GPT-2 small's sizes: SwiGLU (d_ff = 8/3 d rounded to 64) and RoPE; not GPT-2's architecture.
    "gpt2-small": ModelConfig(
        vocab_size=50257, context_length=1024, d_model=768, num_layers=12, num_heads=12, d_ff=2048
    ),
    # GPT-2 small (the architecture above).
    "gpt2": _GPT2,
    # GPT-2's architecture at test size.
    "gpt2-tiny": _GPT2.replace(vocab_size=10000, context_length=64, d_model=64, num_layers=3, num_heads=4, d_ff=256),
}


def preset(name: str, **changes: Any) -> ModelConfig:
    """The named preset, optionally with fields changed."""
    if name not in PRESETS:
        refuse(f"unknown preset {name!r}", f"choose one of {', '.join(PRESETS)}", error=ConfigError, argument="name")
    return PRESETS[name].replace(**changes) if changes else PRESETS[name]
