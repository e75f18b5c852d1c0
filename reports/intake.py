"""What the ``diagnose`` and ``compare`` commands take in: a model, token batches, output paths.

Nothing the user gave is modified: checkpoints are read only through
``tinylm.checkpoint.load`` (``weights_only``), Hugging Face ``save_pretrained``
directories through ``tinylm.hf.load_any`` (local only, no remote code), token files through
``tinylm.data.load_tokens`` (memory-mapped, read-only), and an output path
that resolves to the checkpoint or the data file is refused before any work.
"""

from __future__ import annotations

import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cli import UsageError, flag_of, positive_int  # noqa: F401  (positive_int: the commands import it from here)

if TYPE_CHECKING:  # torch is imported where a command starts its work, after the flags are checked
    import torch

__all__ = [
    "DEFAULT_PRESET",
    "DEFAULT_INIT",
    "ModelSource",
    "parse_int_list",
    "parse_dtype",
    "resolve_device",
    "load_model",
    "memory_check",
    "report_width",
    "MAX_WIDTH",
    "MIN_WIDTH",
    "load_token_stream",
    "check_outputs",
    "check_suffixes",
    "check_device_name",
    "check_input_file",
    "check_model_path",
    "measured_tokens",
    "is_fingerprint_file",
]

DEFAULT_PRESET, DEFAULT_INIT = "tinystories", "cs336"
DTYPES = ("float32", "bfloat16")


@dataclass
class ModelSource:
    """The model under examination and what is known about where it came from."""

    model: Any  # tinylm.TransformerLM (eval mode); a transformers model for an unmapped HF architecture
    description: str  # one line for the report header
    path: str | None = None  # the checkpoint, None for a fresh model
    format: str = "fresh"  # "fresh" or CheckpointInfo.format
    iteration: int | None = None
    fresh: bool = True  # True: initialised here by a known scheme (theory can be global)
    scheme: str | None = None  # the init scheme of a fresh model
    history: Any = None  # a training history stored in the checkpoint, if any
    nonfinite: list[str] = field(default_factory=list)  # parameters holding NaN or inf
    train_data: str | None = None  # the training data the checkpoint recorded (BUILTIN_CORPUS: the built-in one)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: tinylm's ``config.vocab_size``, or a transformers config's."""
        return int(self.model.config.vocab_size)

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model takes: tinylm's ``config.context_length``, a transformers
        config's ``max_position_embeddings`` or ``n_positions``; None where the config says none."""
        config = self.model.config
        for name in ("context_length", "max_position_embeddings", "n_positions"):
            if isinstance(getattr(config, name, None), int):
                return int(getattr(config, name))
        return None


#: the widest report drawn, in columns: rich lays out every line at the width asked, so a width is a
#: size like any other (a billion columns would take gigabytes); no screen or page is wider
MAX_WIDTH = 10_000

#: the narrowest report drawn whole, in columns: diagnose's narrowest layouts (the per-layer and attention
#: tables without their optional columns) keep an 8-block model's exponents whole down to 38 columns and
#: their flag words ("non-finite", "saturated") down to 44; below, rich cuts numbers and words, and at a
#: few columns folds every line into one to three characters
MIN_WIDTH = 44


def report_width(text: str) -> int:
    """argparse type of ``--width``: an integer in [MIN_WIDTH, MAX_WIDTH] columns."""
    import argparse

    value = positive_int(text)
    if value < MIN_WIDTH:
        raise argparse.ArgumentTypeError(f"{value} columns is narrower than the narrowest report ({MIN_WIDTH} "
                                         f"columns, where every number is drawn whole); give at least {MIN_WIDTH}")
    if value > MAX_WIDTH:
        raise argparse.ArgumentTypeError(f"{value} columns is wider than any screen or page; give at most {MAX_WIDTH:,}")
    return value


