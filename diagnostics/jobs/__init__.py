"""The jobs: short pipelines of named stages over measure, theory and judge.

* :mod:`.diagnose` — probe + theory + verdicts on one model;
* :mod:`.compare` — init schemes side by side over depth and width;
* :mod:`.watch` — per-step records during training (a training loop's monitor), judged as
  they come by :mod:`diagnostics.judge.over_time`;
* :mod:`.history` — the watch's history: its format, its checks, its tidy rows, and
  :class:`History`, which holds its verdicts for whatever draws it.
* :mod:`.diff` — where two executions of one model part ways (sites sketched by :mod:`.fingerprint`).
* :mod:`.history_read`, :mod:`.runs_compare` — a run read back from what a watch wrote
  (``History.read``), two runs side by side (``History.compare``).
"""

from .compare import compare
from .diagnose import diagnose
from .diff import DiffResult, diff, diff_against
from .fingerprint import Fingerprint, fingerprint
from .history import History, check_history
from .history_read import read as _read
from .runs_compare import compare_runs as _compare_runs
from .watch import Watch, WatchEvent, WatchFailure, WatchReport, WatchStop, train_watched

History.read = staticmethod(_read)  # History.read(source): the history module imports neither job
History.compare = staticmethod(_compare_runs)  # History.compare(a, b, labels=None, alpha=1e-6)

__all__ = ["diagnose", "compare", "Watch", "WatchEvent", "WatchFailure", "WatchReport", "WatchStop", "History", "check_history",
           "train_watched", "diff", "diff_against", "DiffResult", "fingerprint", "Fingerprint"]
