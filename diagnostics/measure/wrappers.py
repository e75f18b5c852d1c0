"""The module a wrapped model runs, and the eager stance a measurement runs in.

Two wrappers put a model one attribute away from the module that holds its parameters:
``torch.compile`` (an ``OptimizedModule``, the module at ``_orig_mod``) and
``DistributedDataParallel`` (the module at ``.module``), in either order. :func:`unwrap`
goes through both, so a job measures and names the sites of the module itself
(``layers.0``, never ``_orig_mod.layers.0`` or ``module.layers.0``).

A compiled graph does not see hooks added after it was built (Dynamo does not guard on
them), and tracing the probe's hooks into a graph would break it many times over. So
whatever is measured runs eagerly: inside :func:`eager`, every ``torch.compile``'d
function and module runs its Python as written (``torch.compiler.set_stance("force_eager")``),
with the same parameters; outside it the compiled graphs run as they were built, and
nothing is compiled again.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["unwrap", "is_compiled", "is_data_parallel", "eager", "default_stance"]


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper (an ``OptimizedModule`` holding ``_orig_mod``)."""
    return type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module)


def is_data_parallel(model: nn.Module) -> bool:
    """Whether ``model`` is a ``torch.nn.parallel.DistributedDataParallel`` wrapper."""
    return isinstance(model, nn.parallel.DistributedDataParallel)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside any ``torch.compile`` and ``DistributedDataParallel`` wrappers (``model``
    itself when it is neither); its parameters are the wrapper's, the same objects."""
    while True:
        if is_compiled(model):
            model = model._orig_mod
        elif is_data_parallel(model):
            model = model.module
        else:
            return model


def _stance(name: str):
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    return set_stance(name) if set_stance is not None else contextlib.nullcontext()


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Every compiled function and module runs eagerly inside (none is compiled or recompiled)."""
    with _stance("force_eager"):
        yield


class _Default:
    """``torch.compiler.set_stance("default")`` as a context, without building the stance and its
    decorator object per entry: what ``set_stance`` does on enter and exit (dynamo's
    ``_set_stance``, to one ``DynamoStance`` made once, and back to the one before), in about a
    tenth of its time (a probe's reductions enter it once per compiled call)."""

    __slots__ = ("_set", "_to", "_prior")

    def __init__(self, set_, to):
        self._set, self._to, self._prior = set_, to, None

    def __enter__(self) -> None:
        self._prior = self._set(self._to)

    def __exit__(self, *exc) -> None:
        self._set(self._prior)


def _default_parts():
    try:
        from torch._dynamo.eval_frame import DynamoStance, _set_stance
        return _set_stance, DynamoStance("default")
    except (ImportError, TypeError):  # another torch: its public switch
        return None


_DEFAULT = _default_parts()


def default_stance():
    """A context in which ``torch.compile`` compiles again (inside :func:`eager`: the probe's own
    compiled reductions run compiled, while the model around them runs eagerly)."""
    return _Default(*_DEFAULT) if _DEFAULT is not None else _stance("default")
