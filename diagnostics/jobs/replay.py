"""``replay``: run one training step twice and name the first site where the two executions part ways.

    result = replay(model, step)          # step() is your forward and backward; it returns the loss
    result.verdict                        # "identical", "roundoff", "departs" or "not measured"
    result.first                          # the first row beyond roundoff (site, direction, block, ...)
    print(result)                         # the answer first
    opt.step()                            # the step the first execution prepared

Four stages. ``_first``: the real step, ``fn()``, under the hooks of
:class:`diagnostics.measure.step_record.StepRecorder` (the sites a diff pairs, each tensor and its
gradient reduced at once to moments and a sketch, as ``diff`` measures them). ``_rerun``: the
state the first execution left put aside (:class:`~diagnostics.measure.step_record.StepState`:
``.grad``, written buffers, modes, random generators), the state before it put back, ``fn()`` again
under the same hooks, then the first execution's state back. ``_rows``: the two executions paired
site by site (:func:`diagnostics.jobs.diff.compare_fingerprints`, in the order they ran: forward,
then backward from the loss), the loss, and each parameter's gradient compared exactly.
``_judge``: :mod:`diagnostics.judge.replay` (identical / roundoff / departs).

``fn`` is called exactly twice. The model is left as the first execution left it: the same
``.grad`` tensors, buffers, ``training`` flags and random generator states, so the optimizer step
that follows is the one the user would have taken. Nothing needs deterministic mode: a kernel that
sums in another order on each call gives ``roundoff``, not a false alarm.
"""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
from torch import nn

from tinylm.validate import boolean, integer

from ..errors import OptionsError
from ..judge.departure import Tolerance
from ..judge.replay import ReplayProtocol, Verdict
from ..measure.blocks import find_blocks
from ..measure.step_record import StepRecorder, StepState
from ..measure.wrappers import eager, is_compiled, unwrap
from .diff import DiffRow, compare_fingerprints
from .fingerprint import FORMAT, PROJECTION_SEED, VERSION, Fingerprint, SiteRecord, _gaussian, diff_sites

__all__ = ["replay", "ReplayOptions", "ReplayResult", "ReplayRow", "ReplayError", "REPLAY_COLUMNS"]

REPLAY_SCHEMA_VERSION = "1"
#: the projection matrices G and H, keyed by everything they depend on (rows, k, axis, seed, device)
#: and shared by the replays of a run; emptied when it holds more than _CACHE_MAX
_PROJECTIONS: dict = {}
_CACHE_MAX = 64
#: the tidy columns of ReplayResult.to_frame()
REPLAY_COLUMNS = ("site", "direction", "block", "kind", "departure", "tolerance", "ratio", "depth", "dtype",
                  "first_rms", "rerun_rms", "module")


class ReplayError(OptionsError):
    """A step that replay cannot rerun faithfully (it steps the optimizer itself, it is not callable)."""


@dataclass(frozen=True)
class ReplayOptions:
    """How :func:`diagnostics.replay` measures the two executions.

    k: the sketch size per axis (as DiffOptions.k): each site's tensor, flattened to (N, width),
        is kept as the k x k matrix G^T X H / k.
    backward: also compare the gradient of the loss with respect to every site.
    gradients: also compare each parameter's ``.grad`` exactly (no sketch: the first execution's
        gradients are kept anyway, to be put back).
    rng: put the random generators back before the rerun (both executions draw the same dropout
        masks) and, after it, as the first execution left them.
    tolerance: a diagnostics.judge.departure.Tolerance (None = the calibrated defaults of diff).
    exact: judge every difference as a departure (the tolerance 0), for a step whose kernels are
        known to be deterministic (a CPU; a GPU in deterministic mode). In bfloat16 and float16 the
        roundoff tolerance is above what one changed element moves a large tensor by, so only
        exact names such a fault where it happens (docs/replay.md).
    """

    k: int = 32
    backward: bool = True
    gradients: bool = True
    rng: bool = True
    tolerance: Tolerance | None = field(default=None)
    exact: bool = False

    def __post_init__(self) -> None:
        integer("k", self.k, low=2, high=1024, fix="k=N (32 is the default)", error=OptionsError)
        for name in ("backward", "gradients", "rng", "exact"):
            boolean(name, getattr(self, name), error=OptionsError)
        if self.tolerance is not None and not isinstance(self.tolerance, Tolerance):
            raise OptionsError(f"tolerance={self.tolerance!r}: must be a diagnostics.judge.departure.Tolerance; "
                               "pass Tolerance(...) or None for the defaults")


