"""What torch itself loses while the probe's hooks are on: the probe's cost outside its hook bodies.

    python benchmarks/bench_hookcost.py [--rounds 30] [--threads 1] [--models gpt2,tinylm]

At the launch-bound shape of ``bench_launch.py`` (d_model 64, 24 layers, T 32, batch 4, one
thread), everything in the thread's CPU time (``time.thread_time``: what preemption on a shared
machine does not move), medians over ``--rounds`` interleaved rounds (the order of the arms
shuffled by a seeded generator each round), the first quartile beside it:

* the machinery, per call: a module call with a no-op forward hook against none; a gradient
  hook put on by ``Tensor.register_hook`` and by :func:`diagnostics.measure.hooks.tensor_hook`,
  and one trip of autograd into a no-op hook; a torch call passed on by the attention watch
  (:class:`~diagnostics.measure.eager_attention.EagerAttentionWatch`) against none;
* per pass (forward+backward), for each model: ``bare``; ``machinery``: what the probe puts on
  without its work (a no-op forward hook on each module it hooks, a no-op gradient hook on each
  output that needs one and, where the probe needs it for that model, the attention watch's mode
  on inside the attention modules with nothing measured: :mod:`diagnostics.measure.attention_watch`); ``busy``: the same with each hook running pure Python for about as long as one of
  the probe's hook bodies on average (a control: the pass less those bodies); ``probe``: the
  pass under the default probe less its hook bodies (``run.seconds``, its clocks read in the
  thread's CPU time for this script). Each with its excess over bare: what torch loses.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _clock_in_cpu_time() -> None:
    """The probe's clocks (``time.perf_counter`` in the modules that time hook bodies) read the
    thread's CPU time, as this script's do."""
    shim = types.SimpleNamespace(perf_counter=time.thread_time)
    for name in ("probe", "attention", "sdpa", "eager_attention"):
        importlib.import_module(f"diagnostics.measure.{name}").time = shim


def _per_call(fn_a, fn_b, calls: int, rounds: int) -> tuple[float, float]:
    """Median µs per call of ``fn_a`` and ``fn_b`` (each runs ``calls`` calls), interleaved."""
    got: dict = {0: [], 1: []}
    for _ in range(rounds):
        for i, fn in enumerate((fn_a, fn_b)):
            t0 = time.thread_time()
            fn()
            got[i].append((time.thread_time() - t0) / calls * 1e6)
    return statistics.median(got[0]), statistics.median(got[1])


def machinery(rounds: int) -> None:
    import torch
    from torch import nn

    from diagnostics.measure.eager_attention import EagerAttentionWatch
    from diagnostics.measure.hooks import Hooks, tensor_hook

    lin, x = nn.Linear(64, 64), torch.randn(128, 64)
    hooked = nn.Linear(64, 64)
    Hooks().forward(hooked, lambda m, a, o: None)
    n = 200
    plain, with_hook = _per_call(lambda: [lin(x) for _ in range(n)], lambda: [hooked(x) for _ in range(n)], n, rounds)
    print(f"  module call: no hook {plain:.2f} µs, a no-op forward hook {with_hook:.2f} µs "
          f"(+{with_hook - plain:.2f})")

    w = torch.randn(64, 64, requires_grad=True)

    def chain(put):
        def run():
            y = x
            for _ in range(n):
                y = torch.tanh(y @ w)
                put(y)
        return run
    noop = lambda g: None  # noqa: E731
    handle, entry = _per_call(chain(lambda y: y.register_hook(noop)), chain(lambda y: tensor_hook(y, noop)), n, rounds)
    base = _per_call(chain(lambda y: None), chain(lambda y: None), n, rounds)[0]
    print(f"  gradient hook put on: Tensor.register_hook {handle - base:.2f} µs, tensor_hook {entry - base:.2f} µs")

    def backward(put):
        y = x
        for _ in range(n):
            y = torch.tanh(y @ w)
            put(y)
        loss = y.sum()
        return lambda: loss.backward(retain_graph=True)
    bare_b, hooked_b = _per_call(backward(lambda y: None), backward(lambda y: tensor_hook(y, noop)), n, rounds)
    print(f"  backward, per node: no hook {bare_b:.2f} µs, a no-op tensor hook {hooked_b:.2f} µs "
          f"(+{hooked_b - bare_b:.2f}: one trip into Python)")

    watch = EagerAttentionWatch(lambda *a: None, lambda: None)
    t = torch.randn(4, 32, 64)

    def calls():
        for _ in range(40):  # 5 calls each: a view, a transpose, a shape, a size, a reshape
            t.view(4, 32, 4, 16).transpose(1, 2)
            t.shape, t.size(), t.reshape(-1)

    def under_watch():
        with watch:
            calls()
    off, on = _per_call(calls, under_watch, 200, rounds)
    print(f"  torch call: {off:.2f} µs, under the attention watch {on:.2f} µs (+{on - off:.2f}, passed on)")


def _arms(model, tokens, step):
    """{arm: callable returning (the pass's CPU ms less the hook bodies, the hook bodies' ms)}."""
    import torch

    from diagnostics import probe
    from diagnostics.measure import hooks as hooks_module
    from diagnostics.measure.eager_attention import EagerAttentionWatch
    from diagnostics.measure.hooks import Hooks
    from diagnostics.measure.sites import model_walk

    tensor_hook = getattr(hooks_module, "tensor_hook", lambda t, fn: t.register_hook(fn))  # a tree without it
    P = importlib.import_module("diagnostics.measure.probe")
    sites, named, _params = model_walk(model)
    observed = P.observed_attention(model, sites.points, named)
    hooked = [n for n, k in sites.points.items() if n in named
              and n.rpartition(".")[2] not in observed.get(n.rpartition(".")[0], ())]
    try:
        from diagnostics.measure import attention_watch
    except ImportError:  # a tree before it: the mode always on
        attention_watch = types.SimpleNamespace(watched_modules=P._watched)
    watched = attention_watch.watched_modules(sites.blocks, named) if sites.blocks and not P._is_tinylm(model) else []
    body = {"us": 0.0, "spent": 0.0, "loops": 0}

    def busy():  # pure Python (no system call inside): a loop of about body["us"]
        t0 = time.thread_time()
        for _ in range(body["loops"]):
            pass
        body["spent"] += time.thread_time() - t0

    def put(work: bool) -> Hooks:
        hooks, watch, running = Hooks(), EagerAttentionWatch(lambda *a: None, lambda: None), []

        def grad(g):
            if work:
                busy()

        def fwd(m, a, o):
            if work:
                busy()
            if isinstance(o, torch.Tensor) and o.requires_grad:
                tensor_hook(o, grad)
        for name in hooked:
            hooks.forward(named[name], fwd)

        def push(m, a):
            if not running:
                watch.__enter__()
            running.append(1)

        def pop(m, a, o):
            running.pop()
            if not running:
                watch.__exit__(None, None, None)
        if getattr(attention_watch, "_BY_NAME", {}).get(model) is not True:  # as the probe: the mode only if needed
            for name in watched:
                hooks.pre(named[name], push)
                hooks.forward(named[name], pop, always_call=True)
        return hooks

    def plain(hooks_of=None):
        def run():
            hooks = hooks_of() if hooks_of else None
            body["spent"] = 0.0
            t0 = time.thread_time()
            step(model, tokens)
            t = time.thread_time() - t0 - body["spent"]
            if hooks is not None:
                hooks.remove()
            return t * 1e3, body["spent"] * 1e3
        return run

    def probed():
        with probe(model) as run:
            s0 = run.seconds
            t0 = time.thread_time()
            step(model, tokens)
            t = time.thread_time() - t0
            hooks = run.seconds - s0
        return (t - hooks) * 1e3, hooks * 1e3
    return {"bare": plain(), "machinery": plain(lambda: put(False)), "busy": plain(lambda: put(True)),
            "probe": probed}, body, len(hooked), watched


def passes(name: str, model, tokens, step, rounds: int, only: list[str] | None = None) -> None:
    arms, body, n_hooked, watched = _arms(model, tokens, step)
    arms = {k: v for k, v in arms.items() if only is None or k in only or k == "bare"}
    trips = _trips(model, tokens, step)
    for arm in arms.values():  # warm-up
        arm()
    hooks_ms = statistics.median(arms["probe"]()[1] for _ in range(3))
    body["us"] = hooks_ms * 1e3 / max(trips["forward"] + trips["gradient"], 1)
    t0 = time.thread_time()
    for _ in range(1_000_000):
        pass
    body["loops"] = int(body["us"] * 1e-6 / ((time.thread_time() - t0) / 1e6))
    got: dict = {k: [] for k in arms}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(arms)
        rng.shuffle(order)
        for k in order:
            got[k].append(arms[k]())
    med = {k: statistics.median(t for t, _ in v) for k, v in got.items()}
    q1 = {k: sorted(t for t, _ in v)[len(v) // 4] for k, v in got.items()}
    print(f"\n{name}: {n_hooked} modules hooked, {len(watched)} under the attention watch; per probed pass "
          f"{trips['forward']} forward records, {trips['gradient']} gradient hook trips, "
          f"{trips['intercepted']} calls intercepted by the watch; the busy control's body {body['us']:.1f} µs")
    for k in arms:
        hooks = statistics.median(h for _, h in got[k])
        whole = statistics.median(t + h for t, h in got[k])
        print(f"  {k:10s} torch {med[k]:6.1f} ms (+{med[k] - med['bare']:5.1f}; first quartile "
              f"+{q1[k] - q1['bare']:5.1f}), hook bodies {hooks:5.1f} ms, the pass {whole:6.1f} ms "
              f"({whole / med['bare']:.2f}x bare)")


def _trips(model, tokens, step) -> dict:
    """Per probed pass: forward records (``ProbeRun._forward`` calls: a hooked module's output, the
    heads, a block's input), gradient hook trips, calls the attention watch intercepted."""
    P = importlib.import_module("diagnostics.measure.probe")
    from diagnostics import probe
    from diagnostics.measure.eager_attention import EagerAttentionWatch

    n = {"forward": 0, "gradient": 0, "intercepted": 0}
    real = (P.ProbeRun._forward, P.ProbeRun._gradient, EagerAttentionWatch.__torch_function__)

    def fwd(self, *a):
        n["forward"] += 1
        return real[0](self, *a)

    def grad(self, *a):
        n["gradient"] += 1
        return real[1](self, *a)

    def tf(self, *a, **k):
        n["intercepted"] += 1
        return real[2](self, *a, **k)
    P.ProbeRun._forward, P.ProbeRun._gradient, EagerAttentionWatch.__torch_function__ = fwd, grad, tf
    try:
        with probe(model):
            step(model, tokens)
    finally:
        P.ProbeRun._forward, P.ProbeRun._gradient, EagerAttentionWatch.__torch_function__ = real
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default="gpt2,tinylm")
    ap.add_argument("--arms", default="machinery,busy,probe", help="which arms beside bare")
    ap.add_argument("--no-machinery", action="store_true", help="skip the per-call figures")
    args = ap.parse_args(argv)
    import torch

    import bench_launch as bl

    torch.set_num_threads(args.threads)
    _clock_in_cpu_time()
    print(f"threads {args.threads}, load {os.getloadavg()[0]:.1f}; thread CPU time, medians of {args.rounds} rounds")
    if not args.no_machinery:
        print("machinery, per call:")
        machinery(args.rounds)
    nets, tokens = bl.models()
    for name in args.models.split(","):
        passes(name, nets[name], tokens, bl.step, args.rounds, args.arms.split(","))
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
