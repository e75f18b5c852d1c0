"""Per-GEMM SQNR over training, for one recipe: fp8 divergence comes late, so the trend matters.

    trend = PrecisionTrend("tensorwise", drop_db=6.0)
    for step, batch in enumerate(loader):
        ...
        if step % 50 == 0:
            for alert in trend.record(step, model, batch):   # one precision() pass, theory off
                print(alert)

Each record keeps, per module and GEMM, the SQNR judged (the lower of the output's and its
typical row's) and the worst operand's peak/median (the precursor: massive activations and the
SwiGLU product's growth show there first). An alert is raised when a GEMM's SQNR has fallen by
more than ``drop_db`` from its own first record, once per GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .precision import PrecisionOptions, precision
from .precision_result import PrecisionResult

__all__ = ["PrecisionTrend", "TrendAlert"]


@dataclass(frozen=True)
class TrendAlert:
    step: int
    module: str
    gemm: str
    start_db: float
    now_db: float
    peak_to_median: float

    def __str__(self) -> str:
        return (f"step {self.step}: {self.module} ({self.gemm}) SQNR fell {self.start_db - self.now_db:.1f} dB since "
                f"its first record ({self.start_db:.1f} -> {self.now_db:.1f} dB); its worst operand's peak is "
                f"{self.peak_to_median:.2g}x its median")


@dataclass
class PrecisionTrend:
    """SQNR per (module, GEMM) over steps for ``recipe``; ``rows`` tidy (step, module, gemm, sqnr_db,
    peak_to_median); ``alerts`` raised so far."""

    recipe: str = "tensorwise"
    drop_db: float = 6.0
    batch_size: int = 4
    seq_len: int | None = None
    rows: list[tuple[int, str, str, float, float]] = field(default_factory=list)
    alerts: list[TrendAlert] = field(default_factory=list)
    _start: dict = field(default_factory=dict, repr=False)

    def record(self, step: int, model, tokens=None) -> list[TrendAlert]:
        """Measure ``model`` on ``tokens`` (precision's conventions) and add the result (:meth:`add`)."""
        options = PrecisionOptions(recipes=(self.recipe,), batch_size=self.batch_size, seq_len=self.seq_len,
                                   theory=False)
        return self.add(step, precision(model, tokens, options))

    def add(self, step: int, result: PrecisionResult) -> list[TrendAlert]:
        """Add one result's rows of this recipe; the new alerts."""
        new = []
        alerted = {(a.module, a.gemm) for a in self.alerts}
        for r in result.rows:
            if r.recipe != self.recipe:
                continue
            db = min(r.sqnr_db, r.row_sqnr_db)
            self.rows.append((step, r.module, r.gemm, db, r.peak_to_median))
            key = (r.module, r.gemm)
            start = self._start.setdefault(key, db)
            if key not in alerted and start - db > self.drop_db:
                new.append(TrendAlert(step, r.module, r.gemm, start, db, r.peak_to_median))
        self.alerts += new
        return new

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows, columns=["step", "module", "gemm", "sqnr_db", "peak_to_median"])
