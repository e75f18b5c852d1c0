"""What a pass dispatches: aten ops (each a kernel launch on a GPU) and host reads (each a sync there).

    with OpCount() as ops:
        loss = model(x).sum(); loss.backward()
    ops.total, ops.counts.most_common(5), ops.reads

On a CPU the arithmetic of a small model hides what a GPU pays per op, so the cost of the
probe is counted where it is deterministic: :class:`OpCount` is a ``TorchDispatchMode`` that
counts every aten op dispatched while it is on (views and in-place ops included; a
registered custom op counts once, whatever its kernel does inside), and a
``TorchFunctionMode`` beside it counts the host reads Python asks for (``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``float()``, ``int()``, ``bool()`` of a tensor) and
the scalar reads aten makes (``_local_scalar_dense``). ``paused()`` stops both counts for a
stretch (the tests pause over what they do not measure).

A ``torch.compile``'d function called directly while the mode is on runs eagerly, op by op
(dynamo does not trace under a dispatch mode), so its ops are counted one by one; inside a
custom op's kernel the mode is off and the compiled code runs as compiled.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCount", "HOST_READS"]

#: the tensor methods that bring values to the host
HOST_READS = frozenset(("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"))


class _Reads(TorchFunctionMode):
    def __init__(self, owner: "OpCount"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and self.owner.on:
            self.owner.reads[name] += 1
        return func(*args, **(kwargs or {}))


class OpCount(TorchDispatchMode):
    """Counts the aten ops (``counts``: {name: n}) and host reads (``reads``) dispatched while on."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.reads: Counter = Counter()
        self.on = True
        self._reads = _Reads(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            name = func.__name__
            self.counts[name] += 1
            if name.startswith("_local_scalar_dense"):
                self.reads["_local_scalar_dense"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is counted inside."""
        was, self.on = self.on, False
        try:
            yield
        finally:
            self.on = was

    @property
    def total(self) -> int:
        """Aten ops dispatched."""
        return sum(self.counts.values())

    @property
    def host_reads(self) -> int:
        """Host reads: the Python-level ones (``.item()``, ``.tolist()``, ...) and aten's scalar
        reads not already counted by one of them (``float(t)`` dispatches one of each)."""
        python = sum(v for k, v in self.reads.items() if k != "_local_scalar_dense")
        return max(python, self.reads["_local_scalar_dense"])
