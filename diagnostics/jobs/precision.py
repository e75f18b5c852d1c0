"""``precision``: a quantization what-if for every GEMM of every linear layer of any model.

    result = precision(model)                       # tensorwise, rowwise, mxfp8
    print(result)                                   # per recipe: what to keep in bf16
    result.to_frame()                               # module, gemm, recipe, sqnr_db, predicted_sqnr_db, ...
    convert_to_float8_training(model, module_filter_fn=result.module_filter_fn("tensorwise"))

Stages. ``_batch``: the measured tokens (diff's conventions: batch_size, seq_len, seed, inputs,
tokens). ``_capture``: one forward and backward in the model's own precision (next-token
cross-entropy in float32 from the logits); a forward hook on each linear layer (a module whose
forward is one GEMM with a 2-D weight: ``nn.Linear``, tinylm's ``Linear``, Hugging Face's
``Conv1D``; checked on the pass: its output must be x W^T (+ b)) holds its input x and weight W,
and a hook on its output's gradient receives g = dL/dy. ``_measure``: each of the layer's three
GEMMs (fprop y = x W^T, dgrad dx = g W, wgrad dW = g^T x) recomputed in float32 from the
unquantized operands (the reference) and from the operands cast per recipe
(diagnostics.measure.quant), SQNR measured, theory beside it (diagnostics.theory.quant); done in
the gradient hook, so no operand outlives its layer's backward. ``_judge``: verdicts, causes and
fixes (diagnostics.judge.precision). The model is left exactly as it was (parameters, ``.grad``,
``requires_grad``, ``training``; every hook removed, whatever happens).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from tinylm.validate import boolean, check, choice, integer

from ..judge.precision import PrecisionThresholds, judge_gemm, module_role, worst_operand
from ..measure.blocks import find_blocks
from ..measure.outputs import read_output
from ..measure.quant import GEMMS, RECIPES, Recipe, quantize, recipe as recipe_of
from ..options import OptionsError
from ..theory.loss_cost import descent_lost, fisher, gemm_loss_costs
from ..theory.quant import GemmTheory, describe_operand, element_noise, noise_sums, unit_ideal_noise
from .fingerprint import batch_of
from .precision_result import PrecisionResult, PrecisionRow

__all__ = ["precision", "PrecisionOptions", "linear_layers", "gemm_operands", "measure_gemms"]

DEFAULT_RECIPES = ("tensorwise", "rowwise", "mxfp8")


@dataclass(frozen=True)
class PrecisionOptions:
    """What :func:`diagnostics.precision` measures.

    recipes: names in diagnostics.measure.quant.RECIPES ("tensorwise", "rowwise", "mxfp8", "mxfp4",
        "nvfp4") or Recipe objects.
    batch_size, seq_len, seed, inputs: the measured batch, as DiffOptions' (seq_len None = min(model
        context, 256), 128 when the model states no context).
    theory: also predict each GEMM's SQNR (about a sixth of the cost).
    thresholds: a diagnostics.judge.precision.PrecisionThresholds (None = the defaults).
    modules: None measures every linear layer; else a callable (module, name) -> bool choosing them.
    """

    recipes: tuple = DEFAULT_RECIPES
    batch_size: int = 4
    seq_len: int | None = None
    seed: int = 0
    inputs: Callable[[Any], Any] | None = field(default=None, compare=False)
    theory: bool = True
    thresholds: PrecisionThresholds | None = None
    modules: Callable[[nn.Module, str], bool] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        recipes = (self.recipes,) if isinstance(self.recipes, (str, Recipe)) else tuple(self.recipes)
        check("recipes", self.recipes, lambda _: len(recipes) > 0, "name at least one recipe",
              fix="recipes=(" + ", ".join(repr(r) for r in DEFAULT_RECIPES) + ")", error=OptionsError)
        for r in recipes:
            if not isinstance(r, Recipe):
                choice("recipes", r, RECIPES, fix="names from " + ", ".join(RECIPES), error=OptionsError)
        object.__setattr__(self, "recipes", recipes)
        integer("batch_size", self.batch_size, low=1, fix="batch_size=N", error=OptionsError)
        if self.seq_len is not None:
            integer("seq_len", self.seq_len, low=2, fix="seq_len=N (or None for the default)", error=OptionsError)
        integer("seed", self.seed, low=0, high=2**63 - 1, fix="seed=N", error=OptionsError)
        boolean("theory", self.theory, error=OptionsError)
        for name in ("inputs", "modules"):
            if getattr(self, name) is not None:
                check(name, getattr(self, name), callable, "be a callable", error=OptionsError)


def _orientation(module: nn.Module) -> str | None:
    """"out_in" (weight (out, in): y = x W^T) or "in_out" (Conv1D: y = x W), None for no 2-D weight."""
    w = getattr(module, "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 2 or not w.is_floating_point() or isinstance(module, nn.Embedding):
        return None
    if any(True for _ in module.children()):
        return None
    return "in_out" if type(module).__name__ == "Conv1D" else "out_in"


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every leaf module with a 2-D floating weight (a candidate linear layer), in registration order;
    whether its forward is one GEMM is checked on the pass."""
    return [(n, m) for n, m in model.named_modules() if n and _orientation(m) is not None]


