"""The ``tinylm`` and ``diagnose`` commands.

Each verb lives in its own module ``reports.cmd_<verb>`` exposing
``add_arguments(parser)``, ``run(args) -> int`` and optionally ``check(args)``;
this file only dispatches and turns a user's mistake into one line on stderr and
exit code 2.

Order of work: the flags are parsed and every argument that can be checked
without torch (paths, output suffixes, device names, presets, schemes, numbers)
is checked by the verb's ``check(args)`` before anything heavy is imported, so a
mistyped flag costs a fraction of a second; only then does ``run`` import
tinylm (and torch) and start.

Exit codes (also in docs/cli.md):

== =====================================================================
0  success (``diagnose``: healthy, or run without ``--check``)
1  findings (``diagnose --check``), a failing property (``props``) or a departure
   beyond roundoff (``diff --check``) or a GEMM that fails a recipe (``precision --check``)
2  bad input or usage: one line on stderr, no traceback
3  an internal error: a bug of ours, never expected (rerun with ``--debug``
   and report it)
4  ``train`` stopped early on a non-finite loss (the checkpoint is written)
5  ``diagnose --check``: the model could not be judged (no block stack and no
   next-token logits found; the report says what is missing)
130 interrupted (Ctrl-C)
141 the reader of the output went away (``| head``): the rest is dropped quietly
== =====================================================================
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import re
import sys
import traceback
import warnings

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_PIPE = 141  # 128 + SIGPIPE, as a shell reports a pipeline's reader closing early
EXIT_NONFINITE = 4  # tinylm train stopped on a non-finite loss

# verb -> one-line help; the module reports.cmd_<verb> implements it.
VERBS = {
    "init": "write a freshly initialised checkpoint",
    "diagnose": "measure per-layer variance against theory and give verdicts",
    "compare": "compare init schemes side by side over depth",
    "props": "run the property-based numerics suite and summarise it",
    "train": "train a small model while watching per-layer statistics",
    "export": "write a model as a Hugging Face directory that transformers loads",
    "diff": "find where two executions of one model part ways (per-site departures against roundoff)",
    "coord-check": "check width scaling (muP): each site's slope over width against theory's exponent",
    "runs": "read back what a watch wrote: outcome, first departure, alerts, forensics; runs side by side",
    "precision": "quantize every linear layer's GEMMs per fp8/MX recipe: SQNR, theory, what to keep in bf16",
}

#: The presets and init schemes the command line offers, named here so that flags are
#: checked (with "did you mean") before torch is imported; a test holds them equal to
#: ``tinylm.config.PRESETS`` and ``tinylm.init.SCHEMES``.
PRESET_NAMES = ("tiny", "tinystories", "gpt2-small", "gpt2", "gpt2-tiny")
SCHEME_NAMES = ("cs336", "kaiming", "torch-default", "gpt2", "small-init", "zero-residual")


class UsageError(ValueError):
    """A bad flag or flag combination; the message says which and what to do."""


# --------------------------------------------------------------------------- the library's words in flags

#: The one map from a library argument (a keyword of tinylm or diagnostics) to the flag that
#: carries it: ``--`` and the name with dashes, except these. Only the command line speaks in
#: flags; the library names its arguments (``pass seq_len=N``) and :func:`in_flags` translates.
_RENAMED_FLAGS = {"unsafe": "--unsafe-load"}

#: The flag that names the file a library error class refuses (its ``argument`` is ``path``).
_FILE_FLAGS = {"DataError": "--data"}


def flag_of(name: str) -> str:
    """The flag of a library argument: ``seq_len`` -> ``--seq-len``, ``unsafe`` -> ``--unsafe-load``."""
    return _RENAMED_FLAGS.get(name, "--" + name.replace("_", "-"))


_ADVICE = re.compile(r"(?<![\w.])(?P<name>[a-z][a-z0-9_]*)=(?P<value>[A-Z]+\b|True\b|-?\d[\d.]*(?:e[-+]?\d+)?)")


def in_flags(message: str, flags: dict[str, bool]) -> str:
    """A library message in the command line's words: each piece of advice whose flag the command
    has (``flags``: flag -> whether it takes a value) becomes that flag. Advice is ``name=N`` with an
    upper-case placeholder (``--name N``), ``name=True`` for a switch (``--name``) or a number after
    "pass " or "try " (``try batch_size=8``: ``try --batch-size 8``). A statement of a value
    (``steps=0: must ...``) and a name the command has no flag for stay as they are."""
    def swap(m: re.Match) -> str:
        flag, value = flag_of(m["name"]), m["value"]
        if flag not in flags:
            return m[0]
        if value == "True":
            return m[0] if flags[flag] else flag
        if value.isalpha() or message[:m.start()].endswith(("pass ", "try ")):
            return f"{flag} {value}"
        return m[0]

    return _ADVICE.sub(swap, message)


def flags_of(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """The long flags of ``parser``, each with whether it takes a value."""
    return {s: a.nargs != 0 for a in parser._actions for s in a.option_strings if s.startswith("--")}


def user_message(e: BaseException, parser: argparse.ArgumentParser | None) -> str:
    """The one line a user sees for a mistake: a UsageError as it is; a library error in the
    command's flags (:func:`in_flags`), a refused file under the flag that named it."""
    message = str(e)
    if isinstance(e, UsageError) or parser is None:
        return message
    flags = flags_of(parser)
    message = in_flags(message, flags)
    file_flag = _FILE_FLAGS.get(type(e).__name__)
    if getattr(e, "argument", None) == "path" and file_flag in flags:
        message = f"{file_flag} {message}"
    return message


