"""coord_check: does a model's training move every activation by the same amount at every width?

    result = coord_check(lambda w: make_my_model(w), widths=(64, 128, 256, 512))
    result.ok          # no site's width exponent departs from muP's
    result.findings    # site, quantity, slope, interval, expected, severity, cause, fix
    result.to_frame()  # tidy: width, seed, step, site, kind, quantity, value

The pipeline, per width and seed: build the model (``torch.manual_seed(seed)`` first, so a
seed replicates the init), make its optimizer, then run ``steps`` training steps of next-token
cross-entropy on the same batches at every width, recording on the first batch every site of
:mod:`diagnostics.measure.coord` at init (``init``: its RMS) and after each step (``delta``: the
RMS of its change X_t - X_0), and every parameter's update RMS(W_t - W_0) (``update``, site =
the parameter's name). Then :mod:`diagnostics.judge.coord` fits each site's slope of log RMS
against log width and judges it against muP's exponent. Training on one batch, the forward of
step t is also the measurement of the model after t updates, so a step costs one forward and
one backward.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from tinylm.validate import check, fail, integer, number

from ..errors import OptionsError
from ..judge.coord import CONFIDENCE, TOLERANCE, TOLERANCE_BELOW, CoordFinding, Fit, fit_slopes, judge_coord
from ..measure.coord import KINDS, OUTPUT, CoordRecorder, delta_rms, rms
from ..measure.outputs import read_output
from ..measure.sites import model_sites
from .diagnose_sample import takes_targets

__all__ = ["coord_check", "CoordCheckOptions", "CoordCheckResult", "COORD_SCHEMA_VERSION"]

COORD_SCHEMA_VERSION = "1"
_COLUMNS = ("width", "seed", "step", "site", "kind", "quantity", "value")


@dataclass(frozen=True)
class CoordCheckOptions:
    """How :func:`coord_check` trains and measures.

    steps: optimizer steps per model (the last one's change is judged).
    seeds: models per width (seeds seed .. seed + seeds - 1): the replicates of the intervals.
    batch_size, seq_len: the shape of each batch (seq_len input tokens and their next tokens).
    lr: the default optimizer's learning rate (Adam over every parameter); ignored with
        ``make_optimizer``.
    seed: the first seed; it also draws the random tokens when none are given.
    vocab_size: the random tokens' range (None: the model's token embedding's rows).
    """

    steps: int = 10
    seeds: int = 2
    batch_size: int = 4
    seq_len: int = 32
    lr: float = 1e-2
    seed: int = 0
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        integer("steps", self.steps, low=1, fix="steps=N (at least 1)", error=OptionsError)
        integer("seeds", self.seeds, low=1, fix="seeds=N", error=OptionsError)
        integer("batch_size", self.batch_size, low=1, fix="batch_size=N", error=OptionsError)
        integer("seq_len", self.seq_len, low=1, fix="seq_len=N", error=OptionsError)
        number("lr", self.lr, low=0, strict_low=True, fix="lr=1e-2", error=OptionsError)
        integer("seed", self.seed, fix="seed=N", error=OptionsError)
        if self.vocab_size is not None:
            integer("vocab_size", self.vocab_size, low=1, fix="vocab_size=N, or None", error=OptionsError)


@dataclass
class CoordCheckResult:
    """The rows, the fitted slopes and the findings of one coordinate check."""

    widths: tuple[int, ...]
    options: CoordCheckOptions
    rows: list[dict[str, Any]]
    fits: list[Fit]
    findings: list[CoordFinding]
    schema_version: str = field(default=COORD_SCHEMA_VERSION)

    @property
    def ok(self) -> bool:
        """True when some site was judged and none departs from muP's exponent."""
        return not self.findings and bool(self._measured())

    def _measured(self) -> list[Fit]:
        """The judged fits with an interval (at least three points: two widths x two seeds, or three widths)."""
        return [f for f in self.judged if f.expected is not None and f.points >= 3 and math.isfinite(f.high)]

    @property
    def judged(self) -> list[Fit]:
        """The fits that are judged: ``init`` at step 0 and ``delta`` at the last step."""
        last = self.options.steps
        return [f for f in self.fits if (f.quantity, f.step) in (("init", 0), ("delta", last))]

    def to_frame(self):
        """Tidy rows: width, seed, step, site, kind, quantity, value."""
        import pandas as pd

        return pd.DataFrame(self.rows, columns=list(_COLUMNS))

    def slopes_frame(self):
        """One row per fitted (site, quantity, step): slope, interval, muP's and SP's exponents."""
        import pandas as pd

        return pd.DataFrame([asdict(f) for f in self.fits])

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "summary": self.headline, "ok": self.ok,
                "widths": list(self.widths), "options": asdict(self.options), "confidence": CONFIDENCE,
                "tolerance": TOLERANCE, "tolerance_below": TOLERANCE_BELOW,
                "findings": [f.to_dict() for f in self.findings],
                "slopes": [asdict(f) for f in self.judged], "rows": self.rows}

    def to_json(self) -> str:
        def safe(v):
            return None if isinstance(v, float) and not math.isfinite(v) else v
        d = self.to_dict()
        d["slopes"] = [{k: safe(v) for k, v in s.items()} for s in d["slopes"]]
        d["rows"] = [{k: safe(v) for k, v in r.items()} for r in d["rows"]]
        return json.dumps(d)

    @property
    def headline(self) -> str:
        judged = self._measured()
        sites = len({f.site for f in judged})
        w = f"widths {', '.join(map(str, self.widths))}"
        if not judged:
            return (f"coord check: not judged (no slope has an interval: give three widths, or two seeds; {w}, "
                    f"{self.options.seeds} seed(s))")
        if self.ok:
            return (f"coord check: ok, muP - every site's width exponent as muP expects ({sites} sites, {w}, "
                    f"{self.options.seeds} seed(s), {self.options.steps} steps)")
        causes = list(dict.fromkeys(f.cause for f in self.findings))
        return (f"coord check: {len({f.site for f in self.findings})} of {sites} sites depart from muP "
                f"({w}): {'; '.join(causes)}")

    def __str__(self) -> str:
        lines = [self.headline]
        lines += [f"  {f.message}" for f in self.findings]
        return "\n".join(lines)


