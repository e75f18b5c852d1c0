"""The thresholds of every verdict, one-shot and over training, in one validated dataclass."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from tinylm.validate import number

from ..errors import OptionsError

__all__ = ["Thresholds"]

#: the fields that count (blocks, losses, records, steps): whole numbers
_WHOLE = ("spike_warmup", "exploding_run", "early_persist", "plateau_steps")


@dataclass(frozen=True)
class Thresholds:
    """Thresholds of every verdict: each field's default, and the rule it sets.

    A block's gain is Var(x_{k+1}) / Var(x_k) on the residual stream forward, and
    Var(g_k) / Var(g_{k+1}) for its gradient on the way down (pre-norm: of Var(g) Var(x)).
    A weight's variance gain is std^2 fan_in (the variance it passes to a unit-variance input).
    How each default was chosen, and what healthy models measure against it, is in
    docs/verdicts.md ("How the thresholds were calibrated").

    One-shot (:func:`diagnostics.judge.judge`):

    exploding_gain = 4.0: exploding stream, exploding_run blocks in a row each with gain > 4.
    exploding_run = 3: that run's length in blocks (a shallower stack is not judged exploding by its gains).
    exploding_total = 1e4: exploding stream, total gain over a stack of at least exploding_run blocks > 1e4
        and geometric (:func:`.symptoms.growth`).
    vanishing_gain = 0.25: vanishing stream, exploding_run blocks in a row each with gain < 0.25.
    vanishing_branch = 1e-8: vanishing branch, Var(branch) / Var(the stream it is added to) < 1e-8.
    vanishing_grad = 1e-4: starved block, median weight-gradient std in it / the model's largest < 1e-4.
    dead_fraction = 0.9: dead tensor, fraction of its entries exactly zero > 0.9.
    dead_flat = 0.5: dead gates (warn), fraction of SiLU gate inputs x < -6 > 0.5, their mean < -0.25 std.
    dead_flat_fail = 0.9: the same fraction past which dead gates fail.
    saturated_rows = 0.9: saturated attention (warn), fraction of query rows (t >= 1) with max p > 0.99 > 0.9.
    saturated_fail = 0.99: the same fraction past which saturated attention fails.
    score_ratio = 4.0: misscaled scores, E[s^2] / (E[q^2] E[k^2]) > 4 on weights at their init; fail also > d_k/2.
    init_gain_high = 8.0: weights too large, median block-weight gain > 8 (fail > 8^2); q/k sqrt(g_q g_k) > 8.
    init_gain_low = 0.01: weights too small, median block-weight gain without residual outputs < 0.01 (fail < 0.01^2).
    init_drift = 4.0: badly scaled weights, median block-weight std / declared std outside [1/4, 4] (fail [1/16, 16]).
    post_norm_imbalance = 2.0: deep post-norm, exp(|slope| (n - 1)) > 2, slope of ln Var(g) over the n block outputs.
    nonfinite_fraction = 0.0: non-finite, fraction of a tensor's or parameter's entries inf or NaN > 0.
    loss_excess = 9.0: logits too large, loss - ln V > 9 ln V (loss > 10 ln V), where the loss is judged.

    Over training (the watch), each site against its own earlier records:

    watch_growth = 1e3: exploding, a forward variance > 1e3 x its lowest value at an earlier record.
    watch_shrink = 1e4: vanishing, a gradient variance < its highest value at an earlier record / 1e4.
    watch_move = 10.0: moved (the site a spike names first), a variance > 10 x its lowest earlier value.
    spike_factor = 1.5: spike, a loss > 1.5 x the running loss.
    spike_ema = 0.9: the running loss, ema <- 0.9 ema + (1 - 0.9) loss.
    spike_warmup = 10: no spike alarm before this many finite losses.

    Precursors over training (:mod:`diagnostics.judge.precursors`; diagnose reads the ones
    that a single measurement can show); the persistence and fail levels are in that module.
    How each default was calibrated, and the healthy runs' extremes beside it: docs/instability.md.

    attn_logit = 200.0: attention logit growth, the largest |attention logit| of a layer > 200.
    attn_entropy = 0.03: attention entropy collapse, a layer's mean row entropy / its causal
        maximum (mean over rows of ln(keys)) < 0.03.
    logz_limit = 30.0: log-partition drift, |mean log Z| of the output rows > 30 (log Z = logsumexp of a row's logits).
    logit_limit = 50.0: output logit growth, the largest |output logit| > 50.
    update_high = 0.3: updates too large, a matrix's ||W_after - W_before|| / ||W_before|| > 0.3 per step
        from step 10 on; at step 0 (Adam's first step moves every entry by the learning rate) the
        median matrix's ratio > 0.3 (first_update).
    update_low = 1e-4: updates too small, the median matrix's update ratio < 1e-4 per step.
    eps_share = 0.5: epsilon-dominated Adam, share of entries with sqrt(v_hat) < eps > 0.5.
    underflow_share = 0.01: gradient underflow, share of a block's gradient entries that are
        exact zeros in a float16 or bfloat16 run > 0.01; in any other dtype, the share of an
        embedding's, a branch's or the stream's gradient more than 0.01 above the run's own
        baseline (zero_gradient, :mod:`diagnostics.judge.baseline`).
    overflow_headroom = 8.0: overflow ahead, max |activation| > the training format's largest finite / 8.
    massive_ratio = 1e4: massive activations, a block output's max |x| / median |x| > 1e4.
    early_persist = 3: records in a row a precursor must hold before it is reported.
    plateau_steps = 100: stall, the loss has not fallen (its fitted slope over the last 100 steps
        is not below zero at the false-alarm rate) while updates are too small or Adam is
        epsilon-dominated.

    Raises:
        OptionsError: a field negative or not a number, or the fields inconsistent (each
            factor > 1, vanishing_gain < 1, spike_ema < 1, init_gain_low < init_gain_high,
            saturated_rows <= saturated_fail <= 1, dead_flat <= dead_flat_fail <= 1,
            exploding_run and spike_warmup whole numbers, exploding_run >= 1).
    """

    exploding_gain: float = 4.0
    exploding_total: float = 1e4
    vanishing_gain: float = 0.25
    vanishing_branch: float = 1e-8
    vanishing_grad: float = 1e-4
    dead_fraction: float = 0.9
    saturated_rows: float = 0.9
    nonfinite_fraction: float = 0.0
    exploding_run: int = 3
    loss_excess: float = 9.0
    score_ratio: float = 4.0
    saturated_fail: float = 0.99
    dead_flat: float = 0.5
    dead_flat_fail: float = 0.9
    init_gain_high: float = 8.0
    init_gain_low: float = 0.01
    init_drift: float = 4.0
    post_norm_imbalance: float = 2.0
    watch_growth: float = 1e3
    watch_shrink: float = 1e4
    watch_move: float = 10.0
    spike_factor: float = 1.5
    spike_ema: float = 0.9
    spike_warmup: int = 10
    attn_logit: float = 200.0
    attn_entropy: float = 0.03
    logz_limit: float = 30.0
    logit_limit: float = 50.0
    update_high: float = 0.3
    update_low: float = 1e-4
    eps_share: float = 0.5
    underflow_share: float = 0.01
    overflow_headroom: float = 8.0
    massive_ratio: float = 1e4
    early_persist: int = 3
    plateau_steps: int = 100

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            number(f.name, v, low=0.0, error=OptionsError)
        if self.exploding_gain <= 1 or self.vanishing_gain >= 1:
            raise OptionsError(f"exploding_gain={self.exploding_gain}, vanishing_gain={self.vanishing_gain}: "
                               "need exploding_gain > 1 > vanishing_gain")
        for name in ("watch_growth", "watch_shrink", "watch_move", "spike_factor"):
            if getattr(self, name) <= 1:
                raise OptionsError(f"{name}={getattr(self, name)!r}: must be > 1 (a factor of change); "
                                   "pass a larger value")
        if self.spike_ema >= 1:
            raise OptionsError(f"spike_ema={self.spike_ema!r}: must be in [0, 1); pass e.g. 0.9")
        for name in _WHOLE:
            if getattr(self, name) != int(getattr(self, name)):
                raise OptionsError(f"{name}={getattr(self, name)!r}: must be a whole number")
        for name in ("attn_entropy", "eps_share", "underflow_share"):
            if getattr(self, name) > 1:
                raise OptionsError(f"{name}={getattr(self, name)!r}: must be a fraction in [0, 1]")
        if self.update_low >= self.update_high:
            raise OptionsError(f"update_low={self.update_low}, update_high={self.update_high}: "
                               "need update_low < update_high")
        if self.exploding_run < 1:
            raise OptionsError(f"exploding_run={self.exploding_run!r}: must be at least 1 block")
        for name in ("init_drift", "score_ratio", "post_norm_imbalance", "init_gain_high"):
            if getattr(self, name) <= 1:
                raise OptionsError(f"{name}={getattr(self, name)!r}: must be > 1 (a factor); pass a larger value")
        if self.init_gain_low >= self.init_gain_high:
            raise OptionsError(f"init_gain_low={self.init_gain_low}, init_gain_high={self.init_gain_high}: "
                               "need init_gain_low < init_gain_high")
        for low, high in (("saturated_rows", "saturated_fail"), ("dead_flat", "dead_flat_fail")):
            if not getattr(self, low) <= getattr(self, high) <= 1:
                raise OptionsError(f"{low}={getattr(self, low)}, {high}={getattr(self, high)}: "
                                   f"need {low} <= {high} <= 1 (fractions)")

    def to_dict(self) -> dict[str, float]:
        """Every threshold as a float, by field name."""
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> "Thresholds":
        """The thresholds of :meth:`to_dict` (fields it lacks take their defaults; unknown keys raise)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise OptionsError(f"thresholds {unknown}: not fields of Thresholds; use {', '.join(sorted(names))}")
        kw = dict(data)
        for name in _WHOLE:
            if name in kw and float(kw[name]).is_integer():
                kw[name] = int(kw[name])
        return cls(**kw)
