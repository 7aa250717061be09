"""`ray_procs stop` with real processes: a daemon that carries the session token and a child it starts with
a clean environment, standing in for raylet's dashboard and runtime-env agents (whose /proc environ does
not always show the token; then only the process tree ties them to us)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import tagged_pids
from launcher.node_scripts import ray_procs

# The "daemon": starts a child with an empty environment, writes the child's PID, then sleeps.
DAEMON = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env={})
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def _ray_procs(action: str, state: Path) -> dict:
    out = subprocess.run([sys.executable, ray_procs.__file__, action, str(state)], capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_stop_takes_what_the_daemons_started_without_the_token(tmp_path):
    token = f"v4-test-{os.getpid()}-{time.monotonic_ns()}"
    (tmp_path / "ray.session").write_text(token + "\n")
    child_file = tmp_path / "child.pid"
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON, str(child_file)],
                              env={**os.environ, "V4_RAY_SESSION": token})
    pids = [daemon.pid]
    try:
        deadline = time.time() + 30
        while not child_file.exists() or not child_file.read_text():
            assert time.time() < deadline and daemon.poll() is None, "the daemon did not start its child"
            time.sleep(0.05)
        pids.append(int(child_file.read_text()))
        procs = [{"pid": p, "start": ray_procs.proc_start(p)} for p in pids]
        assert tagged_pids(f"V4_RAY_SESSION={token}") == [daemon.pid], "only the daemon carries the token"

        rec = _ray_procs("record", tmp_path)
        assert [p["pid"] for p in rec["procs"]] == [daemon.pid]
        report = _ray_procs("stop", tmp_path)
        daemon.wait(timeout=10)
        assert report["remaining"] == []
        assert [p["pid"] for p in procs if ray_procs.alive(p)] == [], "a process the daemon started outlived `stop`"
        assert (tmp_path / "ray_procs.json.stopped").exists()
    finally:
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        daemon.wait(timeout=10)
