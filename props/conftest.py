"""pytest settings of the property suite, usable without the repository's root conftest.

* Hypothesis profiles ``ci`` (default) and ``thorough``: registered here only if no
  one registered them before (the repository's root conftest does, with the same
  values), so that ``pytest --pyargs props`` on an installed copy behaves the same.
* Registers the ``prop`` and ``slow`` markers and the :class:`props.plugin.PropsPlugin`.
* The session fixture ``impl``: the implementation under test (TINYLM_PROPS_IMPL).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.errors import InvalidArgument

from props.impl import Implementation, current
from props.plugin import PLUGIN_NAME, RESULTS_ENV, PropsPlugin

try:
    settings.get_profile("ci")
except InvalidArgument:  # no root conftest: register the same profiles it would
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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "prop(claim, needs, alpha): a numerics property of the suite")
    config.addinivalue_line("markers", "slow: thorough variants left out of the default run")
    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(PropsPlugin(os.environ.get(RESULTS_ENV) or None), PLUGIN_NAME)


@pytest.fixture(scope="session")
def impl() -> Implementation:
    """The implementation under test (tinylm unless TINYLM_PROPS_IMPL names another)."""
    return current()
