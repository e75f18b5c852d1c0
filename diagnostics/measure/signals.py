"""Precursor signals a probe takes when ``ProbeOptions.signals`` is on (the watch turns it on).

Kept as float64 tensors on the measured tensors' device and merged as they come (no host
transfer); :meth:`Signals.entries` hands them to :func:`diagnostics.measure.distributed.exchange`
with the rest of a record, and :meth:`Signals.read` turns the merged values into the record's
figures.

* Attention, per layer (key: its probs name, ``layers.i.attn.probs`` for tinylm,
  ``{module}.probs`` for a ``scaled_dot_product_attention`` call or an eager softmax):
  max_logit = the largest |attention logit| over the unmasked entries (scale applied);
  entropy_ceiling = mean over the measured rows of ln(n_t), n_t = the keys row t may attend
  to. The sampled rows of :mod:`.sdpa` and :mod:`.eager_attention` give both; a tinylm
  attention gives max_logit from its scores' moments (their max |x| over the causal
  entries) and its ceiling from its shape: every row t of each (batch, head) matrix,
  n_t = min(t + 1, W) (W: the sliding window, else T), so per matrix
  sum_t ln n_t = ln(min(T, W)!) + (T - min(T, W)) ln W.
* The head's output logits z (..., V): per row log Z_t = logsumexp_j z_tj in float32 at least,
  kept as its moments (mean, variance and max |log Z| merge exactly over batches and ranks),
  and max_logit = max |z| over the finite logits.
* The residual stream (block outputs, kind "residual") and the head: the peak ratio
  max|x| / median|x|, max over every finite entry, the median (torch's: the lower of the two
  middle values) over the finite entries of a sample of rows: x as (N, d) rows of its last
  dimension, the rows of :func:`.sdpa.sample_rows` (every row up to 64, else 64 evenly
  spaced) x all d features. NaN when that median is 0 or there is no finite entry. Several
  passes and ranks merge as the largest ratio. On the CPU's default path one numba call gives
  it (:func:`._numba_rows.peak`: the median selected exactly from the bits, the same figure).

Merges: max_logit and the peak ratio by the largest value (NaN ignored unless every value is
NaN), the ceiling's sums by addition, log Z's moments by Chan's update.
"""

from __future__ import annotations

import functools
import math
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import tinylm

from . import numba_reducer, reduction
from .moments import Moments
from .reducer import merge_vectors, reduce
from .sdpa import ROWS, sample_rows

__all__ = ["Signals", "peak_ratio", "log_partition", "causal_ceiling", "init_drift", "PEAK_KINDS"]

#: the kinds of site whose peak ratio is measured: the residual stream and the head's logits
PEAK_KINDS = ("residual", "logits")


def _wide(t: Tensor) -> Tensor:
    return t.detach().to(torch.promote_types(t.dtype, torch.float32))


_LOOP_DTYPES = (torch.float32, torch.float64)
_PLAIN = (Tensor, torch.nn.Parameter)


def _loop_reads(a: Tensor, max_abs: Tensor) -> bool:
    """Whether :func:`peak_ratio` of the rows ``a`` takes numba's loop: CPU float32/float64
    contiguous plain tensors (and a CPU ``max_abs``) under ``TINYLM_REDUCER=auto``, where nothing
    observes the ops (:func:`.reduction.direct`) and the loop is compiled (:func:`.numba_reducer.ready`)."""
    return a.is_cpu and max_abs.is_cpu and a.dtype in _LOOP_DTYPES and type(a) in _PLAIN and a.is_contiguous() \
        and a.numel() > 0 and reduction.direct() and reduction.all_numba(())


@functools.lru_cache(maxsize=64)
def _sampled(n: int, rows: int) -> np.ndarray:
    """:func:`.sdpa.sample_rows` as int64 numpy, made once per (rows of x, rows sampled)."""
    got = sample_rows(n, rows).numpy()
    got.flags.writeable = False
    return got


