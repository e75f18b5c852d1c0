"""tinylm's own contract: ``ModelConfig`` validation and round trips, the validation module's one message pattern.

Every field of ``ModelConfig`` refuses each kind of wrong value with the one-line
message ``name=value: must <rule>[; pass <fix>]`` (the exact text is what a user
reads, so it is asserted whole), accepts the edge of its valid range, and survives
``to_dict`` / ``from_dict`` unchanged. These are properties of tinylm itself, not of
an implementation under test, so they carry the ``tinylm_only`` marker.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from props.contract import assert_refused
from props.record import prop
from props.strategies import model_configs
from tinylm import errors
from tinylm.config import PRESETS, ModelConfig, default_d_ff, preset
from tinylm.errors import ConfigError, TinyLMError
from tinylm.validate import boolean, check, choice, fail, integer, number

pytestmark = pytest.mark.tinylm_only

SIZES = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff")
BASE = dict(vocab_size=16, context_length=8, d_model=8, num_layers=2, num_heads=2, d_ff=12)




@prop("default_d_ff(d, m) is the least multiple of m that is >= 8d/3; d or m <= 0 is refused naming both")
@given(d=st.integers(1, 5000), m=st.integers(1, 256))
def test_default_d_ff(d, m):
    f = default_d_ff(d, m)
    assert f % m == 0 and 3 * f >= 8 * d and 3 * (f - m) < 8 * d, (d, m, f)
    g = default_d_ff(d)
    assert g % 64 == 0 and 3 * g >= 8 * d and 3 * (g - 64) < 8 * d, (d, g)


def test_default_d_ff_refuses_non_positive():
    for d, m in ((0, 64), (8, 0), (-1, 64), (8, -3)):
        assert_refused(ConfigError, f"d_model={d}, multiple_of={m}: both must be positive", default_d_ff, d, m)
    assert default_d_ff(1, 1) == 3 and default_d_ff(768) == 2048 and default_d_ff(512) == 1408


@prop("ModelConfig: every valid config round-trips through to_dict/from_dict and replace() unchanged; head_dim = d/H")
@settings(max_examples=30)
@given(cfg=model_configs(max_layers=4, max_heads=8))
def test_round_trip(cfg):
    d = cfg.to_dict()
    assert isinstance(d, dict) and set(d) == {f for f in ModelConfig.__dataclass_fields__}
    assert ModelConfig.from_dict(d) == cfg and cfg.replace() == cfg
    assert cfg.head_dim == cfg.d_model // cfg.num_heads and cfg.head_dim * cfg.num_heads == cfg.d_model
    other = cfg.replace(num_layers=cfg.num_layers + 1)
    assert other.num_layers == cfg.num_layers + 1 and other.replace(num_layers=cfg.num_layers) == cfg


def test_defaults_are_the_documented_ones():
    c = ModelConfig(**BASE)
    assert (c.rope_theta, c.eps, c.norm, c.ffn, c.positions, c.tie_embeddings, c.dropout, c.init, c.norm_kind,
            c.bias) == (10000.0, 1e-5, "pre", "swiglu", "rope", False, 0.0, "cs336", "rms", False)
    assert c.rope is True and c.replace(positions="learned").rope is False
    assert ModelConfig.from_dict(dict(BASE)) == c  # fields with defaults may be left out


@pytest.mark.parametrize("name", SIZES)
@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "4", None, np.float64(4.0)])
def test_sizes_refuse_non_positive_integers(name, bad):
    assert_refused(ConfigError, f"{name}={bad!r}: must be an integer >= 1", ModelConfig, **{**BASE, name: bad})


def test_sizes_accept_numpy_integers_and_one():
    c = ModelConfig(**{**BASE, "vocab_size": np.int64(1), "num_layers": 1, "context_length": 1, "d_ff": 1})
    assert c.vocab_size == 1 and c.num_layers == 1


def test_heads_divide_width_and_rope_needs_even_head_dim():
    assert_refused(ConfigError, "d_model=10, num_heads=4: d_model must be divisible by num_heads",
            ModelConfig, **{**BASE, "d_model": 10, "num_heads": 4})
    assert_refused(ConfigError, "head dimension d_model/num_heads=3 is odd: RoPE rotates pairs, so it must be even "
            "(change num_heads, or set positions='learned' or 'none')", ModelConfig, **{**BASE, "d_model": 6, "num_heads": 2})
    assert ModelConfig(**{**BASE, "d_model": 6, "num_heads": 2, "positions": "none"}).head_dim == 3
    assert ModelConfig(**{**BASE, "d_model": 6, "num_heads": 2, "positions": "learned"}).head_dim == 3
    assert ModelConfig(**{**BASE, "d_model": 12, "num_heads": 3}).head_dim == 4


@pytest.mark.parametrize("field, bad, message", [
    ("rope_theta", 0.0, "rope_theta=0.0: must be a finite number > 0.0"),
    ("rope_theta", -1.0, "rope_theta=-1.0: must be a finite number > 0.0"),
    ("rope_theta", math.inf, "rope_theta=inf: must be a finite number > 0.0"),
    ("rope_theta", True, "rope_theta=True: must be a finite number > 0.0"),
    ("eps", -1e-9, "eps=-1e-09: must be a finite number >= 0.0"),
    ("eps", math.nan, "eps=nan: must be a finite number >= 0.0"),
    ("eps", "1e-5", "eps='1e-5': must be a finite number >= 0.0"),
    ("norm", "layer", "norm='layer': must be one of pre, post, none"),
    ("norm_kind", "pre", "norm_kind='pre': must be one of rms, layer"),
    ("ffn", "geglu", "ffn='geglu': must be one of swiglu, silu, gelu, gelu_tanh, relu"),
    ("positions", True, "positions=True: must be one of rope, learned, none"),
    ("positions", "absolute", "positions='absolute': must be one of rope, learned, none"),
    ("bias", 1, "bias=1: must be True or False"),
    ("bias", None, "bias=None: must be True or False"),
    ("tie_embeddings", "yes", "tie_embeddings='yes': must be True or False"),
    ("tie_embeddings", 0, "tie_embeddings=0: must be True or False"),
    ("dropout", 1.0, "dropout=1.0: must be a number in [0, 1)"),
    ("dropout", -0.1, "dropout=-0.1: must be a number in [0, 1)"),
    ("dropout", True, "dropout=True: must be a number in [0, 1)"),
    ("dropout", "0.1", "dropout='0.1': must be a number in [0, 1)"),
    ("init", "", "init='': must name an init scheme; pass one of tinylm.init.SCHEMES"),
    ("init", 3, "init=3: must name an init scheme; pass one of tinylm.init.SCHEMES"),
])
def test_fields_refuse_with_the_pattern(field, bad, message):
    assert_refused(ConfigError, message, ModelConfig, **{**BASE, field: bad})


def test_fields_accept_the_edges_of_their_range():
    edge = ModelConfig(**BASE, rope_theta=1e-300, eps=0.0, dropout=0, norm="none", ffn="silu", tie_embeddings=True)
    assert edge.dropout == 0 and edge.eps == 0.0
    assert ModelConfig(**BASE, dropout=0.999999, positions="none", norm="post").dropout == 0.999999


def test_replace_validates_again():
    assert_refused(ConfigError, "num_heads=0: must be an integer >= 1", ModelConfig(**BASE).replace, num_heads=0)


def test_from_dict_names_what_is_wrong():
    assert_refused(ConfigError, "data=list: must be a dict of config fields", ModelConfig.from_dict, [("vocab_size", 4)])
    known = ", ".join(sorted(ModelConfig.__dataclass_fields__))
    assert_refused(ConfigError, f"unknown config field(s) 'heads', 'width'; known: {known}",
            ModelConfig.from_dict, {**BASE, "width": 4, "heads": 2})
    partial = {k: v for k, v in BASE.items() if k not in ("d_ff", "num_heads")}
    assert_refused(ConfigError, "config lacks field(s) d_ff, num_heads", ModelConfig.from_dict, partial)
    assert_refused(ConfigError, "d_ff=0: must be an integer >= 1", ModelConfig.from_dict, {**BASE, "d_ff": 0})


def test_presets_hold_the_documented_shapes():
    shape = {name: tuple(getattr(c, f) for f in SIZES) for name, c in PRESETS.items()}
    assert shape == {
        "tiny": (10000, 16, 64, 3, 4, 128),             # the CS336 assignment-1 test fixture
        "tinystories": (10000, 256, 512, 4, 16, 1344),  # the CS336 TinyStories model
        "gpt2-small": (50257, 1024, 768, 12, 12, default_d_ff(768)),
        "gpt2": (50257, 1024, 768, 12, 12, 3072),       # GPT-2 small itself
        "gpt2-tiny": (10000, 64, 64, 3, 4, 256),
    }
    cs336 = ("tiny", "tinystories", "gpt2-small")
    assert all(PRESETS[n] == ModelConfig(**{f: getattr(PRESETS[n], f) for f in SIZES}) for n in cs336), "CS336 block"
    gpt2 = dict(norm="pre", norm_kind="layer", ffn="gelu_tanh", positions="learned", bias=True, tie_embeddings=True,
                init="gpt2", eps=1e-5)
    for name in ("gpt2", "gpt2-tiny"):
        assert PRESETS[name] == ModelConfig(**{f: getattr(PRESETS[name], f) for f in SIZES}, **gpt2), name
    assert preset("tiny") is PRESETS["tiny"]
    changed = preset("tinystories", num_layers=2, positions="none")
    assert changed == PRESETS["tinystories"].replace(num_layers=2, positions="none") and PRESETS["tinystories"].num_layers == 4
    assert_refused(ConfigError, "unknown preset 'huge'; choose one of tiny, tinystories, gpt2-small, gpt2, gpt2-tiny",
                   preset, "huge")


def test_legacy_rope_key_maps_to_positions():
    """Configs stored before ``positions`` existed carry a boolean "rope": True is RoPE, False is NoPE."""
    assert ModelConfig.from_dict({**BASE, "rope": True}) == ModelConfig(**BASE)
    assert ModelConfig.from_dict({**BASE, "rope": False}) == ModelConfig(**BASE, positions="none")
    assert ModelConfig.from_dict({**BASE, "rope": False, "positions": "none"}).positions == "none"
    assert_refused(ConfigError, "rope=False and positions='rope' disagree; drop the legacy 'rope' key",
                   ModelConfig.from_dict, {**BASE, "rope": False, "positions": "rope"})
    assert_refused(ConfigError, "rope=1: must be True or False; pass True or False (the legacy field; use positions=)",
                   ModelConfig.from_dict, {**BASE, "rope": 1})
    assert "rope" not in ModelConfig(**BASE).to_dict()
    with pytest.raises(TypeError):
        ModelConfig(**BASE, rope=False)  # no longer a field: only the legacy dict key is read


# ------------------------------------------------------------------ the validation module


@prop("validate.integer: any int or numpy int within [low, high] comes back as that int; anything else is refused")
@given(v=st.integers(-50, 50), low=st.none() | st.integers(-20, 20), high=st.none() | st.integers(-20, 20))
def test_integer_bounds(v, low, high):
    inside = (low is None or v >= low) and (high is None or v <= high)
    if inside:
        out = integer("n", np.int32(v), low=low, high=high)
        assert out == v and type(out) is int
    else:
        with pytest.raises(TinyLMError, match=r"^n=-?\d+: must be an integer "):
            integer("n", v, low=low, high=high)


@prop("validate.number: finite reals within the bounds (strict or not) come back as float; others are refused")
@given(v=st.floats(-10, 10), low=st.none() | st.floats(-5, 5), strict=st.booleans(), high=st.none() | st.floats(-5, 5))
def test_number_bounds(v, low, strict, high):
    inside = (low is None or (v > low if strict else v >= low)) and (high is None or v <= high)
    if inside:
        out = number("x", v, low=low, high=high, strict_low=strict)
        assert out == v and type(out) is float
        assert type(number("x", int(v), low=None, high=None)) is float
    else:
        with pytest.raises(TinyLMError, match=r"^x=.+: must be a finite number"):
            number("x", v, low=low, high=high, strict_low=strict)


def test_messages_state_the_bounds():
    assert_refused(TinyLMError, "n=0: must be an integer in [1, 3]; pass n=N", integer, "n", 0, low=1, high=3, fix="n=N")
    assert_refused(TinyLMError, "n=5: must be an integer <= 3", integer, "n", 5, high=3)
    assert_refused(TinyLMError, "n=1.5: must be an integer", integer, "n", 1.5)
    assert_refused(TinyLMError, "x=0.0: must be a finite number in (0.0, 1.0]", number, "x", 0.0, low=0.0, high=1.0, strict_low=True)
    assert_refused(TinyLMError, "x=2.0: must be a finite number in [0.0, 1.0]", number, "x", 2.0, low=0.0, high=1.0)
    assert_refused(TinyLMError, "x=2.0: must be a finite number <= 1.0", number, "x", 2.0, high=1.0)
    assert_refused(TinyLMError, "x=-inf: must be a finite number", number, "x", -math.inf)
    assert_refused(TinyLMError, "x=-1.0: must be a finite number >= 0.0; pass x=X", number, "x", -1.0, low=0.0, fix="x=X")
    assert number("x", 1.0, low=1.0) == 1.0 and integer("n", 3, low=3, high=3) == 3
    assert number("x", 1.0, low=0.0, high=1.0, strict_low=True) == 1.0


def test_choice_boolean_check_and_fail():
    assert choice("k", "b", ("a", "b")) == "b"
    assert_refused(ConfigError, "k='c': must be one of a, b; pass k='a'", choice, "k", "c", ("a", "b"), fix="k='a'", error=ConfigError)
    assert boolean("b", False) is False and boolean("b", True) is True
    assert_refused(TinyLMError, "b=0: must be True or False; pass b=True", boolean, "b", 0, fix="b=True")
    assert check("v", 7, lambda x: x > 3, "exceed 3") == 7
    assert_refused(ConfigError, "v=2: must exceed 3", check, "v", 2, lambda x: x > 3, "exceed 3", error=ConfigError)
    assert_refused(TinyLMError, "v=2: must exceed 3; pass v=4", check, "v", 2, lambda x: x > 3, "exceed 3", fix="v=4")
    assert_refused(ConfigError, "name='x': must y; pass z", fail, "name", "x", "y", "z", error=ConfigError)
    assert_refused(TinyLMError, "name='x': must y", fail, "name", "x", "y")


def test_each_check_raises_the_callers_error_class():
    class Mine(TinyLMError):
        pass

    for fn, args in ((integer, ("n", "x")), (number, ("x", "y")), (choice, ("c", 3, (1,))), (boolean, ("b", 1)),
                     (check, ("v", 1, lambda _: False, "r"))):
        with pytest.raises(Mine):
            fn(*args, error=Mine)


def test_errors_are_value_errors_and_name_the_argument():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.TinyLMError) and issubclass(getattr(errors, name), ValueError)
    assert issubclass(errors.MissingOptionError, errors.CheckpointError)
    assert issubclass(errors.UnsafeCheckpointError, errors.CheckpointError)
    e = errors.MissingOptionError("num_heads", "the checkpoint stores no config")
    assert (e.field, e.argument) == ("num_heads", "num_heads")
    assert str(e) == "the checkpoint stores no config; pass num_heads=N"
    assert re.fullmatch(r"[^\n]+", str(e))
