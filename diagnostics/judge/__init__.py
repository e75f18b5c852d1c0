"""Judgement: every verdict, cause, severity and threshold, one-shot and over time.

It judges and does nothing else: the jobs that measure, predict and then ask for a
judgement live in :mod:`diagnostics.jobs`.
"""

from .verdicts import Thresholds, judge

__all__ = ["Thresholds", "judge"]