@torch.no_grad()
def peak_ratio(x: Tensor, max_abs: Tensor | None = None, rows: int = ROWS) -> Tensor:
    """(1,) float64: max|x| / median|x| (module docstring); ``max_abs``: max |x| over the finite
    entries when already known (a 0-d or (1,) tensor), else taken here."""
    a = x.detach().reshape(-1, x.shape[-1]) if x.dim() else x.detach().reshape(1, 1)
    if max_abs is not None and _loop_reads(a, max_abs):  # one call, the same bits
        top = float(max_abs.reshape(-1)[0])
        idx = _sampled(a.shape[0], rows)
        return torch.tensor([numba_reducer.peak_loop()(a.numpy(), idx, top)], dtype=torch.float64)
    if max_abs is None:
        full = _wide(a).abs()
        max_abs = torch.where(torch.isfinite(full), full, 0.0).amax() if full.numel() else full.new_zeros(())
    idx = sample_rows(a.shape[0], rows).to(a.device)
    s = _wide(a.index_select(0, idx)).abs()
    median = torch.where(torch.isfinite(s), s, math.nan).nanmedian().double()
    top = max_abs.reshape(()).double()
    return torch.where(median > 0, top / median, math.nan).reshape(1)


@torch.no_grad()
def log_partition(z: Tensor) -> Tensor:
    """log Z_t = logsumexp over the last dimension of each row of ``z``, in float32 at least."""
    return torch.logsumexp(_wide(z), dim=-1)


def causal_ceiling(T: int, window: int | None = None) -> float:
    """sum over the rows t = 0..T-1 of ln(min(t + 1, W)) (W = ``window``, else T): one causal
    matrix's share of the entropy ceiling."""
    if T <= 0:
        return 0.0
    w = T if window is None else int(window)
    n = min(T, w)
    return math.lgamma(n + 1) + (T - n) * math.log(w)


def _fmax(a: Tensor | None, b: Tensor) -> Tensor:
    return b if a is None else torch.fmax(a, b)


def _add(a: Any, b: Any) -> Any:
    """a + b for two tensors or two lists of floats (a None: b)."""
    if a is None:
        return b
    return a + b if isinstance(a, Tensor) else [x + y for x, y in zip(a, b)]


