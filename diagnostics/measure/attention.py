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
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor, nn

import tinylm

from . import reducer, reduction
from .reducer import merge_attention_vectors, merge_vectors
from .reducer_choice import chosen
from .reference import FIELDS

__all__ = ["statistics", "forward_statistics", "backward_statistics", "AttentionObserver", "observed_attention",
           "CHUNK", "CHUNK_DEVICE", "BLOCK", "KINDS"]

_PLAIN = (Tensor, torch.nn.Parameter)

#: the probe's kind of each Tap of a tinylm attention
KINDS = {"scores": "attn_scores", "probs": "attn_probs"}

#: entries of the (chunk, T, T) buffers at most, on the CPU (a few fit its caches) and elsewhere
#: (fewer, larger launches); one whole T x T matrix where T^2 is larger
CHUNK = 1 << 18
CHUNK_DEVICE = 1 << 26
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
    return max(n for n in range(1, min(N, most) + 1) if N % n == 0)


def _blocks(T: int, device: torch.device, block: int | None) -> list[tuple[int, int]]:
    size = block if block is not None else (BLOCK if _cpu_structure(device) else T)
    size = max(1, min(size, T))
    return [(r0, min(r0 + size, T)) for r0 in range(0, T, size)]


def _scores(S: Tensor, r0: int, r1: int, above: Tensor) -> Tensor:
    """S of rows r0..r1-1 against keys 0..r1-1, a view of the chunk's products ``S`` (n, T, T), with
    the keys after each row (in the diagonal block) set to -inf."""
    s = S[:, r0:r1, :r1]
    s[:, :, r0:].masked_fill_(above[:r1 - r0, :r1 - r0], -math.inf)  # the diagonal block: keys after the row
    return s


_ABOVE: dict = {}


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
    backward = grad is not None and (scores or probs)
    want = {"scores": forward and scores, "probs": forward and probs, "panel": forward and probs and panel,
            "scores_grad": backward and scores, "probs_grad": backward and probs}
    out: dict[str, Tensor | None] = dict.fromkeys(want)
    if not any(want.values()):
        return out
    T, dev, dtype = q.shape[-2], q.device, q.dtype
    qf, kf = _flat(q), _flat(k)
    vf, gf = (_flat(v), _flat(grad)) if backward else (None, None)
    N = qf.shape[0]
    n = _chunk(N, T, dev)
    above = _above(T, dev)
    wide = _wide(dtype)
    need_p = want["probs"] or want["scores_grad"]
    S = torch.empty(n, T, T, dtype=dtype, device=dev)
    P = torch.empty(n, T, T, dtype=wide, device=dev) if need_p else None  # the softmax's own precision
    Pm = P if not want["probs"] or dtype == wide else torch.empty_like(S)  # the weights, rounded as the model's
    G = torch.empty(n, T, T, dtype=grad.dtype, device=dev) if backward else None
    D = torch.empty_like(G) if want["scores_grad"] else None
    for c in range(0, N, n):
        qs = qf[c:c + n] / math.sqrt(q.shape[-1])  # scale the smaller tensor, as attention_scores does
        torch.matmul(qs, kf[c:c + n].transpose(-2, -1), out=S)  # the whole products: one GEMM per matrix
        if backward:
            torch.matmul(gf[c:c + n], vf[c:c + n].transpose(-2, -1), out=G)  # dP = dO v^T
        for r0, r1 in _blocks(T, dev, block):
            s = _scores(S, r0, r1, above)
            p = _softmax(s, P[:, r0:r1, :r1]) if need_p else None
            if want["probs"] and Pm is not P:
                Pm[:, r0:r1, :r1] = p
            if D is not None:
                _score_grad(G[:, r0:r1, :r1], p, D[:, r0:r1, :r1])
        _add(out, want, S, Pm, G, D)
    return out


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


def _add(out: dict, want: dict, S: Tensor, P: Tensor | None, G: Tensor | None, D: Tensor | None) -> None:
    """Reduce one chunk's buffers (causal entries) into ``out``, merging with the chunks before:
    all of them in one call into numba's loops where they take its direct lane."""
    asked = [(key, t, False) for key, t in (("scores", S), ("scores_grad", D), ("probs_grad", G)) if want[key]]
    if want["probs"]:
        asked.append(("probs", P, want["panel"]))
    got = reduction.causal_parts([t for _, t, _ in asked], [p for _, _, p in asked])
    if got is not None:
        for (key, _, _), (mom, panel) in zip(asked, got):
            out[key] = _merge(out[key], mom, merge_vectors)
            if panel is not None:
                out["panel"] = _merge(out["panel"], panel, merge_attention_vectors)
        return
    for key, t in (("scores", S), ("scores_grad", D), ("probs_grad", G)):
        if want[key]:
            out[key] = _merge(out[key], reducer.reduce(t, causal=True).moments, merge_vectors)
    if want["probs"]:
        r = reducer.reduce(P, causal=True, probs=want["panel"])
        out["probs"] = _merge(out["probs"], r.moments, merge_vectors)
        if want["panel"]:
            out["panel"] = _merge(out["panel"], r.panel, merge_attention_vectors)


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


_HELD: dict = {}


def _held(device: torch.device) -> tuple[Tensor, Tensor]:
    """(FIELDS of no entries, ATTN_FIELDS of no rows) on ``device``: made once per device and
    shared by every place held (never changed in place: a merge makes a new vector)."""
    got = _HELD.get(device)
    if got is None:
        none = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
        no_rows = torch.zeros(6, dtype=torch.float64, device=device)
        no_rows[3] = math.inf  # a fill on the device, no host copy
        got = _HELD[device] = (none, no_rows)
    return got


