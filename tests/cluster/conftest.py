"""Fixtures for the cluster tests: 3 network-namespace hosts with their own sshd (session-wide)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from netns import NetnsCluster, missing_requirements  # noqa: E402


@pytest.fixture(scope="session")
def netns_cluster():
    """Three hosts 10.200.N.2-4 on a bridge, torn down by PID and by namespace, even on failure."""
    why = missing_requirements()
    if why:
        pytest.skip(f"network-namespace hosts unavailable: {why}")
    c = NetnsCluster.create(3)
    try:
        yield c
    finally:
        c.teardown()
