"""The implementation under test: a small protocol, with tinylm as the default.

The properties never call tinylm directly; they call the functions of an
*implementation*, any object (or module) that provides some of:

=================================  ====================================================================
name                               signature (tensors are torch tensors; ``...`` = any leading dims)
=================================  ====================================================================
``softmax``                        ``(x, dim=-1) -> Tensor``
``log_softmax``                    ``(x, dim=-1) -> Tensor``
``logsumexp``                      ``(x, dim=-1, keepdim=False) -> Tensor`` (dim reduced unless keepdim)
``cross_entropy``                  ``(logits (..., C), targets (...), label_smoothing=0.0) -> scalar`` (mean);
                                   ValueError naming ``label_smoothing=`` outside [0, 1] or on a shape mismatch
``silu``                           ``(x) -> Tensor``
``rmsnorm``                        ``(x (..., d), weight (d,), eps) -> Tensor`` (same dtype as x)
``linear``                         ``(x (..., d_in), weight (d_out, d_in)) -> (..., d_out)``
``swiglu``                         ``(x (..., d), w1 (d_ff, d), w2 (d, d_ff), w3 (d_ff, d)) -> (..., d)``
``dropout``                        ``(x, p, training=True, generator=None) -> Tensor`` (inverted dropout);
                                   ValueError naming ``p=`` outside [0, 1)
``scaled_dot_product_attention``   ``(Q (..., Tq, dk), K (..., Tk, dk), V (..., Tk, dv), mask=None) -> (..., Tq, dv)``
                                   mask True = may attend
``multihead_self_attention``       ``(x (..., T, d), q_w, k_w, v_w, o_w (each (d, d)), num_heads) -> (..., T, d)`` causal, no RoPE
``rope``                           ``(x (..., T, dk), theta, token_positions (..., T)) -> Tensor``
``transformer_block``              ``(config: tinylm.ModelConfig, generator) -> nn.Module`` with submodules
                                   ``ln1, attn, ln2, ffn`` (CS336 names), ``forward(x)``
``transformer_lm``                 ``(config: tinylm.ModelConfig, generator) -> nn.Module``, token ids -> logits,
                                   submodules ``token_embeddings`` and ``lm_head`` (CS336 names)
``init``                           a module like :mod:`tinylm.init` (``declare``, ``apply``, ``truncnorm_variance``)
``functional``                     a module like :mod:`tinylm.functional` (its helpers ``causal_mask``,
                                   ``attention_scores``, ``rope_angles``, ``apply_rope``, ``rms_norm``)
``layers``                         a module like :mod:`tinylm.layers` (``Linear``, ``Embedding``, ``RMSNorm``
                                   with ``reset_parameters``)
=================================  ====================================================================

``load("package.module:object")`` imports a user's object (``package.module``
alone uses the module itself). A property that needs a function the object
lacks is skipped and the report names the missing function.

Example, wrapping one's own CS336 code::

    # mylm_props.py
    import mylm
    softmax = mylm.softmax                    # (x, dim)
    def linear(x, weight):                    # adapt a module to the protocol
        lin = mylm.Linear(weight.shape[1], weight.shape[0], dtype=weight.dtype)
        lin.load_state_dict({"weight": weight})
        return lin(x)

    $ TINYLM_PROPS_IMPL=mylm_props tinylm props      # or: tinylm props --impl mylm_props
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from tinylm.errors import TinyLMError

__all__ = ["FUNCTIONS", "TinyLMImpl", "Implementation", "ImplError", "load", "current", "ENV_VAR"]

ENV_VAR = "TINYLM_PROPS_IMPL"

#: Every function name of the protocol.
FUNCTIONS: tuple[str, ...] = (
    "softmax",
    "log_softmax",
    "logsumexp",
    "cross_entropy",
    "silu",
    "rmsnorm",
    "linear",
    "swiglu",
    "dropout",
    "scaled_dot_product_attention",
    "multihead_self_attention",
    "rope",
    "transformer_block",
    "transformer_lm",
    "init",
    "functional",
    "layers",
)


class TinyLMImpl:
    """The protocol implemented by tinylm, through its public modules and functions.

    Functions with weights build the tinylm module and load the weights into it, so
    the module code (not only ``tinylm.functional``) is what the properties test.
    """

    name = "tinylm"

    def __init__(self) -> None:
        import tinylm

        self._tl = tinylm
        self.init = tinylm.init
        self.functional = tinylm.functional
        self.layers = tinylm.layers
        self.source = os.path.dirname(tinylm.__file__)

    # -- functional (arguments passed through as given, so tinylm's own defaults are what runs) --
    def softmax(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self._tl.functional.softmax(x, *args, **kwargs)

    def log_softmax(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self._tl.functional.log_softmax(x, *args, **kwargs)

    def logsumexp(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self._tl.functional.logsumexp(x, *args, **kwargs)

    def cross_entropy(self, logits: Tensor, targets: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self._tl.functional.cross_entropy(logits, targets, *args, **kwargs)

    def silu(self, x: Tensor) -> Tensor:
        return self._tl.functional.silu(x)

    def dropout(self, x: Tensor, p: float, *args: Any, **kwargs: Any) -> Tensor:
        return self._tl.functional.dropout(x, p, *args, **kwargs)

    def scaled_dot_product_attention(self, Q: Tensor, K: Tensor, V: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self._tl.functional.scaled_dot_product_attention(Q, K, V, *args, **kwargs)

    # -- modules ------------------------------------------------------------
    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        m = self._tl.RMSNorm(weight.shape[0], eps=eps, device="meta", dtype=weight.dtype)
        return functional_call(m, {"weight": weight}, (x,))

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        m = self._tl.Linear(weight.shape[1], weight.shape[0], device="meta", dtype=weight.dtype)
        return functional_call(m, {"weight": weight}, (x,))

    def swiglu(self, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
        m = self._tl.SwiGLU(w1.shape[1], w1.shape[0], device="meta", dtype=w1.dtype)
        return functional_call(m, {"w1.weight": w1, "w2.weight": w2, "w3.weight": w3}, (x,))

    def multihead_self_attention(
        self, x: Tensor, q_w: Tensor, k_w: Tensor, v_w: Tensor, o_w: Tensor, num_heads: int
    ) -> Tensor:
        m = self._tl.MultiHeadSelfAttention(q_w.shape[1], num_heads, device="meta", dtype=q_w.dtype)
        weights = {"q_proj.weight": q_w, "k_proj.weight": k_w, "v_proj.weight": v_w, "output_proj.weight": o_w}
        return functional_call(m, weights, (x,))

    def rope(self, x: Tensor, theta: float, token_positions: Tensor) -> Tensor:
        max_len = int(token_positions.max()) + 1 if token_positions.numel() else 1
        m = self._tl.RotaryPositionalEmbedding(theta, x.shape[-1], max_len)
        return m(x, token_positions)

    def transformer_block(self, config: Any, generator: torch.Generator | None = None) -> nn.Module:
        from tinylm.model import TransformerBlock

        c = config
        theta = c.rope_theta if c.rope else None
        block = TransformerBlock(
            c.d_model, c.num_heads, c.d_ff, c.context_length, theta, c.eps, c.norm, c.ffn, c.dropout
        )
        self._tl.init.apply(block, c.init, generator=generator)
        return block

    def transformer_lm(self, config: Any, generator: torch.Generator | None = None) -> nn.Module:
        return self._tl.TransformerLM(config, generator=generator)


class Implementation:
    """An implementation under test: ``has(name)`` and attribute access to its functions."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj = obj
        self.name = name
        self.source: str | None = (
            getattr(obj, "source", None)
            or getattr(obj, "__file__", None)
            or getattr(sys.modules.get(type(obj).__module__), "__file__", None)
        )

    def has(self, fn: str) -> bool:
        return getattr(self.obj, fn, None) is not None

    def missing(self, needs: tuple[str, ...]) -> list[str]:
        return [n for n in needs if not self.has(n)]

    def provided(self) -> list[str]:
        return [n for n in FUNCTIONS if self.has(n)]

    def __getattr__(self, fn: str) -> Any:
        if fn.startswith("_") or fn in ("obj", "name", "source"):
            raise AttributeError(fn)
        value = getattr(self.obj, fn, None)
        if value is None:
            raise AttributeError(f"implementation {self.name!r} provides no {fn!r}")
        return value

    def __repr__(self) -> str:
        return f"Implementation({self.name!r}, provides {', '.join(self.provided()) or 'nothing'})"