def parse_int_list(text: str, flag: str, minimum: int = 1) -> list[int]:
    """``"2,8,32"`` -> [2, 8, 32]; a bad entry is a one-line UsageError naming the flag."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: {part!r} is not an integer; give a comma-separated list such as 2,8,32") from None
        if value < minimum:
            raise UsageError(f"{flag} {text!r}: {value} is below {minimum}; give integers >= {minimum}")
        out.append(value)
    if not out:
        raise UsageError(f"{flag} {text!r}: empty; give a comma-separated list such as 2,8,32")
    return out


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UsageError(f"--dtype {name}: choose one of {', '.join(DTYPES)}")
    import torch

    return getattr(torch, name)


_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def check_device_name(name: str | None) -> None:
    """``--device`` spelled as cpu, cuda or cuda:N (checked before torch is imported; whether
    CUDA is there is :func:`resolve_device`'s question)."""
    if name is not None and not _DEVICE.fullmatch(name):
        raise UsageError(f"--device {name}: not a device name; use cpu or cuda (or cuda:N)")


def resolve_device(name: str | None) -> torch.device:
    """``None`` -> cuda when available, else cpu; an unavailable device is a UsageError."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name}: not a device name; use cpu or cuda (or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: only cpu and cuda are supported")
    return dev


def memory_check(batch_size: int, seq_len: int | None, dtype: Any = None) -> Any:
    """A check of a tinylm config against the host's memory, made before any tensor is allocated:
    the forward and backward pass of ``batch_size`` sequences of ``seq_len`` tokens (None: the
    config's context length) at ``dtype`` (default float32), by ``tinylm.memory.check_fits`` (the
    estimate times its margin of 1.5 against the available memory). A ``seq_len`` above the context
    is left to the caller's own refusal."""
    def check(config: Any) -> None:
        import torch

        from tinylm.memory import check_fits

        seq = config.context_length if seq_len is None else seq_len
        if seq <= config.context_length:
            check_fits(config, batch_size, seq, dtype or torch.float32)
    return check


def load_model(checkpoint: str | None, *, num_heads: int | None = None, rope_theta: float | None = None,
               context_length: int | None = None, unsafe: bool = False, seed: int = 0,
               command: str = "diagnose", check: Any = None) -> ModelSource:
    """The checkpoint's model (read-only, through tinylm.checkpoint.load), or a fresh default one.

    No checkpoint: ``tinystories`` preset, ``cs336`` init, drawn from a generator seeded with ``seed``.
    ``check(config)`` (e.g. :func:`memory_check`) is called with a tinylm config before its model is
    allocated; the model's own tensors are always checked against the host's memory first.
    """
    if is_fingerprint_file(checkpoint):
        raise UsageError(f"{checkpoint}: is a fingerprint (written by tinylm diff --save), which holds sketches of "
                         "one run, not weights; compare it with tinylm diff, or pass a checkpoint")
    import torch

    import tinylm
    from tinylm import checkpoint as ckpt

    if checkpoint is None:
        flags = [flag_of(k) for k, v in (("num_heads", num_heads), ("rope_theta", rope_theta)) if v is not None]
        if flags:
            raise UsageError(f"{', '.join(flags)} describe a checkpoint without a config; pass a CHECKPOINT or drop them")
        changes = {"init": DEFAULT_INIT}
        if context_length is not None:
            changes["context_length"] = context_length
        config = tinylm.preset(DEFAULT_PRESET, **changes)
        if check is not None:
            from tinylm.memory import check_model_fits

            check_model_fits(config)  # the model itself, then what the pass will need
            check(config)
        model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(seed))
        model.eval()
        return ModelSource(model, f"fresh {DEFAULT_PRESET} preset, {DEFAULT_INIT} init, seed {seed}",
                           scheme=DEFAULT_INIT)
    if Path(checkpoint).is_dir():
        return _load_hf_directory(checkpoint, num_heads=num_heads, rope_theta=rope_theta,
                                  context_length=context_length, unsafe=unsafe)
    try:
        model, info = ckpt.load(checkpoint, unsafe=unsafe, check=check, num_heads=num_heads, rope_theta=rope_theta,
                                context_length=context_length)
    except ckpt.MissingOptionsError as e:
        raise UsageError(_missing_flags_message(checkpoint, e, command)) from None
    where = f"{info.format} checkpoint {checkpoint}"
    if info.iteration is not None:
        where += f", iteration {info.iteration:,}" if isinstance(info.iteration, int) else f", iteration {info.iteration}"
    if info.config_source == "inferred":
        where += ", config inferred from shapes"
    return ModelSource(model, where, path=str(checkpoint), format=info.format, iteration=info.iteration,
                       fresh=False, history=info.history, nonfinite=list(info.nonfinite),
                       train_data=_recorded_data(info))


