"""tinylm's own contract: the training loop does what its docstring writes, and a resumed run is the same run.

The options refuse each wrong value with its flag; the schedule is the CS336 formula;
the loop draws the documented batches, clips by the global norm, sets the scheduled
rate, calls a monitor as :class:`tinylm.train.Monitor` describes, stops before the
optimizer step on a non-finite loss, writes checkpoints when asked, and a run resumed
from a checkpoint ends bit for bit where the uninterrupted run ends. Properties of
tinylm itself: ``tinylm_only``.
"""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from props.contract import assert_refused
from props.record import prop
from props.strategies import generator
from tinylm.config import ModelConfig
from tinylm.data import DataError, get_batch
from tinylm.errors import CheckpointError
from tinylm.functional import cross_entropy
from tinylm.model import TransformerLM
from tinylm.train import (Monitor, StepInfo, TrainError, TrainOptions, TrainResult, load_training, lr_schedule,
                          make_optimizer, save_training, train)

pytestmark = pytest.mark.tinylm_only

CFG = ModelConfig(vocab_size=16, context_length=4, d_model=8, num_layers=1, num_heads=2, d_ff=8)
TOKENS = (np.arange(200) * 7 % 16).astype(np.int64)
OPTS = TrainOptions(steps=5, batch_size=2, lr=1e-2, warmup=2, watch_every=0, clip=0.05)


def model_of(seed: int = 0) -> TransformerLM:
    return TransformerLM(CFG, generator(seed))




def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("field, bad, message", [
    ("steps", 0, "steps=0: must be an integer >= 1; pass steps=N"),
    ("batch_size", 1.0, "batch_size=1.0: must be an integer >= 1; pass batch_size=N"),
    ("seed", -1, "seed=-1: must be an integer in [0, 9223372036854775807]; pass seed=N"),
    ("seed", 2**63, "seed=9223372036854775808: must be an integer in [0, 9223372036854775807]; pass seed=N"),
    ("watch_every", -1, "watch_every=-1: must be an integer >= 0; pass watch_every=N"),
    ("checkpoint_every", -2, "checkpoint_every=-2: must be an integer >= 0; pass checkpoint_every=N"),
    ("lr", 0.0, "lr=0.0: must be a finite number > 0.0; pass lr=X"),
    ("min_lr", -1e-3, "min_lr=-0.001: must be a finite number >= 0.0; pass min_lr=X"),
    ("min_lr", 0.5, "min_lr=0.5: must not exceed the peak lr=0.003; pass a smaller min_lr=X"),
    ("warmup", -1, "warmup=-1: must be an integer >= 0; pass warmup=N"),
    ("weight_decay", -0.1, "weight_decay=-0.1: must be a finite number >= 0.0; pass weight_decay=X"),
    ("clip", -1.0, "clip=-1.0: must be a finite number >= 0.0; pass clip=X"),
    ("adam_eps", 0.0, "adam_eps=0.0: must be a finite number > 0.0; pass adam_eps=X"),
    ("spike_factor", 1.0, "spike_factor=1.0: must be a finite number > 1.0; pass spike_factor=X"),
    ("beta1", 1.0, "beta1=1.0: must be in [0, 1); pass beta1=X"),
    ("beta2", -0.5, "beta2=-0.5: must be a finite number >= 0.0; pass beta2=X"),
    ("beta2", 1.5, "beta2=1.5: must be in [0, 1); pass beta2=X"),
])
def test_options_refuse_with_their_flag(field, bad, message):
    assert_refused(TrainError, message, TrainOptions, **{"steps": 10, field: bad})


