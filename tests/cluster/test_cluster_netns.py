"""`cluster up | status | down` on three SSH hosts (network namespaces), with real Ray.

The tests share one cluster and run in file order: up -> up again -> kill a raylet -> heal ->
down next to a foreign Ray.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tagged_pids
from launcher import cluster

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]


def v4(cfg, *args, check=True) -> subprocess.CompletedProcess:
    """The real CLI, as a user runs it, against the test cluster's env file."""
    r = subprocess.run([sys.executable, "-m", "launcher", *args, "--cluster", cfg.selection.cluster, "--hw", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, f"v4 {' '.join(args)} -> {r.returncode}\n{r.stderr[-3000:]}"
    return r


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def ray_up(netns_cluster, netns_cfg):
    try:
        yield cluster.up(netns_cfg)
    finally:
        cluster.down(netns_cfg)


def test_up_reaches_readiness_with_three_nodes(netns_cluster, netns_cfg, ray_up):
    st = ray_up
    assert st.healthy, st.problems
    assert st.changed
    assert [n.ip for n in st.nodes] == [h.ip for h in netns_cluster.hosts]
    assert [n.gcs_state for n in st.nodes] == ["ALIVE"] * 3
    assert [n.hostname for n in st.nodes] == [h.hostname for h in netns_cluster.hosts]
    assert all(n.resources["CPU"] == 1 and n.resources.get("GPU", 0) == 0 for n in st.nodes)
    assert all(n.proc("raylet") and n.proc("raylet")["alive"] for n in st.nodes)
    assert st.nodes[0].proc("gcs_server")["alive"] and st.dashboard_ok


def test_up_twice_is_a_noop(netns_cfg, ray_up, capsys):
    before = {n.ip: n.proc("raylet")["pid"] for n in cluster.status(netns_cfg).nodes}
    st = cluster.up(netns_cfg)
    assert st.healthy and not st.changed
    assert "already up" in capsys.readouterr().err
    assert {n.ip: n.proc("raylet")["pid"] for n in st.nodes} == before


def test_probe_job_runs_across_the_nodes(netns_cluster, netns_cfg, ray_up):
    out = json.loads(v4(netns_cfg, "cluster", "probe", "--json").stdout)
    hosts = netns_cluster.hosts
    assert sorted(n["ip"] for n in out["nodes"]) == [h.ip for h in hosts]
    assert sorted(n["hostname"] for n in out["nodes"]) == [h.hostname for h in hosts]
    assert all(n["socket_ifname"] == f"v4eth{i}" for i, n in enumerate(sorted(out["nodes"], key=lambda n: n["ip"])))
    run_id, sid = out["run_id"], out["outcome"]["submission_id"]
    assert out["outcome"]["ok"] and out["outcome"]["exit_code"] == 0
    # the registry tracked it ...
    runs = json.loads(v4(netns_cfg, "runs", "ls", "--json").stdout)["runs"]
    assert [r["status"] for r in runs if r["id"] == run_id] == ["passed"]
    show = json.loads(v4(netns_cfg, "runs", "show", run_id[:-2], "--json").stdout)
    assert show["steps"][0]["name"] == "probe" and show["steps"][0]["submission_id"] == sid
    assert "V4_PROBE" in v4(netns_cfg, "runs", "logs", run_id).stdout
    manifest = json.loads((Path(show["dir"]) / "manifest.json").read_text())
    assert manifest["config"]["values"]["V4_MASTER_IP"] == hosts[0].ip and manifest["code"]["sha"]
    # ... and so does the cluster
    st = json.loads(v4(netns_cfg, "cluster", "status", "--json").stdout)
    assert st["healthy"] and [j["status"] for j in st["jobs"] if j["submission_id"] == sid] == ["SUCCEEDED"]


def test_killed_worker_raylet_shows_in_status_and_up_heals_it(netns_cluster, netns_cfg, ray_up):
    victim = cluster.status(netns_cfg).nodes[2]
    pid = victim.proc("raylet")["pid"]
    os.kill(pid, signal.SIGKILL)
    st = cluster.status(netns_cfg)
    assert not st.healthy
    assert any(victim.ip in p and "raylet" in p for p in st.problems), st.problems
    assert [n.ip for n in st.nodes if not n.proc("raylet")["alive"]] == [victim.ip]
    r = v4(netns_cfg, "cluster", "status", check=False)
    assert r.returncode == 5 and f"pid {pid} DEAD" in r.stdout and "NOT healthy" in r.stdout
    healed = cluster.up(netns_cfg)              # restarts that worker only
    assert healed.healthy and healed.changed
    assert healed.nodes[0].proc("raylet")["pid"] == st.nodes[0].proc("raylet")["pid"]
    assert healed.nodes[2].proc("raylet")["pid"] != pid


def test_down_stops_only_what_it_started(netns_cluster, netns_cfg, ray_up, tmp_path):
    c = netns_cluster
    host = c.hosts[1]
    # A Ray this tool did not start, on the same host (own port, temp dir and tag).
    foreign_tmp = c.root / "foreign"
    env = dict(os.environ, FOREIGN_RAY="1", PATH=os.path.dirname(sys.executable) + ":" + os.environ["PATH"])
    r = subprocess.run(["ip", "netns", "exec", host.ns, sys.executable, "-m", "ray.scripts.scripts", "start",
                        "--head", f"--node-ip-address={host.ip}", "--port=6999", "--include-dashboard=false",
                        "--num-cpus=1", "--num-gpus=0", f"--temp-dir={foreign_tmp}",
                        "--dashboard-agent-listen-port=0", "--disable-usage-stats"],
                       env=env, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert r.returncode == 0, r.stderr[-2000:]
    foreign = tagged_pids("FOREIGN_RAY=")
    try:
        assert any("raylet" in open(f"/proc/{p}/comm").read() for p in foreign)
        ours = tagged_pids("V4_RAY_SESSION=v4-netns-")
        assert len(ours) >= 3 * 3
        reports = cluster.down(netns_cfg)
        assert [rep["ok"] for rep in reports] == [True] * 3, reports
        # each node's daemons signalled one after another end on SIGTERM (ray_procs.STOP_ORDER)
        assert [rep["killed"] for rep in reports] == [[]] * 3, reports
        time.sleep(0.5)
        assert [p for p in ours if _alive(p)] == [], "a process started by `up` survived `down`"
        assert tagged_pids("V4_RAY_SESSION=v4-netns-") == []
        assert all(_alive(p) for p in foreign), "down touched a Ray it did not start"
        st = cluster.status(netns_cfg)
        assert not st.healthy and not st.gcs_ok
        assert not any(n.recorded for n in st.nodes)
    finally:
        for p in tagged_pids("FOREIGN_RAY="):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
