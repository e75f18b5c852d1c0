"""The jobs: short pipelines of named stages over measure, theory and judge.

* :mod:`.diagnose` — probe + theory + verdicts on one model;
* :mod:`.compare` — init schemes side by side over depth and width;
* :mod:`.watch` — per-step records and verdicts during training (a training loop's monitor).
"""

from .compare import compare
from .diagnose import diagnose
from .watch import History, Watch, WatchEvent, WatchFailure, WatchStop

__all__ = ["diagnose", "compare", "Watch", "WatchEvent", "WatchFailure", "WatchStop", "History"]