@dataclass
class ReplayRow:
    """One site (or parameter gradient, or the loss) and direction: ``departure`` ||rerun - first||
    / ||first|| (sketched for sites, exact for gradients and the loss), ``tolerance``, ``ratio``
    = departure / tolerance, ``depth`` l of the tolerance formula, the dtype, each execution's
    root mean square and the module (or parameter) name."""

    site: str
    direction: str
    block: int | None
    kind: str
    departure: float
    tolerance: float
    ratio: float
    depth: int
    dtype: str
    first_rms: float
    rerun_rms: float
    module: str

    @property
    def departs(self) -> bool:
        return not (self.ratio <= 1.0)


def _num(v):
    return v if not isinstance(v, float) or math.isfinite(v) else str(v)


@dataclass
class ReplayResult:
    """The verdict of a replay (:mod:`diagnostics.judge.replay`), ``first`` the first departing
    row (None unless the verdict is departs), ``rows`` in judging order, ``unpaired`` what one
    execution had and the other lacked, ``losses`` (first, rerun) and ``loss``, the value the
    first execution's ``fn()`` returned (the step's own loss)."""

    verdict: str
    first: ReplayRow | None
    rows: list[ReplayRow]
    unpaired: list[tuple[str, str]]
    losses: tuple[float, float]
    meaning: str
    action: str
    reproduced: bool | None
    loss: object = field(default=None, repr=False)
    schema_version: str = field(default=REPLAY_SCHEMA_VERSION)

    @property
    def first_difference(self) -> ReplayRow | None:
        """The first row that differs at all (departure > 0), within tolerance or not: where a
        non-deterministic kernel first shows, or a fault too small for the tolerance."""
        return next((r for r in self.rows if r.departure != 0.0), None)

    def to_frame(self):
        """Tidy rows, one per site (parameter, loss) and direction (columns ``REPLAY_COLUMNS``)."""
        import pandas as pd

        return pd.DataFrame([asdict(r) for r in self.rows], columns=list(REPLAY_COLUMNS))

    def to_dict(self) -> dict:
        return {"schema_version": self.schema_version, "summary": str(self), "verdict": self.verdict,
                "reproduced": self.reproduced, "meaning": self.meaning, "action": self.action,
                "first": None if self.first is None else {k: _num(v) for k, v in asdict(self.first).items()},
                "first_difference": None if self.first_difference is None else
                self.first_difference.site + f" ({self.first_difference.direction})",
                "losses": [_num(x) for x in self.losses], "columns": list(REPLAY_COLUMNS),
                "rows": [[_num(getattr(r, c)) for c in REPLAY_COLUMNS] for r in self.rows],
                "unpaired": [list(u) for u in self.unpaired]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    def __str__(self) -> str:
        sites = len({r.site for r in self.rows if r.kind not in ("param_grad", "loss")})
        grads = sum(r.kind == "param_grad" for r in self.rows)
        what = f"{sites} sites, {grads} parameter gradients and the loss"
        if self.verdict == "departs":
            f = self.first
            return (f"the rerun departs at {f.site} ({f.direction}): {f.departure:.2g} vs tolerance "
                    f"{f.tolerance:.2g} — not reproducible: suspect the hardware, or a kernel that is not "
                    "deterministic beyond roundoff")
        if self.verdict == "identical":
            return f"identical: the rerun reproduced the step bit for bit ({what})"
        if self.verdict == "roundoff":
            top = max(self.rows, key=lambda r: r.ratio)
            d = self.first_difference
            return (f"roundoff: the rerun reproduced the step within roundoff ({what}; largest departure "
                    f"{top.ratio:.2g}x its tolerance, at {top.site} ({top.direction}); first difference at "
                    f"{d.site} ({d.direction}))")
        return f"not measured: {self.meaning}"

    def __repr__(self) -> str:
        return f"ReplayResult({self})"


# ----------------------------------------------------------------------------- the stages


@torch.no_grad()
def reduce_site(x: torch.Tensor, k: int, cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`diagnostics.jobs.fingerprint.sketch` of ``x`` (the same moments and sketch, to float64
    rounding) in fewer passes over the tensor: the finite count read from x as it is, one float64
    copy with its non-finite entries zeroed in place, the norms in one op each."""
    x = x.detach()
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)
    finite = torch.isfinite(x2).sum()
    xd = x2.double().nan_to_num_(0.0, 0.0, 0.0)
    n = finite.clamp(min=1).double()
    moments = torch.stack([finite.double(), xd.sum() / n, torch.linalg.vector_norm(xd).square() / n,
                           torch.linalg.vector_norm(xd, float("inf")) if xd.numel() else xd.new_zeros(()),
                           x2.numel() - finite.double()])
    G = _gaussian(xd.shape[0], k, "rows", PROJECTION_SEED, xd.device, cache)
    H = _gaussian(xd.shape[1], k, "columns", PROJECTION_SEED, xd.device, cache)
    return moments, G.T @ (xd @ H) / k


def _execute(recorder: StepRecorder, fn, compiled: bool):
    with recorder.recording():
        if compiled:
            with eager():
                return fn()
        return fn()


def _first(model, fn, options, sites, stack, state, protocol, compiled):
    """The real step under the hooks; refuses a step that wrote the parameters (an optimizer step inside)."""
    protocol.first()
    state.begin()
    if len(_PROJECTIONS) > _CACHE_MAX:
        _PROJECTIONS.clear()
    recorder = StepRecorder(model, sites, stack, options.k, options.backward, reduce_site, _PROJECTIONS)
    loss = _execute(recorder, fn, compiled)
    changed = state.changed_parameters()
    if changed:
        raise ReplayError(f"fn wrote parameter(s) {', '.join(changed[:3])} in place: fn must be the forward and "
                          "backward of the step only; pass a fn without the optimizer step and step after replay")
    return loss, recorder


def _rerun(model, fn, options, sites, stack, state, protocol, compiled):
    """The rerun from the state before the first execution; the first execution's state back after it.
    Returns (its loss, its recorder, its parameter gradients)."""
    protocol.rerun()
    state.between()
    try:
        recorder = StepRecorder(model, sites, stack, options.k, options.backward, reduce_site, _PROJECTIONS)
        loss = _execute(recorder, fn, compiled)
        grads = [p.grad for _, p in state.params]
    finally:
        state.end()
    return loss, recorder, grads


def _fingerprint(recorder: StepRecorder, k: int) -> Fingerprint:
    moments, sketches = recorder.host()
    records = [SiteRecord(key, site.module, site.kind, site.block, site.order, direction, dtype, shape,
                          *[float(v) for v in m], sketch=s)
               for (key, site, direction, _, _, dtype, shape), m, s in zip(recorder.records, moments, sketches)]
    meta = {"format": FORMAT, "version": VERSION, "tokens_sha256": "", "k": k, "projection_seed": PROJECTION_SEED}
    return Fingerprint(meta, np.zeros((0, 0), dtype=np.int64), records)


def _site_row(r: DiffRow) -> ReplayRow:
    return ReplayRow(r.site, r.direction, r.block, r.kind, r.departure, r.tolerance, r.ratio, r.depth,
                     r.reference_dtype, r.reference_rms, r.candidate_rms, r.reference_module)


def _float(x) -> float:
    if isinstance(x, torch.Tensor):
        return float(x.detach().double().reshape(-1)[0]) if x.numel() else math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _scalar_departure(a: float, b: float) -> float:
    """|b - a| / |a|: 0 when equal (NaN equal to NaN), inf where only one is finite or a is 0."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)) or a == 0.0:
        return math.inf
    return abs(b - a) / abs(a)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rms(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64)) / math.sqrt(max(t.numel(), 1))


@torch.no_grad()
def _grad_departure(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float, bool]:
    """(||b - a|| / ||a||, rms a, rms b, equal bit for bit) of two gradients; NaN equal to NaN where
    both have it; no float64 copy unless they differ."""
    a, b = _local(a), _local(b)
    same = torch.equal(a, b) or (a.shape == b.shape and bool(torch.equal(a.isnan(), b.isnan()))
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))
    ra = _rms(a)
    if same:
        return 0.0, ra, ra, True
    na = float(torch.linalg.vector_norm(a, dtype=torch.float64))
    d = float(torch.linalg.vector_norm(b.double() - a.double())) / na if na > 0 else math.inf
    return (d if math.isfinite(d) else math.inf), ra, _rms(b), False


