"""Reusable hypothesis strategies for numerics properties of Transformer LMs.

Import them in your own tests::

    from hypothesis import given
    from props.strategies import shapes, float_dtypes, scales, seeds, generator, tensors

    @given(t=tensors(shapes(min_rank=2), dtypes=float_dtypes()))
    def test_mine(t): ...

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
) -> ModelConfig:
    """Small :class:`tinylm.ModelConfig` that are always valid (even head dims for RoPE, d divisible by H)."""
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
    )
