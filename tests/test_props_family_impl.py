"""A user's implementation and the GPT-2 family's properties: what it lacks is skipped, by name.

A CS336 implementation has no LayerNorm, GELU or learned positions; the family's properties
must skip on it, saying which function or argument is missing, and never fail it for that.
tinylm itself is never skipped (its missing piece would be a failure).
"""

from __future__ import annotations

import pytest
import torch

import tinylm
from props import impl as props_impl
from props import test_model as props_model
from props import test_wiring as props_wiring

USER = '''
import torch
import tinylm

def gelu(x):                                # no `approximate` argument
    return 0.5 * x * (1 + torch.erf(x / 2 ** 0.5))

def relu(x):
    return x.clamp(min=0)

def transformer_lm(config, generator=None):  # the CS336 block whatever the config asks
    cs336 = config.replace(positions="rope", bias=False, norm_kind="rms", ffn="swiglu")
    return tinylm.TransformerLM(cs336, generator=generator)

def transformer_block(config, generator=None):
    from tinylm.model import TransformerBlock
    return TransformerBlock(config.d_model, config.num_heads, config.d_ff, config.context_length, None, norm=config.norm)
'''


@pytest.fixture
def user(tmp_path):
    (tmp_path / "mine.py").write_text(USER)
    return props_impl.load(str(tmp_path / "mine.py"))


def test_a_gelu_without_approximate_skips_the_tanh_form_only(user):
    assert user.provided() == ["gelu", "relu", "transformer_block", "transformer_lm"]
    x = torch.linspace(-3, 3, 7, dtype=torch.float64)
    torch.testing.assert_close(user.gelu(x), torch.nn.functional.gelu(x))  # the exact form runs
    with pytest.raises(pytest.skip.Exception, match=r"^implementation 'mine.py': gelu\(x\) takes no approximate argument$"):
        user.gelu(x, approximate="tanh")


def test_a_cs336_model_skips_the_family_properties_naming_why(user):
    with pytest.raises(pytest.skip.Exception, match=r"transformer_lm builds no GPT-2 family model \(no layers.0.attn.q_proj.bias\)"):
        props_wiring._skip_unless_family(user)
    with pytest.raises(pytest.skip.Exception, match=r"transformer_block builds no LayerNorm for norm_kind='layer'"):
        props_model._layer_norm_block(user, "pre", 0)


def test_tinylm_is_never_skipped():
    impl = props_impl.load()
    props_wiring._skip_unless_family(impl)  # returns: tinylm builds the family
    block, x = props_model._layer_norm_block(impl, "pre", 0)
    assert isinstance(block.ln1, tinylm.LayerNorm) and block.ln1.bias is not None
