"""Markers and time limits by test tier (pyproject.toml declares the markers; --strict-markers refuses others).

tests/unit: CPU, hand-computed numbers, 5 minutes per test at most.
tests/distributed: several ranks (torchrun, mpirun, gloo); tests/e2e: the real CLI with real engines;
tests/gpu: needs a GPU. These keep the default limit (pyproject.toml) or set their own.
"""
from pathlib import Path

import pytest

TIERS = {"unit": None, "e2e": pytest.mark.e2e, "distributed": pytest.mark.distributed, "gpu": pytest.mark.gpu}
UNIT_TIMEOUT_S = 300


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        tier = Path(item.fspath).relative_to(root).parts[0]
        mark = TIERS.get(tier)
        if mark is not None:
            item.add_marker(mark)
        if tier in ("e2e", "distributed"):
            item.add_marker(pytest.mark.slow)
        if tier == "unit" and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))
