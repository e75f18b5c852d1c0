"""Find where two executions of one model part ways: per-site departures against roundoff.

``tinylm diff A B`` compares two models (tinylm or CS336 checkpoints, .safetensors files, Hugging
Face save_pretrained directories) or fingerprint files (written by ``--save``; told by their
content, whatever their name) on the same
tokens, forward and backward; ``tinylm diff A --against VARIANT`` compares one model with a
variant of itself (compiled, bf16, fp16, cpu-threads, explicit-attention, float64). Exit codes: 0
(or, with ``--check``, every site within roundoff), 1 with ``--check`` a departure beyond its
tolerance, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli import EXIT_FINDINGS, EXIT_OK, UsageError, choose
from .intake import (check_device_name, check_input_file, check_model_path, check_outputs, check_suffixes,
                     is_fingerprint_file, load_model, load_token_stream, positive_int, resolve_device, report_width)

#: what --against offers (diagnostics.jobs.diff.VARIANTS, named here to check the flag before torch loads)
VARIANT_NAMES = ("compiled", "bf16", "fp16", "cpu-threads", "explicit-attention", "float64")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="the reference: a checkpoint, a save_pretrained directory or a fingerprint file")
    p.add_argument("b", metavar="B", nargs="?", help="the candidate (same kinds as A); or use --against")
    p.add_argument("--against", metavar="VARIANT",
                   help=f"compare A with a variant of itself: {', '.join(VARIANT_NAMES)}")
    p.add_argument("--transformers", action="store_true",
                   help="read save_pretrained directories through transformers (not mapped onto tinylm)")
    g = p.add_argument_group("measurement")
    g.add_argument("--data", metavar="PATH", help="token file (.npy, .bin, .txt); default: uniform random tokens")
    g.add_argument("--batch-size", type=positive_int, default=4, help="sequences (default 4)")
    g.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: min(context, 256))")
    g.add_argument("--seed", type=int, default=0, help="seed of the tokens (default 0)")
    g.add_argument("--k", type=positive_int, default=32, help="sketch size per axis (default 32)")
    g.add_argument("--device", help="cpu or cuda (default: cpu)")
    g.add_argument("--forward-only", action="store_true", help="compare the forward tensors only")
    g = p.add_argument_group("output")
    g.add_argument("--check", action="store_true", help="exit 1 when a departure exceeds its tolerance (for CI)")
    g.add_argument("--json", metavar="PATH", help="write the result as JSON")
    g.add_argument("--csv", metavar="PATH", help="write the tidy rows (site, direction, block, departure, ...) as CSV")
    g.add_argument("--save", metavar="PATH", help="write A's fingerprint (any name; .npz by custom) to compare on another machine")
    g.add_argument("--width", type=report_width, help="report width in columns (default: the terminal's)")


def _is_fingerprint(path: str | None) -> bool:
    """A fingerprint file, by its content (whatever its name)."""
    return is_fingerprint_file(path)


def check(args: argparse.Namespace) -> None:
    """Every flag that can be checked without torch: one candidate, inputs exist, outputs writable."""
    if args.against is not None:
        choose("--against", args.against, VARIANT_NAMES, "variant")
        if args.b is not None:
            raise UsageError(f"B ({args.b}) and --against {args.against} both name a candidate; give one of them")
        if _is_fingerprint(args.a):
            raise UsageError(f"--against {args.against}: A ({args.a}) is a fingerprint, which cannot be run again; "
                             "give a checkpoint or directory")
    elif args.b is None and args.save is None:
        raise UsageError("no candidate: give B (a second model or fingerprint) or --against VARIANT "
                         f"({', '.join(VARIANT_NAMES)}), or --save PATH to write A's fingerprint")
    for flag, value in (("A", args.a), ("B", args.b)):
        (check_input_file if _is_fingerprint(value) else check_model_path)(flag, value)
    check_input_file("--data", args.data)
    if args.save is not None and Path(args.save).is_file() and not _is_fingerprint(args.save):
        raise UsageError(f"--save {args.save}: exists and is not a fingerprint (--save replaces only a fingerprint); "
                         "choose another path")
    if args.save is not None and _is_fingerprint(args.a):
        raise UsageError(f"--save {args.save}: A ({args.a}) is already a fingerprint; drop --save")
    outputs = {"--json": args.json, "--csv": args.csv, "--save": args.save}
    check_outputs(outputs, {"A": args.a, "B": args.b, "--data file": args.data})
    check_suffixes(outputs)
    check_device_name(args.device)
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be 0 or more")


def _load(path: str, args: argparse.Namespace):
    """(a model or a Fingerprint, one line saying what it is)."""
    if _is_fingerprint(path):
        from diagnostics import Fingerprint

        return Fingerprint.load(path), f"fingerprint {path}"
    if args.transformers and Path(path).is_dir():
        from tinylm import hf

        try:
            import transformers
        except ImportError:
            raise UsageError(f"--transformers: transformers is not installed; {hf.INSTALL_HF}") from None
        hf.read_config(path)  # a directory and a readable config.json, or one line
        transformers.utils.logging.disable_progress_bar()  # a local read: no progress bar on stderr
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        return model.eval(), f"Hugging Face directory {path} (read through transformers)"
    source = load_model(path, command="diff")
    return source.model, source.description


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    check(args)
    from diagnostics import DiffOptions, diff, diff_against, fingerprint

    from . import export
    from .render_diff import report

    reference, ref_text = _load(args.a, args)
    candidate, cand_text = _load(args.b, args) if args.b is not None else (None, f"A as {args.against}")
    device = resolve_device(args.device or "cpu")
    for side in (reference, candidate):
        if hasattr(side, "to"):
            side.to(device)
    options = DiffOptions(batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed, k=args.k,
                          backward=not args.forward_only)
    tokens = None
    if args.data is not None:
        model = next((s for s in (reference, candidate) if hasattr(s, "to")), None)
        if model is not None:
            tokens = load_token_stream(args.data, int(model.config.vocab_size), args.seq_len or 256)
    if args.save is not None:
        reference = fingerprint(reference, tokens, options)
        reference.save(args.save)
        print(f"wrote fingerprint {args.save} ({Path(args.save).stat().st_size:,} bytes)", file=sys.stderr)
        if candidate is None and args.against is None:
            return EXIT_OK
    if args.against is not None:
        result = diff_against(reference, args.against, tokens, options)
    else:
        result = diff(reference, candidate, tokens, options)
    Console(width=args.width, highlight=False).print(report(result, ref_text, cand_text))
    if args.json:
        export.write_text(args.json, result.to_json() + "\n")
    if args.csv:
        export.write_csv(args.csv, result.to_frame())
    written = [f"{flag[2:]} {path}" for flag, path in (("--json", args.json), ("--csv", args.csv)) if path]
    if written:
        print(f"wrote {', '.join(written)}", file=sys.stderr)
    return EXIT_FINDINGS if (args.check and not result.same) else EXIT_OK
