"""diagnostics: measurement, prediction and judgement of per-layer variance, for any nn.Module.

Four sub-packages, one concept each:

* :mod:`diagnostics.measure` — ``probe`` and the mergeable moments it records;
* :mod:`diagnostics.theory` — ``predict``: theory's moments beside every measured one;
* :mod:`diagnostics.judge` — verdicts, causes and thresholds; it judges and does nothing else;
* :mod:`diagnostics.jobs` — pipelines over the three: ``diagnose`` (one model), ``compare``
  (init schemes side by side), ``Watch`` (training), ``diff`` (where two executions of one
  model part ways), ``fingerprint`` (one execution, sketched, for a diff across machines),
  ``replay`` (a training step run twice, compared site by site; ``StepReplay`` in a watched
  loop) and ``check_replicas`` (data-parallel replicas compared in one collective).

The results of those jobs share one schema (:mod:`diagnostics.result`); their options
are :mod:`diagnostics.options` (``DiagnoseOptions``, ``CompareOptions``); their intervals over
replicates are :mod:`diagnostics.measure.intervals`. See diagnostics/API.md.
"""

from __future__ import annotations

import warnings
from typing import Any

from .jobs import History, Watch, WatchEvent, WatchFailure, WatchReport, WatchStop, compare, diagnose
from .jobs.coord_check import CoordCheckOptions, CoordCheckResult, coord_check
from .jobs.diff import DiffResult, diff, diff_against
from .jobs.fingerprint import Fingerprint, fingerprint
from .jobs.replay import ReplayOptions, ReplayResult, replay
from .jobs.replicas import ReplicaResult, check_replicas
from .jobs.watch_replay import StepReplay
from .jobs.precision import PrecisionOptions, precision
from .jobs.precision_result import PrecisionResult
from .jobs.watch_precision import PrecisionWatch
from .judge import Thresholds
from .measure import AttnMoments, Moments, ParamStats, ProbeRun, ProbeStats, instrument_points, merge_distributed, probe
from .measure.intervals import CONFIDENCE, interval_scope, log_t_interval, t_interval
from .options import CompareOptions, DiagnoseOptions, DiffOptions, OptionsError, ProbeOptions
from .result import (
    SCHEMA_VERSION,
    AttentionRow,
    DepthRow,
    DiagnoseResult,
    Finding,
    Header,
    ParamRow,
    TensorRow,
)
from .theory import Prediction, predict

__all__ = [
    "diagnose",
    "compare",
    "merge_distributed",
    "Thresholds",
    "predict",
    "Prediction",
    "probe",
    "ProbeRun",
    "instrument_points",
    "Moments",
    "AttnMoments",
    "ParamStats",
    "ProbeStats",
    "DiagnoseOptions",
    "CompareOptions",
    "ProbeOptions",
    "OptionsError",
    "SCHEMA_VERSION",
    "AttentionRow",
    "DepthRow",
    "DiagnoseResult",
    "Finding",
    "Header",
    "ParamRow",
    "TensorRow",
    "Watch",
    "WatchEvent",
    "WatchFailure",
    "WatchReport",
    "WatchStop",
    "History",
    "CONFIDENCE",
    "t_interval",
    "log_t_interval",
    "interval_scope",
    "diff",
    "diff_against",
    "DiffOptions",
    "DiffResult",
    "fingerprint",
    "Fingerprint",
    "coord_check",
    "CoordCheckOptions",
    "CoordCheckResult",
    "replay",
    "ReplayOptions",
    "ReplayResult",
    "StepReplay",
    "check_replicas",
    "ReplicaResult",
    "precision",
    "PrecisionOptions",
    "PrecisionResult",
    "PrecisionWatch",
]

# Names that moved to tinylm (the training loop belongs with the model); still importable
# from here, with a DeprecationWarning that names the new home.
_MOVED = {
    "TrainError": "tinylm.train",
    "TrainOptions": "tinylm.train",
    "TrainResult": "tinylm.train",
    "lr_schedule": "tinylm.train",
    "load_training": "tinylm.train",
}


def __getattr__(name: str) -> Any:
    if name == "train":
        warnings.warn("diagnostics.train moved to tinylm.train.train; pass monitor=diagnostics.Watch(model, ...)",
                      DeprecationWarning, stacklevel=2)
        from .jobs.watch import train_watched

        return train_watched
    if name in _MOVED:
        import importlib

        home = _MOVED[name]
        warnings.warn(f"diagnostics.{name} moved to {home}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'diagnostics' has no attribute {name!r}")
