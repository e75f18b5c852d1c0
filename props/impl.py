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
``layer_norm``                     ``(x (..., d), weight (d,), bias (d,) or None, eps) -> Tensor`` (same dtype as x;
                                   the population variance, as ``torch.nn.LayerNorm``)
``gelu``                           ``(x, approximate="none") -> Tensor``; ``approximate="tanh"``: GPT-2's tanh form
``relu``                           ``(x) -> Tensor``
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
alone uses the module itself); a module that is not importable is looked for in
the current directory, and ``path/to/file.py[:object]`` loads that file. Only
what is named is imported. A property that needs a function the object lacks is
skipped and the report names the missing function; so is one that passes an
argument the user's function does not take (a CS336 ``cross_entropy(inputs,
targets)`` has no ``label_smoothing``): the report names ``cross_entropy(label_smoothing)``.

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

import functools
import importlib
import importlib.util
import inspect
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
    "layer_norm",
    "gelu",
    "relu",
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

    def gelu(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self._tl.functional.gelu(x, *args, **kwargs)

    def relu(self, x: Tensor) -> Tensor:
        return self._tl.functional.relu(x)

    def dropout(self, x: Tensor, p: float, *args: Any, **kwargs: Any) -> Tensor:
        return self._tl.functional.dropout(x, p, *args, **kwargs)

    def scaled_dot_product_attention(self, Q: Tensor, K: Tensor, V: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self._tl.functional.scaled_dot_product_attention(Q, K, V, *args, **kwargs)

    # -- modules ------------------------------------------------------------
    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        m = self._tl.RMSNorm(weight.shape[0], eps=eps, device="meta", dtype=weight.dtype)
        return functional_call(m, {"weight": weight}, (x,))

    def layer_norm(self, x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
        m = self._tl.LayerNorm(weight.shape[0], eps=eps, bias=bias is not None, device="meta", dtype=weight.dtype)
        params = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
        return functional_call(m, params, (x,))

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
            c.d_model, c.num_heads, c.d_ff, c.context_length, theta, c.eps, c.norm, c.ffn, c.dropout,
            norm_kind=c.norm_kind, bias=c.bias, qk_norm=c.qk_norm,
        )
        self._tl.init.apply(block, c.init, generator=generator)
        return block

    def transformer_lm(self, config: Any, generator: torch.Generator | None = None) -> nn.Module:
        return self._tl.TransformerLM(config, generator=generator)


def _contiguous(value: Any) -> Any:
    """``value`` with every tensor in it (in tuples, lists and dicts too) contiguous; a contiguous
    tensor is itself. A user's code may ``.view`` what it is given, which a strided tensor (an
    ``expand``, a transpose, a slice) cannot always take: the properties test the math, not that."""
    if isinstance(value, Tensor):
        return value.contiguous()
    if isinstance(value, (tuple, list)):
        items = [_contiguous(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _contiguous(v) for k, v in value.items()}
    return value


def _contiguous_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook (module-level, so a model that holds it still pickles): contiguous inputs."""
    return _contiguous(args), _contiguous(kwargs)


def _signature_checked(fn: Any, name: str, impl_name: str) -> Any:
    """``fn`` wrapped so that a call its signature cannot take (an argument it does not have,
    one too many, one it requires that the protocol does not pass) skips the property,
    naming the argument, instead of failing it; errors raised inside ``fn`` pass through.
    Every tensor it is handed is contiguous, and so is every tensor a module it builds
    (``transformer_block``, ``transformer_lm``) is called with."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: call it as it is
        sig = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            if sig is not None:
                sig.bind(*args, **kwargs)
        except TypeError as e:
            import pytest

            extra = [k for k in kwargs if k not in sig.parameters]
            has_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
            what = f"takes no {extra[0]} argument" if extra and not has_var_kw else f"cannot take this call ({e})"
            pytest.skip(f"implementation {impl_name!r}: {name}{_short(sig)} {what}")
        out = fn(*_contiguous(args), **_contiguous(kwargs))
        if isinstance(out, nn.Module):
            out.register_forward_pre_hook(_contiguous_inputs, with_kwargs=True)
        return out

    return call


def _short(sig: inspect.Signature) -> str:
    return "(" + ", ".join(p.name for p in sig.parameters.values()) + ")"


class Implementation:
    """An implementation under test: ``has(name)`` and attribute access to its functions.

    A user's functions (not tinylm's) are called through a signature check: a property that
    passes an argument the function does not take is skipped, naming the argument. They, and
    the modules they build, are handed contiguous tensors only.
    """

    def __init__(self, obj: Any, name: str, spec: str | None = None) -> None:
        self.obj = obj
        self.name = name
        self.spec = spec if spec is not None else name  # what a subprocess passes to load() to get the same object
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
        if fn.startswith("_") or fn in ("obj", "name", "source", "spec"):
            raise AttributeError(fn)
        value = getattr(self.obj, fn, None)
        if value is None:
            raise AttributeError(f"implementation {self.name!r} provides no {fn!r}")
        if fn in FUNCTIONS and self.name != "tinylm" and callable(value) and not isinstance(value, (type, ModuleType)):
            return _signature_checked(value, fn, self.name)
        return value

    def __repr__(self) -> str:
        return f"Implementation({self.name!r}, provides {', '.join(self.provided()) or 'nothing'})"


class ImplError(TinyLMError):
    """The --impl / TINYLM_PROPS_IMPL value cannot be loaded; the message says why and what to pass."""


def _is_file_spec(mod_name: str) -> bool:
    return mod_name.endswith(".py") or "/" in mod_name or os.sep in mod_name


def _import_file(spec: str, path_text: str) -> ModuleType:
    """The module in file ``path_text`` (the user named it), imported under its stem's name."""
    path = os.path.abspath(path_text)
    if not os.path.isfile(path):
        raise ImplError(f"impl={spec!r}: no such file {path_text!r}; give a .py file or an importable module")
    name = os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules and os.path.abspath(getattr(sys.modules[name], "__file__", "") or "") == path:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImplError(f"impl={spec!r}: {path_text!r} is not a Python module; give a .py file")
    mod = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = mod
    sys.path.insert(0, os.path.dirname(path))  # its own imports of modules beside it
    try:
        module_spec.loader.exec_module(mod)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ImplError(f"impl={spec!r}: importing {path_text} failed ({type(e).__name__}: {e})") from None
    finally:
        sys.path.remove(os.path.dirname(path))
    return mod


def _import_module(spec: str, mod_name: str) -> tuple[ModuleType, str]:
    """``mod_name`` imported from sys.path, else from the current directory (as ``python -m``
    would find it); returns the module and the spec a subprocess should use."""
    try:
        return importlib.import_module(mod_name), spec
    except ModuleNotFoundError as e:
        top = mod_name.split(".")[0]
        if e.name != top and not (e.name or "").startswith(top + "."):
            raise ImplError(f"impl={spec!r}: importing {mod_name!r} failed: {e}; install what it needs") from None
    except ImportError as e:
        raise ImplError(f"impl={spec!r}: cannot import module {mod_name!r} ({e})") from None
    cwd = os.getcwd()
    top = mod_name.split(".")[0]
    if os.path.isfile(os.path.join(cwd, top + ".py")) or os.path.isfile(os.path.join(cwd, top, "__init__.py")):
        sys.path.insert(0, cwd)
        try:
            return importlib.import_module(mod_name), spec
        except ImportError as e:
            raise ImplError(f"impl={spec!r}: cannot import module {mod_name!r} from {cwd} ({e})") from None
        finally:
            sys.path.remove(cwd)
    raise ImplError(
        f"impl={spec!r}: cannot import module {mod_name!r}: it is neither on the Python path nor in the current "
        f"directory ({cwd}); "
        "run from the directory that holds it, give a file (path/to/file.py:object), or pip install -e your package"
    )


def load(spec: str | None = None) -> Implementation:
    """The implementation named by ``spec``; tinylm when None/"tinylm".

    ``spec``: "package.module:object" or "package.module" (importable, or in the current
    directory), or "path/to/file.py[:object]". Nothing but the named module is imported.
    """
    if spec is None or spec in ("", "tinylm"):
        return Implementation(TinyLMImpl(), "tinylm")
    if not isinstance(spec, str) or spec.count(":") > 1:
        raise ImplError(f"impl={spec!r}: give package.module, package.module:object or path/to/file.py:object")
    mod_name, _, attr = spec.partition(":")
    resolved = spec
    if _is_file_spec(mod_name):
        mod = _import_file(spec, mod_name)
        resolved = os.path.abspath(mod_name) + (f":{attr}" if attr else "")
    else:
        mod, resolved = _import_module(spec, mod_name)
        if getattr(mod, "__file__", None) and os.path.dirname(os.path.abspath(mod.__file__)) == os.getcwd() \
                and "." not in mod_name:
            resolved = os.path.abspath(mod.__file__) + (f":{attr}" if attr else "")  # found here: a subprocess too
    obj: Any = mod
    for part in filter(None, attr.split(".")):
        if not hasattr(obj, part):
            raise ImplError(f"impl={spec!r}: module {mod_name!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        obj = obj()
    impl = Implementation(obj, os.path.basename(spec) if _is_file_spec(mod_name) else spec, resolved)
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
