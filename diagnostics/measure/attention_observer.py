"""The probe's observer of tinylm attention (:class:`AttentionObserver`) and the queue that takes
a pass's layers together (:class:`AttentionQueue`).

    queue = AttentionQueue()                   # one per probe: run.attention_queue
    observer = AttentionObserver(run, "layers.0.attn", frozenset({"scores", "probs"}))
    ...                                        # forward and backward: entries queued
    queue.flush()                              # each layer's figures into the run's stores

A tinylm attention on the fused path hands its observer q, k, v and, through a hook, the heads'
gradient; its statistics (:func:`.attention.statistics`) cost about twenty small torch ops and a
call into numba per layer, each op's dispatch far above its arithmetic at a launch-bound shape.
The queue keeps each layer's (q, k, v, gradient) instead (autograd holds q, k and v for the
fused kernel's backward anyway) and measures them together at a flush: per group of layers with
one T, d_k, d_v, dtypes, device and figures asked, one :func:`.attention.summaries` (the ops once
on the layers' joined matrices, every causal reduction in one call; each layer's vectors bit for
bit those it gets alone). Flushes: when the last gradient a pass waits for has come (the end of
the backward, for attention), before anything reads the run's stores (the probe's
:meth:`~.probe.ProbeRun.flush`), on exit, and past :data:`~.pending.MAX_BYTES` of tensors kept.

Order. A layer's forward, and its gradient when it comes, hold their places among the run's
records (a record of no entries, which the first figures replace), so the records' order is the
one hooks that measured at once would give, whenever the flush comes; each key's vectors merge
in the order they were queued, as they did one hook at a time.

Changed in place. A tensor whose ``_version`` moved between queueing and the flush no longer
holds what the hook saw: that layer's entry is not measured (its held places stay records of
no entries: "not measured", never a wrong figure),
:attr:`AttentionQueue.stale` counts it, and that observer measures at once from then on (only
the pass that found it loses it).
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor, nn

import tinylm

from .attention import KINDS, summaries
from .pending import MAX_BYTES
from .reducer import merge_attention_vectors, merge_vectors
from .reference import FIELDS

__all__ = ["AttentionObserver", "AttentionQueue", "observed_attention"]

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


def _versions(tensors) -> tuple:
    return tuple(t._version if t is not None else None for t in tensors)


class AttentionQueue:
    """The entries of one probe's observers waiting to be measured (module docstring).
    ``waiting``: forwards whose gradient is still to come; ``stale``: entries not measured
    because a tensor changed in place before the flush; ``flushes``: flushes that measured something."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.waiting = 0
        self.stale = 0
        self.flushes = 0
        self._entries: list[tuple] = []  # (observer, (q, k, v, grad), versions, forward)
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, observer: AttentionObserver, tensors: tuple, versions: tuple, forward: bool) -> bool:
        """Queue one entry; True when the tensors kept are now past :attr:`max_bytes` (flush)."""
        self._entries.append((observer, tensors, versions, forward))
        self.nbytes += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return self.nbytes > self.max_bytes

    def clear(self) -> None:
        """Drop every entry (a pass that raised: nothing half-measured is recorded)."""
        self._entries, self.nbytes, self.waiting = [], 0, 0

    def flush(self) -> None:
        """Measure every entry queued, by groups of one shape, dtype, device and request, and
        record each layer's figures in the order queued."""
        entries = self._entries
        self._entries, self.nbytes = [], 0
        if not entries:
            return
        groups: dict = {}
        for i, (observer, tensors, versions, forward) in enumerate(entries):
            if _versions(tensors) != versions:  # written over in place since queued: not measured
                continue
            q, k, v, grad = tensors
            key = (q.shape[-2], q.shape[-1], q.dtype, k.dtype, q.device, forward, grad is not None,
                   None if grad is None else (v.shape[-1], v.dtype, grad.dtype), observer.scores, observer.probs,
                   observer.run.options.attention)
            groups.setdefault(key, []).append(i)
        got: list = [None] * len(entries)
        for key, idx in groups.items():
            items = [entries[i][1] for i in idx]
            for i, figures in zip(idx, summaries(items, scores=key[8], probs=key[9], panel=key[10],
                                                 forward=key[5])):
                got[i] = figures
        for (observer, tensors, _, forward), figures in zip(entries, got):
            if figures is None:
                self.stale += 1
                observer.lost()
            else:
                observer.record(figures)
        self.flushes += 1


