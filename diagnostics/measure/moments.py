"""The records a probe fills: mergeable moments per tensor, attention panels, parameter statistics.

A tensor is reduced inside the hook (:func:`diagnostics.measure.reducer.reduce`) to a fixed
float64 vector (:data:`FIELDS`); vectors merge with Chan's pairwise update

    n = n_a + n_b,  delta = mean_b - mean_a,
    mean = mean_a + delta n_b / n,  M2 = M2_a + M2_b + delta^2 n_a n_b / n,

and by sums / maxima / minima for the rest, so a run's memory does not grow with
the number of batches and two runs merge into what one run over both gives (up
to float64 rounding). The records here hold the merged vectors as Python floats.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .reference import ATTN_FIELDS, FIELDS

__all__ = ["FIELDS", "ATTN_FIELDS", "Moments", "AttnMoments", "ParamStats", "ProbeStats"]


def _vec_to_dict(v: list[float], names: tuple[str, ...]) -> dict[str, float]:
    return dict(zip(names, v))


@dataclass
class Moments:
    """Merged statistics of one tensor (see :data:`FIELDS`); plain Python floats.

    var = m2 / count (population variance of the finite entries);
    mean_square = var + mean^2; fractions are over all measured entries.
    """

    n_total: float = 0.0
    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0
    max_abs: float = 0.0
    n_zero: float = 0.0
    n_fp16_under: float = 0.0
    n_fp16_over: float = 0.0
    n_bf16_under: float = 0.0
    n_bf16_over: float = 0.0

    @classmethod
    def from_vector(cls, v: list[float]) -> "Moments":
        return cls(**_vec_to_dict(v, FIELDS))

    def vector(self) -> list[float]:
        return [getattr(self, f) for f in FIELDS]

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count else math.nan

    @property
    def std(self) -> float:
        return math.sqrt(self.var) if self.count else math.nan

    @property
    def mean_square(self) -> float:
        return self.var + self.mean**2 if self.count else math.nan

    def _frac(self, n: float) -> float:
        return n / self.n_total if self.n_total else 0.0

    @property
    def frac_zero(self) -> float:
        return self._frac(self.n_zero)

    @property
    def frac_nonfinite(self) -> float:
        return self._frac(self.n_total - self.count)

    @property
    def frac_fp16_underflow(self) -> float:
        return self._frac(self.n_fp16_under)

    @property
    def frac_fp16_overflow(self) -> float:
        return self._frac(self.n_fp16_over)

    @property
    def frac_bf16_underflow(self) -> float:
        return self._frac(self.n_bf16_under)

    @property
    def frac_bf16_overflow(self) -> float:
        return self._frac(self.n_bf16_over)

    def merge(self, other: "Moments") -> "Moments":
        """Chan's merge (a new object; neither input changes)."""
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * other.count / n if n else 0.0
        m2 = self.m2 + other.m2 + (delta * delta * self.count * other.count / n if n else 0.0)
        out = Moments(*[a + b for a, b in zip(self.vector(), other.vector())])
        out.mean, out.m2, out.max_abs = mean, m2, max(self.max_abs, other.max_abs)
        return out


@dataclass
class AttnMoments:
    """Merged attention panel of one probs Tap (see :data:`ATTN_FIELDS`)."""

    rows: float = 0.0
    entropy_mean: float = 0.0
    entropy_m2: float = 0.0
    entropy_min: float = math.inf
    rows_after_first: float = 0.0
    rows_saturated: float = 0.0

    @classmethod
    def from_vector(cls, v: list[float]) -> "AttnMoments":
        return cls(**_vec_to_dict(v, ATTN_FIELDS))

    def vector(self) -> list[float]:
        return [getattr(self, f) for f in ATTN_FIELDS]

    @property
    def saturated_frac(self) -> float:
        return self.rows_saturated / self.rows_after_first if self.rows_after_first else 0.0

    def merge(self, other: "AttnMoments") -> "AttnMoments":
        n = self.rows + other.rows
        delta = other.entropy_mean - self.entropy_mean
        out = AttnMoments(*[a + b for a, b in zip(self.vector(), other.vector())])
        out.entropy_mean = self.entropy_mean + delta * other.rows / n if n else 0.0
        out.entropy_m2 = self.entropy_m2 + other.entropy_m2 + (delta * delta * self.rows * other.rows / n if n else 0.0)
        out.entropy_min = min(self.entropy_min, other.entropy_min)
        return out


