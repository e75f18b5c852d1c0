"""Causal attention's statistics from the heads' inputs, blockwise (no (..., H, T, T) tensor is
kept), and the probe's observer that takes them (:class:`AttentionObserver`).

A tinylm attention on torch's fused kernel never forms its scores or weights. The probe
measures them from the kernel's inputs instead (``q``, ``k`` after RoPE, each (..., H, T, d_k)),
and backward from ``v`` and the gradient ``dO`` of the heads, with the formulas of the explicit
path (:class:`tinylm.MultiHeadSelfAttention`):

    S  = (q / sqrt(d_k)) k^T,  -inf above the diagonal       the scores (``attn_scores``)
    P  = softmax(S) per row (:func:`tinylm.functional.softmax`) the weights (``attn_probs``)
    dP = dO v^T                                              the gradient of the weights
    dS = P (dP - rowsum(dP P))                               the gradient of the scores

in the model's dtype where the explicit path rounds to it (S, P, dP, dS) and in float32 at
least where it computes (the softmax and its backward). Only the entries on and below each
diagonal are measured (:func:`diagnostics.measure.reducer.reduce` with ``causal``), so the
figures are those of the explicit path's tensors to rounding.

Work and memory. The (batch x head) matrices are taken a chunk at a time: the largest
divisor of their number whose chunk holds at most :data:`CHUNK` entries (:data:`CHUNK_DEVICE` off
the CPU; one matrix at least), so every chunk has one shape. In a chunk, S and dP are formed
whole, one matrix product each (as the explicit path forms them: the same products, the same
bits; a few large products cost less than many small ones), into (chunk, T, T) buffers; the
softmax and its backward then run in blocks of ``block`` query rows against the keys up to
the block's last row, into the buffers of P and dS, whose entries above the diagonal blocks
are never written: about (1 + 1/b) / 2 of the explicit path's exponentials for b blocks. The
reductions read only the causal entries. Nothing outlives the call.

Several layers at once. :func:`statistics_many` takes a list of layers' (q, k, v, grad): each
layer is cut into its own chunks as above, consecutive chunks (of any layers) are joined into
groups of at most :data:`GROUP` entries, and every op above runs once per group on the joined
matrices, the causal reductions of all the group's chunks in one call. Each matrix goes through
the same arithmetic as alone (the products and the softmax work matrix by matrix and row by
row), and each chunk is reduced and merged as alone: every layer's vectors are bit for bit those
:func:`statistics` gives it (tests/test_attention_batch.py). On the CPU the causal mask is
written by two bitwise ops on the scores' bits (the bits masked_fill_ writes, at a fraction of
its cost). The probe's :class:`~.attention_observer.AttentionQueue` calls it, by way of
:func:`summaries`, once per flush: at a launch-bound shape one call for all the layers of a
pass, rather than about twenty ops per layer.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from . import compiled, numba_reducer, reducer, reduction, reference
from .reducer import merge_attention_vectors, merge_vectors
from .reducer_choice import chosen
from .reference import SATURATED_PROB

__all__ = ["statistics", "statistics_many", "summaries", "forward_statistics", "backward_statistics", "CHUNK",
           "CHUNK_DEVICE", "GROUP", "GROUP_DEVICE", "BLOCK", "KINDS"]

_PLAIN = (Tensor, torch.nn.Parameter)

#: the probe's kind of each Tap of a tinylm attention
KINDS = {"scores": "attn_scores", "probs": "attn_probs"}

#: entries of the (chunk, T, T) buffers at most, on the CPU (a few fit its caches) and elsewhere
#: (fewer, larger launches); one whole T x T matrix where T^2 is larger
CHUNK = 1 << 18
CHUNK_DEVICE = 1 << 26
#: entries of the buffers :func:`statistics_many` joins several chunks into, at most, on the CPU
#: and elsewhere (a larger chunk alone)
GROUP = 1 << 17
GROUP_DEVICE = 1 << 24
#: query rows per block on the CPU; on other devices a block is the whole matrix (fewer launches)
BLOCK = 64


def _flat(t: Tensor) -> Tensor:
    """(..., T, d) as (N, T, d), detached."""
    return t.detach().reshape(-1, t.shape[-2], t.shape[-1])


def _cpu_structure(device: torch.device) -> bool:
    """Whether work on ``device`` is cut as for a CPU: a CPU tensor, unless ``TINYLM_REDUCER=cuda``
    (or ``compiled``) asks for the structure CUDA tensors get."""
    return device.type == "cpu" and chosen() not in ("cuda", "compiled")


def _chunk(N: int, T: int, device: torch.device = torch.device("cpu")) -> int:
    """The largest divisor n of N with n T^2 <= CHUNK (CHUNK_DEVICE off the CPU), at least 1."""
    most = max(1, (CHUNK if _cpu_structure(device) else CHUNK_DEVICE) // max(T * T, 1))
    if N <= most:
        return N
    return max(n for n in range(1, min(N, most) + 1) if N % n == 0)


def _blocks(T: int, device: torch.device, block: int | None) -> list[tuple[int, int]]:
    size = block if block is not None else (BLOCK if _cpu_structure(device) else T)
    size = max(1, min(size, T))
    return [(r0, min(r0 + size, T)) for r0 in range(0, T, size)]


def _scores(S: Tensor, r0: int, r1: int, above) -> Tensor:
    """S of rows r0..r1-1 against keys 0..r1-1, a view of the chunk's products ``S`` (n, T, T), with
    the keys after each row (in the diagonal block) set to -inf. ``above``: :func:`_above`'s
    mask, or :func:`_above_bits`' pair (the same -inf written by two bitwise ops)."""
    s = S[:, r0:r1, :r1]
    w = r1 - r0
    if isinstance(above, tuple):  # the diagonal block's bits: kept below, those of -inf after the row
        keep, fill = above
        s[:, :, r0:].view(keep.dtype).bitwise_and_(keep[:w, :w]).bitwise_or_(fill[:w, :w])
    else:
        s[:, :, r0:].masked_fill_(above[:w, :w], -math.inf)  # the diagonal block: keys after the row
    return s


