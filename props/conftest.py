"""pytest settings of the property suite, usable without the repository's root conftest.

* Hypothesis profiles ``ci`` (default) and ``thorough``: registered here only if no
  one registered them before (the repository's root conftest does, with the same
  values), so that ``pytest --pyargs props`` on an installed copy behaves the same.
* ``TINYLM_PROPS_NO_SHRINK=1`` (set by the mutation check) turns off shrinking of failing examples.
* Registers the ``prop`` and ``slow`` markers and the :class:`props.plugin.PropsPlugin`.
* The session fixture ``impl``: the implementation under test (TINYLM_PROPS_IMPL).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import InvalidArgument

from props.impl import Implementation, current
from props.plugin import PLUGIN_NAME, RESULTS_ENV, PropsPlugin



def _project_profiles_registered() -> bool:
    """True when someone (the repository's root conftest) registered the project's ``ci`` profile.

    Recent hypothesis versions ship a built-in ``ci`` profile (100 examples, loaded
    automatically when CI is set); the project's has 25 examples.
    """
    try:
        return settings.get_profile("ci").max_examples != 100
    except InvalidArgument:
        return False


if not _project_profiles_registered():  # no root conftest (an installed copy): the same profiles it registers
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

if os.environ.get("TINYLM_PROPS_NO_SHRINK"):  # the mutation check: a failure is a kill, its smallest example is not needed
    settings.register_profile(
        "no-shrink", parent=settings.default, phases=[Phase.explicit, Phase.reuse, Phase.generate]
    )
    settings.load_profile("no-shrink")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "prop(claim, needs, alpha): a numerics property of the suite")
    config.addinivalue_line("markers", "slow: thorough variants left out of the default run")
    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(PropsPlugin(os.environ.get(RESULTS_ENV) or None), PLUGIN_NAME)


@pytest.fixture(scope="session")
def impl() -> Implementation:
    """The implementation under test (tinylm unless TINYLM_PROPS_IMPL names another)."""
    return current()
