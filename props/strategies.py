"""Reusable hypothesis strategies for numerics properties of Transformer LMs.

Import them in your own tests::

    from hypothesis import given
    from props.strategies import shapes, float_dtypes, scales, seeds, generator, tensors

    @given(t=tensors(shapes(min_rank=2), dtypes=float_dtypes()))
    def test_mine(t): ...

For the whole finite range of a dtype, :func:`wide_tensors` gives each row its own magnitude
(log-uniform over the dtype's normal exponents, :func:`finite_exponents`), and
:func:`magnitudes` draws single scale factors over many decades.

Randomness inside an example comes from an explicit ``torch.Generator`` seeded by
a hypothesis-drawn integer (:func:`seeds` then :func:`generator`), so a failing
example replays exactly and hypothesis never touches torch's global RNG.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from tinylm.config import ModelConfig

__all__ = [
    "seeds",
    "generator",
    "sizes",
    "shapes",
    "float_dtypes",
    "LOW_PRECISION",
    "scales",
    "tensors",
    "dyadic_logits",
    "model_configs",
    "finite_exponents",
    "magnitudes",
    "wide_tensors",
]

#: dtypes whose large values overflow when squared (bf16 keeps float32's range but not its precision).
LOW_PRECISION = (torch.float16, torch.bfloat16)


def seeds() -> st.SearchStrategy[int]:
    """Seeds for ``torch.Generator().manual_seed``: integers in [0, 2^32)."""
    return st.integers(min_value=0, max_value=2**32 - 1)


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (the only randomness a property uses)."""
    return torch.Generator().manual_seed(int(seed))


def sizes(min_value: int = 1, max_value: int = 16) -> st.SearchStrategy[int]:
    """A dimension size in [min_value, max_value]."""
    if not 1 <= min_value <= max_value:
        raise ValueError(f"min_value={min_value}, max_value={max_value}: need 1 <= min_value <= max_value")
    return st.integers(min_value=min_value, max_value=max_value)


def shapes(
    min_rank: int = 1, max_rank: int = 4, min_side: int = 1, max_side: int = 8
) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes of rank min_rank..max_rank (default 1 to 4), each side in [min_side, max_side]."""
    if not 1 <= min_rank <= max_rank:
        raise ValueError(f"min_rank={min_rank}, max_rank={max_rank}: need 1 <= min_rank <= max_rank")
    side = sizes(min_side, max_side)
    return st.integers(min_rank, max_rank).flatmap(lambda r: st.tuples(*[side] * r))


def float_dtypes(low_precision: bool = False) -> st.SearchStrategy[torch.dtype]:
    """float32 and float64; with ``low_precision`` also float16 and bfloat16."""
    choices = [torch.float32, torch.float64] + (list(LOW_PRECISION) if low_precision else [])
    return st.sampled_from(choices)


def scales(min_exp: float = -3.0, max_exp: float = 3.0) -> st.SearchStrategy[float]:
    """Positive scale factors 10^e, e uniform in [min_exp, max_exp] (log-uniform magnitudes)."""
    if not min_exp <= max_exp:
        raise ValueError(f"min_exp={min_exp}, max_exp={max_exp}: need min_exp <= max_exp")
    return st.floats(min_exp, max_exp, allow_nan=False).map(lambda e: float(10.0**e))


@st.composite
def tensors(
    draw,
    shape: st.SearchStrategy[tuple[int, ...]] | None = None,
    dtypes: st.SearchStrategy[torch.dtype] | None = None,
    scale: st.SearchStrategy[float] | None = None,
) -> torch.Tensor:
    """Standard-normal tensors times a drawn scale, drawn from a seeded generator in float64, then cast."""
    shp = draw(shape if shape is not None else shapes())
    dtype = draw(dtypes if dtypes is not None else float_dtypes())
    s = draw(scale if scale is not None else st.just(1.0))
    g = generator(draw(seeds()))
    return (torch.randn(shp, generator=g, dtype=torch.float64) * s).to(dtype)


def finite_exponents(dtype: torch.dtype, headroom: float = 1.0) -> tuple[float, float]:
    """(log10 of ``dtype``'s smallest normal, log10 of its largest finite value / ``headroom``).

    float32 and bfloat16: (-37.9, 38.5); float16: (-4.2, 4.8); float64: (-307.7, 308.3). ``headroom``
    (>= 1) keeps room above the magnitudes drawn: a property whose function adds or squares its
    inputs passes the factor by which the result may exceed them.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype}: must be a floating-point dtype; pass torch.float32, torch.float16, ...")
    if not headroom >= 1.0:
        raise ValueError(f"headroom={headroom}: must be >= 1; pass 1.0 for the whole finite range")
    info = torch.finfo(dtype)
    return math.log10(info.tiny), math.log10(info.max / headroom)


def magnitudes(
    dtype: torch.dtype = torch.float32, min_exp: float | None = None, max_exp: float | None = None, headroom: float = 1.0
) -> st.SearchStrategy[float]:
    """Positive magnitudes 10^e, e uniform over [min_exp, max_exp] (log-uniform over many decades).

    Unset bounds default to ``finite_exponents(dtype, headroom)``: the whole normal range of ``dtype``;
    a bound beyond that range is clipped to it.
    """
    lo, hi = finite_exponents(dtype, headroom)
    lo = lo if min_exp is None else max(lo, min_exp)
    hi = hi if max_exp is None else min(hi, max_exp)
    if not lo <= hi:
        raise ValueError(f"min_exp={min_exp}, max_exp={max_exp}: no exponent of {dtype} lies between them")
    return st.floats(lo, hi, allow_nan=False).map(lambda e: float(10.0**e))


