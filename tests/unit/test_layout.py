"""The test tree's layout: pytest imports test files by basename (no packages), so two test modules with
the same file name in different folders make the whole collection fail."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def test_test_module_names_are_unique():
    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], "rename one of each pair"
