"""What a probe leaves as it found it: each module's ``training``, each parameter's
``requires_grad`` and ``.grad`` (the same tensor object, its values restored), and each
gradient's share of the probed pass (:meth:`ModelState.grad_deltas`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ModelState"]

_SETATTR = nn.Module.__setattr__


class ModelState:
    """What a probe must leave as it found it: every module's ``training``, every parameter's
    ``requires_grad`` and ``.grad`` (the same tensor object, its values restored)."""

    def __init__(self, model: nn.Module, named: dict[str, nn.Module], params: list[tuple[str, nn.Parameter]]):
        self.model = model
        self.training = {m: m.training for m in named.values()}
        entry = params  # list(model.named_parameters()), from the probe's one walk
        self.requires = {n: p.requires_grad for n, p in entry}
        self.grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in entry}
        self.grad_objs = {n: p.grad for n, p in entry}
        self._now: list[tuple[str, nn.Parameter]] | None = None

    def now(self) -> list[tuple[str, nn.Parameter]]:
        """The model's named parameters as they are on exit (a parameter may have been replaced),
        walked once for everything the exit does."""
        if self._now is None:
            self._now = list(self.model.named_parameters())
        return self._now

    def eval(self) -> None:
        """``model.eval()``: each module's ``training`` set False directly where no module
        overrides ``train`` or ``__setattr__`` (what ``eval`` does, without a call per module),
        else ``model.eval()`` itself."""
        if not any(self.training.values()):
            return
        if all(type(m).train is nn.Module.train and type(m).__setattr__ is _SETATTR for m in self.training):
            for m in self.training:
                object.__setattr__(m, "training", False)
        else:
            self.model.eval()

    def grad_deltas(self, params: dict[str, Tensor]) -> dict[str, Tensor | None]:
        """Each parameter's gradient less what it held when the probe began (this pass's share)."""
        out = {}
        for n, p in params.items():
            g, before = p.grad, self.grads.get(n)
            out[n] = g if (g is None or before is None) else g.detach() - before
        return out

    def restore(self, grads: bool) -> None:
        params = dict(self.now())
        for m, flag in self.training.items():
            if m.training is not flag:  # a write through Module.__setattr__ costs more than the check
                if type(m).__setattr__ is _SETATTR:
                    object.__setattr__(m, "training", flag)  # what Module.__setattr__ does with a bool
                else:
                    m.training = flag
        for n, flag in self.requires.items():
            p = params[n]
            if p.requires_grad is not flag:
                p.requires_grad_(flag)
        if grads:
            for n, p in params.items():
                saved = self.grads.get(n)
                if saved is None:
                    if p.grad is not None:
                        p.grad = None
                else:
                    obj = self.grad_objs[n]
                    with torch.no_grad():
                        obj.copy_(saved)
                    p.grad = obj
