"""Between records the watch costs nothing: a step it does not record runs the same
attention path and the same tensor operations as a step without any watch, and leaves no
hook behind.

tinylm's attention takes torch's fused kernel only while nothing observes its ``scores`` /
``probs`` Taps (``MultiHeadSelfAttention.weights_needed``); one hook left on the model after
a record would force the explicit T x T path on every later step. So these tests count, per
step, which path each attention layer took and every aten operation dispatched (a gradient
norm, a parameter copy, a ``.item()`` sync each show up there), in ``tinylm.train.train``
and in a hand-written loop, against the same loop without a watch. The recorded steps are
the negative control: there the counters must see the probe's work (its attention observers
keep the fused kernel, so the path is the same on every step).
All counts are exact (no timing), so nothing here depends on the machine's load.
"""

from __future__ import annotations

import collections
import sys

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tinylm
from diagnostics import Watch
from diagnostics.jobs.watch import train_watched
from tinylm import functional as F
from tinylm.train import TrainOptions, train

SMALL = dict(vocab_size=32, context_length=8, d_model=16, num_heads=2, d_ff=32)
EVERY, STEPS = 3, 7  # records at steps 0, 3, 6


def small_model(layers: int = 2) -> tinylm.TransformerLM:
    config = tinylm.ModelConfig(**SMALL, num_layers=layers)
    return tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))


def tokens(n: int = 3000) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 32, size=n).astype(np.int64)


