"""Train a small model while watching per-layer statistics (tinylm train).

``tinylm train --preset tiny -o model.pt`` trains (60 steps by default) on the built-in
corpus (the Python standard library's source, as bytes); ``--data`` takes a
.npy/.bin (uint16) token file or a .txt file. Every ``--watch-every`` steps the
watch records per-layer moments into the checkpoint's history, which
``tinylm diagnose model.pt`` draws as its "during training" panel.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli import EXIT_NONFINITE, EXIT_OK, PRESET_NAMES, SCHEME_NAMES, UsageError, choose
from .intake import check_input_file, check_outputs, check_suffixes

# Hyper-parameter flags: default None so that a resumed run keeps the stored value unless the flag is given.
_TRAIN_FLAGS = {
    "steps": (int, "total optimizer steps (default 60; a resumed run continues up to this number)"),
    "batch_size": (int, "sequences per step (default 32)"),
    "lr": (float, "peak learning rate after warmup (default 3e-3)"),
    "min_lr": (float, "floor of the cosine decay (default lr/10)"),
    "warmup": (int, "linear warmup steps (default min(100, steps/10))"),
    "weight_decay": (float, "AdamW weight decay (default 0.1)"),
    "clip": (float, "maximum global gradient norm, 0 disables clipping (default 1.0)"),
    "watch_every": (int, "record the watch every K steps, 0 turns it off (default 25)"),
    "spike_factor": (float, "a loss above this multiple of the running loss is a spike (default 1.5)"),
    "checkpoint_every": (int, "also save the checkpoint every N steps (default 0: at the end only)"),
    "z_loss": (float, "coefficient C of the z-loss C mean (log Z)^2 added to the cross-entropy; the loss shown "
                      "stays the cross-entropy (default 0: off; PaLM uses 1e-4)"),
}
_MODEL_FLAGS = ("norm", "ffn", "d_model", "d_ff", "num_layers", "num_heads", "context_length", "vocab_size", "qk_norm",
                "parametrization", "mup_base_width")
DEFAULT_STEPS = 60


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help=f"model sizes: {', '.join(PRESET_NAMES)} (default tiny)")
    p.add_argument("--init", help=f"init scheme: {', '.join(SCHEME_NAMES)} (default cs336)")
    p.add_argument("--data", help="token file: .npy or .bin (uint16 ids) or .txt (bytes); default: the built-in corpus")
    p.add_argument("-o", "--output", required=True, help="where to write the checkpoint (.pt)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument("--resume", metavar="PATH", help="continue from a checkpoint written by tinylm train")
    p.add_argument("--seed", type=int, help="seed of the init draws and the batch sampler (default 0)")
    for name, (kind, text) in _TRAIN_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, help=text)
    p.add_argument("--norm", choices=["pre", "post", "none"], help="norm placement (default: the preset's, pre)")
    p.add_argument("--ffn", choices=["swiglu", "silu"], help="feed-forward kind (default swiglu)")
    p.add_argument("--qk-norm", choices=["none", "rms", "layer"],
                   help="normalise each head's queries and keys before RoPE (default none)")
    p.add_argument("--parametrization", choices=["sp", "mup"],
                   help="sp (standard, default) or mup (muP: per-width multipliers and learning rates)")
    p.add_argument("--mup-base-width", type=int,
                   help="the base d_model of --parametrization mup (default: the preset's d_model)")
    p.add_argument("--d-model", type=int, help="override the preset's width (d_ff follows as 8/3 d unless --d-ff)")
    p.add_argument("--d-ff", type=int, help="override the feed-forward width")
    p.add_argument("--num-layers", type=int, help="override the preset's number of blocks")
    p.add_argument("--num-heads", type=int, help="override the preset's number of heads")
    p.add_argument("--context-length", type=int, help="override the preset's context length (the training window)")
    p.add_argument("--vocab-size", type=int, help="override the preset's vocabulary (>= 256 for byte data)")
    p.add_argument("--watch-json", metavar="PATH", help="also write the watch history as JSON")
    p.add_argument("--watch-csv", metavar="PATH",
                   help="also write the watch history as CSV rows of the tidy result schema (as diagnose --csv)")
    p.add_argument("--quiet", action="store_true", help="no progress display, only the summary")


def _build_model(args: argparse.Namespace):
    import torch

    from tinylm import TransformerLM, default_d_ff, preset
    from tinylm.init import get

    init = args.init or "cs336"
    get(init)  # unknown scheme: a clear error before any work
    changes = {"init": init}
    for name in _MODEL_FLAGS:
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if "d_model" in changes and "d_ff" not in changes:
        changes["d_ff"] = default_d_ff(changes["d_model"])
    if changes.get("parametrization") == "mup":
        changes.setdefault("mup_base_width", preset(args.preset or "tiny").d_model)
    config = preset(args.preset or "tiny", **changes)
    return TransformerLM(config, generator=torch.Generator().manual_seed(args.seed or 0))


def _load_data(args: argparse.Namespace, vocab_size: int):
    from tinylm.data import DataError, load_tokens, stdlib_corpus

    if args.data is not None:
        return load_tokens(args.data, vocab_size), str(args.data)
    if vocab_size < 256:
        raise DataError(f"the built-in corpus is bytes (ids 0..255) but vocab_size={vocab_size}; "
                        "use --vocab-size 256 or more, or pass --data with your own token file")
    return stdlib_corpus(), "the built-in corpus (Python standard library source, as bytes)"


def _options(args: argparse.Namespace, stored: dict | None):
    from tinylm.train import TrainOptions

    given = {name: getattr(args, name) for name in _TRAIN_FLAGS if getattr(args, name) is not None}
    if args.seed is not None:
        given["seed"] = args.seed
    if stored:
        return TrainOptions.from_dict(stored, **given)
    given.setdefault("steps", DEFAULT_STEPS)
    return TrainOptions(**given)


def _output_paths(args: argparse.Namespace) -> dict[str, str | None]:
    return {"-o": args.output, "--watch-json": args.watch_json, "--watch-csv": args.watch_csv}


def check(args: argparse.Namespace) -> None:
    """The flags, before torch is imported: preset, scheme, inputs, output paths."""
    from .cmd_init import check_checkpoint_suffix

    if args.preset is not None:
        choose("--preset", args.preset, PRESET_NAMES, "preset")
    if args.init is not None:
        choose("--init", args.init, SCHEME_NAMES, "init scheme")
    check_input_file("--data", args.data)
    check_input_file("--resume", args.resume)
    check_outputs(_output_paths(args), {"--data file": args.data, "--resume checkpoint": args.resume},
                  force=args.force, may_replace={"-o": "--resume checkpoint"})
    check_suffixes(_output_paths(args))
    check_checkpoint_suffix("-o", args.output)
    if args.output.endswith(".safetensors"):
        raise UsageError(f"-o {args.output}: a training checkpoint holds the optimizer state, which safetensors "
                         "cannot store; give a .pt path")


def run(args: argparse.Namespace) -> int:
    """Train; exit 0, or EXIT_NONFINITE (4) when the run stopped on a non-finite loss."""
    from rich.console import Console

    from diagnostics import History
    from diagnostics.integrations.writers import write_json
    from diagnostics.jobs import check_history, train_watched
    from tinylm.train import load_training

    out = Path(args.output)
    resume = None
    if args.resume is not None:
        shaped = [n for n in ("preset", "init", *_MODEL_FLAGS) if getattr(args, n) is not None]
        if shaped:
            flags = ", ".join("--" + n.replace("_", "-") for n in shaped)
            raise UsageError(f"{flags}: a resumed run keeps the checkpoint's model; drop these flags or start a new run")
        model, resume = load_training(args.resume)
        options = _options(args, resume.get("options"))
        if args.data is None and resume.get("data"):  # the run's own data, if it is still there
            if not Path(resume["data"]).is_file():
                raise UsageError(f"the checkpoint was trained on {resume['data']}, which is gone; pass --data")
            args.data = resume["data"]
    else:
        options = _options(args, None)
        model = _build_model(args)
    check_outputs({"-o": args.output, "--watch-json": args.watch_json, "--watch-csv": args.watch_csv},
                  {"--data file": args.data, "--resume checkpoint": args.resume}, force=args.force,
                  may_replace={"-o": "--resume checkpoint"})
    from tinylm.memory import check_fits

    check_fits(model.config, options.batch_size, model.config.context_length)  # before the first step allocates
    tokens, source = _load_data(args, model.config.vocab_size)

    console = Console(highlight=False, soft_wrap=True)
    c = model.config
    console.print(
        f"training {model.num_parameters():,} parameters (d={c.d_model}, L={c.num_layers}, H={c.num_heads}, "
        f"norm={c.norm}, V={c.vocab_size}, T={c.context_length}) on {source}: {len(tokens):,} tokens"
    )
    if resume is not None:
        console.print(f"resuming from {args.resume} at iteration {resume['iteration']}")
        _, problem = check_history(resume.get("history"))
        if problem:  # the watch starts a new history rather than build on a damaged one
            console.print(f"note: the checkpoint's training history is skipped ({problem}); the watch starts a new one")
    display = _Display(console, options.steps, quiet=args.quiet)
    with display:
        result = train_watched(model, tokens, options, output=out, resume=resume, on_step=display.step,
                               writers=[_Alerts(console)], data=None if args.data is None else str(Path(args.data).resolve()))
    history = History(result.history)  # its verdicts, judged once for the summary and the CSV
    _summary(console, result, history, options, out)
    from . import export

    writers = {"watch_json": lambda path: write_json(result.history, path),
               "watch_csv": lambda path: export.write_csv(path, history.to_frame(run=str(out)))}
    for flag, write in writers.items():
        target = getattr(args, flag)
        if target is not None:
            write(target)
            console.print(f"wrote the watch history to {target}")
    return EXIT_NONFINITE if result.stopped else EXIT_OK


class _Display:
    """A rich progress bar with step, loss, tokens/s, learning rate and gradient norm."""

    def __init__(self, console, steps: int, quiet: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.lines = not quiet and not console.is_terminal  # a pipe or a log file: plain lines
        self.progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=24),
            TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  lr {task.fields[lr]}  |g| {task.fields[gn]}"),
            TimeElapsedColumn(), console=console, transient=False, disable=quiet or self.lines,
        )
        self.task = self.progress.add_task("train", total=steps, loss="-", tps="-", lr="-", gn="-")
        self.last_print = 0

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def step(self, info) -> None:
        self.progress.update(self.task, completed=info.step, loss=f"{info.loss:.4f}", tps=f"{info.tokens_per_s:,.0f}",
                             lr=f"{info.lr:.2e}", gn=f"{info.grad_norm:.3g}")
        if self.lines and (info.step - self.last_print >= max(1, info.steps // 10) or info.step == info.steps):
            # no live display: a line every tenth of the run
            self.last_print = info.step
            self.console.print(f"step {info.step}/{info.steps}  loss {info.loss:.4f}  {info.tokens_per_s:,.0f} tok/s  "
                               f"lr {info.lr:.2e}  |g| {info.grad_norm:.3g}")



class _Alerts:
    """A watch writer (the five methods of diagnostics' ``WatchWriter``, and ``alert``) that prints
    each alert of the run (a spike's included, with its cause) as it comes."""

    def __init__(self, console):
        self.console = console

    def open(self, watch) -> None:
        pass

    def step(self, t, loss, lr, grad_norm) -> None:
        pass

    def record(self, record, verdicts) -> None:
        pass

    def event(self, event) -> None:
        pass  # its alert follows, with the cause

    def close(self) -> None:
        pass

    def alert(self, alert) -> None:
        color = "bold red" if alert.severity == "fail" else "yellow"
        self.console.print(f"[{color}]watch {alert.severity}:[/] {alert.message}", markup=True, highlight=False)


def _summary(console, result, history, options, out: Path) -> None:
    """The lines after a run: steps, time, loss, where it went, why it stopped, the watch's
    first verdict other than ok (``history``: the run's ``diagnostics.History``)."""
    from .fmt import verdict_text

    k, first, last = history.loss_summary()
    console.print(
        f"{result.iteration} steps, {result.seconds:.1f} s, {result.tokens_per_s:,.0f} tokens/s; "
        f"loss {first:.4f} -> {last:.4f} (mean of the first and last {k} steps); wrote {out}"
    )
    if result.stopped:
        console.print(f"[bold red]stopped:[/] {result.stopped}")
    dep = history.first_departure()
    if options.watch_every:
        if dep is None:
            console.print(f"watch: {len(result.history['records'])} records, every verdict ok")
        else:
            console.print(f"watch: first verdict other than ok at step {dep['step']}: {dep['site']} {verdict_text(dep['verdict'])} "
                          f"({dep['stat']} = {dep['value']:.3g})")