def _grad_rows(state: StepState, grads, tol: Tolerance, width: int, depth: int, stack) -> tuple[list, bool]:
    """One row per parameter gradient: the exact relative distance of the rerun's from the first's."""
    rows, bitwise = [], True
    for (name, p), a, b in zip(state.params, state.first_grads, grads):
        if a is None and b is None:
            continue
        if a is None or b is None:
            dep, ra, rb, same = math.inf, math.nan, math.nan, False
        else:
            dep, ra, rb, same = _grad_departure(a, b)
        bitwise = bitwise and same
        dtype = str((a if a is not None else b).dtype).removeprefix("torch.")
        t = tol((dtype, dtype), width, depth, "backward")
        block = stack.index(name) if stack is not None else None
        rows.append(ReplayRow(name, "backward", block, "param_grad", dep, t, dep / t, depth, dtype, ra, rb, name))
    return rows, bitwise


def _loss_row(first, rerun, tol: Tolerance, width: int, depth: int) -> tuple[ReplayRow, bool]:
    a, b = _float(first), _float(rerun)
    dep = _scalar_departure(a, b)
    dtype = str(first.dtype).removeprefix("torch.") if isinstance(first, torch.Tensor) else "float64"
    t = tol((dtype, dtype), width, depth, "forward")
    same = a == b or (math.isnan(a) and math.isnan(b))
    return ReplayRow("loss", "forward", None, "loss", dep, t, dep / t, depth, dtype, abs(a), abs(b), ""), same