class AtenOps(TorchDispatchMode):
    """Counts every aten operation dispatched while active (forward, backward, optimizer)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def take(self) -> collections.Counter:
        out, self.counts = self.counts, collections.Counter()
        return out


def count_paths(monkeypatch) -> collections.Counter:
    """Counts attention calls by path: "fused" (torch's kernel) and "explicit" (scores formed)."""
    paths: collections.Counter = collections.Counter()
    fused, scores = torch.nn.functional.scaled_dot_product_attention, F.attention_scores

    def counted_fused(*a, **k):
        paths["fused"] += 1
        return fused(*a, **k)

    def counted_scores(*a, **k):
        paths["explicit"] += 1
        return scores(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_fused)
    monkeypatch.setattr(F, "attention_scores", counted_scores)
    return paths


def observers(model) -> list[str]:
    """Everything that would make attention take its explicit path or run code per forward:
    module hooks of any kind, global module hooks, ``explicit`` flags, ``weights_needed()``,
    attention observers."""
    found = [f"hook on {n or 'the model'}" for n, m in model.named_modules()
             if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks]
    if tinylm.layers._global_hooks():
        found.append("a global module hook")
    for n, m in model.named_modules():
        if isinstance(m, tinylm.MultiHeadSelfAttention):
            if m.explicit:
                found.append(f"{n}.explicit")
            if m.weights_needed():
                found.append(f"{n}.weights_needed()")
            if m.__dict__.get("_observers"):
                found.append(f"an observer on {n}")
    return found


def per_step_train(monitor_every: int | None, monkeypatch) -> list[dict]:
    """tinylm.train.train for STEPS steps, without a monitor (None) or under a Watch every K
    steps; per step: whether it was recorded, its attention paths, aten ops and the observers
    left on the model when it ended."""
    model = small_model()
    paths = count_paths(monkeypatch)
    ops = AtenOps()
    out: list[dict] = []

    def on_step(info):
        out.append({"recorded": info.recorded, "paths": dict(paths), "ops": ops.take(),
                    "observers": observers(model)})
        paths.clear()

    options = TrainOptions(steps=STEPS, batch_size=2, watch_every=monitor_every or 0)
    with ops:
        if monitor_every is None:
            train(model, tokens(), options, on_step=on_step)
        else:
            train_watched(model, tokens(), options, on_step=on_step)
    return out


def test_train_unrecorded_steps_take_the_fused_path_and_leave_nothing_attached(monkeypatch):
    steps = per_step_train(EVERY, monkeypatch)
    layers = small_model().config.num_layers
    assert [s["recorded"] for s in steps] == [t % EVERY == 0 for t in range(STEPS)]
    for t, s in enumerate(steps):
        assert s["observers"] == [], f"step {t}: {s['observers']} left on the model"
        want = {"fused": layers}
        assert s["paths"] == want, f"step {t} (recorded={s['recorded']}): attention paths {s['paths']}"


def test_train_unrecorded_step_does_the_tensor_work_of_a_plain_step(monkeypatch):
    plain = per_step_train(None, monkeypatch)
    watched = per_step_train(EVERY, monkeypatch)
    for t, (p, w) in enumerate(zip(plain, watched)):
        if w["recorded"]:  # negative control: the counter sees the probe and the parameter copies
            extra = w["ops"] - p["ops"]
            assert sum(extra.values()) > 0 and extra["aten._foreach_mul.Scalar"] == 1  # the copies: one op
        else:
            assert w["ops"] == p["ops"], (f"step {t}: the watch added {dict(w['ops'] - p['ops'])} "
                                          f"and removed {dict(p['ops'] - w['ops'])}")
    # one gradient norm per step (the loop's clipping), with the watch or without it
    assert all(s["ops"]["aten.linalg_vector_norm.default"] == p["ops"]["aten.linalg_vector_norm.default"]
               for s, p in zip(watched, plain) if not s["recorded"])


def hand_loop(watch: Watch | None, model, monkeypatch, steps: int = STEPS) -> list[dict]:
    """A user's loop with AdamW, with the watch's step context or without any watch; per step
    its attention paths and aten ops (the loss read as a float in both)."""
    paths = count_paths(monkeypatch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    out: list[dict] = []
    with AtenOps() as ops:
        for t in range(steps):
            x = torch.randint(0, 32, (2, 9), generator=g)
            if watch is None:
                loss = F.cross_entropy(model(x[:, :-1]), x[:, 1:])
                loss.backward()
                opt.step()
                opt.zero_grad()
                float(loss.detach())
            else:
                with watch.step(t):
                    loss = F.cross_entropy(model(x[:, :-1]), x[:, 1:])
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                watch.record(loss, lr=1e-3)
            out.append({"paths": dict(paths), "ops": ops.take(), "observers": observers(model)})
            paths.clear()
    return out


def test_own_loop_unrecorded_step_matches_a_loop_without_the_watch(monkeypatch, tmp_path):
    plain = hand_loop(None, small_model(), monkeypatch)
    model = small_model()
    with Watch(model, every=EVERY, log_dir=str(tmp_path)) as watch:  # the writers included
        watched = hand_loop(watch, model, monkeypatch)
    layers = model.config.num_layers
    for t, (p, w) in enumerate(zip(plain, watched)):
        assert w["observers"] == [], f"step {t}: {w['observers']} left on the model"
        if t % EVERY == 0:  # negative control
            assert w["paths"] == {"fused": layers} and w["ops"] != p["ops"]
        else:
            assert w["paths"] == {"fused": layers} == p["paths"]
            assert w["ops"] == p["ops"], f"step {t}: the watch added {dict(w['ops'] - p['ops'])}"


def watch_calls(layers: int, monkeypatch) -> list[int]:
    """Per step of a hand-written loop under Watch(every=EVERY): the Python function calls made
    in the diagnostics package (the watch's own work, whatever torch does)."""
    import diagnostics

    root = diagnostics.__file__.rsplit("/", 1)[0]
    model = small_model(layers)
    watch = Watch(model, every=EVERY)
    counts: list[int] = []
    n = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            n[0] += 1

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for t in range(STEPS):
        x = torch.randint(0, 32, (2, 9), generator=g)
        n[0] = 0
        sys.setprofile(profile)
        try:
            with watch.step(t):
                loss = F.cross_entropy(model(x[:, :-1]), x[:, 1:])
                loss.backward()
                opt.step()
                opt.zero_grad()
            watch.record(loss, lr=1e-3)
        finally:
            sys.setprofile(None)
        counts.append(n[0])
    watch.close()
    return counts


def test_own_loop_unrecorded_step_work_does_not_grow_with_the_model(monkeypatch):
    one, three = watch_calls(1, monkeypatch), watch_calls(3, monkeypatch)
    unrecorded = [t for t in range(STEPS) if t % EVERY]
    # the same calls whatever the number of sites and parameters: no per-site or per-parameter loop
    assert [one[t] for t in unrecorded] == [three[t] for t in unrecorded]
    assert len({one[t] for t in unrecorded[1:]}) == 1  # and the same at every unrecorded step
    # negative control: a recorded step's work grows with the sites (the count can see a loop)
    assert all(three[t] > one[t] for t in range(0, STEPS, EVERY))
