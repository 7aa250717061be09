"""`v4 bootstrap` with a worker that fails preflight, on three SSH hosts (network namespaces with real sshd and real
Ray; launcher/commands/bootstrap.py, docs/resilience.md). Host 2 sees an empty directory of its own at V4_WORK (a
bind mount in its sshd's mount namespace), so `shared_work` fails there:
1. without a flag the checklist stops at preflight naming host 2 and its check, and prints the command that goes on
   without it;
2. that command (`--exclude-bad-nodes`) continues at preflight, leaves host 2 out (recorded in the checklist's state
   and the cluster's quarantine record) and brings Ray up on the other two, its command carrying the roster;
   (the head's failure, the floor and the listing: tests/launcher/test_bootstrap_roster.py, without hosts)
3. host 2 fixed, `--from preflight` checks it again and takes it back."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port
from launcher import cluster
from launcher.config import Selection, resolve
from launcher.recovery import quarantined

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]


def v4(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_bootstrap_goes_on_without_a_failing_worker(netns_cluster, tmp_path):
    c = netns_cluster
    head, w1, w2 = c.hosts
    # a cluster name of its own: its checklist state and quarantine record are not the other netns tests'
    path = c.env_file(c.root / "bsexclude.env", V4_CLUSTER_NAME="bsexclude", V4_RAY_PORT=free_port(),
                      V4_DASHBOARD_PORT=free_port(), V4_RAY_CLIENT_PORT=free_port(), V4_RAY_READY_TIMEOUT=180)
    flags = ("--cluster", str(path), "--hw", "cpu")
    private = tmp_path / "not_shared"
    private.mkdir()
    c.restart_sshd(w2, private_mounts=[(str(private), str(c.root / "work"))])
    t0 = time.monotonic()
    try:
        stop = v4("bootstrap", *flags, "--until", "up")
        t1 = time.monotonic()
        assert stop.returncode == 3, stop.stderr[-4000:]
        assert f"bootstrap stopped at step 3/4 (preflight, exit 3): preflight failed on {w2.ip} (" in stop.stderr
        assert "shared_work" in stop.stderr.split("bootstrap stopped at")[1]
        assert head.ip not in stop.stderr.split("bootstrap stopped at")[1]       # the head passed: not named
        go_on = f"v4 bootstrap --cluster {path} --hw cpu --exclude-bad-nodes      (goes on without the workers"
        assert go_on in stop.stderr, stop.stderr[-2000:]

        r = v4("bootstrap", *flags, "--until", "up", "--exclude-bad-nodes")
        t2 = time.monotonic()
        assert r.returncode == 0, r.stderr[-6000:]
        assert "[2/4] ssh: passed" in r.stderr                                 # continued where it stopped
        assert f"  leaving out {w2.ip}: shared_work: " in r.stderr
        assert f"  going on with 2 node(s): {head.ip} {w1.ip}" in r.stderr
        assert (f"[4/4] up: Ray head and workers; ready when the GCS reports every node\n"
                f"  $ v4 cluster up --cluster {path} --hw cpu --set V4_WORKER_IPS={w1.ip} --set V4_NUM_NODES=2"
                ) in r.stderr, r.stderr[-3000:]
        assert f"bootstrap of bsexclude passed up to up without {w2.ip}; next: v4 bootstrap --cluster {path}" \
            in r.stderr
        assert f"left out: {w2.ip} (preflight: shared_work: " in r.stderr
        assert f"check and take it back: v4 bootstrap --cluster {path} --hw cpu --from preflight" in r.stderr
        state = json.loads((c.root / "work/.v4-bootstrap/bsexclude.json").read_text())
        assert state["steps"]["preflight"]["status"] == "passed" and state["steps"]["preflight"]["left_out"] == [w2.ip]
        assert [(e["ip"], e["step"], "shared_work" in e["checks"]) for e in state["left_out"]] == [
            (w2.ip, "preflight", True)]
        small = resolve(Selection(cluster=str(path), hw="cpu",
                                  sets=(f"V4_WORKER_IPS={w1.ip}", "V4_NUM_NODES=2")))
        st = cluster.status(small)
        assert st.healthy and [n.ip for n in st.nodes] == [head.ip, w1.ip]
        # the cluster's quarantine record (what `v4 cluster status` prints under "left out by runs")
        assert [(e.ip, e.run, e.by) for e in quarantined(small).values()] == [(w2.ip, "bootstrap", "preflight")]
    finally:
        c.restart_sshd(w2)
    back = v4("bootstrap", *flags, "--from", "preflight", "--until", "preflight")
    t3 = time.monotonic()
    try:
        assert back.returncode == 0, back.stderr[-4000:]
        assert f"[preflight] {w2.ip} passes again: no longer left out (run bootstrap left it out: " in back.stderr
        assert f"bootstrap of bsexclude passed up to preflight; next:" in back.stderr
        state = json.loads((c.root / "work/.v4-bootstrap/bsexclude.json").read_text())
        assert state["left_out"] == [] and "left_out" not in state["steps"]["preflight"]
        assert quarantined(small) == {}
    finally:
        cluster.down(resolve(Selection(cluster=str(path), hw="cpu")), progress=lambda m: None)
    print(f"\nstopped at preflight naming {w2.ip}: {t1 - t0:.0f} s; going on without it through Ray up: "
          f"{t2 - t1:.0f} s; taken back by --from preflight: {t3 - t2:.0f} s")
