"""Cost of a whole ``diagnose`` against one bare forward+backward of the same batch, in one process.

    python benchmarks/bench_diagnose.py [--preset gpt2-small] [--batch-size 4] [--seq-len 256] [--repeats 3]

Writes a ``gpt2-small``-preset checkpoint (cs336 init) to a temporary directory,
then times, on the same batch of random tokens:

  bare      one forward + next-token cross-entropy + backward of the loaded model;
  diagnose  ``diagnostics.diagnose`` (probe forward and backward, theory, verdicts,
            parameter statistics) on that batch, plus rendering the report;
  command   the whole ``tinylm diagnose CHECKPOINT`` command in-process (loading the
            checkpoint, the above, printing the report to a null console).

Each is the best of ``--repeats`` runs. Prints the times, the ratios diagnose/bare
and command/bare (target: diagnose/bare <= 3), the peak resident memory of the
process, and the number of threads torch used.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    import torch
    from rich.console import Console

    import tinylm
    from diagnostics import DiagnoseOptions, diagnose
    from reports.cli import main as cli_main
    from reports.render import ReportContext, report
    from tinylm import checkpoint
    from tinylm.functional import cross_entropy

    threads = torch.get_num_threads()
    config = tinylm.preset(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{args.preset}.pt")
        checkpoint.save(path, tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0)))
        model, _ = checkpoint.load(path)
        print(f"{args.preset}: {model.num_parameters():,} parameters; batch {args.batch_size} x {args.seq_len}; "
              f"torch threads {threads}; best of {args.repeats}", flush=True)
        tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1),
                               generator=torch.Generator().manual_seed(0))
        rss_loaded = _peak_rss_mib()

        def bare() -> None:
            logits = model(tokens[:, :-1])
            loss = cross_entropy(logits, tokens[:, 1:])
            loss.backward()
            model.zero_grad(set_to_none=True)

        options = DiagnoseOptions(batch_size=args.batch_size, seq_len=args.seq_len, batches=1, seeds=1)

        def diag() -> None:
            result = diagnose(model, tokens, options)
            Console(file=io.StringIO(), width=100).print(report(result, ReportContext()))

        def command() -> None:
            with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
                code = cli_main(["diagnose", path, "--batch-size", str(args.batch_size), "--seq-len",
                                 str(args.seq_len), "--batches", "1", "--no-progress", "--width", "100"])
            assert code == 0, f"diagnose exited {code}"

        bare()  # warm-up (allocator, kernels)
        t_bare = _best(bare, args.repeats)
        print(f"bare forward+backward : {t_bare:8.3f} s   (peak RSS {_peak_rss_mib():,.0f} MiB; "
              f"{rss_loaded:,.0f} MiB after loading)", flush=True)
        t_diag = _best(diag, args.repeats)
        print(f"diagnose + report     : {t_diag:8.3f} s   (peak RSS {_peak_rss_mib():,.0f} MiB)", flush=True)
        t_cmd = _best(command, max(1, args.repeats - 1))
    print(f"whole command (load)  : {t_cmd:8.3f} s   (peak RSS {_peak_rss_mib():,.0f} MiB)")
    print(f"ratio diagnose/bare   : {t_diag / t_bare:8.2f}   (target <= 3)")
    print(f"ratio command/bare    : {t_cmd / t_bare:8.2f}")
    print(f"threads               : torch {threads}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"cpus {os.cpu_count()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
