"""Streaming, mergeable statistics of tensors, reduced at once (no activation is kept).

A tensor is reduced inside the hook, under ``no_grad``, to a fixed float64 vector
(:data:`FIELDS`); vectors merge with Chan's pairwise update

    n = n_a + n_b,  delta = mean_b - mean_a,
    mean = mean_a + delta n_b / n,  M2 = M2_a + M2_b + delta^2 n_a n_b / n,

and by sums / maxima / minima for the rest, so a run's memory does not grow with
the number of batches and two runs merge into what one run over both gives (up
to float64 rounding). Hooks keep 0-d/1-D tensors (no ``.item()``); a run converts
all of them to Python floats once, when its statistics are read.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import accel

__all__ = [
    "FIELDS",
    "ATTN_FIELDS",
    "FP16_TINY",
    "FP16_MAX",
    "BF16_TINY",
    "BF16_MAX",
    "summarize",
    "summarize_attention",
    "summarize_probs",
    "summarize_cosine",
    "causal_mask",
    "merge_vectors",
    "merge_attention_vectors",
    "Moments",
    "AttnMoments",
    "ParamStats",
    "ProbeStats",
]

FP16_TINY = float(torch.finfo(torch.float16).tiny)   # 6.1035e-05, smallest normal
FP16_MAX = float(torch.finfo(torch.float16).max)     # 65504
BF16_TINY = float(torch.finfo(torch.bfloat16).tiny)  # 1.1755e-38
BF16_MAX = float(torch.finfo(torch.bfloat16).max)    # 3.3895e+38

#: Layout of a tensor summary vector (float64).
FIELDS = ("n_total", "count", "mean", "m2", "max_abs", "n_zero",
          "n_fp16_under", "n_fp16_over", "n_bf16_under", "n_bf16_over")
_I = {name: i for i, name in enumerate(FIELDS)}

#: Layout of an attention summary vector: rows (all query rows), entropy mean / M2 over
#: rows, min entropy over rows t >= 1, rows t >= 1, rows t >= 1 with max prob > 0.99.
ATTN_FIELDS = ("rows", "entropy_mean", "entropy_m2", "entropy_min", "rows_after_first", "rows_saturated")
SATURATED_PROB = 0.99


_ROW = 1024
_ONES: dict[tuple, Tensor] = {}


def _ones(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    key = (n, dtype, device)
    if key not in _ONES:
        _ONES[key] = torch.ones(n, dtype=dtype, device=device)
    return _ONES[key]


def _sums64(v: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """(sum v, sum v^2) of a flat finite tensor, as float64 0-d tensors.

    float32 data is summed in rows of 1024 (BLAS matrix-vector products, float32,
    relative error ~1e-7 per row) and the row sums are added in float64; float64
    data is summed in float64. float32 data is divided by ``scale`` (max |v|, float64 0-d)
    first so that no square overflows, and the sums are scaled back in float64.
    """
    if v.dtype == torch.float64:
        return v.sum(), torch.dot(v, v)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    v = v / scale.to(v.dtype)  # |v| <= 1: the squares cannot overflow float32
    k = v.numel() // _ROW
    main, tail = v[: k * _ROW].view(k, _ROW), v[k * _ROW:]
    s1 = (main @ _ones(_ROW, v.dtype, v.device)).double().sum() + tail.double().sum()
    s2 = torch.linalg.vecdot(main, main).double().sum() + tail.double().square().sum()
    return s1 * scale, s2 * scale * scale


def summarize(x: Tensor, valid: Tensor | None = None, fill: float | None = None) -> Tensor:
    """Reduce ``x`` (any shape, any float dtype) to a float64 vector laid out as :data:`FIELDS`.

    ``valid`` (bool, shape (T, T) = x's last two dimensions) selects the entries measured
    (the causal entries of attention); the others are ignored. Moments (count, mean,
    M2) are over the finite entries, accumulated in float64
    (fp16/bf16 data is first converted to float32, exactly). Counts are over all
    measured entries: exact zeros; non-finite; underflow = nonzero |x| below the
    smallest normal (fp16: 2^-14, bf16: 2^-126); overflow = finite |x| in or above the
    binade of the format's largest finite value, resolved to powers of two: fp16
    |x| >= 2^16 (65504 < |x| < 65536 is not counted), bf16 |x| >= 2^127 (which may
    round to bf16's 3.39e38 or overflow). Non-finite entries are counted apart.

    Two paths with these definitions: a CPU tensor of float32/bf16/fp16 with ``valid`` None
    or exactly the causal mask goes through :func:`diagnostics.accel.summary` (one compiled
    pass; masked entries never read); anything else through torch ops, where all counts come
    from one histogram of float32 exponents and M2 = sum x^2 - n mean^2.

    ``fill`` (torch path only): the value every entry outside ``valid`` is known to hold
    (0 or -inf, as for causal attention probabilities and scores); the entries are then left
    in place and their known share taken out of the counts, which saves a masking pass.
    """
    return as_tensor(reduce(x, valid, fill))


def reduce(x: Tensor, valid: Tensor | None = None, fill: float | None = None) -> np.ndarray | Tensor:
    """:func:`summarize`'s vector as its path produces it: a numpy array on the compiled path
    (no conversion), a tensor on ``x``'s device on the torch path (no device sync). For callers
    that keep many vectors and convert them once (a probe); :func:`merge_vectors` takes either.
    (The compiled path reads ``x`` at its pointer, outside autograd: no detached copy of the
    tensor object for it, one less allocation per hook.)"""
    if _fusable(x):
        if valid is None:
            return accel.summary(x)
        if _is_causal(valid, x):
            return accel.summary(x, x.shape[-1])
    return _summarize_torch(x.detach(), valid, fill)


def as_tensor(v: np.ndarray | Tensor) -> Tensor:
    """A vector of :func:`reduce` (or the like) as a tensor (a numpy array's memory is shared)."""
    return torch.from_numpy(v) if isinstance(v, np.ndarray) else v


def row_mean_square(x: Tensor) -> Tensor:
    """mean(x^2) over the last dimension, float32 at least (a norm: no squared copy of ``x``)."""
    x = x.detach()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    return torch.linalg.vector_norm(x, dim=-1).square() / x.shape[-1]


def summarize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """(:func:`summarize` of ``x``, :func:`row_mean_square` of ``x``): on the fused path both
    from one read (the mean squares summed in float64, returned as float32)."""
    vec, ms, _ = reduce_rows(x)
    return as_tensor(vec), ms


def reduce_rows(x: Tensor, cosine: bool = False
                ) -> tuple[np.ndarray | Tensor, Tensor, np.ndarray | Tensor | None]:
    """:func:`summarize_rows` with the summary as :func:`reduce` gives it, and, when ``cosine``,
    :func:`summarize_cosine` of ``x`` (else None): on the fused path from the rows just read,
    the sum of unit vectors kept in float64."""
    if _fusable(x) and x.shape[-1] > 0:
        vec, rowsq, cos = accel.summary_rows(x, cosine)
        return vec, torch.from_numpy(rowsq / x.shape[-1]).float(), cos
    x = x.detach()
    ms = row_mean_square(x)
    return reduce(x), ms, summarize_cosine(x, ms) if cosine else None


def _summarize_torch(x: Tensor, valid: Tensor | None, fill: float | None) -> Tensor:
    """:func:`summarize` with torch ops (any device and dtype)."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    n_masked = 0
    masked_inf = 0  # masked entries left in place as -inf (counted non-finite, not zero)
    if valid is not None:
        T = valid.shape[-1]
        n_masked = (x.numel() // (T * T)) * (T * (T - 1) // 2)
        if fill is not None and fill == -math.inf:
            masked_inf = n_masked
        elif fill is None or fill != 0:
            x = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    flat = x.reshape(-1)
    numel = flat.numel()
    dev = flat.device
    if numel == 0:
        return torch.zeros(len(FIELDS), dtype=torch.float64, device=dev)
    n_total = float(numel - n_masked)
    f32 = flat if flat.dtype == torch.float32 else flat.float()
    # float32 exponent field: shift the bits right by 23; the cast to uint8 keeps the low 8 bits (drops the sign)
    expo = torch.bitwise_right_shift(f32.view(torch.int32), 23).to(torch.uint8)
    counts = _selector(dev) @ torch.bincount(expo, minlength=256).double()  # nf, <2^-14, >=2^16, subnormal/0, >=2^127
    nz = torch.count_nonzero(flat).double()  # NaN counts as nonzero
    if flat.dtype == torch.float64:  # the float32 exponent misjudges float64 extremes as non-finite
        counts = torch.cat([(numel - torch.count_nonzero(torch.isfinite(flat))).double().reshape(1), counts[1:]])
    clean = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = torch.aminmax(clean)
    max_abs = torch.maximum(-lo, hi).double()
    if flat.dtype == torch.float64 or numel <= _SMALL:
        c64 = clean.double()
        s1, s2 = c64.sum(), torch.dot(c64, c64)
    else:
        s1, s2 = _sums64(clean, max_abs)
    n = (n_total + masked_inf - counts[0]).clamp(min=1.0)
    mean = s1 / n
    m2 = (s2 - s1 * mean).clamp(min=0.0)
    raw = torch.cat([counts, torch.stack([nz, mean, m2, max_abs])])
    const = torch.tensor([n_total, n_total + masked_inf, 0.0, 0.0, 0.0, numel - n_masked + masked_inf, -numel, 0.0,
                          -numel, 0.0], dtype=torch.float64, device=dev)
    return const + _assemble(dev) @ raw


def _fusable(x: Tensor) -> bool:
    """Whether :mod:`diagnostics.measure.accel` reduces ``x`` (CPU, 16/32-bit float, numba present).
    (Attribute reads only: this runs for every tensor a hook reduces, when the interpreter is
    out of the caches; ``x.device`` builds an object.)"""
    return x.is_cpu and x.dtype in accel.DTYPES and x.ndim > 0 and accel.available()


_TRIL: dict[tuple[int, torch.device], Tensor] = {}


def causal_mask(T: int, device: torch.device | str = "cpu") -> Tensor:
    """The (T, T) lower-triangular bool mask of causal attention (cached; do not modify)."""
    key = (T, torch.device(device))
    if key not in _TRIL:
        _TRIL[key] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return _TRIL[key]


def _is_causal(valid: Tensor, x: Tensor) -> bool:
    """True when ``valid`` is exactly the causal mask of x's last two (square) dimensions."""
    T = valid.shape[-1]
    if valid.dim() != 2 or valid.shape[0] != T or x.dim() < 2 or x.shape[-2:] != (T, T):
        return False
    mask = causal_mask(T, valid.device)
    return valid is mask or bool(torch.equal(valid, mask))


_SMALL = 1 << 16
_SEL: dict[torch.device, Tensor] = {}
_ASM: dict[torch.device, Tensor] = {}


def _selector(dev: torch.device) -> Tensor:
    """(5, 256) 0/1 rows over float32 exponents: 255 (inf/NaN), < 113 (|x| < 2^-14), 143..254
    (finite |x| >= 2^16), 0 (zero or subnormal: |x| < 2^-126), 254 (finite |x| >= 2^127)."""
    if dev not in _SEL:
        sel = torch.zeros(5, 256, dtype=torch.float64)
        sel[0, 255] = 1
        sel[1, :113] = 1
        sel[2, 143:255] = 1
        sel[3, 0] = 1
        sel[4, 254] = 1
        _SEL[dev] = sel.to(dev)
    return _SEL[dev]


def _assemble(dev: torch.device) -> Tensor:
    """(10, 9) map from raw = (nf, c113, c143, c0, c254, nonzero, mean, m2, max_abs) to FIELDS
    (plus the constant vector built in summarize):
    count = n_total - nf; n_zero = numel - n_masked - nonzero; fp16 underflow = c113 - zeros
    - masked = c113 + nonzero - numel; bf16 underflow = c0 + nonzero - numel."""
    if dev not in _ASM:
        a = torch.zeros(10, 9, dtype=torch.float64)
        a[1, 0] = -1          # count
        a[2, 6] = 1           # mean
        a[3, 7] = 1           # m2
        a[4, 8] = 1           # max_abs
        a[5, 5] = -1          # n_zero
        a[6, 1], a[6, 5] = 1, 1   # fp16 underflow
        a[7, 2] = 1           # fp16 overflow
        a[8, 3], a[8, 5] = 1, 1   # bf16 underflow
        a[9, 4] = 1           # bf16 overflow
        _ASM[dev] = a.to(dev)
    return _ASM[dev]


def _chan(na: Tensor, ma: Tensor, m2a: Tensor, nb: Tensor, mb: Tensor, m2b: Tensor) -> tuple[Tensor, Tensor]:
    n = na + nb
    safe = torch.where(n > 0, n, torch.ones_like(n))
    delta = mb - ma
    mean = torch.where(n > 0, ma + delta * nb / safe, torch.zeros_like(ma))
    m2 = m2a + m2b + delta * delta * na * nb / safe
    return mean, m2


def _merge(a: np.ndarray | Tensor, b: np.ndarray | Tensor, n: int, ext: int, largest: bool) -> np.ndarray | Tensor:
    """Merge two summary vectors: (count, mean, M2) at n, n+1, n+2 by Chan's rule, the larger
    (``largest``) or smaller at ``ext``, and a sum everywhere else. Two numpy arrays (the
    compiled path) merge in numpy; otherwise in torch, on the tensor's device."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        out = a + b
        na, nb = a[n], b[n]
        total = na + nb
        delta = b[n + 1] - a[n + 1]
        out[n + 1] = a[n + 1] + delta * nb / total if total > 0 else 0.0
        out[n + 2] = a[n + 2] + b[n + 2] + (delta * delta * na * nb / total if total > 0 else 0.0)
        out[ext] = (np.maximum if largest else np.minimum)(a[ext], b[ext])
        return out
    a = torch.from_numpy(a).to(b.device) if isinstance(a, np.ndarray) else a
    b = torch.from_numpy(b).to(a.device) if isinstance(b, np.ndarray) else b
    mean, m2 = _chan(a[n], a[n + 1], a[n + 2], b[n], b[n + 1], b[n + 2])
    out = a + b
    out[n + 1] = mean
    out[n + 2] = m2
    out[ext] = (torch.maximum if largest else torch.minimum)(a[ext], b[ext])
    return out


@torch.no_grad()
def merge_vectors(a: np.ndarray | Tensor, b: np.ndarray | Tensor) -> np.ndarray | Tensor:
    """Merge two :func:`summarize` (or :func:`reduce`) vectors (Chan for mean/M2, max for max|x|,
    sums for the rest); a numpy array when both are."""
    return _merge(a, b, 1, 4, True)


@torch.no_grad()
def summarize_attention(probs: Tensor) -> Tensor:
    """Attention panel of probabilities ``probs`` (..., T, T) (rows sum to 1), laid out as ATTN_FIELDS.

    Entropy of row t is H_t = -sum_j p_tj ln p_tj (0 ln 0 = 0). The first query row of
    causal attention has one key and is always saturated, so the minimum entropy and
    the saturated fraction (max_j p_tj > 0.99) are taken over rows t >= 1. Entries above
    the diagonal are taken to be 0, as causal masking makes them: on the CPU
    (:func:`summarize_probs`) they are not read at all.
    """
    p = probs.detach()
    if p.dim() >= 2 and p.shape[-1] == p.shape[-2] and _fusable(p):
        return summarize_probs(p)[1]
    return _attention_torch(p)


def summarize_probs(probs: Tensor, fill: float | None = None) -> tuple[Tensor, Tensor]:
    """(:func:`summarize` of square ``probs`` over the causal entries, :func:`summarize_attention`),
    from one read of each row when the fused path takes ``probs``; ``fill`` as for summarize."""
    vec, panel = reduce_probs(probs, fill)
    return as_tensor(vec), as_tensor(panel)


def reduce_probs(probs: Tensor, fill: float | None = None) -> tuple[np.ndarray | Tensor, np.ndarray | Tensor]:
    """:func:`summarize_probs` with both vectors as :func:`reduce` gives them."""
    p = probs.detach()
    if p.dim() >= 2 and p.shape[-1] == p.shape[-2] and _fusable(p):
        v = accel.summary(p, p.shape[-1], probs=True)
        return v[:len(FIELDS)], v[len(FIELDS):]
    valid = causal_mask(p.shape[-1], p.device) if p.dim() >= 2 and p.shape[-1] == p.shape[-2] else None
    return reduce(p, valid, fill), _attention_torch(p)


@torch.no_grad()
def _attention_torch(p: Tensor) -> Tensor:
    dev = p.device
    if p.dtype not in (torch.float32, torch.float64):
        p = p.float()
    ent = torch.special.entr(p).sum(-1, dtype=torch.float64)  # (..., T)
    rowmax = p[..., 1:, :].amax(-1) if p.dim() >= 2 else p.new_zeros(0)
    rows = float(ent.numel())
    var, mean = torch.var_mean(ent, correction=0)
    later = ent[..., 1:]
    if later.numel():
        ent_min = later.amin()
        sat = (rowmax > SATURATED_PROB).sum().double()
    else:
        ent_min = torch.tensor(math.inf, dtype=torch.float64, device=dev)
        sat = torch.zeros((), dtype=torch.float64, device=dev)
    return torch.stack([torch.tensor(rows, dtype=torch.float64, device=dev), mean, var * rows, ent_min,
                        torch.tensor(float(later.numel()), dtype=torch.float64, device=dev), sat])


@torch.no_grad()
def merge_attention_vectors(a: np.ndarray | Tensor, b: np.ndarray | Tensor) -> np.ndarray | Tensor:
    """Merge two :func:`summarize_attention` vectors (Chan for the entropy, min for its minimum)."""
    return _merge(a, b, 0, 3, False)


@torch.no_grad()
def summarize_cosine(x: Tensor, ms: Tensor | None = None) -> Tensor:
    """Per-sequence mean cosine similarity between different tokens, as a summary vector.

    For x (B, T, d) with unit vectors u_t = x_t/|x_t|: |sum_t u_t|^2 = T + sum_{s != t} cos(x_s, x_t),
    so the mean over the T(T-1) ordered pairs is (|sum_t u_t|^2 - T) / (T (T-1)). The B
    per-sequence values (float32) are summarised like any tensor (count B). ``ms``: each token's
    mean(x_t^2), when the caller has it (|x_t| = sqrt(d ms)).
    """
    x = x.detach()
    if x.dim() < 2 or x.shape[-2] < 2:
        return summarize(torch.zeros(0, dtype=torch.float64))
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    T = x.shape[-2]
    # sum_t u_t as one (1, T) x (T, d) product per sequence (no normalised copy of x); the
    # float32 rounding of that sum moves a cosine by ~1e-7 / T
    norm = torch.linalg.vector_norm(x, dim=-1) if ms is None else (ms * x.shape[-1]).sqrt()
    inv = 1.0 / norm.unsqueeze(-1).clamp(min=torch.finfo(x.dtype).tiny)
    s = (inv.transpose(-1, -2) @ x).squeeze(-2).double()  # (..., d)
    cos = ((s * s).sum(-1) - T) / (T * (T - 1))
    # the B cosines as float32 (rounding 6e-8, far below any spread that matters): a float64
    # tensor takes the torch path, 0.5 ms for four numbers
    return summarize(cos.reshape(-1).float())


def _vec_to_dict(v: list[float], names: tuple[str, ...]) -> dict[str, float]:
    return dict(zip(names, v))


@dataclass
class Moments:
    """Merged statistics of one tensor (see :data:`FIELDS`); plain Python floats.

    var = m2 / count (population variance of the finite entries);
    mean_square = var + mean^2; fractions are over all measured entries.
    """

    n_total: float = 0.0
    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0
    max_abs: float = 0.0
    n_zero: float = 0.0
    n_fp16_under: float = 0.0
    n_fp16_over: float = 0.0
    n_bf16_under: float = 0.0
    n_bf16_over: float = 0.0

    @classmethod
    def from_vector(cls, v: list[float]) -> "Moments":
        return cls(**_vec_to_dict(v, FIELDS))

    def vector(self) -> list[float]:
        return [getattr(self, f) for f in FIELDS]

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count else math.nan

    @property
    def std(self) -> float:
        return math.sqrt(self.var) if self.count else math.nan

    @property
    def mean_square(self) -> float:
        return self.var + self.mean**2 if self.count else math.nan

    def _frac(self, n: float) -> float:
        return n / self.n_total if self.n_total else 0.0

    @property
    def frac_zero(self) -> float:
        return self._frac(self.n_zero)

    @property
    def frac_nonfinite(self) -> float:
        return self._frac(self.n_total - self.count)

    @property
    def frac_fp16_underflow(self) -> float:
        return self._frac(self.n_fp16_under)

    @property
    def frac_fp16_overflow(self) -> float:
        return self._frac(self.n_fp16_over)

    @property
    def frac_bf16_underflow(self) -> float:
        return self._frac(self.n_bf16_under)

    @property
    def frac_bf16_overflow(self) -> float:
        return self._frac(self.n_bf16_over)

    def merge(self, other: "Moments") -> "Moments":
        """Chan's merge (a new object; neither input changes)."""
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * other.count / n if n else 0.0
        m2 = self.m2 + other.m2 + (delta * delta * self.count * other.count / n if n else 0.0)
        out = Moments(*[a + b for a, b in zip(self.vector(), other.vector())])
        out.mean, out.m2, out.max_abs = mean, m2, max(self.max_abs, other.max_abs)
        return out


@dataclass
class AttnMoments:
    """Merged attention panel of one probs Tap (see :data:`ATTN_FIELDS`)."""

    rows: float = 0.0
    entropy_mean: float = 0.0
    entropy_m2: float = 0.0
    entropy_min: float = math.inf
    rows_after_first: float = 0.0
    rows_saturated: float = 0.0

    @classmethod
    def from_vector(cls, v: list[float]) -> "AttnMoments":
        return cls(**_vec_to_dict(v, ATTN_FIELDS))

    def vector(self) -> list[float]:
        return [getattr(self, f) for f in ATTN_FIELDS]

    @property
    def saturated_frac(self) -> float:
        return self.rows_saturated / self.rows_after_first if self.rows_after_first else 0.0

    def merge(self, other: "AttnMoments") -> "AttnMoments":
        n = self.rows + other.rows
        delta = other.entropy_mean - self.entropy_mean
        out = AttnMoments(*[a + b for a, b in zip(self.vector(), other.vector())])
        out.entropy_mean = self.entropy_mean + delta * other.rows / n if n else 0.0
        out.entropy_m2 = self.entropy_m2 + other.entropy_m2 + (delta * delta * self.rows * other.rows / n if n else 0.0)
        out.entropy_min = min(self.entropy_min, other.entropy_min)
        return out


@dataclass
class ParamStats:
    """One parameter at the end of a run.

    std, grad_std: population std of the entries / of the gradient the run produced
    (None: no gradient). declared_std: of its init scheme (None: unknown);
    drift = std / declared_std. spectral_norm = largest singular value; stable_rank =
    ||W||_F^2 / ||W||_2^2 (2-D parameters, when asked). frac_nonfinite of the entries.
    """

    shape: tuple[int, ...]
    std: float
    grad_std: float | None
    frac_nonfinite: float
    grad_frac_nonfinite: float | None = None
    declared_std: float | None = None
    declared: str = ""
    spectral_norm: float | None = None
    stable_rank: float | None = None

    @property
    def drift(self) -> float | None:
        if self.declared_std is None or self.declared_std == 0 or not math.isfinite(self.std):
            return None
        return self.std / self.declared_std


@dataclass
class ProbeStats:
    """What a probe measured: merged moments per (tensor name, direction), and more.

    tensors: {(name, "forward"|"backward"): Moments}. kinds: {name: kind}. order: names
    in the order their forward outputs first appeared. attention: {probs Tap name:
    AttnMoments}. cosine: {residual point name: Moments of per-sequence cosine}.
    params: {parameter name: ParamStats} (the model at the end of the first run merged).
    steps: forward passes measured. inv_ms: {stream point: Moments of 1/(mean_i x_i^2 + eps)
    per token} at the residual points a norm reads. norm_back: {RMSNorm name: Moments over
    tokens of mean_i(g_y,i^2) / (mean_i x_i^2 + eps)}, the per-token product RMSNorm's
    backward scales by (g_y: gradient at the norm's output, x: its input).
    """

    tensors: dict[tuple[str, str], Moments] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    attention: dict[str, AttnMoments] = field(default_factory=dict)
    cosine: dict[str, Moments] = field(default_factory=dict)
    params: dict[str, ParamStats] = field(default_factory=dict)
    steps: int = 0
    inv_ms: dict[str, Moments] = field(default_factory=dict)
    norm_back: dict[str, Moments] = field(default_factory=dict)

    def merge(self, other: "ProbeStats") -> "ProbeStats":
        """A new ProbeStats over both runs (moments merged; params kept from ``self`` when present)."""
        def both(a: dict, b: dict) -> dict:
            out = dict(a)
            for k, v in b.items():
                out[k] = out[k].merge(v) if k in out else v
            return out

        order = list(self.order) + [n for n in other.order if n not in set(self.order)]
        return ProbeStats(
            tensors=both(self.tensors, other.tensors), kinds={**other.kinds, **self.kinds}, order=order,
            attention=both(self.attention, other.attention), cosine=both(self.cosine, other.cosine),
            params=dict(self.params) if self.params else dict(other.params), steps=self.steps + other.steps,
            inv_ms=both(self.inv_ms, other.inv_ms), norm_back=both(self.norm_back, other.norm_back),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible dict (infinite floats kept as Python floats: use json allow_nan)."""
        return {
            "tensors": [[name, d, m.vector()] for (name, d), m in self.tensors.items()],
            "kinds": dict(self.kinds),
            "order": list(self.order),
            "attention": {k: v.vector() for k, v in self.attention.items()},
            "cosine": {k: v.vector() for k, v in self.cosine.items()},
            "params": {k: {**asdict(v), "shape": list(v.shape)} for k, v in self.params.items()},
            "steps": self.steps,
            "inv_ms": {k: v.vector() for k, v in self.inv_ms.items()},
            "norm_back": {k: v.vector() for k, v in self.norm_back.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProbeStats":
        return cls(
            tensors={(name, direction): Moments.from_vector(v) for name, direction, v in d["tensors"]},
            kinds=dict(d["kinds"]),
            order=list(d["order"]),
            attention={k: AttnMoments.from_vector(v) for k, v in d["attention"].items()},
            cosine={k: Moments.from_vector(v) for k, v in d["cosine"].items()},
            params={k: ParamStats(**{**v, "shape": tuple(v["shape"])}) for k, v in d["params"].items()},
            steps=int(d["steps"]),
            inv_ms={k: Moments.from_vector(v) for k, v in d.get("inv_ms", {}).items()},
            norm_back={k: Moments.from_vector(v) for k, v in d.get("norm_back", {}).items()},
        )