def _same_record(x: SiteRecord, y: SiteRecord | None) -> bool:
    """Whether two records are equal bit for bit (sketch and moments; an unpaired one is not)."""
    fields = ("count", "mean", "mean_square", "max_abs", "nonfinite")
    return y is not None and np.array_equal(x.sketch, y.sketch) and \
        all(getattr(x, f) == getattr(y, f) for f in fields)


def _rows(first_rec, rerun_rec, first_loss, rerun_loss, state, grads, options, stack):
    """(rows in judging order, unpaired, bitwise): sites as the two executions ran them, the loss
    before the first gradient, then each parameter's gradient."""
    tol = options.tolerance or Tolerance()
    a, b = _fingerprint(first_rec, options.k), _fingerprint(rerun_rec, options.k)
    result = compare_fingerprints(a, b, tol)
    order = {(r.key, r.direction): i for i, r in enumerate(a.records)}
    site_rows = sorted(result.rows, key=lambda r: order[(r.site, r.direction)])
    bitwise = all(_same_record(x, b.record(x.key, x.direction)) for x in a.records)
    blocks = 1 + max([r.block for r in a.records if r.block is not None] or [-1])
    width = next((r.shape[-1] for r in a.records if r.key == "embedding"), 1)
    tokens = next((int(np.prod(r.shape[:-1])) for r in a.records if r.key == "embedding"), width)
    loss_row, same_loss = _loss_row(first_loss, rerun_loss, tol, width, blocks + 2)
    rows = [_site_row(r) for r in site_rows]
    at = next((i for i, r in enumerate(rows) if r.direction == "backward"), len(rows))
    rows.insert(at, loss_row)
    same_grads = True
    if options.gradients:
        grad_rows, same_grads = _grad_rows(state, grads, tol, max(width, tokens), 2 * blocks + 3, stack)
        rows += grad_rows
    if options.exact:  # any difference departs: tolerance 0
        rows = [replace(r, tolerance=0.0, ratio=0.0 if r.departure == 0.0 else math.inf) for r in rows]
    return rows, result.unpaired, bitwise and same_loss and same_grads


#: model -> (its module names, its diff sites, its block stack): a watched loop replays one model often
_SITES: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _sites_of(model: nn.Module) -> tuple[list, object]:
    """(diff_sites, find_blocks) of ``model``, kept while its module names stay the same."""
    names = tuple(n for n, _ in model.named_modules())
    kept = _SITES.get(model)
    if kept is None or kept[0] != names:
        kept = (names, diff_sites(model), find_blocks(model))
        _SITES[model] = kept
    return kept[1], kept[2]


def replay(model: nn.Module, fn, options: ReplayOptions | None = None) -> ReplayResult:
    """Run ``fn`` (the forward and backward of one step; it returns the loss) twice under the
    fingerprint hooks and judge whether the rerun reproduced the first execution, site by site.

    Args:
        model: the model ``fn`` runs (any ``nn.Module`` the diff pairs: tinylm, a Hugging Face
            causal LM, a module with a block stack; a ``torch.compile`` or DDP wrapper is seen
            through, and a compiled model runs eagerly for both executions so its sites are seen).
        fn: a callable of no arguments: the step's forward and backward, returning the loss. It
            must not step the optimizer.
        options: :class:`ReplayOptions`.
    Returns:
        a :class:`ReplayResult`; the model is left as the first execution left it (module docstring).
    """
    if not isinstance(model, nn.Module):
        raise OptionsError(f"model={type(model).__name__}: must be a torch.nn.Module; pass the model fn runs")
    if not callable(fn):
        raise ReplayError(f"fn={fn!r}: must be a callable of no arguments that runs the step's forward and "
                          "backward and returns the loss; pass lambda: step(batch)")
    options = options or ReplayOptions()
    compiled = is_compiled(model)
    inner = unwrap(model)
    sites, stack = _sites_of(inner)
    protocol, state = ReplayProtocol(), StepState(inner, options.rng)
    first_loss, first_rec = _first(inner, fn, options, sites, stack, state, protocol, compiled)
    rerun_loss, rerun_rec, grads = _rerun(inner, fn, options, sites, stack, state, protocol, compiled)
    rows, unpaired, bitwise = _rows(first_rec, rerun_rec, first_loss, rerun_loss, state, grads, options, stack)
    verdict: Verdict = protocol.judge([r.ratio for r in rows], [r.departure for r in rows], bitwise)
    first = None if protocol.first_index is None else rows[protocol.first_index]
    return ReplayResult(verdict.name, first, rows, unpaired, (_float(first_loss), _float(rerun_loss)),
                        verdict.meaning, verdict.action, verdict.reproduced, loss=first_loss)
