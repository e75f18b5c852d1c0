"""diagnostics.measure.outputs: the one rule by which the probe reads a module's output and diagnose a model's."""

import importlib
from types import SimpleNamespace

import torch

from diagnostics.measure.outputs import first_tensor, read_output

LOGITS, LOSS = torch.zeros(2, 3, 5), torch.tensor(1.5)


def test_first_tensor():
    assert first_tensor(LOGITS) is LOGITS
    assert first_tensor(("cache", LOGITS, LOSS)) is LOGITS and first_tensor([None, LOSS]) is LOSS
    assert first_tensor(("no", "tensor")) is None and first_tensor({"logits": LOGITS}) is None


def test_read_output():
    assert read_output(LOGITS) == (LOGITS, None)
    assert read_output(LOSS) == (None, LOSS)  # a 0-d tensor is a loss
    assert read_output((LOGITS, "past")) == (LOGITS, None) and read_output((LOSS, LOGITS)) == (None, LOSS)
    assert read_output(("past",)) == (None, None)
    assert read_output({"logits": LOGITS, "loss": LOSS}) == (LOGITS, LOSS)
    assert read_output(SimpleNamespace(loss=LOSS)) == (None, LOSS)
    assert read_output(SimpleNamespace(logits="not a tensor")) == (None, None)


def test_the_probe_reads_a_module_by_the_same_rule():
    probe_module = importlib.import_module("diagnostics.measure.probe")  # the module (the package re-exports probe)
    assert probe_module._first_tensor is first_tensor