_ABOVE: dict = {}
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def _above(T: int, device: torch.device) -> Tensor:
    """The (T, T) mask of the keys after each query row (above the diagonal), made once per T and
    device (read only: masked_fill_ reads it); made afresh, not kept, under a dispatch mode (a
    FakeTensor mode would make it fake)."""
    got = _ABOVE.get((T, device))
    if got is None:
        got = torch.ones(T, T, dtype=torch.bool, device=device).triu_(1)
        if not torch._C._len_torch_dispatch_stack():
            _ABOVE[(T, device)] = got
    return got


def _above_bits(T: int, device: torch.device, dtype: torch.dtype):
    """:func:`_above` as (keep, fill), integer (T, T) tensors of ``dtype``'s width: x & keep | fill
    is x's bits on and below the diagonal, -inf's above (what masked_fill_ writes, bit for bit;
    on the CPU two vectorized ops cost a fraction of one masked fill). None for another dtype."""
    bits = _BITS.get(dtype)
    if bits is None:
        return None
    got = _ABOVE.get((T, device, dtype))
    if got is None:
        mask = _above(T, device)
        ninf = torch.tensor(-math.inf, dtype=dtype, device=device).view(bits)
        got = ((~mask).to(bits) * -1, mask.to(bits) * ninf)  # keep: all ones (-1) below; fill: -inf above
        if not torch._C._len_torch_dispatch_stack():
            _ABOVE[(T, device, dtype)] = got
    return got


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _softmax(s: Tensor, out: Tensor | None = None) -> Tensor:
    """:func:`tinylm.functional.softmax` of ``s`` over its last dimension, in float32 at least
    and not rounded back (the weights the softmax keeps for its backward): p = z / sum z with
    z = exp(s - max s), flushed to exactly 0 where s - max s < log(smallest normal) + 2 (and
    where it equals that floor, which tinylm keeps: an entry of measure zero).
    ``out`` (a view of that dtype and shape) receives it when given."""
    wide = _wide(s.dtype)
    floor = math.log(torch.finfo(wide).tiny) + 2.0
    top = s.amax(-1, keepdim=True)
    if out is not None and s.dtype == wide:
        y = torch.sub(s, top, out=out)
    else:
        y = s.to(wide) - top.to(wide)
        if out is not None:
            y = out.copy_(y)
    # the clamped entries come out as exp(floor), the others above it (exp is monotone): set to 0 in
    # one pass; the margin of 8 ulp covers an exp that rounds differently from the host's
    edge = math.exp(floor) * (1.0 + 8 * torch.finfo(wide).eps)
    torch.nn.functional.threshold_(y.clamp_(min=floor).exp_(), edge, 0.0)
    return y.div_(y.sum(-1, keepdim=True))


