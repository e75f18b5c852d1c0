"""Low-precision formats and training recipes as data, and their emulation on any device.

A recipe says, for each of a linear layer's three GEMMs, how each operand is cast:

    fprop   y  = x W^T        operands  input (x), weight (W)
    dgrad   dx = g W          operands  grad_output (g), weight
    wgrad   dW = g^T x        operands  grad_output, input

Each cast (:class:`Cast`) names an element format (:class:`FloatFormat`), a scaling granularity
(one scale per tensor, per row along the GEMM's contraction dimension, or per block of
``block`` elements along it) and how a scale is rounded. The recipes follow torchao 0.18:

    tensorwise  Float8LinearConfig.from_recipe_name("tensorwise"): E4M3 input and weight, E5M2
                grad_output, one scale per tensor = fmax / amax (float64, then float32), not rounded
    rowwise     from_recipe_name("rowwise"): E4M3 everywhere, one scale per row along the
                contraction dimension, rounded down to a power of two
    mxfp8       MXFP8TrainingOpConfig (MXFP8_EMULATED_RCEIL): E4M3 everywhere, one E8M0 scale per
                32 elements along the contraction dimension, RCEIL: scale = 2^ceil(log2(amax / fmax))
    mxfp4       E2M1 elements, 32-element blocks, E8M0 scales rounded as MX's FLOOR mode:
                scale = 2^(floor(log2 amax) - emax_elem)
    nvfp4       E2M1 elements, 16-element blocks, block scale amax / 6 stored in E4M3 under a
                float32 scale per tensor amax / (448 * 6)

Quantizing x: multiply by the scale's reciprocal in float32, clamp to +-fmax (saturate), round
to the nearest representable value (ties to even, subnormals kept), multiply back. An emulated
GEMM multiplies the two dequantized operands in float32, as torchao's emulation does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

__all__ = ["FloatFormat", "Cast", "Recipe", "FORMATS", "RECIPES", "GEMMS", "OPERANDS", "recipe", "quantize",
           "round_to_format", "scaled_groups", "QuantStats", "Scaled"]

#: the three GEMMs of a linear layer and their operands (left, right), each cast along the contraction
GEMMS = {"fprop": ("input", "weight"), "dgrad": ("grad_output", "weight"), "wgrad": ("grad_output", "input")}
OPERANDS = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point element format: ``ebits`` exponent bits, ``mbits`` mantissa bits,
    ``emin`` the smallest normal exponent, ``max`` the largest finite value (saturation point).
    Subnormals step by 2^(emin - mbits). ``torch_dtype`` names torch's own dtype, if any."""

    name: str
    ebits: int
    mbits: int
    emin: int
    max: float
    torch_dtype: str | None = None

    @property
    def emax(self) -> int:
        """The exponent of the largest binade: floor(log2 max)."""
        return int(math.floor(math.log2(self.max)))

    @property
    def tiny(self) -> float:
        """The smallest positive subnormal, 2^(emin - mbits)."""
        return 2.0 ** (self.emin - self.mbits)

    @property
    def dynamic_range_binades(self) -> float:
        """log2(max / tiny): binades between the largest value and the smallest subnormal."""
        return math.log2(self.max / self.tiny)

    @property
    def unit_roundoff(self) -> float:
        """2^-(mbits+1): the largest relative rounding error of a normal value."""
        return 2.0 ** -(self.mbits + 1)


FORMATS = {
    "e4m3": FloatFormat("e4m3", 4, 3, -6, 448.0, "float8_e4m3fn"),
    "e5m2": FloatFormat("e5m2", 5, 2, -14, 57344.0, "float8_e5m2"),
    "e2m1": FloatFormat("e2m1", 2, 1, 0, 6.0),
    "bf16": FloatFormat("bf16", 8, 7, -126, 3.3895313892515355e38, "bfloat16"),
}