def _load_hf_directory(directory: str, *, num_heads: int | None, rope_theta: float | None,
                       context_length: int | None, unsafe: bool) -> ModelSource:
    """A ``save_pretrained`` directory: a Llama (or GPT-2) as the tinylm model that computes the
    same function, any other causal LM through transformers (``tinylm.hf.load_any``)."""
    from tinylm import hf

    flags = [flag_of(k) for k, v in (("num_heads", num_heads), ("rope_theta", rope_theta),
                                     ("context_length", context_length)) if v is not None]
    if flags:
        raise UsageError(f"{', '.join(flags)}: {directory} is a save_pretrained directory whose config.json gives "
                         "the whole config; drop the flag(s)")
    if unsafe:
        raise UsageError(f"--unsafe-load: {directory} is a save_pretrained directory, which is always read safely "
                         "(safetensors, or torch.load with weights_only); drop the flag")
    model, info = hf.load_any(directory)
    model_type = info.extra.get("model_type")
    how = "read through transformers" if info.format == "hf-transformers" else "mapped exactly onto tinylm"
    return ModelSource(model, f"Hugging Face directory {directory} ({model_type}, {how})", path=str(directory),
                       format=info.format, fresh=False, nonfinite=list(info.nonfinite))


#: what a CS336 TinyStories run uses, offered as the example values of a missing flag
_EXAMPLE = {"num_heads": 16, "context_length": 256, "rope_theta": 10000.0}


def _missing_flags_message(checkpoint: str, e: Any, command: str) -> str:
    """Every missing flag at once, with a complete command to copy (example values where the
    weights cannot tell; the head count a divisor of d_model)."""
    known = dict(e.known)
    given = {k: v for k, v in e.given.items() if v is not None}
    example = {**_EXAMPLE, **given}
    d_model = known.get("d_model")
    if isinstance(d_model, int) and "num_heads" not in given and d_model % example["num_heads"]:
        example["num_heads"] = next(h for h in (8, 4, 2, 1) if d_model % h == 0)
    flags = " ".join(f"{flag_of(k)} {_plain(v)}" for k, v in example.items() if k in e.missing or k in given)
    sizes = ", ".join(f"{k}={known[k]}" for k in ("vocab_size", "d_model", "num_layers", "d_ff") if k in known)
    what = ", ".join(flag_of(k) for k in e.missing)
    return (f"{checkpoint}: the checkpoint stores no config; its weights give {sizes or 'the sizes'} but not "
            f"{what}: pass {'them' if len(e.missing) > 1 else 'it'} as your run used them, e.g. "
            f"{command} {checkpoint} {flags} (example values of a CS336 TinyStories run)")


