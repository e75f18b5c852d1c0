"""``diff`` moves what it measured to the host in one transfer per model, not two per site: on a
GPU each host read is a sync, so the count must not grow with the model. Counted exactly with
:class:`diagnostics.measure.opcount.OpCount` (``.item()``, ``.tolist()``, ``.cpu()`` and kin, CPU
tensors standing in for a device's); the negative control moves each site's figures on its own,
as a per-site loop would, and its count grows with the layers."""

from __future__ import annotations

import copy
import importlib

import numpy as np
import torch

import tinylm
from diagnostics import DiffOptions, diff
from diagnostics.measure.opcount import OpCount

fingerprint = importlib.import_module("diagnostics.jobs.fingerprint")  # the module (the package exports its function)


def _reads(layers: int) -> int:
    config = tinylm.preset("tiny", num_layers=layers, d_model=32, num_heads=2, context_length=16, vocab_size=64)
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    twin = copy.deepcopy(model)
    opts = DiffOptions(batch_size=2, seq_len=8)
    diff(model, twin, options=opts)  # anything built once, outside the count
    with OpCount() as ops:
        diff(model, twin, options=opts)
    return ops.host_reads


def test_diff_host_reads_do_not_grow_with_the_model():
    one, three = _reads(1), _reads(3)
    assert one == three and one <= 12


def test_per_site_transfers_are_caught(monkeypatch):
    def per_site(vectors, sketches):
        return [v.cpu().tolist() for v in vectors], [np.asarray(s.cpu()) for s in sketches]
    monkeypatch.setattr(fingerprint, "_to_host", per_site)
    assert _reads(3) - _reads(1) >= 2 * 2 * 2  # two more layers: several sites each, two reads per site


def test_one_transfer_gives_each_sites_figures():
    g = torch.Generator().manual_seed(1)
    vectors = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(3)]
    sketches = [torch.randn(4, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    got_v, got_s = fingerprint._to_host(vectors, sketches)
    assert got_v == [v.tolist() for v in vectors]
    assert all(np.array_equal(a, s.numpy()) and a.shape == (4, 4) for a, s in zip(got_s, sketches))
    assert fingerprint._to_host([], []) == ([], [])
