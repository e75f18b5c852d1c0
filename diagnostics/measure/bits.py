"""Bit patterns of floating tensors: a checksum that replicas compare, and the flip that tests inject.

:func:`checksums` reduces a tensor to three int64 words: the sum of its elements' bit patterns
(read as signed integers of the element's width), the same sum weighted by each element's
position (1 + i mod 65521, so that two elements trading places change it), and the float64 sum
of squares of the values, its bits read as an int64 (a magnitude a report can show). Sums wrap
modulo 2^64, as int64 arithmetic does. One element whose bit pattern changes by d != 0 changes
the first word by d (mod 2^64), which is never 0 for |d| < 2^63: a single flipped bit is always
seen. Two tensors with equal words are equal except by a coincidence of both sums.

:func:`flip_exponent_bit` flips one exponent bit of one element: the silent corruption a replay
and the replica check are tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["checksums", "flip_exponent_bit", "EXPONENT_BITS", "INT_OF"]

#: the integer dtype of each float dtype's width
INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
          torch.float16: torch.int16}
#: (first exponent bit, number of exponent bits) of each float dtype
EXPONENT_BITS = {torch.float64: (52, 11), torch.float32: (23, 8), torch.bfloat16: (7, 8), torch.float16: (10, 5)}
_MOD = 65521  # the largest prime below 2^16: position weights 1..65521


@torch.no_grad()
def checksums(t: Tensor) -> Tensor:
    """(3,) int64 on t's device: sum of bit patterns, position-weighted sum, bits of the float64
    sum of squares (module docstring). A non-float tensor is read as its integer values."""
    x = t.detach().reshape(-1)
    bits = x.view(INT_OF[x.dtype]).long() if x.dtype in INT_OF else x.long()
    weights = torch.arange(x.numel(), device=x.device, dtype=torch.int64) % _MOD + 1
    square = x.double().pow(2).sum()
    return torch.stack([bits.sum(), (bits * weights).sum(), square.reshape(1).view(torch.int64)[0]])


@torch.no_grad()
def flip_exponent_bit(t: Tensor, index: int, bit: int) -> None:
    """Flip exponent bit ``bit`` (0 = the lowest) of element ``index`` of ``t`` (flattened), in place."""
    first, count = EXPONENT_BITS[t.dtype]
    if not 0 <= bit < count:
        raise ValueError(f"bit={bit}: must be in 0..{count - 1} for {t.dtype}; pass an exponent bit")
    ints = t.view(INT_OF[t.dtype]).reshape(-1)
    mask = torch.tensor(1, dtype=torch.int64).bitwise_left_shift(first + bit)
    ints[index] = ints[index] ^ mask.to(ints.dtype)
