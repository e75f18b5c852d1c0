"""The watch and diagnose on a torch.compile'd model.

A recorded step runs the model eagerly (the probe holds ``torch.compiler.set_stance("force_eager")``)
with the same parameters, so it measures what the eager model gives; a step the watch does not
record runs the compiled graphs, built once and never again. A custom backend counts the graphs
built (it runs each one's FX graph as traced, which keeps the test fast on a CPU).
"""

import logging
import math
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tinylm
from diagnostics import DiagnoseOptions, History, Watch, diagnose

CFG = tinylm.ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)


class Counting:
    """A torch.compile backend that counts the graphs it is asked to build."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _model():
    return tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (4, 9), generator=g) for _ in range(n)]


def _train(call, params, watch, steps):
    """Steps 1..steps of a loop (the first watched step is not step 0) through ``call``."""
    opt = torch.optim.SGD(params, lr=0.05)
    for t, x in zip(range(1, steps + 1), _batches(steps)):
        with watch.step(t):
            loss = F.cross_entropy(call(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        watch.record(loss, lr=0.05)
    return watch.history


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _close(a, b, rel=1e-5):
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


def _assert_same_records(got, want):
    assert [r["step"] for r in got["records"]] == [r["step"] for r in want["records"]]
    for rg, rw in zip(got["records"], want["records"]):
        assert rg["stats"].keys() == rw["stats"].keys()
        for site, st in rw["stats"].items():
            assert st["count"] > 0, site
            for key, value in st.items():
                assert _close(rg["stats"][site][key], value), (rg["step"], site, key, rg["stats"][site][key], value)
        for name, value in rw["update_ratio"].items():
            assert _close(rg["update_ratio"][name], value, 1e-4), (name, rg["update_ratio"][name], value)


@pytest.mark.parametrize("when", ["before", "after"])
def test_compiled_model_is_measured_like_eager_with_one_graph(when, caplog):
    """Compiled before the watch (the watch given the compiled module) or after it (the watch
    given the eager one): every site counted, the eager loop's numbers within float32 rounding,
    the unrecorded steps running the graphs the same compiled loop without a watch builds, none
    built again, no graph break or warning of the watch's."""
    eager = _model()
    want = _train(eager, eager.parameters(), Watch(eager, every=2), 6)  # the eager loop's records
    plain = Counting()  # the graphs of the same compiled loop without a watch
    base = _model()
    _train(torch.compile(base, backend=plain), base.parameters(), Watch(base, every=0), 6)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    breaks = sum(counters["graph_break"].values())
    counters.clear()

    backend = Counting()
    model = _model()
    if when == "before":
        compiled = torch.compile(model, backend=backend)
        watch = Watch(compiled, every=2)
    else:
        watch = Watch(model, every=2)
        compiled = torch.compile(model, backend=backend)
    with caplog.at_level(logging.WARNING, logger="torch"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(compiled, model.parameters(), watch, 6)
    assert watch.sites == Watch(_model()).sites  # the module's own names, no "_orig_mod." prefix
    _assert_same_records(got, want)
    assert History(got).first_departure() is None
    # steps 1, 3, 5 ran the graphs built at step 1; 2, 4, 6 ran eagerly: nothing built again
    assert backend.graphs == plain.graphs
    assert not counters["recompiles"]
    assert sum(counters["graph_break"].values()) == breaks  # the model's own (tinylm's RoPE bound check), none added
    said = [r.getMessage() for r in caplog.records] + [str(w.message) for w in caught]
    assert not [m for m in said if "bug" in m.lower() or "probe.py" in m or "perf_counter" in m]


def test_diagnose_of_a_compiled_model_is_the_eager_diagnosis():
    """diagnose(compiled) measures ``_orig_mod`` eagerly: nothing is compiled, the same rows."""
    backend = Counting()
    opts = DiagnoseOptions(batch_size=2, batches=2, seq_len=8)
    want = diagnose(_model(), options=opts)
    t0 = time.perf_counter()
    got = diagnose(torch.compile(_model(), backend=backend), options=opts)
    assert time.perf_counter() - t0 < 60
    assert backend.graphs == 0
    assert [(r.name, r.direction) for r in got.tensors] == [(r.name, r.direction) for r in want.tensors]
    for a, b in zip(got.tensors, want.tensors):
        assert _close(a.var, b.var), (a.name, a.var, b.var)
    assert got.status == want.status


class _Skipped(nn.Module):
    """A model one of whose modules never runs."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_a_site_that_counts_nothing_is_not_measured_never_ok():
    """count 0 is "not_measured" in the verdicts, the first departure and the tidy rows; not a fail."""
    model = _Skipped()
    watch = Watch(model, every=1, sites=["used", "unused"])
    for t in range(2):
        with watch.step(t):
            loss = model(torch.randn(3, 4)).square().mean()
            loss.backward()
        assert watch.record(loss).failure is None
    h = History(watch.history)
    assert watch.history["records"][0]["stats"]["unused"]["count"] == 0
    dep = h.first_departure()
    assert dep["site"] == "unused" and dep["verdict"] == "not_measured"
    assert {r["site"] for r in h.verdicts()} == {"unused"}
    verdicts = {r.verdict for r in h.to_rows() if r.name == "unused"}
    assert verdicts == {"not_measured"}
    assert {r.verdict for r in h.to_rows() if r.name == "used" and r.verdict is not None} == {"ok"}
    assert watch.failure is None