GRANULARITIES = ("tensor", "row", "block")
#: how a scale is rounded: "none" (float32 fmax / amax), "pow2_floor" (the scale rounded down to a power
#: of two), "e8m0_rceil" (MX RCEIL), "e8m0_floor" (MX FLOOR), "e4m3_nv" (NVFP4: E4M3 block scales
#: under a float32 scale per tensor)
SCALE_ROUNDINGS = ("none", "pow2_floor", "e8m0_rceil", "e8m0_floor", "e4m3_nv")


@dataclass(frozen=True)
class Cast:
    """How one operand is cast: its element ``format``, ``granularity`` ("tensor", "row": one scale per
    row along the contraction dimension, "block": one per ``block`` elements along it) and
    ``scale_rounding`` (:data:`SCALE_ROUNDINGS`). ``format=None`` keeps the operand unquantized."""

    format: FloatFormat | None
    granularity: str = "tensor"
    scale_rounding: str = "none"
    block: int = 0

    def __post_init__(self) -> None:
        assert self.granularity in GRANULARITIES and self.scale_rounding in SCALE_ROUNDINGS
        assert (self.granularity == "block") == (self.block > 0)

    def describe(self) -> str:
        if self.format is None:
            return "high precision"
        where = {"tensor": "per tensor", "row": "per row"}.get(self.granularity, f"per {self.block}")
        return f"{self.format.name} {where}, scale {self.scale_rounding}"


@dataclass(frozen=True)
class Recipe:
    """A training recipe: per GEMM, the cast of its left and right operand (:data:`GEMMS`)."""

    name: str
    fprop: tuple[Cast, Cast]
    dgrad: tuple[Cast, Cast]
    wgrad: tuple[Cast, Cast]
    description: str = field(default="", compare=False)

    def casts(self, gemm: str) -> tuple[Cast, Cast]:
        return getattr(self, gemm)

    @classmethod
    def uniform(cls, name: str, input: Cast, weight: Cast, grad_output: Cast, description: str = "") -> "Recipe":
        """The same cast of an operand in every GEMM it enters (as every torchao recipe here)."""
        return cls(name, (input, weight), (grad_output, weight), (grad_output, input), description)

    def with_cast(self, operand: str, cast: Cast) -> "Recipe":
        """This recipe with ``operand`` cast as ``cast`` wherever it enters (for ablations and controls)."""
        changes = {g: tuple(cast if o == operand else c for o, c in zip(GEMMS[g], self.casts(g))) for g in GEMMS}
        return replace(self, **changes)


def _recipes() -> dict[str, Recipe]:
    e4m3, e5m2, e2m1 = FORMATS["e4m3"], FORMATS["e5m2"], FORMATS["e2m1"]
    tw = Cast(e4m3)
    row = Cast(e4m3, "row", "pow2_floor")
    mx8 = Cast(e4m3, "block", "e8m0_rceil", 32)
    mx4 = Cast(e2m1, "block", "e8m0_floor", 32)
    nv4 = Cast(e2m1, "block", "e4m3_nv", 16)
    return {
        "tensorwise": Recipe.uniform("tensorwise", tw, tw, Cast(e5m2),
                                     "E4M3 input and weight, E5M2 gradients, one scale per tensor"),
        "rowwise": Recipe.uniform("rowwise", row, row, row, "E4M3 everywhere, a power-of-two scale per row"),
        "mxfp8": Recipe.uniform("mxfp8", mx8, mx8, mx8, "E4M3 elements, an E8M0 scale per 32 (RCEIL)"),
        "mxfp4": Recipe.uniform("mxfp4", mx4, mx4, mx4, "E2M1 elements, an E8M0 scale per 32 (FLOOR)"),
        "nvfp4": Recipe.uniform("nvfp4", nv4, nv4, nv4, "E2M1 elements, an E4M3 scale per 16 under a tensor scale"),
    }


RECIPES: dict[str, Recipe] = _recipes()


