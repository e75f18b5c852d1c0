"""Will it train in fp8 or MX formats? Every linear layer's three GEMMs quantized per recipe.

``tinylm precision [CHECKPOINT] [--recipes tensorwise,rowwise,mxfp8]`` runs one forward and
backward of the model (a tinylm or CS336 checkpoint, .safetensors, a Hugging Face save_pretrained
directory; none: a fresh default model) and reports, per recipe, which modules to keep in bf16,
then the worst GEMMs with measured SQNR, theory beside it, verdict, cause and fix, and a table per
block. Exit codes: 0 (or, with ``--check``, no GEMM fails), 1 with ``--check`` a GEMM that fails,
2 bad input or usage.
"""

from __future__ import annotations

import argparse
import math
import sys

from .cli import EXIT_FINDINGS, EXIT_OK, UsageError, choose
from .intake import (check_device_name, check_input_file, check_model_path, check_outputs, check_suffixes, load_model,
                     load_token_stream, memory_check, positive_int, report_width, resolve_device)

#: what --recipes offers (diagnostics.measure.quant.RECIPES, named here to check the flag before torch loads)
RECIPE_NAMES = ("tensorwise", "rowwise", "mxfp8", "mxfp4", "nvfp4")
DEFAULT_RECIPES = "tensorwise,rowwise,mxfp8"
_STYLE = {"fail": "bold red", "warn": "yellow", "ok": "green", "not measured": "dim"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="a checkpoint, .safetensors file or save_pretrained directory; none: a fresh default model")
    p.add_argument("--recipes", default=DEFAULT_RECIPES,
                   help=f"comma-separated, from {', '.join(RECIPE_NAMES)} (default {DEFAULT_RECIPES})")
    g = p.add_argument_group("measurement")
    g.add_argument("--data", metavar="PATH", help="token file (.npy, .bin, .txt); default: uniform random tokens")
    g.add_argument("--batch-size", type=positive_int, default=4, help="sequences (default 4)")
    g.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: min(context, 256))")
    g.add_argument("--seed", type=int, default=0, help="seed of the tokens (default 0)")
    g.add_argument("--device", help="cpu or cuda (default: cpu)")
    g.add_argument("--no-theory", action="store_true", help="skip the predicted SQNR (about a third faster)")
    g = p.add_argument_group("output")
    g.add_argument("--check", action="store_true", help="exit 1 when a GEMM fails in a recipe (for CI)")
    g.add_argument("--top", type=positive_int, default=10, help="worst GEMMs listed (default 10)")
    g.add_argument("--json", metavar="PATH", help="write the result as JSON")
    g.add_argument("--csv", metavar="PATH", help="write the tidy rows (module, gemm, recipe, sqnr_db, ...) as CSV")
    g.add_argument("--plot", metavar="PATH", help="write SQNR over depth per recipe and GEMM (.png, .svg, .pdf)")
    g.add_argument("--width", type=report_width, help="report width in columns (default: the terminal's)")