class Signals:
    """The signals of one probe run (module docstring), filled by the probe's hooks and watchers."""

    def __init__(self) -> None:
        self._max: dict[str, Tensor] = {}  # probs name -> (1,) largest |attention logit|
        self._ceiling: dict[str, Any] = {}  # probs name -> [sum of ln n_t, rows] (a tensor or host floats)
        self._scores: dict[str, str] = {}  # tinylm probs name -> its scores name (max_logit from their moments)
        self._peak: dict[str, Tensor] = {}  # site -> (1,) peak ratio
        self._logz: Tensor | None = None  # FIELDS of log Z
        self._logit_max: Tensor | None = None  # (1,) max |logit|
        #: site -> the dtype its forward output had ("float16", "bfloat16", "float32", ...): the
        #: format its gradient is computed in, which the underflow judgement reads (host strings)
        self.dtypes: dict[str, str] = {}

    # -- filled while the model runs (no host transfer)
    def forward(self, name: str, kind: str, out: Tensor, moments: Tensor) -> None:
        """A measured forward output (``moments``: its FIELDS vector): the peak ratio of the
        residual stream and the head, and the head's log Z and largest logit; every site's dtype."""
        self.dtypes[name] = str(out.dtype).removeprefix("torch.")
        if kind not in PEAK_KINDS or out.dim() < 1 or out.numel() == 0:
            return
        self._peak[name] = _fmax(self._peak.get(name), peak_ratio(out, moments[4]))
        if kind == "logits":
            lz = reduce(log_partition(out)).moments
            self._logz = lz if self._logz is None else merge_vectors(self._logz, lz)
            self._logit_max = _fmax(self._logit_max, moments[4:5].double())

    def attention(self, module: str, vec: Tensor) -> None:
        """A sampled attention call of ``module`` (SDPA or eager): its :data:`.sdpa.SIGNAL` vector."""
        key = f"{module}.probs"
        self._max[key] = _fmax(self._max.get(key), vec[0:1])
        self._ceiling[key] = _add(self._ceiling.get(key), vec[1:3])

    def attach(self, run: Any, model: nn.Module, points: dict[str, str], owner: ExitStack) -> None:
        """Observe each tinylm attention whose probs are among ``points`` for its entropy ceiling
        (the observer owned by ``owner``; it counts only while ``run.active``)."""
        for name, module in model.named_modules():
            key = f"{name}.probs"
            if isinstance(module, tinylm.MultiHeadSelfAttention) and key in points:
                self._scores[key] = f"{name}.scores"
                owner.callback(module.register_observer(self._shape_observer(run, key, module)).remove)

    def _shape_observer(self, run: Any, key: str, module: nn.Module):
        def observe(q: Tensor, k: Tensor, v: Tensor, heads: Tensor, weights) -> None:
            if not run.active or q.dim() < 2:
                return None
            T = q.shape[-2]
            matrices = q.numel() // max(T * q.shape[-1], 1)
            share = [matrices * causal_ceiling(T, getattr(module, "sliding_window", None)), float(matrices * T)]
            self._ceiling[key] = _add(self._ceiling.get(key), share)
            return None
        return observe

    # -- moved with the record
    def entries(self, tensors: dict[tuple[str, str], Tensor]) -> list[tuple[str, str, Any]]:
        """The :func:`~diagnostics.measure.distributed.exchange` entries of everything measured;
        ``tensors``: the probe's {(name, direction): FIELDS vector} (a tinylm attention's max_logit
        is its scores' max |x|)."""
        out: list[tuple[str, str, Any]] = []
        for key in self._names():
            largest = self._max.get(key)
            scores = tensors.get((self._scores.get(key, ""), "forward"))
            if largest is None:
                largest = scores[4:5] if scores is not None and key in self._scores else [math.nan]
            out.append((f"s/am/{key}", "max", largest))
            out.append((f"s/ac/{key}", "sum", self._ceiling.get(key, [0.0, 0.0])))
        out += [(f"s/peak/{site}", "max", v) for site, v in self._peak.items()]
        if self._logz is not None:
            out += [("s/logz", "moments", self._logz), ("s/logit_max", "max", self._logit_max)]
        return out

    def _names(self) -> list[str]:
        return list(dict.fromkeys([*self._max, *self._scores, *self._ceiling]))

    def read(self, got: dict[str, Any]) -> tuple[dict[str, dict[str, float]], tuple[Moments, float] | None,
                                                 dict[str, float]]:
        """(attention {probs name: {max_logit, entropy_ceiling}}, (the Moments of log Z, the largest
        |logit|) or None without a head, {site: peak ratio}) from what
        :func:`~diagnostics.measure.distributed.exchange` returned for :meth:`entries`."""
        attention = {}
        for key in self._names():
            total, rows = got[f"s/ac/{key}"]
            attention[key] = {"max_logit": float(got[f"s/am/{key}"][0]),
                              "entropy_ceiling": total / rows if rows else math.nan}
        peaks = {site: float(got[f"s/peak/{site}"][0]) for site in self._peak}
        logz = None
        if self._logz is not None and got.get("s/logz") is not None:
            logz = (Moments.from_vector(got["s/logz"]), float(got["s/logit_max"][0]))
        return attention, logz, peaks


@torch.no_grad()
def init_drift(model: nn.Module, params: dict[str, Tensor] | None = None) -> Tensor | None:
    """The median over the block matrices (2-D parameters of a block) of std(W) / the std its
    declared init scheme intends (``tinylm.init.declare`` of ``model.config.init``), read from
    ``params`` (the values to judge, e.g. the copies taken before a step; None: the model's own),
    as a (1,) float64 tensor on the weights' device (no host transfer). None for a model without
    a declared scheme or without such a matrix, and for sharded weights (FSDP2's DTensors: a
    shard's std is not its matrix's), which every rank skips alike."""
    scheme = getattr(getattr(model, "config", None), "init", None)
    if not scheme:
        return None
    from tinylm.init import declare

    try:
        declared = declare(model, scheme)
    except Exception:  # a scheme that cannot describe this model: nothing declared to compare with
        return None
    own = dict(model.named_parameters())
    ratios = []
    for name, dist in declared.items():
        w = (params or {}).get(name, own.get(name))
        std = getattr(dist, "actual_std", None)
        if w is None or w.dim() != 2 or tinylm.plan.block_index(name) is None or not std:
            continue
        w = w.detach()
        if type(w) is not Tensor:  # a shard (DTensor): its std is not its matrix's
            return None
        ratios.append(w.float().std() / std)
    if not ratios:
        return None
    return torch.stack(ratios).median().double().reshape(1)
