"""The watch's precision trend: per-GEMM SQNR of one low-precision recipe at every record.

    watch = Watch(model, every=50, precision="tensorwise")          # or PrecisionWatch(...)

At a recorded step, and only then, a forward hook on every linear layer
(:func:`diagnostics.jobs.precision.linear_layers`: a leaf module with a 2-D weight whose output is
x W^T (+ b)) keeps its input x (the rows of a strided subsample of at most ``tokens`` tokens) and
its weight W, and a hook on its output's gradient receives g = dL/dy for the same rows. There, in
the step's own backward, the layer's three GEMMs (fprop y = x W^T, dgrad dx = g W, wgrad
dW = g^T x) are measured in the recipe by :func:`diagnostics.jobs.precision.measure_gemms` (theory
off): the same code and the same numbers as :func:`diagnostics.precision` on the same operands.
No extra forward or backward runs; the operands are dropped as soon as the layer's gradient has
been measured. The record gains ``"precision"``::

    {"tokens": m, "modules": {module: {"fprop", "dgrad", "wgrad",             # SQNR judged, dB
                                       "fprop_row", "dgrad_row", "wgrad_row", # typical row's, dB
                                       "input_peak", "grad_peak",             # max|.| / median|.|
                                       "underflow"}}}                         # share of non-zero
                                                                              # entries sent to 0
(the judged SQNR is the lower of the output's and its typical row's, as diagnostics.judge.precision
judges a GEMM) and the history's header ``"precision"``: {"recipe", "drop_db", "tokens",
"products"} (``products``: the layers whose input is the SwiGLU product, w2 / down_proj).

A subsample (a layer whose input has more than ``tokens`` rows; every s-th row, s = ceil(M /
tokens)) changes what is measured: fprop's and dgrad's SQNR are those of the sampled rows (a
tensorwise scale from the sampled rows' largest entry: a massive value at a token not sampled is
not seen), and wgrad's is the SQNR of the GEMM over the sampled tokens only (its signal adds up
over fewer tokens: it may read lower than the full GEMM's). The trend compares each GEMM with
itself measured the same way, so the drop it judges is not changed in kind.

Over several ranks each rank measures its own batch and keeps its own figures (not merged);
its alerts are its own.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from tinylm.validate import check, choice, integer, number

from ..errors import OptionsError
from ..judge.precision import module_role
from ..measure.quant import RECIPES, recipe as recipe_of
from ..result import Row
from .precision import _Capture, linear_layers, measure_gemms

__all__ = ["PrecisionWatch", "PrecisionTap", "precision_tap", "precision_rows", "precision_scalars", "GEMM_KEYS"]

#: the per-module keys of a record's "precision" entry
GEMM_KEYS = ("fprop", "dgrad", "wgrad", "fprop_row", "dgrad_row", "wgrad_row", "input_peak", "grad_peak",
             "underflow")


@dataclass(frozen=True)
class PrecisionWatch:
    """The watch's precision trend (module docstring).

    recipe: a name in diagnostics.measure.quant.RECIPES ("tensorwise", "rowwise", "mxfp8", "mxfp4",
        "nvfp4"): the recipe whose GEMMs are measured.
    drop_db: a GEMM whose SQNR falls more than this below its own first record is alerted (dB, > 0).
    tokens: the most token rows of a layer measured (a strided subsample above it; 0: every row).
    """

    recipe: str = "tensorwise"
    drop_db: float = 6.0
    tokens: int = 1024

    def __post_init__(self) -> None:
        choice("precision", self.recipe, RECIPES, fix="precision=\"tensorwise\" (or one of "
               + ", ".join(RECIPES) + ")", error=OptionsError)
        number("drop_db", self.drop_db, low=0.0, strict_low=True, fix="PrecisionWatch(drop_db=6.0)",
               error=OptionsError)
        integer("tokens", self.tokens, low=0, fix="PrecisionWatch(tokens=1024) (0: every row)", error=OptionsError)


def _options(value: Any) -> PrecisionWatch | None:
    """``Watch(precision=...)`` as options: None (off), a recipe name, or a PrecisionWatch."""
    if value is None or isinstance(value, PrecisionWatch):
        return value
    check("precision", value, lambda v: isinstance(v, str), "be a recipe name or a diagnostics.PrecisionWatch",
          fix="precision=\"tensorwise\" (or None: off)", error=OptionsError)
    return PrecisionWatch(recipe=value)


class _Hooks(_Capture):
    """precision()'s capture with its rows subsampled and theory off; the facts kept per layer."""

    def __init__(self, options: PrecisionWatch):
        super().__init__([recipe_of(options.recipe)], theory=False)
        self.tokens = options.tokens
        self.used = 0

    def _take(self, name: str, x: Tensor, w: Tensor, g: Tensor) -> None:
        g = g.reshape(-1, g.shape[-1])
        stride = 1 if not self.tokens or g.shape[0] <= self.tokens else -(-g.shape[0] // self.tokens)
        if stride > 1:
            x, g = x[::stride], g[::stride]
        self.used = max(self.used, int(g.shape[0]))
        with torch.no_grad():
            self.facts[name] = measure_gemms(x, w, g, self.recipes, theory=False)


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
        self._pending = _entry(hooks)

    def take(self) -> dict[str, Any]:
        """{"precision": the pending record entry} (and forget it), or {} when none is pending."""
        got, self._pending = self._pending, None
        return {} if not got else {"precision": got}


def _entry(hooks: _Hooks) -> dict[str, Any] | None:
    """The record's "precision" entry from a capture's facts (module docstring); None if none measured."""
    modules = {}
    for name in hooks.order:
        facts = {f["gemm"]: f for f in hooks.facts.get(name, ())}
        if not facts:
            continue
        entry = {}
        for gm, f in facts.items():
            entry[gm] = float(min(f["sqnr_db"], f["row_sqnr_db"]))
            entry[f"{gm}_row"] = float(f["row_sqnr_db"])
        ops = facts["fprop"]["operands"]
        grad = facts["dgrad"]["operands"]["grad_output"]
        entry["input_peak"] = float(ops["input"]["peak_to_median"])
        entry["grad_peak"] = float(grad["peak_to_median"])
        entry["underflow"] = float(max(f["underflow"] for f in facts.values()))
        modules[name] = entry
    return {"tokens": hooks.used, "modules": modules} if modules else None


def precision_tap(model: nn.Module, value: Any, history: dict[str, Any]) -> PrecisionTap:
    """The :class:`PrecisionTap` of ``Watch(precision=value)`` (value checked: a one-line error)."""
    return PrecisionTap(model, _options(value), history)


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def precision_rows(rec: dict[str, Any], common: dict[str, Any]) -> list[Row]:
    """The tidy rows of a record's "precision" entry: per linear layer (kind "linear", name the
    module), statistics ``sqnr_db`` and ``row_sqnr_db`` per GEMM (direction forward for fprop,
    backward for dgrad and wgrad, the GEMM in the statistic: ``sqnr_db_fprop``), ``peak_ratio``
    of its input (forward) and of its output's gradient (backward), ``frac_underflow``."""
    from ..measure.probe import block_index

    got = rec.get("precision")
    if not isinstance(got, dict):
        return []
    rows = []
    for name, e in (got.get("modules") or {}).items():
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
    got = rec.get("precision")
    out: dict[str, float] = {}
    for name, e in ((got or {}).get("modules") or {}).items():
        for gm in ("fprop", "dgrad", "wgrad"):
            out[f"watch/sqnr_db/{gm}/{name}"] = _num(e.get(gm))
        out[f"watch/input_peak/{name}"] = _num(e.get("input_peak"))
    return out