@st.composite
def wide_tensors(
    draw,
    rows: st.SearchStrategy[int] | None = None,
    cols: st.SearchStrategy[int] | None = None,
    dtypes: st.SearchStrategy[torch.dtype] | None = None,
    min_exp: float | None = None,
    max_exp: float | None = None,
    headroom: float = 8.0,
) -> torch.Tensor:
    """(rows, cols) tensors whose rows each carry their own magnitude: row i is N(0, 1) times
    10^e_i, e_i drawn from [min_exp, max_exp] (default: ``dtype``'s whole normal range less
    ``headroom``), uniform or one of its two ends, in float64, clamped to +-max/headroom and
    rounded to the dtype (so a row at the top end holds +-max/headroom itself).

    One example thus spans many decades: a bug that shows only at large (or tiny) magnitudes
    meets them in most examples, and the rows near N(0, 1) still check the ordinary case.
    The rounded tensor is exact in its dtype; compare against a float64 reference of ``x.double()``.
    """
    n_rows = draw(rows if rows is not None else sizes(1, 6))
    n_cols = draw(cols if cols is not None else sizes(1, 16))
    dtype = draw(dtypes if dtypes is not None else float_dtypes(low_precision=True))
    lo, hi = finite_exponents(dtype, headroom)
    lo = lo if min_exp is None else max(lo, min_exp)
    hi = hi if max_exp is None else min(hi, max_exp)
    if not lo <= hi:
        raise ValueError(f"min_exp={min_exp}, max_exp={max_exp}: no exponent of {dtype} lies between them")
    # the ends of the range are drawn on purpose: uniform exponents would rarely reach the last decade
    exponent = st.one_of(st.floats(lo, hi), st.sampled_from([lo, hi]))
    e = torch.tensor(draw(st.lists(exponent, min_size=n_rows, max_size=n_rows)), dtype=torch.float64)[:, None]
    g = generator(draw(seeds()))
    x = torch.randn(n_rows, n_cols, generator=g, dtype=torch.float64) * 10.0**e
    big = float(torch.finfo(dtype).max) / headroom
    return x.clamp(-big, big).to(dtype)


@st.composite
def dyadic_logits(draw, max_rows: int = 4, max_cols: int = 16, frac_bits: int = 4, max_abs: int = 64) -> torch.Tensor:
    """Float32 logits on the grid 2^-frac_bits with |z| <= max_abs: adding a shift on the same grid
    (|c| <= 2^10) is exact in float32, so a shift-invariant softmax must agree bitwise."""
    rows = draw(sizes(1, max_rows))
    cols = draw(sizes(1, max_cols))
    g = generator(draw(seeds()))
    steps = max_abs * 2**frac_bits
    k = torch.randint(-steps, steps + 1, (rows, cols), generator=g)
    return k.to(torch.float32) / 2**frac_bits


@st.composite
def model_configs(
    draw,
    max_layers: int = 3,
    max_heads: int = 4,
    max_head_dim: int = 8,
    max_vocab: int = 64,
    max_context: int = 12,
    norms: tuple[str, ...] = ("pre", "post", "none"),
    ffns: tuple[str, ...] = ("swiglu", "silu"),
    positions: tuple[str, ...] = ("rope", "none"),
    tie: tuple[bool, ...] = (False, True),
    norm_kinds: tuple[str, ...] = ("rms",),
    biases: tuple[bool, ...] = (False,),
    qk_norms: tuple[str, ...] = ("none",),
) -> ModelConfig:
    """Small :class:`tinylm.ModelConfig` that are always valid (even head dims for RoPE, d divisible by H).

    The defaults draw the CS336 block's variants; pass ``GPT2_FAMILY`` (``**GPT2_FAMILY``) to draw
    the GPT-2 family's choices too (LayerNorm, GELU/ReLU MLPs, learned positions, biases);
    ``qk_norms`` draws the per-head query/key norm (default: none).
    """
    heads = draw(st.integers(1, max_heads))
    head_dim = 2 * draw(st.integers(1, max(1, max_head_dim // 2)))
    d_model = heads * head_dim
    d_ff = draw(st.integers(max(1, d_model // 2), max(2, math.ceil(8 * d_model / 3))))
    return ModelConfig(
        vocab_size=draw(st.integers(2, max_vocab)),
        context_length=draw(st.integers(2, max_context)),
        d_model=d_model,
        num_layers=draw(st.integers(1, max_layers)),
        num_heads=heads,
        d_ff=d_ff,
        rope_theta=draw(st.sampled_from([100.0, 10000.0])),
        norm=draw(st.sampled_from(norms)),
        ffn=draw(st.sampled_from(ffns)),
        positions=draw(st.sampled_from(positions)),
        tie_embeddings=draw(st.sampled_from(tie)),
        **({"norm_kind": draw(st.sampled_from(norm_kinds))} if norm_kinds != ("rms",) else {}),
        **({"bias": draw(st.sampled_from(biases))} if biases != (False,) else {}),
        **({"qk_norm": draw(st.sampled_from(qk_norms))} if qk_norms != ("none",) else {}),
    )


#: ``model_configs(**GPT2_FAMILY)``: every family choice of ModelConfig
GPT2_FAMILY = dict(
    ffns=("swiglu", "silu", "gelu", "gelu_tanh", "relu"),
    positions=("rope", "learned", "none"),
    norm_kinds=("rms", "layer"),
    biases=(False, True),
)
