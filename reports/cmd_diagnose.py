"""Measure per-layer activation and gradient variance against theory and say whether the model is healthy.

``diagnose [CHECKPOINT]`` (also ``tinylm diagnose``). With no checkpoint: a
freshly initialised default model (``tinystories`` preset, ``cs336`` init,
seed 0). Exit codes: 0 healthy (or no ``--check``), 1 with ``--check`` a finding
that fails (``--check=warn``: any finding, warnings too), 2 bad input or usage, 5 with
``--check`` a model that could not be judged (neither its residual stream nor its loss).
"""

from __future__ import annotations

import argparse
import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cli import EXIT_FINDINGS, EXIT_OK, UsageError
from .intake import (check_device_name, check_input_file, check_model_path, check_outputs, check_suffixes, load_model,
                     measured_tokens, memory_check, parse_dtype, positive_int, report_width, resolve_device)
from .progress import progress_bar

# Defaults sized so that the no-argument run (the README Quickstart's main job)
# stays short on two CPU cores: four independent one-sequence batches give the
# replicates of every 99% interval (3 degrees of freedom) at the cost of about
# two bare forward+backward passes of a 2 x 256 batch.
DEFAULT_BATCH_SIZE, DEFAULT_BATCHES, DEFAULT_SEEDS = 1, 4, 1
EXPORT_WIDTH = 120  # columns of an --html or --svg report, at least
#: --check: nothing that says whether the model trains could be judged (DiagnoseResult.status
#: "not judged"); distinct from 1 (findings), so that CI does not read "unjudged" as "broken" or "fine"
EXIT_NOT_JUDGED = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="a tinylm, CS336 (bare or training) state dict, or .safetensors file, or a local Hugging "
                        "Face save_pretrained directory; "
                        "none: a fresh tinystories-preset model (cs336 init, seed 0)")
    g = p.add_argument_group("model (where the checkpoint has no config)")
    g.add_argument("--num-heads", type=positive_int, help="attention heads")
    g.add_argument("--rope-theta", type=float, help="RoPE base theta")
    g.add_argument("--context-length", type=positive_int, help="longest sequence the model takes")
    g.add_argument("--unsafe-load", action="store_true",
                   help="allow a whole pickled model (runs code from the file: only for files you trust)")
    g = p.add_argument_group("measurement")
    g.add_argument("--data", metavar="PATH", help="token file: .npy, .bin (uint16, CS336) or .txt (bytes); default: the "
                   "data a tinylm train checkpoint recorded, else uniform random tokens")
    g.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE, help=f"sequences per batch (default {DEFAULT_BATCH_SIZE})")
    g.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the context length; "
                   "at most 1024 for a model read through transformers)")
    g.add_argument("--batches", type=positive_int, default=DEFAULT_BATCHES, help=f"batches per seed (default {DEFAULT_BATCHES})")
    g.add_argument("--seeds", type=positive_int,
                   help="fresh model only: re-initialise N copies (seeds --seed..--seed+N-1) as replicates, so "
                        "that the 99%% intervals cover the weight draw, not only batch noise "
                        f"(default {DEFAULT_SEEDS}: replicates are --batches of one draw)")
    g.add_argument("--seed", type=int, default=0, help="base seed of the tokens (and of the fresh model) (default 0)")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available, else cpu)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="model dtype; statistics always accumulate in float64 (default: the dtype the "
                        "checkpoint is stored in, float32 for a fresh model or one stored in another dtype)")
    g.add_argument("--theory", default="auto", choices=["auto", "local", "global", "off", "none"],
                   metavar="{auto,local,global,off}",
                   help="prediction mode: global (from the init scheme; fresh models), local (from the measured "
                        "inputs of each layer), auto chooses, off measures only (no predictions; 'none' is an "
                        "alias) (default auto)")
    g = p.add_argument_group("output")
    g.add_argument("--check", nargs="?", const="fail", metavar="LEVEL",
                   help="exit 1 on a finding that fails (for CI); --check=warn: on warnings too")
    g.add_argument("--json", metavar="PATH", help="write the result (versioned schema) as JSON")
    g.add_argument("--csv", metavar="PATH",
                   help="write the tidy rows (one per tensor, direction and statistic; run = the checkpoint) as CSV")
    g.add_argument("--html", metavar="PATH", help="write the rendered report as HTML")
    g.add_argument("--svg", metavar="PATH", help="write the rendered report as SVG")
    g.add_argument("--plot", metavar="PATH", help="write a PNG of variance over depth (forward and backward); for a checkpoint with "
                   "a training history also PATH's stem + .training.png beside it (same rules)")
    g.add_argument("--all", action="store_true", help="every instrumented tensor in the per-layer table, not the summary")
    g.add_argument("--width", type=report_width, help="report width in columns (default: the terminal's)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _outputs(args: argparse.Namespace) -> dict[str, str | None]:
    return {"--json": args.json, "--csv": args.csv, "--html": args.html, "--svg": args.svg, "--plot": args.plot}


def _seeds(args: argparse.Namespace, fresh: bool) -> int:
    if args.seeds is not None:
        if args.seeds > 1 and not fresh:
            raise UsageError(f"--seeds {args.seeds} re-initialises the model, which would discard the checkpoint's "
                             "weights; a checkpoint is measured as it is: use --batches N for replicates")
        return args.seeds
    return DEFAULT_SEEDS


def _watch_view(history: Any) -> Any:
    """``reports.watch_view`` when the checkpoint holds a training history and that module is there, else None."""
    if not history:
        return None
    try:
        from . import watch_view
    except ImportError:
        return None
    return watch_view


def _training_plot_path(plot: str) -> Path:
    """Beside ``--plot report.png``: ``report.training.png`` for the "during training" figure."""
    p = Path(plot)
    return p.with_name(f"{p.stem}.training{p.suffix or '.png'}")


def _check_level(args: argparse.Namespace) -> str | None:
    """``--check`` as "fail" or "warn" (None: not given). A bare ``--check`` written before the
    checkpoint takes the checkpoint as its value; that value is given back to the checkpoint."""
    level = args.check
    if level is None or level in ("fail", "warn"):
        return level
    if args.checkpoint is None and not level.startswith("-"):
        args.checkpoint, args.check = level, "fail"
        return "fail"
    raise UsageError(f"--check {level}: the level must be 'fail' or 'warn'; use --check or --check=warn")


def _all_outputs(args: argparse.Namespace) -> dict[str, str | None]:
    outputs = _outputs(args)
    if args.plot:
        outputs["--plot (training history)"] = str(_training_plot_path(args.plot))
    return outputs


def check(args: argparse.Namespace) -> None:
    """Every flag that can be checked without torch: inputs exist, outputs are writable and
    of a known kind, the device is spelled right, --seeds suits the model."""
    _check_level(args)  # first: a bare --check before the checkpoint gives the checkpoint back
    check_model_path("checkpoint", args.checkpoint)
    check_input_file("--data", args.data)
    check_outputs(_all_outputs(args), {"checkpoint": args.checkpoint, "--data file": args.data})
    check_suffixes(_outputs(args))
    check_device_name(args.device)
    _seeds(args, fresh=args.checkpoint is None)


#: the default --seq-len of a model that is not tinylm's (read through transformers)
OTHER_SEQ_LEN = 1024


@dataclass
class _Inputs:
    """Everything read before measuring: the model and where it came from, the device and dtype, the
    sequence length, the seeds, the tokens and the words for them, the checkpoint's training
    history (None: none, or one that cannot be drawn), and the dtype with why (for the header)."""

    source: Any
    device: Any
    dtype: Any
    seq_len: int
    seeds: int
    tokens: Any
    data_text: str
    history: Any
    dtype_text: str = "float32"


def run(args: argparse.Namespace) -> int:
    """Gather the inputs, call :func:`diagnostics.diagnose` once, then draw and write the result."""
    check(args)  # also when run() is called without the command line's main()
    level = _check_level(args)
    inputs = _gather(args)
    result = _described(_diagnose(inputs, args), inputs)
    doc = _document(result, inputs, args)
    _write(result, doc, inputs, args)
    unhealthy = bool(result.failures) or bool(inputs.source.nonfinite) or (level == "warn" and bool(result.findings))
    if level and unhealthy:
        return EXIT_FINDINGS
    return EXIT_NOT_JUDGED if (level and result.status == "not judged") else EXIT_OK


def _gather(args: argparse.Namespace) -> _Inputs:
    """The model (loaded, its size checked, moved to the device), the tokens, and the checkpoint's
    training history (a damaged one is skipped, with a note on stderr)."""
    from rich.console import Console

    from diagnostics.jobs import check_history

    device = resolve_device(args.device)
    source = load_model(args.checkpoint, num_heads=args.num_heads, rope_theta=args.rope_theta,
                        context_length=args.context_length, unsafe=args.unsafe_load, seed=args.seed,
                        check=memory_check(args.batch_size, args.seq_len,
                                                  parse_dtype(args.dtype) if args.dtype else None))
    import tinylm

    model = source.model
    own = isinstance(model, tinylm.TransformerLM)
    context = source.context_length
    # tinylm's own models are measured at their full context; another architecture (read through
    # transformers) at its context up to 1024 tokens, its full one only when asked
    default = context if own else min(context or OTHER_SEQ_LEN, OTHER_SEQ_LEN)
    seq_len = args.seq_len if args.seq_len is not None else default
    if context is not None and seq_len > context:
        raise UsageError(f"--seq-len {seq_len} is above the model's context length {context}; "
                         f"use --seq-len {context} or less")
    if seq_len < 2:
        raise UsageError(f"--seq-len {seq_len}: need at least 2 tokens to score a next token")
    dtype, dtype_text = _measured_dtype(args.dtype, source)
    seeds = _seeds(args, source.fresh)
    tokens, data_text = measured_tokens(args.data, source, seq_len)
    if own:
        from tinylm.memory import check_fits

        check_fits(model.config, args.batch_size, seq_len, dtype)  # estimate before allocating: one line if too big
    model.to(device=device, dtype=dtype)
    history, problem = check_history(source.history)
    if problem:
        Console(stderr=True, highlight=False).print(f"note: the checkpoint's training history is skipped ({problem})")
    source.history = history
    return _Inputs(source, device, dtype, seq_len, seeds, tokens, data_text, history, dtype_text)


def _measured_dtype(flag: str | None, source: Any) -> tuple[Any, str]:
    """(the dtype the model is measured in, that dtype with why, for the header): ``--dtype`` when
    given; else the dtype the checkpoint stores its weights in (a directory: config.json's or the
    safetensors'), when it is one that can be measured; else float32."""
    if flag is not None:
        return parse_dtype(flag), f"{flag} (--dtype)"
    floats = [p.dtype for p in source.model.parameters() if p.is_floating_point()]
    stored = str(floats[0]).removeprefix("torch.") if floats else None
    if source.fresh or stored is None:
        return parse_dtype("float32"), "float32 (default)"
    try:
        return parse_dtype(stored), f"{stored} (stored)"
    except UsageError:
        return parse_dtype("float32"), f"float32 (stored {stored}, measured in float32; --dtype to choose)"


def _diagnose(inputs: _Inputs, args: argparse.Namespace) -> Any:
    """The one library call, with a progress bar on stderr."""
    from diagnostics import DiagnoseOptions, diagnose

    with progress_bar("diagnose", enabled=False if args.no_progress else None) as update:
        options = DiagnoseOptions(batch_size=args.batch_size, seq_len=inputs.seq_len, batches=args.batches,
                                  seeds=inputs.seeds, seed=args.seed, theory=args.theory, progress=update)
        return diagnose(inputs.source.model, inputs.tokens, options)


def _described(result: Any, inputs: _Inputs) -> Any:
    """The result with what the command line knows in its header (where the model and the tokens came
    from, why this dtype), so that every fact of the text header is in the JSON document too."""
    import dataclasses

    note = inputs.dtype_text.partition(" (")[2].removesuffix(")")
    result.header = dataclasses.replace(result.header, source=inputs.source.description, data=inputs.data_text,
                                        dtype_note=note)
    return result


def _document(result: Any, inputs: _Inputs, args: argparse.Namespace) -> Any:
    """The report: the result drawn, with the training history's panel when the checkpoint holds one."""
    from .render import ReportContext, report

    source = inputs.source
    ctx = ReportContext(nonfinite_params=source.nonfinite, all_tensors=args.all)  # the rest is in the header
    watch_view = _watch_view(inputs.history)
    return report(result, ctx, extra=[watch_view.render_history(inputs.history)] if watch_view else [])


def _write(result: Any, doc: Any, inputs: _Inputs, args: argparse.Namespace) -> None:
    """The report on the terminal, then each file asked for, and one line on stderr naming them."""
    from rich.console import Console

    from . import export

    outputs = _all_outputs(args)
    Console(width=args.width, highlight=False).print(doc)
    if args.html or args.svg:  # exports are laid out for a wide page whatever the terminal's width
        export_console = Console(width=max(args.width or 0, EXPORT_WIDTH), record=True, highlight=False,
                                 file=io.StringIO(), color_system="truecolor")
        export_console.print(doc)
    if args.json:
        export.write_json(args.json, result)
    if args.csv:
        export.write_csv(args.csv, result.to_frame(run=args.checkpoint))
    if args.html:
        export.write_console(args.html, export_console, "html")
    if args.svg:
        export.write_console(args.svg, export_console, "svg")
    if args.plot:
        _write_plots(result, inputs, args, outputs)
    written = [f"{flag[2:]} {path}" for flag, path in outputs.items() if path]
    if written:
        print(f"wrote {', '.join(written)}", file=sys.stderr)


def _write_plots(result: Any, inputs: _Inputs, args: argparse.Namespace, outputs: dict[str, str | None]) -> None:
    """--plot: variance over depth, and beside it the training history's figure when there is one."""
    import matplotlib.pyplot as plt

    from . import export
    from .plots import depth_figure

    fig = depth_figure(result)
    try:
        export.write_figure(args.plot, fig)
    finally:
        plt.close(fig)
    watch_view = _watch_view(inputs.history)
    if watch_view:
        derived = str(_training_plot_path(args.plot))
        path = export.free_path(derived)  # a file the user has there is never replaced
        if path != derived:
            print(f"note: {derived} exists and is kept; the training-history figure goes to {path}", file=sys.stderr)
            outputs["--plot (training history)"] = path
        watch_view.plot_history(inputs.history, path)
    else:
        outputs.pop("--plot (training history)", None)
