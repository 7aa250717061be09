"""Shared by the pipeline tests: a free port, and one local Ray cluster for the tests whose steps run as Ray jobs.

Those runs bring the cluster up themselves (a run's `cluster up` step is a no-op on a healthy cluster) on ports and
under a state directory of the session's own -- not the checkout's local cluster (envs/cluster/local.env, its ports
picked once per checkout), which tests/pipeline/test_smoke_pipeline.py runs on as a user does, and not another pytest
session's. Each module keeps a V4_WORK of its own (runs, models, data); the cluster is stopped once, after the last
test: a Ray start costs a 2-core machine ~13 CPU-seconds (~5 s to ready, then its dashboard's modules warming up),
an idle cluster ~5 % of one core."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sets_to_flags(*sets: str) -> tuple[str, ...]:
    return tuple(x for s in sets for x in ("--set", s))


@pytest.fixture(scope="session")
def local_ray(tmp_path_factory):
    """The `--set` flags of the shared local Ray: V4_LOCAL_DIR (its state; short, for Ray's AF_UNIX socket paths, and
    made by mkdtemp, so that two pytest sessions never share one) and its ports. Pass V4_WORK beside them."""
    local = tempfile.mkdtemp(prefix="v4p-", dir="/tmp")
    flags = sets_to_flags(f"V4_LOCAL_DIR={local}", "V4_RAY_NUM_CPUS=3", f"V4_RAY_PORT={free_port()}",
                          f"V4_DASHBOARD_PORT={free_port()}", f"V4_RAY_CLIENT_PORT={free_port()}",
                          f"V4_DIST_PORT={free_port()}")
    yield flags
    work = tmp_path_factory.mktemp("ray-down")
    subprocess.run([sys.executable, "-m", "launcher", "cluster", "down", "--hw", "cpu", "--set", f"V4_WORK={work}",
                    *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
    shutil.rmtree(local, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_work(tmp_path_factory, local_ray, request):
    """(work directory, flags): one V4_WORK for the module (its later runs reuse the generated and converted
    checkpoint of the first) and the flags that put its runs there and on the shared local Ray."""
    work = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2].removeprefix("test_"))
    return work, ("--set", f"V4_WORK={work}", *local_ray)
