"""What a coordinate check measures: each site's tensor on one batch, kept to compare with init.

A coordinate check (Yang et al. 2022, "Tensor Programs V") trains a model a few steps at
several widths and asks how the size of each activation, and of its change since init,
scales with width. :func:`coord_sites` finds the sites of any ``nn.Module`` by structure
(:func:`diagnostics.measure.sites.model_sites`):

* ``embedding``: every embedding table's output;
* ``attn_logits``: the attention logits s = scale q.k (masked entries left out), named
  ``{attention module}.logits``: from each ``F.scaled_dot_product_attention`` call (its own
  ``scale``, else 1/sqrt(d_k)) or an eager softmax over 4-D logits (its input), attributed to
  the attention module running it (any other model: to the block);
* ``attn_branch`` / ``ffn_branch``: the attention and FFN modules' outputs, before the residual
  add (tinylm: ``layers.i.attn`` and ``layers.i.ffn``; any other model: each block child whose
  class name ends in ``Attention``, and each named ``mlp``, ``ffn``, ``feed_forward`` or whose
  class name holds ``MLP``);
* ``residual``: each block's output (the residual stream);
* ``logits``: the model's output logits, named ``output``: the logits the loss sees, after
  any multiplier the forward applies (a muP head's raw output grows with width by design; its
  logits do not).

:class:`CoordRecorder` captures them during a forward (hooks removed on exit, whatever
happens); :func:`rms` and :func:`delta_rms` reduce, in float64.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import tinylm

from .eager_attention import SOFTMAX, _call, is_attention_softmax
from .outputs import first_tensor
from .sdpa import _logits, masked_additive
from .sites import model_sites

__all__ = ["KINDS", "coord_sites", "CoordRecorder", "rms", "delta_rms", "OUTPUT"]

#: the kinds of coordinate-check sites, in forward order
KINDS = ("embedding", "attn_logits", "attn_branch", "ffn_branch", "residual", "logits")
#: the site name of the model's output logits
OUTPUT = "output"
_FFN_NAMES = ("mlp", "ffn", "feed_forward")


def _branches(model: nn.Module, sites) -> dict[str, str]:
    if isinstance(model, tinylm.TransformerLM):
        return {n: k for n, k in sites.points.items() if k in ("attn_branch", "ffn_branch")}
    out = {a: "attn_branch" for a in sites.attention}
    named = dict(model.named_modules())
    for block in (sites.blocks.names if sites.blocks is not None else ()):
        for child, mod in named[block].named_children():
            if child in _FFN_NAMES or "MLP" in type(mod).__name__:
                out[f"{block}.{child}"] = "ffn_branch"
    return out


def coord_sites(model: nn.Module) -> tuple[dict[str, str], tuple[str, ...]]:
    """({module name: kind} of the hooked sites, the modules attention logits are named after).

    The attention logits' sites (``{module}.logits``) and the output (``output``) are added as
    they are seen."""
    sites = model_sites(model)
    hooked = {t: "embedding" for t in sites.embeddings}
    hooked.update(_branches(model, sites))
    blocks = sites.blocks.names if sites.blocks is not None else ()
    hooked.update({b: "residual" for b in blocks})
    owners = sites.attention or blocks
    return hooked, tuple(owners)


class _AttentionMode(TorchFunctionMode):
    """Sees every SDPA call and attention softmax while entered; hands the logits (the allowed
    entries, flattened, float64) to ``record(values)``."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            call = {**dict(zip(names, args)), **kwargs}
            with torch._C.DisableTorchFunction():
                q = call["query"]
                s, allowed = _logits(q, call["key"], call.get("attn_mask"), bool(call.get("is_causal", False)),
                                     call.get("scale"), q.shape[-2])
                self.record(s.double()[allowed.expand(s.shape)])
        elif func in SOFTMAX:
            x, dim = _call(func, args, kwargs)
            if is_attention_softmax(x, dim):
                with torch._C.DisableTorchFunction():
                    s = x.detach()
                    self.record(s.double()[~masked_additive(s)])
        return func(*args, **kwargs)


class CoordRecorder:
    """Captures every coordinate-check site of ``model`` in the forwards run inside ``capture()``.

    ``values`` maps a site name to its tensor (float64, detached) of the last forward;
    ``kinds`` maps a site name to its kind. The model's output is recorded by the caller
    (:meth:`record_output`), since only the caller reads it."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.hooked, self.owners = coord_sites(model)
        self.kinds: dict[str, str] = dict(self.hooked)
        self.values: dict[str, Tensor] = {}
        self._stack: list[str] = []

    def _record_attention(self, values: Tensor) -> None:
        if self._stack:
            name = f"{self._stack[-1]}.logits"
            self.kinds[name] = "attn_logits"
            self.values[name] = values

    def record_output(self, logits: Tensor) -> None:
        self.kinds[OUTPUT] = "logits"
        self.values[OUTPUT] = logits.detach().double()

    @contextlib.contextmanager
    def capture(self):
        named = dict(self.model.named_modules())
        handles = []
        try:
            for name in self.hooked:
                handles.append(named[name].register_forward_hook(self._keep(name)))
            for name in self.owners:
                handles.append(named[name].register_forward_pre_hook(self._enter(name)))
                handles.append(named[name].register_forward_hook(self._leave))
            with _AttentionMode(self._record_attention):
                yield self
        finally:
            for h in handles:
                h.remove()
            self._stack.clear()

    def _keep(self, name: str):
        def hook(module, args, output):
            t = first_tensor(output)
            if t is not None:
                self.values[name] = t.detach().double()
        return hook

    def _enter(self, name: str):
        def hook(module, args):
            self._stack.append(name)
        return hook

    def _leave(self, module, args, output):
        if self._stack:
            self._stack.pop()


def rms(x: Tensor) -> float:
    """sqrt(mean(x^2)) in float64 (nan for an empty tensor)."""
    return math.sqrt(float(x.double().square().mean())) if x.numel() else math.nan


def delta_rms(x: Tensor, x0: Tensor) -> float:
    """RMS of x - x0 (nan when the shapes differ: the site is not comparable)."""
    if x.shape != x0.shape:
        return math.nan
    return rms(x - x0)
