"""The probe in the launch-bound regime: a small, deep model where every op costs its dispatch.

    python benchmarks/bench_launch.py [--pairs 9] [--threads 1] [--reducer cuda,auto] [--models tinylm,gpt2]
                                      [--top 12] [--no-watch] [--breakdown N] [--queue N] [--rows N]

d_model 64, 24 layers, 4 heads, T 32, batch 4 (vocab 10000), one thread by default: on a
GPU every model people debug with is in this regime, and on the CPU this shape shows it. Per
model (tinylm's ``TransformerLM``, ``tinylm.reference.BuiltinLM`` for the bare ops only, and
a Hugging Face GPT-2 of the same shape) and per reducer (``TINYLM_REDUCER``: ``cuda`` is the
structure CUDA tensors get, ``auto`` the default CPU path), one forward+backward:

* dispatched aten ops, bare and under ``probe`` (the whole ``with`` block: its exit, the
  parameter statistics and the one transfer of its results, included), counted by
  :class:`diagnostics.measure.opcount.OpCount`, and the ops the probe adds, by name (``--top``);
* the compiled graphs a probed pass runs (:func:`compiled_calls`: under ``cuda``, the kernel
  launches a GPU pays for, which the CPU's time hides behind the float64 arithmetic);
* host reads (``.item()``, ``.tolist()``, ``.cpu()`` and kin) inside forward and backward;
* time probed / bare: ``--pairs`` interleaved pairs (order by a seeded coin) after a warm-up
  of each, the median of the within-pair ratios (the machine is shared: pairs, not means);
* a recorded watch step against a plain step (``Watch(every=1)``, SGD) the same way (its ops
  also with the optimizer's figures, ``optimizer=``), and the
  same step under the watch's probe alone (``Watch.capture``, nothing recorded): the rest is
  the watch's own work (parameter copies, update ratios, the one transfer, the judging);
* for tinylm, the bare pass's ops and time against ``BuiltinLM``'s (the same pairs);
* ``--queue N``: the probe with its queue (:mod:`diagnostics.measure.pending`) against every
  request reduced in its hook, N interleaved pairs in CPU time;
* ``--rows N``: the queue's requests with rows (cosine, inverse row mean squares, a gate's count,
  a norm's factor and its gradient's weighted figure) against those reduced in their hooks, N
  interleaved pairs in CPU time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

SHAPE = dict(d_model=64, num_layers=24, num_heads=4, context_length=32, batch=4, vocab=10000)


def models():
    import torch
    import transformers

    import tinylm
    from tinylm.reference import BuiltinLM

    s = SHAPE
    config = tinylm.preset("tiny", num_layers=s["num_layers"], context_length=s["context_length"],
                           d_model=s["d_model"], num_heads=s["num_heads"], vocab_size=s["vocab"])
    tiny = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0))
    builtin = BuiltinLM(config)
    builtin.load_state_dict(tiny.state_dict())
    gcfg = transformers.GPT2Config(vocab_size=s["vocab"], n_positions=s["context_length"], n_embd=s["d_model"],
                                   n_layer=s["num_layers"], n_head=s["num_heads"], attn_implementation="sdpa")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(gcfg)
    gpt2.train(False)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["context_length"] + 1),
                           generator=torch.Generator().manual_seed(1))
    return {"tinylm": tiny, "builtin": builtin, "gpt2": gpt2}, tokens


def step(model, tokens) -> None:
    """One forward and backward of the next-token loss (gradients dropped after)."""
    import tinylm

    out = model(tokens[:, :-1])
    logits = out if not hasattr(out, "logits") else out.logits
    tinylm.functional.cross_entropy(logits, tokens[:, 1:]).backward()
    model.zero_grad(set_to_none=True)


def probed(model, tokens, counter=None) -> None:
    """One probed step; with ``counter`` (an OpCount), host reads are counted inside forward and
    backward only (the count of ops covers the whole ``with`` block)."""
    from diagnostics import probe

    with probe(model) as run:
        reads = dict(counter.reads) if counter is not None else None
        step(model, tokens)
        if counter is not None:
            inside = {k: v - reads.get(k, 0) for k, v in counter.reads.items() if v - reads.get(k, 0)}
    run.stats  # noqa: B018 - the one transfer
    return inside if counter is not None else None


def breakdown(model, tokens, n: int) -> dict[str, float]:
    """Medians over ``n`` probed passes, in ms, of the probe's own parts: ``entry`` (entering the
    ``with``: the module walks, the hooks registered), ``hooks`` (``run.seconds`` spent in forward
    and backward), ``torch`` (the pass less its hooks), ``exit`` (leaving the ``with``: the
    parameters' and gradients' moments, the hooks removed, the model restored), ``stats`` (the
    one transfer of the results to Python); and ``bare`` (one unprobed pass, interleaved). Inside
    the hooks and the exit, the mean time per pass of some pieces (clocked, so slightly slower):
    the direct lane's numba reductions (``reduction.numba_moments`` and ``numba_parts``), the tinylm
    attention summaries (``attention.statistics_many``: all the layers of a flush in one call) and
    the queue's flushes (its plain requests, ``pending._reduced``; those with rows,
    ``pending_rows.Rows.reduce``), the SDPA calls' sampled rows (``sdpa.summary``, ``sdpa.summaries``) and, at the exit, the parameters' and gradients' moments
    (``reduction.many``, where no other clocked piece called it)."""
    import importlib

    from diagnostics import probe
    from diagnostics.measure import attention, params, pending, reduction, sdpa

    parts: dict[str, list[float]] = {k: [] for k in ("bare", "entry", "hooks", "torch", "exit", "stats")}
    clocks = {"numba reductions in hooks": [0.0, 0], "attention summaries": [0.0, 0], "queue's reductions": [0.0, 0],
              "SDPA calls' sampled rows": [0.0, 0], "parameters' and gradients' moments": [0.0, 0],
              "queue's reductions with rows": [0.0, 0]}
    timed = [(reduction, "numba_moments", "numba reductions in hooks"),
             (reduction, "numba_parts", "numba reductions in hooks"), (attention, "statistics_many", "attention summaries"),
             (pending, "_reduced", "queue's reductions"), (sdpa, "summary", "SDPA calls' sampled rows"),
             (sdpa, "summaries", "SDPA calls' sampled rows"),
             (params.reduction, "many", "parameters' and gradients' moments")]
    try:  # a tree whose queue also takes the requests with rows
        timed.append((importlib.import_module("diagnostics.measure.pending_rows").Rows, "reduce",
                      "queue's reductions with rows"))
    except ImportError:
        del clocks["queue's reductions with rows"]
    real = [(mod, name, getattr(mod, name)) for mod, name, _ in timed]

    inside = [0]  # a clocked piece running: one called inside it (the queue's reduction.many) is its part

    def clocked(fn, key):
        def f(*a, **k):
            if inside[0]:
                return fn(*a, **k)
            inside[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clocks[key][0] += time.perf_counter() - t0
                clocks[key][1] += 1
                inside[0] -= 1
        return f
    for _ in range(n + 1):
        t0 = time.perf_counter()
        step(model, tokens)
        t1 = time.perf_counter()
        cm = probe(model)
        run = cm.__enter__()
        t2 = time.perf_counter()
        s0 = run.seconds
        for (mod, name, fn), (_, _, key) in zip(real, timed):  # the hooks and the exit (clocks the pieces)
            setattr(mod, name, clocked(fn, key))
        try:
            step(model, tokens)
            t3 = time.perf_counter()
            hooks = run.seconds - s0
            cm.__exit__(None, None, None)
            t4 = time.perf_counter()
        finally:
            for mod, name, fn in real:
                setattr(mod, name, fn)
        run.stats  # noqa: B018 - the one transfer
        t5 = time.perf_counter()
        for k, v in (("bare", t1 - t0), ("entry", t2 - t1), ("hooks", hooks), ("torch", t3 - t2 - hooks),
                     ("exit", t4 - t3), ("stats", t5 - t4)):
            parts[k].append(v * 1e3)
    out = {k: statistics.median(v[1:]) for k, v in parts.items()}  # the first pass warms up
    for key, (secs, calls) in clocks.items():  # means over all passes (the pieces are clocked, so slower)
        out[f"{key} ({calls // (n + 1)} calls)"] = secs * 1e3 / (n + 1)
    return out


def floor(parts: dict[str, float]) -> float:
    """probed/bare with the probe's arithmetic taken out: 1 + (entry + hooks + torch - bare + exit
    + stats - the clocked reductions) / bare. The clocked pieces include the Python around each
    kernel call, so this is a lower bound on what the probe's machinery (hooks, walks, records)
    costs on its own, whatever its reductions cost."""
    own = sum(parts[k] for k in ("entry", "hooks", "torch", "exit", "stats")) - parts["bare"]
    arithmetic = sum(v for k, v in parts.items() if k.endswith(" calls)"))
    return 1 + (own - arithmetic) / parts["bare"]


def switched_pairs(model, tokens, n: int, owner, name: str, off, seed: int) -> list[tuple[float, float]]:
    """(CPU seconds with ``owner.name`` as it is, with it replaced by ``off``) of one probed pass
    each, over ``n`` interleaved pairs (order by a seeded coin) after a warm-up of each, the same
    tree and process. CPU time of this thread (``time.thread_time``): what preemption on a
    loaded machine does not move."""
    from diagnostics import probe

    real = getattr(owner, name)

    def run(on: bool) -> float:
        if not on:
            setattr(owner, name, off)
        try:
            c0 = time.thread_time()
            with probe(model) as r:
                step(model, tokens)
            r.stats  # noqa: B018 - the one transfer
            return time.thread_time() - c0
        finally:
            setattr(owner, name, real)
    run(True), run(False)
    rng, out = random.Random(seed), []
    for _ in range(n):
        got = {}
        for on in ((True, False) if rng.random() < 0.5 else (False, True)):
            got[on] = run(on)
        out.append((got[True], got[False]))
    return out


def queue_pairs(model, tokens, n: int) -> tuple[float, list[float], float, float]:
    """The probe's queue on against every request reduced in its hook (``ProbeRun._plain`` always
    False): (median over ``n`` interleaved pairs of the queue's CPU time / the other's, the
    ratios, the median CPU ms of each) (:func:`switched_pairs`)."""
    from diagnostics.measure.probe import ProbeRun

    got = switched_pairs(model, tokens, n, ProbeRun, "_plain", lambda self, kind, t, key: False, 1)
    ratios = [q / h for q, h in got]
    return (statistics.median(ratios), ratios, statistics.median(q for q, _ in got) * 1e3,
            statistics.median(h for _, h in got) * 1e3)


def rows_pairs(model, tokens, n: int) -> tuple[float, float, float]:
    """The queue's requests with rows (:mod:`diagnostics.measure.pending_rows`) against those
    requests reduced in their hooks (``Pending.takes_rows`` always False: the probe before the
    queue took them): (median over ``n`` interleaved pairs of the difference in CPU ms per probed
    pass, the queued's / the other's CPU time, the other's ms) (:func:`switched_pairs`)."""
    from diagnostics.measure.pending import Pending

    got = switched_pairs(model, tokens, n, Pending, "takes_rows", lambda self, x: False, 2)
    return (statistics.median((h - q) * 1e3 for q, h in got), statistics.median(q / h for q, h in got),
            statistics.median(h * 1e3 for _, h in got))


def compiled_calls(fn, *args) -> int:
    """How many compiled graphs one ``fn(*args)`` runs (inductor's ``CompiledFxGraph`` calls): on a
    GPU each is a host-side wrapper and one or a few kernel launches, whatever the arithmetic, so
    under ``TINYLM_REDUCER=cuda`` this count is the launch-bound cost the CPU's time cannot show
    (the CPU runs the compiled float64 reductions' arithmetic, which a GPU does in microseconds)."""
    from torch._inductor import output_code

    cls, calls = output_code.CompiledFxGraph, [0]
    real = cls.__call__

    def call(self, *a, **k):
        calls[0] += 1
        return real(self, *a, **k)
    cls.__call__ = call
    try:
        fn(*args)
    finally:
        cls.__call__ = real
    return calls[0]


def sdpa_inner_ops(fn, *args) -> tuple[int, int]:
    """(calls of the SDPA summary ops, aten ops their kernels dispatch) in one ``fn(*args)``: a
    registered op counts once in :class:`~diagnostics.measure.opcount.OpCount`, but on a GPU each
    op its kernel dispatches is a launch. Each ``tinylm::sdpa_summaries`` / ``sdpa_summary`` call
    is captured, then its kernel run again on the same arguments under a counter."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from diagnostics.measure import sdpa
    from diagnostics.measure.opcount import OpCount

    kernels = {op: getattr(sdpa, fn) for op, fn in (("sdpa_summaries", "_summaries_kernel"),
                                                     ("sdpa_summary", "_summary_kernel")) if hasattr(sdpa, fn)}
    seen = []

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in kernels:
                seen.append((name, args, kwargs or {}))
            return func(*args, **(kwargs or {}))
    with Capture():
        fn(*args)
    with OpCount() as ops:
        for name, a, k in seen:
            kernels[name](*a, **k)
    return len(seen), ops.total


def count(fn, *args):
    from diagnostics.measure.opcount import OpCount

    with OpCount() as ops:
        got = fn(*args, counter=ops) if fn is probed else fn(*args)
    return ops, got


def watch_pair(model, tokens, figures: bool = False):
    """(plain step, recorded watch step) callables on ``model`` with SGD (``Watch(every=1)``:
    every step recorded; ``figures``: ``optimizer=`` the SGD too, its figures measured); both
    take the loss to the host once, as a training loop logs it."""
    import torch

    import tinylm
    from diagnostics import Watch

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    watch = Watch(model, every=1, optimizer=opt if figures else None)
    t = [0]

    def loss_of():
        out = model(tokens[:, :-1])
        logits = out if not hasattr(out, "logits") else out.logits
        loss = tinylm.functional.cross_entropy(logits, tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def plain():
        float(loss_of().detach())

    def watched():
        with watch.step(t[0]):
            loss = loss_of()
        watch.record(loss)
        t[0] += 1

    def captured():
        with watch.capture():
            loss = loss_of()
        float(loss.detach())
    watched.captured = captured
    return plain, watched, watch


def timed_pairs(a, b, n: int, seed: int = 0) -> tuple[list[float], list[float], list[float]]:
    """(b/a ratios, a's seconds, b's seconds) of ``n`` interleaved pairs (order by a seeded coin),
    after one warm-up each."""
    a(), b()
    rng, ratios, ta, tb = random.Random(seed), [], [], []
    for _ in range(n):
        times = {}
        for which in (("a", "b") if rng.random() < 0.5 else ("b", "a")):
            t0 = time.perf_counter()
            (a if which == "a" else b)()
            times[which] = time.perf_counter() - t0
        ratios.append(times["b"] / times["a"])
        ta.append(times["a"])
        tb.append(times["b"])
    return ratios, ta, tb


def pairs(a, b, n: int, seed: int = 0) -> tuple[float, list[float]]:
    """Median of b/a over ``n`` interleaved pairs (:func:`timed_pairs`), and the ratios."""
    ratios = timed_pairs(a, b, n, seed)[0]
    return statistics.median(ratios), ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reducer", default="cuda,auto")
    ap.add_argument("--models", default="tinylm,gpt2")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--no-watch", action="store_true")
    ap.add_argument("--breakdown", type=int, default=0, metavar="N",
                    help="also the probe's own parts (entry, hooks, exit, stats), medians of N passes")
    ap.add_argument("--queue", type=int, default=0, metavar="N",
                    help="also N interleaved pairs of the probe with its queue and without (CPU time)")
    ap.add_argument("--rows", type=int, default=0, metavar="N",
                    help="also N interleaved pairs of the requests with rows queued and in their hooks (CPU time)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    nets, tokens = models()
    print(f"shape {SHAPE}, threads {args.threads}, load {os.getloadavg()[0]:.1f}")
    bare_builtin = count(step, nets["builtin"], tokens)[0].total
    for name in args.models.split(","):
        model = nets[name]
        bare = count(step, model, tokens)[0]
        extra = f" (BuiltinLM {bare_builtin}, ratio {bare.total / bare_builtin:.3f})" if name == "tinylm" else ""
        print(f"\n{name}: bare ops {bare.total}{extra}; host reads bare {bare.host_reads}")
        if name == "tinylm":
            med, ratios = pairs(lambda: step(nets["builtin"], tokens), lambda: step(model, tokens), args.pairs)
            print(f"  bare time tinylm/BuiltinLM: median {med:.3f} over {len(ratios)} pairs "
                  f"(range {min(ratios):.3f}-{max(ratios):.3f})")
        for reducer in args.reducer.split(","):
            os.environ["TINYLM_REDUCER"] = reducer
            probed(model, tokens)  # builds what the reducer compiles, outside the count
            ops, inside = count(probed, model, tokens)
            added = ops.counts - bare.counts
            print(f"  TINYLM_REDUCER={reducer}: probed ops {ops.total} ({ops.total / bare.total:.2f}x); "
                  f"host reads inside forward+backward {sum(inside.values())} {inside or ''}; "
                  f"all host reads {ops.host_reads}")
            print("    added: " + ", ".join(f"{k} {v}" for k, v in added.most_common(args.top)))
            print(f"    compiled calls per probed pass: {compiled_calls(probed, model, tokens)}")
            calls, inner = sdpa_inner_ops(probed, model, tokens) if reducer == "cuda" else (0, 0)
            if calls:
                print(f"    SDPA summary ops per probed pass: {calls}, dispatching {inner} aten ops inside (launches on a GPU)")
            med, ratios = pairs(lambda: step(model, tokens), lambda: probed(model, tokens), args.pairs)
            print(f"    time probed/bare: median {med:.2f} over {len(ratios)} pairs "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f})")
            if args.queue:
                med, ratios, q, i = queue_pairs(model, tokens, args.queue)
                print(f"    CPU time with the queue / every request reduced in its hook: median {med:.3f} over "
                      f"{len(ratios)} pairs (range {min(ratios):.3f}-{max(ratios):.3f}); {q:.1f} / {i:.1f} ms")
            if args.rows:
                saved, ratio, hooked = rows_pairs(model, tokens, args.rows)
                print(f"    CPU time with the requests with rows queued / reduced in their hooks: median {ratio:.3f} "
                      f"over {args.rows} pairs; {saved:.2f} ms less per pass (of {hooked:.1f} ms)")
            if args.breakdown:
                b = breakdown(model, tokens, args.breakdown)
                print("    probe's parts (ms, median of %d): " % args.breakdown
                      + ", ".join(f"{k} {v:.1f}" for k, v in b.items()))
                print(f"    the probe's machinery alone (its reductions taken out), probed/bare at least {floor(b):.2f}")
            if not args.no_watch:
                plain, watched, watch = watch_pair(model, tokens)
                med, ratios = pairs(plain, watched, args.pairs)
                wops = count(watched)[0].total
                pops = count(plain)[0].total
                print(f"    watch step recorded/plain: time median {med:.2f} "
                      f"(range {min(ratios):.2f}-{max(ratios):.2f}); ops {wops} / {pops} = {wops / pops:.2f}x")
                pmed, pratios = pairs(watched.captured, watched, args.pairs)
                cops = count(watched.captured)[0].total
                print(f"      its probe alone / plain: ops {cops / pops:.2f}x; recorded / its probe alone: time median "
                      f"{pmed:.2f} (range {min(pratios):.2f}-{max(pratios):.2f}), ops {wops - cops} more")
                watch.close()
                _, measured, watch = watch_pair(model, tokens, figures=True)
                measured(), measured()
                mops = count(measured)[0].total
                print(f"      with the optimizer's figures (Watch(optimizer=opt)): ops {mops} / {pops} = {mops / pops:.2f}x")
                watch.close() if hasattr(watch, "close") else None
    os.environ.pop("TINYLM_REDUCER", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
