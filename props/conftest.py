"""pytest settings of the property suite, usable without the repository's root conftest.

* Hypothesis profiles ``ci`` (default) and ``thorough`` from :mod:`props.profiles`, as the
  repository's root conftest registers them, so ``pytest --pyargs props`` on an installed
  copy behaves the same.
* ``TINYLM_PROPS_NO_SHRINK=1`` (set by the mutation check) turns off shrinking of failing examples.
* Registers the ``prop``, ``slow`` and ``tinylm_only`` markers and the :class:`props.plugin.PropsPlugin`.
* The session fixture ``impl``: the implementation under test (TINYLM_PROPS_IMPL).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import Phase, settings

from props.impl import Implementation, current
from props.plugin import PLUGIN_NAME, RESULTS_ENV, PropsPlugin
from props.profiles import register_profiles



register_profiles()  # the same call as the root conftest's, so an installed copy behaves alike

if os.environ.get("TINYLM_PROPS_NO_SHRINK"):  # the mutation check: a failure is a kill, its smallest example is not needed
    settings.register_profile(
        "no-shrink", parent=settings.default, phases=[Phase.explicit, Phase.reuse, Phase.generate]
    )
    settings.load_profile("no-shrink")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "prop(claim, needs, alpha): a numerics property of the suite")
    config.addinivalue_line("markers", "slow: thorough variants left out of the default run")
    config.addinivalue_line(
        "markers", "tinylm_only: a test of tinylm's own contract, left out when another implementation is under test"
    )
    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(PropsPlugin(os.environ.get(RESULTS_ENV) or None), PLUGIN_NAME)


@pytest.fixture(scope="session")
def impl() -> Implementation:
    """The implementation under test (tinylm unless TINYLM_PROPS_IMPL names another)."""
    return current()
