"""Compare init schemes side by side: loss at init, variance slope over depth, verdicts.

``tinylm compare`` builds, for every scheme x depth x width, fresh models from
several seeds, measures the residual stream's forward and backward variance
over depth (``diagnostics.compare`` does the computing) and prints one table.
The tokens are uniform random ones, or with ``--data PATH`` windows of a token
file (.npy, .bin uint16 as CS336 writes them, or .txt read as bytes; read-only),
which also feed the ``--steps`` training steps. The vocabulary is 256, or with
``--data`` the file's largest id + 1 when that is larger; ``--vocab-size`` fixes it
(and a file with an id outside it is refused). Exit codes: 0 done, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .intake import check_outputs, parse_int_list, positive_int, report_width
from .progress import progress_bar

DEFAULT_DEPTHS, DEFAULT_WIDTHS, DEFAULT_SEEDS = "2,8,32", "128", 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schemes", help="comma-separated init schemes (default: every registered scheme)")
    p.add_argument("--depths", default=DEFAULT_DEPTHS, help=f"numbers of blocks (default {DEFAULT_DEPTHS})")
    p.add_argument("--widths", default=DEFAULT_WIDTHS, help=f"d_model values (default {DEFAULT_WIDTHS})")
    p.add_argument("--seeds", type=positive_int, default=DEFAULT_SEEDS, help=f"models per cell, the source of the intervals (default {DEFAULT_SEEDS})")
    p.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    p.add_argument("--steps", type=int, default=0,
                   help="AdamW steps per model, to compare early loss: on the --data tokens, without --data on "
                        "the standard library's bytes (default 0)")
    p.add_argument("--data", metavar="PATH",
                   help="token file: .npy, .bin (uint16, CS336) or .txt (bytes); default uniform random tokens")
    p.add_argument("--vocab-size", type=positive_int,
                   help="vocabulary of the models (default 256, or with --data its largest id + 1 when larger)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG grid (schemes x direction) of variance over depth")
    p.add_argument("--csv", metavar="PATH", help="write the tidy frame as CSV")
    p.add_argument("--width", type=report_width, help="table width in columns (default: the terminal's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _tokens(data: str | None, vocab_size: int | None, seq_len: int) -> tuple[Any, int | None]:
    """The ``--data`` file's tokens (memory-mapped, never written) and the vocabulary for them; one-line errors."""
    if data is None:
        return None, vocab_size
    from diagnostics.jobs.compare import data_vocab
    from tinylm.data import load_tokens

    from .cli import UsageError

    tokens = load_tokens(data)
    vocab_size = data_vocab(tokens, vocab_size, f"--data {data}", name="--vocab-size")
    if len(tokens) < seq_len + 1:
        raise UsageError(f"--data {data}: {len(tokens)} tokens are fewer than the {seq_len + 1} of one "
                         f"sequence ({seq_len} inputs and the next token); use a file with at least "
                         f"{seq_len + 1} tokens")
    return tokens, vocab_size


def _schemes(text: str | None) -> list[str] | None:
    """``--schemes a,b`` as a list (None: every registered scheme)."""
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def check(args: argparse.Namespace) -> None:
    """The flags, before torch is imported: schemes, depths, widths, steps, paths."""
    from .cli import SCHEME_NAMES, UsageError, choose
    from .intake import check_input_file, check_suffixes

    for s in _schemes(args.schemes) or ():
        choose("--schemes", s, SCHEME_NAMES, "init scheme")
    parse_int_list(args.depths, "--depths")
    parse_int_list(args.widths, "--widths")
    if args.steps < 0:
        raise UsageError(f"--steps {args.steps}: must be 0 or more")
    check_input_file("--data", args.data)
    check_outputs({"--plot": args.plot, "--csv": args.csv}, {"--data file": args.data})
    check_suffixes({"--plot": args.plot, "--csv": args.csv})


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    import tinylm
    from diagnostics import CompareOptions, compare

    from . import export
    from .cli import UsageError
    from .render_compare import CompareTable

    if args.schemes:
        schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
        for s in schemes:
            tinylm.init.get(s)  # an unknown name: one line listing the registered ones
    else:
        schemes = list(tinylm.init.SCHEMES)
    depths = parse_int_list(args.depths, "--depths")
    widths = parse_int_list(args.widths, "--widths")
    if args.steps < 0:
        raise UsageError(f"--steps {args.steps}: must be 0 or more")
    check_outputs({"--plot": args.plot, "--csv": args.csv}, {"--data file": args.data})
    tokens, vocab_size = _tokens(args.data, args.vocab_size, CompareOptions.seq_len)
    with progress_bar("compare", enabled=False if args.no_progress else None) as update:
        options = CompareOptions(schemes=schemes, depths=depths, widths=widths, seeds=args.seeds, steps=args.steps,
                                 seed=args.seed, data=tokens, data_name=args.data, vocab_size=vocab_size,
                                 progress=update)
        tidy, summary = compare(options)
    console = Console(width=args.width, highlight=False)
    console.print(CompareTable(summary))
    if args.csv:
        export.write_csv(args.csv, tidy)
    if args.plot:
        import matplotlib.pyplot as plt

        from .plots import compare_figure

        fig = compare_figure(tidy, schemes)
        try:
            export.write_figure(args.plot, fig)
        finally:
            plt.close(fig)
    written = [f"{flag} {path}" for flag, path in (("csv", args.csv), ("plot", args.plot)) if path]
    if written:
        print(f"wrote {', '.join(written)}", file=sys.stderr)
    return 0
