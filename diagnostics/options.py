"""The options of a probe and of a diagnosis: one dataclass each, validated eagerly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import OptionsError
from tinylm.validate import boolean, check, choice, fail, integer, number

__all__ = ["OptionsError", "ProbeOptions", "DiagnoseOptions", "CompareOptions", "DiffOptions", "DIFF_DTYPES", "Progress",
           "THEORY_MODES"]

#: progress(done, total, description): called as work advances (the CLI draws a bar).
Progress = Callable[[int, int, str], None]

#: theory modes a user may ask for; "none" is an alias of "off" (measurement only).
THEORY_MODES = ("auto", "local", "global", "off", "none")


def _callable(name: str, value: Any, signature: str) -> None:
    """``value`` is None or a callable of ``signature``."""
    if value is not None:
        check(name, value, callable, f"be a callable {signature}", error=OptionsError)


@dataclass(frozen=True)
class ProbeOptions:
    """What a :func:`diagnostics.probe` instruments and measures.

    modules: module names to instrument; None = the default set (each leaf module
        with parameters, plus for tinylm the block outputs, the attention and FFN
        branches and the Taps).
    backward: also measure the gradient of the loss w.r.t. each instrumented tensor.
    attention: the attention panel (entropy, saturated rows) on ``*.attn.probs`` Taps.
    cosine: mean cosine similarity between tokens at the residual points.
    params: per-parameter statistics on exit (std, grad std, drift).
    spectral: spectral norm and stable rank of each matrix on exit (a Gram eigendecomposition each:
        off by default to keep a probe cheap; ``diagnose`` turns it on).
    restore_grads: on exit put every parameter's ``.grad`` back as it was on entry
        (True keeps the model exactly as it was; a training loop that probes its own
        backward passes False so its optimizer still sees the gradients).
    eval_mode: run under ``model.eval()`` (dropout off); ``training`` is restored on exit.
    signals: also the precursor signals of :mod:`diagnostics.measure.signals` (every attention
        layer's largest logit and entropy ceiling, eager softmax attention and
        ``scaled_dot_product_attention`` calls of any model included; the head's log Z; the
        residual stream's peak ratio); the watch turns it on.
    """

    modules: tuple[str, ...] | None = None
    backward: bool = True
    attention: bool = True
    cosine: bool = True
    params: bool = True
    spectral: bool = False
    restore_grads: bool = True
    eval_mode: bool = True
    signals: bool = False

    def __post_init__(self) -> None:
        if self.modules is not None:
            check("modules", self.modules, lambda v: not isinstance(v, str) and all(isinstance(m, str) for m in v),
                  "be a tuple of module names (or None for the default set)", fix="modules=('layers.0', ...)",
                  error=OptionsError)
        for name in ("backward", "attention", "cosine", "params", "spectral", "restore_grads", "eval_mode",
                     "signals"):
            boolean(name, getattr(self, name), error=OptionsError)


@dataclass(frozen=True)
class DiagnoseOptions:
    """Everything :func:`diagnostics.diagnose` needs besides the model.

    batch_size, seq_len: shape of each measured batch (seq_len None = min(model
        context, 128)); the model sees ``seq_len`` tokens and predicts the next.
    batches: independent batches per seed (with one seed, the replicates of the 99% intervals,
        which then cover batch noise of that one weight draw, not the draw).
    seeds: 1 measures the model as given; n > 1 re-initialises n copies of a tinylm
        model from its own scheme (config.init) with seeds seed..seed+n-1 (a fresh-init
        study; never for a trained checkpoint). The draws are then the replicates of the
        99% intervals (each the geometric mean over its batches), which cover the draw.
    seed: seeds the random tokens (when none are given) and the re-initialisations.
    theory: "local" (each layer from its measured input and actual weights), "global"
        (analytic at init), "auto" (global if every parameter's std matches its declared
        init within 5%, else local) or "off" (measurement only: no predictions, ratios or
        intervals; the verdicts do not depend on theory). "none" is accepted as an alias of
        "off" and stored as "off".
    thresholds: a diagnostics.judge.Thresholds (None = the documented defaults).
    progress: progress(done, total, description) callback, or None.
    inputs: what the model is called with, built from the token ids (B, T): ``inputs(ids)``
        returns a dict (``model(**d)``, e.g. ``{"input_ids": ids}``), a tuple (``model(*t)``)
        or one value (``model(x)``); None calls ``model(ids)``.
    loss_fn: ``loss_fn(logits, targets) -> scalar``, the loss whose gradient is measured, with
        the model's output read as logits (a tensor, a tuple's first tensor or ``.logits``) and
        targets (B, T) the next tokens; None: mean next-token cross-entropy of (B, T, V) logits,
        or the model's own ``.loss`` (or 0-d output) when it returns no logits. A custom loss is
        not next-token cross-entropy, so the loss is then not judged against ln V.
    """

    batch_size: int = 8
    seq_len: int | None = None
    batches: int = 4
    seeds: int = 1
    seed: int = 0
    theory: str = "auto"
    thresholds: object | None = None
    progress: Progress | None = field(default=None, compare=False)
    inputs: Callable[[Any], Any] | None = field(default=None, compare=False)
    loss_fn: Callable[[Any, Any], Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name, signature in (("inputs", "ids -> dict, tuple or tensor"), ("loss_fn", "(logits, targets) -> scalar loss"),
                                ("progress", "(done, total, description)")):
            _callable(name, getattr(self, name), signature)
        for name in ("batch_size", "batches", "seeds"):
            integer(name, getattr(self, name), low=1, fix=f"{name}=N", error=OptionsError)
        if self.seq_len is not None:
            integer("seq_len", self.seq_len, low=2, fix="seq_len=N (or None for the default)", error=OptionsError)
        integer("seed", self.seed, low=0, high=2**63 - 1, fix="seed=N", error=OptionsError)
        choice("theory", self.theory, THEORY_MODES, fix="theory=MODE", error=OptionsError)
        if self.theory == "none":
            object.__setattr__(self, "theory", "off")


def _sizes(name: str, values: Any) -> tuple[int, ...]:
    """``values`` as a non-empty tuple of positive integers."""
    values = (values,) if isinstance(values, (int, str)) else tuple(values)
    return check(name, values, lambda vs: bool(vs) and all(not isinstance(v, bool) and isinstance(v, int) and v > 0
                                                           for v in vs),
                 "be a non-empty list of positive integers", fix=f"{name}=(2, 8, 32)", error=OptionsError)


@dataclass(frozen=True)
class CompareOptions:
    """Everything :func:`diagnostics.compare` needs: the grid, the tokens and the measurement.

    schemes: init scheme names (``tinylm.init.SCHEMES``); None = every scheme registered when
        compare runs.
    depths, widths: num_layers and d_model of the grid's models (each a non-empty sequence of
        positive integers, stored as a tuple).
    seeds: models per grid cell, initialised with seed, seed+1, ...: the replicates of the 99%
        intervals. seed: the first of them (it also draws each model's batch and training batches).
    steps: AdamW steps per model after the measurement (0: none), for the early loss; lr: their
        learning rate.
    data: None (uniform random tokens; the steps train on the standard library's bytes), a 1-D
        integer token array, or the path of a token file (.npy, .bin, .txt; see tinylm.data).
    data_name: what the summary's ``data`` column calls the tokens (default: the path, or "given tokens").
    vocab_size: None sizes it (256, or to the data); an int is used as given.
    seq_len, batch_size: the shape of each measured (and training) batch.
    norm: the models' norm placement ("pre", "post" or "none").
    tensors: "stream" (the residual stream and the logits) or "all" (every default probe point).
    thresholds: a diagnostics.Thresholds (None = the documented defaults).
    progress: progress(done, total, description), called after each model, or None.
    run: the tidy frame's ``run`` column (a label for concatenating comparisons; None by default).
    """

    schemes: tuple[str, ...] | None = None
    depths: tuple[int, ...] = (2, 8, 32)
    widths: tuple[int, ...] = (128,)
    seeds: int = 3
    steps: int = 0
    data: Any = field(default=None, compare=False)
    data_name: str | None = None
    vocab_size: int | None = None
    seq_len: int = 32
    batch_size: int = 2
    norm: str = "pre"
    tensors: str = "stream"
    lr: float = 1e-3
    seed: int = 0
    thresholds: object | None = None
    progress: Progress | None = field(default=None, compare=False)
    run: str | None = None

    def __post_init__(self) -> None:
        if self.schemes is not None:
            import tinylm.init

            schemes = (self.schemes,) if isinstance(self.schemes, str) else tuple(self.schemes)
            for s in schemes:
                tinylm.init.get(s)  # an unknown name: ConfigError listing the registered ones
            object.__setattr__(self, "schemes", schemes)
        object.__setattr__(self, "depths", _sizes("depths", self.depths))
        object.__setattr__(self, "widths", _sizes("widths", self.widths))
        integer("seeds", self.seeds, low=1, fix="seeds=N", error=OptionsError)
        integer("steps", self.steps, low=0, fix="steps=N", error=OptionsError)
        choice("tensors", self.tensors, ("stream", "all"), error=OptionsError)
        _callable("progress", self.progress, "(done, total, description)")
        integer("seq_len", self.seq_len, low=1, fix="seq_len=N", error=OptionsError)
        if self.vocab_size is not None:
            integer("vocab_size", self.vocab_size, low=1, fix="vocab_size=N, or None to size it to the data",
                    error=OptionsError)
        integer("batch_size", self.batch_size, low=1, fix="batch_size=N", error=OptionsError)
        choice("norm", self.norm, ("pre", "post", "none"), error=OptionsError)
        number("lr", self.lr, low=0, strict_low=True, fix="lr=1e-3", error=OptionsError)
        integer("seed", self.seed, fix="seed=N", error=OptionsError)
        if self.data_name is not None and not isinstance(self.data_name, str):
            fail("data_name", self.data_name, "be a string or None", error=OptionsError)
        if self.thresholds is not None:
            from .judge.thresholds import Thresholds

            if not isinstance(self.thresholds, Thresholds):
                fail("thresholds", self.thresholds, "be a diagnostics.Thresholds (or None for the defaults)",
                     error=OptionsError)


#: the dtypes a side of a diff may be cast to (a copy; the caller's model is never cast)
DIFF_DTYPES = ("float64", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class DiffOptions:
    """What :func:`diagnostics.diff` and :func:`diagnostics.fingerprint` run each model on.

    batch_size, seq_len: the measured batch (seq_len None = min(model context, 256), 128 when the
        model states no context); the model reads ``seq_len`` tokens and is scored on the next.
    seed: seeds the random tokens (when none are given) and the windows drawn from a token stream.
    k: the sketch size per axis; each site's tensor, flattened to (N tokens, width), is reduced to
        the k x k matrix G^T X H / k with G (N, k) and H (width, k) fixed standard Gaussian draws
        (diagnostics.jobs.fingerprint). A departure is estimated to a relative standard error of
        about 1/(sqrt(2) k) for a difference spread over many directions, at most about 1/sqrt(k)
        for a rank-one difference (diagnostics.judge.departure.sketch_error).
    reference_dtype, candidate_dtype: None measures the model as it is; "float64", "float32",
        "bfloat16" or "float16" measures a copy cast to that dtype (the model is never cast).
    backward: also compare the gradient of the loss with respect to every site.
    inputs: what the model is called with, built from the token ids (B, T) (as DiagnoseOptions').
    tolerance: a diagnostics.judge.departure.Tolerance (None = the calibrated defaults).
    """

    batch_size: int = 4
    seq_len: int | None = None
    seed: int = 0
    k: int = 32
    reference_dtype: str | None = None
    candidate_dtype: str | None = None
    backward: bool = True
    inputs: Callable[[Any], Any] | None = field(default=None, compare=False)
    tolerance: object | None = None

    def __post_init__(self) -> None:
        integer("batch_size", self.batch_size, low=1, fix="batch_size=N", error=OptionsError)
        if self.seq_len is not None:
            integer("seq_len", self.seq_len, low=2, fix="seq_len=N (or None for the default)", error=OptionsError)
        integer("seed", self.seed, low=0, high=2**63 - 1, fix="seed=N", error=OptionsError)
        integer("k", self.k, low=2, high=1024, fix="k=N (32 is the default)", error=OptionsError)
        for name in ("reference_dtype", "candidate_dtype"):
            if getattr(self, name) is not None:
                choice(name, getattr(self, name), DIFF_DTYPES, fix=f"{name}=None or one of {', '.join(DIFF_DTYPES)}",
                       error=OptionsError)
        boolean("backward", self.backward, error=OptionsError)
        _callable("inputs", self.inputs, "ids -> dict, tuple or tensor")