def test_options_edges_defaults_and_round_trip():
    edge = TrainOptions(steps=1, batch_size=1, seed=2**63 - 1, watch_every=0, checkpoint_every=0, min_lr=0.0, warmup=0,
                        weight_decay=0.0, clip=0.0, beta1=0.0, beta2=0.0, lr=1e-9)
    assert edge.floor == 0.0 and edge.warmup_steps == 0
    assert TrainOptions(steps=10, min_lr=3e-3).floor == 3e-3  # min_lr may equal lr
    d = TrainOptions(steps=10)
    assert (d.batch_size, d.lr, d.min_lr, d.warmup, d.weight_decay, d.beta1, d.beta2, d.adam_eps, d.clip, d.seed,
            d.watch_every, d.spike_factor, d.checkpoint_every, d.stop_on_nonfinite) == (
        32, 3e-3, None, None, 0.1, 0.9, 0.95, 1e-8, 1.0, 0, 25, 1.5, 0, True)
    assert d.floor == pytest.approx(3e-4, rel=1e-15) and d.warmup_steps == 1
    assert TrainOptions(steps=5000).warmup_steps == 100 and TrainOptions(steps=999).warmup_steps == 99
    assert TrainOptions(steps=9).warmup_steps == 0
    assert TrainOptions.from_dict(OPTS.to_dict()) == OPTS
    assert TrainOptions.from_dict({**OPTS.to_dict(), "unknown": 1}, steps=9) == TrainOptions(**{**OPTS.to_dict(), "steps": 9})


@prop("lr_schedule is the CS336 schedule: (t+1)/T_w alpha_max in warmup, cosine from alpha_max to alpha_min, then alpha_min")
@given(lr=st.floats(1e-5, 1.0), frac=st.floats(0.0, 1.0), warmup=st.integers(0, 20), extra=st.integers(0, 50),
       t=st.integers(0, 100))
def test_lr_schedule(lr, frac, warmup, extra, t):
    lo, total = lr * frac, warmup + extra
    got = lr_schedule(t, lr, lo, warmup, total)
    if t < warmup:
        expected = lr * (t + 1) / warmup
    elif t >= total:
        expected = lo
    else:
        expected = lo + (1 + math.cos(math.pi * (t - warmup) / max(total - warmup, 1))) / 2 * (lr - lo)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-300)
    if warmup <= t < total:
        assert lo - 1e-15 <= got <= lr + 1e-15 and lr_schedule(t + 1, lr, lo, warmup, total) <= got + 1e-15
    assert lr_schedule(warmup, lr, lo, warmup, total + 1) == pytest.approx(lr, rel=1e-12) if warmup < total + 1 else True


def test_lr_schedule_points():
    assert lr_schedule(0, 1.0, 0.1, 4, 10) == 0.25 and lr_schedule(3, 1.0, 0.1, 4, 10) == 1.0
    assert lr_schedule(4, 1.0, 0.1, 4, 10) == 1.0 and lr_schedule(7, 1.0, 0.1, 4, 10) == pytest.approx(0.55, abs=1e-15)
    assert lr_schedule(10, 1.0, 0.1, 4, 10) == 0.1 and lr_schedule(0, 1.0, 0.1, 0, 10) == 1.0
    assert lr_schedule(5, 1.0, 0.1, 5, 5) == 0.1 and lr_schedule(0, 2.0, 0.0, 0, 1) == 2.0
    assert lr_schedule(0, 1.0, 0.1, 1, 10) == 1.0 and lr_schedule(1, 1.0, 0.1, 1, 10) == 1.0  # a one-step warmup


def test_monitor_defaults():
    m = Monitor()
    assert m.enabled is False and m.history is None and m.events == [] and Monitor().events is not m.events
    assert m.due(0) is False and m.snapshot_params() == {}
    assert m.alarm(1.0) is None and m.alarm(float("nan")) == "nonfinite" and m.alarm(float("inf")) == "nonfinite"
    with m.capture():
        pass
    assert m.commit(0, 1.0, 1.0, 1.0) is None and m.log(0, 1.0, 1.0, 1.0) is None


def test_optimizer_and_data_checks():
    model = TransformerLM(CFG.replace(tie_embeddings=True), generator(0))
    opt = make_optimizer(model, TrainOptions(steps=3, lr=0.5, beta1=0.8, beta2=0.7, adam_eps=1e-6, weight_decay=0.25))
    g = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) == 1
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (0.5, (0.8, 0.7), 1e-6, 0.25)
    assert [id(p) for p in g["params"]] == [id(p) for p in model.parameters()]
    assert_refused(DataError, "data: token id 19 is outside the model's vocabulary [0, 16); the data was tokenised for another "
            "vocabulary", train, model_of(), np.arange(20), OPTS)
    assert_refused(DataError, "data: 4 tokens are fewer than context_length + 1 = 5; use more data or a shorter context_length=N",
            train, model_of(), np.arange(4), OPTS)
    train(model_of(), np.arange(5), TrainOptions(steps=1, batch_size=1, watch_every=0))  # exactly enough
    assert_refused(TypeError, "options=dict: must be a TrainOptions", train, model_of(), TOKENS, OPTS.to_dict())