def recipe(name: str | Recipe) -> Recipe:
    """The :class:`Recipe` of a name in :data:`RECIPES` (a Recipe is returned as it is)."""
    if isinstance(name, Recipe):
        return name
    if name not in RECIPES:
        from tinylm.validate import fail

        from ..errors import OptionsError

        fail("recipe", name, "be one of " + ", ".join(RECIPES), "one of " + ", ".join(RECIPES), error=OptionsError)
    return RECIPES[name]


# ----------------------------------------------------------------------------- element rounding


def round_to_format(a: Tensor, fmt: FloatFormat, native: bool = True, saturate: bool = True) -> Tensor:
    """``a`` (float32, already scaled) saturated to +-fmt.max and rounded to the nearest value of ``fmt``
    (ties to even, subnormals kept). ``native`` uses torch's own dtype where there is one; ``saturate``
    False skips the clamp (the caller knows no entry exceeds fmt.max)."""
    if saturate:
        a = a.clamp(-fmt.max, fmt.max)
    if native and fmt.torch_dtype is not None:
        return a.to(getattr(torch, fmt.torch_dtype)).to(torch.float32)
    mag = a.abs()
    _, exp = torch.frexp(mag)  # mag = m 2^exp, m in [0.5, 1): floor(log2 mag) = exp - 1
    step = torch.exp2((exp - 1).clamp(min=fmt.emin).to(torch.float32) - fmt.mbits)
    return torch.copysign(torch.round(mag / step) * step, a)


# ----------------------------------------------------------------------------- scales


def _grouped(x: Tensor, cast: Cast) -> tuple[Tensor, int]:
    """x (rows, K) contracted along K, as (rows, groups, size) and the zero padding added to K."""
    rows, k = x.shape
    if cast.granularity == "tensor":
        return x.reshape(1, 1, -1), 0
    if cast.granularity == "row":
        return x.reshape(rows, 1, k), 0
    pad = (-k) % cast.block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, -1, cast.block), pad


def _scales(amax: Tensor, cast: Cast, x: Tensor) -> tuple[Tensor, Tensor]:
    """(multiplier, reader) per group, float32, as the recipe computes them: an entry is stored as
    round(x * multiplier) and read back as that / reader (NVFP4: that * reader, the product of its
    block and tensor scales); the reader is the multiplier but for NVFP4 and RCEIL's all-zero blocks."""
    fmt = cast.format
    rule = cast.scale_rounding
    if rule in ("none", "pow2_floor"):
        scale = (fmt.max / amax.double().clamp(min=1e-12)).float()
        if rule == "pow2_floor":
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        return scale, scale
    if rule == "e8m0_rceil":
        descale = amax / fmt.max
        e = torch.clamp(torch.ceil(torch.log2(descale)), -127, 127) + 127
        mult = torch.where(e == 0, torch.ones_like(descale), torch.exp2(127 - e))
        return mult, torch.exp2(127 - e)
    if rule == "e8m0_floor":
        bits = amax.contiguous().view(torch.int32)
        pow2 = ((bits >> 23) & 0xFF) - 127
        e = torch.clamp(pow2 - fmt.emax, -127, 128).to(torch.float32)
        scale = torch.exp2(e).clamp(min=2.0 ** -126)
        return 1.0 / scale, 1.0 / scale
    # e4m3_nv: a float32 scale per tensor, an E4M3 scale per block under it
    e4m3 = FORMATS["e4m3"]
    tensor_scale = x.abs().amax().double() / (e4m3.max * fmt.max)
    tensor_scale = tensor_scale.float().clamp(min=1e-30)
    block = round_to_format((amax / fmt.max / tensor_scale).clamp(min=2.0 ** -6), e4m3)
    mult = (1.0 / tensor_scale) / block
    return mult, block * tensor_scale


def scaled_groups(x: Tensor, cast: Cast) -> tuple[Tensor, int, Tensor, Tensor]:
    """x (rows, K) float32 as its scaling groups (rows, groups, size), the zero padding added to K,
    and each group's multiplier and reader (:func:`_scales`)."""
    g, pad, mult, reader, _ = _scaled_groups(x, cast)
    return g, pad, mult, reader