def gemm_operands(x: Tensor, w: Tensor, g: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """Per GEMM its (left, right) operands, both contracted along their last dimension, out = left right^T:
    fprop (x, W), dgrad (g, W^T), wgrad (g^T, x^T); x (M, K), W (N, K), g (M, N)."""
    return {"fprop": (x, w), "dgrad": (g, w.t()), "wgrad": (g.t(), x.t())}  # views: a cast copies where it groups


#: per GEMM, whether its (left, right) operand is the transpose of the layer's x, W or g
_TRANSPOSED = {"fprop": (False, False), "dgrad": (False, True), "wgrad": (True, True)}


def _db(signal: float, noise: float) -> float:
    if not math.isfinite(noise):
        return -math.inf
    return math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)


def _sqnr_db(signal_rows: Tensor, ref: Tensor, out: Tensor) -> tuple[float, float]:
    """(the output's SQNR, the median over its rows of each row's SQNR), from the reference's power per
    row. The first is dominated by the rows of largest power; the second is what a typical row (token,
    or output feature for wgrad) gets."""
    noise_rows = out.sub_(ref).square_().sum(1).double()
    whole = _db(float(signal_rows.sum()), float(noise_rows.sum()))
    keep = signal_rows > 0
    if not bool(keep.any()):
        return whole, whole
    rows = 10 * torch.log10(signal_rows[keep] / noise_rows[keep])
    return whole, float(rows.nan_to_num(nan=-math.inf).median())


_NAMES = {"fprop": ("input", "weight"), "dgrad": ("grad_output", "weight"), "wgrad": ("grad_output", "input")}


class _Operands:
    """What every recipe reads of a layer's x, W and g, computed once: each operand's zero count, its
    squares summed along each dimension (rows: dim 1; columns: dim 0), and for theory its unit ideal
    variances summed the same ways."""

    def __init__(self, x: Tensor, w: Tensor, g: Tensor, theory: bool):
        self.t = {"input": x, "weight": w, "grad_output": g}
        self.zeros, self.power, self.unit = {}, {}, {}
        for name, t in self.t.items():
            sq = t.square()
            self.power[name] = (sq.sum(1), sq.sum(0))  # rows of t, rows of t^T
            self.zeros[name] = int((t == 0).sum())
            if theory:
                u = unit_ideal_noise(t)
                self.unit[name] = (u.sum(0), u.sum(1))  # summed over t's rows (t contracted), over t^T's rows

    def rows(self, name: str, flip: bool) -> Tensor:
        """Each row's sum of squares of the operand as a GEMM takes it (transposed where ``flip``)."""
        return self.power[name][1 if flip else 0]

    def cols(self, name: str, flip: bool) -> Tensor:
        """Each column's (contraction index's) sum of squares of the operand as a GEMM takes it."""
        return self.power[name][0 if flip else 1]

    def theory(self, gm: str, signal: float) -> GemmTheory:
        """The GEMM's recipe-independent theory."""
        (nl, fl), (nr, fr) = zip(_NAMES[gm], _TRANSPOSED[gm])
        return GemmTheory.from_sums(self.cols(nl, fl), self.cols(nr, fr), signal,
                                    (self.unit[nl][int(fl)], self.unit[nr][int(fr)]))


