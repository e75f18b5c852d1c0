"""coord_check: muP passes, SP and each classic mistake fail at the right kind of site, on tinylm,
on a plain-PyTorch GPT (SDPA and eager attention) and on a model built with the mup package.

The verdicts are deterministic given the seeds (CPU, one thread of arithmetic per op); each
case is a negative control of the others: the same check that passes muP must name the mistake."""

from __future__ import annotations

import json

import pytest
import torch

from diagnostics import CoordCheckOptions, CoordCheckResult, OptionsError, coord_check
from coordhelp import MISTAKES, mup_package_case, plain_case, tinylm_case

WIDTHS = (32, 64, 128)
OPTIONS = CoordCheckOptions(steps=4, seeds=2)
#: the kind of site (and quantity) each mistake must be named at, with its cause's words
EXPECTED = {
    "attention": ("attn_logits", "init", "1/sqrt(d_head)"),
    "hidden_lr": ("ffn_branch", "delta", "hidden learning rate"),
    "readout": ("logits", "delta", "readout multiplier"),
    "embedding_lr": ("embedding", "delta", "embedding learning rate"),
    "init_std": ("ffn_branch", "init", "init std fixed"),
}


def _check(case) -> CoordCheckResult:
    make_model, make_optimizer = case
    return coord_check(make_model, WIDTHS, make_optimizer=make_optimizer, options=OPTIONS)


def _assert_named(result: CoordCheckResult, mistake: str) -> None:
    kind, quantity, words = EXPECTED[mistake]
    assert not result.ok
    hits = [f for f in result.findings if f.kind == kind and f.quantity == quantity]
    assert hits, [f.message for f in result.findings]
    assert all(words in f.cause for f in hits), [f.cause for f in hits]
    assert words in str(result).splitlines()[0]  # the answer first


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tinylm_mup_passes_with_no_finding():
    result = _check(tinylm_case("mup", layers=1))
    assert result.ok and not result.findings, str(result)
    assert str(result).startswith("coord check: ok")
    frame = result.to_frame()
    assert list(frame.columns) == ["width", "seed", "step", "site", "kind", "quantity", "value"]
    assert set(frame.quantity) == {"init", "delta", "update"} and set(frame.width) == set(WIDTHS)
    assert {"embedding", "attn_logits", "attn_branch", "ffn_branch", "residual", "logits"} <= set(frame.kind)
    assert json.loads(result.to_json())["schema_version"] == "1"


def test_tinylm_sp_fails_at_hidden_attention_and_readout():
    result = _check(tinylm_case("sp", layers=1))
    kinds = {(f.kind, f.quantity) for f in result.findings}
    assert {("attn_logits", "init"), ("logits", "init"), ("ffn_branch", "delta"), ("residual", "delta")} <= kinds
    assert not any(f.kind == "embedding" for f in result.findings)


@pytest.mark.parametrize("mistake", MISTAKES)
def test_tinylm_mistake_named_at_its_site(mistake):
    _assert_named(_check(tinylm_case(mistake, layers=1)), mistake)


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ["attention", "readout", "embedding_lr"])
def test_local_mistakes_leave_other_sites_alone(mistake):
    """A mistake local to one site departs there only (the check does not blame everything)."""
    kind = EXPECTED[mistake][0]
    result = _check(tinylm_case(mistake, layers=1))
    assert {f.kind for f in result.findings} == {kind}


