"""The jobs: short pipelines of named stages over measure, theory and judge.

* :mod:`.diagnose` — probe + theory + verdicts on one model;
* :mod:`.compare` — init schemes side by side over depth and width;
* :mod:`.watch` — per-step records and verdicts during training (a training loop's monitor);
* :mod:`.diff` — where two executions of one model part ways (sites sketched by :mod:`.fingerprint`).
"""

from .compare import compare
from .diagnose import diagnose
from .diff import DiffResult, diff, diff_against
from .fingerprint import Fingerprint, fingerprint
from .watch import History, Watch, WatchEvent, WatchFailure, WatchStop

__all__ = ["diagnose", "compare", "Watch", "WatchEvent", "WatchFailure", "WatchStop", "History", "diff", "diff_against", "DiffResult",
           "fingerprint", "Fingerprint"]
