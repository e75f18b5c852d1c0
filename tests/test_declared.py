"""What a model declares of its init, one fresh-or-trained decision per report, and what the report
says where it cannot know: the README's own flow, Hugging Face models, plain trained modules."""

from __future__ import annotations

import importlib
import json
import math
import re
import tomllib
from pathlib import Path

import pytest
import torch

import tinylm
from benchmarks.verdict_zoo import GeluLM, NanoGPT, train_nanogpt
from diagnostics import DepthRow, DiagnoseOptions, Thresholds, diagnose, display
from diagnostics.jobs.diagnose import _architecture, _scale_invariant
from diagnostics.jobs.diagnose_init import FRESH_SIGMAS, declaration
from diagnostics.judge import judge
from diagnostics.measure.sites import model_sites
from diagnostics.result import LOSS
from diagnostics.theory import Prediction
from diagnostics.theory import _no_impossible_variance
from reports.cli import main
from tinylm import checkpoint

ROOT = Path(__file__).resolve().parents[1]
SCORES = "attention score scaling"
OPTS = DiagnoseOptions(batch_size=2, seq_len=16, batches=2)


def small(**changes) -> tinylm.TransformerLM:
    config = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=64, num_layers=2, num_heads=4,
                                d_ff=tinylm.default_d_ff(64), **changes)
    return tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def readme_model(tmp_path_factory) -> Path:
    """`tinylm train --preset tiny` (the README's flow), with fewer, smaller steps."""
    path = tmp_path_factory.mktemp("readme") / "m.pt"
    assert main(["train", "--preset", "tiny", "-o", str(path), "--steps", "20", "--batch-size", "8", "--quiet",
                 "--threads", "1"]) == 0
    return path


def test_the_readme_flow_passes_check_warn(readme_model, capsys):
    """train --preset tiny, then diagnose --check=warn: exit 0 (the trained model's score ratio is not
    judged as if it were fresh)."""
    code = main(["diagnose", str(readme_model), "--check=warn", "--batch-size", "2", "--batches", "2",
                 "--no-progress", "--width", "100"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "declared: cs336 (model config); trained" in out


def test_one_fresh_decision_serves_every_check(readme_model):
    model, _ = checkpoint.load(readme_model)
    r = diagnose(model, options=OPTS)
    assert r.header.fresh is False and r.header.theory == "local" and r.header.fresh_rule
    not_judged = dict(r.not_judged)
    assert "trained" in not_judged[SCORES] and LOSS in r.judged  # the loss: warn-level on random tokens
    # the same weights' draw is fresh: every check then treats it so
    fresh = diagnose(small(), options=OPTS)
    assert fresh.header.fresh is True and fresh.header.theory == "global"
    assert SCORES in fresh.judged and LOSS in fresh.judged


def test_the_head_and_embedding_count_and_the_band_is_a_fresh_draws_spread():
    """Fresh iff every weight matrix and embedding is within FRESH_SIGMAS/sqrt(2n) of its declared std."""
    def fresh_after(name: str, sigmas: float) -> bool:
        m = small()
        p = dict(m.named_parameters())[name]
        with torch.no_grad():
            p.mul_(1 + sigmas / math.sqrt(2 * p.numel()))
        return diagnose(m, options=OPTS).header.fresh

    assert fresh_after("lm_head.weight", 1.0) is True
    assert fresh_after("lm_head.weight", FRESH_SIGMAS + 1) is False  # the head alone moved: trained
    assert fresh_after("token_embeddings.weight", FRESH_SIGMAS + 1) is False
    assert fresh_after("layers.1.ffn.w1.weight", FRESH_SIGMAS + 1) is False


def test_no_prediction_is_a_negative_variance(readme_model):
    impossible = Prediction(mean_square=1.0, mean=2.0, valid=True, validity="", rule="r")
    fixed = _no_impossible_variance({("x", "forward"): impossible})[("x", "forward")]
    assert not fixed.valid and "negative variance" in fixed.validity
    model, _ = checkpoint.load(readme_model)
    r = diagnose(model, options=OPTS)
    assert all(t.predicted is None or t.predicted >= 0 for t in r.tensors)
    doc = json.loads(r.to_json())
    assert all(t.get("predicted") is None or t["predicted"] >= 0 for t in doc["theory"])


def _llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64))
    m.save_pretrained(tmp_path / "llama")
    return m, tmp_path / "llama"


