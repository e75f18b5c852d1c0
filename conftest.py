"""Test-run settings shared by tests/ and props/: one torch thread per process, hypothesis profiles.

Hypothesis profiles: ``ci`` (the default: derandomized, no example database, no
deadline, so every run is the same and fast) and ``thorough`` (many more
examples, random). Choose with HYPOTHESIS_PROFILE=thorough.
"""

import os

import torch
from hypothesis import HealthCheck, settings

# The default run uses pytest-xdist with one worker per core; torch's own threads
# on top would oversubscribe the cores (one test went from 1.5 s to 45 s).
torch.set_num_threads(1)

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
    "thorough",
    derandomize=False,
    deadline=None,
    max_examples=500,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
