"""Shared test set-up.

The simulated device count must be fixed before jax is imported anywhere in the test
process, so it is set here, at collection time.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true", help="rewrite golden files from current output")


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))