def _batches(tokens: Tensor | None, model: nn.Module, options: CoordCheckOptions) -> list[Tensor]:
    """The batches (each (batch_size, seq_len + 1)) every width trains on; the first is measured."""
    L = options.seq_len + 1
    sites = model_sites(model)
    table = dict(model.named_modules()).get(sites.embedding) if sites.embedding else None
    rows = getattr(table, "num_embeddings", None)
    if tokens is None:
        vocab = options.vocab_size if options.vocab_size is not None else rows
        if vocab is None:
            fail("tokens", None, "be given for a model without a token embedding", "tokens=LongTensor (N, T+1)",
                 error=OptionsError)
        gen = torch.Generator().manual_seed(options.seed)
        return [torch.randint(0, vocab, (options.batch_size, L), generator=gen)]
    need = options.batch_size * options.steps  # rows: one batch per step at most
    if isinstance(tokens, Tensor):
        t = tokens.detach()
    else:  # a numpy array or memmap: copy only what the steps read
        import numpy as np

        flat = np.asarray(tokens)
        t = torch.from_numpy(np.array(flat[: need * L] if flat.ndim == 1 else flat[:need], dtype=np.int64))
    t = t.long()
    if t.dim() == 1:
        t = t[: min(t.numel() // L, need) * L].view(-1, L)
    if t.dim() != 2 or t.shape[1] < 2 or t.shape[0] < 1:
        fail("tokens", tuple(t.shape), "be a 1-D token stream of at least seq_len + 1 tokens or a 2-D "
             "(N, seq_len + 1) tensor with N >= 1", error=OptionsError)
    if isinstance(rows, int) and (int(t.max()) >= rows or int(t.min()) < 0):
        fail("tokens", f"ids in [{int(t.min())}, {int(t.max())}]", f"lie in [0, {rows}) (the token embedding's rows)",
             error=OptionsError)
    t = t[:need]
    return [t[i: i + options.batch_size] for i in range(0, t.shape[0], options.batch_size)]


def _loss(model: nn.Module, batch: Tensor, recorder: CoordRecorder | None) -> Tensor:
    x, y = batch[:, :-1], batch[:, 1:]
    out = model(x, targets=y) if takes_targets(model) else model(x)
    logits, _ = read_output(out)
    if logits is None or logits.shape[:2] != y.shape:
        fail("make_model", type(model).__name__, "build a model whose output holds logits (B, T, V)",
             error=OptionsError)
    if recorder is not None:
        recorder.record_output(logits)
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), y.flatten())


def _default_optimizer(lr: float):
    return lambda model, width: torch.optim.Adam(model.parameters(), lr=lr)


