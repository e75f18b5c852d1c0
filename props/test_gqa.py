"""Grouped-query attention and the sliding window of tinylm's attention.

With H query heads and H_kv key/value heads (G = H / H_kv), query head h reads K/V head
h // G ("repeat": each K/V head serves G consecutive query heads, Llama's ``repeat_kv``). So
GQA attention is exactly multi-head attention whose k_proj and v_proj rows are the GQA ones,
each head's block of d_k rows repeated G times; with H_kv = H it is multi-head attention
itself. A sliding window W keeps key j for query i iff 0 <= i - j < W. These are properties
of tinylm's module, so they carry the ``tinylm_only`` marker.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.contract import assert_refused
from props.record import check, prop
from props.strategies import generator, seeds, sizes
from props.tolerances import unit_roundoff
from tinylm import functional as F
from tinylm.config import ModelConfig
from tinylm.errors import ConfigError
from tinylm.layers import MultiHeadSelfAttention

pytestmark = pytest.mark.tinylm_only

U64 = unit_roundoff(torch.float64)


@st.composite
def gqa_case(draw):
    """(attention with H_kv < H or = H, input x, H, H_kv): float64, RoPE or not, random weights."""
    kv = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    dk = draw(st.sampled_from([2, 4, 6]))
    T, lead = draw(sizes(1, 7)), draw(sizes(1, 3))
    heads = kv * groups
    rope = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 8)))
    g = generator(draw(seeds()))
    attn = MultiHeadSelfAttention(heads * dk, heads, 8, 10000.0 if rope else None, num_kv_heads=kv,
                                  sliding_window=window, dtype=torch.float64, bias=draw(st.booleans()))
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    x = torch.randn(lead, T, heads * dk, generator=g, dtype=torch.float64)
    return attn, x


def _as_mha(attn: MultiHeadSelfAttention, order: str = "repeat") -> MultiHeadSelfAttention:
    """Multi-head attention computing what ``attn`` should: its k/v rows (and biases) of K/V head
    h // G copied to query head h ("repeat"), or of K/V head h mod H_kv ("tile": a wrong grouping)."""
    H, kv, dk = attn.num_heads, attn.num_kv_heads, attn.d_k
    mha = MultiHeadSelfAttention(attn.d_model, H, 8, attn.rope.theta if attn.rope is not None else None,
                                 sliding_window=attn.sliding_window, dtype=torch.float64,
                                 bias=attn.q_proj.bias is not None)
    source = [h // (H // kv) if order == "repeat" else h % kv for h in range(H)]
    rows = torch.tensor([s * dk + r for s in source for r in range(dk)])
    state = attn.state_dict()
    for key, value in list(state.items()):
        if key.startswith(("k_proj.", "v_proj.")):
            state[key] = value[rows]
    mha.load_state_dict(state)
    return mha


def _run(attn: MultiHeadSelfAttention, x: torch.Tensor, explicit: bool) -> torch.Tensor:
    attn.explicit = explicit
    with torch.no_grad():
        return attn(x)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / (1 + float(b.abs().max()))


@prop("GQA(x) = MHA(x) with each K/V head's rows repeated for its G query heads (h reads K/V head h // G), float64")
@given(case=gqa_case(), explicit=st.booleans())
def test_gqa_is_mha_with_repeated_kv_heads(case, explicit):
    attn, x = case
    mha = _as_mha(attn)
    d = attn.d_model
    check(_err(_run(attn, x, explicit), _run(mha, x, explicit)), 16 * (d + x.shape[-2]) * U64,
          "grouped-query attention differs from multi-head attention with repeated K/V heads")


@prop("negative control: a wrong grouping (query head h reading K/V head h mod H_kv) is rejected")
@settings(max_examples=20)
@given(seed=seeds(), kv=st.integers(2, 3), groups=st.integers(2, 3))
def test_tiled_grouping_is_rejected(seed, kv, groups):
    g = generator(seed)
    heads, dk, T = kv * groups, 4, 6
    attn = MultiHeadSelfAttention(heads * dk, heads, 8, 10000.0, num_kv_heads=kv, dtype=torch.float64)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    x = torch.randn(2, T, heads * dk, generator=g, dtype=torch.float64)
    assert _err(_run(attn, x, False), _run(_as_mha(attn, "tile"), x, False)) > 1e-3


@prop("num_kv_heads = num_heads is multi-head attention exactly: the same parameters, bit-identical outputs")
@given(seed=seeds(), heads=st.integers(1, 4), T=sizes(1, 7), explicit=st.booleans())
def test_full_kv_heads_is_todays_attention(seed, heads, T, explicit):
    torch.manual_seed(seed)
    mha = MultiHeadSelfAttention(heads * 4, heads, 8, 10000.0, dtype=torch.float64)
    same = MultiHeadSelfAttention(heads * 4, heads, 8, 10000.0, num_kv_heads=heads, dtype=torch.float64)
    assert {k: v.shape for k, v in mha.state_dict().items()} == {k: v.shape for k, v in same.state_dict().items()}
    same.load_state_dict(mha.state_dict())
    x = torch.randn(2, T, heads * 4, generator=generator(seed), dtype=torch.float64)
    assert torch.equal(_run(mha, x, explicit), _run(same, x, explicit))


@prop("sliding window W: query i reads key j iff 0 <= i - j < W (the fused and explicit paths alike); "
      "W >= T is no window; W - 1 is another function")
@settings(max_examples=30)
@given(seed=seeds(), window=st.integers(1, 6), T=st.integers(2, 8))
def test_sliding_window_mask(seed, window, T):
    g = generator(seed)
    attn = MultiHeadSelfAttention(8, 2, 8, None, sliding_window=window, dtype=torch.float64)
    full = MultiHeadSelfAttention(8, 2, 8, None, dtype=torch.float64)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    full.load_state_dict(attn.state_dict())
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    assert torch.equal(attn.mask(T), (i >= j) & (i - j < window))
    x = torch.randn(3, T, 8, generator=g, dtype=torch.float64)
    q, k, v = (t.view(3, T, 2, 4).transpose(1, 2) for t in (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)))
    heads = F.scaled_dot_product_attention(q, k, v, (i >= j) & (i - j < window))
    ref = attn.output_proj(heads.transpose(1, 2).reshape(3, T, 8)).detach()
    for explicit in (False, True):
        check(_err(_run(attn, x, explicit), ref), 64 * (8 + T) * U64, "the windowed attention differs from its mask")
    if window >= T:
        check(_err(_run(attn, x, False), _run(full, x, False)), 64 * (8 + T) * U64, "a window >= T is not no window")
    elif window >= 1 and T > window:
        attn.sliding_window = window + 1  # one key more for the queries at i >= window
        assert _err(_run(attn, x, False), ref) > 1e-6


def test_num_kv_heads_and_window_are_validated():
    base = dict(vocab_size=16, context_length=8, d_model=16, num_layers=1, num_heads=4, d_ff=8)
    assert_refused(ConfigError, "num_kv_heads=3: must divide num_heads=4 (each key/value head serves a whole "
                   "group of query heads); pass one of 1, 2, 4", ModelConfig, **base, num_kv_heads=3)
    assert_refused(ConfigError, "num_kv_heads=0: must be an integer >= 1", ModelConfig, **base, num_kv_heads=0)
    assert_refused(ConfigError, "sliding_window=0: must be an integer >= 1", ModelConfig, **base, sliding_window=0)
    c = ModelConfig(**base, num_kv_heads=2, sliding_window=3)
    assert c.kv_heads == 2 and ModelConfig(**base).kv_heads == 4
    assert ModelConfig.from_dict(c.to_dict()) == c