class Recorder(Monitor):
    """A monitor that records every call; ``alarms`` maps a step to the alarm it raises."""

    def __init__(self, model, every=0, alarms=None, enabled=True):
        super().__init__()
        self.model, self.every, self.alarms, self.enabled = model, every, alarms or {}, enabled
        self.calls: list[tuple] = []
        self.t = -1
        self.inside = False
        self.history = {"mine": True}

    def due(self, t):
        self.t = t
        self.calls.append(("due", t))
        return bool(self.every) and t % self.every == 0

    @contextlib.contextmanager
    def capture(self):
        self.calls.append(("capture", self.t))
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def alarm(self, loss):
        self.calls.append(("alarm", self.t))
        return self.alarms.get(self.t)

    def snapshot_params(self):
        self.calls.append(("snapshot", self.t))
        return {"token": torch.tensor(float(self.t))}

    def commit(self, t, loss, lr, grad_norm, reason="interval", before=None):
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.model.parameters()])).item()
        self.calls.append(("commit", t, reason, None if before is None else float(before["token"]), norm, grad_norm,
                           loss, lr))

    def log(self, t, loss, lr, grad_norm):
        self.calls.append(("log", t, loss, lr, grad_norm))


@prop("train: batches from the seeded sampler, clipped global norm, the scheduled rate, the monitor protocol in order")
def test_loop_follows_its_docstring():
    model, ref = model_of(), model_of()
    rec = Recorder(model, every=2, alarms={1: "spike", 3: "spike"})
    infos: list[StepInfo] = []
    wall, cpu = time.perf_counter(), time.process_time()
    res = train(model.eval(), TOKENS, OPTS, monitor=rec, on_step=infos.append)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert 0 < res.seconds <= wall and 0 <= res.cpu_seconds <= cpu
    assert isinstance(res, TrainResult) and res.model is model and model.training
    assert (res.iteration, res.tokens, res.stopped, res.history) == (5, 5 * 2 * 4, None, {"mine": True})
    assert res.seconds > 0 and res.cpu_seconds >= 0 and res.tokens_per_s == res.tokens / res.seconds and res.events == []
    lrs = [lr_schedule(t, OPTS.lr, OPTS.floor, 2, 5) for t in range(5)]
    assert [(i.step, i.steps, i.lr, i.recorded) for i in infos] == [(t + 1, 5, lrs[t], t in (0, 1, 2, 3, 4)) for t in range(5)]
    assert all(i.tokens_per_s > 0 and math.isfinite(i.loss) for i in infos)
    assert sum(2 * 4 / i.tokens_per_s for i in infos) <= res.seconds  # each step's rate is over that step's time
    assert res.optimizer.param_groups[0]["lr"] == lrs[-1]
    # the first step's loss is the initial model's loss on the first batch the seeded sampler draws
    x, y = get_batch(TOKENS, 2, 4, torch.Generator().manual_seed(OPTS.seed))
    assert infos[0].loss == float(cross_entropy(ref(x), y).detach())
    commits = [c for c in rec.calls if c[0] == "commit"]
    assert [(c[1], c[2], c[3]) for c in commits] == [(0, "interval", 0.0), (1, "spike", 1.0), (2, "interval", 2.0),
                                                      (3, "spike", 3.0), (4, "interval", 4.0)]
    for c in commits:  # the gradient the optimizer used is clipped to the global norm; grad_norm is before clipping
        assert c[4] == pytest.approx(min(c[5], OPTS.clip), rel=1e-5) and c[5] > OPTS.clip
    logs = [c for c in rec.calls if c[0] == "log"]
    assert [c[1:] for c in logs] == [(t, i.loss, lrs[t], i.grad_norm) for t, i in enumerate(infos)]
    assert [c[5:] for c in commits] == [(i.grad_norm, i.loss, lrs[t]) for t, i in enumerate(infos)]
    step1 = [c[0] for c in rec.calls if len(c) > 1 and c[1] == 1 and c[0] != "commit" and c[0] != "log"]
    assert step1 == ["due", "alarm", "capture", "snapshot"]  # a spike on a step not due: run again under capture
    step2 = [c[0] for c in rec.calls if len(c) > 1 and c[1] == 2]
    assert step2 == ["due", "capture", "alarm", "snapshot", "commit", "log"]


