"""How a model's (or a module's) output is read: the one rule for every job and the probe.

* A module's output stands for its first tensor: the output itself when it is a tensor, the
  first tensor of a tuple or list (a Hugging Face block returns ``(hidden, ...)``), else none.
* A model's output gives (logits, loss): a tensor of one or more dimensions is logits, a 0-d
  tensor a loss; a tuple or list is read as its first tensor; an object or mapping is read for
  its ``logits`` and ``loss`` (a Hugging Face ``ModelOutput``).

How a model is called before its output is read (``model(ids, targets=targets)`` for a forward
with a ``targets`` parameter, as nanoGPT's, whose logits are otherwise the last position's
only) is :func:`diagnostics.jobs.diagnose_sample.takes_targets`'s rule (diagnostics/API.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

__all__ = ["first_tensor", "read_output"]


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