class ImplError(TinyLMError):
    """The --impl / TINYLM_PROPS_IMPL value cannot be loaded; the message says why and what to pass."""


def load(spec: str | None = None) -> Implementation:
    """The implementation named by ``spec`` ("package.module:object" or "package.module"); tinylm when None/"tinylm"."""
    if spec is None or spec in ("", "tinylm"):
        return Implementation(TinyLMImpl(), "tinylm")
    if not isinstance(spec, str) or spec.count(":") > 1:
        raise ImplError(f"impl={spec!r}: give package.module or package.module:object")
    mod_name, _, attr = spec.partition(":")
    try:
        mod: ModuleType = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImplError(
            f"impl={spec!r}: cannot import module {mod_name!r} ({e}); make it importable (pip install -e, or PYTHONPATH)"
        ) from None
    obj: Any = mod
    for part in filter(None, attr.split(".")):
        if not hasattr(obj, part):
            raise ImplError(f"impl={spec!r}: module {mod_name!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        obj = obj()
    impl = Implementation(obj, spec)
    if not impl.provided():
        raise ImplError(
            f"impl={spec!r} provides none of the protocol's functions ({', '.join(FUNCTIONS)}); see props.impl"
        )
    return impl


_cache: dict[str, Implementation] = {}


def current() -> Implementation:
    """The implementation named by the environment variable TINYLM_PROPS_IMPL (tinylm when unset)."""
    spec = os.environ.get(ENV_VAR, "") or "tinylm"
    if spec not in _cache:
        _cache[spec] = load(spec)
    return _cache[spec]
