"""Token data: CS336 token files, text as bytes, a built-in corpus, and batch sampling.

Formats read (never modified; memory-mapped, so a file larger than memory is read
window by window):
  ``.npy``  a 1-D integer array (``np.save``), loaded with ``allow_pickle=False``;
  ``.bin``  raw little-endian uint16 tokens, as CS336 writes them;
  ``.txt``  UTF-8 text tokenised as its bytes (ids 0..255; needs vocab_size >= 256).
The built-in corpus is the text of the Python standard library's own ``.py``
files, so training and measuring on real text works offline everywhere.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from tinylm.errors import TinyLMError
from tinylm.validate import file_error, refuse

__all__ = ["DataError", "load_tokens", "stdlib_corpus", "get_batch", "random_tokens", "check_vocab"]


class DataError(TinyLMError):
    """Token data that cannot be used; the message names the problem and the fix."""


def _check_path(path: Path) -> None:
    if not path.exists():
        file_error(path, "no such file", "check the path", error=DataError)
    if path.is_dir():
        file_error(path, "is a directory", "pass a .npy, .bin or .txt file", error=DataError)
    if not os.access(path, os.R_OK):
        file_error(path, "not readable (permission denied)", "fix its permissions", error=DataError)
    if path.stat().st_size == 0:
        file_error(path, "empty file", "pass a file with tokens in it", error=DataError)


def load_tokens(path: str | os.PathLike, vocab_size: int | None = None) -> np.ndarray:
    """A 1-D integer array of token ids from ``path`` (memory-mapped where the format allows).

    With ``vocab_size``, every id is checked to lie in [0, vocab_size).
    """
    path = Path(path)
    _check_path(path)
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:
            file_error(path, f"not a readable .npy array ({str(e).splitlines()[0][:100]})",
                       "write tokens with np.save(path, array)", error=DataError)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            found = ""
            if tokens.ndim == 1 and tokens.size and np.issubdtype(tokens.dtype, np.number):
                found = f" (values {tokens.min()} .. {tokens.max()})"
            file_error(path, f"holds a {tokens.ndim}-D {tokens.dtype} array{found}",
                       "tokens must be a 1-D integer array (np.save(path, ids.astype(np.int64)))", error=DataError)
    elif suffix == ".bin":
        if path.stat().st_size % 2:
            file_error(path, "odd byte count", "a .bin token file is raw uint16 (2 bytes per token)", error=DataError)
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    elif suffix == ".txt":
        tokens = np.memmap(path, dtype=np.uint8, mode="r")
        if vocab_size is not None and vocab_size < 256:
            file_error(path, f"text is tokenised as bytes (ids 0..255) but vocab_size={vocab_size}",
                       "use a model with vocab_size >= 256 or pre-tokenised .npy/.bin data", error=DataError)
    else:
        file_error(path, f"unknown suffix {path.suffix!r}", "use .npy, .bin (uint16) or .txt", error=DataError)
    if vocab_size is not None:
        check_vocab(tokens, vocab_size, str(path))
    return tokens


def check_vocab(tokens: np.ndarray, vocab_size: int, source: str = "tokens") -> None:
    if len(tokens) == 0:
        refuse(f"{source}: no tokens", error=DataError)
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        refuse(f"{source}: token id {bad} is outside the model's vocabulary [0, {vocab_size})",
               "the data was tokenised for another vocabulary", error=DataError)


def stdlib_corpus(max_bytes: int = 8_000_000) -> np.ndarray:
    """The bytes of the standard library's ``.py`` files (sorted by path, tests excluded), as uint8 ids."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel or any(part in ("test", "tests", "idlelib") for part in rel):
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        refuse(f"no .py files found under {root}", "use a token file instead (data=PATH)", error=DataError)
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def get_batch(tokens: np.ndarray, batch_size: int, context_length: int, generator: torch.Generator,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``context_length + 1`` tokens, as CS336's ``get_batch``.

    Returns (x, y), each (batch_size, context_length) int64 and contiguous (a model may ``.view``
    them), with y the next tokens of x.
    """
    n = len(tokens)
    if n < context_length + 1:
        refuse(f"{n} tokens are fewer than context_length + 1 = {context_length + 1}",
               "use more data or a shorter context_length=N", error=DataError, argument="context_length")
    starts = torch.randint(0, n - context_length, (batch_size,), generator=generator).tolist()
    window = np.stack([np.asarray(tokens[s:s + context_length + 1], dtype=np.int64) for s in starts])
    w = torch.from_numpy(window).to(device)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def random_tokens(vocab_size: int, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Uniform random token ids, (batch_size, seq_len) int64."""
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