@pytest.mark.parametrize("eager", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sdpa", "eager"])
def test_plain_gpt_mup_passes_and_attention_mistake_is_named(eager):
    assert _check(plain_case("mup", eager=eager)).ok
    _assert_named(_check(plain_case("attention", eager=eager)), "attention")


@pytest.mark.slow
@pytest.mark.parametrize("mistake", MISTAKES)
def test_plain_gpt_mistake_named(mistake):
    _assert_named(_check(plain_case(mistake)), mistake)


@pytest.mark.slow
def test_plain_gpt_sp_fails():
    result = _check(plain_case("sp"))
    assert {"attn_logits", "logits", "ffn_branch"} <= {f.kind for f in result.findings}


def test_mup_package_model_passes_and_fails_in_sp():
    pytest.importorskip("mup")
    assert _check(mup_package_case("mup")).ok
    sp = _check(mup_package_case("sp"))
    assert {"attn_logits", "logits", "ffn_branch"} <= {f.kind for f in sp.findings}


@pytest.mark.parametrize("bad, words", [
    (dict(steps=0), "steps=0: must"), (dict(seeds=0), "seeds=0: must"), (dict(lr=-1.0), "lr=-1.0: must"),
    (dict(batch_size=0), "batch_size=0: must"), (dict(seq_len=0), "seq_len=0: must"),
])
def test_options_validated(bad, words):
    with pytest.raises(OptionsError, match=words.replace("(", r"\(")):
        CoordCheckOptions(**bad)


def test_widths_and_factory_validated():
    make_model, _ = tinylm_case("mup", layers=1)
    with pytest.raises(OptionsError, match="widths"):
        coord_check(make_model, (64,))
    with pytest.raises(OptionsError, match="make_model"):
        coord_check(42, (32, 64))
    with pytest.raises(OptionsError, match="make_model"):
        coord_check(lambda w: "not a module", (32, 64), options=CoordCheckOptions(steps=1, seeds=1))


def test_hooks_removed_when_the_model_raises():
    from diagnostics.measure.coord import CoordRecorder

    model = tinylm_case("mup", layers=1)[0](32)
    rec = CoordRecorder(model)
    with pytest.raises(RuntimeError):
        with rec.capture():
            raise RuntimeError("boom")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_too_few_points_is_not_judged_never_ok():
    """Two widths and one seed give a slope without an interval: "not judged", not "ok"."""
    make_model, make_optimizer = tinylm_case("sp", layers=1)
    result = coord_check(make_model, (32, 64), make_optimizer=make_optimizer,
                         options=CoordCheckOptions(steps=1, seeds=1))
    assert not result.ok and not result.findings
    assert str(result).startswith("coord check: not judged")


def test_gpt2_family_in_mup_passes_and_its_fixed_std_sp_is_named():
    """GPT-2's architecture (tied embeddings, learned positions, LayerNorm, GELU): muP passes; SP
    with GPT-2's fixed 0.02 init is named for its fixed init std."""
    import tinylm

    def case(parametrization):
        def make_model(width):
            return tinylm.TransformerLM(tinylm.preset(
                "gpt2-tiny", vocab_size=128, context_length=32, d_model=width, d_ff=4 * width, num_layers=1,
                parametrization=parametrization, mup_base_width=32 if parametrization == "mup" else None))

        def make_optimizer(model, width):
            return torch.optim.Adam(tinylm.mup.param_groups(model, 1e-2))
        return make_model, make_optimizer

    assert _check(case("mup")).ok
    sp = _check(case("sp"))
    assert any(f.kind == "ffn_branch" and f.quantity == "init" and "init std fixed" in f.cause for f in sp.findings)


def test_token_stream_batches_and_bad_ids():
    """A 1-D stream trains on several batches (the first measured by a forward of its own); ids outside
    the embedding are refused with one message."""
    import numpy as np

    make_model, make_optimizer = tinylm_case("mup", layers=1)
    stream = np.random.default_rng(0).integers(0, 128, 4 * 33 * 3).astype(np.uint16)
    result = coord_check(make_model, WIDTHS, make_optimizer=make_optimizer, tokens=stream, options=OPTIONS)
    assert result.ok, str(result)
    with pytest.raises(OptionsError, match=r"tokens='ids in \[0, 300\]': must lie in \[0, 128\)"):
        coord_check(make_model, WIDTHS, tokens=torch.tensor([[0, 300, 1]]), options=CoordCheckOptions(seq_len=2))
