"""The options of a probe and of a diagnosis: one dataclass each, validated eagerly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from tinylm.errors import TinyLMError
from tinylm.validate import boolean, choice, fail, flag_of, integer

__all__ = ["OptionsError", "ProbeOptions", "DiagnoseOptions", "Progress", "THEORY_MODES"]

#: progress(done, total, description): called as work advances (the CLI draws a bar).
Progress = Callable[[int, int, str], None]

#: theory modes a user may ask for; "none" is an alias of "off" (measurement only).
THEORY_MODES = ("auto", "local", "global", "off", "none")


class OptionsError(TinyLMError):
    """An option value that cannot work; the message names it and the fix."""


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
    """

    modules: tuple[str, ...] | None = None
    backward: bool = True
    attention: bool = True
    cosine: bool = True
    params: bool = True
    spectral: bool = False
    restore_grads: bool = True
    eval_mode: bool = True

    def __post_init__(self) -> None:
        if self.modules is not None and (isinstance(self.modules, str) or not all(
                isinstance(m, str) for m in self.modules)):
            fail("modules", self.modules, "be a tuple of module names (or None for the default set)",
                 "modules=('layers.0', ...)", error=OptionsError)
        for name in ("backward", "attention", "cosine", "params", "spectral", "restore_grads", "eval_mode"):
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
    thresholds: a diagnostics.judge.verdicts.Thresholds (None = the documented defaults).
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
        for name in ("inputs", "loss_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                fail(name, getattr(self, name), "be a callable" + (" ids -> dict, tuple or tensor" if name == "inputs"
                                                                   else " (logits, targets) -> scalar loss"),
                     error=OptionsError)
        for name in ("batch_size", "batches", "seeds"):
            integer(name, getattr(self, name), low=1, fix=f"{flag_of(name)} N", error=OptionsError)
        if self.seq_len is not None:
            integer("seq_len", self.seq_len, low=2, fix="--seq-len N (or None for the default)", error=OptionsError)
        integer("seed", self.seed, low=0, high=2**63 - 1, fix="--seed N", error=OptionsError)
        choice("theory", self.theory, THEORY_MODES, fix="--theory MODE", error=OptionsError)
        if self.theory == "none":
            object.__setattr__(self, "theory", "off")
        if self.progress is not None and not callable(self.progress):
            fail("progress", self.progress, "be a callable (done, total, description)", error=OptionsError)


__all__ += ["DiffOptions", "DIFF_DTYPES"]

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
        integer("batch_size", self.batch_size, low=1, fix="--batch-size N", error=OptionsError)
        if self.seq_len is not None:
            integer("seq_len", self.seq_len, low=2, fix="--seq-len N (or None for the default)", error=OptionsError)
        integer("seed", self.seed, low=0, high=2**63 - 1, fix="--seed N", error=OptionsError)
        integer("k", self.k, low=2, high=1024, fix="--k N (32 is the default)", error=OptionsError)
        for name in ("reference_dtype", "candidate_dtype"):
            if getattr(self, name) is not None:
                choice(name, getattr(self, name), DIFF_DTYPES, fix=f"{name}=None or one of {', '.join(DIFF_DTYPES)}",
                       error=OptionsError)
        boolean("backward", self.backward, error=OptionsError)
        if self.inputs is not None and not callable(self.inputs):
            fail("inputs", self.inputs, "be a callable ids -> dict, tuple or tensor", error=OptionsError)
