"""tinylm.validate: one message pattern, ``name=value: must <rule>[; pass <fix>]``, every caller's error class."""

from __future__ import annotations

import numpy as np
import pytest

from diagnostics.options import DiagnoseOptions, OptionsError, ProbeOptions
from tinylm import ModelConfig
from tinylm.errors import ConfigError, TinyLMError
from tinylm.train import TrainError, TrainOptions
from tinylm.validate import boolean, choice, fail, flag_of, integer, number

PATTERN = r"^[a-z_0-9]+=.+: must .+"


@pytest.mark.parametrize("value", [1, 5, np.int64(3), np.int32(7)])
def test_integer_accepts_integers_in_range(value):
    assert integer("n", value, low=1, high=10) == int(value)
    assert type(integer("n", value, low=1)) is int


@pytest.mark.parametrize("value", [0, 11, True, 2.0, "3", None, np.float64(3.0)])
def test_integer_refuses_with_the_pattern(value):
    with pytest.raises(TinyLMError, match=r"^n=.*: must be an integer in \[1, 10\]; pass --n N$"):
        integer("n", value, low=1, high=10, fix="--n N")


def test_number_bounds_and_finiteness():
    assert number("lr", 0.5, low=0.0, strict_low=True) == 0.5
    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(TinyLMError, match=r"^lr=.*: must be a finite number > 0.0$"):
            number("lr", bad, low=0.0, strict_low=True)
    assert number("eps", 0.0, low=0.0) == 0.0


def test_choice_boolean_and_fail():
    assert choice("norm", "pre", ("pre", "post")) == "pre"
    with pytest.raises(TinyLMError, match=r"^norm='mid': must be one of pre, post$"):
        choice("norm", "mid", ("pre", "post"))
    with pytest.raises(TinyLMError, match=r"^rope=1: must be True or False$"):
        boolean("rope", 1)
    with pytest.raises(ConfigError, match=r"^x=3: must be odd; pass x=5$"):
        fail("x", 3, "be odd", "x=5", error=ConfigError)
    assert flag_of("seq_len") == "--seq-len"


@pytest.mark.parametrize("make, error", [
    (lambda: ModelConfig(vocab_size=0, context_length=8, d_model=8, num_layers=1, num_heads=2, d_ff=8), ConfigError),
    (lambda: ModelConfig(vocab_size=8, context_length=8, d_model=8, num_layers=1, num_heads=2, d_ff=8, norm="mid"),
     ConfigError),
    (lambda: ModelConfig(vocab_size=8, context_length=8, d_model=8, num_layers=1, num_heads=2, d_ff=8, dropout=1.0),
     ConfigError),
    (lambda: TrainOptions(steps=0), TrainError),
    (lambda: TrainOptions(steps=5, lr=-1.0), TrainError),
    (lambda: TrainOptions(steps=5, beta1=1.0), TrainError),
    (lambda: DiagnoseOptions(batches=0), OptionsError),
    (lambda: DiagnoseOptions(theory="magic"), OptionsError),
    (lambda: ProbeOptions(backward="yes"), OptionsError),
    (lambda: ProbeOptions(modules="layers.0"), OptionsError),
])
def test_every_options_class_speaks_the_pattern(make, error):
    with pytest.raises(error, match=PATTERN):
        make()


def test_pattern_rejects_a_message_off_the_pattern():
    # negative control for PATTERN: the old style "field: bad value" does not match it
    import re

    assert re.match(PATTERN, "seq_len=3: must be an integer >= 4")
    assert not re.match(PATTERN, "seq_len: bad value 3")