def recipes_of(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise UsageError(f"--recipes {text!r}: name at least one of {', '.join(RECIPE_NAMES)}")
    for n in names:
        choose("--recipes", n, RECIPE_NAMES, "recipe")
    return tuple(dict.fromkeys(names))


def check(args: argparse.Namespace) -> None:
    """Every flag that can be checked without torch."""
    recipes_of(args.recipes)
    check_model_path("CHECKPOINT", args.checkpoint)
    check_input_file("--data", args.data)
    outputs = {"--json": args.json, "--csv": args.csv, "--plot": args.plot}
    check_outputs(outputs, {"checkpoint": args.checkpoint, "--data file": args.data})
    check_suffixes(outputs)
    check_device_name(args.device)
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be 0 or more")


def _db(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def _loss(v: float) -> str:
    """The predicted training-loss increase, or "-" where none was predicted."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1e}"


def _worst_table(result, top: int):
    from rich.table import Table

    t = Table(title=f"worst GEMMs (of {len(result.rows)})", title_justify="left", expand=False)
    for col in ("module", "gemm", "recipe", "SQNR dB", "row dB", "theory dB", "loss +", "verdict", "cause -> fix"):
        t.add_column(col, overflow="fold")
    for r in result.worst()[:top]:
        theory = _db(r.predicted_sqnr_db) + ("" if r.valid else " *")
        text = r.cause if r.verdict == "ok" else f"{r.cause.split(': ', 1)[-1]} -> {r.fix}"
        t.add_row(r.module, r.gemm, r.recipe, _db(r.sqnr_db), _db(r.row_sqnr_db), theory, _loss(r.predicted_loss),
                  f"[{_STYLE[r.verdict]}]{r.verdict}[/]", text)
    return t


def _block_table(result):
    """Per block (or outside), per recipe, the lowest SQNR of its GEMMs and its verdict."""
    from rich.table import Table

    t = Table(title="lowest SQNR (dB) per block and recipe", title_justify="left")
    t.add_column("block")
    for rc in result.recipes:
        t.add_column(rc, justify="right")
    groups: dict[str, list] = {}
    for r in result.rows:
        groups.setdefault("-" if r.block is None else str(r.block), []).append(r)
    for key, rows in groups.items():
        cells = []
        for rc in result.recipes:
            mine = [r for r in rows if r.recipe == rc]
            low = min(mine, key=lambda r: min(r.sqnr_db, r.row_sqnr_db))
            verdict = min((r.verdict for r in mine), key=["fail", "warn", "not measured", "ok"].index)
            cells.append(f"[{_STYLE[verdict]}]{_db(min(low.sqnr_db, low.row_sqnr_db))}[/]")
        t.add_row(key if key == "-" else f"layers.{key}", *cells)
    return t


def figure(result):
    """SQNR over depth (the measured modules in forward order), one panel per GEMM, a line per recipe."""
    from . import plots  # noqa: F401  (selects the non-interactive backend)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for ax, gemm in zip(axes, ("fprop", "dgrad", "wgrad")):
        for rc in result.recipes:
            rows = [r for r in result.rows if r.gemm == gemm and r.recipe == rc]
            ax.plot([r.depth for r in rows], [min(r.sqnr_db, r.row_sqnr_db) for r in rows], marker=".", label=rc)
            bad = [r for r in rows if r.verdict == "fail"]
            ax.scatter([r.depth for r in bad], [min(r.sqnr_db, r.row_sqnr_db) for r in bad], s=60,
                       facecolors="none", edgecolors="red")
        ax.set_title(gemm)
        ax.set_xlabel("linear layer (forward order)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("SQNR dB (lower of output and typical row)")
    axes[0].legend(fontsize=8)
    fig.suptitle("precision: SQNR per GEMM over depth (red circles: fail)")
    return fig


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    check(args)
    from diagnostics import PrecisionOptions, precision

    from . import export

    source = load_model(args.checkpoint, command="precision", check=memory_check(args.batch_size, args.seq_len))
    model = source.model.to(resolve_device(args.device or "cpu"))
    context = next((v for k in ("context_length", "max_position_embeddings", "n_positions")
                    if isinstance(v := getattr(getattr(model, "config", None), k, None), int)), None)
    if args.seq_len is not None and context is not None and args.seq_len > context:
        raise UsageError(f"--seq-len {args.seq_len}: the model takes at most {context} tokens; give --seq-len {context}"
                         " or less")
    tokens = None
    if args.data is not None:
        tokens = load_token_stream(args.data, int(model.config.vocab_size), args.seq_len or 256)
    options = PrecisionOptions(recipes=recipes_of(args.recipes), batch_size=args.batch_size, seq_len=args.seq_len,
                               seed=args.seed, theory=not args.no_theory)
    result = precision(model, tokens, options)
    console = Console(width=args.width, highlight=False)
    console.print(f"[bold]precision[/] {source.description}: {result.meta['batch_size']} x {result.meta['seq_len']} "
                  f"tokens, loss {result.meta['loss']:.3f}")
    console.print(str(result), markup=False)
    if result.rows:
        console.print(_worst_table(result, args.top))
        console.print(_block_table(result))
        console.print("[dim]row dB: the median row's SQNR (a token; an output feature for wgrad); * theory outside its validity (see --json)[/]")
    if args.json:
        export.write_text(args.json, result.to_json() + "\n")
    if args.csv:
        result.to_frame().to_csv(args.csv, index=False)
    if args.plot and result.rows:
        export.write_figure(args.plot, figure(result))
    written = [f"{flag[2:]} {path}" for flag, path in (("--json", args.json), ("--csv", args.csv),
                                                       ("--plot", args.plot)) if path]
    if written:
        print(f"wrote {', '.join(written)}", file=sys.stderr)
    return EXIT_FINDINGS if (args.check and not result.ok) else EXIT_OK
