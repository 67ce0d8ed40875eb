"""Markers by what a test does, so that ``make test-fast`` (``-m "not multirank and not slow"``)
starts no ranks: every test under ``tests/multirank`` and every test that uses a fixture which
starts ranks is marked ``multirank`` (a whole command run end to end is marked ``slow`` where it
is written)."""

from __future__ import annotations

from pathlib import Path

import pytest

MULTIRANK_DIR = Path(__file__).resolve().parent / "multirank"
#: Fixtures that start Gloo ranks (tests/unit/test_gradient_study.py captures gradients on 2).
RANK_FIXTURES = {"captured"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        in_dir = MULTIRANK_DIR in Path(str(item.fspath)).resolve().parents
        if in_dir or RANK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multirank)
