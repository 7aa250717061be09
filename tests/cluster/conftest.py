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


def free_port() -> int:
    """A TCP port free on this machine now (for a local Ray's GCS, dashboard, rendezvous; a test's Redis)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _proc_env_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return False


def tagged_pids(prefix: str) -> list[int]:
    """PIDs whose environment has a variable assignment starting with `prefix` (e.g. V4_RAY_SESSION=v4-netns)."""
    import os
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if any(e.startswith(prefix.encode()) for e in env):
                out.append(int(d))
    return out


@pytest.fixture(scope="session")
def netns_cfg(netns_cluster):
    """The resolved configuration of the 3-host test cluster (hw=cpu)."""
    from launcher.config import Selection, resolve
    path = netns_cluster.env_file()
    return resolve(Selection(cluster=str(path), hw="cpu"))
