"""The model: same function as a torch built-in reference, causal, RoPE's geometry, CS336 keys."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tinylm
from tinylm import functional as F
from tinylm.reference import BuiltinLM

SMALL = tinylm.ModelConfig(vocab_size=97, context_length=12, d_model=32, num_layers=2, num_heads=4, d_ff=64)


def tokens(config, shape, seed=0):
    return torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("changes", [{}, {"ffn": "silu"}, {"positions": "none"}, {"tie_embeddings": True}])
def test_matches_builtin_reference_in_float64(changes):
    c = SMALL.replace(**changes)
    model = tinylm.TransformerLM(c, generator=torch.Generator().manual_seed(1)).double()
    ref = BuiltinLM(c).double()
    ref.load_state_dict(model.state_dict())
    x = tokens(c, (3, c.context_length))
    torch.testing.assert_close(model(x), ref(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
@given(t=st.integers(0, SMALL.context_length - 1), seed=st.integers(0, 2**16))
def test_causality(norm, t, seed):
    """Changing the token at position t changes no logit at positions < t (and does change position t)."""
    c = SMALL.replace(norm=norm)
    model = tinylm.TransformerLM(c, generator=torch.Generator().manual_seed(seed)).double()
    x = tokens(c, (2, c.context_length), seed)
    x2 = x.clone()
    x2[:, t] = (x2[:, t] + 1) % c.vocab_size
    y, y2 = model(x), model(x2)
    torch.testing.assert_close(y[:, :t], y2[:, :t], rtol=0, atol=1e-12)
    assert (y[:, t] - y2[:, t]).abs().max() > 1e-6


def test_post_norm_and_no_norm_blocks_compute_their_formulas():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    for norm in ("pre", "post", "none"):
        blk = tinylm.TransformerBlock(16, 2, 32, 8, 10000.0, norm=norm).double()
        a, f = blk.attn, blk.ffn
        if norm == "pre":
            h = x + a(blk.ln1(x))
            want = h + f(blk.ln2(h))
        elif norm == "post":
            h = blk.ln1(x + a(x))
            want = blk.ln2(h + f(h))
        else:
            h = x + a(x)
            want = h + f(h)
        torch.testing.assert_close(blk(x), want, rtol=0, atol=0)


def _rope_reference(x, pos, theta):
    """Rotation of adjacent pairs as complex multiplication by exp(i pos theta^(-2k/d))."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(freq), pos[..., None].double() * freq)).flatten(-2)


@given(seed=st.integers(0, 2**16), d=st.sampled_from([2, 4, 16]), lead=st.integers(0, 2))
def test_rope_matches_complex_rotation_and_preserves_norm(seed, d, lead):
    rope = tinylm.RotaryPositionalEmbedding(10000.0, d, 32)
    g = torch.Generator().manual_seed(seed)
    shape = (2,) * lead + (7, d)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 32, shape[:-1], generator=g)
    out = rope(x, pos)
    torch.testing.assert_close(out, _rope_reference(x, pos, 10000.0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)


@given(seed=st.integers(0, 2**16), i=st.integers(0, 20), j=st.integers(0, 20), s=st.integers(0, 11))
def test_rope_dot_product_depends_only_on_position_difference(seed, i, j, s):
    rope = tinylm.RotaryPositionalEmbedding(500.0, 8, 32)
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 8, generator=g, dtype=torch.float64)
    dot = lambda a, b: (rope(q[None], torch.tensor([a])) * rope(k[None], torch.tensor([b]))).sum()
    torch.testing.assert_close(dot(i, j), dot(i + s, j + s), rtol=1e-12, atol=1e-12)


def test_rope_rejects_odd_dimension_and_long_positions():
    with pytest.raises(ValueError, match="d_k=5"):
        tinylm.RotaryPositionalEmbedding(1e4, 5, 8)
    rope = tinylm.RotaryPositionalEmbedding(1e4, 4, 8)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        rope(torch.zeros(1, 9, 4), torch.arange(9))


def test_rope_buffers_are_not_in_state_dict():
    assert tinylm.RotaryPositionalEmbedding(1e4, 4, 8).state_dict() == {}


