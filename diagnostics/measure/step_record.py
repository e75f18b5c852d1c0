"""What a replay measures of one execution of a user's step, and what it puts back between two.

:class:`StepRecorder` hooks the sites a diff pairs (:func:`diagnostics.jobs.fingerprint.diff_sites`)
and reduces each tensor, forward and backward, at once to the moments and the k x k sketch that
``diff`` keeps (:func:`diagnostics.jobs.fingerprint.sketch`), in the order the execution produced
them. Unlike a fingerprint it changes nothing about the model: no mode, no ``requires_grad``, no
``.grad``; the step runs as the user wrote it (training mode, dropout, their loss). A site met
more than once in one execution (micro-batches of gradient accumulation) is recorded each time,
its key given ``#n`` from the second on.

:class:`StepState` is what a step may change that the rerun must start from and the user must
get back: the parameters' ``.grad`` (moved aside, never copied unless the step accumulates into
gradients that were already there), the buffers a step wrote (running statistics), every
module's ``training`` flag and the random number generators (torch's CPU and CUDA ones, Python's
``random`` and NumPy's global one), so that a rerun draws the same dropout masks.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch
from torch import Tensor, nn

from .outputs import first_tensor, read_output

__all__ = ["hook_sites", "StepRecorder", "StepState", "Record", "rng_state", "set_rng_state"]

Record = tuple  # (key, base key, direction, moments (5,), sketch (k, k), dtype, shape)


def hook_sites(undo: contextlib.ExitStack, model: nn.Module, sites: list, stack, take, *, output: bool) -> None:
    """Hand each site's tensor to ``take(site, tensor)`` as the forward reaches it; every hook's
    removal goes on ``undo``. The stack's input site is read before its first block (a positional
    argument or ``hidden_states``); the ``logits`` site from the model's output where ``output``,
    else skipped (a caller that reads the logits itself); every other site from its module's output."""
    named = dict(model.named_modules())
    for site in sites:
        if site.key == "logits":
            if not output:
                continue
            h = model.register_forward_hook(lambda m, i, o, _s=site: take(_s, read_output(o)[0]))
        elif stack is not None and site.module == stack.input:
            def pre(module, args, kwargs, _s=site):
                t = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("hidden_states")
                take(_s, t)
            h = named[stack.names[0]].register_forward_pre_hook(pre, with_kwargs=True)
        else:
            h = named[site.module].register_forward_hook(lambda m, i, o, _s=site: take(_s, first_tensor(o)))
        undo.callback(h.remove)


class StepRecorder:
    """Hooks on ``sites`` (a list of :class:`diagnostics.jobs.fingerprint.Site`) of ``model``
    while :meth:`recording` is open; ``records`` in execution order (module docstring)."""

    def __init__(self, model: nn.Module, sites: list, stack, k: int, backward: bool, reduce, cache: dict):
        self.model, self.sites, self.stack, self.k = model, sites, stack, k
        self.backward, self.reduce = backward, reduce
        self.cache = cache  # the projections, shared by the executions of one replay
        self.records: list[Record] = []
        self.seen: dict[tuple[str, str], int] = {}

    def take(self, site, t: Tensor | None) -> None:
        if not isinstance(t, Tensor) or not t.is_floating_point():
            return
        self._reduce(site, "forward", t)
        if self.backward and t.requires_grad:
            t.register_hook(lambda g, _s=site: self._reduce(_s, "backward", g))

    def _reduce(self, site, direction: str, t: Tensor) -> None:
        n = self.seen.get((site.key, direction), 0)
        self.seen[(site.key, direction)] = n + 1
        key = site.key if n == 0 else f"{site.key}#{n}"
        moments, s = self.reduce(t, self.k, cache=self.cache)
        self.records.append((key, site, direction, moments, s, str(t.dtype).removeprefix("torch."), tuple(t.shape)))

    @contextlib.contextmanager
    def recording(self) -> Iterator["StepRecorder"]:
        """The hooks on for the ``with`` block, removed whatever happens."""
        with contextlib.ExitStack() as undo:
            hook_sites(undo, self.model, self.sites, self.stack, self.take, output=True)
            yield self

    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """(moments (n, 5), sketches (n, k, k)) of the records, moved to the host in one transfer each."""
        if not self.records:
            return np.zeros((0, 5)), np.zeros((0, self.k, self.k))
        moments = torch.stack([r[3] for r in self.records]).cpu().numpy()
        sketches = torch.stack([r[4] for r in self.records]).cpu().numpy()
        return moments, sketches


def _unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen, out = set(), []
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def set_rng_state(state: tuple) -> None:
    cpu, cuda, py, npy = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npy)


class StepState:
    """The state a step changes, taken before the first execution (module docstring).

    ``begin()`` before the first execution; ``between(rng)`` after it (keeps what it left and
    puts back what the rerun starts from); ``end()`` after the rerun (the first execution's
    state back, whatever the rerun did). ``first_grads`` holds the first execution's gradients."""

    def __init__(self, model: nn.Module, rng: bool):
        self.params = _unique_parameters(model)
        self.buffers = [b for b in model.buffers()]
        self.modules = list(model.modules())
        self.rng = rng

    def begin(self) -> None:
        grads = [p.grad for _, p in self.params]
        self.start_grads = [None if g is None else g.detach().clone() for g in grads]
        self.start_buffers = [b.detach().clone() for b in self.buffers]
        self.start_versions = [b._version for b in self.buffers]
        self.param_versions = [p._version for _, p in self.params]
        self.start_training = [m.training for m in self.modules]
        self.start_rng = rng_state() if self.rng else None

    def changed_parameters(self) -> list[str]:
        """The parameters the first execution wrote in place (a step must not: the optimizer steps after)."""
        return [n for (n, p), v in zip(self.params, self.param_versions) if p._version != v]

    @torch.no_grad()
    def between(self) -> None:
        self.first_grads = [p.grad for _, p in self.params]
        self.first_training = [m.training for m in self.modules]
        self.first_rng = rng_state() if self.rng else None
        self.written = [i for i, (b, v) in enumerate(zip(self.buffers, self.start_versions)) if b._version != v]
        self.first_buffers = {i: self.buffers[i].detach().clone() for i in self.written}
        for i in self.written:
            self.buffers[i].copy_(self.start_buffers[i])
        for (_, p), g in zip(self.params, self.start_grads):
            p.grad = g
        for m, flag in zip(self.modules, self.start_training):
            m.training = flag
        if self.start_rng is not None:
            set_rng_state(self.start_rng)

    @torch.no_grad()
    def end(self) -> None:
        for i, saved in self.first_buffers.items():
            self.buffers[i].copy_(saved)
        for (_, p), g in zip(self.params, self.first_grads):
            p.grad = g
        for m, flag in zip(self.modules, self.first_training):
            m.training = flag
        if self.first_rng is not None:
            set_rng_state(self.first_rng)