def _merge(total: Tensor | None, vec: Tensor, merge) -> Tensor:
    return vec if total is None else merge(total, vec)


def forward_statistics(q: Tensor, k: Tensor, *, scores: bool = True, probs: bool = True, panel: bool = True,
                       block: int | None = None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(FIELDS of S, FIELDS of P, ATTN_FIELDS panel of P) over the causal entries, each None when
    not asked (the panel needs ``probs``): :func:`statistics` without a gradient."""
    got = statistics(q, k, scores=scores, probs=probs, panel=panel, block=block)
    return got["scores"], got["probs"], got["panel"]


def backward_statistics(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, *, scores: bool = True, probs: bool = True,
                        block: int | None = None) -> tuple[Tensor | None, Tensor | None]:
    """(FIELDS of dS, FIELDS of dP) over the causal entries, each None when not asked:
    :func:`statistics` of the gradient only."""
    got = statistics(q, k, v, grad, scores=scores, probs=probs, forward=False, block=block)
    return got["scores_grad"], got["probs_grad"]


@torch.no_grad()
def statistics(q: Tensor, k: Tensor, v: Tensor | None = None, grad: Tensor | None = None, *, scores: bool = True,
               probs: bool = True, panel: bool = True, forward: bool = True, block: int | None = None
               ) -> dict[str, Tensor | None]:
    """The statistics of S and P (``forward``) and, given ``v`` and ``grad``, of dS and dP, from one
    pass over the blocks: {"scores", "probs", "panel", "scores_grad", "probs_grad"}, FIELDS vectors
    (the panel: ATTN_FIELDS) over the causal entries, None where not asked.

    q, k (..., T, d_k), v and ``grad`` = dL/d heads (..., T, d_v), in the model's dtype; S, P, dP
    = grad v^T and dS = P (dP - rowsum(dP P)) as in the module docstring (the softmax and its
    backward in float32 at least; P and dS rounded to the model's dtype). ``block``: query rows
    per block (None: :data:`BLOCK` on the CPU, the whole matrix elsewhere)."""
    return statistics_many([(q, k, v, grad)], scores=scores, probs=probs, panel=panel, forward=forward,
                           block=block)[0]


def _wanted(backward: bool, scores: bool, probs: bool, panel: bool, forward: bool) -> dict[str, bool]:
    backward = backward and (scores or probs)
    return {"scores": forward and scores, "probs": forward and probs, "panel": forward and probs and panel,
            "scores_grad": backward and scores, "probs_grad": backward and probs}


def _pieces(items: list, backward: bool, T: int, dev: torch.device) -> list[tuple]:
    """Each item's chunks, in order: (item index, n, (q, k, v, grad)), n matrices of each item's
    own :func:`_chunk` (v and grad None without ``backward``): an item of one chunk as it is,
    (..., T, d); the chunks of another as (n, T, d) slices of its flattening."""
    out = []
    for i, (q, k, v, grad) in enumerate(items):
        N = math.prod(q.shape[:-2])
        n = _chunk(N, T, dev)
        if n == N:
            out.append((i, N, (q, k, v, grad) if backward else (q, k, None, None)))
            continue
        flat = [_flat(t) for t in ((q, k, v, grad) if backward else (q, k))]
        flat += [None] * (4 - len(flat))
        for c in range(0, N, n):
            out.append((i, n, tuple(t[c:c + n] if t is not None else None for t in flat)))
    return out


def _groups(pieces: list[tuple], most: int) -> list[list[tuple]]:
    """Consecutive pieces together, at most ``most`` matrices a group (a larger piece alone)."""
    groups: list[list[tuple]] = []
    size = most
    for piece in pieces:
        if size + piece[1] > most or not groups:
            groups.append([])
            size = 0
        groups[-1].append(piece)
        size += piece[1]
    return groups


def _joined(group: list[tuple], at: int, T: int, room: dict) -> tuple[Tensor, bool]:
    """(part ``at`` (0 q, 1 k, 2 v, 3 grad) of the group's pieces as one (m, T, d) tensor, whether
    it is a copy of the caller's own): a piece alone as :func:`_flat` gives it (a view where its
    layout allows); several copied into one buffer of ``room`` ({part: tensor}, made at the
    first group that joins and reused by the next: no fresh memory per group)."""
    parts = [p[2][at].detach() for p in group]
    if len(parts) == 1:
        return _flat(parts[0]), False
    n, d = sum(p[1] for p in group), parts[0].shape[-1]
    buf = room.get(at)
    if buf is None or buf.shape[0] < n:
        buf = room[at] = torch.empty(room["most"], T, d, dtype=parts[0].dtype, device=parts[0].device)
    out = buf[:n]
    if all(t.shape[1:] == parts[0].shape[1:] for t in parts):  # one copy, whatever each part's layout
        torch.cat(parts, out=out.view(-1, *parts[0].shape[1:]))
    else:
        torch.cat([t.reshape(-1, T, d) for t in parts], out=out)
    return out, True


@torch.no_grad()
def statistics_many(items: list[tuple], *, scores: bool = True, probs: bool = True, panel: bool = True,
                    forward: bool = True, block: int | None = None) -> list[dict[str, Tensor | None]]:
    """:func:`statistics` of each (q, k, v, grad) of ``items`` (one T, d_k, dtype and device; v and
    grad given for all or for none), the same bits, from one pass over them all: each item cut
    in its own chunks (:func:`_chunk`), consecutive chunks of any items joined into groups of
    at most :data:`GROUP` entries (:data:`GROUP_DEVICE` off the CPU), every op of the products,
    the softmax and its backward run once per group on the joined matrices (the same
    arithmetic on each matrix as alone), and the causal entries of every chunk reduced in one
    call (:func:`.reduction.causal_parts`), each chunk's vectors merged into its item's as
    :func:`statistics` merges them."""
    backward = items[0][3] is not None and items[0][2] is not None
    want = _wanted(backward, scores, probs, panel, forward)
    outs: list[dict[str, Tensor | None]] = [dict.fromkeys(want) for _ in items]
    if not any(want.values()):
        return outs
    backward = want["scores_grad"] or want["probs_grad"]
    q0 = items[0][0]
    T, dev, dtype, d = q0.shape[-2], q0.device, q0.dtype, q0.shape[-1]
    pieces = _pieces(items, backward, T, dev)
    most = max(max(p[1] for p in pieces), (GROUP if _cpu_structure(dev) else GROUP_DEVICE) // max(T * T, 1))
    groups = _groups(pieces, most)
    m = max(sum(p[1] for p in g) for g in groups)
    above = (_cpu_structure(dev) and _above_bits(T, dev, dtype)) or _above(T, dev)
    wide = _wide(dtype)
    need_p = want["probs"] or want["scores_grad"]
    S = torch.empty(m, T, T, dtype=dtype, device=dev)
    P = torch.empty(m, T, T, dtype=wide, device=dev) if need_p else None  # the softmax's own precision
    Pm = P if not want["probs"] or dtype == wide else torch.empty_like(S)  # the weights, rounded as the model's
    G = torch.empty(m, T, T, dtype=items[0][3].dtype, device=dev) if backward else None
    D = torch.empty_like(G) if want["scores_grad"] else None
    blocks = _blocks(T, dev, block)
    rounded = want["probs"] and Pm is not P
    room = {"most": m}  # the joined q, k, v and grad of a group, made once
    for group in groups:
        n = sum(p[1] for p in group)
        s_, p_, pm_, g_, d_ = (b[:n] if b is not None and n < m else b for b in (S, P, Pm, G, D))
        qj, own = _joined(group, 0, T, room)
        qs = qj.div_(math.sqrt(d)) if own else qj / math.sqrt(d)  # scale the smaller tensor, as attention_scores does
        torch.matmul(qs, _joined(group, 1, T, room)[0].transpose(-2, -1), out=s_)  # the whole products
        if backward:
            torch.matmul(_joined(group, 3, T, room)[0], _joined(group, 2, T, room)[0].transpose(-2, -1), out=g_)
        for r0, r1 in blocks:
            s = _scores(s_, r0, r1, above)
            p = _softmax(s, p_[:, r0:r1, :r1]) if need_p else None
            if rounded:
                pm_[:, r0:r1, :r1] = p
            if d_ is not None:
                _score_grad(g_[:, r0:r1, :r1], p, d_[:, r0:r1, :r1])
        _add(outs, want, group, s_, pm_, g_, d_)
    return outs


def _score_grad(g: Tensor, p: Tensor, out: Tensor) -> None:
    """out = p (g - rowsum(g p)) in p's precision, rounded to out's dtype (softmax's backward)."""
    if g.dtype == p.dtype == out.dtype:  # out holds the products g p first: no temporary
        rowsum = torch.mul(g, p, out=out).sum(-1, keepdim=True)
        torch.sub(g, rowsum, out=out).mul_(p)
        return
    gw = g if g.dtype == p.dtype else g.to(p.dtype)
    rowsum = (gw * p).sum(-1, keepdim=True)
    if out.dtype == p.dtype:
        torch.sub(gw, rowsum, out=out).mul_(p)
    else:
        out.copy_((gw - rowsum).mul_(p))


def _add(outs: list[dict], want: dict, group: list[tuple], S: Tensor, P: Tensor | None, G: Tensor | None,
         D: Tensor | None) -> None:
    """Reduce one group's buffers (causal entries), each piece's rows apart, into its item's dict
    of ``outs``, merging with the item's chunks before: all of them in one call into numba's
    loops where they take its direct lane."""
    asked, at = [], 0  # (item, key, buffer, first matrix, matrices, panel)
    for i, n, _ in group:
        asked += [(i, key, t, at, n, False) for key, t in (("scores", S), ("scores_grad", D), ("probs_grad", G))
                  if want[key]]
        if want["probs"]:
            asked.append((i, "probs", P, at, n, want["panel"]))
        at += n
    got = _loop(asked)
    views = None
    if got is None:
        views = [t[a:a + n] for _, _, t, a, n, _ in asked]
        got = reduction.causal_parts(views, [p for *_, p in asked]) or _compiled_parts(group, asked)
    if got is None:
        got = []
        for view, (*_, panel) in zip(views, asked):
            r = reducer.reduce(view, causal=True, probs=panel)
            got.append((r.moments, r.panel if panel else None))
    for (i, key, *_), (mom, panel) in zip(asked, got):
        out = outs[i]
        out[key] = _merge(out[key], mom, merge_vectors)
        if panel is not None:
            out["panel"] = _merge(out["panel"], panel, merge_attention_vectors)


def _loop(asked: list[tuple]) -> list[tuple] | None:
    """[(moments, panel or None)] of each (.., buffer, first matrix, matrices, panel) of ``asked``
    from one call into numba's loop at the matrices' addresses (no views made: what
    :func:`.reduction.causal_parts` gives their views, bit for bit), or None where they do not
    all take that lane: float32 CPU buffers on the direct lane, each read by one thread."""
    if not (asked and reduction.direct() and reduction.all_numba(())):
        return None
    T = asked[0][2].shape[-1]
    if torch.get_num_threads() > 1 and max(n for *_, n, _ in asked) * T * T >= numba_reducer.PARALLEL_MIN:
        return None  # one the threads would split
    for t in {id(t): t for _, _, t, _, _, _ in asked}.values():  # each buffer once
        if not (t.dtype == torch.float32 and t.is_cpu and type(t) in _PLAIN and t.is_contiguous() and not t.is_neg()):
            return None
    size = T * T * 4
    addrs = np.array([t.data_ptr() + a * size for _, _, t, a, _, _ in asked], dtype=np.int64)
    ns = np.array([n * T * T for *_, n, _ in asked], dtype=np.int64)
    flags = np.array([p for *_, p in asked], dtype=np.bool_)
    out = (numba_reducer._loops or numba_reducer._build()).many_at(addrs, ns, T, flags)
    moms = torch.from_numpy(np.ascontiguousarray(out[:, :10])).unbind(0)
    panels = iter(torch.from_numpy(out[flags, 10:]).unbind(0))  # a copy: the rows asked, contiguous
    return [(m, next(panels) if p else None) for m, p in zip(moms, flags.tolist())]


def _compiled_parts(group: list[tuple], asked: list[tuple]) -> list[tuple] | None:
    """[(moments, panel or None)] of ``asked`` (as :func:`_loop` takes it) on the CUDA structure
    with one compiled call per buffer for all the group's pieces (:func:`_causal_layers`,
    :func:`_causal_probs_layers`) rather than one per piece, or None where that does not apply
    (pieces of different sizes, the CPU's own structure, a buffer another kernel reduces,
    compilation failed, a dispatch mode on): the same formulas as the compiled reducer's, each piece's rows summed apart
    (counts and max |x| exact, mean and M2 to the rounding of float64 sums)."""
    if len(group) < 2 or len({n for _, n, _ in group}) != 1 or torch._C._len_torch_dispatch_stack() \
            or _cpu_structure(asked[0][2].device):
        return None
    L, n = len(group), group[0][1]
    bufs: dict[str, tuple] = {}
    for _, key, t, _, _, panel in asked:
        bufs.setdefault(key, (t, panel))
    if not all(reduction.route(t) == reduction.CUDA for t, _ in bufs.values()) or not compiled.available():
        return None
    T = asked[0][2].shape[-1]
    rows: dict[str, tuple] = {}
    with reduction.compiling():
        for key, (t, panel) in bufs.items():
            x = t[:L * n].view(L, n, T, T)
            out = compiled.call(_causal_probs_layers if panel else _causal_layers, x)
            if out is None:
                return None
            mom, pan = out if panel else (out, None)
            rows[key] = (mom.unbind(0), pan.unbind(0) if pan is not None else None)
    got = []
    for at, (_, key, _, _, _, panel) in enumerate(asked):  # each piece asks every key, in one order
        mom, pan = rows[key]
        got.append((mom[at // len(bufs)], pan[at // len(bufs)] if panel else None))
    return got


def _layer_partials(x: Tensor, probs: bool) -> tuple[Tensor, Tensor]:
    """(row partials (L, n, T, 10 or 12), each layer's shift (L,)) of causal matrices x (L, n, T, T)."""
    first = x.reshape(x.shape[0], -1)[:, 0].double()
    shift = torch.where(torch.isfinite(first), first, 0.0)
    mask = reference.causal_mask(x.shape[-1], x.device)
    return compiled.row_partials(x, mask, shift.view(-1, 1, 1, 1), probs=probs), shift


def _causal_layers(x: Tensor) -> Tensor:  # x (L, n, T, T) -> (L, 10)
    parts, shift = _layer_partials(x, False)
    s = parts.reshape(x.shape[0], -1, parts.shape[-1])
    return compiled.finish(s[..., :10].sum(1), s[..., 4].amax(1), shift)


def _causal_probs_layers(x: Tensor) -> tuple[Tensor, Tensor]:  # x (L, n, T, T) -> (L, 10), (L, 6)
    parts, shift = _layer_partials(x, True)
    s = parts.reshape(x.shape[0], -1, parts.shape[-1])
    mom = compiled.finish(s[..., :10].sum(1), s[..., 4].amax(1), shift)
    h, top = parts[..., 10], parts[..., 11]  # (L, n, T)
    later, top = h[..., 1:], top[..., 1:]  # rows t >= 1
    mean = h.mean((1, 2))
    lowest = later.amin((1, 2)) if later.numel() else torch.full_like(mean, float("inf"))
    panel = torch.stack([torch.ones_like(h).sum((1, 2)), mean, (h - mean.view(-1, 1, 1)).square().sum((1, 2)),
                         lowest, torch.ones_like(later).sum((1, 2)), (top > SATURATED_PROB).sum((1, 2)).double()], -1)
    return mom, panel


#: the parts of :func:`statistics` in the order the op ``tinylm::attention_summary`` lays them out
PARTS = (("scores", 10), ("probs", 10), ("panel", 6), ("scores_grad", 10), ("probs_grad", 10))

_LIB = torch.library.Library("tinylm", "FRAGMENT")
_LIB.define("attention_summary(Tensor q, Tensor k, Tensor? v, Tensor? grad, bool scores, bool probs, bool panel, "
            "bool forward) -> Tensor")


def _summary_kernel(q, k, v, grad, scores, probs, panel, forward):
    """:func:`statistics` as one vector (the parts of :data:`PARTS` asked, in order)."""
    with torch._C.DisableTorchFunction():
        got = statistics(q, k, v, grad, scores=scores, probs=probs, panel=panel, forward=forward)
        return torch.cat([got[key] for key, _ in PARTS if got[key] is not None])


_LIB.impl("attention_summary", _summary_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("tinylm::attention_summary", lib=_LIB)
def _(q, k, v, grad, scores, probs, panel, forward):
    return q.new_empty((sum(n for key, n in PARTS if _asked(key, grad is not None, scores, probs, panel, forward)),),
                       dtype=torch.float64)


def _asked(key: str, backward: bool, scores: bool, probs: bool, panel: bool, forward: bool) -> bool:
    backward = backward and (scores or probs)
    return {"scores": forward and scores, "probs": forward and probs, "panel": forward and probs and panel,
            "scores_grad": backward and scores, "probs_grad": backward and probs}[key]


def summary(q: Tensor, k: Tensor, v: Tensor | None = None, grad: Tensor | None = None, *, scores: bool = True,
            probs: bool = True, panel: bool = True, forward: bool = True) -> dict[str, Tensor | None]:
    """:func:`statistics` (default blocks) from one dispatched op, ``tinylm::attention_summary``:
    the same dict, its vectors views of the op's one output (one ``split``). CPU tensors under
    ``TINYLM_REDUCER=auto``, where nothing observes the ops (:func:`.reduction.direct`), skip
    the op's dispatch: :func:`statistics` itself (what the op's kernel runs; the same bits)."""
    if q.is_cpu and chosen() == "auto" and reduction.direct() and type(q) in _PLAIN and type(k) in _PLAIN:
        with torch._C.DisableTorchFunction():  # as inside the op's kernel
            return statistics(q, k, v, grad, scores=scores, probs=probs, panel=panel, forward=forward)
    with torch.no_grad():
        vec = torch.ops.tinylm.attention_summary(q, k, v, grad, scores, probs, panel, forward)
    keys = [(key, n) for key, n in PARTS if _asked(key, grad is not None and v is not None, scores, probs, panel,
                                                  forward)]
    out: dict[str, Tensor | None] = {key: None for key, _ in PARTS}
    if len(keys) == 1:
        out[keys[0][0]] = vec
    elif keys:
        out.update(zip([key for key, _ in keys], vec.split_with_sizes([n for _, n in keys])))
    return out


_LIB.define("attention_summaries(Tensor[] q, Tensor[] k, Tensor[] v, Tensor[] grad, bool scores, bool probs, "
            "bool panel, bool forward) -> Tensor")


def _summaries_kernel(q, k, v, grad, scores, probs, panel, forward):
    """:func:`statistics_many` as one (L, parts) matrix, row i item i's :func:`_summary_kernel` vector."""
    with torch._C.DisableTorchFunction():
        items = [(a, b, v[i] if v else None, grad[i] if grad else None) for i, (a, b) in enumerate(zip(q, k))]
        got = statistics_many(items, scores=scores, probs=probs, panel=panel, forward=forward)
        keys = [key for key, _ in PARTS if got[0][key] is not None]
        return torch.stack([torch.cat([g[key] for key in keys]) for g in got])


_LIB.impl("attention_summaries", _summaries_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("tinylm::attention_summaries", lib=_LIB)
def _(q, k, v, grad, scores, probs, panel, forward):
    width = sum(n for key, n in PARTS if _asked(key, bool(grad), scores, probs, panel, forward))
    return q[0].new_empty((len(q), width), dtype=torch.float64)


def summaries(items: list[tuple], *, scores: bool = True, probs: bool = True, panel: bool = True,
              forward: bool = True) -> list[dict[str, Tensor | None]]:
    """:func:`summary` of each (q, k, v, grad) of ``items`` (as :func:`statistics_many` takes them:
    one T, d_k, dtype and device; v and grad for all or none), the same bits, from one
    dispatched op, ``tinylm::attention_summaries`` (its matrix cut by one ``split`` and one
    ``unbind`` per part), or, for CPU tensors on the direct lane (as :func:`summary`), from
    :func:`statistics_many` itself."""
    if items[0][0].is_cpu and chosen() == "auto" and reduction.direct() \
            and all(type(q) in _PLAIN and type(k) in _PLAIN for q, k, _, _ in items):
        with torch._C.DisableTorchFunction():  # as inside the op's kernel
            return statistics_many(items, scores=scores, probs=probs, panel=panel, forward=forward)
    if len(items) == 1:
        return [summary(*items[0], scores=scores, probs=probs, panel=panel, forward=forward)]
    backward = items[0][2] is not None and items[0][3] is not None
    q, k = [it[0] for it in items], [it[1] for it in items]
    v, g = ([it[2] for it in items], [it[3] for it in items]) if backward else ([], [])
    with torch.no_grad():
        mat = torch.ops.tinylm.attention_summaries(q, k, v, g, scores, probs, panel, forward)
    keys = [(key, n) for key, n in PARTS if _asked(key, backward, scores, probs, panel, forward)]
    out: list[dict[str, Tensor | None]] = [{key: None for key, _ in PARTS} for _ in items]
    cols = mat.split_with_sizes([n for _, n in keys], dim=1) if len(keys) > 1 else [mat]
    for (key, _), col in zip(keys, cols):
        for got, row in zip(out, col.unbind(0)):
            got[key] = row
    return out