def _scaled_groups(x: Tensor, cast: Cast) -> tuple[Tensor, int, Tensor, Tensor, Tensor]:
    """:func:`scaled_groups` and each group's largest magnitude."""
    g, pad = _grouped(x, cast)
    amax = g.abs().amax(dim=-1, keepdim=True)
    mult, reader = _scales(amax, cast, x)
    return g, pad, mult, reader, amax


@dataclass
class QuantStats:
    """What one cast did to one operand: ``nonzero`` entries before, ``underflow`` how many of them
    became 0, ``overflow`` how many saturated, ``scale_min`` / ``scale_max`` the range of the
    multipliers applied (log2), ``noise`` sum of squared errors, ``power`` sum of squares,
    ``typical_relative_noise`` the median over rows of each row's error power over its power."""

    nonzero: int
    underflow: int
    overflow: int
    scale_min_log2: float
    scale_max_log2: float
    noise: float
    power: float
    typical_relative_noise: float = 0.0


@dataclass
class Scaled:
    """An operand as its cast saw it: ``scaled`` (rows, groups, size) the entries times their group's
    multiplier, ``reader`` per group (:func:`_scales`), ``pad`` the zeros added to K, ``shape``."""

    scaled: Tensor
    reader: Tensor
    pad: int
    shape: tuple[int, int]


def quantize(x: Tensor, cast: Cast, native: bool = True, stats: bool = True, keep_scaled: bool = False,
             zeros: int | None = None, row_power: Tensor | None = None
             ) -> tuple[Tensor, QuantStats | None] | tuple[Tensor, QuantStats | None, Scaled | None]:
    """``x`` (rows, K), contracted along its last dimension, cast as ``cast`` and dequantized
    (float32, same shape), with its :class:`QuantStats` (``stats``) and, with ``keep_scaled``, the
    :class:`Scaled` operand (for theory: diagnostics.theory.quant.element_noise). ``zeros`` (how many
    entries of x are 0) and ``row_power`` (each row's sum of squares) spare their pass where known."""
    x = x.to(torch.float32)
    if cast.format is None:
        out = (x, QuantStats(0, 0, 0, 0.0, 0.0, 0.0, 0.0) if stats else None)
        return (*out, None) if keep_scaled else out
    rows, k = x.shape
    g, pad, mult, div, amax = _scaled_groups(x, cast)
    scaled = g * mult
    # an entry saturates only in a group whose largest entry does (rounding is monotonic): else no clamp
    saturates = bool((amax * mult > cast.format.max).any())
    q = round_to_format(scaled, cast.format, native, saturate=saturates)
    q = q * div if cast.scale_rounding == "e4m3_nv" else q / div
    if pad:
        q = q.reshape(rows, -1)[:, :k]
    q = q.reshape(rows, k)
    kept = Scaled(scaled, div, pad, (rows, k)) if keep_scaled else None
    if not stats:
        return (q, None, kept) if keep_scaled else (q, None)
    lm = torch.log2(mult[mult > 0]) if bool((mult > 0).any()) else torch.zeros(1)
    counts = [(x == 0).sum() if zeros is None else torch.tensor(zeros), (q == 0).sum(),
              (scaled.abs() > cast.format.max).sum() if saturates else torch.tensor(0)]
    counts = torch.stack(counts).tolist()
    s = [x.numel() - counts[0], counts[1] - counts[0], counts[2]]  # a zero stays zero: new zeros are underflow
    err_rows = (q - x).square_().sum(1)
    pow_rows = x.square().sum(1) if row_power is None else row_power
    live = pow_rows > 0
    typical = float((err_rows[live] / pow_rows[live]).median()) if bool(live.any()) else 0.0
    st = QuantStats(int(s[0]), int(s[1]), int(s[2]), float(lm.min()), float(lm.max()),
                    float(err_rows.sum()), float(pow_rows.sum()), typical)
    return (q, st, kept) if keep_scaled else (q, st)
