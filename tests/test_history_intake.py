"""A training history read from a checkpoint is validated before use: a damaged one is skipped, never fatal."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinylm
from diagnostics.jobs import history as H
from diagnostics.jobs import watch as W
from diagnostics.judge import over_time as V
from reports.cli import main
from tinylm import checkpoint
from tinylm.train import TrainOptions

SMALL = tinylm.ModelConfig(vocab_size=60, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
FAST = ["--batch-size", "1", "--batches", "1", "--seq-len", "4", "--no-progress", "--width", "100"]


@pytest.fixture(scope="module")
def real_history():
    model = tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))
    tokens = np.arange(400) % 60
    return W.train_watched(model, tokens, TrainOptions(steps=4, batch_size=2, watch_every=2)).history


def test_a_real_history_passes_and_reads(real_history):
    h, why = H.check_history(real_history)
    assert why is None and h is real_history and H.to_rows(h)


DAMAGE = [
    ("records", [1, 2], "records[0] is not a record"),
    ("series", {"loss": "x"}, "'series' lacks"),
    ("sites", "layers.0", "'sites' is not a list"),
    ("version", 7, "version is 7"),
    ("format", "other", "format is 'other'"),
]


@pytest.mark.parametrize("key, value, why", DAMAGE)
def test_a_damaged_history_is_named_and_skipped(real_history, key, value, why):
    h = copy.deepcopy(real_history)
    h[key] = value
    assert H.check_history(h)[0] is None and why in H.check_history(h)[1]


def test_a_damaged_record_deep_inside_is_found(real_history):
    h = copy.deepcopy(real_history)
    site = next(iter(h["records"][0]["stats"]))
    h["records"][0]["stats"][site]["fwd_var"] = "big"
    assert H.check_history(h) == (None, "records[0].stats is not {site: {count, fwd_mean, ...: number}}")


json_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5)),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=20)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_whatever_passes_the_check_reads_without_error(real_history, data):
    h = copy.deepcopy(real_history)
    # damage one place of a real history, or replace it whole
    path = data.draw(st.sampled_from([None, "series", "records", "events", "kinds", "thresholds", "stats", "attention"]))
    value = data.draw(json_value)
    if path is None:
        h = value
    elif path in ("stats", "attention"):
        if h["records"]:
            h["records"][0][path] = value
    else:
        h[path] = value
    accepted, why = H.check_history(h)
    assert (accepted is None) == (why is not None or h is None)
    if accepted is not None:
        H.to_rows(accepted)
        V.verdicts(accepted)
        V.first_departure(accepted)


def test_diagnose_reports_a_damaged_history_and_goes_on(tmp_path, capsys):
    model = tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "m.pt"
    checkpoint.save(path, model, history={"format": H.FORMAT, "version": 1, "records": [1, 2]})
    code = main(["diagnose", str(path), *FAST])
    err = capsys.readouterr().err
    assert code == 0 and "training history is skipped" in err


def test_resume_from_a_damaged_history_starts_a_new_one(tmp_path):
    model = tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))
    watch = W.Watch(model, every=1, history={"format": H.FORMAT, "version": 1, "series": "x"})
    assert watch.history_problem and watch.history["records"] == []


def test_train_resume_says_a_damaged_history_is_skipped(tmp_path, capsys):
    model = tinylm.TransformerLM(tinylm.preset("tiny"), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "run.pt"
    checkpoint.save(path, model, iteration=1, history={"format": H.FORMAT, "version": 1, "records": "x"})
    data = tmp_path / "d.npy"
    np.save(data, np.arange(400, dtype=np.int64) % 256)
    code = main(["train", "--resume", str(path), "--data", str(data), "-o", str(path), "--steps", "2", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "training history is skipped" in out
