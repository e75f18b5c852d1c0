"""The project's hypothesis profiles, in one place.

``ci`` (the default): derandomized, no example database, no deadline, 25 examples,
so every run is the same and fast. ``thorough``: 500 random examples. Choose with
HYPOTHESIS_PROFILE=thorough. Recent hypothesis versions ship a built-in ``ci``
profile (100 examples, loaded when CI is set); registering ours replaces it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def register_profiles() -> None:
    """Register ``ci`` and ``thorough`` and load the one HYPOTHESIS_PROFILE names (default ci)."""
    settings.register_profile(
        "ci",
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=25,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile(
        "thorough", derandomize=False, deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