def measure_gemms(x: Tensor, w: Tensor, g: Tensor, recipes: list[Recipe], theory: bool = True,
                  sequences: int = 1) -> list[dict]:
    """Each GEMM of one layer in each recipe: the measured and predicted facts (a dict per GEMM and
    recipe), from x (M, K), W (N, K) and g (M, N) in any float dtype; the M rows are ``sequences``
    sequences of equal length, in order (for the predicted loss increase, diagnostics.theory.loss_cost)."""
    x, w, g = (t.detach().to(torch.float32) for t in (x, w, g))
    ops = gemm_operands(x, w, g)
    facts = _Operands(x, w, g, theory)
    described = {nm: describe_operand(t.t() if nm == "weight" else t, facts.cols(nm, nm == "weight"), facts.zeros[nm])
                 for nm, t in facts.t.items()}
    refs = {gm: left @ right.t() for gm, (left, right) in ops.items()}
    signal = {gm: r.square().sum(1).double() for gm, r in refs.items()}
    theories = {gm: facts.theory(gm, float(signal[gm].sum())) for gm in GEMMS} if theory else {}
    carries = gemm_loss_costs(x, g, refs, sequences)
    out = []
    for rc in recipes:
        cache: dict = {}
        for gm in GEMMS:
            casts = rc.casts(gm)
            q = [_cast(cache, facts, gm, side, ops[gm][side], c, theory) for side, c in enumerate(casts)]
            product = q[0][0] @ q[1][0].t()
            cost = _loss_cost(gm, product, refs[gm], g, carries, sequences)
            sqnr, row_sqnr = _sqnr_db(signal[gm], refs[gm], product)
            st = [s for _, s, _ in q]
            fact = {"recipe": rc.name, "gemm": gm, "sqnr_db": sqnr, "row_sqnr_db": row_sqnr, "predicted_loss": cost,
                    "m": x.shape[0],
                    "n": w.shape[0], "k": x.shape[1], **_range_facts(st)}
            fact["operands"] = {nm: {**described[nm], "name": nm, "format": c.format.name if c.format else "hp",
                                     "granularity": c.granularity, "underflow": s.underflow / max(s.nonzero, 1),
                                     "overflow": s.overflow / max(s.nonzero, 1),
                                     "relative_noise": s.noise / s.power if s.power > 0 else 0.0,
                                     "typical_relative_noise": s.typical_relative_noise}
                                for nm, c, s in zip(_NAMES[gm], casts, st)}
            if theory:
                p = theories[gm].predict(casts, (q[0][2], q[1][2]), (st[0].noise, st[1].noise), _NAMES[gm])
                fact.update(predicted_sqnr_db=p.sqnr_db, ideal_sqnr_db=p.ideal_sqnr_db, valid=p.valid,
                            why_invalid=p.reason)
            else:
                fact.update(predicted_sqnr_db=math.nan, ideal_sqnr_db=math.nan, valid=False,
                            why_invalid="theory not asked for")
            out.append(fact)
    return out


def _loss_cost(gm: str, product: Tensor, ref: Tensor, g: Tensor, carries: dict, sequences: int) -> float:
    """The GEMM's predicted loss increase (diagnostics.theory.loss_cost): fprop the Fisher term of its
    output's error; dgrad and wgrad the share of their gradient's descent lost times what it trains."""
    if gm == "fprop":
        return fisher(g, product - ref, sequences)
    return descent_lost(product, ref, per_row=gm == "wgrad") * carries["x" if gm == "dgrad" else "y"]


def _cast(cache: dict, facts: _Operands, gm: str, side: int, t: Tensor, c, theory: bool) -> tuple:
    """(dequantized operand, its QuantStats, its predicted error variances reduced by
    diagnostics.theory.quant.noise_sums, or None), cached per operand, layout and cast; one scale per
    tensor does not depend on the layout: cast once, transpose."""
    name, flip = _NAMES[gm][side], _TRANSPOSED[gm][side]
    key = (name, c) if c.granularity == "tensor" else (name, flip, c)
    if key not in cache:
        q, st, scaled = quantize(t, c, keep_scaled=True, zeros=facts.zeros[name], row_power=facts.rows(name, flip))
        noise = None
        if theory:
            small = t.numel() - st.nonzero + st.underflow > 0  # an entry became (or was) 0
            noise = element_noise(t, c, scaled, st.overflow > 0, small)
        cache[key] = (q, st, noise, flip, {})
    q, st, noise, was, sums = cache[key]
    if noise is not None and flip not in sums:
        sums[flip] = noise_sums(noise if was == flip else noise.t())
    return (q if was == flip else q.t()), st, sums.get(flip)


