"""How a model's (or a module's) output is read: the one rule for every job and the probe.

* A module's output stands for its first tensor: the output itself when it is a tensor, the
  first tensor of a tuple or list (a Hugging Face block returns ``(hidden, ...)``), else none.
* A model's output gives (logits, loss): a tensor of one or more dimensions is logits, a 0-d
  tensor a loss; a tuple or list is read as its first tensor; an object or mapping is read for
  its ``logits`` and ``loss`` (a Hugging Face ``ModelOutput``).

How a model is called before its output is read is :func:`call_model`'s rule, the one every job
uses: ``model(ids, targets=targets)`` for a forward with a ``targets`` parameter (nanoGPT's, whose
logits are otherwise the last position's only; :func:`takes_targets`), what ``inputs(ids)``
builds, else ``model(ids)``; every tensor it hands the model is contiguous (a user's forward may
``.view`` it, as nanoGPT's does its targets) (diagnostics/API.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

from torch import Tensor, nn

__all__ = ["first_tensor", "read_output", "takes_targets", "contiguous", "call_model"]


def takes_targets(model: nn.Module) -> bool:
    """Whether ``model.forward`` has a parameter named ``targets`` (nanoGPT's and minGPT's
    ``forward(idx, targets=None)``, which return ``(logits, loss)``; nanoGPT's logits are those of
    the last position only, ``(B, 1, V)``, unless targets are given)."""
    try:
        return "targets" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a builtin or an object without a readable signature
        return False


def contiguous(value):
    """``value`` with every tensor in it contiguous: a tensor, or a mapping (read back as a dict),
    tuple, named tuple or list of them (nested); anything else as it is. A contiguous tensor is
    returned itself (no copy)."""
    if isinstance(value, Tensor):
        return value.contiguous()
    if isinstance(value, Mapping):
        return {k: contiguous(v) for k, v in value.items()}
    if isinstance(value, tuple):
        items = [contiguous(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [contiguous(v) for v in value]
    return value


def call_model(model: nn.Module, ids: Tensor, targets: Tensor | None = None,
               inputs: Callable | None = None):
    """The model's output on token ids (B, T), every tensor handed to it contiguous.

    Without ``inputs``: ``model(ids, targets=targets)`` when ``targets`` is given and the model's
    forward takes ``targets`` (so that nanoGPT returns every position's logits), else
    ``model(ids)``. With ``inputs``: what ``inputs(ids)`` builds, a dict (``model(**d)``), a tuple
    (``model(*t)``) or one value (``model(x)``).
    """
    ids = ids.contiguous()
    if inputs is None:
        if targets is not None and takes_targets(model):
            return model(ids, targets=targets.contiguous())
        return model(ids)
    x = contiguous(inputs(ids))
    if isinstance(x, Mapping):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def first_tensor(output) -> Tensor | None:
    """``output`` if it is a tensor, else the first tensor of a tuple or list, else None."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for o in output:
            if isinstance(o, Tensor):
                return o
    return None


def read_output(output) -> tuple[Tensor | None, Tensor | None]:
    """(logits, loss) of a model's output, either None where the output holds none.

    Args:
        output: what the model returned: a tensor (0-d: a loss), a tuple or list (read as its
            first tensor), or an object or mapping with ``logits`` / ``loss``.
    Returns: (logits, loss), each a tensor or None.
    """
    if isinstance(output, Tensor):
        return (output, None) if output.dim() else (None, output)
    if isinstance(output, (tuple, list)):
        first = first_tensor(output)
        return read_output(first) if first is not None else (None, None)
    get = output.get if isinstance(output, Mapping) else (lambda k: getattr(output, k, None))
    logits, loss = get("logits"), get("loss")
    return (logits if isinstance(logits, Tensor) else None), (loss if isinstance(loss, Tensor) else None)
