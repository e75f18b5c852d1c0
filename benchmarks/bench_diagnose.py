"""Cost of a whole ``diagnose`` against one bare forward+backward of the same tokens, interleaved in one process.

    python benchmarks/bench_diagnose.py [--preset gpt2-small] [--seq-len 256 1024] [--batch-size 1] [--batches 4]
                                        [--repeats 2] [--device cpu|cuda] [--command]

Builds a ``gpt2-small``-preset model (cs336 init, seed 0) and, for each ``--seq-len`` (default:
256 and the preset's full context), draws ``--batch-size`` x ``--batches`` sequences of random
tokens (the ``diagnose`` command's defaults: 4 batches of one sequence) and times, in pairs:

  bare      one forward + next-token cross-entropy + backward of all those sequences as one batch;
  diagnose  ``diagnostics.diagnose`` of the same sequences with the command's defaults (probe
            forward and backward of each batch, spectral statistics, theory, verdicts),
            plus rendering the report. The token-kernel theory's per-process cache is
            cleared first, so each run pays for the theory as a fresh ``diagnose`` does.

The two arms of a pair run back to back, in alternating order from pair to pair (a slow spell
of a shared machine hits both). Prints, per sequence length, each pair's times and ratio, the
median ratio diagnose/bare with the lowest and highest (the spread), the peak resident memory,
and the thread count. Target: the median at the full context <= 3. ``--command`` adds the whole
``tinylm diagnose CHECKPOINT`` command (loading a saved checkpoint, the report printed to a null
console; its own batches, so it reads other random tokens) once per sequence length.
``--device cuda`` runs the model and the probe on the GPU (timings synchronise the device).
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> int:
    from reports.cmd_diagnose import DEFAULT_BATCH_SIZE, DEFAULT_BATCHES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--seq-len", type=int, nargs="+", help="sequence lengths (default: 256 and the full context)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--batches", type=int, default=DEFAULT_BATCHES)
    p.add_argument("--repeats", type=int, default=2, help="pairs per sequence length (default 2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--command", action="store_true", help="also time the whole diagnose command once")
    args = p.parse_args(argv)

    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        print(f"--device {args.device}: not a device name; use cpu or cuda", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available on this machine (torch {torch.__version__}); "
              "run on a machine with a GPU, or use --device cpu", file=sys.stderr)
        return 2
    if device.type not in ("cpu", "cuda"):
        print(f"--device {args.device}: only cpu and cuda are supported", file=sys.stderr)
        return 2

    from rich.console import Console

    import tinylm
    from diagnostics import DiagnoseOptions, diagnose
    from diagnostics.theory.tokenkernel import clear_cache
    from reports.cli import main as cli_main
    from reports.render import ReportContext, report
    from tinylm import checkpoint
    from tinylm.functional import cross_entropy

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    threads = torch.get_num_threads()
    config = tinylm.preset(args.preset)
    seq_lens = args.seq_len or sorted({min(256, config.context_length), config.context_length})
    for T in seq_lens:
        if not 2 <= T <= config.context_length:
            print(f"--seq-len {T}: must be within 2..{config.context_length} (the preset's context)", file=sys.stderr)
            return 2
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(0)).to(device)
    n = args.batch_size * args.batches
    print(f"{args.preset}: {model.num_parameters():,} parameters on {device}; diagnose of {args.batches} batches "
          f"x {args.batch_size} sequences against one bare step of {n} sequences; {args.repeats} pairs per length",
          flush=True)

    summary = []
    for T in seq_lens:
        tokens = torch.randint(0, config.vocab_size, (n, T + 1), generator=torch.Generator().manual_seed(T)).to(device)

        def bare() -> None:
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            model.zero_grad(set_to_none=True)
            sync()

        def diag() -> None:
            clear_cache()
            result = diagnose(model, tokens, DiagnoseOptions(batch_size=args.batch_size, seq_len=T,
                                                             batches=args.batches))
            sync()
            Console(file=io.StringIO(), width=100).print(report(result, ReportContext()))

        bare()  # warm-up: the allocator at this size
        if not summary:
            diag()  # warm-up, once: the numba reducer loads (or compiles) on first use
        ratios = []
        for i in range(args.repeats):
            times = {}
            for name, fn in ((("bare", bare), ("diagnose", diag)) if i % 2 == 0 else (("diagnose", diag), ("bare", bare))):
                t0 = time.perf_counter()
                fn()
                times[name] = time.perf_counter() - t0
            ratios.append(times["diagnose"] / times["bare"])
            print(f"T {T:5d} pair {i + 1}: bare {times['bare']:8.2f} s, diagnose + report {times['diagnose']:8.2f} s, "
                  f"ratio {ratios[-1]:5.2f}", flush=True)
        line = (f"T {T:5d}: median ratio diagnose/bare {statistics.median(ratios):5.2f} "
                f"(spread {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} pairs; target <= 3 at the full "
                f"context); peak RSS {_peak_rss_mib():,.0f} MiB")
        if args.command:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, f"{args.preset}.pt")
                checkpoint.save(path, model)
                t0 = time.perf_counter()
                with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
                    code = cli_main(["diagnose", path, "--seq-len", str(T), "--batch-size", str(args.batch_size),
                                     "--batches", str(args.batches), "--device", str(device), "--no-progress",
                                     "--width", "100"])
                assert code == 0, f"diagnose exited {code}"
                line += f"; whole command {time.perf_counter() - t0:.1f} s"
        print(line, flush=True)
        summary.append(line)
    print("\n".join(summary))
    print(f"threads: torch {threads}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
