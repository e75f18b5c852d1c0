"""StepReplay in a watched loop: chosen steps and alarming steps replayed before the optimizer steps,
the trajectory the same as without it, the answer in the forensics report, other steps bare."""

import torch
import torch.nn.functional as F

import tinylm
from benchmarks.bench_replay import flip_hook, injection_sites
from diagnostics import Thresholds, Watch
from diagnostics.jobs.watch_replay import StepReplay

CFG = tinylm.ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
STEPS, SPIKE_AT = 8, 6


def _batch(t):
    return torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(t))


def _loop(make_replayer=None, fault=None):
    """8 SGD steps, the loss scaled by 50 at SPIKE_AT (a spike the watch alarms on); ``fault(t, call)``
    may wrap a call of the step in a context (a flip). Returns (model, replayer, watch, calls per step)."""
    model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
    watch = Watch(model, every=4, thresholds=Thresholds(spike_warmup=3))
    replayer = make_replayer(watch) if make_replayer else None
    calls = {}
    for t in range(STEPS):
        x = _batch(t)

        def step(t=t, x=x):
            calls[t] = calls.get(t, 0) + 1
            hooks = sum(len(m._forward_hooks) for m in model.modules())
            calls.setdefault(("hooks", t), []).append(hooks)
            with (fault(t, calls[t]) if fault else torch.enable_grad()):
                loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()) * (50 if t == SPIKE_AT else 1)
            loss.backward()
            return loss
        with watch.step(t):
            loss = replayer.run(t, step) if replayer else step()
            with torch.no_grad():  # SGD, and the gradients cleared to None
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.05)
                    p.grad = None
        watch.record(loss)
    watch.close()
    return model, replayer, watch, calls


def test_replays_chosen_and_alarming_steps_and_leaves_the_trajectory_alone():
    plain, _, _, _ = _loop()
    model, replayer, watch, calls = _loop(lambda w: StepReplay(w, steps=[2]))
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)  # the optimizer took the steps it would have taken
    assert set(replayer.results) == {2, SPIKE_AT}
    assert calls[2] == 2 and calls[SPIKE_AT] == 3  # chosen: twice; at the alarm: the real one and two more
    assert all(calls[t] == 1 for t in range(STEPS) if t not in (2, SPIKE_AT))
    assert calls[("hooks", 1)] == [0]  # a step not replayed runs bare
    assert replayer.results[2].verdict == "identical" and replayer.results[SPIKE_AT].verdict == "identical"
    report = next(r for r in watch.reports if r["step"] == SPIKE_AT)
    assert report["replay"]["verdict"] == "identical" and report["replay"]["original"]["reproduced"] is True
    assert report["replay"]["why"] == "at a spike alarm"


def _flip_on(step, call, direction="forward"):
    """A flip at layers.1.ffn in ``call`` of step ``step`` only."""
    def fault(t, c):
        if (t, c) != (step, call):
            return torch.enable_grad()
        model = fault.model
        site = next(s for s in injection_sites(model) if s.key == "layers.1.ffn")
        return flip_hook(model, site, direction, torch.Generator().manual_seed(0), {})
    return fault


def test_a_fault_in_the_real_execution_is_told_apart_from_one_in_the_rerun():
    faults = {"real": _flip_on(SPIKE_AT, 1), "rerun": _flip_on(SPIKE_AT, 3)}
    found = {}
    for name, fault in faults.items():
        def make(w, fault=fault):
            fault.model = w.model
            return StepReplay(w)
        _, replayer, watch, _ = _loop(make, fault)
        found[name] = next(r for r in watch.reports if r["step"] == SPIKE_AT)["replay"]
    real, rerun = found["real"], found["rerun"]
    assert real["verdict"] == "identical" and real["original"]["reproduced"] is False  # the reruns agree; the real one did not
    assert real["original"]["first_gradient_that_differs"] is not None
    assert rerun["verdict"] == "departs" and rerun["first"]["site"] == "layers.1.ffn"