def test_a_hugging_face_llama_is_judged_against_its_initializer_range(tmp_path):
    from tinylm import hf

    hf_model, path = _llama(tmp_path)
    mapped, _ = hf.load(path)
    r = diagnose(mapped, options=OPTS)
    assert r.header.declared == "initializer_range 0.02 (config.json)" and r.header.fresh is True
    assert r.findings == [] and LOSS in r.judged
    # negative control: judged against the config's placeholder scheme, the same weights were misscaled
    del mapped.declared_init
    wrong = diagnose(mapped, options=OPTS)
    assert wrong.header.declared.startswith("cs336") and {f.cause for f in wrong.findings} == {"init_scale"}
    # read through transformers: its config's initializer_range, theory "off", cosine not measured
    direct = diagnose(hf_model, options=OPTS)
    assert direct.header.declared.startswith("initializer_range 0.02") and direct.header.fresh is True
    assert direct.header.theory == "off" and all(d.cosine is None for d in direct.depth)
    assert not direct.findings


def test_gpt2_c_proj_is_declared_scaled():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    g = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=500, n_positions=32, n_embd=64, n_layer=4,
                                                             n_head=4))
    d = declaration(g).dists
    assert d["transformer.h.0.mlp.c_proj.weight"].std == pytest.approx(0.02 / math.sqrt(8))
    assert d["transformer.h.0.mlp.c_fc.weight"].std == pytest.approx(0.02)
    r = diagnose(g, options=OPTS)
    drifts = [p.drift for p in r.params if p.drift is not None]
    assert drifts and all(0.9 < x < 1.1 for x in drifts)


def test_a_module_without_a_declaration_says_so():
    r = diagnose(GeluLM(L=2), options=OPTS)
    assert r.header.declared.startswith("none") and r.header.fresh is None and r.header.theory == "off"
    from reports.plots import figure_title

    title = figure_title(r)
    assert "?" not in title and "not tinylm" in title and "no declared init" in title


def test_print_result_is_the_report_and_repr_is_short(capsys):
    r = diagnose(small(), options=OPTS)
    assert len(repr(r)) <= 300 and "healthy" in repr(r)
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["tinylm.renderers"]
    module, _, name = entry["text"].partition(":")
    try:
        display.use(text=getattr(importlib.import_module(module), name))
        print(r)
        out = capsys.readouterr().out
        assert "verdict: healthy" in out and "Per layer" in out and "Attention and rank collapse" in out
        assert not re.search(r"\x1b\[", out)  # plain text
    finally:
        display.use(None)
    display.use(None, text=lambda obj: None)
    try:
        assert str(r).startswith("TransformerLM: healthy")  # no renderer: a short summary
    finally:
        display.use(None)


def test_the_text_renderer_is_found_through_the_entry_point(monkeypatch, capsys):
    from importlib import metadata

    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][display.GROUP]
    points = metadata.EntryPoints([metadata.EntryPoint(name=k, value=v, group=display.GROUP) for k, v in table.items()])
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points",
                        lambda **kw: points if kw.get("group") == display.GROUP else real(**kw))
    display.use(None)
    try:
        print(diagnose(small(), options=OPTS))
        out = capsys.readouterr().out
        assert "verdict: healthy" in out and "Per layer" in out
    finally:
        monkeypatch.undo()
        display.use(None)


def test_a_shallow_stack_is_not_exploding_by_two_gains():
    """Two blocks each multiplying the stream by 10 is not a run of exploding_run (3); four are."""
    def rows(n, gain):
        return [DepthRow(index=k, name=f"b{k}", forward_var=gain ** k, forward_predicted=None, backward_var=1.0,
                         backward_predicted=None, cosine=None) for k in range(n + 1)]

    assert not judge([], [], [], rows(2, 10.0), [], Thresholds())[0]
    assert [f.kind for f in judge([], [], [], rows(4, 10.0), [], Thresholds())[0]] == ["exploding"]


def test_a_plain_pre_norm_model_is_judged_scale_invariant():
    nano, gelu = NanoGPT(L=2), GeluLM(L=2)
    assert _scale_invariant(nano, _architecture(nano, model_sites(nano).blocks))
    assert not _scale_invariant(gelu, _architecture(gelu, model_sites(gelu).blocks))


def test_a_plain_gpt_trained_hard_is_healthy():
    """The reduced healthy control: a 2-block nanoGPT-style module after a few steps at lr 1e-2."""
    model, loss = train_nanogpt(2, steps=30, lr=1e-2, warmup=5, batch=8, T=32)
    assert loss < math.log(256)
    r = diagnose(model, options=DiagnoseOptions(batch_size=2, seq_len=32, batches=2))
    assert r.healthy and not r.findings, [f.message for f in r.findings]
