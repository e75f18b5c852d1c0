"""Construction arguments and their checks: dtype, device, sizes, context length, RoPE table, init registry.

Each public constructor argument is exercised with a value other than its default,
and each argument check raises with a message that names the value (the exact
one-line messages below are part of the contract that users read).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.strategies import generator, model_configs, seeds


@pytest.mark.tinylm_only  # tinylm's own constructor arguments, whatever the implementation under test
@prop("TransformerLM(dtype=float64) and device='meta': every parameter in that dtype / on meta; materialize() to cpu; ties kept", needs=("transformer_lm",))
@settings(max_examples=8)
@given(cfg=model_configs(max_layers=2, max_vocab=32, max_context=8))
def test_model_dtype_and_meta(impl, cfg):
    from tinylm.model import TransformerLM  # the constructor's own arguments (dtype, device) are tinylm's API

    m64 = TransformerLM(cfg, generator(0), dtype=torch.float64)
    wrong = [n for n, p in m64.named_parameters() if p.dtype != torch.float64]
    assert not wrong, f"dtype=float64 left {wrong[:3]} in another dtype"
    meta = TransformerLM(cfg, device="meta")
    off = [n for n, p in meta.named_parameters() if p.device.type != "meta"]
    assert not off, f"device='meta' allocated {off[:3]}"
    if cfg.tie_embeddings:
        assert meta.lm_head.weight is meta.token_embeddings.weight, "a meta-built tied model is not tied"
    meta.materialize()
    assert all(p.device.type == "cpu" for p in meta.parameters()), "materialize() did not default to the cpu"
    distinct = {id(p): p.numel() for p in m64.parameters()}
    assert m64.num_parameters() == sum(distinct.values()) == sum(p.numel() for p in m64.state_dict().values()) - (
        cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0
    ), "num_parameters does not count each distinct parameter once"
    check(0.0, 0.0, "construction", kind="exact")


@prop("the model takes token ids (..., T): 1-D, 2-D and 3-D agree row by row; T > context_length raises naming it", needs=("transformer_lm",))
@settings(max_examples=8)
@given(cfg=model_configs(max_layers=1, max_vocab=32, max_context=6), seed=seeds())
def test_model_token_shapes_and_context(impl, cfg, seed):
    g = generator(seed)
    model = impl.transformer_lm(cfg, g).double().eval()
    T = cfg.context_length
    tok = torch.randint(0, cfg.vocab_size, (2, 3, T), generator=g)
    with torch.no_grad():
        out3 = model(tok)
        out2 = model(tok[0])
        out1 = model(tok[0, 1])
    assert out3.shape == (2, 3, T, cfg.vocab_size) and out1.shape == (T, cfg.vocab_size)
    scale = 1 + float(out3.abs().max())
    err = max(float((out3[0] - out2).abs().max()), float((out2[1] - out1).abs().max())) / scale
    long = torch.zeros(1, T + 1, dtype=torch.long)
    msg = rf"^sequence length {T + 1} > context_length={T}: pass at most context_length tokens \(or build the model with a longer context\)$"
    with pytest.raises(ValueError, match=msg):
        model(long)
    check(err, 1e-12, "logits depend on the leading shape of token ids")


@prop("RoPE: a position >= max_seq_len raises ValueError naming the position and max_seq_len", needs=("layers",))
@given(T=st.integers(1, 8), theta=st.sampled_from([100.0, 1e4]))
def test_rope_table_bound(impl, T, theta):
    rope = impl.layers.RotaryPositionalEmbedding(theta, 4, T)
    x = torch.zeros(T + 1, 4)
    rope(x[:T], torch.arange(T))  # the last table row is usable
    msg = rf"^token position {T} >= max_seq_len={T}: the sequence is longer than the RoPE table$"
    with pytest.raises(ValueError, match=msg):
        rope(x, torch.arange(T + 1))
    check(0.0, 0.0, "RoPE bound", kind="raises")


@prop("modules record their sizes and dtype: Linear, Embedding, SwiGLU/SiLU FFN built in float64 hold float64", needs=("layers",))
@given(a=st.integers(1, 9), b=st.integers(1, 9))
def test_module_sizes_and_dtype(impl, a, b):
    L = impl.layers
    lin, emb = L.Linear(a, b, dtype=torch.float64), L.Embedding(a, b, dtype=torch.float64)
    assert (lin.in_features, lin.out_features, emb.num_embeddings, emb.embedding_dim) == (a, b, a, b)
    assert lin.weight.shape == (b, a) and emb.weight.shape == (a, b)
    mods = [lin, emb, L.SwiGLU(a, b, dtype=torch.float64), L.SiLUFFN(a, b, dtype=torch.float64), L.RMSNorm(a, dtype=torch.float64),
            L.MultiHeadSelfAttention(2 * a, 2, dtype=torch.float64)]
    wrong = [type(m).__name__ for m in mods for p in m.parameters() if p.dtype != torch.float64]
    assert not wrong, f"dtype=float64 ignored by {wrong}"
    meta = [L.SiLUFFN(a, b, device="meta"), L.SwiGLU(a, b, device="meta"), L.Embedding(a, b, device="meta"),
            L.RMSNorm(a, device="meta"), L.MultiHeadSelfAttention(4 * a, 2, 4, 100.0, device="meta")]
    assert all(t.device.type == "meta" for m in meta for t in [*m.parameters(), *m.buffers()]), "device='meta' ignored"
    check(0.0, 0.0, "module sizes", kind="exact")


@prop("TransformerLM rejects a config that is not a ModelConfig, naming the type it got", needs=("transformer_lm",))
def test_model_rejects_non_config(impl):
    from tinylm.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^config must be a tinylm.ModelConfig, got dict$"):
        impl.transformer_lm({"vocab_size": 4}, None)
    check(0.0, 0.0, "non-config", kind="raises")


# -- the init registry ------------------------------------------------------------------------------------

BUILTIN_SCHEMES = ("cs336", "kaiming", "torch-default", "gpt2", "small-init", "zero-residual")


def _site(impl, kind: str, fan_in: int = 8, fan_out: int = 4, residual: bool = False):
    return impl.init.ParamSite("p", kind, fan_in, fan_out, residual, 2, fan_out)


@prop("every scheme states why for each rule; biases: 0, torch-default U(+-1/sqrt(d_in)); an unknown kind raises naming scheme", needs=("init",))
@pytest.mark.parametrize("scheme", BUILTIN_SCHEMES)
def test_scheme_rules_and_reasons(impl, scheme):
    from tinylm.errors import ConfigError

    fn = impl.init.get(scheme)
    for kind in ("linear_weight", "linear_bias", "embedding", "norm_gain"):
        for residual in (False, True):
            d = fn(_site(impl, kind, residual=residual))
            assert isinstance(d.why, str) and d.why.strip(), f"{scheme}: no reason stated for {kind}"
    bias = fn(_site(impl, "linear_bias", fan_in=16))
    want = ("uniform", -0.25, 0.25) if scheme == "torch-default" else ("constant", 0.0)
    got = (bias.family, bias.low, bias.high) if bias.family == "uniform" else (bias.family, bias.value)
    assert got == want, f"{scheme}: bias declared {got}, documented {want}"
    msg = rf"^init scheme '{re.escape(scheme)}' has no rule for parameter 'p' of kind 'other'; register a scheme that covers it \(tinylm.init.register\)$"
    with pytest.raises(ConfigError, match=msg):
        fn(_site(impl, "other"))
    check(0.0, 0.0, f"{scheme}: rules", kind="exact")


@prop("truncnorm_variance at the edges: sigma = 0 gives 0, infinite bounds sigma^2, one-sided sigma^2 (1 - 2/pi)", needs=("init",))
@given(sigma=st.floats(1e-3, 10.0))
def test_truncnorm_variance_edges(impl, sigma):
    import math

    tv = impl.init.truncnorm_variance
    assert tv(0.0, -1.0, 1.0) == 0.0 and impl.init.Dist("trunc_normal", std=0.0, low=0.0, high=0.0).variance == 0.0
    errs = [abs(tv(sigma, -math.inf, math.inf) - sigma**2) / sigma**2,
            abs(tv(sigma, 0.0, math.inf) - sigma**2 * (1 - 2 / math.pi)) / sigma**2,
            abs(tv(sigma, -math.inf, 0.0) - sigma**2 * (1 - 2 / math.pi)) / sigma**2]
    check(max(errs), 1e-12, "truncated-normal variance with infinite bounds", kind="rel error")


@prop("register: a valid scheme is used by declare/apply (by name or as a function); bad names, non-functions, clashes raise", needs=("init", "transformer_lm"))
def test_register(impl):
    from tinylm.config import ModelConfig
    from tinylm.errors import ConfigError

    init = impl.init

    def tiny(site):
        if site.kind == "linear_weight":
            return init.Dist("normal", std=1e-3, why="deliberately small")
        return init.cs336(site)

    name = "props-test-tiny"
    try:
        assert init.register(name, tiny) is tiny and init.SCHEMES[name] is tiny
        with pytest.raises(ConfigError, match=rf"^init scheme '{name}' exists already; pass overwrite=True to replace it$"):
            init.register(name, tiny)
        init.register(name, init.cs336, overwrite=True)
        assert init.SCHEMES[name] is init.cs336
        init.register(name, tiny, overwrite=True)
        model = impl.transformer_lm(ModelConfig(vocab_size=8, context_length=4, d_model=8, num_layers=1, num_heads=2, d_ff=8), generator(0))
        by_name, by_fn = init.declare(model, name), init.declare(model, tiny)
        assert by_name == by_fn and by_name["lm_head.weight"].std == 1e-3
        init.apply(model, name, generator=generator(1))
        assert float(model.lm_head.weight.detach().abs().max()) < 1e-2
    finally:
        init.SCHEMES.pop(name, None)
    with pytest.raises(ConfigError, match=r"^name='': a scheme needs a non-empty name$"):
        init.register("", tiny)
    with pytest.raises(ConfigError, match=r"^name=3: a scheme needs a non-empty name$"):
        init.register(3, tiny)
    with pytest.raises(ConfigError, match=r"^scheme=42: must be a function ParamSite -> Dist$"):
        init.register("props-test-bad", 42)
    assert "props-test-bad" not in init.SCHEMES
    check(0.0, 0.0, "register", kind="exact")


@prop("Linear(bias=True): y = x W^T + b, bias in the module's dtype and device", needs=("layers",))
@given(seed=seeds(), a=st.integers(1, 8), b=st.integers(1, 8))
def test_linear_bias(impl, seed, a, b):
    g = generator(seed)
    lin = impl.layers.Linear(a, b, bias=True, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(b, a, generator=g, dtype=torch.float64))
        lin.bias.copy_(torch.randn(b, generator=g, dtype=torch.float64))
    x = torch.randn(3, a, generator=g, dtype=torch.float64)
    W, bias = lin.weight.detach(), lin.bias.detach()
    with torch.no_grad():
        err = float((lin(x) - (x @ W.T + bias)).abs().max())
    assert lin.bias.dtype == torch.float64 and lin.bias.shape == (b,)
    assert impl.layers.Linear(a, b, bias=True, device="meta").bias.device.type == "meta"
    check(err, 4 * (a + 2) * 2.0**-53 * (1 + float(x.abs().max() * W.abs().max() * a + bias.abs().max())), "Linear with bias")


@pytest.mark.tinylm_only  # tinylm's own TransformerBlock, whatever the implementation under test
@prop("TransformerBlock defaults: pre-norm, SwiGLU, no dropout, eps 1e-5; eps, dtype, device and bad norm/ffn (named) honoured", needs=("transformer_block",))
def test_block_arguments(impl):
    from tinylm.model import TransformerBlock

    blk = TransformerBlock(8, 2, 12, 6, 100.0)
    assert (blk.norm, blk.dropout, blk.ln1.eps, blk.ln2.eps) == ("pre", 0.0, 1e-5, 1e-5) and hasattr(blk.ffn, "w3")
    assert impl.layers.RMSNorm(4).eps == 1e-5
    blk = TransformerBlock(8, 2, 12, 6, 100.0, eps=0.25, norm="post", ffn="silu", dtype=torch.float64)
    assert (blk.ln1.eps, blk.ln2.eps) == (0.25, 0.25) and not hasattr(blk.ffn, "w3")
    assert all(p.dtype == torch.float64 for p in blk.parameters()), "TransformerBlock ignored dtype"
    none = TransformerBlock(8, 2, 12, 6, None, norm="none")
    assert not hasattr(none, "ln1") and not hasattr(none, "ln2") and none.attn.rope is None
    meta = TransformerBlock(8, 2, 12, 6, 100.0, device="meta")
    assert all(t.device.type == "meta" for t in [*meta.parameters(), *meta.buffers()]), "device='meta' ignored"
    with pytest.raises(ValueError, match=r"^norm='mid': must be 'pre', 'post' or 'none'$"):
        TransformerBlock(8, 2, 12, 6, None, norm="mid")
    with pytest.raises(ValueError, match=r"^ffn='geglu': must be 'swiglu' or one of silu, gelu, gelu_tanh, relu$"):
        TransformerBlock(8, 2, 12, 6, None, ffn="geglu")
    with pytest.raises(ValueError, match=r"^d_model=9, num_heads=2: d_model must be divisible by num_heads$"):
        impl.layers.MultiHeadSelfAttention(9, 2)
    with pytest.raises(ValueError, match=r"^theta given without max_seq_len: RoPE needs max_seq_len for its tables$"):
        impl.layers.MultiHeadSelfAttention(8, 2, theta=100.0)
    check(0.0, 0.0, "block arguments", kind="exact")


@prop("init.sites on any module: parameter names, kinds, fans (bare parameters: shape[-1], shape[0]; scalars 1), layer count", needs=("init", "layers"))
def test_sites_of_any_module(impl):
    from torch import nn

    from tinylm.errors import ConfigError

    L = impl.layers

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))
            self.table = nn.Parameter(torch.ones(5, 3))
            self.cube = nn.Parameter(torch.ones(2, 3, 4))
            self.proj = L.Linear(3, 4, bias=True)
            self.emb = L.Embedding(7, 3)
            self.layers = nn.ModuleList(L.RMSNorm(3) for _ in range(3))

    got = {n: (s.name, s.kind, s.fan_in, s.fan_out, s.num_layers, s.d_model) for n, (s, _) in impl.init.sites(Custom()).items()}
    want = {
        "scale": ("scale", "other", 1, 1, 3, 1),
        "table": ("table", "other", 3, 5, 3, 5),
        "cube": ("cube", "other", 4, 2, 3, 2),
        "proj.weight": ("proj.weight", "linear_weight", 3, 4, 3, 4),
        "proj.bias": ("proj.bias", "linear_bias", 3, 4, 3, 4),
        "emb.weight": ("emb.weight", "embedding", 1, 3, 3, 3),
        **{f"layers.{i}.weight": (f"layers.{i}.weight", "norm_gain", 3, 3, 3, 3) for i in range(3)},
    }
    assert got == want, f"sites differ: {set(got.items()) ^ set(want.items())}"
    bare = impl.init.sites(L.Linear(2, 5))
    assert {n: (s.kind, s.num_layers) for n, (s, _) in bare.items()} == {"weight": ("linear_weight", 1)}
    with pytest.raises(ConfigError, match=r"^unknown init scheme 'nope'; choose one of cs336, kaiming, torch-default"):
        impl.init.get("nope")
    with pytest.raises(ValueError, match=r"^d_k=3: RoPE rotates pairs of dimensions, so d_k must be even$"):
        L.RotaryPositionalEmbedding(100.0, 3, 4)
    check(0.0, 0.0, "sites", kind="exact")


# The text a report shows for each declaration (the "declared" column and its reason), as
# docs/model.md documents the schemes: a rule whose numbers hold but whose stated reason or
# formula text changed would tell a user something else.
DECLARED = {  # (scheme, kind, residual) -> (describe(), why) at fan_in 8, fan_out 4, L 2, d_model 4
    ('cs336', 'linear_weight', False): ('TN(0, 0.4082^2, [-1.225, 1.225])',
        'Xavier/Glorot: 2/(d_in+d_out) is the harmonic compromise of the forward 1/d_in and backward 1/d_out conditions; truncated at 3 sigma'),
    ('cs336', 'linear_weight', True): ('TN(0, 0.4082^2, [-1.225, 1.225])',
        'Xavier/Glorot: 2/(d_in+d_out) is the harmonic compromise of the forward 1/d_in and backward 1/d_out conditions; truncated at 3 sigma'),
    ('cs336', 'linear_bias', False): ('const 0',
        'biases start at 0'),
    ('cs336', 'linear_bias', True): ('const 0',
        'biases start at 0'),
    ('cs336', 'embedding', False): ('TN(0, 1^2, [-3, 3])',
        'unit-variance token vectors, truncated at 3'),
    ('cs336', 'embedding', True): ('TN(0, 1^2, [-3, 3])',
        'unit-variance token vectors, truncated at 3'),
    ('cs336', 'norm_gain', False): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('cs336', 'norm_gain', True): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('kaiming', 'linear_weight', False): ('TN(0, 0.5^2, [-1.5, 1.5])',
        'He/Kaiming: 2/d_in keeps the second moment through a ReLU'),
    ('kaiming', 'linear_weight', True): ('TN(0, 0.5^2, [-1.5, 1.5])',
        'He/Kaiming: 2/d_in keeps the second moment through a ReLU'),
    ('kaiming', 'linear_bias', False): ('const 0',
        'biases start at 0'),
    ('kaiming', 'linear_bias', True): ('const 0',
        'biases start at 0'),
    ('kaiming', 'embedding', False): ('TN(0, 1^2, [-3, 3])',
        'unit-variance token vectors, truncated at 3'),
    ('kaiming', 'embedding', True): ('TN(0, 1^2, [-3, 3])',
        'unit-variance token vectors, truncated at 3'),
    ('kaiming', 'norm_gain', False): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('kaiming', 'norm_gain', True): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('torch-default', 'linear_weight', False): ('U(-0.3536, 0.3536)',
        "nn.Linear's default: kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(d_in))"),
    ('torch-default', 'linear_weight', True): ('U(-0.3536, 0.3536)',
        "nn.Linear's default: kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(d_in))"),
    ('torch-default', 'linear_bias', False): ('U(-0.3536, 0.3536)',
        "nn.Linear's default: kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(d_in))"),
    ('torch-default', 'linear_bias', True): ('U(-0.3536, 0.3536)',
        "nn.Linear's default: kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(d_in))"),
    ('torch-default', 'embedding', False): ('N(0, 1^2)',
        "nn.Embedding's default N(0, 1)"),
    ('torch-default', 'embedding', True): ('N(0, 1^2)',
        "nn.Embedding's default N(0, 1)"),
    ('torch-default', 'norm_gain', False): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('torch-default', 'norm_gain', True): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('gpt2', 'linear_weight', False): ('N(0, 0.02^2)',
        'GPT-2: N(0, 0.02^2)'),
    ('gpt2', 'linear_weight', True): ('N(0, 0.01^2)',
        'GPT-2: residual outputs scaled by 1/sqrt(2L) so the 2L branch sums stay O(1)'),
    ('gpt2', 'linear_bias', False): ('const 0',
        'biases start at 0'),
    ('gpt2', 'linear_bias', True): ('const 0',
        'biases start at 0'),
    ('gpt2', 'embedding', False): ('N(0, 0.02^2)',
        'GPT-2: N(0, 0.02^2)'),
    ('gpt2', 'embedding', True): ('N(0, 0.01^2)',
        'GPT-2: residual outputs scaled by 1/sqrt(2L) so the 2L branch sums stay O(1)'),
    ('gpt2', 'norm_gain', False): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('gpt2', 'norm_gain', True): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('small-init', 'linear_weight', False): ('N(0, 0.3162^2)',
        'Nguyen & Salazar small init: N(0, 2/(5d))'),
    ('small-init', 'linear_weight', True): ('N(0, 0.5^2)',
        'Wang: residual outputs std 2/(L sqrt(d))'),
    ('small-init', 'linear_bias', False): ('const 0',
        'biases start at 0'),
    ('small-init', 'linear_bias', True): ('const 0',
        'biases start at 0'),
    ('small-init', 'embedding', False): ('N(0, 0.3162^2)',
        'Nguyen & Salazar small init: N(0, 2/(5d))'),
    ('small-init', 'embedding', True): ('N(0, 0.5^2)',
        'Wang: residual outputs std 2/(L sqrt(d))'),
    ('small-init', 'norm_gain', False): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('small-init', 'norm_gain', True): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('zero-residual', 'linear_weight', False): ('TN(0, 0.4082^2, [-1.225, 1.225])',
        'Xavier/Glorot: 2/(d_in+d_out) is the harmonic compromise of the forward 1/d_in and backward 1/d_out conditions; truncated at 3 sigma'),
    ('zero-residual', 'linear_weight', True): ('const 0',
        'residual outputs zero: every block starts as the identity'),
    ('zero-residual', 'linear_bias', False): ('const 0',
        'biases start at 0'),
    ('zero-residual', 'linear_bias', True): ('const 0',
        'biases start at 0'),
    ('zero-residual', 'embedding', False): ('TN(0, 1^2, [-3, 3])',
        'unit-variance token vectors, truncated at 3'),
    ('zero-residual', 'embedding', True): ('TN(0, 1^2, [-3, 3])',
        'unit-variance token vectors, truncated at 3'),
    ('zero-residual', 'norm_gain', False): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
    ('zero-residual', 'norm_gain', True): ('const 1',
        "norm gains start at 1: the norm's output has unit RMS"),
}


@prop("every scheme's declarations read as documented: describe() and why, for every kind of parameter", needs=("init",))
@pytest.mark.parametrize("scheme", BUILTIN_SCHEMES)
def test_scheme_declarations_read_as_documented(impl, scheme):
    fn = impl.init.get(scheme)
    for (name, kind, residual), want in DECLARED.items():
        if name != scheme:
            continue
        d = fn(_site(impl, kind, residual=residual))
        got = (d.describe(), d.why)
        assert got == want, f"{scheme} {kind} residual={residual}: declared {got}, documented {want}"
    check(0.0, 0.0, f"{scheme}: declarations as documented", kind="exact")


@prop("negative control: a declaration whose reason changed by one word is not as documented", needs=("init",))
def test_scheme_declarations_negative_control(impl):
    import dataclasses

    d = impl.init.get("cs336")(_site(impl, "embedding"))
    changed = dataclasses.replace(d, why=d.why.replace("unit", "half"))
    assert (changed.describe(), changed.why) != DECLARED[("cs336", "embedding", False)]
    check(0.0, 0.0, "the comparison tells a changed reason", kind="exact")
