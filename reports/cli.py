"""The ``tinylm`` and ``diagnose`` commands.

Each verb lives in its own module ``reports.cmd_<verb>`` exposing
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches and
turns a user's mistake into one line on stderr and exit code 2.

Exit codes: 0 success (healthy), 1 findings (``--check``), 2 bad input or usage,
3 an internal error (a bug of ours: rerun with ``--debug`` and report it),
130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

# verb -> one-line help; the module reports.cmd_<verb> implements it.
VERBS = {
    "init": "write a freshly initialised checkpoint",
    "diagnose": "measure per-layer variance against theory and give verdicts",
    "compare": "compare init schemes side by side over depth",
    "props": "run the property-based numerics suite and summarise it",
    "train": "train a small model while watching per-layer statistics",
}


class UsageError(ValueError):
    """A bad flag or flag combination; the message says which and what to do."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise UsageError(f"{message} (see {self.prog} --help)")


def _modules() -> dict[str, object]:
    mods = {}
    for verb in VERBS:
        try:
            mods[verb] = importlib.import_module(f"reports.cmd_{verb}")
        except ModuleNotFoundError as e:
            if e.name != f"reports.cmd_{verb}":
                raise
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tinylm", description="Numerics verification and diagnostics for Transformer LMs.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    for verb, mod in _modules().items():
        p = sub.add_parser(verb, help=VERBS[verb], description=(mod.__doc__ or VERBS[verb]).strip().splitlines()[0])
        p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _is_user_error(e: BaseException) -> bool:
    """A TinyLMError (a mistake in what the user gave us). Flags are parsed before tinylm
    (and torch) is imported, so a parse error costs no import: look the class up only if
    tinylm was loaded."""
    errors = sys.modules.get("tinylm.errors")
    return errors is not None and isinstance(e, errors.TinyLMError)


def _say(message: str) -> None:
    print(message.replace("\n", " "), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tinylm``; returns the exit code (console scripts pass it to sys.exit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        parser = build_parser()
        if not argv:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        args = parser.parse_args(argv)
        if args.verb is None:
            raise UsageError("no verb given (see tinylm --help)")
        return int(args._run(args))
    except KeyboardInterrupt:
        _say("tinylm: interrupted")
        return EXIT_INTERRUPTED
    except SystemExit as e:  # --help and --version exit 0 through argparse
        return int(e.code or 0)
    except Exception as e:
        if debug:
            traceback.print_exc()
        if isinstance(e, UsageError) or _is_user_error(e):
            _say(f"tinylm: error: {e}")
            return EXIT_USAGE
        # a bug of ours: one line unless --debug
        _say(f"tinylm: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback and report it)")
        return EXIT_INTERNAL


def diagnose_main(argv: list[str] | None = None) -> int:
    """Entry point of the ``diagnose`` shortcut: ``diagnose X`` is ``tinylm diagnose X``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return main(["diagnose", *argv])


def console_main() -> None:  # pragma: no cover - thin wrapper for python -m
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    console_main()
