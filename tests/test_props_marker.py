"""The tinylm_only marker: tests of tinylm's own contract are left out when another implementation is under test."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from props import plugin
from props.impl import Implementation, TinyLMImpl


class Item:
    def __init__(self, name: str, marks: tuple[str, ...]):
        self.name, self.marks = name, marks

    def get_closest_marker(self, name: str):
        return SimpleNamespace(name=name) if name in self.marks else None


def _collect(monkeypatch, impl_name: str) -> tuple[list[str], list[str]]:
    monkeypatch.setattr(plugin, "current", lambda: Implementation(TinyLMImpl(), impl_name))
    deselected: list = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    items = [Item("a", ("prop",)), Item("b", ("prop", plugin.TINYLM_ONLY)), Item("c", (plugin.TINYLM_ONLY, "slow")),
             Item("d", ())]
    plugin.PropsPlugin().pytest_collection_modifyitems(config, items)
    return [i.name for i in items], [i.name for i in deselected]


def test_another_implementation_runs_without_the_tinylm_only_tests(monkeypatch):
    assert _collect(monkeypatch, "mylm_props") == (["a", "d"], ["b", "c"])


def test_tinylm_runs_them_all(monkeypatch):
    assert _collect(monkeypatch, "tinylm") == (["a", "b", "c", "d"], [])


@pytest.mark.parametrize("module", ["test_config", "test_checkpoint", "test_data", "test_memory", "test_plan",
                                    "test_reference", "test_train"])
def test_contract_files_carry_the_marker(module):
    text = (Path(plugin.__file__).parent / f"{module}.py").read_text()
    assert f"pytestmark = pytest.mark.{plugin.TINYLM_ONLY}" in text
