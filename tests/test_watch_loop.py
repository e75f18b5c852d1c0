"""The watch in a hand-written loop: records at its interval with the update ratio of the
optimizer step, the fail signal and WatchStop (with negative controls), the sites it finds in
a module that is not tinylm, and what it writes beside the run: CSV and JSONL equal to the
history, and a TensorBoard event file read back with TensorBoard's own reader."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from torch import nn

import tinylm
from diagnostics import OptionsError, Watch
from diagnostics.jobs import history as H
from diagnostics.jobs import watch as W
from diagnostics.judge import over_time as V
from tinylm import functional as F

SMALL = dict(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)


def small_model(seed: int = 0) -> tinylm.TransformerLM:
    return tinylm.TransformerLM(tinylm.ModelConfig(**SMALL), generator=torch.Generator().manual_seed(seed))


def no_hooks(model) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())


def run_loop(watch: Watch, model, steps: int, blow_up_at: int | None = None, lr: float = 1e-2):
    """A user's loop: the watch's step context around forward, backward and optimizer step.
    At ``blow_up_at`` the head's weights are multiplied by 100 (the logits' variance by 10^4)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    returned, before = [], {}
    for t in range(steps):
        x = torch.randint(0, 32, (2, 9), generator=g)
        if t == blow_up_at:
            with torch.no_grad():
                model.lm_head.weight.mul_(100.0)
        before[t] = {n: p.detach().clone() for n, p in model.named_parameters()}
        with watch.step(t):
            loss = F.cross_entropy(model(x[:, :-1]), x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        returned.append(watch.record(loss, lr=lr, grad_norm=1.0).failure)
    return returned, before


def test_own_loop_records_at_the_interval_with_update_ratios():
    model = small_model()
    watch = Watch(model, every=2)
    returned, before = run_loop(watch, model, 5)
    h = watch.history
    assert [r["step"] for r in h["records"]] == [0, 2, 4]
    assert h["series"]["step"] == [0, 1, 2, 3, 4] and all(math.isfinite(v) for v in h["series"]["loss"])
    assert returned == [None] * 5 and watch.failure is None
    # the update ratio of step 2 is that optimizer step's ||W_after - W_before|| / ||W_before||
    after = before[3]
    for name in ("lm_head.weight", "layers.0.attn.q_proj.weight"):
        want = torch.linalg.vector_norm((after[name] - before[2][name]).double()) / torch.linalg.vector_norm(
            before[2][name].double())
        assert h["records"][1]["update_ratio"][name] == pytest.approx(want.item(), rel=1e-9)
        assert want.item() > 0
    assert no_hooks(model)


def test_a_step_left_without_record_keeps_a_nan_loss_and_bad_calls_are_refused():
    model = small_model()
    watch = Watch(model, every=1)
    x = torch.zeros(1, 8, dtype=torch.long)
    with watch.step(0):
        model(x).sum().backward()
    with watch.step(1):  # step 0 is committed here, without a loss
        model(x).sum().backward()
    watch.close()
    assert watch.history["series"]["step"] == [0, 1] and all(math.isnan(v) for v in watch.history["series"]["loss"])
    assert [r["step"] for r in watch.history["records"]] == [0, 1]
    with pytest.raises(OptionsError, match="without a step"):
        watch.record(1.0)
    with pytest.raises(OptionsError, match="every"):
        Watch(model, every=-1)
    with pytest.raises(OptionsError, match="stop"):
        Watch(model, stop="yes")
    with pytest.raises(OptionsError, match="writers"):
        Watch(model, writers=[print])


def test_a_log_dir_that_is_a_file_is_refused_in_one_line(tmp_path):
    f = tmp_path / "run"
    f.write_text("mine")
    with pytest.raises(OptionsError, match="log_dir=.*is a file"):
        Watch(small_model(), log_dir=f)
    assert f.read_text() == "mine"  # left as it was


def test_incremental_verdicts_equal_the_verdicts_of_the_whole_history(tmp_path):
    model = small_model()
    watch = Watch(model, every=1, log_dir=tmp_path)
    returned, _ = run_loop(watch, model, 6, blow_up_at=4)
    watch.close()
    lines = [json.loads(x) for x in (tmp_path / "watch.jsonl").read_text().splitlines()]
    streamed = [v for x in lines if x["type"] == "record" for v in x["verdicts"]]
    whole = V.verdicts(watch.history)
    assert whole  # the blow-up is judged ...
    assert [(v["step"], v["site"], v["verdict"]) for v in streamed] == [
        (v["step"], v["site"], v["verdict"]) for v in whole]
    assert [v["value"] for v in streamed] == pytest.approx([v["value"] for v in whole], rel=1e-12)


def test_a_fail_is_signalled_from_its_step_on():
    model = small_model()
    watch = Watch(model, every=1)
    returned, _ = run_loop(watch, model, 6, blow_up_at=4)
    fails = [(t, f) for t, f in enumerate(returned) if f is not None]
    assert [t for t, _ in fails] == [4, 5]  # the head stays 10^4 above its lowest earlier variance
    f = fails[0][1]
    assert f.verdict == "exploding" and f.site == "lm_head" and f.stat == "fwd_var" and f.step == 4
    assert f.value > f.threshold and "lm_head" in f.message
    assert watch.failure is f  # the first one
    # the loop hears it once as an alert, with its cause and fix (the fail persists, the alert is not repeated)
    fail_alerts = [a for a in watch.alerts if a.severity == "fail"]
    assert [(a.step, a.signal, a.site) for a in fail_alerts] == [(4, "exploding", "lm_head")]
    assert "fix:" in fail_alerts[0].message and fail_alerts[0].fix


def test_negative_control_no_signal_without_the_blow_up():
    model = small_model()
    watch = Watch(model, every=1)
    returned, _ = run_loop(watch, model, 6)
    assert returned == [None] * 6 and watch.failure is None and V.verdicts(watch.history) == []
    assert watch.alerts == []  # nothing reported: no warning either


def test_stop_raise_raises_watchstop_at_the_fail_and_removes_the_hooks():
    model = small_model()
    watch = Watch(model, every=1, stop="raise")
    with pytest.raises(W.WatchStop) as e:
        run_loop(watch, model, 6, blow_up_at=4)
    assert e.value.failure.step == 4 and e.value.failure.verdict == "exploding"
    assert watch.history["series"]["step"] == [0, 1, 2, 3, 4]  # step 4 was recorded before the stop
    assert no_hooks(model)


def test_a_nonfinite_loss_is_a_fail_even_when_not_recorded():
    model = small_model()
    watch = Watch(model, every=10)
    x = torch.zeros(1, 8, dtype=torch.long)
    for t, loss in enumerate([3.0, 3.0, math.nan]):
        with watch.step(t):
            model(x).sum().backward()
        report = watch.record(loss)
        got = report.failure
        assert (got is None) == (t < 2) and bool(report) == (t == 2)
    assert report.alerts[0].severity == "fail" and report.alerts[0].signal == "non_finite"
    assert got.verdict == "non_finite" and got.site is None and got.step == 2
    assert watch.history["events"][-1]["kind"] == "nonfinite"


class ToyDecoder(nn.Module):
    """A decoder that is not tinylm: its own names, blocks in a ModuleList, a final Linear head."""

    def __init__(self, vocab: int = 32, d: int = 16, depth: int = 3):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(depth))
        self.out = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.wte(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def test_sites_are_found_in_a_module_that_is_not_tinylm():
    model = ToyDecoder()
    assert W.default_sites(model) == ["wte", "blocks.0", "blocks.1", "blocks.2", "out"]
    watch = Watch(model, every=1)
    assert "5 sites: wte, blocks.0, ..., out" in watch.describe()
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with watch.step(0):
        F.cross_entropy(model(x), x).backward()
    watch.record(3.0)
    st = watch.history["records"][0]["stats"]["blocks.1"]
    assert st["count"] == 2 * 8 * 16 and st["fwd_var"] > 0 and st["grad_var"] > 0
    # a module with nothing to find watches nothing, and says so
    assert W.find_sites(nn.ReLU()) == []
    assert "no sites" in Watch(nn.ReLU()).describe()


def test_csv_and_jsonl_beside_the_run_hold_the_history(tmp_path):
    model = small_model()
    watch = Watch(model, every=2, log_dir=tmp_path / "run")
    run_loop(watch, model, 4)
    watch.close()
    got = pd.read_csv(tmp_path / "run" / "watch.csv")
    want = H.to_frame(watch.history)
    key = ["step", "name", "direction", "statistic"]
    got = got.sort_values(key, na_position="first", kind="stable").reset_index(drop=True)
    want = want.sort_values(key, na_position="first", kind="stable").reset_index(drop=True)
    assert len(got) == len(want) > 0
    assert list(got.columns) == list(want.columns)
    assert got["value"].to_numpy() == pytest.approx(want["value"].to_numpy().astype(float), rel=1e-15, nan_ok=True)
    assert list(got["verdict"].fillna("")) == list(want["verdict"].fillna(""))
    lines = [json.loads(x) for x in (tmp_path / "run" / "watch.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["type"] == "step"] == [0, 1, 2, 3]
    assert [x["step"] for x in lines if x["type"] == "record"] == [0, 2]
    assert [x["loss"] for x in lines if x["type"] == "step"] == watch.history["series"]["loss"]


def test_tensorboard_event_file_reads_back_with_tensorboards_reader(tmp_path):
    pytest.importorskip("tensorboard", reason='the tensorboard extra: pip install -e ".[tensorboard]"')
    from tensorboard.backend.event_processing import event_accumulator as ea

    model = small_model()
    watch = Watch(model, every=2, log_dir=tmp_path)
    assert "TensorBoardWriter" in watch.describe()
    run_loop(watch, model, 5)
    watch.close()
    acc = ea.EventAccumulator(str(tmp_path), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    h = watch.history
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == h["series"]["step"]
    assert [e.value for e in loss] == pytest.approx(h["series"]["loss"], rel=1e-6)  # stored as float32
    var = acc.Scalars("watch/activation_var/layers.1")
    assert [e.step for e in var] == [0, 2, 4]
    assert [e.value for e in var] == pytest.approx([r["stats"]["layers.1"]["fwd_var"] for r in h["records"]], rel=1e-6)
    ratio = acc.Scalars("watch/update_ratio/lm_head.weight")
    assert [e.value for e in ratio] == pytest.approx([r["update_ratio"]["lm_head.weight"] for r in h["records"]],
                                                    rel=1e-6)
    tags = acc.Tags()["scalars"]
    assert "watch/activation_var/layers.7" not in tags and "train/lr" in tags  # only what was watched


def test_the_live_panel_draws_the_history_as_it_grows():
    import io

    from rich.console import Console

    from reports.watch_live import LivePanel

    out = io.StringIO()
    model = small_model()
    watch = Watch(model, every=2, writers=[LivePanel(Console(file=out, width=120, color_system=None))])
    assert "LivePanel" in watch.describe()
    run_loop(watch, model, 3)
    watch.close()
    text = out.getvalue()
    assert "during training" in text and "layers.1" in text
    assert "2 watch records" in text  # redrawn at the second record
    assert f"step 2  loss {watch.history['series']['loss'][2]:.4g}" in text


def test_a_spike_on_a_step_not_recorded_makes_the_next_step_recorded():
    from diagnostics import Thresholds

    model = small_model()
    watch = Watch(model, every=100)
    x = torch.zeros(1, 8, dtype=torch.long)
    n = Thresholds().spike_warmup + 2
    losses = [3.0] * n + [30.0, 3.0, 3.0]
    for t, loss in enumerate(losses):
        with watch.step(t):
            model(x).sum().backward()
        watch.record(loss)
    assert [r["step"] for r in watch.history["records"]] == [0, n + 1]  # step 0 (due) and the step after the spike
    assert [(e["step"], e["kind"]) for e in watch.history["events"]] == [(n, "spike")]


def test_a_missing_optional_package_names_its_extra(monkeypatch):
    import importlib
    import sys

    from diagnostics.integrations import writers

    monkeypatch.setattr(writers, "tensorboard_available", lambda: False)
    with pytest.raises(ImportError, match=r'pip install "tinylm\[tensorboard\]"'):
        writers.TensorBoardWriter("runs/x")
    assert not any(isinstance(w, writers.TensorBoardWriter) for w in writers.default_writers("unused-dir"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "diagnostics.integrations.hf", raising=False)
    with pytest.raises(ImportError, match=r'pip install "tinylm\[hf\]"'):
        importlib.import_module("diagnostics.integrations.hf")
