"""GCS fault tolerance with an external Redis (V4_REDIS_*): a real redis-server with a password and a real local Ray.
`up` starts the head's GCS against the Redis under this cluster's prefix, the password reaching Ray from a 0600
file and never from the script's text; a head killed without `down` comes back from that state with the next `up`;
`down` removes the state from the Redis, and the password file."""
from __future__ import annotations

import json
import secrets
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import free_port
from launcher import cluster
from launcher.config import Selection, resolve

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (.ci/run installs it)")



@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    port, password = free_port(), secrets.token_urlsafe(16)
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password,
                             "--save", "", "--appendonly", "no", "--dir", str(d)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if cli(port, password, "ping").strip() == "PONG":
                break
            time.sleep(0.1)
        yield port, password
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def cli(port: int, password: str, *args: str) -> str:
    r = subprocess.run(["redis-cli", "-p", str(port), "-a", password, "--no-auth-warning", *args],
                       capture_output=True, text=True, timeout=30)
    return r.stdout


def test_up_keeps_the_gcs_state_in_redis_and_down_removes_it(redis, tmp_path):
    port, password = redis
    local = Path(f"/tmp/v4red-{tmp_path.name[-6:]}")           # short: Ray's AF_UNIX socket paths live below it
    sets = (f"V4_RAY_PORT={free_port()}", f"V4_DASHBOARD_PORT={free_port()}", f"V4_DIST_PORT={free_port()}",
            f"V4_WORK={tmp_path / 'work'}", f"V4_LOCAL_DIR={local}", "V4_RAY_NUM_CPUS=1",
            "V4_REDIS_HOST=127.0.0.1", f"V4_REDIS_PORT={port}", f"V4_REDIS_PASSWORD={password}")
    cfg = resolve(Selection(cluster="local", hw="cpu", sets=sets))
    ns = cluster.redis_namespace(cfg)
    head = cluster.cluster_commands(cfg)[0]
    assert password not in head.start and "--redis-password" in head.start and f"RAY_REDIS_ADDRESS=127.0.0.1:{port}" \
        in head.start
    said: list[str] = []
    try:
        st = cluster.up(cfg, progress=said.append)
        assert st.healthy, st.problems
        pw_file = Path(cluster.redis_password_path(cfg, "127.0.0.1"))
        assert stat.S_IMODE(pw_file.stat().st_mode) == 0o600 and pw_file.read_text() == password
        keys = cli(port, password, "--scan").split()
        assert keys and all(ns in k for k in keys), keys                # the GCS writes under this cluster's prefix
        assert not any(password in line for line in said)
        # the head dies without `down` (kill -9): the next `up` starts a head whose GCS takes up the state in Redis
        rec = json.loads(Path(head.state_dir, "ray_procs.json").read_text())
        for p in rec["procs"]:
            subprocess.run(["kill", "-9", str(p["pid"])], check=False)
        time.sleep(2)
        assert not cluster.status(cfg).healthy
        again = cluster.up(cfg, progress=said.append)
        assert again.healthy and again.changed, again.problems
        assert [k for k in cli(port, password, "--scan").split() if ns in k]
    finally:
        reports = cluster.down(cfg, progress=said.append)
        subprocess.run(["rm", "-rf", str(local)])
    assert all(r["ok"] for r in reports), reports
    assert reports[0]["redis_cleared"] == ns and cli(port, password, "--scan").split() == []
    assert not pw_file.exists()
