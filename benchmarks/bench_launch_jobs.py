"""``diagnose`` and ``diff`` in the launch-bound regime: each whole job against the bare passes it runs.

    python benchmarks/bench_launch_jobs.py [--pairs 5] [--threads 1] [--reducer auto,cuda] [--models tinylm,gpt2]
                                           [--jobs diagnose,diff]

The shape of ``bench_launch.py`` (d_model 64, 24 layers, 4 heads, T 32, batch 4, vocab 10000, one
thread by default), where every op costs its dispatch as it does on a GPU. Per model (tinylm's
``TransformerLM``, a Hugging Face GPT-2 of the same shape) and reducer (``TINYLM_REDUCER``):

* ``diagnose(model, options=DiagnoseOptions(batch_size=4, seq_len=32))``: its default four
  batches measured, theory (tinylm), verdicts and the result built, against four bare
  forward+backward passes of the same shape;
* ``diff(model, copy)`` (``DiffOptions(batch_size=4, seq_len=32)``): both models measured and
  compared site by site, against two bare passes (one of each model).

For each: the aten ops the whole job dispatches (``OpCount``, everything it does, its host-side
work and transfers included) against the bare passes', the host reads (``.item()``, ``.tolist()``,
``.cpu()`` and kin) of the whole job, the compiled graphs it runs (under ``cuda``: the launches
the CPU's time hides), and time job / bare in ``--pairs`` interleaved pairs (median of the
within-pair ratios; the machine is shared: pairs, not means). The job's own host work (theory,
judging, the result) is inside its time and its ops, as a user waits for it.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_launch import SHAPE, compiled_calls, models, pairs, step  # noqa: E402

#: the bare passes each job runs, in forward+backward passes of one model
BARE_PASSES = {"diagnose": 4, "diff": 2}


def job(name: str, model, twin, tokens):
    """(the job as a callable, the bare passes it stands against as a callable)."""
    from diagnostics import DiagnoseOptions, DiffOptions, diagnose, diff

    b, t = SHAPE["batch"], SHAPE["context_length"]
    if name == "diagnose":
        opts = DiagnoseOptions(batch_size=b, seq_len=t)

        def run():
            diagnose(model, options=opts)

        def bare():
            for _ in range(BARE_PASSES[name]):
                step(model, tokens)
        return run, bare
    opts = DiffOptions(batch_size=b, seq_len=t)

    def run():
        diff(model, twin, options=opts)

    def bare():
        step(model, tokens)
        step(twin, tokens)
    return run, bare


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reducer", default="auto,cuda")
    ap.add_argument("--models", default="tinylm,gpt2")
    ap.add_argument("--jobs", default="diagnose,diff")
    args = ap.parse_args(argv)
    import torch

    from diagnostics.measure.opcount import OpCount

    torch.set_num_threads(args.threads)
    nets, tokens = models()
    print(f"shape {SHAPE}, threads {args.threads}, load {os.getloadavg()[0]:.1f}")
    for name in args.models.split(","):
        model = nets[name]
        twin = copy.deepcopy(model)
        for reducer in args.reducer.split(","):
            os.environ["TINYLM_REDUCER"] = reducer
            for which in args.jobs.split(","):
                run, bare = job(which, model, twin, tokens)
                run()  # builds what the reducer compiles, outside the counts
                with OpCount() as bare_ops:
                    bare()
                with OpCount() as ops:
                    run()
                calls = compiled_calls(run)
                med, ratios = pairs(bare, run, args.pairs)
                print(f"{name}, TINYLM_REDUCER={reducer}, {which}: ops {ops.total} against {bare_ops.total} bare "
                      f"({BARE_PASSES[which]} passes) = {ops.total / bare_ops.total:.2f}x; host reads {ops.host_reads}; "
                      f"compiled calls {calls}; time {med:.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}, "
                      f"{len(ratios)} pairs)")
    os.environ.pop("TINYLM_REDUCER", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
