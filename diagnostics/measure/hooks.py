"""Module hooks put on and taken off in bulk: :class:`Hooks`; a tensor's gradient hook without
its handle: :func:`tensor_hook`.

A probe puts hundreds of hooks on a model at every entry and takes them off at every exit.
``nn.Module.register_forward_hook`` builds a ``RemovableHandle`` per hook (weak references to
three dicts) and ``remove`` looks each of them up again; here each hook is one entry in the
module's own hook dict, under a key drawn from the same counter ``RemovableHandle`` draws
from (so it never meets a key of a hook registered the usual way), and :meth:`Hooks.remove`
deletes every entry it made. What the module runs is the same: ``nn.Module.__call__`` reads
those dicts, in insertion order, whoever filled them.

A probe also puts one gradient hook on hundreds of tensors per pass and never removes them
(they go with the graph). ``Tensor.register_hook`` builds a ``RemovableHandle`` for each (about
half its time); :func:`tensor_hook` makes the same entry in the tensor's ``_backward_hooks``
(the dict autograd reads, registered with the tensor's ``grad_fn`` once, as ``register_hook``
does) and returns nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["Hooks", "tensor_hook"]

_PLAIN = (Tensor, nn.Parameter)


def _next_key() -> int:
    key = RemovableHandle.next_id  # the counter RemovableHandle draws from: never a key it gives
    RemovableHandle.next_id = key + 1
    return key


def tensor_hook(t: Tensor, fn: Callable) -> None:
    """``t.register_hook(fn)`` without the handle: ``fn(grad)`` runs when the gradient of the
    loss w.r.t. ``t`` is computed, in the order of the tensor's hooks, as the handle's would.
    ``t`` requires grad. A leaf, a tensor subclass or a tensor that a ``__torch_function__``
    override would see (a mode on) takes ``register_hook`` itself."""
    grad_fn = t.grad_fn
    if grad_fn is None or type(t) not in _PLAIN or torch._C._has_torch_function_unary(t):
        t.register_hook(fn)
        return
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()
        grad_fn._register_hook_dict(t)
    hooks[_next_key()] = fn


class Hooks:
    """Forward hooks and forward pre-hooks (the plain signatures: ``hook(module, args, output)``,
    ``pre(module, args)``) added to modules, all removed by one :meth:`remove` (idempotent)."""

    def __init__(self) -> None:
        self._made: list[tuple[dict, int]] = []

    def _add(self, hooks: dict, fn: Callable, *extra: dict) -> None:
        key = _next_key()
        hooks[key] = fn
        self._made.append((hooks, key))
        for d in extra:  # e.g. the always-called marks, removed with the hook
            d[key] = True
            self._made.append((d, key))

    def forward(self, module: nn.Module, fn: Callable, always_call: bool = False) -> None:
        """``module.register_forward_hook(fn, always_call=always_call)``, without the handle."""
        if always_call:
            self._add(module._forward_hooks, fn, module._forward_hooks_always_called)
        else:
            self._add(module._forward_hooks, fn)

    def pre(self, module: nn.Module, fn: Callable) -> None:
        """``module.register_forward_pre_hook(fn)``, without the handle."""
        self._add(module._forward_pre_hooks, fn)

    def remove(self) -> None:
        """Delete every entry made, last first (entries already gone are skipped)."""
        made, self._made = self._made, []
        for hooks, key in reversed(made):
            hooks.pop(key, None)