def test_alarms_on_a_disabled_monitor_record_nothing():
    model = model_of()
    rec = Recorder(model, every=0, alarms={1: "spike"}, enabled=False)
    infos: list[StepInfo] = []
    train(model, TOKENS, OPTS, monitor=rec, on_step=infos.append)
    assert not [c for c in rec.calls if c[0] in ("capture", "commit", "snapshot")] and not any(i.recorded for i in infos)


def test_no_clipping_at_zero_and_one_checkpoint_at_the_end(tmp_path):
    model = model_of()
    rec = Recorder(model, every=1)
    out = tmp_path / "c.pt"
    train(model, TOKENS, TrainOptions(**{**OPTS.to_dict(), "clip": 0.0}), monitor=rec, output=out,
          on_step=lambda info: rec.calls.append(("file", out.exists())))
    commits = [c for c in rec.calls if c[0] == "commit"]
    assert len(commits) == 5 and all(c[4] == pytest.approx(c[5], rel=1e-5) and c[5] > OPTS.clip for c in commits)
    assert [c[1] for c in rec.calls if c[0] == "file"] == [False] * 5 and out.exists()


@pytest.mark.parametrize("stop", [True, False])
def test_nonfinite_stops_before_the_optimizer_step(tmp_path, stop):
    model, ref = model_of(), model_of()
    train(ref, TOKENS, TrainOptions(**{**OPTS.to_dict(), "steps": 2}))
    rec = Recorder(model, every=0, alarms={2: "nonfinite"})
    res = train(model, TOKENS, TrainOptions(**{**OPTS.to_dict(), "stop_on_nonfinite": stop}), monitor=rec,
                output=tmp_path / "c.pt")
    commits, logs = [c for c in rec.calls if c[0] == "commit"], [c for c in rec.calls if c[0] == "log"]
    assert commits[0][1:3] == (2, "nonfinite") and (commits[0][3] is None) == stop
    lr2 = lr_schedule(2, OPTS.lr, OPTS.floor, 2, 5)
    assert commits[0][5:] == (logs[2][4], logs[2][2], lr2) and logs[2][1] == 2 and logs[2][3] == lr2
    if stop:
        loss = [c for c in rec.calls if c[0] == "log"][-1][2]
        assert res.stopped == f"non-finite loss ({loss}) at step 2; stopped before the optimizer step"
        assert res.iteration == 2 and res.tokens == 2 * 8 and same(model, ref)
        saved = torch.load(tmp_path / "c.pt", weights_only=True)
        assert saved["iteration"] == 2 and saved["history"] == {"mine": True}
        assert len([c for c in rec.calls if c[0] == "log"]) == 3
    else:
        assert res.stopped is None and res.iteration == 5 and not same(model, ref)


def test_resume_is_the_same_run(tmp_path):
    full = model_of()
    train(full, TOKENS, OPTS)
    part, seen = model_of(), []

    def on_step(info):  # checkpoint_every=2: the file holds the last even iteration before the end
        f = tmp_path / "c.pt"
        seen.append(torch.load(f, weights_only=True)["iteration"] if f.exists() else None)

    opts = TrainOptions(**{**OPTS.to_dict(), "checkpoint_every": 2})
    train(part, TOKENS, TrainOptions(**{**opts.to_dict(), "steps": 3}), output=tmp_path / "c.pt", on_step=on_step,
          data="tok.npy")
    assert seen == [None, 2, 2]
    model, extra = load_training(tmp_path / "c.pt")
    assert model.training and extra["iteration"] == 3 and extra["data"] == "tok.npy" and extra["history"] is None
    assert extra["options"] == TrainOptions(**{**opts.to_dict(), "steps": 3}).to_dict()
    assert extra["sampler_state"].dtype == torch.uint8 and extra["optimizer"]["state"]
    res = train(model, TOKENS, opts, resume=extra)
    assert res.iteration == 5 and res.tokens == 2 * 8 and same(model, full)
    assert_refused(TrainError, "the checkpoint is already at iteration 5 >= steps=5; pass a larger steps=N",
            train, model, TOKENS, opts, resume={"iteration": 5})