class AttentionObserver:
    """The observer (:meth:`tinylm.MultiHeadSelfAttention.register_observer`) that measures the
    tinylm attention ``name``'s ``{name}.scores`` and ``{name}.probs`` (the leaves in ``want``).

    Weights the explicit path formed are measured as a Tap's output is. On the fused path the
    same figures come from q, k, v and the heads' gradient
    (:func:`statistics`). When that gradient will come, the forward's
    figures wait for it and both are taken from one pass over the blocks; the forward's place
    among the run's records is held until then by a record of no entries, which the first
    figures replace. A forward still pending at the next forward of the same attention, or on
    exit (:meth:`flush`), is measured then; the gradient of a forward measured early is
    measured alone."""

    def __init__(self, run, name: str, want: frozenset[str]):
        self.run, self.name = run, name
        self.scores, self.probs = "scores" in want, "probs" in want
        self.pending: list[dict] = []  # at most one forward whose figures wait for its gradient
        self.held: set = set()  # (store, key) of places held by a record of no entries

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, heads: Tensor, weights) -> None:
        run = self.run
        if not run.active:
            return None
        t0 = time.perf_counter()
        if weights is not None:
            allowed = self._window_mask(weights[0])
            for leaf, t in zip(("scores", "probs"), weights):
                if getattr(self, leaf) and t.is_floating_point():
                    if leaf == "scores" and allowed is not None:  # the entries a window masks are not scores
                        t = t.detach().masked_select(allowed)
                    run._forward(f"{self.name}.{leaf}", KINDS[leaf], t)
        else:
            self.flush()
            later = run.options.backward and heads.requires_grad
            for leaf in ("scores", "probs"):
                if getattr(self, leaf):
                    self._register(leaf, q.device, later)
            # kept as they are until the gradient comes (the graph holds them until then anyway)
            entry = {"q": q, "k": k, "v": v, "forward": True}
            if later:
                self.pending.append(entry)
                heads.register_hook(self._hook(entry))
            else:
                self._measure(entry, None)
        run.seconds += time.perf_counter() - t0
        return None

    def _window_mask(self, scores: Tensor) -> Tensor | None:
        """The (T, T) mask of the entries a sliding-window attention may attend to (None without a
        window: the causal entries are the reducer's own)."""
        module = self.run.model.get_submodule(self.name)
        if getattr(module, "sliding_window", None) is None:
            return None
        return module.mask(scores.shape[-1], scores.device)

    def flush(self) -> None:
        """Measure the forward still waiting for its gradient, if any."""
        while self.pending:
            entry = self.pending.pop()
            if entry.get("forward"):
                self._measure(entry, None)

    def _register(self, leaf: str, device: torch.device, hold: bool) -> None:
        run, key = self.run, f"{self.name}.{leaf}"
        if key not in run.kinds:
            run.kinds[key] = KINDS[leaf]
            run.order.append(key)
        if key == run.order[0]:
            run.steps += 1
        if hold and (key, "forward") not in run._vec:
            none, no_rows = _held(device)
            run._vec[(key, "forward")] = none
            self.held.add(("vec", (key, "forward")))
            if leaf == "probs" and run.options.attention and key not in run._attn:
                run._attn[key] = no_rows
                self.held.add(("attn", key))

    def _record(self, which: str, key, vec: Tensor | None) -> None:
        if vec is None:
            return
        store, merge = (self.run._vec, merge_vectors) if which == "vec" else (self.run._attn, merge_attention_vectors)
        if (which, key) in self.held:  # the place held in order: the first figures replace it
            self.held.discard((which, key))
            store[key] = vec
            self.run._stats = None
        else:
            self.run._add(store, key, vec, merge)

    def _measure(self, entry: dict, grad: Tensor | None) -> None:
        got = summary(entry["q"], entry["k"], entry["v"], grad, scores=self.scores, probs=self.probs,
                      panel=self.run.options.attention, forward=entry.pop("forward", False))
        s, p = f"{self.name}.scores", f"{self.name}.probs"
        self._record("vec", (s, "forward"), got["scores"])
        self._record("vec", (p, "forward"), got["probs"])
        self._record("attn", p, got["panel"])
        self._record("vec", (p, "backward"), got["probs_grad"])  # in the order autograd reaches them
        self._record("vec", (s, "backward"), got["scores_grad"])

    def _hook(self, entry: dict):
        def hook(grad: Tensor) -> None:
            if not self.run.active:
                return None
            t0 = time.perf_counter()
            self.pending = [e for e in self.pending if e is not entry]
            self._measure(entry, grad)
            self.run.seconds += time.perf_counter() - t0
            return None
        return hook


def observed_attention(model: nn.Module, points: dict[str, str], named: dict[str, nn.Module] | None = None
                       ) -> dict[str, frozenset[str]]:
    """{tinylm attention name: the leaves of ``scores``/``probs`` among ``points``}: those Taps are
    measured through the attention's observer rather than hooked (a hook would force the explicit
    path). A subclass with a forward of its own calls no observer: its Taps are hooked.
    ``named``: ``dict(model.named_modules())`` where the caller has it."""
    found: dict[str, set[str]] = {}
    for name, mod in (named if named is not None else dict(model.named_modules())).items():
        attention = tinylm.MultiHeadSelfAttention
        if isinstance(mod, attention) and type(mod).forward is attention.forward:
            for leaf in ("scores", "probs"):
                if f"{name}.{leaf}" in points and type(getattr(mod, leaf)) is tinylm.Tap:
                    found.setdefault(name, set()).add(leaf)
    return {n: frozenset(w) for n, w in found.items()}