def _run(model: nn.Module, opt, batches: list[Tensor], steps: int, emit: Callable) -> None:
    """Train ``steps`` steps; emit(step, site, kind, quantity, value) for each measurement. With
    one batch its training forward is the measurement; with several the first batch is measured
    by a forward of its own before each step."""
    rec = CoordRecorder(model)
    start: dict[str, Tensor] = {}
    params0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    single = len(batches) == 1
    for t in range(steps + 1):
        with rec.capture(), torch.set_grad_enabled(single and t < steps):
            loss = _loss(model, batches[0], rec)
        if t == 0:
            start = dict(rec.values)
            for site, x in start.items():
                emit(0, site, rec.kinds[site], "init", rms(x))
        else:
            for site, x in rec.values.items():
                if site in start:
                    emit(t, site, rec.kinds[site], "delta", delta_rms(x, start[site]))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    emit(t, n, "parameter", "update", rms(p.detach() - params0[n]))
        if t == steps:
            break
        if not single:
            loss = _loss(model, batches[t % len(batches)], None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def coord_check(make_model: Callable[[int], nn.Module], widths, *,
                make_optimizer: Callable[[nn.Module, int], Any] | None = None, tokens: Tensor | None = None,
                options: CoordCheckOptions = CoordCheckOptions(), progress: Callable | None = None
                ) -> CoordCheckResult:
    """Train ``make_model(width)`` at each width a few steps and judge each site's width exponent.

    Args:
        make_model: width -> a fresh model (its output: logits (B, T, V), or an object with them).
        widths: at least two distinct positive widths, increasing.
        make_optimizer: (model, width) -> a torch optimizer (default: Adam at ``options.lr``).
        tokens: a 1-D token stream or (N, seq_len + 1) rows; None: random tokens.
        options: a :class:`CoordCheckOptions`.
        progress: progress(done, total, description) after each model, or None.
    Returns: a :class:`CoordCheckResult`.
    """
    check("make_model", make_model, callable, "be a callable width -> nn.Module", error=OptionsError)
    if make_optimizer is not None:
        check("make_optimizer", make_optimizer, callable, "be a callable (model, width) -> optimizer",
              error=OptionsError)
    if not isinstance(options, CoordCheckOptions):
        fail("options", type(options).__name__, "be a diagnostics.CoordCheckOptions", error=OptionsError)
    widths = _widths(widths)
    make_optimizer = make_optimizer or _default_optimizer(options.lr)
    rows: list[dict[str, Any]] = []
    batches = None
    total, done = len(widths) * options.seeds, 0
    for width in widths:
        for s in range(options.seeds):
            seed = options.seed + s
            torch.manual_seed(seed)
            model = make_model(width)
            if not isinstance(model, nn.Module):
                fail("make_model", type(model).__name__, "return an nn.Module", error=OptionsError)
            model.train()
            if batches is None:
                batches = _batches(tokens, model, options)

            def emit(step, site, kind, quantity, value, _w=width, _s=seed):
                rows.append({"width": _w, "seed": _s, "step": step, "site": site, "kind": kind,
                             "quantity": quantity, "value": value})

            _run(model, make_optimizer(model, width), batches, options.steps, emit)
            done += 1
            if progress is not None:
                progress(done, total, f"width {width}, seed {seed}")
    fits = _fits(rows)
    judged = [f for f in fits if (f.quantity, f.step) in (("init", 0), ("delta", options.steps))]
    return CoordCheckResult(widths, options, rows, fits, judge_coord(judged))


def _widths(widths) -> tuple[int, ...]:
    try:
        out = tuple(widths)
    except TypeError:
        fail("widths", widths, "be a sequence of positive integers", "widths=(64, 128, 256, 512)", error=OptionsError)
    for w in out:
        integer("widths", w, low=1, fix="widths=(64, 128, 256, 512)", error=OptionsError)
    if len(set(out)) < 2:
        fail("widths", out, "hold at least two distinct widths (a slope needs two)", "widths=(64, 128, 256, 512)",
             error=OptionsError)
    return tuple(sorted(set(out)))


def _fits(rows: list[dict[str, Any]]) -> list[Fit]:
    points: dict[tuple[str, str, str, int], list[tuple[int, float]]] = {}
    for r in rows:
        if r["kind"] in KINDS:
            points.setdefault((r["site"], r["kind"], r["quantity"], r["step"]), []).append((r["width"], r["value"]))
    return fit_slopes(points)
