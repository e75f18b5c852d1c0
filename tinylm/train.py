"""Training a tinylm model with a watch: the loop behind ``tinylm train``.

One step t = 0 .. steps-1 (CS336 assignment 1, section 4):

    x, y      = get_batch(tokens, B, T, generator)          # (B, T) windows, y shifted by one
    loss      = cross_entropy(model(x), y)                   # mean next-token CE, nats
    objective = loss + z_loss * mean_t (log Z_t)^2           # z_loss = 0 (default): the CE alone
    g         = grad objective;  n = ||g||_2 over all params # global norm
    g         = g * min(1, clip / n)                         # clipping by global norm
    lr_t      = schedule(t)                                  # warmup, then cosine to a floor
    W         = AdamW(W, g, lr_t, betas, eps, weight_decay)

A monitor sees every step through a few callbacks (:class:`Monitor`): whether to
record this step, a context to run the forward and backward in, an alarm on the
loss (spike or non-finite: the step is then recorded too), and the record after
the optimizer step. The training watch (``diagnostics.Watch``) is such a monitor:
every ``watch_every`` steps it keeps per-tensor moments and per-parameter update
ratios in a compact history. tinylm knows nothing of diagnostics; the caller
hands the watch in (``train(..., monitor=Watch(model, every=25))``). A checkpoint holds
the model, the optimizer, the iteration, the sampler's generator state, the
training options and the history, so a run resumes where it stopped and
reproduces the same numbers as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import numpy as np
import torch
from torch import nn

from tinylm import functional as F
from tinylm.errors import CheckpointError, TinyLMError

from . import validate
from .data import DataError, check_vocab, get_batch

__all__ = ["TrainError", "TrainOptions", "StepInfo", "TrainResult", "Monitor", "lr_schedule", "train", "load_training",
           "save_training"]


class TrainError(TinyLMError):
    """A training setting that cannot work; the message names the option and the fix."""


@dataclass(frozen=True)
class TrainOptions:
    """Settings of one training run.

    Args:
        steps: total optimizer steps (a resumed run continues up to this number).
        batch_size: sequences per step B.
        lr: peak learning rate alpha_max, reached at the end of warmup.
        min_lr: the floor alpha_min of the cosine decay (None: lr / 10).
        warmup: linear warmup steps T_w (None: min(100, steps // 10)).
        weight_decay: AdamW's decoupled weight decay lambda.
        beta1, beta2, adam_eps: AdamW's moment decay rates and epsilon.
        clip: maximum global gradient norm (0 disables clipping).
        seed: seeds the batch sampler (the model's init has its own seed).
        watch_every: record the watch every K steps (0 turns the watch off).
        spike_factor: a step whose loss exceeds spike_factor x the running (EMA) loss is a spike.
        checkpoint_every: also save a checkpoint every N steps (0: only at the end).
        stop_on_nonfinite: stop (before the optimizer step) when the loss is NaN or inf.
        z_loss: coefficient c >= 0 of the auxiliary z-loss (:func:`tinylm.functional.z_loss`):
            the gradient is taken of CE + c mean_t (log Z_t)^2, log Z_t the logsumexp of row t's
            logits (PaLM uses 1e-4); 0 (default) trains on the cross-entropy alone. The loss the
            loop reports, records and checks (``StepInfo.loss``, the monitor's ``alarm`` and
            ``commit``, so the watch's history and its spike and non-finite alarms) stays the
            cross-entropy in nats.
    """

    steps: int
    batch_size: int = 32
    lr: float = 3e-3
    min_lr: float | None = None
    warmup: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    clip: float = 1.0
    seed: int = 0
    watch_every: int = 25
    spike_factor: float = 1.5
    checkpoint_every: int = 0
    stop_on_nonfinite: bool = True
    z_loss: float = 0.0

    def __post_init__(self) -> None:
        def integer(name: str, value: Any, low: int, high: int | None = None) -> None:
            validate.integer(name, value, low=low, high=high, fix=f"{name}=N", error=TrainError)

        def number(name: str, value: Any, low: float, strict: bool) -> None:
            validate.number(name, value, low=low, strict_low=strict, fix=f"{name}=X", error=TrainError)

        integer("steps", self.steps, 1)
        integer("batch_size", self.batch_size, 1)
        integer("seed", self.seed, 0, 2**63 - 1)  # torch's generators take 64-bit seeds
        integer("watch_every", self.watch_every, 0)
        integer("checkpoint_every", self.checkpoint_every, 0)
        number("lr", self.lr, 0.0, True)
        if self.min_lr is not None:
            number("min_lr", self.min_lr, 0.0, False)
            validate.check("min_lr", self.min_lr, lambda v: v <= self.lr, f"not exceed the peak lr={self.lr}",
                           fix="a smaller min_lr=X", error=TrainError)
        if self.warmup is not None:
            integer("warmup", self.warmup, 0)
        number("weight_decay", self.weight_decay, 0.0, False)
        number("clip", self.clip, 0.0, False)
        number("adam_eps", self.adam_eps, 0.0, True)
        number("spike_factor", self.spike_factor, 1.0, True)
        number("z_loss", self.z_loss, 0.0, False)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            number(name, value, 0.0, False)
            validate.check(name, value, lambda v: v < 1, "be in [0, 1)", fix=f"{name}=X", error=TrainError)

    @property
    def floor(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def warmup_steps(self) -> int:
        return min(100, self.steps // 10) if self.warmup is None else self.warmup

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], **changes: Any) -> "TrainOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in {**data, **changes}.items() if k in known})


def lr_schedule(t: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """The CS336 schedule: linear warmup, cosine decay to a floor, then the floor.

        t < T_w:            alpha_t = t / T_w * alpha_max
        T_w <= t <= T_c:    alpha_t = alpha_min + (1 + cos(pi (t - T_w) / (T_c - T_w))) / 2 * (alpha_max - alpha_min)
        t > T_c:            alpha_t = alpha_min

    with T_c = ``total``. A step-0 rate of 0 would waste the first step, so the
    warmup uses (t + 1) / T_w: step T_w - 1 reaches alpha_max.
    """
    if warmup > 0 and t < warmup:
        return lr * (t + 1) / warmup
    if t >= total:
        return min_lr
    span = max(total - warmup, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / span)) * (lr - min_lr)


@dataclass
class StepInfo:
    """What one step did, for a progress display (``on_step``)."""

    step: int  # iterations completed after this step (1-based)
    steps: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float  # over this step
    recorded: bool  # the watch recorded this step


@dataclass
class TrainResult:
    """The trained model and what happened."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    iteration: int
    history: dict[str, Any] | None  # the monitor's history (None without one)
    stopped: str | None = None  # why training stopped early (non-finite loss), else None
    events: list[Any] = field(default_factory=list)  # the monitor's events (the watch's WatchEvent)
    seconds: float = 0.0  # wall-clock time of the loop
    cpu_seconds: float = 0.0  # CPU time of this process during the loop (all its threads)
    tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


class Monitor:
    """What the loop asks of a monitor, and the monitor that records nothing.

    The loop, at step t: ``due(t)`` says whether to record; the forward and backward run
    inside ``capture()`` when recording; ``alarm(loss)`` returns "nonfinite", "spike" or
    None (an alarm on a step not being recorded makes the loop run that step again
    inside ``capture()``, when ``enabled``); before the optimizer step of a recorded step
    ``snapshot_params()`` is taken and after it ``commit(t, loss, lr, grad_norm, reason,
    before)`` called; ``log(t, loss, lr, grad_norm)`` after every step. ``history`` is
    stored in the checkpoint, ``events`` returned in the :class:`TrainResult`.
    """

    enabled: bool = False
    history: dict[str, Any] | None = None

    def __init__(self) -> None:
        self.events: list[Any] = []

    def due(self, t: int) -> bool:
        return False

    def capture(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def alarm(self, loss: float) -> str | None:
        return None if math.isfinite(loss) else "nonfinite"

    def snapshot_params(self) -> dict[str, torch.Tensor]:
        return {}

    def commit(self, t: int, loss: float, lr: float, grad_norm: float, reason: str = "interval",
               before: dict[str, torch.Tensor] | None = None) -> None:
        pass

    def log(self, t: int, loss: float, lr: float, grad_norm: float) -> None:
        pass


def _sampler_generator(options: TrainOptions, state: torch.Tensor | None) -> torch.Generator:
    gen = torch.Generator().manual_seed(options.seed)
    if state is not None:
        try:
            gen.set_state(state)
        except (RuntimeError, TypeError, ValueError):
            validate.refuse("the checkpoint's sampler state is damaged (not a CPU generator state)",
                            "resume from another checkpoint, or start a new run with the same seed=N",
                            error=CheckpointError)
    return gen


def make_optimizer(model: nn.Module, options: TrainOptions) -> torch.optim.AdamW:
    """AdamW over every parameter (a tied matrix once), decay applied to all, as in CS336; a model
    in muP gets its per-parameter learning rates (``tinylm.mup.param_groups``: each group's
    ``lr_scale`` multiplies the schedule's lr)."""
    from .mup import param_groups

    return torch.optim.AdamW(
        param_groups(model, options.lr, "adam"),
        lr=options.lr,
        betas=(options.beta1, options.beta2),
        eps=options.adam_eps,
        weight_decay=options.weight_decay,
    )


def check_data(tokens: np.ndarray, model: nn.Module, source: str) -> None:
    """Raise a DataError when the data does not fit the model's vocabulary or context."""
    config = model.config
    check_vocab(tokens, config.vocab_size, source)
    if len(tokens) < config.context_length + 1:
        validate.refuse(f"{source}: {len(tokens)} tokens are fewer than context_length + 1 = {config.context_length + 1}",
                        "use more data or a shorter context_length=N", error=DataError)


def save_training(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, iteration: int,
                  history: dict[str, Any], options: TrainOptions, generator: torch.Generator,
                  data: str | None = None) -> None:
    """Write a resumable tinylm checkpoint (atomic; weights_only-loadable)."""
    from tinylm import checkpoint

    checkpoint.save(
        path,
        model,
        optimizer=optimizer.state_dict(),
        iteration=int(iteration),
        history=history,
        train_options=options.to_dict(),
        sampler_state=generator.get_state(),
        train_data=data,
    )


def load_training(path: str | os.PathLike) -> tuple[nn.Module, dict[str, Any]]:
    """Read a checkpoint to resume: (model in train mode, {"optimizer", "iteration", "history", "options",
    "sampler_state", "data"}).

    The model comes from ``tinylm.checkpoint.load`` (any supported format); the
    optimizer state and the rest are read from the same file with ``weights_only=True``.
    """
    from tinylm import checkpoint

    model, info = checkpoint.load(path)
    if info.nonfinite:
        validate.file_error(path, f"parameters hold NaN or inf ({', '.join(info.nonfinite[:3])})",
                            "resume from an earlier checkpoint", error=CheckpointError)
    extra: dict[str, Any] = {"optimizer": None, "iteration": int(info.iteration or 0), "history": info.history,
                             "options": None, "sampler_state": None, "data": None}
    if info.format in ("tinylm", "training"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        extra["optimizer"] = obj.get("optimizer")
        extra["options"] = obj.get("train_options") if isinstance(obj.get("train_options"), dict) else None
        state = obj.get("sampler_state")
        extra["data"] = obj.get("train_data") if isinstance(obj.get("train_data"), str) else None
        extra["sampler_state"] = state if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 else None
    model.train()
    return model, extra


def train(
    model: nn.Module,
    tokens: np.ndarray,
    options: TrainOptions,
    *,
    output: str | os.PathLike | None = None,
    resume: dict[str, Any] | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    monitor: Monitor | Any | None = None,
    data: str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrainResult:
    """Train ``model`` on ``tokens`` for ``options.steps`` steps (see the module docstring).

    Args:
        model: a ``tinylm.TransformerLM`` (anything with ``.config.vocab_size`` and
            ``.config.context_length`` mapping (B, T) ids to (B, T, V) logits).
        tokens: 1-D integer token ids (``tinylm.data.load_tokens`` or ``stdlib_corpus``).
        output: where to write the checkpoint (at the end, on a non-finite stop and
            every ``checkpoint_every`` steps); None writes nothing.
        resume: the dict of :func:`load_training` (optimizer state, iteration,
            history, sampler state) to continue a run.
        on_step: called after every step with its :class:`StepInfo` (a progress display).
        monitor: what watches the run (:class:`Monitor`'s methods; ``diagnostics.Watch``
            records per-tensor statistics); None records nothing. A resumed run's
            monitor should start from ``resume["history"]``.
        data: the token file's path, stored in the checkpoint so that a resume finds it
            (None: the built-in corpus or data given in memory).
        optimizer: the optimizer to step, built over ``model``'s parameters (None:
            :func:`make_optimizer`); its groups' lr follow the schedule, a resumed run loads its state.
    Returns:
        a :class:`TrainResult` with the model (left in train mode), optimizer and history.
    """
    validate.check_type("options", options, TrainOptions, "a TrainOptions", error=TypeError)
    config = model.config
    check_data(tokens, model, "data")
    resume = resume or {}
    start = int(resume.get("iteration") or 0)
    if start >= options.steps:
        validate.refuse(f"the checkpoint is already at iteration {start} >= steps={options.steps}",
                        "pass a larger steps=N", error=TrainError, argument="steps")
    generator = _sampler_generator(options, resume.get("sampler_state"))
    if optimizer is None:
        optimizer = make_optimizer(model, options)
    validate.check_type("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer", error=TrainError)
    if resume.get("optimizer") is not None:
        try:
            optimizer.load_state_dict(resume["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            validate.refuse(f"the checkpoint's optimizer state does not fit the model ({e})",
                            "resume from a matching checkpoint", error=CheckpointError)
    watch = monitor if monitor is not None else Monitor()
    params = [p for p in model.parameters() if p.requires_grad]
    clip = options.clip if options.clip > 0 else math.inf
    B, T = options.batch_size, config.context_length
    model.train()
    result = TrainResult(model, optimizer, start, watch.history)
    t_start, cpu_start = time.perf_counter(), time.process_time()

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> float:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        objective = loss + options.z_loss * F.z_loss(logits) if options.z_loss > 0 else loss
        objective.backward()
        return float(loss.detach())  # the cross-entropy: what is reported, recorded and checked

    def save(iteration: int) -> None:
        if output is not None:
            save_training(output, model, optimizer, iteration, watch.history, options, generator, data)

    for t in range(start, options.steps):
        t0 = time.perf_counter()
        lr = lr_schedule(t, options.lr, options.floor, options.warmup_steps, options.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        x, y = get_batch(tokens, B, T, generator)
        recorded = watch.due(t)
        optimizer.zero_grad(set_to_none=True)
        if recorded:
            with watch.capture():
                loss = forward_backward(x, y)
        else:
            loss = forward_backward(x, y)
        alarm = watch.alarm(loss)  # "spike", "nonfinite" or None
        if alarm and not recorded and watch.enabled:  # record this very step: run it again under the watch
            optimizer.zero_grad(set_to_none=True)
            with watch.capture():
                loss = forward_backward(x, y)
            recorded = True
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if alarm == "nonfinite" and options.stop_on_nonfinite:
            watch.commit(t, loss, lr, grad_norm, reason=alarm)
            watch.log(t, loss, lr, grad_norm)
            result.stopped = f"non-finite loss ({loss}) at step {t}; stopped before the optimizer step"
            result.iteration = t
            break
        if recorded:
            before = watch.snapshot_params()
        optimizer.step()
        if recorded:
            watch.commit(t, loss, lr, grad_norm, reason=alarm or "interval", before=before)
        watch.log(t, loss, lr, grad_norm)
        result.iteration = t + 1
        result.tokens += B * T
        if options.checkpoint_every and result.iteration % options.checkpoint_every == 0 and result.iteration < options.steps:
            save(result.iteration)
        if on_step is not None:
            dt = time.perf_counter() - t0
            on_step(StepInfo(t + 1, options.steps, loss, lr, grad_norm, B * T / dt if dt > 0 else float("nan"), recorded))
    result.seconds = time.perf_counter() - t_start
    result.cpu_seconds = time.process_time() - cpu_start
    result.events = list(watch.events)
    save(result.iteration)
    return result
