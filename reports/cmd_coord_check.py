"""Coordinate check: does training move every activation alike at every width (muP)?

``tinylm coord-check`` builds tinylm models at each ``--widths`` (``--parametrization mup``
with base width the first, or ``sp``), trains each ``--steps`` Adam steps from ``--seeds``
seeds on the same random batch, and judges every site's slope of log RMS against log width
with muP's exponents (``diagnostics.coord_check``). ``--impl path/to/file.py:factory`` checks
your own model instead: ``factory(width) -> nn.Module`` (its optimizer: the module's
``make_optimizer(model, width)`` when it defines one, else Adam at ``--lr``). Exit codes: 0
done (with ``--check``: muP holds), 1 a site departs (with ``--check``), 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from .cli import EXIT_FINDINGS, EXIT_OK, UsageError
from .intake import check_outputs, check_suffixes, parse_int_list, positive_int

DEFAULT_WIDTHS = "64,128,256,512"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parametrization", choices=["sp", "mup"], default="mup",
                   help="tinylm's parametrization (default mup, base width = the first width)")
    p.add_argument("--widths", default=DEFAULT_WIDTHS, help=f"d_model values (default {DEFAULT_WIDTHS})")
    p.add_argument("--steps", type=positive_int, default=10, help="Adam steps per model (default 10)")
    p.add_argument("--seeds", type=positive_int, default=2, help="models per width (default 2)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate at the base width (default 1e-2)")
    p.add_argument("--num-layers", type=positive_int, default=2, help="tinylm blocks (default 2)")
    p.add_argument("--impl", metavar="FILE.py:FACTORY", help="your model: factory(width) -> nn.Module")
    p.add_argument("--check", action="store_true", help="exit 1 when a site departs from muP")
    p.add_argument("--plot", metavar="PATH", help="write the figure (RMS against width, a line per step)")
    p.add_argument("--csv", metavar="PATH", help="write the tidy rows as CSV")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")


def _outputs(args: argparse.Namespace) -> dict[str, str | None]:
    return {"--plot": args.plot, "--csv": args.csv, "--json": args.json}


def check(args: argparse.Namespace) -> None:
    """The flags, before torch is imported."""
    widths = parse_int_list(args.widths, "--widths")
    if len(set(widths)) < 2:
        raise UsageError(f"--widths {args.widths}: give at least two distinct widths (a slope needs two)")
    if not args.lr > 0:
        raise UsageError(f"--lr {args.lr}: must be a positive number")
    if args.impl is not None:
        path, _, name = args.impl.partition(":")
        if not path.endswith(".py") or not name:
            raise UsageError(f"--impl {args.impl}: give path/to/file.py:factory")
        if not Path(path).is_file():
            raise UsageError(f"--impl {args.impl}: {path} is not a file")
    check_outputs(_outputs(args), {"--impl file": args.impl.partition(":")[0] if args.impl else None})
    check_suffixes(_outputs(args))


def _impl(spec: str):
    """(factory, make_optimizer or None) from path/to/file.py:factory."""
    path, _, name = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: one line, not our traceback
        raise UsageError(f"--impl {spec}: importing {path} failed: {type(e).__name__}: {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UsageError(f"--impl {spec}: {path} defines no callable {name!r}")
    return factory, getattr(module, "make_optimizer", None)


def _tinylm(args: argparse.Namespace, base: int):
    import torch

    import tinylm

    def make_model(width):
        config = tinylm.ModelConfig(vocab_size=256, context_length=64, d_model=width, num_layers=args.num_layers,
                                    num_heads=4, d_ff=tinylm.default_d_ff(width), parametrization=args.parametrization,
                                    mup_base_width=base if args.parametrization == "mup" else None)
        return tinylm.TransformerLM(config)

    def make_optimizer(model, width):
        return torch.optim.Adam(tinylm.mup.param_groups(model, args.lr, "adam"), lr=args.lr)

    return make_model, make_optimizer


def run(args: argparse.Namespace) -> int:
    from diagnostics import CoordCheckOptions, coord_check

    widths = sorted(set(parse_int_list(args.widths, "--widths")))
    if args.impl is not None:
        make_model, make_optimizer = _impl(args.impl)
    else:
        make_model, make_optimizer = _tinylm(args, widths[0])
    options = CoordCheckOptions(steps=args.steps, seeds=args.seeds, lr=args.lr)
    result = coord_check(make_model, widths, make_optimizer=make_optimizer, options=options)
    print(str(result))
    if args.csv:
        result.to_frame().to_csv(args.csv, index=False)
    if args.json:
        Path(args.json).write_text(result.to_json())
    if args.plot:
        from .coord_plot import write_coord_plot

        write_coord_plot(result, args.plot)
    for flag, path in _outputs(args).items():
        if path:
            print(f"wrote {path} ({flag})", file=sys.stderr)
    return EXIT_FINDINGS if (args.check and not result.ok) else EXIT_OK