def test_resume_refuses_damage(tmp_path):
    model = model_of()
    opt = make_optimizer(model, OPTS)
    save_training(tmp_path / "c.pt", model, opt, 1, {"h": 1}, OPTS, torch.Generator().manual_seed(0))
    _, extra = load_training(tmp_path / "c.pt")
    assert extra["history"] == {"h": 1} and extra["data"] is None and extra["iteration"] == 1
    assert_refused(CheckpointError, "the checkpoint's sampler state is damaged (not a CPU generator state); resume from "
            "another checkpoint, or start a new run with the same seed=N", train, model, TOKENS, OPTS,
            resume={"iteration": 1, "sampler_state": torch.zeros(3, dtype=torch.uint8)})
    other = make_optimizer(TransformerLM(CFG.replace(num_layers=2), generator(0)), OPTS).state_dict()
    with pytest.raises(CheckpointError) as info:
        train(model, TOKENS, OPTS, resume={"iteration": 1, "optimizer": other})
    assert str(info.value).startswith("the checkpoint's optimizer state does not fit the model (")
    assert str(info.value).endswith("); resume from a matching checkpoint")
    torch.save({"format": "tinylm", "version": 1, "config": CFG.to_dict(), "model": model.state_dict(), "iteration": 2,
                "train_options": [1], "sampler_state": torch.zeros(3), "train_data": 5}, tmp_path / "d.pt")
    _, extra = load_training(tmp_path / "d.pt")
    assert (extra["options"], extra["sampler_state"], extra["data"], extra["optimizer"]) == (None, None, None, None)
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    state = model.state_dict()
    state["ln_final.weight"] = torch.full_like(state["ln_final.weight"], float("nan"))
    torch.save({"format": "tinylm", "version": 1, "config": CFG.to_dict(), "model": state}, tmp_path / "nan.pt")
    assert_refused(CheckpointError, f"{tmp_path / 'nan.pt'}: parameters hold NaN or inf (ln_final.weight); resume from an earlier "
            "checkpoint", load_training, tmp_path / "nan.pt")
    for k in ("layers.0.ln1.weight", "layers.0.ln2.weight", "token_embeddings.weight"):
        state[k] = torch.full_like(state[k], float("inf"))
    torch.save({"format": "tinylm", "version": 1, "config": CFG.to_dict(), "model": state}, tmp_path / "nan.pt")
    assert_refused(CheckpointError, f"{tmp_path / 'nan.pt'}: parameters hold NaN or inf (token_embeddings.weight, layers.0.ln1.weight, "
            "layers.0.ln2.weight); resume from an earlier checkpoint", load_training, tmp_path / "nan.pt")


def test_resume_from_other_formats(tmp_path):
    from tinylm import checkpoint

    model = model_of()
    checkpoint.save(tmp_path / "m.safetensors", model, history={"h": [1]})
    loaded, extra = load_training(tmp_path / "m.safetensors")  # weights only: the run starts at 0 with a new optimizer
    assert loaded.training and same(loaded, model)
    assert extra == {"optimizer": None, "iteration": 0, "history": {"h": [1]}, "options": None, "sampler_state": None,
                     "data": None}
    checkpoint.save(tmp_path / "n.safetensors", model, iteration=4)
    assert load_training(tmp_path / "n.safetensors")[1]["iteration"] == 4
    opt = make_optimizer(model, OPTS)
    train(model, TOKENS, TrainOptions(**{**OPTS.to_dict(), "steps": 1}))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iteration": 2, "config": CFG.to_dict()},
               tmp_path / "t.pt")  # a CS336-style training checkpoint
    _, extra = load_training(tmp_path / "t.pt")
    assert extra["iteration"] == 2 and extra["optimizer"] == opt.state_dict() and extra["options"] is None