def _plain(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _recorded_data(info: Any) -> str | None:
    """The training data a ``tinylm train`` checkpoint recorded: its path, ``BUILTIN_CORPUS``
    for the built-in corpus, None when the checkpoint says nothing about its data."""
    extra = getattr(info, "extra", None) or {}
    if isinstance(extra.get("train_data"), str):
        return extra["train_data"]
    if "train_options" in extra:  # written by tinylm train without --data: the built-in corpus
        return BUILTIN_CORPUS
    return None


BUILTIN_CORPUS = "<built-in corpus>"


def measured_tokens(data: str | None, source: ModelSource, seq_len: int) -> tuple[Any, str]:
    """The tokens ``diagnose`` measures and the header's words for them.

    ``--data`` when given; else the data a checkpoint recorded when it trained (when that is
    still there); else uniform random tokens, with a note on what a trained model's loss on
    them means and how to pass real tokens.
    """
    vocab = source.vocab_size
    if data is not None:
        tokens = load_token_stream(data, vocab, seq_len)
        return tokens, f"{data} ({len(tokens):,} tokens)"
    recorded, note = source.train_data, ""
    if recorded == BUILTIN_CORPUS and vocab >= 256:
        from tinylm.data import stdlib_corpus

        tokens = stdlib_corpus()
        return tokens, (f"the built-in corpus ({len(tokens):,} tokens), which the checkpoint recorded as its "
                        "training data (--data PATH measures other tokens)")
    if recorded is not None and recorded != BUILTIN_CORPUS:
        if Path(recorded).is_file():
            try:
                tokens = load_token_stream(recorded, vocab, seq_len)
            except (UsageError, ValueError) as e:
                note = f"; the recorded training data {recorded} cannot be used ({e})"
            else:
                return tokens, (f"{recorded} ({len(tokens):,} tokens), the training data the checkpoint recorded "
                                "(--data PATH measures other tokens)")
        else:
            note = f"; the recorded training data {recorded} is gone"
    text = f"uniform random tokens over [0, {vocab:,})" + note
    if not source.fresh:
        text += "; pass --data PATH (.npy, .bin or .txt) to measure on the kind of tokens it was trained on"
    return None, text


def load_token_stream(data: str | None, vocab_size: int, seq_len: int) -> Any:
    """The token file ``data`` as a 1-D integer array checked against the vocabulary (None: random tokens)."""
    if data is None:
        return None
    from tinylm.data import load_tokens

    tokens = load_tokens(data, vocab_size)
    if len(tokens) < seq_len + 1:
        raise UsageError(f"--data {data}: {len(tokens)} tokens are fewer than --seq-len + 1 = {seq_len + 1}; "
                         "use more data or a shorter --seq-len")
    return tokens


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def _within(path: Path, directory: Path) -> bool:
    """``path`` lies somewhere under ``directory`` (both resolved: symlinks, ``..``)."""
    return directory.resolve() in path.resolve().parents


def _kind_of(path: Path) -> str:
    suffix = path.suffix.lower()
    return next((kind for kind, suffixes in _KINDS.items() if suffix in suffixes), "other")


def _writable_parent(flag: str, value: str, path: Path) -> None:
    """The nearest existing ancestor of ``path`` must be a directory this process may write in."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {value}: {parent} is a file, not a directory; choose an output path in a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {value}: cannot write in {parent} (permission denied); choose a writable directory")


def check_outputs(outputs: dict[str, str | None], inputs: dict[str, str | None], *, force: bool | None = None,
                  may_replace: dict[str, str] | None = None) -> None:
    """Every output path of a command against its inputs and each other, before any work.

    ``outputs`` maps a flag (``--json``) to its path, ``inputs`` a name (``checkpoint``,
    ``--data file``) to an input path. Paths are compared resolved (symlinks, ``..``) and
    by file identity. Refused, each with a one-line UsageError naming the flag: an output
    that is an input (whatever ``--force`` says; ``may_replace`` lists the exceptions,
    e.g. ``{"-o": "--resume checkpoint"}`` for a run written back over the checkpoint it
    resumed), an existing file inside an input that is a directory (a save_pretrained
    directory's config.json or weights), one given twice, a directory, one under a regular
    file or in a directory that cannot be written, and an existing file of another kind than the flag writes
    (``--json report.npy`` over a token file). ``force``: for commands whose outputs need
    ``--force`` to replace an existing file (``init``, ``train``), False refuses an
    existing one; None (reports) replaces an existing file of the same kind.
    """
    seen: dict[Path, str] = {}
    allowed = may_replace or {}
    for flag, value in outputs.items():
        if value is None:
            continue
        path = Path(value)
        for name, src in inputs.items():
            if src is not None and _same_file(path, Path(src)) and allowed.get(flag) != name:
                raise UsageError(f"{flag} {value} is the {name} itself; choose another output path "
                                 "(inputs are never overwritten, even with --force)")
        for name, src in inputs.items():
            if src is not None and Path(src).is_dir() and path.exists() and _within(path, Path(src)):
                raise UsageError(f"{flag} {value} is a file inside the {name} directory; choose another output path "
                                 "(inputs are never overwritten, even with --force)")
        if path.is_dir():
            raise UsageError(f"{flag} {value} is a directory; give a file name such as "
                             f"{path / ('report' + _SUFFIX.get(flag.split()[0], ''))}")
        _writable_parent(flag, value, path)
        if path.exists() and not any(src is not None and _same_file(path, Path(src)) for src in inputs.values()):
            if force is False:
                raise UsageError(f"{value} exists; pass --force to overwrite it or choose another {flag}")
            want = _KIND_OF_FLAG.get(flag.split()[0])
            if want is not None and _kind_of(path) != want:
                raise UsageError(f"{flag} {value} exists and is not a {want} file; an output replaces only a file of "
                                 "its own kind: choose another path")
        key = path.resolve()
        if key in seen:
            raise UsageError(f"{flag} and {seen[key]} both write {value}; give each output its own path")
        seen[key] = flag


#: what each output flag writes, and the suffixes that mark a file of that kind
_KINDS = {"json": (".json",), "csv": (".csv",), "html": (".html", ".htm"), "svg": (".svg",), "png": (".png",),
          "checkpoint": (".pt", ".pth", ".ckpt", ".safetensors", ".bin")}
_KIND_OF_FLAG = {"--json": "json", "--csv": "csv", "--html": "html", "--svg": "svg", "--plot": "png",
                 "--watch-json": "json", "--watch-csv": "csv", "-o": "checkpoint"}
_SUFFIX = {"--json": ".json", "--csv": ".csv", "--html": ".html", "--svg": ".svg", "--plot": ".png"}

#: the suffixes each report flag writes (a plot's format is chosen by its suffix)
_SUFFIXES = {"--json": (".json",), "--csv": (".csv",), "--html": (".html", ".htm"), "--svg": (".svg",),
             "--plot": (".png", ".svg", ".pdf"), "--watch-json": (".json",), "--watch-csv": (".csv",)}


def check_suffixes(outputs: dict[str, str | None]) -> None:
    """Each output path ends in a suffix its flag writes (``--plot r.txt`` is refused before any
    work, with the path it probably meant)."""
    for flag, value in outputs.items():
        allowed = _SUFFIXES.get(flag.split()[0])
        if value is None or allowed is None:
            continue
        path = Path(value)
        if path.suffix.lower() not in allowed:
            kinds = " or ".join(s[1:].upper() for s in allowed)
            raise UsageError(f"{flag} {value}: {flag} writes {kinds}, chosen by the suffix; give a path ending in "
                             f"{' or '.join(allowed)}, e.g. {path.with_suffix(allowed[0])}")


#: a name the Hugging Face hub would resolve ("gpt2", "meta-llama/Llama-3.2-1B"): owner/name, no suffix of a file
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def check_model_path(flag: str, value: str | None) -> None:
    """A model input (``diagnose CHECKPOINT``, ``export CHECKPOINT``): an existing readable file, or a
    directory with a config.json (a Hugging Face ``save_pretrained`` directory), checked before torch
    is imported. A path that does not exist and reads like a hub name is told that tinylm reads only
    local directories (it never downloads)."""
    if value is None:
        return
    path = Path(value)
    if not path.exists() and _HUB_NAME.fullmatch(value) and path.suffix.lower() not in _KINDS["checkpoint"]:
        raise UsageError(f"{value}: no such file or directory; tinylm reads only local save_pretrained directories "
                         "and never downloads (a hub name is not read): fetch the model yourself and pass its directory")
    if path.is_dir():
        if (path / "watch.jsonl").is_file() and not (path / "config.json").is_file():
            raise UsageError(f"{flag} {value}: is a watch's log dir, not a model; read it with: tinylm runs {value}")
        if not (path / "config.json").is_file():
            raise UsageError(f"{flag} {value}: is a directory without config.json; pass the checkpoint file inside it, "
                             "or a save_pretrained directory")
        if not os.access(path / "config.json", os.R_OK):
            raise UsageError(f"{flag} {value}: its config.json is not readable (permission denied); fix its "
                             "permissions (chmod u+r)")
        return
    check_input_file(flag, value)


#: the arrays of a fingerprint file (``diagnostics.Fingerprint.save``: an .npz archive of plain arrays)
FINGERPRINT_MEMBERS = frozenset({"header.npy", "tokens.npy", "sketches.npy"})


def is_fingerprint_file(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a fingerprint file, told by its content whatever its name: a zip archive
    holding exactly the arrays :data:`FINGERPRINT_MEMBERS` (a PyTorch checkpoint is a zip too, of
    ``archive/data.pkl`` and tensor records). Read without torch, before any work."""
    if path is None or not os.path.isfile(path):
        return False
    try:
        if not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as zf:
            return set(zf.namelist()) == FINGERPRINT_MEMBERS
    except (OSError, zipfile.BadZipFile):
        return False


def check_input_file(flag: str, value: str | None) -> None:
    """An input path (a checkpoint, a token file) exists and is a readable file, checked
    before torch is imported (the loaders check the contents)."""
    if value is None:
        return
    path = Path(value)
    if not path.exists():
        raise UsageError(f"{value}: no such file; check the {flag} path")
    if path.is_dir():
        raise UsageError(f"{flag} {value}: is a directory; pass the file inside it")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{flag} {value}: not readable (permission denied); fix its permissions (chmod u+r)")