class AttentionObserver:
    """The observer (:meth:`tinylm.MultiHeadSelfAttention.register_observer`) that measures the
    tinylm attention ``name``'s ``{name}.scores`` and ``{name}.probs`` (the leaves in ``want``).

    Weights the explicit path formed are measured as a Tap's output is. On the fused path the
    same figures come from q, k, v and the heads' gradient (:func:`.attention.statistics`),
    taken with the other layers' by the run's :class:`AttentionQueue`. When that gradient will
    come, the forward's figures wait for it and both are taken from one pass over the blocks;
    the forward's place among the run's records is held until its figures come by a record of
    no entries, which the first figures replace. A forward still waiting for its gradient at the
    next forward of the same attention, or on exit (:meth:`flush`), is queued alone then; the
    gradient of a forward queued early is measured alone."""

    def __init__(self, run, name: str, want: frozenset[str]):
        self.run, self.name = run, name
        self.scores, self.probs = "scores" in want, "probs" in want
        self.pending: list[dict] = []  # at most one forward whose figures wait for its gradient
        self.held: set = set()  # (store, key) of places held by a record of no entries
        self.at_once = False  # a tensor of this attention was once changed in place while queued

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
            for leaf in ("scores", "probs"):
                if getattr(self, leaf):
                    self._register(leaf, q.device)
            # kept as they are until measured (the graph holds them until their gradient anyway)
            entry = {"tensors": (q, k, v), "versions": _versions((q, k, v)), "forward": True}
            if run.options.backward and heads.requires_grad:
                self.pending.append(entry)
                run.attention_queue.waiting += 1
                heads.register_hook(self._hook(entry))
            else:
                self._queue(entry, None)
        run.seconds += time.perf_counter() - t0
        return None

    def _window_mask(self, scores: Tensor) -> Tensor | None:
        """The (T, T) mask of the entries a sliding-window attention may attend to (None without a
        window: the causal entries are the reducer's own)."""
        module = self.run.model.get_submodule(self.name)
        if getattr(module, "sliding_window", None) is None:
            return None
        return module.mask(scores.shape[-1], scores.device)

    def _queue(self, entry: dict, grad: Tensor | None) -> None:
        """Queue ``entry`` (its forward figures if still due, with ``grad``'s if given); measured
        now where this observer measures at once or the queue is past its bound."""
        queue = self.run.attention_queue
        forward = entry["forward"]
        entry["forward"] = False  # a later gradient of the same forward is measured alone
        if grad is None:  # the forward's figures alone: q and k (v is not read)
            tensors, versions = entry["tensors"][:2] + (None, None), entry["versions"][:2] + (None, None)
        else:
            tensors, versions = entry["tensors"] + (grad,), entry["versions"] + (grad._version,)
        if grad is not None:
            self._hold_backward(grad.device)
        if queue.add(self, tensors, versions, forward) or self.at_once:
            queue.flush()

    def flush(self) -> None:
        """Queue the forward still waiting for its gradient, if any (its figures alone)."""
        while self.pending:
            entry = self.pending.pop()
            self.run.attention_queue.waiting -= 1
            if entry["forward"]:
                self._queue(entry, None)

    def _register(self, leaf: str, device: torch.device) -> None:
        """The leaf's kind and order, and its places held until its first figures come."""
        run, key = self.run, f"{self.name}.{leaf}"
        if key not in run.kinds:
            run.kinds[key] = KINDS[leaf]
            run.order.append(key)
        if key == run.order[0]:
            run.steps += 1
        if (key, "forward") not in run._vec:
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

    def record(self, got: dict) -> None:
        """Record one entry's figures (:func:`.attention.summaries`' dict)."""
        s, p = f"{self.name}.scores", f"{self.name}.probs"
        self._record("vec", (s, "forward"), got["scores"])
        self._record("vec", (p, "forward"), got["probs"])
        self._record("attn", p, got["panel"])
        self._record("vec", (p, "backward"), got["probs_grad"])  # in the order autograd reaches them
        self._record("vec", (s, "backward"), got["scores_grad"])

    def _hold_backward(self, device: torch.device) -> None:
        """The gradient's places among the run's records, held where they have none yet (in the
        order autograd reaches them, as a measurement in the hook would have put them)."""
        run = self.run
        for leaf in ("probs", "scores"):
            key = (f"{self.name}.{leaf}", "backward")
            if getattr(self, leaf) and key not in run._vec:
                run._vec[key] = _held(device)[0]
                self.held.add(("vec", key))

    def lost(self) -> None:
        """An entry not measured (a tensor changed in place while queued): its places stay held (a
        record of no entries) until figures come; this observer measures at once from now on."""
        self.at_once = True

    def _hook(self, entry: dict):
        def hook(grad: Tensor) -> None:
            if not self.run.active:
                return None
            t0 = time.perf_counter()
            queue = self.run.attention_queue
            if any(e is entry for e in self.pending):
                self.pending = [e for e in self.pending if e is not entry]
                queue.waiting -= 1
            self._queue(entry, grad)
            if queue.waiting <= 0:  # the last gradient this pass waits for: the backward's attention is over
                queue.flush()
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