def _range_facts(st) -> dict:
    nonzero = sum(s.nonzero for s in st)
    return {"underflow": sum(s.underflow for s in st) / max(nonzero, 1),
            "overflow": sum(s.overflow for s in st) / max(nonzero, 1),
            "scale_min_log2": min(s.scale_min_log2 for s in st), "scale_max_log2": max(s.scale_max_log2 for s in st)}


def _shape_check(mod: nn.Module, orient: str | None, x: Any, y: Any) -> str:
    """Why a layer's call cannot be measured from its shapes alone ("" when it can)."""
    if not isinstance(x, Tensor) or not isinstance(y, Tensor) or not x.is_floating_point():
        return "its input or output is not one floating tensor"
    w = mod.weight if orient == "out_in" else mod.weight.t()
    if x.shape[-1] != w.shape[1] or y.shape[-1] != w.shape[0]:
        return f"weight {tuple(mod.weight.shape)} does not map its input {tuple(x.shape)} to its output"
    return ""


def _fprop_difference(mod: nn.Module, orient: str | None, x: Tensor, y: Tensor) -> Tensor:
    """The relative difference of y's first 64 rows from x W^T (+ b), as a 0-d tensor (no host read)."""
    w = mod.weight if orient == "out_in" else mod.weight.t()
    with torch.no_grad():
        x2 = x.reshape(-1, x.shape[-1]).float()
        ref = x2[:64] @ w.float().t()
        b = getattr(mod, "bias", None)
        if isinstance(b, Tensor) and b.shape == (w.shape[0],):
            ref = ref + b.float()
        got = y.reshape(-1, y.shape[-1])[:64].float()
        return (got - ref).norm() / ref.norm().clamp(min=1e-30)


def _already_quantized(mod: nn.Module) -> str:
    """Why a layer that torchao already trains in low precision (``convert_to_float8_training``'s
    ``Float8Linear``, a weight of one of its tensor subclasses) is not measured ("" when it is not
    one): its output is already the quantized GEMM's, so there is no unquantized one to hold it to."""
    if not any(t.__module__.startswith("torchao.") for t in (type(mod), type(getattr(mod, "weight", None)))):
        return ""
    return (f"already quantized by torchao ({type(mod).__name__}): its GEMMs run in low precision, with no "
            "unquantized output to compare; measure the model before converting it")


class _Capture:
    """The hooks of one pass: per layer, fprop checked and the three GEMMs measured once g arrives."""

    def __init__(self, recipes: list[Recipe], theory: bool):
        self.recipes, self.theory = recipes, theory
        self.facts: dict[str, list[dict]] = {}
        self.order: list[str] = []
        self.shapes: dict[str, tuple] = {}
        self.skipped: dict[str, str] = {}

    def forward_hook(self, name: str, module: nn.Module):
        orient = _orientation(module)

        def hook(mod, args, kwargs, output):
            if name in self.order or name in self.skipped:
                return
            x = args[0] if args else next(iter(kwargs.values()), None)
            y = output if isinstance(output, Tensor) else None
            why = _shape_check(mod, orient, x, y)
            if not why and not y.requires_grad:
                why = "its output needs no gradient (dgrad and wgrad not reached)"
            why = why or _already_quantized(mod) or self._check(name, mod, orient, x, y)
            if why:
                self.skipped[name] = why
                return
            self.order.append(name)
            self.shapes[name] = tuple(y.shape)
            w = mod.weight.detach() if orient == "out_in" else mod.weight.detach().t()
            x2 = x.detach().reshape(-1, x.shape[-1])
            y.register_hook(lambda g, _x=x2, _w=w: self._take(name, _x, _w, g))
        return hook

    def _check(self, name: str, mod: nn.Module, orient: str | None, x: Tensor, y: Tensor) -> str:
        """Why the layer's output, of the right shape, is not x W^T (+ b) ("" when it is)."""
        err = float(_fprop_difference(mod, orient, x, y))
        return "" if err < 3e-2 else f"its output is not x W^T (+ b) (relative difference {err:.2g})"

    def _take(self, name: str, x: Tensor, w: Tensor, g: Tensor) -> None:
        with torch.no_grad():
            seqs = g.shape[0] if g.dim() >= 3 else 1
            self.facts[name] = measure_gemms(x, w, g.reshape(-1, g.shape[-1]), self.recipes, self.theory, seqs)


