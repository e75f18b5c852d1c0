"""Will a forward+backward pass fit in memory? Estimate before allocating.

The estimate counts what autograd keeps for the backward pass of a tinylm
``TransformerLM`` (float elements per token), calibrated on this implementation:

  logits              ~5 V    (logits, log-softmax, its exp, their gradients)
  per block           ~10 d + 3 d_ff + 4 H T   (projections, norms, FFN, the T x T scores/probs)
  parameters          3 P     (weights, gradients, one spare copy during the update;
                               P counts learned position embeddings, context_length x d)
  RoPE tables         2 L context_length d_k float32 (cos and sin buffers of every block)

The calibration against measured peak memory is in docs/model.md. ``check_fits``
multiplies by a safety factor of 1.5, so it errs on the side of refusing. Every size
a file or a flag gives is checked here before anything is allocated: the model's
tensors by ``check_model_fits`` (at building, and in ``tinylm.checkpoint.load`` before
the weights are placed), the pass at the measured sequence length by ``check_fits``.
"""

from __future__ import annotations

import os

import torch

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.validate import refuse

__all__ = ["MemoryLimitError", "estimate_bytes", "rope_bytes", "available_bytes", "check_fits", "model_bytes",
           "check_model_fits"]

SAFETY = 1.5
#: host memory of the Python objects of one TransformerBlock (its modules, parameter and buffer
#: objects), whatever its sizes: about 47 KiB measured for a block built on the meta device.
BLOCK_OBJECT_BYTES = 64 * 1024


class MemoryLimitError(TinyLMError):
    """The requested batch would need more memory than the machine has."""


def estimate_bytes(config: ModelConfig, batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32,
                   backward: bool = True) -> int:
    """Estimated peak bytes of one forward (+ backward) pass at (batch_size, seq_len):
    ``item * (per_token * B * T + 3 P) + rope`` (forward only: per_token / 3 and P), the terms
    of the module's docstring, ``rope`` the float32 RoPE tables (:func:`rope_bytes`)."""
    c = config
    item = torch.finfo(dtype).bits // 8
    per_token = 5 * c.vocab_size + c.num_layers * (10 * c.d_model + 3 * c.d_ff + 4 * c.num_heads * seq_len)
    if not backward:
        per_token //= 3
    params = _params(c)
    return int(item * (per_token * batch_size * seq_len + (3 if backward else 1) * params)) + rope_bytes(c)


def rope_bytes(config: ModelConfig) -> int:
    """Bytes of a RoPE model's cos and sin tables: float32 (context_length, d_k) each, in every block."""
    c = config
    return c.num_layers * 2 * c.context_length * (c.d_model // c.num_heads) * 4 if c.rope else 0


def _params(c: ModelConfig) -> int:
    """The exact parameter count of ``TransformerLM(c)``."""
    d, b = c.d_model, int(c.bias)
    norm = d * (1 + b * (c.norm_kind == "layer"))  # gain, and LayerNorm's bias
    norms = 0 if c.norm == "none" else 2 * norm
    final = norm if c.norm == "pre" else 0
    mats = 3 if c.ffn == "swiglu" else 2
    ffn = mats * d * c.d_ff + b * ((mats - 1) * c.d_ff + d)  # w1 (w3): d_ff biases each; w2: d
    attn = 4 * d * d + b * 4 * d
    if c.qk_norm != "none":  # q_norm and k_norm: a gain of d_k each (LayerNorm: and a bias)
        attn += 2 * c.head_dim * (2 if c.qk_norm == "layer" else 1)
    positions = c.context_length * d if c.positions == "learned" else 0
    return (c.vocab_size * d * (1 if c.tie_embeddings else 2) + positions + final
            + c.num_layers * (attn + ffn + norms))


def model_bytes(config: ModelConfig, dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(bytes of the model's tensors, bytes of its Python objects) for a ``TransformerLM(config)``.

    Tensors: every parameter at ``dtype`` (default float32) plus the RoPE tables, float32
    cos and sin of (context_length, d_k) in each block. Objects: BLOCK_OBJECT_BYTES
    per block, the part that a meta-device build costs too.
    """
    c = config
    item = torch.finfo(dtype or torch.float32).bits // 8
    return item * _params(c) + rope_bytes(c), c.num_layers * BLOCK_OBJECT_BYTES


def check_model_fits(config: ModelConfig, dtype: torch.dtype | None = None, device=None,
                     available: int | None = None) -> None:
    """Refuse, before anything is allocated, a model whose tensors (on the CPU) or whose objects
    (anywhere) would not fit in the host's available memory; the message gives the estimate."""
    tensors, objects = model_bytes(config, dtype)
    on_host = str(device if device is not None else "cpu").split(":")[0] == "cpu"
    need = objects + (tensors if on_host else 0)
    have = available_bytes() if available is None else available
    if need <= have:
        return
    gib = 2**30
    c = config
    refuse(f"a model with vocab_size={c.vocab_size}, context_length={c.context_length}, d_model={c.d_model}, "
           f"num_layers={c.num_layers}, d_ff={c.d_ff} would need about {need / gib:.3g} GiB but {have / gib:.3g} GiB "
           "is available", "check these sizes (a stored config or an override) and use a smaller model",
           error=MemoryLimitError, argument="config")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) reads as None


def _limits() -> list[int]:
    """What this process may still take under a cgroup (v2 or v1) or an address-space rlimit."""
    out = []
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and cap < 1 << 60:
            out.append(max(cap - (used or 0), 0))
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            out.append(max(soft - size, 0))
    except (ImportError, OSError, ValueError):
        pass
    return out


def available_bytes() -> int:
    """Memory this process can still take: the OS's MemAvailable (else the physical total), lowered
    by a container's cgroup limit or an address-space rlimit where one is set."""
    have = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if have is None:
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            have = 1 << 62  # unknown: do not refuse
    return min([have, *_limits()])


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
    hint = f"try batch_size={fits}" if fits else "use a shorter seq_len=N or a smaller model"
    refuse(f"batch {batch_size} x {seq_len} would need about {need / gib:.1f} GiB but {have / gib:.1f} GiB is available",
           hint, error=MemoryLimitError, argument="batch_size")
