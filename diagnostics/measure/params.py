"""Parameter statistics a probe takes on exit: each parameter's and gradient's spread and
non-finite share (one reduction per tensor), its declared std, and on request its spectral
figures (largest singular value and stable rank, from a Gram matrix)."""

from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor, nn

import tinylm
from tinylm.init import declare

from . import reduction, sharded
from .moments import ParamStats
from .reducer import reduce

__all__ = ["param_stats", "spectral_stats", "spectral_many", "STACK"]


@torch.no_grad()
def spectral_stats(w: Tensor) -> tuple[float, float]:
    """(sigma_max(W), stable rank ||W||_F^2 / sigma_max^2) of a matrix: :func:`spectral_many` of one."""
    return spectral_many([w])[0]


#: entries of the matrices stacked into one batched Gram product at most (a group of one shape
#: is cut into stacks of this size: the stack is a copy)
STACK = 1 << 24


@torch.no_grad()
def spectral_many(ws: list[Tensor]) -> list[tuple[float, float]]:
    """(sigma_max(W), stable rank ||W||_F^2 / sigma_max^2) of each matrix, from its Gram matrix,
    with one transfer to the host for all of them (on a GPU each host read is a sync: one for
    the list, not three per matrix).

    The eigenvalues of G = W^T W (or W W^T, whichever is k x k with k = min(m, n)) are the
    squared singular values, so sigma_max^2 = lambda_max(G) and ||W||_F^2 = trace(G). One
    GEMM (in float32, at least) and a k x k ``eigvalsh`` in float64 replace a full SVD (a k x k
    eigenproblem instead of an m x n decomposition), agreeing with float64 ``svdvals`` to about
    7 digits. The Gram product's rounding (about sqrt(max(m, n)) ulp) stays far below what a
    diagnosis reads. Each W is first divided by the power of two at or below its largest
    |entry| (exact: the figures are those of W itself, multiplied back), so the Gram product
    neither overflows nor underflows in float32 and weights of any finite scale get their
    figures. Matrices of one shape, dtype and device go through one batched product and one
    batched ``eigvalsh`` (:data:`STACK` entries at most per batch).

    A figure that cannot be computed (non-finite weights, an eigensolver that does not converge)
    is NaN, never an error: the rest of the measurement stands.
    """
    groups: dict = {}
    for i, w in enumerate(ws):
        groups.setdefault((tuple(w.shape), w.dtype, w.device), []).append(i)
    order, parts = [], []
    for (shape, _, _), idx in groups.items():
        per = max(1, STACK // max(1, shape[0] * shape[1]))
        for c in range(0, len(idx), per):
            chunk = idx[c:c + per]
            order += chunk
            parts.append(_spectral_rows(torch.stack([ws[i].detach() for i in chunk])))
    rows = torch.cat([p.to(parts[0].device) for p in parts]).tolist() if parts else []  # the one transfer
    out: list[tuple[float, float]] = [(math.nan, math.nan)] * len(ws)
    for i, (top, total, scale, ok) in zip(order, rows):
        if not ok:
            continue
        out[i] = (math.sqrt(top) * scale, total / top if top > 0 else 0.0)
    return out


def _spectral_rows(x: Tensor) -> Tensor:
    """(n, 4) float64 on x's device: lambda_max, trace (both of the scaled Gram matrix, clamped at
    0), the scale and whether the figures stand, for a stack x (n, m, k') of matrices."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    top = x.abs().amax(dim=(-2, -1)) if x.numel() else x.new_zeros(x.shape[0])
    finite = torch.isfinite(top)
    scale = torch.where(finite & (top > 0), torch.exp2(torch.floor(torch.log2(top))), torch.ones_like(top))
    x = torch.where(finite[:, None, None], x / scale[:, None, None], torch.zeros((), dtype=x.dtype, device=x.device))
    gram = x.transpose(-2, -1) @ x if x.shape[-2] >= x.shape[-1] else x @ x.transpose(-2, -1)
    # The eigenproblem runs on one thread: its tridiagonal reduction synchronises the threads at
    # every column, so a second thread gains little and a busy core stalls it many times over.
    threads = torch.get_num_threads()
    converged = torch.ones_like(finite)
    try:
        if threads != 1:
            torch.set_num_threads(1)
        try:
            ev = torch.linalg.eigvalsh(gram.double())  # ascending
        except RuntimeError:  # torch.linalg.LinAlgError: no convergence somewhere: each of several alone
            ev = torch.zeros(gram.shape[:-1], dtype=torch.float64, device=gram.device)
            converged[:] = gram.shape[0] > 1
            for j in range(gram.shape[0] if gram.shape[0] > 1 else 0):
                try:
                    ev[j] = torch.linalg.eigvalsh(gram[j].double())
                except RuntimeError:
                    converged[j] = False
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    ev = ev.clamp(min=0.0)
    top_ev = ev[..., -1] if ev.shape[-1] else ev.new_zeros(ev.shape[0])
    return torch.stack([top_ev, ev.sum(-1), scale.double(), (finite & converged).double()], 1)


_DECLARED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _declared(model: nn.Module, named: list[tuple[str, Tensor]]) -> dict:
    """{name: (actual std, description)} of ``declare(model, model.config.init)`` ({} without a
    declared scheme), cached per model while its scheme and parameter shapes (``named``: its
    parameters) stay the same (the declarations depend on nothing else)."""
    config = getattr(model, "config", None)
    init = getattr(config, "init", None)
    if not isinstance(init, str):
        return {}
    key = (init, tuple((n, tuple(p.shape)) for n, p in named))
    hit = _DECLARED.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        decl = {n: (d.actual_std, d.describe()) for n, d in declare(model, init).items()}
    except tinylm.TinyLMError:
        decl = {}
    _DECLARED[model] = (key, decl)
    return decl


@torch.no_grad()
def param_stats(model: nn.Module, spectral: bool = False, grads: dict[str, Tensor | None] | None = None,
                named: list[tuple[str, Tensor]] | None = None) -> dict[str, ParamStats]:
    """Per-parameter statistics (tied parameters once), with declared std from ``model.config.init``.

    std = sqrt(mean((w - mean w)^2)), accumulated in float64 by :func:`reduce` (NaN when
    any entry is non-finite; the non-finite fraction says how many); grad_std likewise over
    the finite entries of ``grads[name]`` (default: ``p.grad``). spectral_norm = sigma_max(W), stable_rank =
    sum sigma^2 / sigma_max^2 (:func:`spectral_stats`), for 2-D finite parameters when ``spectral``.
    A sharded parameter (DTensor) is measured from its local shards, all parameters and gradients
    merged over their mesh in one collective (:func:`.sharded.moments`); its spectral figures need
    the full matrix and are not measured (``note`` says so). Every rank must call this alike.
    ``named``: ``list(model.named_parameters())`` where the caller has it already.
    """
    named = list(model.named_parameters()) if named is None else named
    decl = _declared(model, named)
    names, plist, glist = [], [], []
    seen: set[int] = set()
    for name, p in named:
        if id(p) in seen:
            continue
        seen.add(id(p))
        names.append(name)
        plist.append(p)
        glist.append(grads.get(name) if grads is not None else p.grad)
    # one summary per parameter and per gradient, then std and non-finite fraction of all of
    # them at once (FIELDS: n_total, count, mean, m2, ...); a parameter with a non-finite entry
    # has no std (NaN), a gradient's std is over its finite entries
    have = [g is not None and g.numel() > 0 for g in glist]
    tensors = plist + [g for g, h in zip(glist, have) if h]
    v = reduction.many(tensors)  # all of them in one op where one kernel takes them all
    if v is None:
        vecs = sharded.moments(tensors, lambda t: reduce(t).moments)
        home = next((v.device for v in vecs if v is not None), None)  # None: not measured (NaN)
        vecs = [torch.full((10,), math.nan, dtype=torch.float64, device=home) if v is None else v for v in vecs]
        v = torch.stack(vecs) if vecs else None
    values = []
    if v is not None:
        vecs = v
        nf = (v[:, 0] - v[:, 1]) / v[:, 0].clamp(min=1.0)
        std = (v[:, 3] / v[:, 1].clamp(min=1.0)).sqrt()
        std = torch.where((nf > 0) & (torch.arange(len(vecs), device=v.device) < len(plist)), math.nan, std)
        flat = torch.stack([std, nf], 1).tolist()
        gi = iter(flat[len(plist):])
        for (pstd, pnf), h in zip(flat[:len(plist)], have):
            gstd, gnf = next(gi) if h else (math.nan, math.nan)
            values.append((pstd, pnf, gstd, gnf))
    out: dict[str, ParamStats] = {}
    wholes = [sharded.whole(p) for p in plist]  # None: sharded, the matrix is on several ranks
    asked = [i for i, (p, full, v) in enumerate(zip(plist, wholes, values))
             if spectral and p.dim() == 2 and v[1] == 0.0 and p.numel() and full is not None]
    figures = dict(zip(asked, spectral_many([wholes[i] for i in asked])))  # one transfer for all
    for i, (name, p, g, (std, nf, gstd, gnf)) in enumerate(zip(names, plist, glist, values)):
        spec, srank = figures.get(i, (None, None))
        full = wholes[i]
        d = decl.get(name)
        out[name] = ParamStats(
            shape=tuple(p.shape), std=std, grad_std=None if g is None else gstd, frac_nonfinite=nf,
            grad_frac_nonfinite=None if g is None else gnf,
            declared_std=d[0] if d is not None else None, declared=d[1] if d is not None else "",
            spectral_norm=spec, stable_rank=srank,
            note=sharded.NOT_MEASURED_SPECTRAL if spectral and p.dim() == 2 and full is None else "",
        )
    return out