def test_state_dict_keys_and_shapes_follow_the_cs336_contract():
    c = tinylm.preset("tiny")
    model = tinylm.TransformerLM(c)
    d, f, V = c.d_model, c.d_ff, c.vocab_size
    want = {"token_embeddings.weight": (V, d), "ln_final.weight": (d,), "lm_head.weight": (V, d)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        want.update({p + "ln1.weight": (d,), p + "ln2.weight": (d,), p + "ffn.w1.weight": (f, d),
                     p + "ffn.w2.weight": (d, f), p + "ffn.w3.weight": (f, d)})
        for proj in ("q_proj", "k_proj", "v_proj", "output_proj"):
            want[p + f"attn.{proj}.weight"] = (d, d)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == want


def test_ablation_keys():
    keys = lambda **kw: set(tinylm.TransformerLM(tinylm.preset("tiny", **kw)).state_dict())
    assert "ln_final.weight" not in keys(norm="post") and "layers.0.ln1.weight" in keys(norm="post")
    assert not any("ln" in k for k in keys(norm="none"))
    assert "layers.0.ffn.w3.weight" not in keys(ffn="silu")


def test_tied_embeddings_share_one_parameter():
    model = tinylm.TransformerLM(tinylm.preset("tiny", tie_embeddings=True))
    assert model.lm_head.weight is model.token_embeddings.weight
    untied = tinylm.TransformerLM(tinylm.preset("tiny"))
    assert model.num_parameters() == untied.num_parameters() - 10000 * 64


def test_sequence_longer_than_context_is_a_clear_error():
    model = tinylm.TransformerLM(SMALL)
    with pytest.raises(ValueError, match="context_length=12"):
        model(torch.zeros(1, 13, dtype=torch.long))


def test_linear_contracts_last_dim_with_any_leading_dims():
    lin = tinylm.Linear(5, 3, bias=True).double()
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, rtol=1e-12, atol=1e-12)
    assert "in_features=5, out_features=3, bias=True" in repr(lin)


def test_swiglu_formula_and_default_d_ff():
    ffn = tinylm.SwiGLU(8, 16).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    want = ffn.w2(F.silu(ffn.w1(x)) * ffn.w3(x))
    torch.testing.assert_close(ffn(x), want, rtol=0, atol=0)
    assert tinylm.default_d_ff(512) == 1408 and tinylm.default_d_ff(768) == 2048
    assert tinylm.default_d_ff(64) % 64 == 0 and tinylm.default_d_ff(64) >= 8 * 64 / 3


@pytest.mark.parametrize(
    "changes, field",
    [({"d_model": 30}, "num_heads"), ({"num_heads": 32, "d_model": 96}, "odd"), ({"vocab_size": 0}, "vocab_size"),
     ({"norm": "mid"}, "norm"), ({"dropout": 1.0}, "dropout"), ({"d_ff": 2.5}, "d_ff")],
)
def test_config_validation_names_the_field(changes, field):
    with pytest.raises(tinylm.ConfigError, match=field):
        SMALL.replace(**changes)


def test_odd_head_dim_is_fine_without_rope():
    assert SMALL.replace(num_heads=32, d_model=96, positions="none").head_dim == 3


def test_config_dict_round_trip_and_unknown_field():
    assert tinylm.ModelConfig.from_dict(SMALL.to_dict()) == SMALL
    with pytest.raises(tinylm.ConfigError, match="'colour'"):
        tinylm.ModelConfig.from_dict({**SMALL.to_dict(), "colour": 1})


def test_dropout_is_active_in_training_only():
    c = SMALL.replace(dropout=0.5)
    model = tinylm.TransformerLM(c)
    x = tokens(c, (2, 8))
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


def test_the_builtin_reference_refuses_what_it_does_not_build():
    """BuiltinLM has one K/V head per query head and no window: a config asking for either is refused."""
    import dataclasses

    from tinylm.errors import ConfigError
    from tinylm.reference import BuiltinLM

    for change in (dict(num_kv_heads=2), dict(sliding_window=4)):
        with pytest.raises(ConfigError, match="BuiltinLM covers full causal multi-head attention"):
            BuiltinLM(dataclasses.replace(tinylm.preset("tiny"), **change))
    BuiltinLM(tinylm.preset("tiny"))  # the plain config still builds


def _scalar_reads(fn) -> int:
    """How many tensor -> Python scalar reads (``aten._local_scalar_dense``: a device sync on a GPU) ``fn`` makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_a_forward_and_backward_reads_no_scalar_from_the_device():
    """RoPE's bound check reads the largest position only for positions a caller passes; the model's own
    positions 0..T-1 are checked from the shape, so a step makes no device sync at any depth."""
    import dataclasses

    tok = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))
    for layers in (2, 4):
        model = tinylm.TransformerLM(dataclasses.replace(tinylm.preset("tiny"), num_layers=layers))
        step = lambda: tinylm.functional.cross_entropy(model(tok[:, :-1]), tok[:, 1:]).backward()  # noqa: E731
        assert _scalar_reads(step) == 0
    # negative control: positions given by the caller are checked once per attention (one read each)
    attn = model.layers[0].attn
    x = torch.randn(2, 16, model.config.d_model)
    assert _scalar_reads(lambda: attn(x, torch.arange(16))) == 1
