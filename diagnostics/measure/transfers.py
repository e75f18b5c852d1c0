"""Count the device-to-host transfers a piece of code makes, on any device, the CPU included.

    with TransferCounter() as c:
        ...one training step...
    c.total, c.counts        # {"item": ..., "tolist": ..., "cpu": ..., "to_cpu": ...}
    c.syncs                  # those that read a tensor not on the CPU: each a sync there

A transfer to the host is a synchronisation on an accelerator: the host waits for every
kernel queued before it. On the CPU none of these moves anything, so the counter counts the
calls that would be one for a tensor on an accelerator:

* ``item``: every ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``
  and any comparison of a tensor used as a Python bool), seen by a ``TorchDispatchMode``;
* ``tolist``: every ``Tensor.tolist()`` call (not an operator: counted by wrapping the method);
* ``cpu``: every ``Tensor.cpu()`` call, on any device;
* ``to_cpu``: every ``aten._to_copy`` / ``aten.copy_`` whose source is not on the CPU and
  whose result is (``.to("cpu")``, ``.copy_`` into a host buffer); on a CPU-only run this
  is 0 by construction, so code that means to move a tensor to the host calls ``.cpu()``.

``Tensor.numpy()`` is not counted: it refuses a tensor that is not on the CPU, so it is
never a transfer. The counter is for tests and benchmarks; it patches two ``Tensor``
methods while it is active (restored on exit, whatever happens) and is not thread-safe.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TransferCounter"]


def _device_of(x) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counter, on_device: Counter):
        super().__init__()
        self.counts, self.on_device = counts, on_device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        if packet is torch.ops.aten._local_scalar_dense:
            self.counts["item"] += 1
            if args and _device_of(args[0]) is not None and args[0].device.type != "cpu":
                self.on_device["item"] += 1
        elif packet is torch.ops.aten._to_copy:
            src, dev = _device_of(args[0] if args else None), kwargs.get("device")
            if src is not None and src.type != "cpu" and dev is not None and torch.device(dev).type == "cpu":
                self.counts["to_cpu"] += 1
        elif packet is torch.ops.aten.copy_:
            dst, src = (_device_of(a) for a in (args + (None, None))[:2])
            if src is not None and dst is not None and src.type != "cpu" and dst.type == "cpu":
                self.counts["to_cpu"] += 1
        return func(*args, **kwargs)


class TransferCounter:
    """A context manager counting the host transfers inside (see the module docstring).

    Attributes:
        counts: a ``collections.Counter`` of "item", "tolist", "cpu" and "to_cpu" calls.
        on_device: the "item" calls among them that read a tensor not on the CPU.
    """

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.on_device: Counter = Counter()
        self._saved: dict[str, object] = {}
        self._mode: _Dispatch | None = None

    @property
    def total(self) -> int:
        """Every counted call: the transfers an accelerator would make."""
        return sum(self.counts.values())

    @property
    def syncs(self) -> int:
        """The transfers that synchronise an accelerator now: scalar reads of a tensor that is not
        on the CPU and copies from such a tensor to the CPU (on a CPU-only run: 0)."""
        return self.on_device["item"] + self.counts["to_cpu"]

    def _wrap(self, name: str):
        original = self._saved[name]
        counts = self.counts

        def method(t, *args, **kwargs):
            counts[name] += 1
            return original(t, *args, **kwargs)
        method.__name__ = name
        return method

    def __enter__(self) -> "TransferCounter":
        for name in ("tolist", "cpu"):
            self._saved[name] = getattr(torch.Tensor, name)
        for name in self._saved:
            setattr(torch.Tensor, name, self._wrap(name))
        self._mode = _Dispatch(self.counts, self.on_device)
        try:
            self._mode.__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}

    def __exit__(self, *exc) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
                self._mode = None
        finally:
            self._restore()