@contextlib.contextmanager
def _instrumented(model: nn.Module, layers, capture: _Capture):
    """Hooks on the chosen layers for the ``with`` block; removed, and the model put back, whatever happens."""
    training = {m: m.training for m in model.modules()}
    params = list(model.named_parameters())
    requires = {n: p.requires_grad for n, p in params}
    grads = {n: p.grad for n, p in params}
    try:
        with contextlib.ExitStack() as undo:
            for name, mod in layers:
                undo.enter_context(mod.register_forward_hook(capture.forward_hook(name, mod), with_kwargs=True))
            model.eval()
            for _, p in params:
                p.grad = None
                if p.is_floating_point():
                    p.requires_grad_(True)
            yield
    finally:
        for m, flag in training.items():
            m.training = flag
        for n, p in params:
            p.requires_grad_(requires[n])
            p.grad = grads[n]


def _loss(model: nn.Module, batch: Tensor, options: PrecisionOptions) -> Tensor:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = batch[:, :-1].to(device)
    x = options.inputs(ids) if options.inputs is not None else ids
    out = model(**x) if isinstance(x, Mapping) else model(*x) if isinstance(x, tuple) else model(x)
    logits, _ = read_output(out)
    if logits is None or logits.dim() < 2:
        raise OptionsError(f"model output={type(out).__name__}: must hold next-token logits (B, T, V); pass "
                           "PrecisionOptions(inputs=...) or wrap the model")
    return logits, torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), batch[:, 1:].to(device).flatten())


def precision(model: nn.Module, tokens=None, options: PrecisionOptions | None = None) -> PrecisionResult:
    """Measure every linear layer's three GEMMs in each recipe of ``options`` (module docstring).

    Args:
        model: any ``nn.Module`` whose output holds next-token logits (B, T, V).
        tokens: (N, T+1) windows, a 1-D token stream, or None (uniform random ids from ``options.seed``).
        options: :class:`PrecisionOptions`.
    Returns:
        a :class:`PrecisionResult`; the model is left as it was.
    """
    if not isinstance(model, nn.Module):
        raise OptionsError(f"model={type(model).__name__}: must be a torch.nn.Module; pass the model itself")
    options = options or PrecisionOptions()
    recipes = [recipe_of(r) for r in options.recipes]
    batch = batch_of(model, tokens, options)
    layers = [(n, m) for n, m in linear_layers(model) if options.modules is None or options.modules(m, n)]
    capture = _Capture(recipes, options.theory)
    with _instrumented(model, layers, capture):
        logits, loss = _loss(model, batch, options)
        loss.backward()
    return _assemble(model, capture, recipes, options, logits.shape, float(loss.detach()), batch)


def _assemble(model, capture: _Capture, recipes, options, logits_shape, loss, batch) -> PrecisionResult:
    thresholds = options.thresholds or PrecisionThresholds()
    stack = find_blocks(model)
    rows = []
    measured = [n for n in capture.order if n in capture.facts]
    skipped = dict(capture.skipped)
    for n in capture.order:
        if n not in capture.facts:
            skipped[n] = "no gradient reached its output"
    for depth, name in enumerate(measured):
        role = module_role(name, capture.shapes[name] == tuple(logits_shape))
        block = stack.index(name) if stack is not None else None
        for f in capture.facts[name]:
            worst = worst_operand(f["operands"])
            facts = {**f, "module": name, "role": role}
            verdict, cause, fix = judge_gemm(facts, f["operands"], thresholds)
            rows.append(PrecisionRow(name, f["gemm"], f["recipe"], f["sqnr_db"], f["row_sqnr_db"], f["predicted_sqnr_db"],
                                     f["ideal_sqnr_db"], f["valid"], f["why_invalid"], f["underflow"], f["overflow"],
                                     f["scale_min_log2"], f["scale_max_log2"], worst["name"], worst["peak_to_median"],
                                     worst["channel_ratio"], role, block, depth, f["m"], f["n"], f["k"], verdict,
                                     cause, fix, f["predicted_loss"]))
    meta = {"model": type(model).__name__, "batch_size": int(batch.shape[0]), "seq_len": int(batch.shape[1] - 1),
            "seed": options.seed, "loss": loss, "thresholds": thresholds.to_dict(), "torch": torch.__version__,
            "recipes": {r.name: r.description for r in recipes}}
    return PrecisionResult(rows, tuple(r.name for r in recipes), sorted(skipped.items()), meta)
