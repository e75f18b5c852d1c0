"""diagnostics: model-agnostic measurement of per-layer activation and gradient variance.

``probe`` measures, ``theory`` predicts, ``verdicts`` judge, ``diagnose`` does all
three, ``compare`` runs init schemes side by side, ``train`` trains a model while a
``Watch`` records per-layer statistics. See diagnostics/API.md.
"""

from .compare import compare
from .diagnose import diagnose
from .distributed import merge_distributed
from .options import DiagnoseOptions, OptionsError, ProbeOptions
from .probe import ProbeRun, instrument_points, probe
from .stats import AttnMoments, Moments, ParamStats, ProbeStats
from .theory import Prediction, predict
from .train import TrainError, TrainOptions, TrainResult, load_training, lr_schedule, train
from .watch import Watch, WatchEvent
from .verdicts import Thresholds
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
    "train",
    "TrainOptions",
    "TrainResult",
    "TrainError",
    "lr_schedule",
    "load_training",
    "Watch",
    "WatchEvent",
]
