"""Test-run settings shared by tests/ and props/: one torch thread per process, hypothesis profiles.

Hypothesis profiles ``ci`` (the default) and ``thorough`` are defined in
:mod:`props.profiles`; choose with HYPOTHESIS_PROFILE=thorough.
"""

import torch

from props.profiles import register_profiles

# The default run uses pytest-xdist with one worker per core; torch's own threads
# on top would oversubscribe the cores.
torch.set_num_threads(1)

register_profiles()
