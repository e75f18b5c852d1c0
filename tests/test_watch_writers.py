"""The writers protocol as docs/watch.md teaches it: the example of "Write your own writer",
run as it stands in the page, in a loop whose head explodes (its record's verdict printed)
and whose loss turns NaN (the alarm printed), with a clean stretch before as the negative
control; a writer of one's own without subclassing, and an object that is not a writer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tinylm
from diagnostics import OptionsError, Watch
from tinylm import functional as F

SMALL = dict(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
DOC = Path(__file__).resolve().parents[1] / "docs" / "watch.md"


def doc_example() -> str:
    """The first python block of the "Write your own writer" section of docs/watch.md."""
    section = DOC.read_text(encoding="utf-8").split("### Write your own writer", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def small_model() -> tinylm.TransformerLM:
    return tinylm.TransformerLM(tinylm.ModelConfig(**SMALL), generator=torch.Generator().manual_seed(0))


def train(watch: Watch, model, steps: int, blow_up_at: int, nan_at: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        x = torch.randint(0, 32, (2, 9), generator=g)
        if t == blow_up_at:
            with torch.no_grad():
                model.lm_head.weight.mul_(100.0)
        with watch.step(t):
            loss = F.cross_entropy(model(x[:, :-1]), x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        watch.record(float("nan") if t == nan_at else loss)


def test_the_documented_writer_runs_as_written(capsys):
    model = small_model()
    scope = {"model": model}
    exec(compile(doc_example(), str(DOC), "exec"), scope)  # noqa: S102 - the page's own example
    watch = scope["watch"]
    assert [type(w).__name__ for w in watch.writers] == ["PrintProblems"] and watch.every == 10
    train(watch, model, steps=22, blow_up_at=10, nan_at=21)  # records at 0, 10, 20
    watch.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 10: lm_head exploding (fwd_var = ")  # nothing printed before it
    assert out[-1] == watch.history["events"][-1]["message"] and "not finite" in out[-1]


def test_a_writer_of_ones_own_needs_no_subclass_and_a_non_writer_is_refused():
    class Steps:
        def __init__(self):
            self.seen = []

        def open(self, watch):
            pass

        def step(self, t, loss, lr, grad_norm):
            self.seen.append(t)

        def record(self, record, verdicts):
            pass

        def event(self, event):
            pass

        def close(self):
            self.seen.append("closed")

    model, mine = small_model(), Steps()
    with Watch(model, every=2, writers=[mine]) as watch:
        train(watch, model, steps=3, blow_up_at=99, nan_at=99)
    assert mine.seen == [0, 1, 2, "closed"]
    with pytest.raises(OptionsError, match="is not a diagnostics WatchWriter"):
        Watch(model, writers=[object()])