@dataclass
class ParamStats:
    """One parameter at the end of a run.

    std, grad_std: population std of the entries / of the gradient the run produced
    (None: no gradient). declared_std: of its init scheme (None: unknown);
    drift = std / declared_std. spectral_norm = largest singular value; stable_rank =
    ||W||_F^2 / ||W||_2^2 (2-D parameters, when asked). frac_nonfinite of the entries.
    note: what was asked and not measured, and why (e.g. the spectral figures of a sharded
    parameter: they need the full matrix); "" when everything asked was measured.
    """

    shape: tuple[int, ...]
    std: float
    grad_std: float | None
    frac_nonfinite: float
    grad_frac_nonfinite: float | None = None
    declared_std: float | None = None
    declared: str = ""
    spectral_norm: float | None = None
    stable_rank: float | None = None
    note: str = ""

    @property
    def drift(self) -> float | None:
        if self.declared_std is None or self.declared_std == 0 or not math.isfinite(self.std):
            return None
        return self.std / self.declared_std


@dataclass
class ProbeStats:
    """What a probe measured: merged moments per (tensor name, direction), and more.

    tensors: {(name, "forward"|"backward"): Moments}. kinds: {name: kind}. order: names
    in the order their forward outputs first appeared. attention: {probs Tap name:
    AttnMoments}. cosine: {residual point name: Moments of per-sequence cosine}.
    params: {parameter name: ParamStats} (the model at the end of the first run merged).
    steps: forward passes measured. inv_ms: {stream point: Moments of 1/(mean_i x_i^2 + eps)
    per token} at the residual points a norm reads. norm_back: {RMSNorm name: Moments over
    tokens of mean_i(g_y,i^2) / (mean_i x_i^2 + eps)}, the per-token product RMSNorm's
    backward scales by (g_y: gradient at the norm's output, x: its input). flat: {SiLU gate
    input name (a tinylm FFN's ``w1``): [entries below FLAT_EDGE, entries measured]}, the
    inputs that sit in SiLU's flat region (see :data:`diagnostics.measure.probe.FLAT_EDGE`).
    """

    tensors: dict[tuple[str, str], Moments] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    attention: dict[str, AttnMoments] = field(default_factory=dict)
    cosine: dict[str, Moments] = field(default_factory=dict)
    params: dict[str, ParamStats] = field(default_factory=dict)
    steps: int = 0
    inv_ms: dict[str, Moments] = field(default_factory=dict)
    norm_back: dict[str, Moments] = field(default_factory=dict)
    flat: dict[str, list[float]] = field(default_factory=dict)

    @property
    def flat_frac(self) -> dict[str, float]:
        """{gate input name: fraction of its entries in SiLU's flat region}."""
        return {k: (v[0] / v[1] if v[1] else 0.0) for k, v in self.flat.items()}

    def merge(self, other: "ProbeStats") -> "ProbeStats":
        """A new ProbeStats over both runs (moments merged; params kept from ``self`` when present)."""
        def both(a: dict, b: dict) -> dict:
            out = dict(a)
            for k, v in b.items():
                out[k] = out[k].merge(v) if k in out else v
            return out

        order = list(self.order) + [n for n in other.order if n not in set(self.order)]
        return ProbeStats(
            tensors=both(self.tensors, other.tensors), kinds={**other.kinds, **self.kinds}, order=order,
            attention=both(self.attention, other.attention), cosine=both(self.cosine, other.cosine),
            params=dict(self.params) if self.params else dict(other.params), steps=self.steps + other.steps,
            inv_ms=both(self.inv_ms, other.inv_ms), norm_back=both(self.norm_back, other.norm_back),
            flat={k: [a + b for a, b in zip(self.flat.get(k, [0.0, 0.0]), other.flat.get(k, [0.0, 0.0]))]
                  for k in {**self.flat, **other.flat}},
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible dict (infinite floats kept as Python floats: use json allow_nan)."""
        return {
            "tensors": [[name, d, m.vector()] for (name, d), m in self.tensors.items()],
            "kinds": dict(self.kinds),
            "order": list(self.order),
            "attention": {k: v.vector() for k, v in self.attention.items()},
            "cosine": {k: v.vector() for k, v in self.cosine.items()},
            "params": {k: {**asdict(v), "shape": list(v.shape)} for k, v in self.params.items()},
            "steps": self.steps,
            "inv_ms": {k: v.vector() for k, v in self.inv_ms.items()},
            "norm_back": {k: v.vector() for k, v in self.norm_back.items()},
            "flat": {k: list(v) for k, v in self.flat.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProbeStats":
        return cls(
            tensors={(name, direction): Moments.from_vector(v) for name, direction, v in d["tensors"]},
            kinds=dict(d["kinds"]),
            order=list(d["order"]),
            attention={k: AttnMoments.from_vector(v) for k, v in d["attention"].items()},
            cosine={k: Moments.from_vector(v) for k, v in d["cosine"].items()},
            params={k: ParamStats(**{**v, "shape": tuple(v["shape"])}) for k, v in d["params"].items()},
            steps=int(d["steps"]),
            inv_ms={k: Moments.from_vector(v) for k, v in d.get("inv_ms", {}).items()},
            norm_back={k: Moments.from_vector(v) for k, v in d.get("norm_back", {}).items()},
            flat={k: [float(x) for x in v] for k, v in d.get("flat", {}).items()},
        )
