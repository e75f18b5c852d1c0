"""compare() measures each seed of a grid cell on one model initialised afresh: exactly the values a
model built new from that seed gives, even when the previous seed's model was trained."""

import pytest
import torch

import tinylm
from diagnostics import CompareOptions, ProbeOptions, compare, probe
from diagnostics.jobs.compare import _config


def fresh_measurement(config, seed, batch_size, seq_len, steps_before=0):
    """{(tensor, direction): var} of a model built new from ``seed`` (after ``steps_before`` SGD steps
    on its own batch: the negative control's wrong claim), measured as compare measures it."""
    gen = torch.Generator().manual_seed(seed)
    model = tinylm.TransformerLM(config, generator=gen)
    batch = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    x, y = batch[:, :-1], batch[:, 1:]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps_before):
        opt.zero_grad(set_to_none=True)
        tinylm.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    stream = list(tinylm.plan.build(config).block_outputs())
    with probe(model, ProbeOptions(modules=tuple(stream + ["lm_head"]), attention=False, params=False)) as run:
        tinylm.functional.cross_entropy(model(x), y).backward()
    return {k: m.var for k, m in run.stats.tensors.items()}


@pytest.mark.parametrize("scheme", ["cs336", "small-init"])
def test_every_seed_measures_what_a_new_model_from_it_measures(scheme):
    tidy, _ = compare(CompareOptions(schemes=[scheme], depths=(2,), widths=(32,), seeds=3, steps=3, seq_len=8, seed=5))
    config = _config(256, 8, 32, 2, "pre", scheme)
    var = tidy[tidy.statistic == "var"]
    for seed in (5, 6, 7):
        want = fresh_measurement(config, seed, 2, 8)
        got = {(r.name, r.direction): r.value for r in var[var.seed == seed].itertuples()}
        assert got == want  # bit for bit: the same draws in the same order
        # negative control: a model that kept the previous seed's training measures otherwise
        trained = fresh_measurement(config, seed, 2, 8, steps_before=3)
        assert any(abs(trained[k] - v) > 1e-6 * abs(v) for k, v in got.items())


def test_compare_runs_on_one_thread_and_gives_the_callers_threads_back(monkeypatch):
    """The grid's models run on one torch thread; the caller's count is back afterwards, also after an
    error inside the grid. Negative control: outside compare the count is the caller's 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        compare(CompareOptions(schemes=["cs336"], depths=(1,), widths=(32,), seeds=1, seq_len=4,
                               progress=lambda d, t, s: seen.append(torch.get_num_threads())))
        assert seen == [1] and torch.get_num_threads() == 2

        def boom(*args, **kwargs):
            raise RuntimeError("inside the grid")

        monkeypatch.setattr(tinylm.functional, "cross_entropy", boom)
        with pytest.raises(RuntimeError, match="inside the grid"):
            compare(CompareOptions(schemes=["cs336"], depths=(1,), widths=(32,), seeds=1, seq_len=4))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