@contextlib.contextmanager
def warnings_in_flags(parser: argparse.ArgumentParser):
    """Within: a warning the library gives is shown in the command's flags (:func:`in_flags`)."""
    show, flags = warnings.showwarning, flags_of(parser)

    def in_words(message, category, filename, lineno, file=None, line=None):
        show(in_flags(str(message), flags), category, filename, lineno, file, line)

    warnings.showwarning = in_words
    try:
        yield
    finally:
        warnings.showwarning = show


def did_you_mean(word: str, choices, n: int = 1) -> str:
    """``"; did you mean 'diagnose'?"`` for the closest of ``choices`` (difflib), or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def choose(flag: str, value: str, choices, what: str) -> str:
    """``value`` if it is one of ``choices``, else a UsageError listing them (with "did you mean")."""
    if value not in choices:
        raise UsageError(f"{flag}: unknown {what} {value!r}; choose one of {', '.join(choices)}"
                         f"{did_you_mean(value, choices)}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        m = re.search(r"invalid choice: '?([^'\s]*)'? \(choose from (.*)\)", message)
        hint = did_you_mean(m.group(1), re.findall(r"'?([^',\s]+)'?", m.group(2))) if m else ""
        raise UsageError(f"{message}{hint} (see {self.prog} --help)")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _modules() -> dict[str, object]:
    mods = {}
    for verb in VERBS:
        try:
            mods[verb] = importlib.import_module(f"reports.cmd_{verb.replace('-', '_')}")
        except ModuleNotFoundError as e:
            if e.name != f"reports.cmd_{verb.replace('-', '_')}":
                raise
    return mods


def build_parser() -> argparse.ArgumentParser:
    """The whole parser; importing it imports no torch (the verbs import it in ``run``)."""
    parser = _Parser(prog="tinylm", description="Numerics verification and diagnostics for Transformer LMs.")
    # --debug and --threads are accepted before the verb too (under their own names: a verb's
    # parser would overwrite the same attribute with its default)
    parser.add_argument("--debug", dest="debug_first", action="store_true", help="show the full traceback on errors")
    parser.add_argument("--threads", dest="threads_first", type=positive_int, metavar="N",
                        help="CPU threads for torch (see the verbs' --help)")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    for verb, mod in _modules().items():
        p = sub.add_parser(verb, help=VERBS[verb], description=(mod.__doc__ or VERBS[verb]).strip().splitlines()[0])
        p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
        p.add_argument("--threads", type=positive_int, metavar="N",
                       help="CPU threads for torch (torch.set_num_threads); on a busy machine 1 can be much "
                            "faster than the default (all cores)")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _check=getattr(mod, "check", None), _parser=p)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; an unknown verb or flag is a UsageError that suggests the closest known one."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is not None and argv and argv[0] == first and first not in VERBS:  # flags first: argparse says it
        raise UsageError(f"unknown command {first!r}{did_you_mean(first, VERBS)} (commands: {', '.join(VERBS)}; "
                         "see tinylm --help)")
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = getattr(args, "_parser", parser)
        known = [s for s in sub._option_string_actions if s.startswith("--")]
        bad = extras[0]
        if bad.split("=", 1)[0] in known:  # a verb's flag given before the verb
            raise UsageError(f"{bad} belongs after the command: tinylm {args.verb} {bad} ...")
        if bad.startswith("-"):
            hint = did_you_mean(bad.split("=", 1)[0], known)
            raise UsageError(f"unrecognized argument {bad}{hint} (see {sub.prog} --help)")
        raise UsageError(f"unexpected argument {bad!r} (see {sub.prog} --help)")
    return args


def _is_user_error(e: BaseException) -> bool:
    """A TinyLMError (a mistake in what the user gave us). Flags are parsed before tinylm
    (and torch) is imported, so a parse error costs no import: look the class up only if
    tinylm was loaded."""
    errors = sys.modules.get("tinylm.errors")
    return errors is not None and isinstance(e, errors.TinyLMError)


def _say(message: str) -> None:
    print(message.replace("\n", " "), file=sys.stderr)


def set_threads(n: int | None) -> None:
    """``--threads N``: torch's intra-op threads (and OpenMP's, for subprocesses) set to N."""
    if n is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tinylm``; returns the exit code (console scripts pass it to sys.exit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    verb_parser = None
    try:
        parser = build_parser()
        if not argv:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        args = _parse(parser, argv)
        verb_parser = getattr(args, "_parser", None)
        if args.verb is None:
            raise UsageError("no command given (commands: " + ", ".join(VERBS) + "; see tinylm --help)")
        if args._check is not None:
            args._check(args)  # every flag that can be checked without torch, before any work
        set_threads(args.threads if args.threads is not None else args.threads_first)
        with warnings_in_flags(verb_parser):
            return int(args._run(args))
    except KeyboardInterrupt:
        _say("tinylm: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE
    except SystemExit as e:  # --help and --version exit 0 through argparse
        return int(e.code or 0)
    except Exception as e:
        if debug:
            traceback.print_exc()
        if isinstance(e, UsageError) or _is_user_error(e):
            _say(f"tinylm: error: {user_message(e, verb_parser)}")
            return EXIT_USAGE
        # a bug of ours: one line unless --debug
        _say(f"tinylm: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback and report it)")
        return EXIT_INTERNAL


def _silence_stdout() -> None:
    """Point stdout at the null device: the reader is gone, and the interpreter's final flush of
    what is still buffered must not raise a second BrokenPipeError on the way out."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a descriptor (captured)
        pass


def diagnose_main(argv: list[str] | None = None) -> int:
    """Entry point of the ``diagnose`` shortcut: ``diagnose X`` is ``tinylm diagnose X``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return main(["diagnose", *argv])


def console_main() -> None:  # pragma: no cover - thin wrapper for python -m
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    console_main()
