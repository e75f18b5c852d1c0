"""Module hooks put on and taken off in bulk: :class:`Hooks`.

A probe puts hundreds of hooks on a model at every entry and takes them off at every exit.
``nn.Module.register_forward_hook`` builds a ``RemovableHandle`` per hook (weak references to
three dicts) and ``remove`` looks each of them up again; here each hook is one entry in the
module's own hook dict, under a key drawn from the same counter ``RemovableHandle`` draws
from (so it never meets a key of a hook registered the usual way), and :meth:`Hooks.remove`
deletes every entry it made. What the module runs is the same: ``nn.Module.__call__`` reads
those dicts, in insertion order, whoever filled them.
"""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["Hooks"]


class Hooks:
    """Forward hooks and forward pre-hooks (the plain signatures: ``hook(module, args, output)``,
    ``pre(module, args)``) added to modules, all removed by one :meth:`remove` (idempotent)."""

    def __init__(self) -> None:
        self._made: list[tuple[dict, int]] = []

    def _add(self, hooks: dict, fn: Callable, *extra: dict) -> None:
        key = RemovableHandle.next_id
        RemovableHandle.next_id = key + 1
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
