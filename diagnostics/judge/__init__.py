"""Judgement: every verdict and threshold, and the jobs that measure, predict and judge.

* :mod:`.verdicts` — the thresholds and the rules that turn measurements into findings;
* :mod:`.diagnose` — probe + theory + verdicts on one model;
* :mod:`.compare` — init schemes side by side over depth and width;
* :mod:`.watch` — per-step records and verdicts during training (a training loop's monitor).
"""

from .compare import compare
from .diagnose import diagnose
from .verdicts import Thresholds, judge
from .watch import History, Watch, WatchEvent, WatchFailure, WatchStop

__all__ = ["diagnose", "compare", "Thresholds", "judge", "Watch", "WatchEvent", "WatchFailure", "WatchStop", "History"]
