"""The probe's deferred queue: a pass's plain tensors reduced together, by one call per flush.

    queue = Pending()
    if queue.takes(x):
        if queue.add(("layers.0.ln1", "forward"), x):   # True: over a bound, flush now
            queue.flush(store)
    ...
    queue.flush(store)            # store: {key: FIELDS vector}, merged in the order added
    queue.flush(store, {"cos": cos, "flat": flat})   # and the entries of other stores

Most of what a probe measures is *plain*: the moments of a tensor and nothing else (no row
mean squares, cosines, attention panel, causal entries or extras). Reduced one at a time in
its hook, each such tensor costs a crossing into the kernel and, around it, the Python of the
reducer's memory, its result and its merge; on the CPU that Python costs several times the
numba loop of a small tensor, and on a GPU each is at least one kernel launch. Here a plain
request is kept as (key, tensor, the tensor's version) and :meth:`Pending.flush` reduces every
tensor queued by :func:`.reduction.many`: one call into numba's loop over them all (the same
loop, the same bits as one call each), or one ``tinylm::summaries`` op on any other path.

With rows. A request that asks for more than the moments (a residual point's cosine and inverse
row mean squares, a gate's count below an edge, a norm's per-token factor and its gradient's
weighted figure) waits here too where the numba loop reads its tensor as it is
(:meth:`Pending.takes_rows`): :meth:`Pending.add_rows` keeps it in a :class:`.pending_rows.Rows`,
whose every tensor and per-token vector the flush makes by one more call
(:mod:`.pending_rows`), and each part it asked for is an entry of the store it goes to (tags:
None the moments', ``"cos"``, ``"inv"``, ``"flat"``, ``"normb"``; ``"later"`` a norm's factor,
kept in a :class:`.pending_rows.Later` and merged nowhere).

Order. The results merge into the store in the order they were added, each key's vectors one
after the other exactly as the hooks would have merged them (so a probe that spans several
passes gets the same bits); :meth:`Pending.ready` queues a vector that was reduced at once for
a key that still has entries waiting, so that it too merges in its turn. On the CPU the merges
of different keys run as numpy rows (elementwise, the same operations as one merge each).

Read once. A tensor queued again while it waits (a branch is the output of its last
projection; a gradient passes unchanged to the branch added at a residual point) is read once
and its moments serve every key it was queued for.

Changed in place. A tensor whose ``_version`` moved between queueing and the flush was written
over in place: its values are no longer the ones the hook saw. Its entries are not measured
(a key with nothing else gets the vector of no entries: "not measured", never a wrong figure)
and :attr:`Pending.stale` counts them (:attr:`Pending.stale_keys`: the probe reduces those sites
of the model in their hooks from then on, so only the pass that found them loses them).

Bounds. Queued tensors stay alive until the flush. The probe flushes the forward's tensors at
the first gradient (until then autograd holds most of them anyway, and none is held through the
backward) and the gradients' at its exit; gradients are not alive otherwise. :data:`MAX_BYTES`
(16 MiB) bounds that extra memory, and :data:`MAX_COUNT` the entries: past either,
:meth:`Pending.add` asks for a flush. 16 MiB holds the tensors of each direction of a launch-
bound pass (those of the d_model 64, 24-layer, T 32, batch 4 benchmark: one flush each), where
the queue pays off; a pass of larger tensors flushes every 16 MiB, and one call that reads 16
MiB costs its read, not its dispatch (on a GPU, 16 MiB per call is well past the launch-bound
size), while the memory a probe adds stays small beside the model's. A tensor of
:data:`~.numba_reducer.PARALLEL_MIN` entries or more is queued too (so the ops a probe adds do
not depend on the tensors' sizes); on the numba path the threads split it at the flush as they
would in the hook (the same bits while the thread count is the same).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from tinylm.validate import check

from ..options import OptionsError
from . import numba_reducer, reduction
from .pending_rows import Later, Rows
from .reducer import merge_np, merge_vectors, reduce

__all__ = ["Pending", "Later", "MAX_BYTES", "MAX_COUNT"]

#: bytes of queued tensors past which :meth:`Pending.add` asks for a flush (module docstring)
MAX_BYTES = 16 << 20
#: entries past which :meth:`Pending.add` asks for a flush
MAX_COUNT = 4096

_PLAIN = (Tensor, torch.nn.Parameter)
_F32, _STRIDED = torch.float32, torch.strided


class Pending:
    """The queue of one probe (module docstring). ``max_count``, ``max_bytes``: the bounds past
    which :meth:`add` asks for a flush. ``stale``: entries not measured because their tensor
    changed in place before the flush; ``flushes``: the flushes that reduced something."""

    def __init__(self, max_count: int = MAX_COUNT, max_bytes: int = MAX_BYTES):
        check("max_count", max_count, lambda v: isinstance(v, int) and v >= 1, "be a positive int (entries queued)",
              fix=f"e.g. {MAX_COUNT}", error=OptionsError)
        check("max_bytes", max_bytes, lambda v: isinstance(v, int) and v >= 0, "be an int >= 0 (bytes queued)",
              fix=f"e.g. {MAX_BYTES}", error=OptionsError)
        self.max_count, self.max_bytes = max_count, max_bytes
        #: CPU float32 tensors take the numba loop (TINYLM_REDUCER auto, numba ready), asked once
        self._numba = reduction.all_numba(())
        self.stale = 0
        #: the keys of the entries not measured (``stale``)
        self.stale_keys: set = set()
        self.flushes = 0
        self._clear()

    def _clear(self) -> None:
        self._xs: list[Tensor] = []  # each tensor once (per version)
        self._loop = True  # every tensor queued is one the numba loop reads as it is (:meth:`takes`)
        self._vers: list[int] = []  # its _version when queued
        self._ids: dict[int, int] = {}  # id(tensor) -> its last index (the queue holds it: ids are unique)
        self._entries: list[tuple] = []  # (tag, key, index into _xs, a vector reduced at once, or a rows part)
        self._keys: set = set()  # keys of the moments' store; (tag, key) of the others'
        self._bytes = 0
        self._rows = Rows()  # the requests with rows (:mod:`.pending_rows`)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        """Whether ``key`` has entries waiting (a vector for it must then wait its turn: :meth:`ready`)."""
        return key in self._keys

    def waits(self, tag, key) -> bool:
        """Whether ``key`` of the store ``tag`` (None: the moments') has entries waiting."""
        return (key if tag is None else (tag, key)) in self._keys

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors queued."""
        return self._bytes

    def takes(self, x: Tensor) -> bool:
        """Whether ``x`` can wait here: a tensor the op reduces (:func:`.reduction.route`: plain,
        strided, non-empty, of its dtypes). Checked first, in a few attribute reads: a CPU float32
        tensor that numba's loop reads as it is (contiguous, fewer than
        :data:`~.numba_reducer.PARALLEL_MIN` entries), which a flush of only those reads without
        checking each again (:func:`_loop`)."""
        if type(x) not in _PLAIN:
            return False
        if self._numba and x.dtype is _F32 and x.is_cpu and x.layout is _STRIDED and x.is_contiguous() \
                and not x.is_neg() and 0 < x.numel() < numba_reducer.PARALLEL_MIN and x.ndim:  # most tensors
            return numba_reducer.has_memory(x)
        if reduction.route(x) is None:
            return False
        self._loop = False  # flushed through reduction.many
        return True

    def add(self, key, x: Tensor) -> bool:
        """Queue the moments of ``x`` (a tensor :meth:`takes`) for ``key``; True when the queue is
        now past a bound (the caller flushes)."""
        version = x._version
        i = self._ids.get(id(x))
        if i is None or self._vers[i] != version:
            i = len(self._xs)
            self._xs.append(x)
            self._vers.append(version)
            self._ids[id(x)] = i
            self._bytes += x.numel() * x.element_size()
        self._entries.append((None, key, i))
        self._keys.add(key)
        return len(self._entries) >= self.max_count or self._bytes > self.max_bytes

    def takes_rows(self, x: Tensor) -> bool:
        """Whether a request with rows (or a count below an edge) of ``x`` can wait here
        (:meth:`.pending_rows.Rows.takes`, on the numba path)."""
        return self._numba and Rows.takes(x)

    def add_rows(self, x: Tensor, parts: list[tuple], rows: bool = False, cosine: bool = False,
                 below: float = math.nan, eps: float = -1.0, weight=None) -> tuple[bool, Later | None]:
        """Queue a request with rows of ``x`` (a tensor :meth:`takes_rows`): ``parts``, each
        (tag, key, part), merges that part into the store ``tag`` (None: the moments') under
        ``key``: ``"moments"``, ``"cosine"``, ``"below"`` ([entries below ``below``, entries]),
        ``"vector"`` (the FIELDS of 1 / (row_ms + ``eps``), or of row_ms * ``weight``: a
        :class:`Later` or a float32 tensor), ``"later"`` (that vector kept for later: tag
        ``"later"``, merged nowhere). Returns (past a bound: the caller flushes, the
        :class:`Later` of a ``"later"`` part, else None)."""
        before = self._rows.nbytes
        i = self._rows.tensor(x, rows, cosine, below)
        self._bytes += self._rows.nbytes - before
        j, later = None, None
        for tag, key, part in parts:
            if part in ("vector", "later") and j is None:
                keep = any(p == "later" for _, _, p in parts)
                j = self._rows.vector(i, eps, weight, keep)
                later = self._rows.laters[j]
            what = ("v", j) if part in ("vector", "later") else (part, i)
            self._entries.append((tag, key, what))
            self._keys.add(key if tag is None else (tag, key))
        return len(self._entries) >= self.max_count or self._bytes > self.max_bytes, later

    def ready(self, key, vec: Tensor, tag=None) -> None:
        """Queue a vector already reduced for ``key`` (one with entries waiting) of the store
        ``tag`` (None: the moments'), to merge in its turn."""
        self._entries.append((tag, key, vec))

    def flush(self, store: dict, others: dict | None = None) -> int:
        """Reduce every tensor queued and merge each entry's vector into ``store`` ({key: FIELDS
        vector}), or into ``others[tag]`` for an entry of another store (``"flat"``: summed, the
        others merged as FIELDS), in the order added; empties the queue. Returns the entries merged."""
        entries, xs, versions, loop, requests = self._entries, self._xs, self._vers, self._loop, self._rows
        self._clear()
        if not entries:
            return 0
        rows = _reduced(xs, versions, loop and self._numba) if xs else []
        parts, summaries = requests.reduce() if len(requests) else ([], [])
        vectors, missing = [], {}
        for tag, key, what in entries:
            if type(what) is int:
                vec, stale = rows[what], rows[what] is None
            elif type(what) is tuple:
                vec, stale = _part(parts, summaries, requests, what)
            else:
                vec, stale = what, False
            if stale:  # changed in place before it was read
                self.stale += 1
                self.stale_keys.add(_site(tag, key))
                if tag is None:
                    missing.setdefault(key, "cpu" if type(what) is tuple else xs[what].device)
            elif vec is not None and tag != "later":
                vectors.append((tag, key, vec))
        _merge_in({None: store, **(others or {})}, vectors)
        for key, device in missing.items():
            if key not in store:
                store[key] = torch.zeros(10, dtype=torch.float64, device=device)
        self.flushes += 1
        return len(entries)


#: the direction of a site whose figure a store other than the moments' holds (keyed by name)
_DIRECTION = {"cos": "forward", "inv": "forward", "flat": "forward", "normb": "backward", "later": "norm"}


def _site(tag, key):
    """The (name, direction) of an entry's site (what :attr:`Pending.stale_keys` holds)."""
    return key if tag is None else (key, _DIRECTION.get(tag, tag))


def _part(parts: list, summaries: list, requests: Rows, what: tuple) -> tuple[Tensor | None, bool]:
    """(the vector of a rows entry or None, whether its tensor changed in place before the flush)."""
    code, i = what
    if code == "v":
        return summaries[i], parts[requests.source(i)] is None
    got = parts[i]
    if got is None:
        return None, True
    return got[("moments", "cosine", "below").index(code)], False


def _loop(xs: list[Tensor]) -> Tensor:
    """(N, 10): the moments of CPU float32 tensors that the numba loop reads as they are (contiguous,
    fewer than PARALLEL_MIN entries: :meth:`Pending.takes`) from one call into it, without the
    per-tensor checks of :func:`.reduction.many` (done when queued): what it gives them, bit for bit."""
    k = numba_reducer._loops or numba_reducer._build()
    n = len(xs)
    addrs = np.fromiter([x.data_ptr() for x in xs], np.int64, n)
    sizes = np.fromiter([x.numel() for x in xs], np.int64, n)
    return torch.from_numpy(k.many_at(addrs, sizes, 0, np.zeros(n, dtype=np.bool_))[:, :10])


def _reduced(xs: list[Tensor], versions: list[int], loop: bool) -> list[Tensor | None]:
    """The FIELDS vector of each tensor (None for one changed in place since it was queued): one
    call for all of them (``loop``: each read as it is by the numba loop, where nothing observes
    the ops, :func:`.reduction.direct`; else :func:`.reduction.many`) where they take one kernel
    on one device, else one per (kernel, device) group, else :func:`.reducer.reduce` each."""
    live = [i for i, (x, v) in enumerate(zip(xs, versions)) if x._version == v]
    out: list[Tensor | None] = [None] * len(xs)
    if not live:
        return out
    if len(live) == len(xs):
        got = _loop(xs) if loop and reduction.direct() else reduction.many(xs)
        if got is not None:
            return list(got.unbind(0))
    groups: dict = {}
    for i in live:
        groups.setdefault((reduction.route(xs[i]), xs[i].device), []).append(i)
    for (kernel, _), idx in groups.items():
        got = reduction.many([xs[i] for i in idx]) if kernel is not None else None
        vecs = list(got.unbind(0)) if got is not None else [reduce(xs[i]).moments for i in idx]
        for i, v in zip(idx, vecs):
            out[i] = v
    return out


def _merge_in(stores: dict, vectors: list[tuple]) -> None:
    """Merge (tag, key, vector) triples into ``stores[tag]`` in their order: by rounds (a key's
    first vector in round 0, its second in round 1, ...), each round's CPU merges as numpy rows at
    once (:func:`.reducer.merge_np`; the ``"flat"`` store's counts summed), any other vector by
    :func:`.reducer.merge_vectors` (or ``torch.add``)."""
    rounds: list[list[tuple]] = []
    depth: dict = {}
    for tag, key, vec in vectors:
        r = depth.get((tag, key), 0)
        depth[(tag, key)] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append((tag, key, vec))
    for group in rounds:
        old: dict = {}
        for tag, key, vec in group:
            store = stores[tag]
            have = store.get(key)
            if have is None:
                store[key] = vec
            elif have.is_cpu and vec.is_cpu:
                old.setdefault(tag == "flat", []).append((store, key, have, vec))
            else:
                store[key] = torch.add(have, vec) if tag == "flat" else merge_vectors(have, vec)
        for flat, merges in old.items():
            a = np.stack([have.numpy() for _, _, have, _ in merges])
            b = np.stack([vec.numpy() for _, _, _, vec in merges])
            for (store, key, _, _), row in zip(merges, torch.from_numpy(a + b if flat else merge_np(a, b)).unbind(0)):
                store[key] = row
