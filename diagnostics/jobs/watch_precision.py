"""The watch's precision trend: per-GEMM SQNR of one low-precision recipe at every record.

    watch = Watch(model, every=50, precision="tensorwise")          # or PrecisionWatch(...)

At a recorded step, and only then, a forward hook on every linear layer
(:func:`diagnostics.jobs.precision.linear_layers`: a leaf module with a 2-D weight whose output is
x W^T (+ b), checked on the pass but for ``nn.Linear`` and tinylm's ``Linear``) keeps its input x,
and a hook on its output's gradient receives g = dL/dy; there, in the step's own backward, the
layer's candidate rows of x and g (below) and a copy of its weight W are kept, with no host read
(the weight is copied because the optimizer may change it before the step ends). After the step
the layer's three GEMMs (fprop y = x W^T, dgrad dx = g W, wgrad dW = g^T x) are measured in the
recipe by :func:`gemm_sqnr`: the casts, products and SQNR of
:func:`diagnostics.jobs.precision.measure_gemms` (equal to the bit on the same operands), without
its theory and its operands' descriptions. No extra forward or backward runs, and nothing is read
on the host inside them; the kept operands are dropped once measured. The record gains ``"precision"``::

    {"tokens": m, "modules": {module: {"fprop", "dgrad", "wgrad",             # SQNR judged, dB
                                       "fprop_row", "dgrad_row", "wgrad_row", # typical row's, dB
                                       "input_peak", "grad_peak",             # max|.| / median|.|
                                       "underflow"}}}                         # share of non-zero
                                                                              # entries sent to 0
(the judged SQNR is the lower of the output's and its typical row's, as diagnostics.judge.precision
judges a GEMM; ``m`` the most token rows measured in a layer) and the history's header
``"precision"``: {"recipe", "drop_db", "tokens", "products"} (``products``: the layers whose input
is the SwiGLU product, w2 / down_proj).

Token rows are subsampled where a layer sees more than ``tokens`` (64 by default): every s-th row
from row 0, s = ceil(M / tokens), and the rows holding the largest |x| and the largest |g|
(:func:`sample_rows`). A scale per tensor is then the whole tensor's, a scale per row or per block
along the contraction is each row's own, so every sampled output row of fprop and dgrad is exactly
the full GEMM's row: their SQNR is that of the sampled rows, an estimate of the whole's (the
output's SQNR a power-weighted mean over rows, the typical row's a median over them), and the
rows of a massive activation are always among them. wgrad contracts over the tokens: its SQNR is
that of the GEMM over the sampled tokens (its signal sums fewer tokens; where they add coherently
it reads lower than the full GEMM's). The trend compares each GEMM with itself measured the same
way. ``tokens=0`` measures every row (a record's cost grows with the rows measured:
docs/benchmarks.md).

Over several ranks each rank measures its own batch and keeps its own figures (not merged);
its alerts are its own.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor, nn

import tinylm
from tinylm.validate import check, choice, integer, number

from ..errors import OptionsError
from ..judge.precision import module_role
from ..judge.precision_trend import record_modules
from ..measure.quant import GEMMS, RECIPES, Recipe, quantize, recipe as recipe_of
from ..result import Row
from .precision import _NAMES, _TRANSPOSED, _Capture, _fprop_difference, _sqnr_db, gemm_operands, linear_layers

__all__ = ["PrecisionWatch", "PrecisionTap", "precision_tap", "precision_rows", "precision_scalars", "GEMM_KEYS",
           "gemm_sqnr", "sample_rows", "peak_ratio"]

#: the per-module keys of a record's "precision" entry
GEMM_KEYS = ("fprop", "dgrad", "wgrad", "fprop_row", "dgrad_row", "wgrad_row", "input_peak", "grad_peak",
             "underflow")


@dataclass(frozen=True)
class PrecisionWatch:
    """The watch's precision trend (module docstring).

    recipe: a name in diagnostics.measure.quant.RECIPES ("tensorwise", "rowwise", "mxfp8", "mxfp4",
        "nvfp4"): the recipe whose GEMMs are measured.
    drop_db: a GEMM whose SQNR falls more than this below its own first record is alerted (dB, > 0).
    tokens: the most token rows of a layer measured (a strided subsample and the rows of the largest
        entries above it, module docstring; 0: every row).
    """

    recipe: str = "tensorwise"
    drop_db: float = 6.0
    tokens: int = 64

    def __post_init__(self) -> None:
        choice("recipe", self.recipe, RECIPES, fix="PrecisionWatch(recipe=\"tensorwise\") (or one of "
               + ", ".join(RECIPES) + ")", error=OptionsError)
        number("drop_db", self.drop_db, low=0.0, strict_low=True, fix="PrecisionWatch(drop_db=6.0)",
               error=OptionsError)
        integer("tokens", self.tokens, low=0, fix="PrecisionWatch(tokens=64) (0: every row)", error=OptionsError)


def _options(value: Any) -> PrecisionWatch | None:
    """``Watch(precision=...)`` as options: None (off), a recipe name, or a PrecisionWatch."""
    if value is None or isinstance(value, PrecisionWatch):
        return value
    check("precision", value, lambda v: isinstance(v, str), "be a recipe name or a diagnostics.PrecisionWatch",
          fix="precision=\"tensorwise\" (or None: off)", error=OptionsError)
    choice("precision", value, RECIPES, fix="precision=\"tensorwise\" (or one of " + ", ".join(RECIPES) + ")",
           error=OptionsError)
    return PrecisionWatch(recipe=value)


#: module classes whose forward is known to be x W^T (+ b): no check of it on the pass
_KNOWN = (nn.Linear, tinylm.Linear)


class _Hooks(_Capture):
    """precision()'s capture with its rows subsampled and theory off. Nothing is read on the host
    inside the forward or the backward: a layer's fprop check (for classes not known to be x W^T),
    its candidate rows and a copy of its weight are kept as tensors when its gradient arrives, and
    :meth:`measure` chooses the rows and measures the GEMMs after the step (module docstring)."""

    def __init__(self, options: PrecisionWatch):
        super().__init__([recipe_of(options.recipe)], theory=False)
        self.tokens = options.tokens
        self.used = 0
        self._kept: dict[str, tuple] = {}  # name: (x rows, g rows, candidate row indices or None, W copy)
        self._checks: dict[str, Tensor] = {}  # name: the fprop check's relative difference (a 0-d tensor)

    def _check(self, name: str, mod: nn.Module, orient: str | None, x: Tensor, y: Tensor) -> str:
        """The fprop check kept as a tensor, read by :meth:`measure` (none for classes known to be x W^T)."""
        if type(mod) not in _KNOWN:
            self._checks[name] = _fprop_difference(mod, orient, x, y)
        return ""

    def _take(self, name: str, x: Tensor, w: Tensor, g: Tensor) -> None:
        g = g.detach().reshape(-1, g.shape[-1])
        with torch.no_grad():
            if self.tokens and g.shape[0] > self.tokens:
                cand = candidate_rows(x, g, self.tokens)
                self._kept[name] = (x.index_select(0, cand), g.index_select(0, cand), cand, w.clone())
            else:
                self._kept[name] = (x, g, None, w.clone())

    def measure(self) -> None:
        """The kept layers' GEMMs measured (after the step: host reads allowed); a layer whose output
        the fprop check found not to be x W^T (+ b) is skipped with why."""
        diffs = dict(zip(self._checks, torch.stack(list(self._checks.values())).tolist())) if self._checks else {}
        for name, (x, g, cand, w) in self._kept.items():
            if diffs.get(name, 0.0) >= 3e-2:
                self.skipped[name] = f"its output is not x W^T (+ b) (relative difference {diffs[name]:.2g})"
                continue
            if cand is not None:  # the distinct candidate rows, in row order: sample_rows' rows
                at = distinct(cand)
                x, g = x.index_select(0, at), g.index_select(0, at)
            self.used = max(self.used, int(g.shape[0]))
            with torch.no_grad():
                self.facts[name] = gemm_sqnr(x, w, g, self.recipes[0])
        self._kept.clear()


def candidate_rows(x: Tensor, g: Tensor, tokens: int) -> Tensor:
    """The rows :func:`sample_rows` chooses, before duplicates go: every s-th row from row 0, s =
    ceil(M / tokens), then the rows holding the largest |x| and the largest |g| (no host read)."""
    m = x.shape[0]
    stride = -(-m // tokens)
    top = torch.stack([x.abs().amax(1).argmax(), g.abs().amax(1).argmax()])
    return torch.cat([torch.arange(0, m, stride, device=x.device), top])


def sample_rows(x: Tensor, g: Tensor, tokens: int) -> Tensor:
    """The rows measured of x (M, K) and g (M, N) when M > ``tokens``: every s-th, s = ceil(M /
    tokens), from row 0, and the rows that hold the largest |x| and the largest |g| (so that a
    scale per tensor is the whole tensor's, and a massive activation is always among them), in
    row order, each once."""
    cand = candidate_rows(x, g, tokens)
    return cand.index_select(0, distinct(cand))


def distinct(cand: Tensor) -> Tensor:
    """Positions in ``cand`` (row indices) of each distinct row's first occurrence, in row order
    (one host read)."""
    _, first = np.unique(cand.cpu().numpy(), return_index=True)
    return torch.from_numpy(first).to(cand.device)


#: entries of an operand whose median |.| is taken for its peak / median (a strided sample beyond)
PEAK_SAMPLE = 4096


def peak_ratio(t: Tensor) -> float:
    """max |t| / the median |t| of its non-zero entries (those of a strided sample of at least
    :data:`PEAK_SAMPLE` entries, all of them in a smaller tensor); NaN for an all-zero tensor, inf
    when that median is 0. A figure for the trend (the sample's median is within a few percent of
    the whole's), the peak itself exact."""
    flat = t.detach().reshape(-1)
    lo, hi = torch.aminmax(flat)
    sample = flat[::max(1, flat.numel() // PEAK_SAMPLE)].abs()
    sample = sample[sample > 0]
    if sample.numel() == 0:
        return math.nan
    med, top = torch.stack([sample.median(), torch.maximum(hi, -lo)]).tolist()
    return top / med if med > 0 else math.inf


def gemm_sqnr(x: Tensor, w: Tensor, g: Tensor, rc: Recipe) -> dict[str, Any]:
    """One layer's three GEMMs in recipe ``rc``: {gemm: (sqnr_db, row_sqnr_db, underflow)} and the
    peaks of x and g. The SQNRs and the underflow share are those of
    :func:`diagnostics.jobs.precision.measure_gemms` (the same casts, cached per operand and layout
    the same way, and the same products: equal to the bit), without its theory and its operands'
    descriptions (kurtosis, channels), which the trend does not keep."""
    x, w, g = (t.detach().to(torch.float32) for t in (x, w, g))
    ops = gemm_operands(x, w, g)
    cache: dict = {}
    out: dict[str, Any] = {}
    for gm in GEMMS:
        left, right = ops[gm]
        ref = left @ right.t()
        signal = ref.square().sum(1).double()
        qs = []
        for side, c in enumerate(rc.casts(gm)):
            name, flip = _NAMES[gm][side], _TRANSPOSED[gm][side]
            key = (name, c) if c.granularity == "tensor" else (name, flip, c)
            if key not in cache:
                t = ops[gm][side]
                q, _ = quantize(t, c, stats=False)
                # zeros after and before (a zero stays zero: the new ones underflowed), entries
                cache[key] = (q, flip, torch.stack([(q == 0).sum(), (t == 0).sum()]), t.numel())
            q, was, counts, n = cache[key]
            qs.append((q if was == flip else q.t(), counts, n))
        out[gm] = (*_sqnr_db(signal, ref, qs[0][0] @ qs[1][0].t()), qs[0][1:], qs[1][1:])
    zeros = {id(c): c for gm in GEMMS for c in (out[gm][2][0], out[gm][3][0])}
    read = dict(zip(zeros, torch.stack(list(zeros.values())).tolist()))  # one read for every count
    for gm in GEMMS:
        sqnr, row, (a, na), (b, nb) = out[gm]
        (qa, za), (qb, zb) = read[id(a)], read[id(b)]
        out[gm] = (sqnr, row, (qa - za + qb - zb) / max(na - za + nb - zb, 1))
    out["input_peak"], out["grad_peak"] = peak_ratio(x), peak_ratio(g)
    return out


class PrecisionTap:
    """Hooks on the linear layers for a recorded step (:meth:`capture`) and the record's entry (:meth:`take`).

    Args:
        model: the watched module (unwrapped).
        options: a :class:`PrecisionWatch`, or None (off: :meth:`capture` does nothing, :meth:`take` gives {}).
        history: the watch's history (its header gets ``"precision"``).
    """

    def __init__(self, model: nn.Module, options: PrecisionWatch | None, history: dict[str, Any]):
        self.options = options
        self.layers = linear_layers(model) if options is not None else []
        self._hooks: _Hooks | None = None
        self._pending: dict[str, Any] | None = None
        if options is not None:
            products = [n for n, _ in self.layers if module_role(n, False) == "swiglu_product"]
            history["precision"] = {"recipe": options.recipe, "drop_db": float(options.drop_db),
                                    "tokens": int(options.tokens), "products": products}

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """The hooks on for the forward and backward inside; removed on exit, whatever happens."""
        if self.options is None:
            yield
            return
        hooks = _Hooks(self.options)
        with contextlib.ExitStack() as undo:
            for name, mod in self.layers:
                undo.enter_context(mod.register_forward_hook(hooks.forward_hook(name, mod), with_kwargs=True))
            yield
        hooks.measure()
        self._pending = _entry(hooks)

    def take(self) -> dict[str, Any]:
        """{"precision": the pending record entry} (and forget it), or {} when none is pending."""
        got, self._pending = self._pending, None
        return {} if not got else {"precision": got}


def _entry(hooks: _Hooks) -> dict[str, Any] | None:
    """The record's "precision" entry from a capture's facts (module docstring); None if none measured."""
    modules = {}
    for name in hooks.order:
        facts = hooks.facts.get(name)
        if not facts:
            continue
        entry = {}
        for gm in GEMMS:
            sqnr, row, _ = facts[gm]
            entry[gm], entry[f"{gm}_row"] = float(min(sqnr, row)), float(row)
        entry["input_peak"], entry["grad_peak"] = float(facts["input_peak"]), float(facts["grad_peak"])
        entry["underflow"] = float(max(facts[gm][2] for gm in GEMMS))
        modules[name] = entry
    return {"tokens": hooks.used, "modules": modules} if modules else None


def precision_tap(model: nn.Module, value: Any, history: dict[str, Any]) -> PrecisionTap:
    """The :class:`PrecisionTap` of ``Watch(precision=value)`` (value checked: a one-line error)."""
    return PrecisionTap(model, _options(value), history)


def _num(x: Any) -> float:
    """A stored figure as a float (NaN where it is missing or not a number)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def precision_rows(rec: dict[str, Any], common: dict[str, Any]) -> list[Row]:
    """The tidy rows of a record's "precision" entry: per linear layer (kind "linear", name the
    module), statistics ``sqnr_db`` and ``row_sqnr_db`` per GEMM (direction forward for fprop,
    backward for dgrad and wgrad, the GEMM in the statistic: ``sqnr_db_fprop``), ``peak_ratio``
    of its input (forward) and of its output's gradient (backward), ``frac_underflow``."""
    from ..measure.probe import block_index

    rows = []
    for name, e in record_modules(rec).items():
        at = dict(common, step=rec["step"], name=name, kind="linear", block=block_index(name))
        for gm in ("fprop", "dgrad", "wgrad"):
            d = "forward" if gm == "fprop" else "backward"
            rows.append(Row(**at, direction=d, statistic=f"sqnr_db_{gm}", value=_num(e.get(gm))))
            rows.append(Row(**at, direction=d, statistic=f"row_sqnr_db_{gm}", value=_num(e.get(f"{gm}_row"))))
        rows.append(Row(**at, direction="forward", statistic="peak_ratio_input", value=_num(e.get("input_peak"))))
        rows.append(Row(**at, direction="backward", statistic="peak_ratio_grad", value=_num(e.get("grad_peak"))))
        rows.append(Row(**at, statistic="frac_underflow_quant", value=_num(e.get("underflow"))))
    return rows


def precision_scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The record's precision figures as scalars, named as the TensorBoard and W&B writers write them:
    ``watch/sqnr_db/<gemm>/<module>`` and ``watch/input_peak/<module>``."""
    out: dict[str, float] = {}
    for name, e in record_modules(rec).items():
        for gm in ("fprop", "dgrad", "wgrad"):
            out[f"watch/sqnr_db/{gm}/{name}"] = _num(e.get(gm))
        out[f"watch/input_peak/{name}"] = _num(e.get("input_peak"))
    return out
