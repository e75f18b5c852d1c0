"""Judgement: every verdict, cause, severity and threshold, one-shot and over time.

It judges and does nothing else: the jobs that measure, predict and then ask for a
judgement live in :mod:`diagnostics.jobs`. One concept a module:

* :mod:`.thresholds` — :class:`Thresholds`, every verdict's threshold;
* :mod:`.symptoms` — the readings past a threshold (:func:`~.symptoms.growth`: a stream's shape);
* :mod:`.evidence` — the measurements that tell the causes apart;
* :mod:`.causes` — each symptom to its cause, one finding per cause (``CAUSES``, ``SEVERITIES``);
* :mod:`.verdicts` — :func:`judge`, the pipeline over them;
* :mod:`.coverage` — :func:`coverage`, what could and could not be judged.
"""

from .coverage import coverage
from .thresholds import Thresholds
from .verdicts import judge

__all__ = ["Thresholds", "judge", "coverage"]
