"""What a recorded watch step does beyond its probe, in a number of ops that does not grow with the model.

Every op is a kernel launch on a GPU, so a recorded step's own work is counted in dispatched
ops (:class:`diagnostics.measure.opcount.OpCount`), not only in seconds:

* :func:`copy_params`: the copies of the parameters taken before the optimizer step (the
  update ratios, the optimizer's figures and the first record's init drift read them), made
  by one ``torch._foreach_mul(params, 1)`` per device and dtype (usually one; a ``clone`` of
  each would dispatch two ops per parameter, ``detach`` and ``clone``). ``x * 1`` is ``x`` to the bit in
  IEEE arithmetic, signed zeros, infinities and NaN included; only a process that has turned
  on flush-to-zero (``torch.set_flush_denormal(True)``) would read a subnormal weight as 0
  there, as its optimizer step already does. Other tensors (DTensors, sparse or
  non-strided ones) are cloned one by one.
* :func:`host_values`: the record's entries for
  :func:`diagnostics.measure.distributed.exchange` with every tensor's values already on the
  host, packed by one ``cat`` and moved by one ``tolist`` (the transfer the exchange would
  make itself), so the exchange dispatches nothing per entry. In one process only: over a
  process group the entries go to the exchange as they are, which packs them on the
  collective's device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["copy_params", "host_values"]

_PLAIN = (Tensor, torch.nn.Parameter)


def _plain(t: Tensor) -> bool:
    return type(t) in _PLAIN and t.layout == torch.strided


@torch.no_grad()
def copy_params(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """{name: a copy of the parameter's values} in ``params``' order (see the module docstring):
    one dispatched op for the plain tensors of each device and dtype, a ``clone`` for each other one."""
    groups: dict[tuple, list[str]] = {}  # (device, dtype) -> names: one foreach launch each on a GPU
    for n, p in params.items():
        if _plain(p):
            groups.setdefault((p.device, p.dtype), []).append(n)
    copies = {}
    for names in groups.values():
        copies.update(zip(names, torch._foreach_mul([params[n] for n in names], 1)))
    return {n: copies[n] if n in copies else p.detach().clone() for n, p in params.items()}


@torch.no_grad()
def host_values(entries: list[tuple[str, str, Any]], group: Any = None) -> list[tuple[str, str, Any]]:
    """``entries`` (key, kind, vector) with each tensor vector replaced by its values as floats,
    every tensor moved in one transfer; as they are over a process group (``group`` not None),
    where none is a tensor, or where the tensors lie on more than one device."""
    tensors = [v for _, _, v in entries if isinstance(v, Tensor)]
    if group is not None or not tensors or len({t.device for t in tensors}) > 1:
        return entries
    flat = torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in tensors]).tolist()
    out, at = [], 0
    for key, kind, v in entries:
        if isinstance(v, Tensor):
            n = v.numel()
            v, at = flat[at:at + n], at + n
        out.append((key, kind, v))
    return out
